"""The in-engine checks' shared pieces: a greedy run reports its tokens and steps and refuses to
pass with a block still in use; two runs are compared token by token."""
from __future__ import annotations

import pytest

from minillm.config import SamplingParams
from minillm.engine import EngineConfig, LLMEngine
from minillm.generate import generate
from minillm.labs.in_engine import assert_same_tokens, demo_model, demo_prompts, serve_greedy


def test_a_greedy_run_equals_each_request_alone_and_frees_every_block():
    model = demo_model()
    prompts, lens = demo_prompts(4)
    run = serve_greedy(LLMEngine(model, None, EngineConfig(num_kv_blocks=64)), prompts, lens)
    for p, m, got in zip(prompts, lens, run["tokens"]):
        assert got == generate(model, p, SamplingParams(temperature=0, max_tokens=m,
                                                        ignore_eos=True))
    assert run["steps"] >= max(lens) and run["preemptions"] == 0


def test_a_leaked_block_fails_the_run():
    class Leaky(LLMEngine):
        def step(self):
            outs = super().step()
            if not self.has_unfinished() and not getattr(self, "leaked", False):
                self.blocks.allocate(10**6, 3)          # a sequence nobody frees
                self.leaked = True
            return outs

    prompts, lens = demo_prompts(2)
    with pytest.raises(AssertionError, match="KV blocks still in use"):
        serve_greedy(Leaky(demo_model(), None, EngineConfig(num_kv_blocks=64)), prompts, lens)


def test_differing_tokens_name_the_request_and_position():
    with pytest.raises(AssertionError, match="request 1: token 2 is \\[9\\]"):
        assert_same_tokens({"tokens": [[1, 2], [3, 4, 9]]}, {"tokens": [[1, 2], [3, 4, 5]]})
