"""One call per technique: check the arguments here, in the caller, then start the processes.

Every function takes the full single-process model (or tensors), starts ``world_size`` ranks
with :func:`~minillm.parallel.launch.run` and returns each rank's result dict (see
:mod:`minillm.parallel.workers`). Bad input raises ValueError before any process starts.
"""
from __future__ import annotations

import torch

from ..model.transformer import Transformer
from . import workers
from .expert import expert_range
from .launch import check_launch, run
from .pipeline import check_pipeline
from .tensor import check_tp


def _check_ids(input_ids: torch.Tensor, model: Transformer) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a LongTensor [batch, seq]")
    if input_ids.shape[1] > model.cfg.max_seq_len:
        raise ValueError(f"input_ids has {input_ids.shape[1]} tokens, more than "
                         f"max_seq_len={model.cfg.max_seq_len}")


def tp_logits(model: Transformer, input_ids: torch.Tensor, world_size: int,
              backend: str | None = None, repeats: int = 1) -> list[dict]:
    """Tensor-parallel forward of ids [B, T]; each rank returns {"logits" [B, T, V], "events",
    "seconds" (best of ``repeats``), "params" (numbers this rank holds)}."""
    check_launch(world_size, backend)
    check_tp(model.cfg, world_size)
    _check_ids(input_ids, model)
    return run(workers.tp_forward, world_size, model, input_ids, repeats, backend=backend)


def pp_logits(model: Transformer, input_ids: torch.Tensor, world_size: int, n_micro: int,
              backend: str | None = None) -> list[dict]:
    """Pipeline-parallel forward in ``n_micro`` micro-batches; the last rank's "logits" are
    [B, T, V]; every rank returns its "timeline" [(micro, start_s, end_s)] and "events"."""
    check_launch(world_size, backend)
    _check_ids(input_ids, model)
    check_pipeline(model.cfg.n_layers, world_size, input_ids.shape[0], n_micro)
    return run(workers.pp_forward, world_size, model, input_ids, n_micro, backend=backend)


def _check_moe(model: Transformer, world_size: int) -> None:
    if not model.cfg.n_experts:
        raise ValueError(f"expert parallelism needs an MoE model (cfg.n_experts > 0); "
                         f"{model.cfg.name} has a dense FFN")
    expert_range(model.cfg.n_experts, 0, world_size)


def ep_logits(model: Transformer, input_ids: torch.Tensor, world_size: int,
              backend: str | None = None) -> list[dict]:
    """Expert-parallel forward: rank r runs batch rows tensor_split(ids, P)[r]; returns its
    "logits", "events" and per-layer "stats" (compute_s, wait_s, slots)."""
    check_launch(world_size, backend)
    _check_ids(input_ids, model)
    _check_moe(model, world_size)
    if input_ids.shape[0] < world_size:
        raise ValueError(f"expert parallelism gives each rank its own rows of the batch: "
                         f"batch must be >= world_size={world_size}, got {input_ids.shape[0]}")
    return run(workers.ep_forward, world_size, model, input_ids, backend=backend)


def hybrid_logits(model: Transformer, input_ids: torch.Tensor, world_size: int,
                  backend: str | None = None) -> list[dict]:
    """TP attention + EP experts on an MoE model; every rank returns the full "logits"."""
    check_launch(world_size, backend)
    _check_ids(input_ids, model)
    _check_moe(model, world_size)
    check_tp(model.cfg, world_size)
    return run(workers.hybrid_forward, world_size, model, input_ids, backend=backend)


def moe_stall(moe, x: torch.Tensor, world_size: int, repeats: int = 3,
              backend: str | None = None) -> list[dict]:
    """One expert-parallel MoE layer on x [N, D] (rows split over ranks): per rank "out",
    "compute_s", "wait_s", "slots", "total_s" (the best of ``repeats`` runs)."""
    check_launch(world_size, backend)
    expert_range(moe.n_experts, 0, world_size)
    if x.dim() != 2 or x.shape[0] < world_size:
        raise ValueError(f"x must be [N, D] with N >= world_size={world_size}, got "
                         f"{tuple(x.shape)}")
    return run(workers.moe_layer_stall, world_size, moe, x, repeats, backend=backend)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError("q must be [B, H, T, D] and k, v [B, Hkv, T, D] of the same shape")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} do not match (batch, "
                         f"head_dim, and H a multiple of Hkv)")


def sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, world_size: int,
                       scheme: str = "ring", causal: bool = True, ulysses_degree: int = 1,
                       backend: str | None = None) -> tuple[torch.Tensor, list[dict]]:
    """Attention of q [B, H, T, D] over k, v [B, Hkv, T, D] split over ``world_size`` ranks by
    sequence with ``scheme`` ("ring", "striped", "ulysses", "usp"). Returns (out [B, H, T, D]
    reassembled from the shards, each rank's result dict)."""
    from . import sequence as sp

    check_launch(world_size, backend)
    if scheme not in workers.SP_SCHEMES:
        raise ValueError(f"scheme must be one of {workers.SP_SCHEMES}, got {scheme!r}")
    _check_qkv(q, k, v)
    if q.shape[2] != k.shape[2]:
        raise ValueError("sequence parallelism here is self-attention: q and k need the same T")
    sp.shard_positions(q.shape[2], world_size)  # checks T >= world_size
    if scheme == "ulysses":
        sp.check_ulysses(q.shape[1], k.shape[1], world_size)
    if scheme == "usp":
        if ulysses_degree < 1 or world_size % ulysses_degree:
            raise ValueError(f"ulysses_degree must divide world_size={world_size}, got "
                             f"{ulysses_degree}")
        sp.check_ulysses(q.shape[1], k.shape[1], ulysses_degree)
    results = run(workers.sp_attention, world_size, q, k, v, scheme, causal, ulysses_degree,
                  backend=backend)
    out = torch.zeros_like(q)
    for r in results:
        real = r["positions"] >= 0
        out[:, :, r["positions"][real]] = r["out"][:, :, real].to(q.dtype)
    return out, results


def pass_q_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, world_size: int,
                     q_positions: torch.Tensor | None = None,
                     backend: str | None = None) -> tuple[torch.Tensor, list[dict]]:
    """Decode with ring pass-Q: queries q [B, H, P Lq, D] at ``q_positions`` [P Lq] (default
    T, T+1, ...: after the whole cache) over a cache k, v [B, Hkv, T, D] split over the ranks,
    causal by position. Returns (out [B, H, P Lq, D], per-rank results)."""
    from . import sequence as sp

    check_launch(world_size, backend)
    _check_qkv(q, k, v)
    sp.shard_positions(k.shape[2], world_size)
    if q.shape[2] % world_size:
        raise ValueError(f"the new tokens are split evenly: q's length {q.shape[2]} must be a "
                         f"multiple of world_size={world_size}")
    if q_positions is None:
        q_positions = torch.arange(k.shape[2], k.shape[2] + q.shape[2])
    if q_positions.shape != (q.shape[2],):
        raise ValueError(f"q_positions must be [{q.shape[2]}] (one per query), got "
                         f"{tuple(q_positions.shape)}")
    results = run(workers.pass_q_decode, world_size, q, k, v, q_positions, backend=backend)
    return torch.cat([r["out"] for r in results], dim=2), results
