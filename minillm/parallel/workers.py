"""Functions one rank runs under :func:`minillm.parallel.run` (importable, so notebooks can spawn
them). Each takes the full single-process model or tensors (the same on every rank), does its
rank's share, and returns plain data: outputs plus the communication log."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from . import comm
from .expert import ExpertParallelMoE, expert_parallel, moe_layers
from .launch import device_for_rank
from .pipeline import pipeline_forward
from .tensor import tensor_parallel


def _here(*items):
    """Move models/tensors to this rank's device (its GPU under NCCL, else the CPU)."""
    dev = device_for_rank(dist.get_rank())
    return tuple(x.to(dev) for x in items)


def _timed(fn, repeats: int) -> tuple[object, float]:
    """(fn(), best wall time of ``repeats`` runs, each started after a barrier)."""
    best, out = float("inf"), None
    for _ in range(max(1, repeats)):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def hello() -> dict:
    """Who am I, and an all-reduce: every rank contributes rank + 1, all receive the sum."""
    rank, p = comm.world()
    t = torch.tensor([rank + 1.0], device=device_for_rank(rank))
    dist.all_reduce(t)
    return {"rank": rank, "world_size": p, "backend": dist.get_backend(), "sum": t.item(),
            "threads": torch.get_num_threads()}


@torch.inference_mode()
def tp_forward(model, input_ids: torch.Tensor, repeats: int = 1) -> dict:
    """Tensor-parallel logits [B, T, V] of ``input_ids`` plus the log of one forward pass."""
    model, input_ids = _here(model, input_ids)
    shard = tensor_parallel(model)
    comm.reset()
    logits = shard(input_ids)
    events = comm.events()
    _, seconds = _timed(lambda: shard(input_ids), repeats)
    return {"logits": logits, "events": events, "seconds": seconds,
            "params": sum(p.numel() for p in shard.parameters())}


@torch.inference_mode()
def pp_forward(model, input_ids: torch.Tensor, n_micro: int) -> dict:
    """Pipeline-parallel forward in ``n_micro`` micro-batches: logits on the last rank, every
    stage's compute timeline and the point-to-point log."""
    model, input_ids = _here(model, input_ids)
    comm.reset()
    pipeline_forward(model, input_ids[:1], 1)  # warm-up: first calls allocate
    comm.reset()
    out = pipeline_forward(model, input_ids, n_micro)
    out["events"] = comm.events()
    return out


@torch.inference_mode()
def ep_forward(model, input_ids: torch.Tensor) -> dict:
    """Expert parallel: rank r takes its slice of the batch (torch.tensor_split), runs the model
    whose FFN experts are spread over the ranks, returns its logits and per-layer stats."""
    rank, p = comm.world()
    model, input_ids = _here(model, input_ids)
    shard = expert_parallel(model)
    mine = torch.tensor_split(input_ids, p, dim=0)[rank]
    comm.reset()
    logits = shard(mine)
    return {"logits": logits, "events": comm.events(),
            "stats": [m.last_stats for m in moe_layers(shard)]}


@torch.inference_mode()
def hybrid_forward(model, input_ids: torch.Tensor) -> dict:
    """TP attention + EP experts (combined by all-reduce) on an MoE model: full logits."""
    model, input_ids = _here(model, input_ids)
    shard = tensor_parallel(model)
    comm.reset()
    logits = shard(input_ids)
    return {"logits": logits, "events": comm.events(),
            "stats": [m.last_stats for m in moe_layers(shard)]}


@torch.inference_mode()
def moe_layer_stall(moe, x: torch.Tensor, repeats: int = 3) -> dict:
    """One expert-parallel MoE layer on x [N, D] split over the ranks by rows; the best of
    ``repeats`` runs of its compute and wait times (seconds) and slots received."""
    rank, p = comm.world()
    moe, x = _here(moe, x)
    layer = ExpertParallelMoE(moe, combine="all_to_all")
    mine = torch.tensor_split(x, p, dim=0)[rank]
    runs = []
    for _ in range(max(1, repeats)):
        dist.barrier()
        t0 = time.perf_counter()
        out = layer(mine)
        runs.append(dict(layer.last_stats, total_s=time.perf_counter() - t0))
    best = min(runs, key=lambda r: r["total_s"])
    return {"out": out, **best}


SP_SCHEMES = ("ring", "striped", "ulysses", "usp")


@torch.inference_mode()
def sp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scheme: str, causal: bool,
                 ulysses_degree: int = 1) -> dict:
    """Sequence-parallel attention of the full q [B, H, T, D], k/v [B, Hkv, T, D] (the same on
    every rank): this rank takes its shard, runs ``scheme`` and returns its "out" [B, H, L, D],
    its "positions" [L] (-1 = padding), "pairs" computed (ring schemes), "seconds", "events"."""
    from . import sequence as sp

    rank, p = comm.world()
    q, k, v = _here(q, k, v)
    layout = "striped" if scheme == "striped" else "contiguous"
    pos = sp.shard_positions(q.shape[2], p, layout)[rank].to(q.device)
    ql, kl, vl = sp.take(q, pos), sp.take(k, pos), sp.take(v, pos)
    groups = sp.usp_groups(ulysses_degree) if scheme == "usp" else None
    stats: dict = {}
    comm.reset()
    dist.barrier()
    t0 = time.perf_counter()
    if scheme in ("ring", "striped"):
        out = sp.ring_attention(ql, kl, vl, pos, pos, causal, stats=stats)
    elif scheme == "ulysses":
        out = sp.ulysses_attention(ql, kl, vl, pos, causal)
    else:
        out = sp.usp_attention(ql, kl, vl, pos, causal, *groups, stats=stats)
    seconds = time.perf_counter() - t0
    return {"out": out, "positions": pos, "pairs": stats.get("pairs"), "seconds": seconds,
            "events": comm.events()}


@torch.inference_mode()
def pass_q_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  q_positions: torch.Tensor) -> dict:
    """Ring pass-Q: the cache k/v [B, Hkv, T, D] is split contiguously over the ranks, rank r owns
    the query block q[:, :, r Lq:(r+1) Lq] at positions q_positions[r Lq:(r+1) Lq]; returns its
    "out" [B, H, Lq, D] and "events"."""
    from . import sequence as sp

    rank, p = comm.world()
    q, k, v, q_positions = _here(q, k, v, q_positions)
    k_pos = sp.shard_positions(k.shape[2], p, "contiguous")[rank].to(q.device)
    lq = q.shape[2] // p
    q_pos = q_positions[rank * lq:(rank + 1) * lq]
    comm.reset()
    out = sp.ring_pass_q(q[:, :, rank * lq:(rank + 1) * lq], sp.take(k, k_pos), sp.take(v, k_pos),
                         q_pos, k_pos)
    return {"out": out, "events": comm.events()}
