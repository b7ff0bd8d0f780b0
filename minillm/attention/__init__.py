"""Attention backends behind one signature.

Shapes: q [B, H, T, hd], k and v [B, H_kv, L, hd] with H a multiple of H_kv (GQA), where the T
queries are the *last* T of the L positions (a KV cache holds the L - T before them). Query i
may see key j when j <= L - T + i. Output [B, H, T, hd].

Backends: "sdpa" (PyTorch's fused kernel, the default), "reference" (the maths written out),
"triton" (our FlashAttention kernel, chapter 05; compiled on a GPU, interpreted on a CPU).
The serving engine's paged attention (``paged.py``) takes the same names ("sdpa", "triton"), and
"cpu", or any object implementing its ``PagedAttentionBackend``.
:func:`attention_with_lse` is the reference everything is checked against.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .reference import attention_with_lse, causal_mask, reference_attention
from .sdpa import sdpa_attention

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
BACKENDS = ("sdpa", "reference", "triton")


def get_backend(name: str) -> AttentionFn:
    """The attention function called ``name`` (one of :data:`BACKENDS`)."""
    if name == "sdpa":
        return sdpa_attention
    if name == "reference":
        return reference_attention
    if name == "triton":
        from .triton import triton_attention  # imports Triton only when asked for

        return triton_attention
    raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")


__all__ = ["BACKENDS", "AttentionFn", "attention_with_lse", "causal_mask", "get_backend",
           "reference_attention",
           "sdpa_attention"]
