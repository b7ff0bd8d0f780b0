"""Chunked prefill against the two classic step policies (``python -m minillm bench chunked``).

The workload (seeded, one for every policy):

- ``num_decodes`` short chat prompts (``decode_range`` tokens) that all arrive at 0 and decode
  long enough to be running until past the last arrival (greedy, EOS ignored);
- ``num_long`` long chat prompts (``long_range`` tokens of prose from the Python reference
  manual, :func:`minillm.evaluate.sample_text`; seeded random ids when there is no tokenizer),
  each with ``long_tokens`` output tokens, arriving one every ``gap`` seconds from ``gap``.

The gap and the decode length come from a calibration on the engine itself (the fastest of a
few steps, after a warm-up): ``gap`` = one whole-prompt prefill step of the median long prompt
+ ``gap_steps`` decode steps of the running requests (so prefill_first is not overloaded), and
the running requests decode for ``(num_long + 1) * gap`` seconds' worth of decode steps (a step
is never faster than a pure decode step, so they run until past the last arrival under every
policy).

It is served on a *virtual clock* (the measured wall time of each step, idle gaps skipped, as
:func:`minillm.driver.drive`) under ``prefill_first`` and ``decode_first`` (token
budget: the longest request, so a whole prompt fits one step) and ``chunked`` at each budget of
``budgets`` (the scheduler's docstring explains the three). Per run: the inter-token latency
(ITL: gaps between consecutive tokens of one request) of the running requests, pooled, at
p50/p90/p99 and its max (the longest stall); TTFT of the long prompts (p50/p90/max); TPOT per
request; output and total (prompt + output) tokens per second over the makespan; the step
timeline (virtual start/end, prefill and decode tokens). With ``repeats`` the policies take
turns, round after round, and each keeps its least disturbed round (the shortest makespan);
every round's numbers stay in the report.

What chunked prefill should do: cut the p99 ITL against prefill_first (``itl_p99_ratio`` =
prefill_first / chunked) while keeping most of its output throughput (``throughput_ratio`` =
chunked / prefill_first); both are reported per budget, the headline at the first budget.

An fp32 check (:func:`same_outputs_check`): a few requests, a long one arriving while the others
decode, give the same greedy token ids under every policy and budget.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..cache.block_manager import blocks_for
from ..checkpoint.loader import REAL_MODEL, load_model
from ..config import SamplingParams
from ..device import resolve_device, serving_dtype
from ..driver import DriveResult, drive
from ..engine import EngineConfig, LLMEngine
from ..evaluate import sample_ids
from ..runinfo import machine_info
from ..serving_metrics import percentile
from ..workloads import Workload
from .common import dtype_name, format_table, log_to_stderr, write_report

BUDGETS = (256, 512)           # chunked prefill's token budgets per step
POLICIES = ("prefill_first", "decode_first", "chunked")
BLOCK_SIZE = 16
INSTRUCTION = "Read the following text carefully, then continue it in the same style.\n\n"


# ----------------------------------------------------------------------------- statistics

def inter_token_latencies(token_times: Sequence[float]) -> list[float]:
    """Gaps (s) between consecutive tokens of one request, from the times its tokens were
    produced (s, non-decreasing): n times give n - 1 gaps."""
    if any(b < a for a, b in zip(token_times, token_times[1:])):
        raise ValueError("token_times must be non-decreasing")
    return [b - a for a, b in zip(token_times, token_times[1:])]


def itl_stats(token_times: Iterable[Sequence[float]]) -> dict:
    """The ITL of several requests (one list of token times each), pooled: p50, p90, p99, max
    (the longest stall) and mean in seconds, the number of gaps, and ``quantiles``: the
    percentiles 0, 1, ..., 100 (for a CDF)."""
    gaps = [g for times in token_times for g in inter_token_latencies(times)]
    if not gaps:
        raise ValueError("token_times must hold at least one request with two tokens")
    return {"p50": percentile(gaps, 50), "p90": percentile(gaps, 90),
            "p99": percentile(gaps, 99), "max": max(gaps), "mean": statistics.fmean(gaps),
            "count": len(gaps), "quantiles": [percentile(gaps, q) for q in range(101)]}


def p50_p90_max(values: Sequence[float]) -> dict:
    """p50, p90 and max of ``values`` (seconds)."""
    return {"p50": percentile(values, 50), "p90": percentile(values, 90), "max": max(values)}


# ----------------------------------------------------------------------------- the workload

@dataclass(frozen=True)
class ChunkedWorkload(Workload):
    """A :class:`~minillm.workloads.Workload` with arrival times (s, virtual clock) per
    request; ``kinds[i]`` is "decode" (a running request) or "long" (a long prompt)."""

    arrivals: list[float]
    kinds: list[str]

    def ids(self, kind: str) -> list[str]:
        """Request ids (str of the index) of one kind."""
        return [str(i) for i, k in enumerate(self.kinds) if k == kind]

    @property
    def longest(self) -> int:
        """Prompt + output tokens of the longest request."""
        return max(len(p) + n for p, n in zip(self.prompts, self.output_lens))

    @property
    def num_kv_blocks(self) -> int:
        """KV blocks for every request at its full length at once, one spare each."""
        return sum(blocks_for(len(p) + n, BLOCK_SIZE) + 1
                   for p, n in zip(self.prompts, self.output_lens))


def chat_frame(tok) -> tuple[list[int], list[int]]:
    """Token ids before and after a user message in the chat template (system prompt and
    user turn; end of turn and the assistant's generation prompt)."""
    marker = "\x00MESSAGE\x00"
    text = tok.apply_chat_template([{"role": "user", "content": marker}],
                                   add_generation_prompt=True)
    head, tail = text.split(marker)
    return tok.encode(head), tok.encode(tail)


def make_prompts(tok, vocab_size: int, lengths: Sequence[int], seed: int = 0
                 ) -> list[list[int]]:
    """One prompt of exactly ``lengths[i]`` tokens each: with a tokenizer, a chat turn asking to
    continue a window of prose (the windows start at seeded offsets); without, seeded random
    ids in [10, vocab_size)."""
    rng = random.Random(seed)
    if tok is None:
        return [[rng.randrange(10, vocab_size) for _ in range(n)] for n in lengths]
    head, tail = chat_frame(tok)
    head = head + tok.encode(INSTRUCTION)
    longest = max(lengths)
    if longest <= len(head) + len(tail):
        raise ValueError(f"prompt lengths must exceed the chat template's "
                         f"{len(head) + len(tail)} tokens, got {longest}")
    prose = sample_ids(2 * longest, tok)
    prompts = []
    for n in lengths:
        body = n - len(head) - len(tail)
        start = rng.randrange(0, len(prose) - body)
        prompts.append(head + prose[start:start + body] + tail)
    return prompts


def workload_prompts(tok, vocab_size: int, num_decodes: int, num_long: int,
                     decode_range: tuple[int, int], long_range: tuple[int, int], seed: int = 0
                     ) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts of the running requests, long prompts), seeded lengths uniform in the ranges
    (inclusive)."""
    for name, (lo, hi) in (("decode_range", decode_range), ("long_range", long_range)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be (min, max) with 1 <= min <= max, got {(lo, hi)}")
    if num_decodes < 1 or num_long < 1:
        raise ValueError(f"num_decodes and num_long must be >= 1, got {num_decodes} and "
                         f"{num_long}")
    rng = random.Random(seed)
    short = [rng.randint(*decode_range) for _ in range(num_decodes)]
    long = [rng.randint(*long_range) for _ in range(num_long)]
    prompts = make_prompts(tok, vocab_size, short + long, seed)
    return prompts[:num_decodes], prompts[num_decodes:]


def chunked_workload(decode_prompts: list[list[int]], long_prompts: list[list[int]], gap: float,
                  decode_step: float, long_tokens: int, max_seq_len: int) -> ChunkedWorkload:
    """The running requests arrive at 0 and decode ``(num_long + 1) * gap / decode_step``
    tokens (capped by ``max_seq_len``); long prompt i arrives at ``(i + 1) * gap`` seconds and
    generates ``long_tokens``."""
    if gap <= 0 or decode_step <= 0:
        raise ValueError(f"gap and decode_step must be > 0 s, got {gap} and {decode_step}")
    if long_tokens < 1:
        raise ValueError(f"long_tokens must be >= 1, got {long_tokens}")
    n_long = len(long_prompts)
    decode_len = math.ceil((n_long + 1) * gap / decode_step)
    outs = [min(decode_len, max_seq_len - len(p)) for p in decode_prompts]
    outs += [min(long_tokens, max_seq_len - len(p)) for p in long_prompts]
    arrivals = [0.0] * len(decode_prompts) + [(i + 1) * gap for i in range(n_long)]
    kinds = ["decode"] * len(decode_prompts) + ["long"] * n_long
    return ChunkedWorkload(decode_prompts + long_prompts, outs, arrivals, kinds)


# ----------------------------------------------------------------------------- the driver

def run_policy(engine: LLMEngine, work: ChunkedWorkload) -> DriveResult:
    """Serve ``work`` on the virtual clock (:func:`minillm.driver.drive`): every new token is
    stamped with the clock at the end of its step."""
    return drive(engine, work, arrivals=work.arrivals)


def engine_for(model, tok, policy: str, budget: int, work: ChunkedWorkload) -> LLMEngine:
    """An engine with room for every request at once (no preemption)."""
    return LLMEngine(model, tok, EngineConfig(
        step_policy=policy, max_num_batched_tokens=budget, max_num_seqs=len(work.prompts),
        block_size=BLOCK_SIZE, num_kv_blocks=work.num_kv_blocks))


def summarize(work: ChunkedWorkload, run: DriveResult) -> dict:
    """The measurements of the module docstring for one run (seconds, tokens/s)."""
    decodes, longs = work.ids("decode"), work.ids("long")
    requests = []
    for i, kind in enumerate(work.kinds):
        times = run.records[i].token_times
        requests.append({"id": str(i), "kind": kind, "prompt_len": len(work.prompts[i]),
                         "output_len": len(times), "arrival": work.arrivals[i],
                         "ttft": times[0] - work.arrivals[i],
                         "tpot": (times[-1] - times[0]) / (len(times) - 1)
                         if len(times) > 1 else None})
    by_id = {r["id"]: r for r in requests}

    def mean_tpot(ids: list[str]) -> float | None:
        vals = [by_id[i]["tpot"] for i in ids if by_id[i]["tpot"] is not None]
        return statistics.fmean(vals) if vals else None

    times = {r.request_id: r.token_times for r in run.records}
    out_tokens = sum(map(len, times.values()))
    prompt_tokens = sum(map(len, work.prompts))
    span = max(t[-1] for t in times.values() if t)
    return {"itl": itl_stats(times[i] for i in decodes),
            "ttft_long": p50_p90_max([by_id[i]["ttft"] for i in longs]),
            "tpot_decode_mean": mean_tpot(decodes), "tpot_long_mean": mean_tpot(longs),
            "makespan_s": span, "output_tokens": out_tokens, "prompt_tokens": prompt_tokens,
            "output_tok_s": out_tokens / span, "total_tok_s": (out_tokens + prompt_tokens) / span,
            "steps": len(run.timeline),
            "preemptions": sum(r.num_preemptions for r in run.records),
            "requests": requests,
            "timeline": [{"start": round(t.start, 6), "end": round(t.end, 6),
                          "prefill": t.prefill_tokens, "decode": t.decode_tokens,
                          "requests": t.num_requests} for t in run.timeline]}


def calibrate(model, tok, decode_prompts: list[list[int]], long_prompt: list[int],
              budget: int, decode_steps: int = 12) -> tuple[float, float]:
    """(seconds of one decode step of the running requests, seconds of one step prefilling
    ``long_prompt`` whole): the fastest of ``decode_steps`` decode steps and of three
    prefills, after one warm-up pass of each (other work on a shared machine only ever slows
    a step down, so the minimum is the machine's own speed)."""
    work = ChunkedWorkload(decode_prompts + [long_prompt],
                           [decode_steps + 1] * len(decode_prompts) + [1],
                           [0.0] * (len(decode_prompts) + 1),
                           ["decode"] * len(decode_prompts) + ["long"])
    engine = engine_for(model, tok, "prefill_first", budget, work)
    prefill = []
    for rounds in range(2):                    # the first round warms up
        params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, ignore_eos=True)
        for p in decode_prompts:
            engine.add_request(p, params)
        start = len(engine.trace)
        while engine.has_unfinished():
            engine.step()
        decode = [r.end - r.start for r in list(engine.trace)[start:] if r.prefill_tokens == 0]
        for _ in range(1 + 2 * rounds):
            engine.add_request(long_prompt, SamplingParams(temperature=0.0, max_tokens=1))
            t0 = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            prefill.append(time.perf_counter() - t0)
    return min(decode), min(prefill[1:])


def decode_step_p50(row: dict, num_decodes: int) -> float | None:
    """Median seconds of the run's steps that decoded ``num_decodes`` or more requests and
    prefilled nothing (compare with the calibration: a busy machine shows here)."""
    steps = [s["end"] - s["start"] for s in row["timeline"]
             if not s["prefill"] and s["decode"] >= num_decodes]
    return statistics.median(steps) if steps else None


def policy_runs(model, tok, work: ChunkedWorkload, budgets: Sequence[int], repeats: int = 1,
                log=print) -> list[dict]:
    """One summarized run per policy: prefill_first and decode_first with a whole-request
    budget, chunked at each of ``budgets``. With ``repeats`` > 1 the rounds are interleaved
    (every policy once per round, so a slow spell of a shared machine hits them alike) and each
    policy keeps its round with the shortest makespan; ``repeats`` lists every round's
    makespan, p99 ITL and output tokens/s."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    plans = [("prefill_first", work.longest), ("decode_first", work.longest)]
    plans += [("chunked", b) for b in budgets]
    num_decodes = len(work.ids("decode"))
    best: dict[str, dict] = {}
    tries: dict[str, list[dict]] = {}
    for rnd in range(repeats):
        for policy, budget in plans:
            label = policy if policy != "chunked" else f"chunked {budget}"
            engine = engine_for(model, tok, policy, budget, work)
            row = {"label": label, "policy": policy, "budget": budget,
                   **summarize(work, run_policy(engine, work))}
            del engine
            row["decode_step_p50_s"] = decode_step_p50(row, num_decodes)
            tries.setdefault(label, []).append(
                {"makespan_s": row["makespan_s"], "itl_p99": row["itl"]["p99"],
                 "output_tok_s": row["output_tok_s"], "decode_step_p50_s":
                 row["decode_step_p50_s"]})
            if label not in best or row["makespan_s"] < best[label]["makespan_s"]:
                best[label] = row
            log(f"round {rnd + 1} {label:>15}: ITL p50 {1e3 * row['itl']['p50']:.1f} ms, p99 "
                f"{1e3 * row['itl']['p99']:.1f} ms, max {1e3 * row['itl']['max']:.1f} ms; "
                f"TTFT p50 {row['ttft_long']['p50']:.2f} s; {row['output_tok_s']:.1f} output "
                f"tok/s; makespan {row['makespan_s']:.1f} s")
    return [best[label] | {"repeats": tries[label]} for label in best]


def same_outputs_check(model, tok, decode_prompts: list[list[int]], long_prompt: list[int],
                       budgets: Sequence[int], max_tokens: int = 8) -> dict:
    """Greedy token ids of the ``decode_prompts`` and ``long_prompt`` (arriving once they
    decode), ``max_tokens`` each, under every policy and chunked budget (use an fp32 model:
    the check is that the schedule does not change the tokens)."""
    work = ChunkedWorkload(decode_prompts + [long_prompt],
                           [max_tokens] * (len(decode_prompts) + 1),
                           [0.0] * len(decode_prompts) + [1e-9],
                           ["decode"] * len(decode_prompts) + ["long"])
    plans = [("prefill_first", work.longest), ("decode_first", work.longest)]
    plans += [("chunked", b) for b in budgets]
    ids = {}
    for policy, budget in plans:
        label = policy if policy != "chunked" else f"chunked {budget}"
        run = run_policy(engine_for(model, tok, policy, budget, work), work)
        ids[label] = [r.token_ids for r in run.records]
    first = next(iter(ids.values()))
    return {"same_outputs": all(v == first for v in ids.values()),
            "differ": [k for k, v in ids.items() if v != first],
            "requests": len(work.prompts), "max_tokens": max_tokens,
            "prompt_lens": [len(p) for p in work.prompts],
            "dtype": dtype_name(model.dtype), "token_ids": ids}


# ----------------------------------------------------------------------------- the benchmark

def ratios(rows: list[dict]) -> dict[str, dict]:
    """Per chunked budget: ``itl_p99_ratio`` (prefill_first / chunked), ``throughput_ratio``
    (chunked / prefill_first output tok/s)."""
    base = next(r for r in rows if r["policy"] == "prefill_first")
    out = {}
    for r in rows:
        if r["policy"] == "chunked":
            itl = base["itl"]["p99"] / r["itl"]["p99"]
            tput = r["output_tok_s"] / base["output_tok_s"]
            out[str(r["budget"])] = {"itl_p99_ratio": itl, "throughput_ratio": tput}
    return out


def run_chunked(model, tok, budgets: Sequence[int] = BUDGETS, num_decodes: int = 16,
                num_long: int = 8, decode_range: tuple[int, int] = (48, 64),
                long_range: tuple[int, int] = (1000, 2000), long_tokens: int = 16,
                gap_steps: int = 24, seed: int = 0, repeats: int = 2, check_model=None,
                log=print) -> dict:
    """Calibrate, build the workload, run every policy and the fp32 check (on
    ``check_model``, default ``model``); returns the report's measurements (JSON-ready)."""
    budgets = list(budgets)
    if not budgets:
        raise ValueError("budgets must name at least one chunked token budget")
    seqs = num_decodes + num_long
    for b in budgets:
        if b < max(seqs, BLOCK_SIZE):
            raise ValueError(f"budgets must be >= max(num_decodes + num_long, block size) = "
                             f"{max(seqs, BLOCK_SIZE)}, got {b}")
    if gap_steps < 0:
        raise ValueError(f"gap_steps must be >= 0, got {gap_steps}")
    cfg = model.cfg
    if long_range[1] + long_tokens >= cfg.max_seq_len:
        raise ValueError(f"long_range's max + long_tokens must be < max_seq_len "
                         f"({cfg.max_seq_len}), got {long_range[1]} + {long_tokens}")
    short, long = workload_prompts(tok, cfg.vocab_size, num_decodes, num_long, decode_range,
                                   long_range, seed)
    median_long = sorted(long, key=len)[len(long) // 2]
    decode_step, prefill = calibrate(model, tok, short, median_long,
                                     max(map(len, long)) + long_tokens)
    gap = prefill + gap_steps * decode_step
    work = chunked_workload(short, long, gap, decode_step, long_tokens, cfg.max_seq_len)
    log(f"calibration: decode step {1e3 * decode_step:.1f} ms ({num_decodes} requests), "
        f"{len(median_long)}-token prefill {1e3 * prefill:.0f} ms -> a long prompt every "
        f"{gap:.2f} s, {work.output_lens[0]} tokens per running request")
    rows = policy_runs(model, tok, work, budgets, repeats, log)
    by_budget = ratios(rows)
    head = by_budget[str(budgets[0])]
    check = same_outputs_check(check_model or model, tok, short[:2], long[0], budgets)
    log(f"same outputs under every policy ({check['dtype']}): {check['same_outputs']}")
    return {"config": {"budgets": budgets, "num_decodes": num_decodes, "num_long": num_long,
                       "decode_range": list(decode_range), "long_range": list(long_range),
                       "long_tokens": long_tokens, "decode_tokens": work.output_lens[0],
                       "gap_steps": gap_steps, "seed": seed, "repeats": repeats,
                       "block_size": BLOCK_SIZE,
                       "whole_budget": work.longest, "num_kv_blocks": work.num_kv_blocks,
                       "long_prompt_lens": [len(p) for p in long],
                       "long_arrivals_s": [t for t, k in zip(work.arrivals, work.kinds)
                                           if k == "long"]},
            "calibration": {"decode_step_s": decode_step, "prefill_step_s": prefill,
                            "prefill_prompt_len": len(median_long), "gap_s": gap},
            "runs": rows, "ratios": by_budget, "primary_budget": budgets[0],
            "itl_p99_ratio": head["itl_p99_ratio"], "throughput_ratio": head["throughput_ratio"],
            "same_outputs": check["same_outputs"], "same_outputs_check": check}


def run_chunked_bench(model_name: str = REAL_MODEL, budgets: Sequence[int] = BUDGETS,
                      num_decodes: int = 16, num_long: int = 8,
                      long_range: tuple[int, int] = (1000, 2000), dtype: str | None = None,
                      device: str | None = None, threads: int | None = None,
                      random_weights: bool = False, log=print, **options) -> dict:
    """Load the model (the serving dtype: what :class:`minillm.LLM` picks unless ``dtype``)
    and, for the equality check, an fp32 copy; run :func:`run_chunked` (``options``: its
    other keyword arguments); the report with machine facts and load averages."""
    load_before = list(os.getloadavg())
    wall = time.perf_counter()
    if threads:
        torch.set_num_threads(threads)
    dev = resolve_device(device)
    dt, reason = serving_dtype(dtype, dev)
    model, tok = load_model(model_name, device=dev, dtype=dt, random_weights=random_weights)
    check = model if dt == torch.float32 else \
        load_model(model_name, device=dev, dtype=torch.float32, random_weights=random_weights)[0]
    log(f"{model_name} in {dtype_name(dt)} on {dev} ({reason}); "
        f"{torch.get_num_threads()} threads; load average {load_before}")
    body = run_chunked(model, tok, budgets, num_decodes, num_long, long_range=long_range,
                       check_model=check, log=log, **options)
    return {"benchmark": "chunked", "model": model_name, "dtype": dtype_name(dt),
            "dtype_reason": reason, "random_weights": random_weights,
            "machine_info": machine_info(dev, torch.get_num_threads()), **body,
            "load_average_before": load_before, "load_average_after": list(os.getloadavg()),
            "seconds": time.perf_counter() - wall}


def chunked_table(report: dict) -> str:
    """One row per run (ms for ITL and TPOT, s for TTFT), then the ratios."""
    table = format_table(
        [("policy", "<15"), ("ITL p50", ">7.1f"), ("p90", ">7.1f"), ("p99", ">7.1f"),
         ("max stall", ">9.1f"), ("TTFT p50 s", ">10.2f"), ("p90", ">6.2f"), ("max", ">6.2f"),
         ("TPOT ms", ">7.1f"), ("out tok/s", ">9.1f"), ("tot tok/s", ">9.1f"),
         ("steps", ">5"), ("decode step ms", ">14.1f")],
        [(r["label"], 1e3 * r["itl"]["p50"], 1e3 * r["itl"]["p90"], 1e3 * r["itl"]["p99"],
          1e3 * r["itl"]["max"], r["ttft_long"]["p50"], r["ttft_long"]["p90"],
          r["ttft_long"]["max"], 1e3 * (r["tpot_decode_mean"] or math.nan), r["output_tok_s"],
          r["total_tok_s"], r["steps"], 1e3 * (r["decode_step_p50_s"] or math.nan))
         for r in report["runs"]])
    cal, cfg = report["calibration"], report["config"]
    lines = [table, "(ITL and max stall in ms, of the running requests; TTFT of the long "
                    "prompts; TPOT: mean over the running requests; decode step: median of the "
                    "steps that only decoded them)",
             f"calibration: decode step {1e3 * cal['decode_step_s']:.1f} ms, "
             f"{cal['prefill_prompt_len']}-token prefill {1e3 * cal['prefill_step_s']:.0f} ms; "
             f"a long prompt every {cal['gap_s']:.2f} s, {cfg['decode_tokens']} tokens per "
             f"running request; the shortest of {cfg['repeats']} rounds per policy"]
    for b, r in report["ratios"].items():
        lines.append(f"chunked {b}: p99 ITL x{r['itl_p99_ratio']:.2f} lower than prefill_first, "
                     f"output throughput x{r['throughput_ratio']:.3f} of prefill_first's")
    check = report["same_outputs_check"]
    lines.append(f"same greedy ids under every policy ({check['dtype']}, {check['requests']} "
                 f"requests x {check['max_tokens']} tokens): {report['same_outputs']}")
    if "load_average_before" in report:
        lines.append(f"load average before {report['load_average_before']}, after "
                     f"{report['load_average_after']}; {report['seconds']:.0f} s")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line

HELP = ("chunked prefill vs prefill_first and decode_first: inter-token latency, TTFT and "
        "throughput")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``minillm bench chunked``'s options (the shared ones: :func:`.common.add_common_args`)."""
    parser.add_argument("--budgets", nargs="+", type=int, default=list(BUDGETS),
                        help="chunked prefill's tokens per step; the first is the headline "
                             "(default: %(default)s)")
    parser.add_argument("--num-decodes", type=int, default=16,
                        help="running requests, short prompts and long outputs (default: 16)")
    parser.add_argument("--num-long", type=int, default=8,
                        help="long prompts arriving while they decode (default: 8)")
    parser.add_argument("--long-range", nargs=2, type=int, default=[1000, 2000],
                        metavar=("MIN", "MAX"), help="long prompt tokens (default: 1000 2000)")
    parser.add_argument("--long-tokens", type=int, default=16,
                        help="output tokens of each long prompt (default: 16)")
    parser.add_argument("--gap-steps", type=int, default=24,
                        help="decode steps between two long prompts besides one's prefill "
                             "(default: 24)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="rounds of every policy, interleaved; each keeps its shortest "
                             "(default: 2)")
    parser.add_argument("--seed", type=int, default=0, help="(default: 0)")
    parser.add_argument("--dtype", default=None, help="default: what minillm.LLM picks (the "
                                                      "equality check always runs in fp32)")


def main(args: argparse.Namespace) -> int:
    """Run ``minillm bench chunked``; print the table, write the JSON and the plot."""
    from ..viz.bench import plot_chunked

    report = run_chunked_bench(args.model, args.budgets, args.num_decodes, args.num_long,
                               tuple(args.long_range), args.dtype, args.device, args.threads,
                               log=log_to_stderr, long_tokens=args.long_tokens,
                               gap_steps=args.gap_steps, seed=args.seed,
                               repeats=args.repeats)
    return write_report(args, report, chunked_table(report), plot_chunked)


__all__ = ["BUDGETS", "ChunkedWorkload", "calibrate", "chunked_table", "chunked_workload",
           "inter_token_latencies", "itl_stats", "make_prompts", "p50_p90_max", "policy_runs",
           "ratios", "run_chunked", "run_chunked_bench", "run_policy", "same_outputs_check",
           "summarize", "workload_prompts"]
