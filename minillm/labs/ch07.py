"""Checkers for the exercises of chapter 07 (prefill/decode scheduling and disaggregation).

- :func:`check_schedule_step`: one chunked-prefill step under a token budget, compared with the
  plan of the package's :class:`minillm.engine.scheduler.Scheduler` on states it reaches.
- :func:`check_goodput`: DistServe's goodput of a rate sweep, compared with the rule of
  :mod:`minillm.course.placement` (the highest rate below the lowest one that misses).
"""
from __future__ import annotations

import random
from collections.abc import Callable

from ..cache.block_manager import BlockManager
from ..config import SamplingParams
from ..engine.scheduler import Scheduler, SchedulerConfig
from ..engine.sequence import Request
from ..serving_metrics import SLO, goodput_of
from .common import Result, check

# --- one scheduling step -------------------------------------------------------------------


def scheduler_states(seed: int = 0, steps: int = 40):
    """Run the package's chunked scheduler on a seeded random arrival stream and yield, before
    each step, (decoding ids, [(prompt id, tokens left to prefill)] in arrival order, budget,
    the package's plan {request id: tokens})."""
    rng = random.Random(seed)
    budget = rng.choice([8, 16, 32, 64])
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=budget,
                                      step_policy="chunked"), BlockManager(4096, 16), 1 << 16)
    left: dict[str, int] = {}
    n = 0
    for _ in range(steps):
        for _ in range(rng.choice([0, 0, 1, 1, 2])):
            rid = f"r{n}"
            n += 1
            left[rid] = rng.randint(1, 6)
            sched.add(Request(rid, [rng.randint(5, 99) for _ in range(rng.randint(1, 90))],
                              SamplingParams(max_tokens=left[rid])))
        if not sched.has_unfinished():
            continue
        decoding = [r.request_id for r in sched._sorted(sched.running)
                    if not sched._prefilling(r)]
        prompts = [(r.request_id, r.num_new_tokens)
                   for r in sched._sorted(sched.running) + sched._sorted(sched.waiting)
                   if sched._prefilling(r) or r in sched.waiting]
        fits = len(sched.running) + len(sched.waiting) <= budget   # sequences never bind
        plan = sched.schedule()
        want = {r.request_id: plan.tokens_of(r) for r in plan.requests}
        if fits:
            yield decoding, prompts, budget, want
        for w in plan.seqs:
            done = w.completes
            w.seq.num_computed += w.num_tokens
            if done:
                w.seq.token_ids.append(7)
        for r in list(sched.running):
            out = len(r.seqs[0].token_ids) - len(r.prompt_ids)
            if out >= left[r.request_id]:
                sched.finish(r)


def _step_cases():
    cases = [(["d0", "d1", "d2"], [("p", 100)], 64, {"d0": 1, "d1": 1, "d2": 1, "p": 61}),
             ([], [("a", 10), ("b", 10)], 16, {"a": 10, "b": 6}),
             (["d0"], [("a", 15)], 16, {"d0": 1, "a": 15}),
             (["d0", "d1"], [], 8, {"d0": 1, "d1": 1}),
             (["d0", "d1"], [("a", 6), ("b", 3)], 8, {"d0": 1, "d1": 1, "a": 6})]
    for seed in range(12):
        cases += list(scheduler_states(seed))
    return cases


def check_schedule_step(fn: Callable) -> Result:
    """``fn(decoding, prompts, budget)`` -> {request id: tokens this step}. ``decoding``: ids of
    running requests that need one token each; ``prompts``: (id, tokens left to prefill) in
    arrival order. Decodes first, then the rest of the budget to prompts in order, a prompt
    longer than the room left getting a chunk of the room; ids with 0 tokens are left out.
    Compared with the package scheduler's plan on the states it reaches."""
    cases = _step_cases()

    def attempt() -> None:
        for decoding, prompts, budget, want in cases:
            got = fn(list(decoding), [tuple(p) for p in prompts], budget)
            got = {str(k): int(v) for k, v in dict(got).items() if int(v)}
            assert got == want, (f"decoding={decoding}, prompts={prompts}, budget={budget}: "
                                 f"expected {want}, got {got}")

    return check("schedule_step", attempt)


# --- goodput -------------------------------------------------------------------------------


def _goodput(curve, ttft_slo: float, tpot_slo: float, attainment: float = 0.9) -> float:
    """The package's rule on a sweep ``curve`` = [(rate, [(ttft, tpot), ...]), ...]."""
    slo = SLO(ttft_slo, tpot_slo)
    return goodput_of([(rate, sum(slo.met(a, b) for a, b in reqs) / len(reqs))
                       for rate, reqs in curve], attainment)


def _goodput_cases():
    rng = random.Random(7)
    cases = [([(1.0, [(0.1, 0.01)] * 10), (2.0, [(0.1, 0.01)] * 9 + [(0.1, 0.5)])], 0.2, 0.05,
              0.9),
             ([(1.0, [(0.1, 0.01)] * 10), (2.0, [(0.1, 0.01)] * 8 + [(0.5, 0.01)] * 2)], 0.2,
              0.05, 0.9),
             ([(2.0, [(0.3, 0.01)] * 4), (1.0, [(0.1, 0.01)] * 4)], 0.2, 0.05, 0.9),
             ([(1.0, [(0.3, 0.01)] * 4)], 0.2, 0.05, 0.5),
             # requests exactly at an SLO meet it
             ([(1.0, [(0.2, 0.05)] * 10), (2.0, [(0.2, 0.01)] * 10), (3.0, [(0.5, 0.5)] * 10)],
              0.2, 0.05, 0.9)]
    for _ in range(60):
        curve = []
        for k in range(rng.randint(1, 6)):
            load = rng.random() * (k + 1)
            curve.append((round(0.5 * (k + 1), 2),
                          [(rng.random() * load, rng.random() * 0.05 * load)
                           for _ in range(rng.randint(1, 12))]))
        rng.shuffle(curve)
        cases.append((curve, 0.5, 0.05, rng.choice([0.5, 0.8, 0.9, 1.0])))
    return cases


def check_goodput(fn: Callable) -> Result:
    """``fn(curve, ttft_slo, tpot_slo, attainment)`` -> goodput (requests/s). ``curve``: a list
    of (rate, [(ttft, tpot), ...] per request) in any order. A request is good when it meets
    both SLOs; a rate passes when at least ``attainment`` of its requests are good; goodput is
    the highest rate below the lowest rate that fails (0 if the lowest fails)."""
    cases = _goodput_cases()

    def attempt() -> None:
        for curve, a, b, att in cases:
            want = _goodput(curve, a, b, att)
            got = float(fn([(r, list(q)) for r, q in curve], a, b, att))
            short = [(r, len(q)) for r, q in curve]
            assert abs(got - want) < 1e-9, (
                f"rates (requests per rate) {short}, SLO ttft {a} s / tpot {b} s, attainment "
                f"{att}: expected goodput {want}, got {got}")

    return check("goodput", attempt)
