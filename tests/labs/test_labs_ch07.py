"""Chapter 07 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

from minillm.labs import ch07
from minillm.labs.solutions.ch07 import (
    goodput,
    schedule_step,
)

# --- wrong solutions ---------------------------------------------------------------------


def prompts_first(decoding, prompts, budget):
    """Prompts take the budget first, decodes get what is left (a stall for decodes)."""
    plan, room = {}, budget
    for rid, left in prompts:
        n = min(left, room)
        if n <= 0:
            break
        plan[rid] = n
        room -= n
    for rid in decoding[:room]:
        plan[rid] = 1
    return plan


def whole_prompts_only(decoding, prompts, budget):
    """No chunking: a prompt that does not fit waits."""
    plan, room = {rid: 1 for rid in decoding}, budget - len(decoding)
    for rid, left in prompts:
        if left > room:
            break
        plan[rid] = left
        room -= left
    return plan


def best_passing_rate(curve, ttft_slo, tpot_slo, attainment):
    """The highest rate that passes, even above one that fails."""
    ok = [r for r, q in curve
          if sum(a <= ttft_slo and b <= tpot_slo for a, b in q) / len(q) >= attainment]
    return max(ok, default=0.0)


def either_slo(curve, ttft_slo, tpot_slo, attainment):
    """A request counts as good when it meets either SLO."""
    return goodput([(r, [(0, 0) if (a <= ttft_slo or b <= tpot_slo) else (1e9, 1e9)
                         for a, b in q]) for r, q in curve], ttft_slo, tpot_slo, attainment)


def strict_slo(curve, ttft_slo, tpot_slo, attainment):
    """A request exactly at an SLO counted as a miss (< instead of <=)."""
    return goodput([(r, [(a, b) if (a < ttft_slo and b < tpot_slo) else (1e9, 1e9)
                         for a, b in q]) for r, q in curve], ttft_slo, tpot_slo, attainment)


def todo(*_):
    raise NotImplementedError


def test_schedule_step():
    assert ch07.check_schedule_step(schedule_step).passed is True
    assert ch07.check_schedule_step(prompts_first).passed is False
    assert ch07.check_schedule_step(whole_prompts_only).passed is False
    assert ch07.check_schedule_step(todo).passed is None


def test_scheduler_states_reach_chunks_and_decodes():
    states = [s for seed in range(3) for s in ch07.scheduler_states(seed)]
    assert any(d and p for d, p, _, _ in states)
    assert any(any(want.get(rid, 0) not in (0, left) for rid, left in p)
               for _, p, _, want in states)       # a prompt was chunked


def test_goodput():
    assert ch07.check_goodput(goodput).passed is True
    assert ch07.check_goodput(best_passing_rate).passed is False
    assert ch07.check_goodput(either_slo).passed is False
    assert ch07.check_goodput(strict_slo).passed is False
    assert ch07.check_goodput(todo).passed is None
