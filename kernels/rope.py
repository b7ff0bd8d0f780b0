"""Rotary position embedding (RoPE), rotate-half convention as in ``minillm.model.apply_rope``.

Spec: x [B, H, T, hd], cos/sin [T, hd] or [B, T, hd] (from ``minillm.model.rope_cos_sin``)
-> x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x[..., hd/2:], x[..., :hd/2]).
So with x1, x2 the two halves: out1 = x1*cos1 - x2*sin1 and out2 = x2*cos2 + x1*sin2.
One program handles BLOCK_T positions of one (batch, head); maths in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_device_ready, check_tensor, next_pow2


@triton.jit
def _rope_kernel(X, Cos, Sin, Out, H, T, half,
                 stride_xb, stride_xh, stride_xt, stride_cb, stride_ct,
                 stride_ob, stride_oh, stride_ot,
                 BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, BLOCK_HALF)
    mask = (t[:, None] < T) & (j[None, :] < half)
    x_rows = X + b * stride_xb + h * stride_xh + t[:, None] * stride_xt
    c_rows = b * stride_cb + t[:, None] * stride_ct
    x1 = tl.load(x_rows + j[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_rows + half + j[None, :], mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(Cos + c_rows + j[None, :], mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(Cos + c_rows + half + j[None, :], mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(Sin + c_rows + j[None, :], mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(Sin + c_rows + half + j[None, :], mask=mask, other=0.0).to(tl.float32)
    o_rows = Out + b * stride_ob + h * stride_oh + t[:, None] * stride_ot
    tl.store(o_rows + j[None, :], x1 * c1 - x2 * s1, mask=mask)
    tl.store(o_rows + half + j[None, :], x2 * c2 + x1 * s2, mask=mask)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, hd], cos/sin [T, hd] or [B, T, hd] -> rotated x [B, H, T, hd] (new tensor)."""
    check_tensor("x", x, ndim=4, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    b, h, t, hd = x.shape
    if hd % 2:
        raise ValueError(f"x's head_dim must be even, got {hd}")
    for name, c in (("cos", cos), ("sin", sin)):
        check_tensor(name, c, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
        if tuple(c.shape) not in ((t, hd), (b, t, hd)):
            raise ValueError(f"{name} must have shape [T, hd]=[{t}, {hd}] or "
                             f"[B, T, hd]=[{b}, {t}, {hd}], got {tuple(c.shape)}")
    if cos.shape != sin.shape or cos.stride() != sin.stride():
        raise ValueError(f"cos and sin must have the same shape and strides, got "
                         f"{tuple(cos.shape)}/{cos.stride()} and {tuple(sin.shape)}/{sin.stride()}")
    check_device_ready(x)
    out = torch.empty((b, h, t, hd), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    stride_cb = cos.stride(0) if cos.dim() == 3 else 0
    block_t = 16
    grid = (triton.cdiv(t, block_t), b * h)
    _rope_kernel[grid](x, cos, sin, out, h, t, hd // 2,
                       x.stride(0), x.stride(1), x.stride(2), stride_cb, cos.stride(-2),
                       out.stride(0), out.stride(1), out.stride(2),
                       BLOCK_T=block_t, BLOCK_HALF=next_pow2(hd // 2))
    return out


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Plain torch: x * cos + rotate_half(x) * sin, cos/sin broadcast over heads."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin
