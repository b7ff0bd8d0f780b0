"""Pipeline parallelism: consecutive layers on consecutive ranks, activations sent point to point.

Stage s holds layers ``stage_layers(n_layers, P)[s]``; stage 0 also the embedding, the last
stage the final norm and the output head. One batch alone would keep only one stage busy at a
time, so the batch is cut into m micro-batches that follow each other down the pipeline (GPipe,
Huang et al. 2019, here for inference: forward only). With equal stage times the pipeline is
idle for a fraction (p-1)/(m+p-1) of its capacity: the *bubble* while it fills and drains.
Every stage records when it computed each micro-batch, so the bubble can be measured.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from ..model.layers import rope_cos_sin
from ..model.transformer import Transformer, _heads_axis
from . import comm


def stage_layers(n_layers: int, world_size: int) -> list[range]:
    """Split n_layers into world_size contiguous stages, the first ones one layer longer."""
    if not 1 <= world_size <= n_layers:
        raise ValueError(f"pipeline world_size must be in [1, n_layers={n_layers}], "
                         f"got {world_size}")
    base, extra = divmod(n_layers, world_size)
    sizes = [base + (s < extra) for s in range(world_size)]
    starts = [sum(sizes[:s]) for s in range(world_size)]
    return [range(a, a + n) for a, n in zip(starts, sizes)]


def bubble_formula(world_size: int, n_micro: int) -> float:
    """GPipe's idle fraction (p-1)/(m+p-1) for p equal stages and m micro-batches."""
    return (world_size - 1) / (n_micro + world_size - 1)


def check_pipeline(n_layers: int, world_size: int, batch: int, n_micro: int) -> None:
    """ValueError unless the layers and the batch split as asked."""
    stage_layers(n_layers, world_size)
    if not 1 <= n_micro <= batch:
        raise ValueError(f"n_micro must be in [1, batch={batch}] (micro-batches split the "
                         f"batch), got {n_micro}")


class Stage(nn.Module):
    """This rank's slice of the model: x [b, T, D] (or ids [b, T] on stage 0) -> [b, T, D]
    (or logits [b, T, V] on the last stage)."""

    def __init__(self, model: Transformer, rank: int, world_size: int) -> None:
        super().__init__()
        self.cfg, self.first, self.last = model.cfg, rank == 0, rank == world_size - 1
        self.layers = nn.ModuleList(model.layers[i] for i in stage_layers(model.cfg.n_layers,
                                                                          world_size)[rank])
        self.embed = model.embed if self.first else None
        self.norm = model.norm if self.last else None
        self.lm_head = model.lm_head if self.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        dtype = self.layers[0].attn_norm.weight.dtype
        cos, sin = rope_cos_sin(torch.arange(t, device=x.device), self.cfg.head_dim,
                                self.cfg.rope_theta, dtype)
        cos, sin = _heads_axis(cos), _heads_axis(sin)
        if self.first:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x)) if self.last else x


@torch.inference_mode()
def pipeline_forward(model: Transformer, input_ids: torch.Tensor, n_micro: int,
                     group=None) -> dict:
    """Run ``input_ids`` [B, T] through the pipeline in ``n_micro`` micro-batches (GPipe).

    Call on every rank with the same model and ids. Returns {"logits": [B, T, V] on the last
    stage, else None, "timeline": [(micro, start_s, end_s)] of this stage's compute}. Times are
    ``time.perf_counter()`` readings, one system-wide clock for the processes of a machine
    (:func:`align` counts them from the earliest start). The model is not modified.
    """
    rank, p = comm.world(group)
    check_pipeline(model.cfg.n_layers, p, input_ids.shape[0], n_micro)
    stage = Stage(model, rank, p)
    micro = torch.tensor_split(input_ids, n_micro, dim=0)
    d, dtype = model.cfg.d_model, model.dtype
    timeline, outputs, pending = [], [], []
    dist.barrier(group)
    for i, ids in enumerate(micro):
        if stage.first:
            x = ids
        else:
            x = torch.empty(ids.shape[0], ids.shape[1], d, dtype=dtype, device=ids.device)
            dist.recv(x, src=_peer(rank - 1, group), group=group)
            comm.log_p2p("recv", x, f"micro {i}")
        start = time.perf_counter()
        y = stage(x)
        timeline.append((i, start, time.perf_counter()))
        if stage.last:
            outputs.append(y)
        else:  # asynchronous: the next micro-batch starts while this one is in flight
            pending.append(dist.isend(y.contiguous(), dst=_peer(rank + 1, group), group=group))
            comm.log_p2p("send", y, f"micro {i}")
    for work in pending:
        work.wait()
    return {"logits": torch.cat(outputs) if stage.last else None, "timeline": timeline}


def _peer(group_rank: int, group) -> int:
    """Global rank of ``group_rank`` in ``group`` (send/recv take global ranks)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def align(timelines: list[list[tuple[int, float, float]]]) -> list[list[tuple[int, float, float]]]:
    """The stages' timelines with times counted from the earliest start of any stage."""
    t0 = min(s for tl in timelines for _, s, _ in tl)
    return [[(m, s - t0, e - t0) for m, s, e in tl] for tl in timelines]


def measured_bubble(timelines: list[list[tuple[int, float, float]]]) -> float:
    """1 - busy / (stages x makespan), from every stage's timeline (first start to last end)."""
    start = min(s for tl in timelines for _, s, _ in tl)
    end = max(e for tl in timelines for _, _, e in tl)
    busy = sum(e - s for tl in timelines for _, s, e in tl)
    return 1.0 - busy / (len(timelines) * (end - start))


def simulate_pipeline(costs: list[list[float]]) -> list[list[tuple[int, float, float]]]:
    """The GPipe forward schedule that stage costs give, without running anything.

    costs[s][i] is the time stage s spends on micro-batch i ([p][m]). Stages take their
    micro-batches in order and start each one as soon as both the stage and the micro-batch
    (done by stage s-1) are free, with free transfers. Returns timelines [stage][(micro, start,
    end)] in the format of :func:`align`, for :func:`measured_bubble` and the Gantt plots.
    """
    if not costs or not costs[0] or any(len(row) != len(costs[0]) for row in costs):
        raise ValueError("costs must be a non-empty [stages][micro-batches] table of equal rows")
    timelines, ready = [], [0.0] * len(costs[0])  # ready[i]: when micro-batch i left stage s-1
    for row in costs:
        free, timeline = 0.0, []
        for i, cost in enumerate(row):
            start = max(free, ready[i])
            free = ready[i] = start + cost
            timeline.append((i, start, free))
        timelines.append(timeline)
    return timelines
