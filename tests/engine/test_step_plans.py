"""Step plans in tokens through the whole engine: chunked prefill under a token budget gives the
same tokens and logprobs as one pass, a long prompt does not wait behind decodes, prompt logprobs
across chunks and a recompute, and engine options and prompts that break the budget are refused.

References: the model's own forward pass without any cache in float64, each request run alone.
The model is the tiny preset with sharpened q/k (attention peaked, so a wrong KV cache changes
the outputs: ``test_context_matters`` makes sure).
"""
from __future__ import annotations

import pytest
import torch
from engine_checks import assert_all_free, full_logprobs, prompts_of, run_all, sharp_model

from minillm import SamplingParams
from minillm.engine import EngineConfig, LLMEngine
from minillm.engine.scheduler import SchedulerOutput
from minillm.generate import generate

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_context_matters(sharp):
    """The test model's next token depends on its context: changing the first token of 40
    changes the greedy choice at most later positions and moves the logits by orders of
    magnitude more than the tests' tolerance, so a wrong KV cache cannot go unseen."""
    a = prompts_of([40], seed=1)[0]
    b = [a[0] + 1] + a[1:]
    with torch.no_grad():
        la, lb = (sharp(torch.tensor([p]))[0] for p in (a, b))
    assert (la.argmax(-1) != lb.argmax(-1))[1:].double().mean() > 0.5
    assert (la[-1] - lb[-1]).abs().max() > 0.1


# ---- step plans in tokens ---------------------------------------------------------------------
@pytest.mark.parametrize("budget", [16, 64, 1000])
def test_chunked_prefill_gives_the_same_tokens_and_logprobs(budget):
    """Prompts of 1 to 2,000 tokens under budgets from 16: the same greedy tokens (fp32) as
    with chunking off (a large budget) and as each request alone, the same logprobs, and the
    budget holds in every step."""
    model = sharp_model(torch.float32)
    prompts = prompts_of([1, 17, 300, 2000, 5])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    chunked = LLMEngine(model, None, EngineConfig(num_kv_blocks=600, max_num_batched_tokens=budget,
                                                  max_num_seqs=4, block_size=16))
    outs = run_all(chunked, prompts, params)
    assert all(sum(r.scheduled.values()) <= budget for r in chunked.trace)
    whole = LLMEngine(model, None, EngineConfig(num_kv_blocks=600, max_num_batched_tokens=4096,
                                                enable_chunked_prefill=False))
    ref = run_all(whole, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref] == \
        [generate(model, p, params) for p in prompts]
    for o, r in zip(outs, ref):
        for a, b in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_a_long_prompt_does_not_wait_behind_decodes(sharp):
    """Budget 64, two requests decoding: a 100-token prompt is admitted in the very next step
    (a 62-token chunk next to the 2 decodes) and finishes its prefill in the one after."""
    engine = LLMEngine(sharp, None, EngineConfig(num_kv_blocks=100, max_num_batched_tokens=64,
                                                 max_num_seqs=4))
    for p in prompts_of([5, 6]):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.step()
    rid = engine.add_request(prompts_of([100], seed=2)[0], GREEDY)
    engine.step()
    engine.step()
    first, second = list(engine.trace)[-2:]
    assert first.scheduled[rid] == 62 and second.scheduled[rid] == 38
    while engine.has_unfinished():
        engine.step()
    assert_all_free(engine)


def test_logprobs_equal_the_full_forward(sharp):
    """Every output token's logprob and top-3 alternatives, sampled at temperature 1 with a
    chunked prompt, equal log_softmax of the model's own logits over the finished sequence."""
    prompt = prompts_of([45])[0]
    params = SamplingParams(temperature=1.0, max_tokens=7, seed=5, logprobs=3, ignore_eos=True)
    engine = LLMEngine(sharp, None, EngineConfig(num_kv_blocks=50, max_num_batched_tokens=16,
                                                 max_num_seqs=4))
    out = run_all(engine, [prompt], params)[0].outputs[0]
    ref = full_logprobs(sharp, prompt + out.token_ids)
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert list(entry)[0] == tok and abs(entry[tok] - row[tok]) < 1e-5   # fp32 logprobs
        top = row.topk(3)
        assert set(top.indices.tolist()) <= set(entry)
        assert all(abs(entry[t] - v) < 1e-5 for t, v in zip(top.indices.tolist(),
                                                            top.values.tolist()))


def test_prompt_logprobs_across_chunks(sharp):
    prompt = prompts_of([50])[0]
    engine = LLMEngine(sharp, None, EngineConfig(num_kv_blocks=50, max_num_batched_tokens=16,
                                                 max_num_seqs=4))
    out = run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=2,
                                                   prompt_logprobs=2))[0]
    ref = full_logprobs(sharp, prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert abs(entry[prompt[i]] - ref[i - 1, prompt[i]]) < 1e-5 and len(entry) in (2, 3)


def test_prompt_logprobs_survive_recompute_mid_prompt(sharp):
    """Preempted (recompute) after two of its four chunks, the prompt is computed again from
    the start: its prompt logprobs are rewritten, not repeated."""
    prompt = prompts_of([60], seed=5)[0]
    engine = LLMEngine(sharp, None, EngineConfig(num_kv_blocks=50, max_num_batched_tokens=16,
                                                 max_num_seqs=4))
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2,
                                                    prompt_logprobs=1))
    engine.step()
    engine.step()
    req = engine.requests[rid]
    assert 0 < len(req.prompt_logprobs) < len(prompt)
    engine.scheduler.running.remove(req)
    engine.scheduler._preempt(req, SchedulerOutput())
    out = None
    while engine.has_unfinished():
        out = engine.step() or out
    ref = full_logprobs(sharp, prompt)
    got = out[0].prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    assert all(abs(e[prompt[i]] - ref[i - 1, prompt[i]]) < 1e-5
               for i, e in enumerate(got[1:], start=1))
    assert_all_free(engine)



def test_parallel_samples_are_admitted_at_their_forked_width(sharp):
    """A request with n samples holds one sequence until its first token forks it into n: the
    scheduler counts it at n, so requests that fit one by one never overfill a later step."""
    engine = LLMEngine(sharp, None, EngineConfig(num_kv_blocks=64, max_num_seqs=8))
    params = [SamplingParams(temperature=1.0, n=5, max_tokens=4, seed=i, ignore_eos=True)
              for i in range(3)]
    outs = run_all(engine, prompts_of([9, 12, 7]), params)
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs) == 5 for o in outs), \
        [o.error for o in outs]
    with pytest.raises(ValueError, match="at most max_num_seqs"):
        engine.add_request(prompts_of([9])[0], SamplingParams(n=9, max_tokens=2))
    assert_all_free(engine)


# ---- bad input -------------------------------------------------------------------------------
@pytest.mark.parametrize("options, name", [
    (dict(max_num_batched_tokens=8, block_size=16, max_num_seqs=4), "block_size"),
    (dict(max_num_batched_tokens=32, max_num_seqs=64), "max_num_seqs"),
    (dict(trace_steps=0), "trace_steps"),
])
def test_bad_engine_options_name_the_parameter(options, name):
    with pytest.raises(ValueError, match=f"max_num_batched_tokens|{name}") as err:
        EngineConfig(**options)
    assert name in str(err.value)


def test_prompt_too_long_for_one_step_without_chunking(sharp):
    engine = LLMEngine(sharp, None, EngineConfig(num_kv_blocks=80, max_num_batched_tokens=64,
                                                 enable_chunked_prefill=False, max_num_seqs=4))
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        engine.add_request(prompts_of([100])[0], GREEDY)
    assert_all_free(engine)
