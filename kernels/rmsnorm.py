"""RMSNorm fused into one pass: y = (x / sqrt(mean(x^2) + eps)).to(dtype) * weight.

Spec: x [..., D], weight [D] -> [..., D], the same rounding order as ``minillm.model.RMSNorm``
(normalise in fp32, cast to x's dtype, then scale). One program per row of D elements.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_device_ready, check_tensor, next_pow2


@triton.jit
def _rmsnorm_kernel(X, W, Out, n_cols, stride_x, stride_o, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    w = tl.load(W + cols, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    y = (x32 * rstd).to(x.dtype) * w
    tl.store(Out + row * stride_o + cols, y, mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] in x's dtype (D up to 65536)."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, contiguous=True)
    check_tensor("weight", weight, ndim=1, dtypes=(x.dtype,), contiguous=True)
    if x.dim() < 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must have shape [{x.shape[-1] if x.dim() else '?'}] "
                         f"(x's last dim), got {tuple(weight.shape)}")
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    d = x.shape[-1]
    if d > 65536:
        raise ValueError(f"x's last dim is {d}; this one-block-per-row kernel allows up to 65536")
    check_device_ready(x)
    x2 = x.view(-1, d)
    out = torch.empty_like(x2)
    if x2.shape[0] and d:
        block = next_pow2(d)
        _rmsnorm_kernel[(x2.shape[0],)](x2, weight, out, d, x2.stride(0), out.stride(0), eps,
                                        BLOCK=block, num_warps=4 if block <= 4096 else 8)
    return out.view(x.shape)


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    x32 = x.float() if x.dtype != torch.float64 else x
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) * weight
