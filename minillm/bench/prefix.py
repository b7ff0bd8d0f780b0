"""Prefix caching (``python -m minillm bench prefix``; chapter 08).

Three workloads on the real model, each served by :func:`minillm.driver.drive`
(Poisson arrivals on a virtual clock of measured step times):

- **shared system prompt**: ``num_requests`` requests, one system prompt of ``system_tokens``
  tokens (English prose, chat template) and a distinct question each, at a few request rates;
  without prefix caching, then with the hash cache and with the radix cache (each the best of
  two runs): TTFT (mean, p50, p90), output tokens/s, the prompt tokens found in the cache (hit
  rate);
- **multi-turn chat**: ``num_users`` conversations of ``turns`` turns, each turn's prompt the
  previous prompt + the reply + a new question, both cache kinds;
- **cache size**: four system prompts taking turns, the hash cache under pools of a few sizes
  (from room for one cached system prompt to all four): hit rate and TTFT against pool blocks.
- **tiers**: eight system prompts taking turns, more KV than the device pool holds: the device
  cache alone, then a tiered store behind it (:mod:`minillm.cache.offload`): a CPU tier large
  enough for all (loaded whole before the forward, and layer by layer during it), a small CPU
  tier with a disk tier, and a fresh engine on that disk folder (a restart): hit rate, TTFT, the
  bytes each tier moved, and the load time the forward waited for (exposed) or not (hidden).
- **blend**: retrieval-style prompts (a short header, passages in a different order each time,
  a question) whose passages' KV was computed once, alone (:mod:`minillm.cache.blend`): full
  recompute, prefix caching (the header only: the passages move), full KV reuse and CacheBlend
  at several recompute ratios: TTFT (median), greedy tokens equal to full recompute's before
  the first difference (agreement), the share of full recompute's answer tokens that are each
  KV's greedy choice when fed that answer (token match), and that answer's perplexity.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import random
import statistics
import tempfile

import torch

from ..cache.pool import block_bytes
from ..driver import drive
from ..engine import EngineConfig, LLMEngine
from ..evaluate import sample_text
from ..runinfo import machine_info
from ..serving_metrics import percentile
from ..workloads import QUESTIONS, Workload, poisson_arrivals, shared_prompt_workload
from .common import format_table, use_threads, write_report


def run(model, tok, work: Workload, rate: float, seed: int, **options) -> dict:
    """Serve ``work`` at ``rate`` req/s; TTFT stats (s), throughput, prefix hit rate."""
    engine = LLMEngine(model, tok, EngineConfig(**options))
    res = drive(engine, work, arrivals=poisson_arrivals(len(work.prompts), rate, seed))
    ttft = [r.ttft for r in res.records]
    out = {"ttft_mean": statistics.fmean(ttft), "ttft_p50": percentile(ttft, 50),
           "ttft_p90": percentile(ttft, 90), "output_tok_s": res.throughput,
           "hit_rate": hit_rate(engine), "makespan": res.makespan,
           "max_step_s": max((r.end - r.start for r in engine.trace), default=0.0)}
    if engine.offload is not None:
        engine.offload.flush()                 # a later engine may read this one's disk tier
        out["store"] = engine.offload.stats()
    return out


def hit_rate(engine: LLMEngine) -> float:
    """Prompt tokens found cached (on the device or in the offload store) over those looked up."""
    b = engine.blocks
    found = b.prefix_hit + (engine.offload.tokens_loaded if engine.offload else 0)
    return found / b.prefix_queried if b.prefix_queried else 0.0


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
        res = drive(engine, Workload(prompts, [24] * users))
        ttfts += [r.ttft for r in res.records]
        for conv, r in zip(convs, res.records):
            conv.append({"role": "assistant", "content": tok.decode(r.token_ids)})
    return {"ttft_mean": statistics.fmean(ttfts), "hit_rate": hit_rate(engine)}


def run_tiers(model, tok, work: Workload, rate: float, seed: int, base: dict,
              device_blocks: int = 170, chunk_tokens: int = 64) -> dict:
    """The tiers workload (module docstring) through five configurations, in order (the last
    two share one disk folder)."""
    prompt_bytes = block_bytes(model.cfg, 1, model.dtype) * len(work.prompts[0])
    num_docs = len({tuple(p[:64]) for p in work.prompts})
    big = {"cpu_bytes": 2 * num_docs * prompt_bytes, "chunk_tokens": chunk_tokens}
    opts = {**base, "num_kv_blocks": device_blocks, "enable_prefix_caching": True}
    runs = {}
    with tempfile.TemporaryDirectory(prefix="minillm-kv-") as folder:
        small = {"cpu_bytes": int(2.5 * prompt_bytes), "chunk_tokens": chunk_tokens,
                 "disk_dir": folder, "disk_bytes": 1 << 30}
        for name, store in [("device only", None),
                            ("CPU, loaded whole", {**big, "layerwise": False}),
                            ("CPU, layer by layer", big),
                            ("small CPU + disk", small),
                            ("restart: same disk", small)]:
            runs[name] = run(model, tok, work, rate, seed, kv_offload=store, **opts)
    device_prompts = device_blocks * base.get("block_size", 16) // len(work.prompts[0])
    return {"device_blocks": device_blocks, "device_prompts": device_prompts,
            "num_prompts": num_docs, "prompt_bytes": prompt_bytes,
            "chunk_tokens": chunk_tokens, "runs": runs}


PARTS = ("shared_prompt", "multi_turn", "cache_size", "tiers", "blend")
BLEND_QUESTIONS = ["Which passage talks about errors, and what does it say?",
                   "Summarise the passages in two sentences.",
                   "What is the first passage about?", "List the topics of the passages."]


def blend_prompts(tok, num_queries: int, num_passages: int, passage_tokens: int, per_query: int,
                  seed: int = 0):
    """(header ids, passages' ids, [(passage indices in order, question suffix ids)]): a chat
    prompt whose user turn holds the passages then the question; the header ends where the user
    turn's text starts, the suffix is the question and the assistant turn's opening."""
    text = tok.encode(sample_text(num_passages * passage_tokens + 64, tok))
    passages = [text[i * passage_tokens:(i + 1) * passage_tokens] for i in range(num_passages)]
    before, after = tok.apply_chat_template(
        [{"role": "system", "content": "Answer from the passages the user gives."},
         {"role": "user", "content": "\x00"}], add_generation_prompt=True).split("\x00")
    rng, queries = random.Random(seed), []
    for q in range(num_queries):
        order = rng.sample(range(num_passages), per_query)
        question = BLEND_QUESTIONS[q % len(BLEND_QUESTIONS)]
        queries.append((order, tok.encode(f"\n\nQuestion: {question}{after}")))
    return tok.encode(before), passages, queries


def run_blend(model, tok, seed: int = 0, num_queries: int = 8, num_passages: int = 6,
              passage_tokens: int = 240, per_query: int = 4,
              ratios: tuple[float, ...] = (0.05, 0.15, 0.3, 0.5, 1.0), answer_tokens: int = 32
              ) -> dict:
    """The blend workload (module docstring); each method's TTFT is the median over queries,
    agreement and perplexity their means."""
    from ..cache import blend

    header, passages, queries = blend_prompts(tok, num_queries, num_passages, passage_tokens,
                                              per_query, seed)
    cached = [blend.precompute_chunk(model, ids) for ids in [header] + passages]
    methods = {"full recompute": None, "prefix caching": "prefix", "full KV reuse": "reuse"}
    methods |= {f"CacheBlend {r:.0%}": r for r in ratios}
    rows = {name: {"ttft": [], "agree": [], "match": [], "nll": [], "fraction": []}
            for name in methods}
    for q, (order, suffix) in enumerate([queries[0]] + queries):   # the first: a warm-up
        chunks = [cached[0]] + [cached[1 + i] for i in order]
        ids = [t for c in chunks for t in c.token_ids] + suffix
        ref = blend.full_prefill(model, ids, answer_tokens)
        answer = blend.greedy_continue(model, ref, answer_tokens)
        for name, how in methods.items():
            res = ref if how is None else blend.prefix_prefill(model, chunks, suffix) \
                if how == "prefix" else blend.full_reuse(model, chunks, suffix) \
                if how == "reuse" else blend.blend_prefill(model, chunks, suffix, how)
            if q == 0:                                     # the warm-up times nothing
                continue
            mine = blend.greedy_continue(model, res, answer_tokens)
            same = next((i for i, (a, b) in enumerate(zip(mine, answer)) if a != b), len(answer))
            row = rows[name]
            row["ttft"].append(res.seconds)
            row["agree"].append(same / len(answer))
            row["match"].append(blend.answer_match(model, res, answer))
            row["nll"].append(blend.answer_nll(model, res, answer))
            row["fraction"].append(res.recomputed_fraction)
    full = statistics.median(rows["full recompute"]["ttft"])
    return {"num_queries": num_queries, "passages": num_passages, "per_query": per_query,
            "passage_tokens": passage_tokens, "prompt_tokens": len(ids),
            "answer_tokens": answer_tokens,
            "methods": {name: {"ttft_p50": statistics.median(r["ttft"]),
                               "ttft_ratio": full / statistics.median(r["ttft"]),
                               "agreement": statistics.fmean(r["agree"]),
                               "token_match": statistics.fmean(r["match"]),
                               "perplexity": math.exp(statistics.fmean(r["nll"])),
                               "recomputed_fraction": statistics.fmean(r["fraction"])}
                        for name, r in rows.items()}}


def run_prefix_bench(model_name: str = "smollm2-135m", num_requests: int = 32,
                     system_tokens: int = 1000, rates: tuple[float, ...] = (0.5, 2.0, 8.0),
                     seed: int = 0, pool_blocks: tuple[int, ...] = (100, 170, 240, 640),
                     dtype=None, parts: tuple[str, ...] = PARTS) -> dict:
    """See the module docstring; the shared-prompt workload runs at every rate of ``rates``
    (req/s), the multi-turn one at its own pace, the cache sizes with 4 system prompts taking
    turns at the middle rate, the tiers with 8 at that rate; ``parts``: which to run."""
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"parts must be among {PARTS}, got {sorted(unknown)}")
    from ..checkpoint.loader import load_model
    from ..device import serving_dtype

    dtype, reason = serving_dtype(dtype, torch.device("cpu"))
    model, tok = load_model(model_name, dtype=dtype)
    work = shared_prompt_workload(tok, num_requests, system_tokens, seed)
    base = {"num_kv_blocks": 2048, "max_num_seqs": 32, "max_num_batched_tokens": 2048}
    load = [os.getloadavg()[0]]
    run(model, tok, Workload(work.prompts[:2], [4, 4]), 1.0, seed, **base)   # warm-up
    mid = rates[len(rates) // 2]
    report = {"machine": machine_info(torch.device("cpu"), torch.get_num_threads()),
              "dtype": str(dtype), "dtype_reason": reason, "load_average": load,
              "workload": {"num_requests": num_requests, "system_tokens": system_tokens,
                           "prompt_tokens": [len(p) for p in work.prompts], "rates": rates,
                           "system_blocks": len(work.prompts[0]) // 16}}
    if "shared_prompt" in parts:
        report["shared_prompt"] = {str(r): shared_runs(model, tok, work, r, seed, base)
                                   for r in rates}
    if "multi_turn" in parts:
        report["multi_turn"] = {k or "none": multi_turn(model, tok, 4, 4, k, seed, **base)
                                for k in (None, "hash", "radix")}
    if "cache_size" in parts:
        four = shared_prompt_workload(tok, num_requests, system_tokens, seed, num_systems=4)
        report["cache_size"] = {str(n): run(model, tok, four, mid, seed,
                                            enable_prefix_caching=True,
                                            **{**base, "num_kv_blocks": n}) for n in pool_blocks}
    if "tiers" in parts:
        eight = shared_prompt_workload(tok, num_requests, system_tokens, seed, num_systems=8)
        report["tiers"] = run_tiers(model, tok, eight, mid, seed, base)
    if "blend" in parts:      # in float32: quality differences, not bf16 rounding, are measured
        report["blend"] = run_blend(copy.deepcopy(model).float(), tok, seed) | {
            "dtype": "torch.float32"}
    load.append(os.getloadavg()[0])
    return report


def best_of(repeats: int, *args, **options) -> dict:
    """``run(*args, **options)`` ``repeats`` times; the run of lowest mean TTFT (a stall of the
    machine shows in one run's max step, not in the result), with every run's mean kept."""
    runs = [run(*args, **options) for _ in range(repeats)]
    best = min(runs, key=lambda r: r["ttft_mean"])
    return best | {"ttft_mean_runs": [r["ttft_mean"] for r in runs],
                   "max_step_s_runs": [r["max_step_s"] for r in runs]}


def shared_runs(model, tok, work: Workload, rate: float, seed: int, base: dict,
                repeats: int = 2) -> dict:
    """The shared-prompt workload without a cache and with each kind, each the best of
    ``repeats`` runs; the hash cache's ratios."""
    runs = {"none": best_of(repeats, model, tok, work, rate, seed, **base)}
    for kind in ("hash", "radix"):
        runs[kind] = best_of(repeats, model, tok, work, rate, seed, enable_prefix_caching=True,
                             prefix_cache=kind, **base)
    runs["ttft_ratio"] = runs["none"]["ttft_mean"] / runs["hash"]["ttft_mean"]
    runs["throughput_ratio"] = runs["hash"]["output_tok_s"] / runs["none"]["output_tok_s"]
    return runs


def prefix_table(report: dict) -> str:
    """The report as text: one table of the serving runs, the tiers' traffic, CacheBlend."""
    rows = [(f"shared prompt at {rate} req/s, {k}", r["ttft_mean"] * 1e3, r["ttft_p90"] * 1e3,
             r["output_tok_s"], r["hit_rate"])
            for rate, runs in report.get("shared_prompt", {}).items()
            for k, r in runs.items() if isinstance(r, dict)]
    rows += [(f"multi-turn, {k}", r["ttft_mean"] * 1e3, float("nan"), float("nan"),
              r["hit_rate"]) for k, r in report.get("multi_turn", {}).items()]
    rows += [(f"4 prompts, pool {n} blocks, hash", r["ttft_mean"] * 1e3, r["ttft_p90"] * 1e3,
              r["output_tok_s"], r["hit_rate"]) for n, r in report.get("cache_size", {}).items()]
    tiers = report.get("tiers", {})
    rows += [(f"{tiers['num_prompts']} prompts: {name}", r["ttft_mean"] * 1e3,
              r["ttft_p90"] * 1e3, r["output_tok_s"], r["hit_rate"])
             for name, r in tiers.get("runs", {}).items()]
    out = [format_table([("run", "s"), ("TTFT mean ms", ".1f"), ("p90 ms", ".1f"),
                         ("out tok/s", ".1f"), ("hit rate", ".2f")], rows)]
    if "shared_prompt" in report:
        ratios = "; ".join(f"{rate} req/s: TTFT {r['ttft_ratio']:.1f}x lower, throughput "
                           f"{r['throughput_ratio']:.2f}x"
                           for rate, r in report["shared_prompt"].items())
        out.append(f"with the hash cache against none: {ratios}")
    if "tiers" in report:
        out.append(tiers_table(report["tiers"]))
    if "blend" in report:
        out.append(blend_table(report["blend"]))
    return "\n".join(out)


def tiers_table(tiers: dict) -> str:
    """MiB across each tier boundary and the load time hidden behind compute, per run."""
    rows = []
    for name, r in tiers["runs"].items():
        st, disk = r.get("store", {}), r.get("store", {}).get("disk", {})
        rows.append((name, st.get("device_to_cpu_bytes", 0) / 2**20,
                     disk.get("bytes_in", 0) / 2**20, disk.get("bytes_out", 0) / 2**20,
                     st.get("store_to_device_bytes", 0) / 2**20,
                     st.get("load_seconds", 0) * 1e3, st.get("exposed_seconds", 0) * 1e3))
    return format_table([("tiers run", "s"), ("dev->CPU MiB", ".0f"), ("CPU->disk MiB", ".0f"),
                         ("disk->CPU MiB", ".0f"), ("->dev MiB", ".0f"), ("load ms", ".1f"),
                         ("exposed ms", ".1f")], rows)


def blend_table(blend: dict) -> str:
    rows = [(name, m["ttft_p50"] * 1e3, m["ttft_ratio"], m["recomputed_fraction"],
             m["agreement"], m["token_match"], m["perplexity"])
            for name, m in blend["methods"].items()]
    return format_table([("prefill", "s"), ("TTFT p50 ms", ".1f"), ("lower x", ".2f"),
                         ("recomputed", ".2f"), ("agreement", ".2f"), ("token match", ".2f"),
                         ("answer ppl", ".3f")], rows)


# ----------------------------------------------------------------------------- command line

HELP = ("prefix caching (hash, radix) on a shared system prompt, multi-turn chat and pool "
        "sizes")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``minillm bench prefix``'s options (the shared ones: :func:`.common.add_common_args`)."""
    parser.add_argument("--num-requests", type=int, default=32, help="(default: %(default)s)")
    parser.add_argument("--system-tokens", type=int, default=1000, help="(default: %(default)s)")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 2.0, 8.0],
                        help="requests/s (default: %(default)s)")
    parser.add_argument("--dtype", default=None, help="default: what minillm.LLM picks")
    parser.add_argument("--parts", nargs="+", default=None,
                        help="any of shared_prompt multi_turn cache_size tiers blend "
                             "(default: all)")


def main(args: argparse.Namespace) -> int:
    """Run ``minillm bench prefix``; print the table, write the JSON and the plot."""
    from ..viz.bench import plot_prefix

    use_threads(args)
    report = run_prefix_bench(args.model, args.num_requests, args.system_tokens,
                              tuple(args.rates), dtype=args.dtype,
                              parts=tuple(args.parts or PARTS))
    return write_report(args, report, prefix_table(report), plot_prefix)
