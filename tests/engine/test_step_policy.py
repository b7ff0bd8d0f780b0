"""The three step policies of chapter 07 (prefill-first, decode-first, chunked prefill): what one
step holds when a prompt arrives while requests decode, checked on the scheduler's plan; and the
limits every step keeps: prompts admitted together share one token budget (conftest checks every
plan against it), and a request preempted by recompute is computed again from its first token."""
from __future__ import annotations

import pytest
from engine_checks import prompts_of, run_all, sharp_model

from minillm import SamplingParams
from minillm.cache.block_manager import BlockManager
from minillm.engine import EngineConfig, LLMEngine
from minillm.engine.plan import PlanError, check_plan
from minillm.engine.scheduler import Scheduler, SchedulerConfig
from minillm.engine.sequence import Request


def decoding_plus_new_prompt(policy: str, budget: int = 64):
    """Three requests decoding (their prompts computed, one token each to go) and a waiting
    prompt of 100 tokens: the next step's plan as {request id: tokens}."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, step_policy=policy),
                      BlockManager(64, 16), 4096)
    params = SamplingParams(max_tokens=8)
    for i in range(3):
        sched.add(Request(f"d{i}", list(range(10)), params))
    first = sched.schedule()                       # the three prompts, whole
    for w in first.seqs:
        w.seq.num_computed += w.num_tokens
        w.seq.token_ids.append(7)                  # their first sampled token
    sched.add(Request("p", list(range(100)), params))
    plan = sched.schedule()
    return {r.request_id: plan.tokens_of(r) for r in plan.requests}


def test_prefill_first_stalls_the_decodes_for_the_whole_prompt():
    assert decoding_plus_new_prompt("prefill_first", budget=128) == {"p": 100}


def test_decode_first_holds_the_prompt_while_anything_decodes():
    assert decoding_plus_new_prompt("decode_first") == {"d0": 1, "d1": 1, "d2": 1}


def test_chunked_fills_the_budget_with_decodes_then_a_chunk():
    assert decoding_plus_new_prompt("chunked", budget=64) == {"d0": 1, "d1": 1, "d2": 1,
                                                              "p": 61}


def test_step_policy_sets_the_two_switches_it_stands_for():
    assert SchedulerConfig(step_policy="chunked").mixed
    cfg = SchedulerConfig(step_policy="prefill_first")
    assert not cfg.mixed and not cfg.enable_chunked_prefill


def test_unknown_step_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="step_policy"):
        SchedulerConfig(step_policy="sarathi")


# ---- the token budget holds for every plan ------------------------------------------------
def test_several_prompts_admitted_at_once_share_one_budget():
    """Three waiting prompts of 30 tokens, chunked prefill, a budget of 64: the first two run
    whole and the third gets the 4 tokens left (a chunk), never a budget of its own; every
    later step stays within the budget until all three prompts are computed."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                                      step_policy="chunked"), BlockManager(64, 16), 4096)
    for name in "abc":
        sched.add(Request(name, list(range(30)), SamplingParams(max_tokens=4)))
    plan = sched.schedule()
    assert {r.request_id: plan.tokens_of(r) for r in plan.requests} == {"a": 30, "b": 30,
                                                                        "c": 4}
    computed = 0
    while plan.seqs:
        assert plan.num_tokens <= 64
        for w in plan.seqs:
            w.seq.num_computed += w.num_tokens
            computed += w.num_tokens
            if w.seq.num_computed == w.seq.num_tokens:
                sched.finish(next(r for r in plan.requests if w.seq in r.seqs))
        plan = sched.schedule()
    assert computed == 90


def test_an_engine_prefilling_several_long_prompts_keeps_its_budget():
    """Four prompts of 20 to 40 tokens arrive together at an engine with a budget of 16
    (chunked prefill): the greedy tokens equal those of an engine that runs each prompt whole,
    and every step's plan stays within the budget (conftest checks each plan)."""
    budget = 16
    model = sharp_model(max_seq_len=128, vocab_size=2000)
    prompts = prompts_of([40, 20, 33, 28], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    small = LLMEngine(model, None, EngineConfig(num_kv_blocks=60, block_size=8, max_num_seqs=8,
                                                max_num_batched_tokens=budget))
    plans: list[int] = []
    small.plan_hooks.append(lambda engine, plan: plans.append(plan.num_tokens))
    got = [o.token_ids for o in run_all(small, prompts, params)]
    whole = LLMEngine(model, None, EngineConfig(num_kv_blocks=60, block_size=8,
                                                max_num_batched_tokens=512))
    assert got == [o.token_ids for o in run_all(whole, prompts, params)]
    assert max(plans) == budget                    # the budget was the binding limit
    assert all(n <= budget for n in plans)


def test_a_plan_over_a_limit_is_reported():
    """The check the engine (and conftest) applies to every plan names the limit it breaks."""
    config = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2)
    sched = Scheduler(config, BlockManager(16, 4), 4096)
    for name in "abc":
        sched.add(Request(name, list(range(6)), SamplingParams(max_tokens=2)))
    plan = sched.schedule()                        # a: 6 tokens, b: a chunk of 2
    assert plan.num_tokens == 8 and len(plan.seqs) == 2
    tables = sched.blocks.tables
    check_plan(plan, config, tables, 4)
    with pytest.raises(PlanError, match="max_num_batched_tokens=4"):
        check_plan(plan, SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=2), tables, 4)
    with pytest.raises(PlanError, match="max_num_seqs=1"):
        check_plan(plan, SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=1), tables, 4)


def test_preempted_requests_are_computed_again_from_their_first_token():
    """Six requests in a pool of 16 blocks of 8 with a budget of 32 (chunked prefill): growing
    decodes preempt others by recompute, whose prompt and output so far are prefilled again
    from token 0 into new blocks. The greedy tokens equal those of an engine with room."""
    model = sharp_model(max_seq_len=128, vocab_size=2000)
    prompts = prompts_of([30, 28, 25, 31, 29, 27], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tight = LLMEngine(model, None, EngineConfig(num_kv_blocks=16, block_size=8, watermark=0,
                                                preemption="recompute", max_num_seqs=8,
                                                max_num_batched_tokens=32))
    outs = run_all(tight, prompts, params)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    roomy = LLMEngine(model, None, EngineConfig(num_kv_blocks=120, block_size=8))
    assert [o.token_ids for o in outs] == [o.token_ids for o in run_all(roomy, prompts, params)]
