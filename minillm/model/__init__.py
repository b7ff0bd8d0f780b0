"""The model (core): layers (RMSNorm, RoPE, grouped-query attention, SwiGLU), mixture of experts,
the decoder :class:`Transformer`, and oneDNN-packed linears for CPU inference.

input_ids [B, T] -> Transformer -> logits [B, T, vocab]; a cache (``minillm.cache``) passed to
the forward stores K/V and decides how attention reads them.
"""
from .layers import Attention, RMSNorm, SwiGLU, apply_rope, rope_cos_sin
from .moe import MoEFeedForward, load_balancing_loss
from .packed import PackedLinear, can_pack_linears, pack_linears
from .transformer import Block, Transformer

__all__ = ["Attention", "Block", "MoEFeedForward", "PackedLinear", "RMSNorm", "SwiGLU",
           "Transformer", "apply_rope", "can_pack_linears", "load_balancing_loss",
           "pack_linears", "rope_cos_sin"]
