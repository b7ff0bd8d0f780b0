"""Attention backends on the tiny model: "triton" (our FlashAttention kernel, in the Triton
interpreter on CPU) and "reference" give the logits and the cached greedy generations of "sdpa".

The tiny model has head_dim 16 and GQA (4 query heads, 2 kv heads); prompt lengths are chosen
off the interpreter's 32x16 tiles so ragged tiles and the causal diagonal are exercised.
"""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from minillm import SamplingParams
from minillm.attention import get_backend, reference_attention
from minillm.cache import KVCache
from minillm.generate import generate

if torch.cuda.is_available():  # these run the kernel in the interpreter; GPUs use benchmarks/
    pytest.skip("backend parity tests run the Triton interpreter (CPU only)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def sdpa_model(tiny):
    """A copy of the shared tiny model (``minillm.load_model("tiny", dtype="float32")``)."""
    return copy.deepcopy(tiny[0]).set_attention_backend("sdpa")


@pytest.fixture(scope="module", params=["triton", "reference"])
def other_model(request, sdpa_model):
    """The same weights (a deep copy) with another attention backend."""
    return request.param, copy.deepcopy(sdpa_model).set_attention_backend(request.param)


def prompt_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 49152, (batch, length), generator=g)


def test_importing_minillm_does_not_import_kernels():
    code = ("import sys, minillm, minillm.attention, minillm.generate\n"
            "assert 'minillm.kernels' not in sys.modules\n"
            "assert not any(m.startswith('minillm.kernels') for m in sys.modules)\n"
            "assert 'minillm.attention.triton' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_get_backend_triton_is_the_kernel_wrapper():
    from minillm.attention.triton import triton_attention

    assert get_backend("triton") is triton_attention


@pytest.mark.parametrize("t,l,h,h_kv", [(37, 37, 4, 2), (5, 50, 6, 2), (1, 19, 4, 4)])
def test_triton_attention_matches_float64_reference(t, l, h, h_kv):
    """Queries are the last t of l positions (a cache holds the rest); GQA read in place."""
    from minillm.attention.triton import triton_attention

    g = torch.Generator().manual_seed(t + l)
    q = torch.randn(2, h, t, 32, generator=g)
    k, v = torch.randn(2, h_kv, l, 32, generator=g), torch.randn(2, h_kv, l, 32, generator=g)
    out = triton_attention(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    want = reference_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


def test_triton_attention_bf16_in_interpreter_keeps_dtype():
    from minillm.attention.triton import triton_attention

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=g).bfloat16() for _ in range(3))
    out = triton_attention(q, k, v)
    assert out.dtype == torch.bfloat16
    want = reference_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


@torch.inference_mode()
def test_logits_match_sdpa_without_cache(sdpa_model, other_model):
    name, model = other_model
    ids = prompt_ids(2, 37)
    torch.testing.assert_close(model(ids), sdpa_model(ids), atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"backend {name}: {m}")


@torch.inference_mode()
def test_chunked_prefill_through_cache_matches_sdpa(sdpa_model, other_model):
    """Chunks of 19, 1 and 14 tokens after a cached prefix: T < L inside the kernel."""
    name, model = other_model
    ids = prompt_ids(1, 34, seed=1)
    want = sdpa_model(ids)
    cache = KVCache(model.cfg, 1, 34)
    got, start = [], 0
    for n in (19, 1, 14):
        got.append(model(ids[:, start:start + n], cache=cache))
        start += n
    torch.testing.assert_close(torch.cat(got, dim=1), want, atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"backend {name}: {m}")


def test_cached_greedy_generation_matches_sdpa(sdpa_model, other_model):
    name, model = other_model
    prompt = prompt_ids(1, 21, seed=2)[0].tolist()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert generate(model, prompt, params) == generate(sdpa_model, prompt, params), name
