"""The three step policies of chapter 07 (prefill-first, decode-first, chunked prefill): what one
step holds when a prompt arrives while requests decode, checked on the scheduler's plan."""
from __future__ import annotations

import pytest

from minillm import SamplingParams
from minillm.cache.block_manager import BlockManager
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
