"""The building blocks of a Llama-family decoder layer.

x [B, T, D] -> x + Attention(RMSNorm(x)) -> x + SwiGLU(RMSNorm(x)): a pre-norm residual stream.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import reference_attention, sdpa_attention
from ..config import ModelConfig


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 (Zhang & Sennrich, 2019)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [..., T] -> cos, sin [..., T, head_dim]; frequency i is theta^(-2i/head_dim)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device,
                                       dtype=torch.float32) / head_dim)
    angles = positions.float()[..., None] * inv_freq  # [..., T, hd/2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (i, i + hd/2) pair of x [B, H, T, hd] by its position's angle (Su et al.)."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Grouped-query attention with RoPE; ``n_kv_heads`` K/V heads serve ``n_heads`` queries."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.backend = sdpa_attention  # see Transformer.set_attention_backend
        self.input_group = None  # wq, wk, wv as one matmul (minillm.model.packed.pack_linears)
        self.keep_probs = False  # set True to record attention maps (slow path)
        self.last_probs: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None,
                kv: torch.Tensor | None = None):
        """x [B, T, D], cos/sin [B or 1, 1, T, hd] -> [B, T, D]. ``kv`` [B, T, D]: other rows to
        take keys and values from (a block drafter's context rows), default x."""
        b, t, _ = x.shape
        if kv is None and self.input_group is not None:
            q, k, v = self.input_group(x)
        else:
            kv = x if kv is None else kv
            q, k, v = self.wq(x), self.wk(kv), self.wv(kv)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.keep_probs and cache is None:
            out, self.last_probs = reference_attention(q, k, v, return_probs=True)
        elif cache is None:
            out = self.backend(q, k, v)
        else:
            out = cache.attend(self.layer_idx, q, k, v, self.backend)
        return self.wo(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    """w_down(silu(w_gate x) * w_up x) (Shazeer, 2020)."""

    def __init__(self, d_model: int, ffn_dim: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(d_model, ffn_dim, bias=False)
        self.w_up = nn.Linear(d_model, ffn_dim, bias=False)
        self.w_down = nn.Linear(ffn_dim, d_model, bias=False)
        self.input_group = None  # w_gate, w_up as one matmul (minillm.model.packed.pack_linears)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_group(x) if self.input_group is not None else \
            (self.w_gate(x), self.w_up(x))
        if torch.is_grad_enabled():
            return self.w_down(F.silu(gate) * up)
        # inference: reuse gate's buffer (two fewer [tokens, ffn_dim] allocations, like vLLM's
        # fused silu_and_mul; autograd would need the input silu overwrites)
        return self.w_down(F.silu(gate, inplace=True).mul_(up))


