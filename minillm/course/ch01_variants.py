"""Attention variants of chapter 01: MHA, MQA, GQA and DeepSeek-V2's multi-head latent attention.

They differ in what one token leaves behind in the KV cache:

- MHA caches a key and a value per query head: 2 x n_heads x head_dim numbers per layer.
- GQA lets a group of query heads share one KV head: 2 x n_kv_heads x head_dim.
- MQA is GQA with a single KV head: 2 x head_dim.
- MLA caches one low-rank latent per token (plus a small shared RoPE key), d_latent + d_rope,
  and rebuilds per-head keys and values from it with up-projections.

These are teaching modules (no KV cache, positions 0..T-1); the model itself lives in `model.py`.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..model.layers import apply_rope, rope_cos_sin

ATTENTION_KINDS = ("mha", "mqa", "gqa", "mla")


def kv_cache_bytes_per_token(kind: str, *, head_dim: int = 0, n_kv_heads: int = 0,
                             d_latent: int = 0, d_rope: int = 0, bytes_per_elem: int = 2) -> int:
    """Bytes one token adds to one layer's KV cache.

    "mha", "gqa": 2 x n_kv_heads x head_dim elements (K and V); "mqa": the same with one KV head;
    "mla": d_latent + d_rope elements (the latent c_kv and the decoupled RoPE key).
    """
    kind = kind.lower()
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"kind must be one of {ATTENTION_KINDS}, got {kind!r}")
    if bytes_per_elem < 1:
        raise ValueError(f"bytes_per_elem must be >= 1, got {bytes_per_elem}")
    if kind == "mla":
        if d_latent < 1 or d_rope < 0:
            raise ValueError(f"mla needs d_latent >= 1 and d_rope >= 0, got {d_latent}, {d_rope}")
        return (d_latent + d_rope) * bytes_per_elem
    if kind == "mqa":
        if n_kv_heads not in (0, 1):
            raise ValueError(f"mqa has exactly one KV head, got n_kv_heads={n_kv_heads}")
        n_kv_heads = 1
    if n_kv_heads < 1 or head_dim < 1:
        raise ValueError(f"{kind} needs n_kv_heads >= 1 and head_dim >= 1, "
                         f"got {n_kv_heads}, {head_dim}")
    return 2 * n_kv_heads * head_dim * bytes_per_elem


def causal_softmax(scores: Tensor) -> Tensor:
    """Softmax over the last axis of scores [..., T, T] after hiding the future (s > t)."""
    t = scores.shape[-1]
    future = torch.ones(t, t, dtype=torch.bool, device=scores.device).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(dim=-1)


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal scaled dot-product attention with shared KV heads.

    q [B, H, T, d], k [B, H_kv, T, d], v [B, H_kv, T, d_v] -> [B, H, T, d_v], where H_kv divides H
    and query head h reads KV head h // (H / H_kv). Scores are scaled by 1/sqrt(d).
    """
    b, h, t, d = q.shape
    h_kv = k.shape[1]
    q = q.view(b, h_kv, h // h_kv, t, d)
    scores = torch.einsum("bkgtd,bksd->bkgts", q, k) / math.sqrt(d)
    out = torch.einsum("bkgts,bksd->bkgtd", causal_softmax(scores), v)
    return out.reshape(b, h, t, v.shape[-1])


def _rope(x: Tensor, theta: float) -> Tensor:
    """RoPE on x [..., T, d] at positions 0..T-1 (the model's rotate-half layout)."""
    positions = torch.arange(x.shape[-2], device=x.device)
    return apply_rope(x, *rope_cos_sin(positions, x.shape[-1], theta, x.dtype))


def _heads(x: Tensor, n_heads: int) -> Tensor:
    """[B, T, n_heads * d] -> [B, n_heads, T, d]."""
    b, t, _ = x.shape
    return x.view(b, t, n_heads, -1).transpose(1, 2)


class MultiHeadAttention(nn.Module):
    """Causal self-attention with W_Q, W_K, W_V, W_O: MHA, GQA or MQA by ``n_kv_heads``.

    n_kv_heads == n_heads is MHA, 1 is MQA, a divisor in between is GQA. No RoPE: positions only
    enter through the causal mask, which is enough to compare the variants.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None,
                 head_dim: int | None = None) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        head_dim = d_model // n_heads if head_dim is None else head_dim
        if n_heads < 1 or head_dim < 1:
            raise ValueError(f"n_heads and head_dim must be >= 1, got {n_heads}, {head_dim}")
        if not 1 <= n_kv_heads <= n_heads or n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads must divide n_heads ({n_heads}), got {n_kv_heads}")
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = (
            d_model, n_heads, n_kv_heads, head_dim)
        self.w_q = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.w_k = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.w_v = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.w_o = nn.Linear(n_heads * head_dim, d_model, bias=False)

    @property
    def kind(self) -> str:
        """"mha", "mqa" or "gqa"."""
        if self.n_kv_heads == self.n_heads:
            return "mha"
        return "mqa" if self.n_kv_heads == 1 else "gqa"

    def kv_cache_tensors(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """What a KV cache would hold for x [B, T, D]: k, v, each [B, n_kv_heads, T, head_dim]."""
        return _heads(self.w_k(x), self.n_kv_heads), _heads(self.w_v(x), self.n_kv_heads)

    def forward(self, x: Tensor) -> Tensor:
        """x [B, T, D] -> [B, T, D]."""
        b, t, _ = x.shape
        k, v = self.kv_cache_tensors(x)
        out = causal_attention(_heads(self.w_q(x), self.n_heads), k, v)
        return self.w_o(out.transpose(1, 2).reshape(b, t, -1))

    def kv_bytes_per_token(self, bytes_per_elem: int = 2) -> int:
        """KV cache bytes per token for this layer."""
        return kv_cache_bytes_per_token(self.kind, head_dim=self.head_dim,
                                        n_kv_heads=self.n_kv_heads, bytes_per_elem=bytes_per_elem)


@torch.no_grad()
def mha_to_gqa(mha: MultiHeadAttention, n_kv_heads: int) -> MultiHeadAttention:
    """A copy of ``mha`` with ``n_kv_heads`` KV heads, each the mean of a group of old ones.

    Ainslie et al. 2023 (GQA), section 2.1: mean-pool the key and value projection heads of each
    group, then uptrain. Adjacent heads form a group, so query head h keeps reading the pool that
    contains its old KV head. ``mha`` may already be grouped; its KV heads are pooled further.
    """
    if not 1 <= n_kv_heads <= mha.n_kv_heads or mha.n_kv_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads must divide the current n_kv_heads ({mha.n_kv_heads}), "
                         f"got {n_kv_heads}")
    gqa = MultiHeadAttention(mha.d_model, mha.n_heads, n_kv_heads, mha.head_dim)
    gqa = gqa.to(device=mha.w_q.weight.device, dtype=mha.w_q.weight.dtype)
    gqa.w_q.weight.copy_(mha.w_q.weight)
    gqa.w_o.weight.copy_(mha.w_o.weight)
    group = mha.n_kv_heads // n_kv_heads
    for new, old in ((gqa.w_k, mha.w_k), (gqa.w_v, mha.w_v)):
        pooled = old.weight.view(n_kv_heads, group, mha.head_dim, mha.d_model).mean(dim=1)
        new.weight.copy_(pooled.reshape(-1, mha.d_model))
    return gqa


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek-V2 multi-head latent attention (MLA), causal, positions 0..T-1.

    c_kv = W_DKV x                         [B, T, d_latent]    cached
    k_h = W_UK_h c_kv, v_h = W_UV_h c_kv    [B, H, T, head_dim] rebuilt per head
    c_q = W_DQ x (if d_q_latent), q_h = W_UQ_h c_q (else q_h = W_Q_h x)
    With d_rope > 0, decoupled RoPE: a key k_R = RoPE(W_KR x) [B, T, d_rope] shared by all heads
    (also cached) and per-head q_R_h = RoPE(W_QR_h c_q); scores are
    (q_h . k_h + q_R_h . k_R) / sqrt(head_dim + d_rope).
    Left out from the paper: the RMSNorms on c_q and c_kv, and a value head size different from
    the key's.
    """

    def __init__(self, d_model: int, n_heads: int, head_dim: int, d_latent: int,
                 d_q_latent: int | None = None, d_rope: int = 0,
                 rope_theta: float = 10000.0) -> None:
        super().__init__()
        if min(d_model, n_heads, head_dim, d_latent, d_q_latent or 1) < 1:
            raise ValueError("d_model, n_heads, head_dim, d_latent and d_q_latent must be >= 1")
        if d_rope < 0 or d_rope % 2:
            raise ValueError(f"d_rope must be an even number >= 0, got {d_rope}")
        self.n_heads, self.head_dim = n_heads, head_dim
        self.d_latent, self.d_rope, self.rope_theta = d_latent, d_rope, rope_theta
        d_q_in = d_model if d_q_latent is None else d_q_latent
        self.w_dq = None if d_q_latent is None else nn.Linear(d_model, d_q_latent, bias=False)
        self.w_uq = nn.Linear(d_q_in, n_heads * head_dim, bias=False)
        self.w_dkv = nn.Linear(d_model, d_latent, bias=False)
        self.w_uk = nn.Linear(d_latent, n_heads * head_dim, bias=False)
        self.w_uv = nn.Linear(d_latent, n_heads * head_dim, bias=False)
        self.w_o = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self.w_qr = nn.Linear(d_q_in, n_heads * d_rope, bias=False) if d_rope else None
        self.w_kr = nn.Linear(d_model, d_rope, bias=False) if d_rope else None

    def _query_input(self, x: Tensor) -> Tensor:
        """c_q [B, T, d_q_latent], or x itself when the query is full rank."""
        return x if self.w_dq is None else self.w_dq(x)

    def _rope_scores(self, c_q: Tensor, x: Tensor) -> Tensor:
        """q_R_h . k_R for every head: [B, H, T, T] (0 when d_rope == 0)."""
        if not self.d_rope:
            return torch.zeros((), dtype=x.dtype, device=x.device)
        q_r = _rope(_heads(self.w_qr(c_q), self.n_heads), self.rope_theta)
        k_r = _rope(self.w_kr(x), self.rope_theta)
        return torch.einsum("bhtr,bsr->bhts", q_r, k_r)

    def kv_cache_tensors(self, x: Tensor) -> tuple[Tensor, ...]:
        """What a KV cache would hold for x [B, T, D]: c_kv [B, T, d_latent], plus k_R
        [B, T, d_rope] when d_rope > 0."""
        c_kv = self.w_dkv(x)
        return (c_kv,) if not self.d_rope else (c_kv, _rope(self.w_kr(x), self.rope_theta))

    def forward(self, x: Tensor) -> Tensor:
        """Naive form, x [B, T, D] -> [B, T, D]: up-project c_kv to per-head K and V."""
        b, t, _ = x.shape
        c_q, c_kv = self._query_input(x), self.w_dkv(x)
        q = _heads(self.w_uq(c_q), self.n_heads)
        k, v = _heads(self.w_uk(c_kv), self.n_heads), _heads(self.w_uv(c_kv), self.n_heads)
        scores = torch.einsum("bhtd,bhsd->bhts", q, k) + self._rope_scores(c_q, x)
        probs = causal_softmax(scores / math.sqrt(self.head_dim + self.d_rope))
        out = torch.einsum("bhts,bhsd->bhtd", probs, v)
        return self.w_o(out.transpose(1, 2).reshape(b, t, -1))

    def absorbed_weights(self) -> tuple[Tensor, Tensor]:
        """W_UK folded into the query side, W_UV into W_O.

        Returns w_q_lat [H, d_q_in, d_latent] (W_UQ_h^T W_UK_h) and w_o_lat [H, d_latent, D]
        ((W_O_h W_UV_h)^T), so q_h . k_h = (c_q w_q_lat_h) . c_kv and
        W_O concat_h(sum_s p_hs v_hs) = sum_h (sum_s p_hs c_kv_s) w_o_lat_h.
        """
        h, d = self.n_heads, self.head_dim
        w_uq = self.w_uq.weight.view(h, d, -1)
        w_uk = self.w_uk.weight.view(h, d, self.d_latent)
        w_uv = self.w_uv.weight.view(h, d, self.d_latent)
        w_o = self.w_o.weight.view(-1, h, d)
        return (torch.einsum("hdq,hdl->hql", w_uq, w_uk),
                torch.einsum("mhd,hdl->hlm", w_o, w_uv))

    def forward_absorbed(self, x: Tensor) -> Tensor:
        """Absorbed form, x [B, T, D] -> [B, T, D]: attention runs on c_kv, no per-head K or V."""
        w_q_lat, w_o_lat = self.absorbed_weights()
        c_q, c_kv = self._query_input(x), self.w_dkv(x)
        q_lat = torch.einsum("btq,hql->bhtl", c_q, w_q_lat)
        scores = torch.einsum("bhtl,bsl->bhts", q_lat, c_kv) + self._rope_scores(c_q, x)
        probs = causal_softmax(scores / math.sqrt(self.head_dim + self.d_rope))
        ctx = torch.einsum("bhts,bsl->bhtl", probs, c_kv)
        return torch.einsum("bhtl,hlm->btm", ctx, w_o_lat)

    def kv_bytes_per_token(self, bytes_per_elem: int = 2) -> int:
        """KV cache bytes per token for this layer: (d_latent + d_rope) x bytes."""
        return kv_cache_bytes_per_token("mla", d_latent=self.d_latent, d_rope=self.d_rope,
                                        bytes_per_elem=bytes_per_elem)
