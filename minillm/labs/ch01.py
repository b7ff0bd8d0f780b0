"""Checkers for the exercises of chapter 01 (transformers).

Each ``check_*`` takes the student's function, compares it with the package's implementation on
seeded random inputs of several shapes, prints a one-line verdict and returns a
:class:`~minillm.labs.common.Result` (``passed`` is None while the function still raises
NotImplementedError).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..attention import reference_attention
from ..model.layers import RMSNorm, apply_rope, rope_cos_sin
from ..sampling import apply_top_p
from .common import Result, check


def _compare(got, want: torch.Tensor, case: str, atol: float, rtol: float) -> None:
    """Assert the student's tensor has the reference's shape, dtype and values."""
    assert isinstance(got, torch.Tensor), f"{case}: expected a tensor, got {type(got).__name__}"
    assert got.shape == want.shape, (f"{case}: shape {tuple(got.shape)}, "
                                     f"expected {tuple(want.shape)}")
    assert got.dtype == want.dtype, f"{case}: dtype {got.dtype}, expected {want.dtype}"
    assert not torch.isnan(got).any(), f"{case}: the result contains NaN"
    err = (got.double() - want.double()).abs()
    bad = err > atol + rtol * want.double().abs()
    assert not bad.any(), (f"{case}: {int(bad.sum())} of {want.numel()} values differ, "
                           f"largest difference {err.max().item():.3g}")


def check_rmsnorm(fn: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]) -> Result:
    """``fn(x, weight, eps)`` -> RMSNorm of x [..., D] over the last axis, times weight [D].

    Statistics in float32, result in x's dtype (as :class:`minillm.model.RMSNorm`). Inputs:
    float32, float64, float16 and bfloat16; tiny inputs where eps matters, and an all-zero row
    that must come out as zeros, not NaN.
    """
    gen = torch.Generator().manual_seed(1)
    cases = [((4, 16), torch.float32, 1e-5, 1.0), ((2, 7, 64), torch.float32, 1e-6, 1e-3),
             ((3, 5, 32), torch.float64, 1e-5, 1.0), ((2, 3, 48), torch.float16, 1e-5, 1.0),
             ((1, 4, 576), torch.bfloat16, 1e-5, 1.0), ((6, 8), torch.float32, 1e-2, 0.05)]
    # float64: statistics in float32 (the package) or in float64 are both right
    tol = {torch.float32: 1e-5, torch.float64: 1e-6, torch.float16: 2e-3,
           torch.bfloat16: 2e-2}

    def attempt() -> None:
        for shape, dtype, eps, scale in cases:
            x = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
            x.view(-1, shape[-1])[0] = 0.0  # a zero row: only eps keeps it finite
            x = x.to(dtype)
            weight = 1 + 0.5 * torch.randn(shape[-1], generator=gen, dtype=torch.float64)
            weight = weight.to(dtype)
            ref = RMSNorm(shape[-1], eps).to(dtype)
            with torch.no_grad():
                ref.weight.copy_(weight)
                want = ref(x)
            got = fn(x.clone(), weight.clone(), eps)
            case = f"x {tuple(shape)} {str(dtype).replace('torch.', '')}, eps={eps:g}"
            _compare(got, want, case, atol=tol[dtype], rtol=tol[dtype])

    return check("rmsnorm", attempt)


def check_rope(fn: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]) -> Result:
    """``fn(x, positions, theta)`` -> x [B, H, T, head_dim] with RoPE applied.

    positions [T] (int64) are the tokens' positions; the pairs rotated together are
    (i, i + head_dim/2), by the angle position * theta^(-2i/head_dim), as
    :func:`minillm.model.apply_rope` does (the Llama / Hugging Face layout).
    """
    gen = torch.Generator().manual_seed(2)
    cases = [((1, 1, 5, 8), 0, 10000.0), ((2, 3, 7, 16), 0, 100000.0),
             ((1, 2, 4, 64), 37, 100000.0), ((2, 2, 6, 32), 200, 500000.0)]

    def attempt() -> None:
        for shape, start, theta in cases:
            x = torch.randn(shape, generator=gen)
            t, hd = shape[2], shape[3]
            if start:  # sorted positions with gaps, as in a packed batch
                positions = start + torch.randperm(3 * t, generator=gen)[:t].sort().values
            else:
                positions = torch.arange(t)
            want = apply_rope(x, *rope_cos_sin(positions, hd, theta, x.dtype))
            got = fn(x.clone(), positions.clone(), theta)
            _compare(got, want, f"x {tuple(shape)}, positions {positions.tolist()}, "
                                f"theta={theta:g}", atol=1e-4, rtol=1e-4)

    return check("rope", attempt)


def check_causal_attention(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                                        torch.Tensor]) -> Result:
    """``fn(q, k, v)`` -> causal attention output [B, H, T, d].

    q [B, H, T, d]; k, v [B, H_kv, L, d] with L >= T and H a multiple of H_kv. The T queries are
    the last T of the L positions (the first L - T are in a KV cache), so query i sees keys
    0 .. L - T + i. Query head h reads KV head h // (H / H_kv). Compared with
    :func:`minillm.attention.reference_attention`.
    """
    gen = torch.Generator().manual_seed(3)
    # (B, H, H_kv, T, L, d)
    cases = [(1, 1, 1, 5, 5, 8), (2, 4, 4, 6, 6, 16), (1, 6, 2, 7, 7, 8),
             (1, 6, 2, 3, 10, 8), (2, 4, 1, 1, 9, 16), (1, 8, 4, 4, 4, 32)]

    def attempt() -> None:
        for b, h, h_kv, t, l, d in cases:
            q = torch.randn(b, h, t, d, generator=gen)
            k = torch.randn(b, h_kv, l, d, generator=gen)
            v = torch.randn(b, h_kv, l, d, generator=gen)
            want = reference_attention(q, k, v)
            got = fn(q.clone(), k.clone(), v.clone())
            _compare(got, want, f"q {tuple(q.shape)}, k/v {tuple(k.shape)}",
                     atol=1e-5, rtol=1e-4)

    return check("causal_attention", attempt)


def check_top_p(fn: Callable[[torch.Tensor, float], torch.Tensor]) -> Result:
    """``fn(logits, p)`` -> logits [B, V] with every token outside the nucleus set to -inf.

    The nucleus is the smallest set of most likely tokens whose probability reaches p: a token
    is dropped when the tokens strictly more likely than it already hold mass >= p, so the most
    likely token is always kept and p = 1 keeps everything. Kept logits are unchanged. Compared
    with :func:`minillm.sampling.apply_top_p`.
    """
    gen = torch.Generator().manual_seed(4)
    cases = [(1, 10, 1.0), (4, 100, 1.0), (3, 1000, 3.0), (2, 50, 6.0), (5, 49152, 2.0)]
    ps = (1e-3, 0.3, 0.5, 0.9, 0.99, 1.0)

    def attempt() -> None:
        for b, vocab, scale in cases:
            logits = torch.randn(b, vocab, generator=gen) * scale
            # float64 mass of the tokens more likely than each token: where it is within 1e-5
            # of p, float32 rounding may keep or drop that token, so either answer is right
            probs64, order = logits.double().softmax(-1).sort(dim=-1, descending=True)
            before = probs64.cumsum(-1) - probs64
            for p in ps:
                want_kept = torch.isfinite(apply_top_p(logits, p))
                near = ((before - p).abs() < 1e-5) & (p < 1)
                either = torch.zeros_like(near).scatter(-1, order, near)
                got = fn(logits.clone(), p)
                case = f"logits {tuple(logits.shape)} (scale {scale:g}), p={p:g}"
                assert isinstance(got, torch.Tensor) and got.shape == logits.shape, (
                    f"{case}: expected a tensor of shape {tuple(logits.shape)}")
                kept = torch.isfinite(got)
                for row in range(b):
                    wrong = (kept[row] != want_kept[row]) & ~either[row]
                    assert not wrong.any(), (
                        f"{case}, row {row}: you kept {int(kept[row].sum())} tokens, expected "
                        f"{int(want_kept[row].sum())}"
                        + ("" if kept[row, logits[row].argmax()] else
                           " (the most likely token must always stay)"))
                assert torch.equal(got[kept], logits[kept]), (
                    f"{case}: the kept logits must keep their values")
                assert (got[~kept] == float("-inf")).all(), (
                    f"{case}: dropped tokens must be -inf")

    return check("top_p", attempt)


__all__ = ["check_causal_attention", "check_rmsnorm", "check_rope", "check_top_p"]
