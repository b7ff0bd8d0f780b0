"""Fused row softmax: one read of each row, one write, nothing in between (Appendix A2, ch. 05).

Spec: x [M, N] -> softmax over the last axis, [M, N]. One program per row; the whole row fits in
one block (BLOCK = next power of two >= N), masked lanes read -inf so they add exp(-inf) = 0.
The unfused torch version reads and writes the row several times (max, subtract, exp, sum,
divide); this kernel moves 2*M*N elements, the minimum.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_device_ready, check_tensor, next_pow2


@triton.jit
def _softmax_kernel(X, Out, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=float("-inf")).to(tl.float32)
    x = x - tl.max(x, axis=0)
    e = tl.exp(x)
    y = e / tl.sum(e, axis=0)
    tl.store(Out + row * stride_o + cols, y, mask=mask)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Row softmax of x [M, N] (computed in fp32, returned in x's dtype); N up to 65536."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    m, n = x.shape
    if n > 65536:
        raise ValueError(f"x has {n} columns; this one-block-per-row kernel allows up to 65536")
    check_device_ready(x)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        block = next_pow2(n)
        num_warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
        _softmax_kernel[(m,)](x, out, n, x.stride(0), out.stride(0), BLOCK=block,
                              num_warps=num_warps)
    return out


def softmax_reference(x: torch.Tensor) -> torch.Tensor:
    """The unfused maths: subtract the row max, exponentiate, normalise."""
    z = x - x.max(dim=-1, keepdim=True).values
    e = z.exp()
    return e / e.sum(dim=-1, keepdim=True)
