"""Speculation under load (``python -m minillm bench spec``, on by default there; chapter 06b).

The same target and greedy decoding as :mod:`.spec`, on ``num_requests`` held-out prompts of
the three kinds taking turns (chat template), each with ``max_tokens`` output tokens at most:

- **acceptance length at equal verification budgets**: for each budget of n draft tokens per
  sequence per round, chains draft k = n (capped at the method's most), trees (medusa, eagle,
  ddtree) get ``tree_nodes`` = n at their default depth, DSpark a ``verify_budget`` of n per
  sequence of the batch (:func:`budget_options`); reported: mean tokens per round, acceptance
  by position and the draft tokens actually verified per round (early exit and prompt
  lookup's misses verify fewer). The requests run all at once: acceptance does not depend on
  the batch, only the time does.
- **speedup against a request rate**: the requests arrive as a seeded Poisson process and are
  served by :func:`minillm.driver.drive` (add every request whose arrival time
  has passed, step the engine; when nothing runs, jump to the next arrival: a virtual clock
  that advances by each step's measured wall time, so idle gaps cost nothing), on the plain
  engine and on each method at its default k, DSpark twice (``verify_budget`` = max_num_seqs
  and 4x). Per run: output tokens/s from the first arrival to the last token, mean and p90
  end-to-end latency, mean TTFT and TPOT (s); against the plain engine at the same rate: the
  throughput speedup and the latency speedup (plain latency / its latency), and per method
  the break-even rate, where its latency speedup first falls to 1 (log-linear between the two
  rates around it).

The drafters' cost per round at batch 1 comes from :func:`.spec.drafter_costs` (part I's
runs); :func:`spec_load_tables` prints it with the two sweeps.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

from ..config import SamplingParams
from ..driver import drive
from ..engine import LLMEngine
from ..spec_decode.config import MAX_TOKENS, TREE_METHODS
from ..spec_decode.prompts import KINDS
from ..spec_decode.speculator import SpecStats
from ..workloads import Workload, poisson_arrivals
from .common import format_table
from .spec import DEFAULT_K, chat_prompts, make_engine, measure, warm_up

BUDGETS = (4, 8, 16)                  # draft tokens verified per sequence per round
RATES = (0.5, 1.0, 2.0, 4.0, 8.0)     # requests / s
NUM_REQUESTS, MAX_NEW_TOKENS = 8, 48  # the load sweeps' requests and their output tokens


def load_prompts(tok, n: int) -> list[list[int]]:
    """``n`` held-out prompts (token ids, chat template), the kinds taking turns."""
    per_kind = {kind: chat_prompts(tok, kind, -(-n // len(KINDS))) for kind in KINDS}
    return [per_kind[KINDS[i % len(KINDS)]][i // len(KINDS)] for i in range(n)]


def budget_options(method: str, nodes: int, max_seqs: int = 1) -> tuple[int, dict]:
    """(k, more speculative_config keys) with which ``method`` verifies at most ``nodes``
    draft tokens per sequence per round: a tree ``tree_nodes`` = nodes at its default depth, a
    chain k = nodes capped at MAX_TOKENS[method]; DSpark's budget is shared by the batch, so
    it gets ``verify_budget`` = nodes x ``max_seqs``."""
    if method in TREE_METHODS:
        return DEFAULT_K[method], {"tree_nodes": nodes}
    k = min(nodes, MAX_TOKENS[method])
    return k, ({"verify_budget": nodes * max_seqs} if method == "dspark" else {})


def equal_budget_runs(target, tok, methods, budgets, prompts: list[list[int]],
                      params: SamplingParams, drafters: dict | None = None,
                      log=print) -> list[dict]:
    """One row per method and budget (:func:`budget_options`), every prompt at once; a
    budget that gives a method the options of a smaller one reuses that run."""
    rows, done = [], {}
    for m in methods:
        for nodes in budgets:
            k, extra = budget_options(m, nodes, len(prompts))
            key = (m, k, tuple(sorted(extra.items())))
            if key not in done:
                done[key] = asdict(measure(target, tok, m, k, "mixed", prompts, len(prompts),
                                           params, extra=extra,
                                           drafter=(drafters or {}).get(m)))
            row = done[key] | {"budget": nodes, **extra}
            rows.append(row)
            log(f"{m:>11} budget {nodes:>2} (k={k}{''.join(f', {a}={b}' for a, b in extra.items())}"
                f"): {row['mean_accepted']:.2f} tokens/round, {row['nodes_per_round']:.1f} "
                f"nodes/round")
    return rows


@dataclass(frozen=True)
class LoadConfig:
    """One server of the rate sweep: ``method`` None is the plain engine; ``extra``: more
    speculative_config keys."""

    label: str
    method: str | None
    k: int = 0
    extra: dict = field(default_factory=dict)


def load_configs(methods, max_seqs: int) -> list[LoadConfig]:
    """The plain engine, then each method at its default k; DSpark with ``verify_budget`` =
    ``max_seqs`` (about one draft token per running sequence) and 4x that."""
    configs = [LoadConfig("none", None)]
    for m in methods:
        budgets = (max_seqs, 4 * max_seqs) if m == "dspark" else (None,)
        configs += [LoadConfig(m if b is None else f"{m} (budget {b})", m, DEFAULT_K[m],
                               {} if b is None else {"verify_budget": b}) for b in budgets]
    return configs


def serve_at_rate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                  rate: float, seed: int = 0) -> dict:
    """Every prompt arriving as a Poisson process of ``rate`` requests/s (seeded), served to
    the end; times in seconds of the virtual clock, throughput in output tokens/s."""
    if engine.speculator is not None:
        engine.speculator.stats = SpecStats()
    arrivals = poisson_arrivals(len(prompts), rate, seed)
    run = drive(engine, Workload(prompts, [params.max_tokens] * len(prompts)), params, arrivals)
    tpots = [(r.finished - r.first_token) / (r.output_len - 1) for r in run.records
             if r.output_len > 1]
    s = engine.speculator.stats if engine.speculator is not None else None
    return {"rate": rate, "seconds": run.makespan, "tokens": run.output_tokens,
            "throughput": run.throughput, "latency": run.mean("e2e"),
            "p90_latency": run.percentile("e2e", 0.9), "ttft": run.mean("ttft"),
            "tpot": statistics.mean(tpots) if tpots else None, "mean_running": run.mean_running,
            "mean_accepted": s.mean_accepted if s else 1.0,
            "nodes_per_round": s.nodes / s.rounds if s and s.rounds else 0.0}


def rate_runs(target, tok, configs: list[LoadConfig], rates, prompts: list[list[int]],
              params: SamplingParams, seed: int = 0, drafters: dict | None = None,
              log=print) -> list[dict]:
    """One row per config and rate (one warmed-up engine per config, room for every
    request at once), with the speedups of :func:`with_speedups`."""
    rows = []
    for c in configs:
        engine = make_engine(target, tok, c.method, c.k, len(prompts), extra=c.extra,
                             drafter=(drafters or {}).get(c.method))
        warm_up(engine, prompts[0])
        for rate in rates:
            row = {"label": c.label, "method": c.method or "none", "k": c.k, **c.extra,
                   **serve_at_rate(engine, prompts, params, rate, seed)}
            rows.append(row)
            log(f"{c.label:>20} {rate:5.2f} req/s: {row['throughput']:7.1f} tok/s, latency "
                f"{row['latency']:6.2f} s, {row['mean_accepted']:.2f} tokens/round")
    return with_speedups(rows)


def with_speedups(rows: list[dict]) -> list[dict]:
    """Each row with ``speedup`` (its throughput / the plain engine's at the same rate) and
    ``latency_speedup`` (the plain engine's mean latency / its own)."""
    plain = {r["rate"]: r for r in rows if r["method"] == "none"}
    return [r | {"speedup": r["throughput"] / plain[r["rate"]]["throughput"],
                 "latency_speedup": plain[r["rate"]]["latency"] / r["latency"]} for r in rows]


def break_even(rows: list[dict]) -> dict[str, float | None]:
    """Per label: the rate (requests/s) where the latency speedup first falls from above 1 to
    1 or below, interpolated in log rate; 0.0 if it is not above 1 even at the lowest rate
    (it never pays), None if it never falls (it pays at every rate of the sweep)."""
    out = {}
    for label in dict.fromkeys(r["label"] for r in rows if r["method"] != "none"):
        pts = sorted((r["rate"], r["latency_speedup"]) for r in rows if r["label"] == label)
        out[label] = None
        for i, (rate, s) in enumerate(pts):
            if s <= 1:
                if i == 0:
                    out[label] = 0.0
                else:
                    (r0, s0) = pts[i - 1]
                    f = (s0 - 1) / (s0 - s)
                    out[label] = math.exp(math.log(r0) + f * (math.log(rate) - math.log(r0)))
                break
    return out


def run_load_sweeps(target, tok, methods, budgets=BUDGETS, rates=RATES,
                    num_requests: int = NUM_REQUESTS, max_tokens: int = MAX_NEW_TOKENS,
                    seed: int = 0, prompts: list[list[int]] | None = None,
                    drafters: dict | None = None, log=print) -> dict:
    """Both sweeps of the module docstring on ``prompts`` (default: :func:`load_prompts`);
    ``drafters``: method -> (module, head, manifest) instead of the packaged weights."""
    prompts = prompts or load_prompts(tok, num_requests)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    budget_rows = equal_budget_runs(target, tok, methods, budgets, prompts, params, drafters,
                                    log)
    rows = rate_runs(target, tok, load_configs(methods, len(prompts)), rates, prompts, params,
                     seed, drafters, log)
    return {"config": {"budgets": list(budgets), "rates": list(rates),
                       "num_requests": len(prompts), "max_tokens": max_tokens, "seed": seed,
                       "max_num_seqs": len(prompts)},
            "equal_budget": budget_rows, "rates": rows, "break_even": break_even(rows)}


def spec_load_tables(report: dict) -> str:
    """The drafters' cost per round and, when the report has them, both load sweeps."""
    parts = [format_table(
        [("drafter cost (batch 1)", "<22"), ("k", ">2"), ("ms/round", ">8.2f"),
         ("plain ms/token", ">14.2f"), ("ratio", ">6.2f"), ("nodes/round", ">11.1f")],
        [(r["method"], r["k"], r["draft_ms_per_round"], r["plain_ms_per_token"], r["ratio"],
          r["nodes_per_round"]) for r in report.get("drafter_cost", [])])]
    load = report.get("load")
    if load:
        parts.append(format_table(
            [("equal budget", "<12"), ("budget", ">6"), ("k", ">2"), ("nodes/round", ">11.1f"),
             ("tok/round", ">9.2f"), ("acceptance by position", "<30")],
            [(r["method"], r["budget"], r["k"], r["nodes_per_round"], r["mean_accepted"],
              " ".join(f"{a:.2f}" for a in r["acceptance"][:8])) for r in load["equal_budget"]]))
        parts.append(format_table(
            [("request rate", "<20"), ("req/s", ">5.2f"), ("tok/s", ">7.1f"),
             ("speedup", ">7.2f"), ("latency s", ">9.2f"), ("x plain", ">7.2f"),
             ("ttft s", ">6.2f"), ("tpot ms", ">7.1f"), ("tok/round", ">9.2f")],
            [(r["label"], r["rate"], r["throughput"], r["speedup"], r["latency"],
              r["latency_speedup"], r["ttft"], 1e3 * (r["tpot"] or math.nan),
              r["mean_accepted"]) for r in load["rates"]]))
        even = [f"{k} {'beyond the sweep' if v is None else f'{v:.2f}'}"
                for k, v in load["break_even"].items()]
        parts.append("break-even rate (req/s; latency no better than plain from there): "
                     + ", ".join(even))
    return "\n\n".join(parts)
