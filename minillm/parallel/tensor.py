"""Tensor parallelism (Megatron-LM): each layer's matrices split across the ranks of a group.

Attention is split by heads: wq, wk, wv are *column*-parallel (rank r keeps the output rows of
its heads), so each rank attends with its own heads on the full sequence; wo is *row*-parallel
(rank r keeps the input columns of those heads), so each rank holds a partial sum of the output
and one all-reduce adds them. The SwiGLU FFN is the same pattern: w_gate and w_up split by
columns of ffn_dim, w_down by rows, one all-reduce. The embedding and the output head are split
by vocabulary: each rank looks up the ids in its slice (zeros elsewhere, then an all-reduce), and
computes the logits of its slice (then an all-gather). One forward pass therefore does
2 x n_layers + 1 all-reduces and 1 all-gather.

Grouped-query attention: ranks split the query heads evenly. KV heads are split too when the
world size divides them; when instead the world size is a multiple of the KV heads, each KV head
is *replicated* on the ranks whose query heads use it. Anything else is refused (ValueError).
An MoE model's FFN is expert-parallel instead (see :mod:`minillm.parallel.expert`): the hybrid
of TP attention and EP experts.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..model.transformer import Transformer
from . import comm


def check_tp(cfg: ModelConfig, world_size: int) -> None:
    """Raise ValueError unless ``cfg`` splits over ``world_size`` tensor-parallel ranks."""
    p = world_size
    if p < 1:
        raise ValueError(f"tensor-parallel world_size must be >= 1, got {p}")
    if cfg.n_heads % p:
        raise ValueError(
            f"tensor parallelism splits the {cfg.n_heads} query heads of {cfg.name} evenly, so "
            f"world_size must divide n_heads={cfg.n_heads}; got {p} (allowed: "
            f"{[d for d in range(1, cfg.n_heads + 1) if cfg.n_heads % d == 0]})")
    if cfg.n_kv_heads % p and p % cfg.n_kv_heads:
        raise ValueError(
            f"world_size={p} neither divides n_kv_heads={cfg.n_kv_heads} (split the KV heads) "
            f"nor is a multiple of it (replicate each KV head on world_size/n_kv_heads ranks)")
    if cfg.n_experts == 0 and cfg.ffn_dim % p:
        raise ValueError(f"world_size must divide ffn_dim={cfg.ffn_dim}, got {p}")
    if cfg.n_experts and cfg.n_experts % p:
        raise ValueError(f"world_size must divide n_experts={cfg.n_experts} (expert-parallel "
                         f"FFN), got {p}")
    if cfg.vocab_size % p:
        raise ValueError(f"world_size must divide vocab_size={cfg.vocab_size}, got {p}")


def kv_heads_of_rank(cfg: ModelConfig, rank: int, world_size: int) -> range:
    """The KV heads rank ``rank`` keeps: its share when split, the one it replicates otherwise."""
    if cfg.n_kv_heads % world_size == 0:
        per = cfg.n_kv_heads // world_size
        return range(rank * per, (rank + 1) * per)
    head = rank // (world_size // cfg.n_kv_heads)
    return range(head, head + 1)


class RowParallelLinear(nn.Module):
    """all_reduce(x_local @ W_local^T): x_local [..., in/P], W_local [out, in/P] -> [..., out]."""

    def __init__(self, weight: torch.Tensor, group=None, tag: str = "") -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group, self.tag = group, tag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(F.linear(x, self.weight), self.group, self.tag)


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + V/P) of the embedding; ids [B, T] -> [B, T, D] after an all-reduce."""

    def __init__(self, weight: torch.Tensor, start: int, group=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.group = start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        out = out * mine[..., None].to(out.dtype)
        return comm.all_reduce(out, self.group, "embedding")


class VocabParallelHead(nn.Module):
    """Logits of the vocab slice [V/P, D], all-gathered: x [..., D] -> [..., V]."""

    def __init__(self, weight: torch.Tensor, group=None) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(
            weight, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return comm.all_gather(F.linear(x, self.weight), dim=-1, group=self.group,
                               tag="lm_head")


def _rows(w: torch.Tensor, index: torch.Tensor | slice) -> torch.Tensor:
    return w[index].clone()


def _head_rows(heads: range, head_dim: int) -> slice:
    return slice(heads.start * head_dim, heads.stop * head_dim)


def _shard_attention(attn: nn.Module, cfg: ModelConfig, rank: int, p: int, group, i: int) -> None:
    q_heads = range(rank * cfg.n_heads // p, (rank + 1) * cfg.n_heads // p)
    kv = kv_heads_of_rank(cfg, rank, p)
    hd = cfg.head_dim
    attn.wq = _column(attn.wq, _head_rows(q_heads, hd))
    attn.wk = _column(attn.wk, _head_rows(kv, hd))
    attn.wv = _column(attn.wv, _head_rows(kv, hd))
    attn.wo = RowParallelLinear(attn.wo.weight[:, _head_rows(q_heads, hd)].clone(), group,
                                f"layer {i} attn")
    attn.n_heads, attn.n_kv_heads = len(q_heads), len(kv)


def _column(linear: nn.Linear, rows: slice) -> nn.Linear:
    weight = _rows(linear.weight, rows)
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device,
                    dtype=weight.dtype)
    out.weight = nn.Parameter(weight, requires_grad=False)
    return out


def _shard_swiglu(ffn: nn.Module, rank: int, p: int, group, i: int) -> None:
    per = ffn.w_gate.weight.shape[0] // p
    cols = slice(rank * per, (rank + 1) * per)
    ffn.w_gate = _column(ffn.w_gate, cols)
    ffn.w_up = _column(ffn.w_up, cols)
    ffn.w_down = RowParallelLinear(ffn.w_down.weight[:, cols].clone(), group, f"layer {i} ffn")


def tensor_parallel(model: Transformer, group=None) -> Transformer:
    """A copy of ``model`` holding this rank's shard (call on every rank of ``group``).

    The input model is not modified (it may sit in shared memory, shared by all ranks). The copy
    takes input_ids [B, T] (the same on every rank) and returns the full logits [B, T, V] on
    every rank, equal to the single-process model's up to float rounding.
    """
    from .expert import ExpertParallelMoE  # the hybrid: experts split across the TP ranks

    rank, p = comm.world(group)
    cfg = model.cfg
    check_tp(cfg, p)
    shard = copy.deepcopy(model)
    per_vocab = cfg.vocab_size // p
    vocab = slice(rank * per_vocab, (rank + 1) * per_vocab)
    emb = VocabParallelEmbedding(_rows(model.embed.weight, vocab), vocab.start, group)
    shard.embed = emb
    head = emb.weight if cfg.tie_embeddings else _rows(model.lm_head.weight, vocab)
    shard.lm_head = VocabParallelHead(head, group)
    for i, block in enumerate(shard.layers):
        _shard_attention(block.attn, cfg, rank, p, group, i)
        if cfg.n_experts:
            block.ffn = ExpertParallelMoE(block.ffn, group, "all_reduce", f"layer {i} ffn")
        else:
            _shard_swiglu(block.ffn, rank, p, group, i)
    return shard.requires_grad_(False)


def expected_collectives(cfg: ModelConfig) -> dict[str, int]:
    """Collectives of one TP forward pass: 2 all-reduces per layer + 1 for the embedding,
    1 all-gather for the logits."""
    return {"all_reduce": 2 * cfg.n_layers + 1, "all_gather": 1}
