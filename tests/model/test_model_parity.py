"""The real model against HF transformers' independent Llama on the same GGUF file (fp32)."""
from __future__ import annotations

import pytest
import torch

from minillm import SamplingParams
from minillm.generate import generate, generate_no_cache

pytestmark = pytest.mark.slow


def long_text(n_chars: int = 6000) -> str:
    """Real English prose that exists offline: the Python reference manual's text."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))[:n_chars]


def chat(tok, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


@pytest.fixture(scope="module")
def prompts(real):
    _, tok = real
    return {"short": chat(tok, "What is the capital of France?"),
            "poem": chat(tok, "Write a poem about the sea."),
            "code": tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n"),
            "long": tok.encode(long_text())}


def test_long_prompt_is_long(prompts):
    assert len(prompts["long"]) > 1000


@pytest.mark.parametrize("name", ["short", "code", "long"])
def test_logits_match_hf(real, hf_model, prompts, name):
    model, _ = real
    ids = torch.tensor([prompts[name]])
    with torch.no_grad():
        ref = hf_model(ids).logits
        ours = model(ids)
    assert (ours - ref).abs().max().item() < 1e-3


def test_batched_rows_match_single_rows(real, prompts):
    model, _ = real
    a = torch.tensor([prompts["code"]])
    b = torch.flip(a, dims=[1])
    with torch.no_grad():
        both = model(torch.cat([a, b]))
        torch.testing.assert_close(both[1:], model(b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["short", "poem", "code"])
def test_greedy_64_tokens_match_hf(real, hf_model, prompts, name):
    """Both stop at EOS (HF's min_new_tokens would forbid EOS, which changes the argmax)."""
    model, _ = real
    ids = prompts[name]
    ours = generate(model, ids, SamplingParams(temperature=0, max_tokens=64))
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                                pad_token_id=2)
    assert ours == out[0, len(ids):].tolist()
    if name != "short":
        assert len(ours) == 64


def test_cached_equals_uncached(real, prompts):
    model, _ = real
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert generate(model, prompts["short"], p) == generate_no_cache(model, prompts["short"], p)


def test_cached_logits_equal_full_forward(real, prompts):
    """Prefill half, then feed the rest one token at a time: same logits as one full pass."""
    from minillm.cache import KVCache

    model, _ = real
    ids = torch.tensor([prompts["code"]])
    t = ids.shape[1]
    cache = KVCache(model.cfg, 1, t)
    with torch.no_grad():
        full = model(ids)
        steps = [model(ids[:, : t // 2], cache=cache)]
        steps += [model(ids[:, i : i + 1], cache=cache) for i in range(t // 2, t)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=1e-4)
