"""The decoder: token embeddings -> N blocks -> final RMSNorm -> output head (tied or not).

A block is x + Attention(RMSNorm(x)) then x + FFN(RMSNorm(x)): a pre-norm residual stream whose
FFN is a SwiGLU or, when the config has experts, a mixture of experts.
"""
from __future__ import annotations

from collections.abc import Callable, Collection

import torch
from torch import nn

from ..attention import get_backend
from ..config import ModelConfig
from .layers import Attention, RMSNorm, SwiGLU, rope_cos_sin
from .moe import MoEFeedForward

LayerCall = Callable[[int], None]     # called with a layer's index, around that layer


class Block(nn.Module):
    """One decoder layer: pre-norm attention and pre-norm SwiGLU, each added to the residual."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, layer_idx)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.n_experts:
            self.ffn = MoEFeedForward(cfg.d_model, cfg.ffn_dim, cfg.n_experts, cfg.top_k)
        else:
            self.ffn = SwiGLU(cfg.d_model, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, cache)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def set_attention_backend(self, name: str) -> Transformer:
        """Route every layer's attention through backend ``name`` (sdpa, reference, triton)."""
        fn = get_backend(name)
        for layer in self.layers:
            layer.attn.backend = fn
        return self

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def hidden_states(self, input_ids: torch.Tensor, cache=None,
                      positions: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> final normed hidden states [B, T, D].

        Without ``positions`` the tokens sit at cache.seen, cache.seen + 1, ... (0, 1, ... with
        no cache) and must fit the context window; explicit ``positions`` ([T] or [B, T]) are
        the caller's to check (reading them here would stall a GPU). With a cache, their K/V
        are stored and ``cache.advance(T)`` is called.
        """
        return self.forward_layers(input_ids, cache, positions)[0]

    def forward_layers(self, input_ids: torch.Tensor, cache=None,
                       positions: torch.Tensor | None = None, keep: Collection[int] = (),
                       before_layer: LayerCall | None = None,
                       after_layer: LayerCall | None = None
                       ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """:meth:`hidden_states`, plus the residual stream after each layer in ``keep``:
        (final normed [B, T, D], {layer: [B, T, D]}) from the same pass (drafters such as
        EAGLE read a target's hidden states). ``before_layer(i)`` / ``after_layer(i)`` are
        called around layer i (the engine's KV connector waits for loads and saves there)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        t = input_ids.shape[1]
        if positions is None:
            start = cache.seen if cache is not None else 0
            if start + t > self.cfg.max_seq_len:
                raise ValueError(f"sequence length {start + t} exceeds the context window "
                                 f"max_seq_len={self.cfg.max_seq_len}")
            positions = torch.arange(start, start + t, device=input_ids.device)
        bad = [i for i in keep if not 0 <= i < self.cfg.n_layers]
        if bad:
            raise ValueError(f"keep must name layers in [0, {self.cfg.n_layers}), got {bad}")
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, self.dtype)
        cos, sin = _heads_axis(cos), _heads_axis(sin)
        x = self.embed(input_ids)
        kept = {}
        for i, layer in enumerate(self.layers):
            if before_layer is not None:
                before_layer(i)
            x = layer(x, cos, sin, cache)
            if after_layer is not None:
                after_layer(i)
            if i in keep:
                kept[i] = x
        if cache is not None:
            cache.advance(t)
        return self.norm(x), kept

    def forward(self, input_ids: torch.Tensor, cache=None, positions: torch.Tensor | None = None,
                last_only: bool = False) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, vocab] ([B, 1, vocab] with ``last_only``)."""
        h = self.hidden_states(input_ids, cache, positions)
        return self.lm_head(h[:, -1:] if last_only else h)


def _heads_axis(x: torch.Tensor) -> torch.Tensor:
    """[T, hd] or [B, T, hd] -> broadcastable over heads: [1 or B, 1, T, hd]."""
    return x[None, None] if x.dim() == 2 else x[:, None]
