"""Attention backends behind one signature.

Shapes: q [B, H, T, hd], k and v [B, H_kv, L, hd] with H a multiple of H_kv (GQA), where the T
queries are the *last* T of the L positions (a KV cache holds the L - T before them). Query i
may see key j when j <= L - T + i. Output [B, H, T, hd].
"""
from .reference import causal_mask, reference_attention
from .sdpa import sdpa_attention

__all__ = ["causal_mask", "reference_attention", "sdpa_attention"]
