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


def scatter_kv(k, v, k_cache, v_cache, block_table):
    bs = k_cache.shape[2]
    for i, block in enumerate(block_table):
        chunk = slice(i * bs, min((i + 1) * bs, k.shape[1]))
        n = chunk.stop - chunk.start
        k_cache[:, block, :n] = k[:, chunk]
        v_cache[:, block, :n] = v[:, chunk]


def ttft_tpot(arrival, token_times):
    first, last, n = token_times[0], token_times[-1], len(token_times)
    return first - arrival, (last - first) / (n - 1) if n > 1 else 0.0


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
    (ch07.check_schedule_step_in_engine, schedule_step),
    (ch07.check_scatter_kv, scatter_kv),
    (ch07.check_scatter_kv_in_engine, scatter_kv),
    (ch07.check_ttft_tpot, ttft_tpot),
    (ch07.check_goodput, goodput),
]
