"""Workloads and a measuring driver for the engine experiments of chapter 04.

- :func:`sharegpt_like_workload`: seeded lognormal prompt and output lengths (a *synthetic*
  stand-in for ShareGPT's long-tailed conversation lengths), prompts cut from real prose;
  :func:`minillm.bench.throughput.make_workload` is the uniform-length one.
- :func:`poisson_arrivals`: arrival times of a Poisson process; :func:`offered_rate`, the rate
  a list of arrivals actually offers.
- :class:`Recorder`: subscribes to an :class:`~minillm.engine.LLMEngine`'s step hook to keep
  each step's plan (new tokens per request, block moves and their time) and a
  :class:`MemorySnapshot` of the block tables (for memory maps and the explorer widget).
- :class:`AttentionRecorder`: a paged attention backend, passed in through
  ``EngineConfig(attention_backend=...)``, that hands every call to another backend and keeps
  what the first layer received in each step.
- :func:`serve`: an arrival-driven loop over a *virtual clock*: the clock advances by the
  measured wall time of each engine step and jumps over idle gaps (nobody waits for a request to
  arrive), so a load sweep costs only the compute. ``stop_at`` ends a request at a given number
  of tokens (its "EOS") while its SamplingParams still say a larger ``max_tokens``: that is what
  a server reserving for max_tokens sees.
"""
from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..attention.paged import PagedAttentionBackend, PagedMetadata, get_paged_backend
from ..bench.throughput import Workload
from ..config import SamplingParams
from ..engine.engine import LLMEngine
from ..engine.outputs import StepRecord
from ..evaluate import sample_ids


# ---- workloads -------------------------------------------------------------------------------
def lognormal_lengths(n: int, median: float, sigma: float, low: int, high: int,
                      rng: random.Random) -> list[int]:
    """``n`` integers from a lognormal with the given median and log-space sigma, clipped."""
    mu = math.log(median)
    return [min(high, max(low, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def sharegpt_like_workload(tok, num_requests: int, prompt_median: float = 64,
                           output_median: float = 48, sigma: float = 0.8,
                           prompt_max: int = 256, output_max: int = 192,
                           seed: int = 0) -> Workload:
    """Synthetic long-tailed lengths (lognormal, like ShareGPT's), seeded; prompts are
    windows of English prose from :func:`minillm.evaluate.sample_ids`."""
    rng = random.Random(seed)
    p_lens = lognormal_lengths(num_requests, prompt_median, sigma, 4, prompt_max, rng)
    o_lens = lognormal_lengths(num_requests, output_median, sigma, 2, output_max, rng)
    text = sample_ids(4 * prompt_max, tok)
    starts = [rng.randrange(0, len(text) - n) for n in p_lens]
    return Workload([text[s:s + n] for s, n in zip(starts, p_lens)], o_lens)


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (s) of a Poisson process of ``rate`` requests/s; rate inf: all at 0."""
    if rate == math.inf:
        return [0.0] * num_requests
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(num_requests):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def offered_rate(arrivals: list[float]) -> float:
    """Requests/s a list of arrival times offers: (n - 1) gaps over the span they cover."""
    span = max(arrivals) - min(arrivals)
    return (len(arrivals) - 1) / span if span > 0 else math.inf


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


# ---- the driver ------------------------------------------------------------------------------
@dataclass
class RequestRecord:
    request_id: str
    arrival: float
    prompt_len: int
    first_token: float | None = None
    finished: float | None = None
    output_len: int = 0
    num_preemptions: int = 0
    token_ids: list[int] = field(default_factory=list)   # the first completion's, so far

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def e2e(self) -> float:
        return self.finished - self.arrival


@dataclass
class RunResult:
    """One run of :func:`serve`: per-request records (virtual-clock seconds), the engine's
    trace and the recorder."""

    records: list[RequestRecord]
    trace: list[StepRecord]
    recorder: Recorder
    makespan: float
    block_size: int
    num_blocks: int
    extra: dict = field(default_factory=dict)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.records)

    @property
    def throughput(self) -> float:
        """Output tokens per second of busy-or-idle time from the first arrival to the end."""
        return self.output_tokens / self.makespan

    def mean(self, what: str) -> float:
        vals = [getattr(r, what) for r in self.records]
        return sum(vals) / len(vals)

    def percentile(self, what: str, q: float) -> float:
        vals = sorted(getattr(r, what) for r in self.records)
        return vals[min(len(vals) - 1, int(q * len(vals)))]

    @property
    def kv_waste(self) -> float:
        return kv_waste(self.trace, self.block_size)

    @property
    def mean_running(self) -> float:
        """Requests in a step, averaged over the steps."""
        return sum(len(r.request_ids) for r in self.trace) / len(self.trace)


def kv_waste(trace: list[StepRecord], block_size: int) -> float:
    """Allocated KV slots holding nothing, over all steps (each step's pool after it)."""
    allocated = sum(r.blocks_used * block_size for r in trace)
    return 1 - sum(r.slots_used for r in trace) / max(1, allocated)


def serve(engine: LLMEngine, work: Workload, params: SamplingParams | list[SamplingParams]
          | None = None, arrivals: list[float] | None = None, priorities: list[int] | None = None,
          stop_at: list[int] | None = None, snapshots: bool = False) -> RunResult:
    """Feed ``work`` to ``engine`` at ``arrivals`` (s; default all at 0) on a virtual clock and
    run until every request is done. ``params`` default: greedy, ``max_tokens`` = the
    workload's output length, EOS ignored. ``stop_at[i]``: end request i after that many
    tokens (abort, which frees its blocks, as EOS would)."""
    n = len(work.prompts)
    if params is None:
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                  for m in work.output_lens]
    elif isinstance(params, SamplingParams):
        params = [params] * n
    arrivals = arrivals if arrivals is not None else [0.0] * n
    priorities = priorities or [0] * n
    rec = Recorder(engine, snapshots)
    order = sorted(range(n), key=lambda i: arrivals[i])
    records = {str(i): RequestRecord(str(i), arrivals[i], len(work.prompts[i])) for i in order}
    clock, nxt = 0.0, 0
    while nxt < n or engine.has_unfinished():
        while nxt < n and arrivals[order[nxt]] <= clock:
            i = order[nxt]
            engine.add_request(work.prompts[i], params[i], request_id=str(i),
                               priority=priorities[i])
            nxt += 1
        if not engine.has_unfinished():
            clock = arrivals[order[nxt]]
            continue
        t0 = time.perf_counter()
        outs = engine.step()
        clock += time.perf_counter() - t0
        for out in outs:
            r = records[out.request_id]
            r.output_len = sum(len(c.token_ids) for c in out.outputs)
            r.token_ids = list(out.token_ids)
            r.num_preemptions = out.metrics.num_preemptions
            if r.first_token is None and r.output_len:
                r.first_token = clock
            stop = stop_at[int(out.request_id)] if stop_at else None
            if not out.finished and stop is not None and len(out.token_ids) >= stop:
                engine.abort(out.request_id)
            if out.finished or (stop is not None and len(out.token_ids) >= stop):
                r.finished = clock
    rec.close()
    recs = [records[str(i)] for i in range(n)]
    start = min(arrivals)
    trace = list(engine.trace)[-len(rec.plans):] if rec.plans else []
    return RunResult(recs, trace, rec, clock - start, engine.blocks.block_size,
                     engine.blocks.num_blocks)


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
            run = serve(make_engine(), work, arrivals=arrivals)
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


def recomputed_tokens(run: RunResult) -> int:
    """Tokens computed beyond what a run without preemption computes (prompt + output - 1
    per request): the cost of preemption by recompute."""
    computed = sum(r.prefill_tokens + r.decode_tokens for r in run.trace)
    return computed - sum(r.prompt_len + r.output_len - 1 for r in run.records)


__all__ = ["AttentionRecorder", "LoadPoint", "MemorySnapshot", "Recorder", "RequestRecord",
           "RunResult", "StepPlan", "kv_waste", "load_sweep", "lognormal_lengths", "offered_rate",
           "padded_tokens", "poisson_arrivals", "recomputed_tokens", "serve",
           "sharegpt_like_workload", "snapshot"]
