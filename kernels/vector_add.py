"""Vector addition: the "hello world" of Triton (Appendix A2).

Spec: x [N], y [N] (same dtype, device) -> out [N] = x + y.
Each program adds one BLOCK-sized slice; the mask covers the ragged end when N % BLOCK != 0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_device_ready, check_same, check_tensor


@triton.jit
def _vector_add_kernel(X, Y, Out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask)
    y = tl.load(Y + offs, mask=mask)
    tl.store(Out + offs, x + y, mask=mask)


def vector_add(x: torch.Tensor, y: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """x [N] + y [N] -> [N] with one Triton program per ``block`` elements."""
    check_tensor("x", x, ndim=1, dtypes=FLOAT_DTYPES, contiguous=True)
    check_tensor("y", y, ndim=1, dtypes=(x.dtype,), contiguous=True)
    check_same("x.shape and y.shape", [tuple(x.shape), tuple(y.shape)])
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    check_device_ready(x)
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        _vector_add_kernel[(triton.cdiv(n, block),)](x, y, out, n, BLOCK=block)
    return out


def vector_add_reference(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + y
