"""Prefix caching (``python -m minillm bench prefix``; chapter 08).

Three workloads on the real model, each served by :func:`minillm.course.ch04_workload.serve`
(Poisson arrivals on a virtual clock of measured step times):

- **shared system prompt**: ``num_requests`` requests, one system prompt of ``system_tokens``
  tokens (English prose, chat template) and a distinct question each, at a few request rates;
  without prefix caching, then with the hash cache and with the radix cache: TTFT (mean, p50,
  p90), output tokens/s, the prompt tokens found in the cache (hit rate);
- **multi-turn chat**: ``num_users`` conversations of ``turns`` turns, each turn's prompt the
  previous prompt + the reply + a new question, both cache kinds;
- **cache size**: four system prompts taking turns, the hash cache under pools of a few sizes
  (from room for one cached system prompt to all four): hit rate and TTFT against pool blocks.
"""
from __future__ import annotations

import os
import random
import statistics

import torch

from ..course.ch04_workload import poisson_arrivals, serve
from ..engine import EngineConfig, LLMEngine
from ..evaluate import sample_text
from .common import format_table, machine_info, percentile
from .throughput import Workload

QUESTIONS = ["What is the main idea?", "Summarise the second sentence.", "Who is speaking?",
             "List three keywords.", "What happens next?", "Is the tone formal?",
             "Translate the first line into French.", "What would you ask the author?"]


def shared_prompt_workload(tok, num_requests: int, system_tokens: int, seed: int = 0,
                           num_systems: int = 1) -> Workload:
    """System prompts of about ``system_tokens`` tokens (request i gets number
    i % num_systems), a different question each."""
    text = tok.encode(sample_text(num_systems * system_tokens + 64, tok))
    systems = [tok.decode(text[j * system_tokens:(j + 1) * system_tokens])
               for j in range(num_systems)]
    rng = random.Random(seed)
    prompts = []
    for i in range(num_requests):
        q = f"Question {i}: {rng.choice(QUESTIONS)}"
        prompts.append(tok.encode(tok.apply_chat_template(
            [{"role": "system", "content": systems[i % num_systems]},
             {"role": "user", "content": q}], add_generation_prompt=True)))
    return Workload(prompts, [16] * num_requests)


def run(model, tok, work: Workload, rate: float, seed: int, **options) -> dict:
    """Serve ``work`` at ``rate`` req/s; TTFT stats (s), throughput, prefix hit rate."""
    engine = LLMEngine(model, tok, EngineConfig(**options))
    res = serve(engine, work, arrivals=poisson_arrivals(len(work.prompts), rate, seed))
    ttft = [r.ttft for r in res.records]
    b = engine.blocks
    return {"ttft_mean": statistics.fmean(ttft), "ttft_p50": percentile(ttft, 50),
            "ttft_p90": percentile(ttft, 90), "output_tok_s": res.throughput,
            "hit_rate": b.prefix_hit / b.prefix_queried if b.prefix_queried else 0.0,
            "makespan": res.makespan}


def multi_turn(model, tok, users: int, turns: int, kind: str | None, seed: int = 0,
               **options) -> dict:
    """Each turn extends the conversation: prompt_t = prompt_{t-1} + reply + question."""
    engine = LLMEngine(model, tok, EngineConfig(enable_prefix_caching=kind is not None,
                                                prefix_cache=kind or "hash", **options))
    convs = [[{"role": "system", "content": sample_text(200 + 40 * u, tok)[-600:]}]
             for u in range(users)]
    rng, ttfts = random.Random(seed), []
    for _ in range(turns):
        prompts = []
        for conv in convs:
            conv.append({"role": "user", "content": rng.choice(QUESTIONS)})
            prompts.append(tok.encode(tok.apply_chat_template(conv, add_generation_prompt=True)))
        res = serve(engine, Workload(prompts, [24] * users))
        ttfts += [r.ttft for r in res.records]
        for conv, r in zip(convs, res.records):
            conv.append({"role": "assistant", "content": tok.decode(r.token_ids)})
    b = engine.blocks
    return {"ttft_mean": statistics.fmean(ttfts),
            "hit_rate": b.prefix_hit / b.prefix_queried if b.prefix_queried else 0.0}


def run_prefix_bench(model_name: str = "smollm2-135m", num_requests: int = 32,
                     system_tokens: int = 1000, rates: tuple[float, ...] = (0.5, 2.0, 8.0),
                     seed: int = 0, pool_blocks: tuple[int, ...] = (100, 170, 240, 640),
                     dtype=None) -> dict:
    """See the module docstring; the shared-prompt workload runs at every rate of ``rates``
    (req/s), the multi-turn one at its own pace, the cache sizes with 4 system prompts taking
    turns at the middle rate."""
    from ..checkpoint.loader import load_model
    from ..device import serving_dtype

    dtype, reason = serving_dtype(dtype, torch.device("cpu"))
    model, tok = load_model(model_name, dtype=dtype)
    work = shared_prompt_workload(tok, num_requests, system_tokens, seed)
    base = {"num_kv_blocks": 2048, "max_num_seqs": 32, "max_num_batched_tokens": 2048}
    load = [os.getloadavg()[0]]
    run(model, tok, Workload(work.prompts[:2], [4, 4]), 1.0, seed, **base)   # warm-up
    shared = {}
    for rate in rates:
        runs = {"none": run(model, tok, work, rate, seed, **base)}
        for kind in ("hash", "radix"):
            runs[kind] = run(model, tok, work, rate, seed, enable_prefix_caching=True,
                             prefix_cache=kind, **base)
        runs["ttft_ratio"] = runs["none"]["ttft_mean"] / runs["hash"]["ttft_mean"]
        runs["throughput_ratio"] = runs["hash"]["output_tok_s"] / runs["none"]["output_tok_s"]
        shared[str(rate)] = runs
    mid = rates[len(rates) // 2]
    turns = {k or "none": multi_turn(model, tok, 4, 4, k, seed, **base)
             for k in (None, "hash", "radix")}
    four = shared_prompt_workload(tok, num_requests, system_tokens, seed, num_systems=4)
    sizes = {n: run(model, tok, four, mid, seed, enable_prefix_caching=True,
                    **{**base, "num_kv_blocks": n}) for n in pool_blocks}
    load.append(os.getloadavg()[0])
    return {"machine": machine_info(torch.device("cpu"), torch.get_num_threads()),
            "dtype": str(dtype), "dtype_reason": reason, "load_average": load,
            "workload": {"num_requests": num_requests, "system_tokens": system_tokens,
                         "prompt_tokens": [len(p) for p in work.prompts], "rates": rates,
                         "system_blocks": len(work.prompts[0]) // base.get("block_size", 16)},
            "shared_prompt": shared, "multi_turn": turns,
            "cache_size": {str(n): r for n, r in sizes.items()}, "target_ttft_ratio": 10.0,
            "target_met_at": [r for r in rates if shared[str(r)]["ttft_ratio"] >= 10.0]}


def prefix_table(report: dict) -> str:
    rows = [(f"shared prompt at {rate} req/s, {k}", r["ttft_mean"] * 1e3, r["ttft_p90"] * 1e3,
             r["output_tok_s"], r["hit_rate"]) for rate, runs in report["shared_prompt"].items()
            for k, r in runs.items() if isinstance(r, dict)]
    rows += [(f"multi-turn, {k}", r["ttft_mean"] * 1e3, float("nan"), float("nan"),
              r["hit_rate"]) for k, r in report["multi_turn"].items()]
    rows += [(f"4 prompts, pool {n} blocks, hash", r["ttft_mean"] * 1e3, r["ttft_p90"] * 1e3,
              r["output_tok_s"], r["hit_rate"]) for n, r in report["cache_size"].items()]
    table = format_table([("run", "s"), ("TTFT mean ms", ".1f"), ("p90 ms", ".1f"),
                          ("out tok/s", ".1f"), ("hit rate", ".2f")], rows)
    ratios = "; ".join(f"{rate} req/s: TTFT {r['ttft_ratio']:.1f}x lower, throughput "
                       f"{r['throughput_ratio']:.2f}x"
                       for rate, r in report["shared_prompt"].items())
    return (f"{table}\nwith the hash cache against none: {ratios}\ntarget TTFT >= 10x lower: "
            f"met at {report['target_met_at'] or 'no rate'}")
