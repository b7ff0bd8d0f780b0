"""SmolLM2 through each engine path, one slow test per path: preemption by recompute and by swap,
chunked prefill and the interpreted Triton kernels give each request's greedy tokens alone, with
logprobs within fp32 rounding of the full forward; n = 3 samples and beam search.
"""
from __future__ import annotations

import pytest
from engine_checks import full_logprobs, run_all

from minillm import SamplingParams
from minillm.engine import EngineConfig, LLMEngine
from minillm.generate import generate

REAL_TEXTS = ["The capital of France is", "def add(a, b):\n    return",
              "List three colours:", "In 1969, the first humans"]


def real_prompts(tok, repeat: int = 1) -> list[list[int]]:
    return [tok.encode(t * repeat) for t in REAL_TEXTS]


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    dict(preemption="recompute", num_kv_blocks=14, block_size=4, watermark=0),
    dict(preemption="swap", num_kv_blocks=14, block_size=4, watermark=0),
    dict(max_num_batched_tokens=16, max_num_seqs=4),           # chunked prefill
    dict(attention_backend="triton", num_kv_blocks=40, block_size=8),  # interpreted kernels
])
def test_real_model_paths_equal_each_request_alone(real, options):
    """SmolLM2 through each engine path: the same greedy tokens, and logprobs within fp32
    rounding, as each request alone through the contiguous-cache loop."""
    from minillm.device import setup_triton

    setup_triton()
    model, tok = real
    triton = options.get("attention_backend") == "triton"
    prompts = real_prompts(tok, 1 if triton else 3)[:2 if triton else 4]
    params = SamplingParams(temperature=0.0, max_tokens=3 if triton else 10, ignore_eos=True,
                            logprobs=1)
    engine = LLMEngine(model, tok, EngineConfig(**{"num_kv_blocks": 64, **options}))
    outs = run_all(engine, prompts, params)
    if "preemption" in options:
        assert sum(o.metrics.num_preemptions for o in outs) > 0
    for p, o in zip(prompts, outs):
        assert o.token_ids == generate(model, p, params)
        ref = full_logprobs(model, p + o.token_ids)
        for i, (t, entry) in enumerate(zip(o.token_ids, o.outputs[0].logprobs)):
            assert abs(entry[t] - ref[len(p) - 1 + i, t]) < 1e-3


@pytest.mark.slow
def test_real_model_parallel_sampling_and_beam_search(real):
    """n = 3 greedy samples share the prompt's blocks (copy-on-write on the first decode) and
    each equals the request alone; beam search equals a plain beam search without a cache."""
    from test_engine import reference_beam_search

    model, tok = real
    prompt = tok.encode(REAL_TEXTS[0])
    engine = LLMEngine(model, tok, EngineConfig(num_kv_blocks=40, block_size=4))
    greedy = SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True)
    out = run_all(engine, [prompt], greedy)[0]
    assert all(c.token_ids == generate(model, prompt, greedy) for c in out.outputs)
    beams = run_all(engine, [prompt], SamplingParams(beam_width=2, n=2, max_tokens=5))[0]
    ref = reference_beam_search(model, prompt, 2, 5, model.cfg.eos_token_id)
    assert [c.token_ids for c in beams.outputs] == ref[:2]
