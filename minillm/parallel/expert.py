"""Expert parallelism: a mixture-of-experts layer whose experts live on different ranks.

Rank r keeps experts [r E/P, (r+1) E/P) and a copy of the router. Two ways to combine:

- ``combine="all_to_all"`` (plain EP, every rank has its *own* tokens): route locally, sort the
  (token, expert) slots by the rank that owns the expert, an all-to-all sends each slot's token
  vector there (*dispatch*), the owner runs its experts, a second all-to-all sends the results
  back (*return*), and the sender adds them with the router weights.
- ``combine="all_reduce"`` (the hybrid with tensor-parallel attention, where every rank already
  has *all* tokens): each rank runs its experts on the slots routed to them and one all-reduce
  sums the partial outputs, the same place a TP FFN would all-reduce.

Either way the output equals the single-process :class:`~minillm.model.moe.MoEFeedForward` and every
slot (tokens x top_k) is computed exactly once. A rank whose experts got more slots computes
longer; the others wait for it in the return collective: the load-imbalance stall, which
``last_stats`` records (seconds computing, seconds waiting, slots received).
"""
from __future__ import annotations

import copy
import time

import torch
from torch import nn

from ..model.moe import MoEFeedForward
from ..model.transformer import Transformer
from . import comm

COMBINES = ("all_to_all", "all_reduce")


def expert_range(n_experts: int, rank: int, world_size: int) -> range:
    """The experts rank ``rank`` holds (a contiguous block of n_experts / world_size)."""
    if n_experts % world_size:
        raise ValueError(f"world_size must divide n_experts={n_experts}, got {world_size}")
    per = n_experts // world_size
    return range(rank * per, (rank + 1) * per)


class ExpertParallelMoE(nn.Module):
    """This rank's part of a :class:`MoEFeedForward`: x [..., D] -> [..., D] (see module doc)."""

    def __init__(self, moe: MoEFeedForward, group=None, combine: str = "all_to_all",
                 tag: str = "") -> None:
        super().__init__()
        if combine not in COMBINES:
            raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
        rank, p = comm.world(group)
        self.mine = expert_range(moe.n_experts, rank, p)
        self.n_experts, self.top_k = moe.n_experts, moe.top_k
        self.router = copy.deepcopy(moe.router)
        self.experts = nn.ModuleList(copy.deepcopy(moe.experts[e]) for e in self.mine)
        self.noise_std, self.world = 0.0, p
        self.group, self.combine, self.tag = group, combine, tag
        self.last_stats: dict[str, float] = {}

    def _run_experts(self, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """x [S, D] rows, expert_ids [S] (global ids, all local) -> expert(x) per row [S, D]."""
        out = torch.empty_like(x)
        for local, expert in enumerate(self.experts):
            rows = (expert_ids == self.mine.start + local).nonzero(as_tuple=True)[0]
            if rows.numel():
                out[rows] = expert(x[rows]).to(out.dtype)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, experts, _ = MoEFeedForward.route(self, flat)  # the same rule, same router
        slots, w = experts.flatten(), weights.flatten()  # slot j belongs to token j // top_k
        tokens = torch.arange(slots.numel(), device=x.device) // self.top_k
        if self.combine == "all_reduce":
            out = self._forward_replicated(flat, slots, w, tokens)
        else:
            out = self._forward_all_to_all(flat, slots, w, tokens)
        return out.view(x.shape)

    def _forward_replicated(self, flat, slots, w, tokens) -> torch.Tensor:
        mine = (slots >= self.mine.start) & (slots < self.mine.stop)
        t0 = time.perf_counter()
        part = self._run_experts(flat[tokens[mine]], slots[mine]) * w[mine, None].to(flat.dtype)
        out = torch.zeros_like(flat).index_add_(0, tokens[mine], part)
        t1 = time.perf_counter()
        comm.all_reduce(out, self.group, self.tag)
        self.last_stats = {"compute_s": t1 - t0, "wait_s": time.perf_counter() - t1,
                           "slots": int(mine.sum())}
        return out

    def _forward_all_to_all(self, flat, slots, w, tokens) -> torch.Tensor:
        per, p = len(self.mine), self.world
        order = (slots // per).argsort(stable=True)  # slots grouped by destination rank
        send = torch.bincount(slots // per, minlength=p).tolist()
        recv = comm.exchange_counts(send, self.group, flat.device)
        x_in = comm.all_to_all(flat[tokens[order]], send, recv, self.group, self.tag + " dispatch")
        ids_in = comm.all_to_all(slots[order], send, recv, self.group, self.tag + " ids")
        t0 = time.perf_counter()
        y_in = self._run_experts(x_in, ids_in)
        t1 = time.perf_counter()
        y = comm.all_to_all(y_in, recv, send, self.group, self.tag + " return")
        self.last_stats = {"compute_s": t1 - t0, "wait_s": time.perf_counter() - t1,
                           "slots": int(sum(recv))}
        gated = y * w[order, None].to(y.dtype)
        return torch.zeros_like(flat).index_add_(0, tokens[order], gated)


def expert_parallel(model: Transformer, group=None) -> Transformer:
    """A copy of an MoE ``model`` whose FFNs are expert-parallel with all-to-all (attention and
    embeddings replicated). Each rank feeds its *own* batch: ids [B_r, T] -> logits [B_r, T, V].
    """
    if not model.cfg.n_experts:
        raise ValueError(f"expert parallelism needs an MoE model (cfg.n_experts > 0); "
                         f"{model.cfg.name} is dense")
    _, p = comm.world(group)
    expert_range(model.cfg.n_experts, 0, p)  # checks divisibility
    shard = copy.deepcopy(model)
    for i, block in enumerate(shard.layers):
        block.ffn = ExpertParallelMoE(block.ffn, group, "all_to_all", f"layer {i} ffn")
    return shard.requires_grad_(False)


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The MoE FFN of every layer (single-process or expert-parallel)."""
    return [b.ffn for b in model.layers if isinstance(b.ffn, (MoEFeedForward, ExpertParallelMoE))]
