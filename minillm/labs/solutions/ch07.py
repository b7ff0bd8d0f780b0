"""Chapter 07's key: reference solutions, written from the rules the chapter teaches."""
from __future__ import annotations

from minillm.labs import ch07


def schedule_step(decoding, prompts, budget):
    plan = {rid: 1 for rid in decoding}
    room = budget - len(decoding)
    for rid, left in prompts:
        n = min(left, room)
        if n <= 0:
            break
        plan[rid] = n
        room -= n
    return plan


def goodput(curve, ttft_slo, tpot_slo, attainment):
    good = 0.0
    for rate, reqs in sorted(curve):
        ok = sum(a <= ttft_slo and b <= tpot_slo for a, b in reqs) / len(reqs)
        if ok < attainment:
            break
        good = rate
    return good


KEY = [
    (ch07.check_schedule_step, schedule_step),
    (ch07.check_goodput, goodput),
]
