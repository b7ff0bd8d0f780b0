"""One reference attention: :func:`minillm.attention.attention_with_lse`.

It is checked against attention computed entry by entry in float64 loops (independent of any
tensor formula), and every other written-out attention in the repository is asserted equal to
it: the causal backend, the kernels' plain-torch references (kept beside each kernel, as the
kernels folder is self-contained), chapter 01's teaching version and the sequence-parallel
position mask.
"""
from __future__ import annotations

import math

import pytest
import torch

from minillm.attention import attention_with_lse, causal_mask, reference_attention
from minillm.course.ch01_variants import causal_attention
from minillm.device import setup_triton
from minillm.parallel.sequence import masked_attention

setup_triton()  # before a kernel module is imported (their references are plain torch)
from minillm.kernels.flash_attention import attention_reference  # noqa: E402


def loops(q, k, v, mask, scale):
    """Attention one (batch, head, query) at a time with Python sums, float64."""
    b, h, t, _ = q.shape
    group = h // k.shape[1]
    out = torch.zeros(b, h, t, v.shape[-1], dtype=torch.float64)
    lse = torch.full((b, h, t), float("-inf"), dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(t):
                keys = [j for j in range(k.shape[2]) if mask[i, j]]
                if not keys:
                    continue
                s = [float(q[bi, hi, i] @ k[bi, hi // group, j]) * scale for j in keys]
                top = max(s)
                w = [math.exp(x - top) for x in s]
                total = sum(w)
                lse[bi, hi, i] = top + math.log(total)
                for wj, j in zip(w, keys):
                    out[bi, hi, i] += wj / total * v[bi, hi // group, j]
    return out, lse


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("h, h_kv, t, l", [(4, 2, 5, 9), (3, 3, 6, 6), (4, 1, 1, 7)])
def test_against_float64_loops_with_an_empty_row(h, h_kv, t, l):
    q, k, v = rand(2, h, t, 8, seed=0), rand(2, h_kv, l, 8, seed=1), rand(2, h_kv, l, 8, seed=2)
    mask = causal_mask(t, l) & (torch.rand(t, l, generator=torch.Generator().manual_seed(3)) > .3)
    mask[0] = False  # a query that sees nothing: out 0, lse -inf
    out, lse = attention_with_lse(q, k, v, mask, scale=0.4)
    want_out, want_lse = loops(q, k, v, mask, 0.4)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)


def test_float32_inputs_give_float32_out_and_lse():
    q, k, v = (x.float() for x in (rand(1, 2, 3, 4, seed=0), rand(1, 2, 3, 4, seed=1),
                                   rand(1, 2, 3, 4, seed=2)))
    out, lse = attention_with_lse(q, k, v)
    assert out.dtype == lse.dtype == torch.float32


@pytest.mark.parametrize("t, l", [(7, 7), (3, 10), (1, 5)])
def test_every_written_out_attention_equals_the_reference(t, l):
    q, k, v = rand(2, 6, t, 16, seed=4), rand(2, 2, l, 16, seed=5), rand(2, 2, l, 16, seed=6)
    want, want_lse = attention_with_lse(q, k, v, causal_mask(t, l))
    torch.testing.assert_close(reference_attention(q, k, v), want)
    out, lse = attention_reference(q, k, v, causal=True)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    pos_q, pos_k = torch.arange(l - t, l), torch.arange(l)
    torch.testing.assert_close(masked_attention(q, k, v, pos_q, pos_k, True)[0], want)
    if t == l:  # the teaching version knows no cache: queries and keys are the same positions
        torch.testing.assert_close(causal_attention(q, k, v), want)
    scaled, _ = attention_reference(q, k, v, causal=False, scale=0.3)
    torch.testing.assert_close(scaled, attention_with_lse(q, k, v, scale=0.3)[0])
