"""Recorders and the load sweep for the engine experiments of chapter 04.

The workloads are :mod:`minillm.workloads`' and the driver :func:`minillm.driver.drive` (a
virtual clock: it advances by the measured wall time of each engine step and jumps over idle
gaps). This module adds what the chapter looks at:

- :class:`Recorder`: subscribes to an :class:`~minillm.engine.LLMEngine`'s step hook to keep
  each step's plan (new tokens per request, block moves and their time) and a
  :class:`MemorySnapshot` of the block tables (for memory maps and the explorer widget);
- :func:`record_run`: :func:`~minillm.driver.drive` with a :class:`Recorder` attached, giving a
  :class:`RecordedRun` (KV waste, requests per step);
- :class:`AttentionRecorder`: a paged attention backend, passed in through
  ``EngineConfig(attention_backend=...)``, that hands every call to another backend and keeps
  what the first layer received in each step;
- :func:`load_sweep`: Poisson arrivals at multiples of a capacity, one fresh engine each.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..attention.paged import PagedAttentionBackend, PagedMetadata, get_paged_backend
from ..config import SamplingParams
from ..driver import DriveResult, drive
from ..engine.engine import LLMEngine
from ..engine.outputs import StepRecord
from ..workloads import Workload, offered_rate, poisson_arrivals


# ---- recording -------------------------------------------------------------------------------
@dataclass
class MemorySnapshot:
    """The device pool after one step. Per physical block: ``owners`` (request ids whose
    sequences hold it; several when shared), ``ref`` (reference count), ``fill`` (token slots
    holding K/V). ``tables``: seq id -> (request id, block table, tokens)."""

    step: int
    block_size: int
    owners: list[list[str]]
    ref: list[int]
    fill: list[int]
    tables: dict[int, tuple[str, list[int], int]]

    @property
    def num_blocks(self) -> int:
        return len(self.ref)

    @property
    def blocks_used(self) -> int:
        return sum(r > 0 for r in self.ref)

    @property
    def blocks_unshared(self) -> int:
        """Blocks the same sequences would need if nothing were shared."""
        return sum(len(t) for _, t, _ in self.tables.values())


def snapshot(engine: LLMEngine, step: int) -> MemorySnapshot:
    bm = engine.blocks
    owner_of = {s.seq_id: r.request_id for r in engine.scheduler.running for s in r.seqs}
    owners: list[list[str]] = [[] for _ in range(bm.num_blocks)]
    fill = [0] * bm.num_blocks
    tables = {}
    for seq_id, table in bm.tables.items():
        rid, n = owner_of.get(seq_id, "?"), bm.filled[seq_id]
        tables[seq_id] = (rid, list(table), n)
        for i, b in enumerate(table):
            if rid not in owners[b]:
                owners[b].append(rid)
            fill[b] = max(fill[b], min(bm.block_size, max(0, n - i * bm.block_size)))
    return MemorySnapshot(step, bm.block_size, owners, list(bm.device.ref), fill, tables)


@dataclass
class StepPlan:
    """What one step computed and moved: new tokens per scheduled request, block moves."""

    new_tokens: dict[str, int]
    swap_out: int
    swap_in: int
    copies: int


class Recorder:
    """Subscribes to one engine's step hook to keep a :class:`StepPlan` per step, a
    :class:`MemorySnapshot` after it (``snapshots=True``) and the seconds the steps spent moving
    blocks (swap, copy-on-write) before their forward passes."""

    def __init__(self, engine: LLMEngine, snapshots: bool = False) -> None:
        self.engine = engine
        self.plans: list[StepPlan] = []
        self.snapshots: list[MemorySnapshot] = []
        self.swap_seconds = 0.0
        self.keep_snapshots = snapshots
        engine.step_hooks.append(self.on_step)

    def on_step(self, engine: LLMEngine, record: StepRecord) -> None:
        self.plans.append(StepPlan(dict(record.scheduled), record.swapped_out,
                                   record.swapped_in, record.copied))
        self.swap_seconds += record.move_seconds
        if self.keep_snapshots:
            self.snapshots.append(snapshot(engine, record.index))

    def close(self) -> None:
        """Stop recording."""
        if self.on_step in self.engine.step_hooks:
            self.engine.step_hooks.remove(self.on_step)


class AttentionRecorder:
    """A :class:`~minillm.attention.paged.PagedAttentionBackend` that delegates every call to
    ``inner`` (a backend or its name) and keeps, per engine step, what the first layer's call
    got and gave: ``steps[i]`` holds ``meta`` (the step's metadata), ``q`` and ``out``
    [N, Hq, D], and copies of that layer's ``k_cache`` and ``v_cache`` [num_blocks,
    block_size, Hkv, D] taken after the step's new K/V were written. It reads the metadata
    ``inner`` reads, and must see every call, so the C++ CPU path never replaces it."""

    cpu_fast_path = False

    def __init__(self, inner: str | PagedAttentionBackend) -> None:
        self.inner = get_paged_backend(inner)
        self.name = f"recorded {self.inner.name}"
        self.reads_direct = self.inner.reads_direct
        self.steps: list[dict] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: PagedMetadata) -> torch.Tensor:
        out = self.inner(q, k, v, k_cache, v_cache, meta)
        if not self.steps or self.steps[-1]["meta"] is not meta:    # a step's first layer
            self.steps.append(dict(meta=meta, q=q.clone(), out=out.clone(),
                                   k_cache=k_cache.clone(), v_cache=v_cache.clone()))
        return out


# ---- a recorded run ----------------------------------------------------------------------------
@dataclass
class RecordedRun(DriveResult):
    """A :class:`~minillm.driver.DriveResult` with the :class:`Recorder` that watched it and
    the engine's pool size."""

    recorder: Recorder | None = None
    block_size: int = 16
    num_blocks: int = 0

    @property
    def kv_waste(self) -> float:
        return kv_waste(self.trace, self.block_size)


def kv_waste(trace: list[StepRecord], block_size: int) -> float:
    """Allocated KV slots holding nothing, over all steps (each step's pool after it)."""
    allocated = sum(r.blocks_used * block_size for r in trace)
    return 1 - sum(r.slots_used for r in trace) / max(1, allocated)


def record_run(engine: LLMEngine, work: Workload, params: SamplingParams | list[SamplingParams]
               | None = None, arrivals: list[float] | None = None,
               priorities: list[int] | None = None, stop_at: list[int] | None = None,
               snapshots: bool = False) -> RecordedRun:
    """:func:`~minillm.driver.drive` ``work`` through ``engine`` on the virtual clock with a
    :class:`Recorder` (and memory snapshots, if asked) watching every step."""
    rec = Recorder(engine, snapshots)
    run = drive(engine, work, params, arrivals, priorities, stop_at)
    rec.close()
    return RecordedRun(run.records, run.timeline, run.trace, run.makespan, rec,
                       engine.blocks.block_size, engine.blocks.num_blocks)


@dataclass
class LoadPoint:
    """One run of a load sweep: the target rate (a multiple ``factor`` of the capacity), the
    seed of its workload and arrivals, the rate the arrivals offered, and what was measured."""

    factor: float
    seed: int
    offered: float
    throughput: float                  # output tokens / s
    e2e: list[float]                   # per request, arrival to last token (s)
    ttft: list[float]                  # per request, arrival to first token (s)
    mean_running: float                # requests per step
    steps: int                         # engine steps the run took
    decode_steps: list[tuple[int, float]]   # (requests, seconds) of each step without prefill

    def quantile(self, what: str, q: float) -> float:
        """The ``q`` quantile of ``what`` ("e2e" or "ttft") over the requests."""
        vals = sorted(getattr(self, what))
        return vals[min(len(vals) - 1, int(q * len(vals)))]


def load_sweep(make_engine: Callable[[], LLMEngine], make_work: Callable[[int], Workload],
               capacity: float, factors: list[float], seeds: list[int]) -> list[LoadPoint]:
    """Serve ``make_work(seed)`` on a fresh engine with Poisson arrivals at ``factor *
    capacity`` requests/s, for every factor and seed; one :class:`LoadPoint` each."""
    points = []
    for factor in factors:
        for seed in seeds:
            work = make_work(seed)
            arrivals = poisson_arrivals(len(work.prompts), factor * capacity, seed=seed)
            run = drive(make_engine(), work, arrivals=arrivals)
            points.append(LoadPoint(factor, seed, offered_rate(arrivals), run.throughput,
                                    [r.e2e for r in run.records], [r.ttft for r in run.records],
                                    run.mean_running, len(run.trace),
                                    [(len(r.request_ids), r.end - r.start) for r in run.trace
                                     if not r.prefill_tokens]))
    return points


def padded_tokens(plans: list[StepPlan]) -> tuple[int, int]:
    """(flat, padded): tokens the steps computed as one flat batch (selective batching), and
    what a [requests x longest] padded batch would have held."""
    flat = sum(sum(p.new_tokens.values()) for p in plans)
    padded = sum(len(p.new_tokens) * max(p.new_tokens.values()) for p in plans)
    return flat, padded


def recomputed_tokens(run: DriveResult) -> int:
    """Tokens computed beyond what a run without preemption computes (prompt + output - 1
    per request): the cost of preemption by recompute."""
    computed = sum(r.prefill_tokens + r.decode_tokens for r in run.trace)
    return computed - sum(r.prompt_len + r.output_len - 1 for r in run.records)


__all__ = ["AttentionRecorder", "LoadPoint", "MemorySnapshot", "RecordedRun", "Recorder",
           "StepPlan", "kv_waste", "load_sweep", "padded_tokens", "recomputed_tokens",
           "record_run", "snapshot"]
