"""Chapter 07 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import torch
from lab_checks import checker_tests

from minillm.labs import ch07
from minillm.labs.solutions import ch07 as key

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


def budget_for_prompts_only(decoding, prompts, budget):
    """The whole budget goes to prompt chunks, the decodes on top of it."""
    return key.schedule_step([], prompts, budget) | {rid: 1 for rid in decoding}


def scatter_contiguous(k, v, k_cache, v_cache, block_table):
    """Writes the tokens into blocks 0, 1, 2, ... as if the table were the identity."""
    key.scatter_kv(k, v, k_cache, v_cache, list(range(len(block_table))))


def scatter_transposed(k, v, k_cache, v_cache, block_table):
    """Token t to block table[t % len(table)], slot t // len(table): the two indices swapped."""
    nb = len(block_table)
    for t in range(k.shape[1]):
        k_cache[:, block_table[t % nb], t // nb] = k[:, t]
        v_cache[:, block_table[t % nb], t // nb] = v[:, t]


def scatter_first_layer(k, v, k_cache, v_cache, block_table):
    """Only layer 0 (one layer's send taken for the whole transfer)."""
    key.scatter_kv(k[:1], v[:1], k_cache[:1], v_cache[:1], block_table)


def tpot_over_all_tokens(arrival, token_times):
    """TPOT as (last - first) / n: the first token counted as a decode."""
    ttft, _ = key.ttft_tpot(arrival, token_times)
    return ttft, (token_times[-1] - token_times[0]) / len(token_times)


def tpot_from_arrival(arrival, token_times):
    """TPOT as the mean time per token since arrival (the prefill counted in)."""
    return token_times[0] - arrival, (token_times[-1] - arrival) / len(token_times)


def best_passing_rate(curve, ttft_slo, tpot_slo, attainment):
    """The highest rate that passes, even above one that fails."""
    ok = [r for r, q in curve
          if sum(a <= ttft_slo and b <= tpot_slo for a, b in q) / len(q) >= attainment]
    return max(ok, default=0.0)


def either_slo(curve, ttft_slo, tpot_slo, attainment):
    """A request counts as good when it meets either SLO."""
    return key.goodput([(r, [(0, 0) if (a <= ttft_slo or b <= tpot_slo) else (1e9, 1e9)
                             for a, b in q]) for r, q in curve], ttft_slo, tpot_slo, attainment)


def strict_slo(curve, ttft_slo, tpot_slo, attainment):
    """A request exactly at an SLO counted as a miss (< instead of <=)."""
    return key.goodput([(r, [(a, b) if (a < ttft_slo and b < tpot_slo) else (1e9, 1e9)
                             for a, b in q]) for r, q in curve], ttft_slo, tpot_slo, attainment)


CHECKS = [
    (ch07.check_schedule_step, key.schedule_step, prompts_first),
    (ch07.check_schedule_step, key.schedule_step, whole_prompts_only),
    (ch07.check_schedule_step_in_engine, key.schedule_step, prompts_first),
    (ch07.check_schedule_step_in_engine, key.schedule_step, whole_prompts_only),
    (ch07.check_schedule_step_in_engine, key.schedule_step, budget_for_prompts_only),
    (ch07.check_scatter_kv, key.scatter_kv, scatter_contiguous),
    (ch07.check_scatter_kv, key.scatter_kv, scatter_transposed),
    (ch07.check_scatter_kv, key.scatter_kv, scatter_first_layer),
    (ch07.check_scatter_kv_in_engine, key.scatter_kv, scatter_contiguous),
    (ch07.check_scatter_kv_in_engine, key.scatter_kv, scatter_transposed),
    (ch07.check_scatter_kv_in_engine, key.scatter_kv, scatter_first_layer),
    (ch07.check_ttft_tpot, key.ttft_tpot, tpot_over_all_tokens),
    (ch07.check_ttft_tpot, key.ttft_tpot, tpot_from_arrival),
    (ch07.check_goodput, key.goodput, best_passing_rate),
    (ch07.check_goodput, key.goodput, either_slo),
    (ch07.check_goodput, key.goodput, strict_slo),
]
IDS = ["step_prompts_first", "step_whole_prompts", "engine_prompts_first",
       "engine_whole_prompts", "engine_over_budget", "scatter_contiguous", "scatter_transposed",
       "scatter_first_layer", "engine_scatter_contiguous", "engine_scatter_transposed",
       "engine_scatter_first_layer", "tpot_over_all_tokens", "tpot_from_arrival",
       "goodput_best_passing_rate", "goodput_either_slo", "goodput_strict_slo"]


test_reference_passes, test_wrong_fails, test_stub_is_not_attempted = \
    checker_tests(CHECKS, IDS)


def test_scheduler_states_reach_chunks_and_decodes():
    states = [s for seed in range(3) for s in ch07.scheduler_states(seed)]
    assert any(d and p for d, p, _, _ in states)
    assert any(any(want.get(rid, 0) not in (0, left) for rid, left in p)
               for _, p, _, want in states)       # a prompt was chunked


def test_the_chunked_workload_chunks_late_prompts_among_decodes():
    """The in-engine check's default run: a late prompt is split over steps that also decode."""
    prompts, lens, steps = ch07.late_prompts_workload()
    engine = ch07.LLMEngine(ch07.demo_model(), None, ch07.EngineConfig(
        step_policy="chunked", max_num_batched_tokens=16, max_num_seqs=len(prompts),
        block_size=4, num_kv_blocks=256))
    run = ch07.serve_arrivals(engine, prompts, lens, steps)
    late = [str(i) for i, s in enumerate(steps) if s > 0]
    mixed = [p for p in run["plans"] if any(0 < p.get(r, 0) < 16 for r in late)
             and sum(v == 1 for v in p.values()) >= 2]
    assert len(mixed) >= 2 and all(sum(p.values()) <= 16 for p in run["plans"])
    assert [len(t) for t in run["tokens"]] == lens


def test_a_plan_naming_an_unknown_request_fails_clearly():
    result = ch07.check_schedule_step_in_engine(
        lambda decoding, prompts, budget: {"nobody": 1, **key.schedule_step(decoding, prompts,
                                                                             budget)})
    assert result.passed is False and "nobody" in result.message


def test_the_scatter_check_hands_over_shuffled_blocks():
    """The decode engine's tables are not runs of consecutive blocks (the identity fails)."""
    alloc = ch07.ShuffledAllocator(32)
    taken = [alloc.take() for _ in range(8)]
    assert taken != sorted(taken) and len(set(taken)) == 8 and len(alloc) == 24
    alloc.put(taken[0])
    assert taken[0] in set(alloc) and len(alloc) == 25


def test_gather_kv_reads_a_sequence_in_token_order():
    pool = ch07.PagedKVPool(ch07.demo_model().cfg, 6, 4, torch.device("cpu"), torch.float64)
    pool.k.copy_(torch.randn(pool.k.shape, dtype=torch.float64))
    k, _ = ch07.gather_kv(pool, [4, 1], 6)
    assert k.shape == (pool.k.shape[0], 6, *pool.k.shape[3:])
    assert torch.equal(k[:, 5], pool.k[:, 1, 1]) and torch.equal(k[:, 0], pool.k[:, 4, 0])
