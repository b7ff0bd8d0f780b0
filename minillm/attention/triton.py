"""Attention through minillm's own Triton FlashAttention kernel (chapter 05).

Same signature as the other backends: q [B, H, T, hd], k/v [B, H_kv, L, hd] -> [B, H, T, hd],
causal with the T queries being the last T of the L positions. The kernel module is imported
inside the call, after :func:`minillm.device.setup_triton`, so ``import minillm`` never imports
Triton and, without a GPU, the kernel runs in Triton's CPU interpreter (slow: small shapes).

The kernel tiles the head dimension whole (a power of two in [16, 256]) and reads GQA K/V heads
in place. The interpreter has no bfloat16, so there bf16 inputs are computed in fp32 and the
result is cast back.
"""
from __future__ import annotations

import torch

from ..device import setup_triton


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [B, H, T, hd], k/v [B, H_kv, L, hd] (L >= T) -> [B, H, T, hd], causal, queries last."""
    interpreting = setup_triton()  # must precede the first import of a kernel module
    from minillm.kernels.flash_attention import flash_attention

    dtype = q.dtype
    if interpreting and dtype == torch.bfloat16:
        q, k, v = q.float(), k.float(), v.float()
    out, _ = flash_attention(q, k, v, causal=True)
    return out.to(dtype)
