"""Generation loops on the tiny random model: cache == no cache, stops, and bad input."""
from __future__ import annotations

import pytest
import torch

from minillm import SamplingParams
from minillm.cache import KVCache
from minillm.generate import generate, generate_no_cache, stream


def test_cached_equals_uncached_greedy_and_seeded(tiny):
    model, _ = tiny
    prompt = [5, 17, 300, 2000, 7]
    for params in (SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=3, max_tokens=20,
                                  ignore_eos=True)):
        assert generate(model, prompt, params) == generate_no_cache(model, prompt, params)


def test_stops_at_eos_unless_ignored(tiny):
    model, _ = tiny
    prompt = [5, 17, 300]
    greedy = generate(model, prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    # make the model's first greedy token the EOS id: generation must stop right there
    eos_first = model.cfg.with_(eos_token_id=greedy[0])
    model.cfg, saved = eos_first, model.cfg
    try:
        assert generate(model, prompt, SamplingParams(temperature=0, max_tokens=8)) == greedy[:1]
        assert len(generate(model, prompt, SamplingParams(temperature=0, max_tokens=8,
                                                          ignore_eos=True))) == 8
    finally:
        model.cfg = saved


def test_generation_stops_at_the_context_window(tiny):
    model, _ = tiny
    window = model.cfg.max_seq_len
    prompt = list(range(1, window - 3))
    out = list(stream(model, prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)))
    assert len(out) == 4


@pytest.mark.parametrize("prompt,match", [([], "prompt"), ([1, 10**6], "token ids"),
                                          (list(range(600)), "max_seq_len")])
def test_bad_prompts_are_clear_errors(tiny, prompt, match):
    model, _ = tiny
    with pytest.raises(ValueError, match=match):
        generate(model, prompt, SamplingParams(max_tokens=4))


def test_model_rejects_positions_beyond_window(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, model.cfg.max_seq_len + 1, dtype=torch.long))


def test_kv_cache_overflow_is_an_error(tiny):
    model, _ = tiny
    cache = KVCache(model.cfg, 1, 4)
    with pytest.raises(ValueError, match="max_len"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache)
