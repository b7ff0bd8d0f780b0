"""Which requests run in the next step, and where their KV blocks go (pure Python, no torch).

Batching (``batching``):
- ``static``: request-level batching, the baseline. A batch is admitted only when the previous
  one has completely finished; finished requests leave holes nobody fills (head-of-line blocking).
- ``continuous``: iteration-level scheduling (Orca, Yu et al. 2022): every step, finished
  requests leave and waiting ones join.

Admission (``admission``): ``paged`` allocates blocks for the tokens a request has and grows on
demand (vLLM); ``reserve`` allocates room for prompt + max_tokens up front, as a system with
contiguous per-request KV must (Orca), which wastes what is never generated.

Order (``policy``): ``fcfs`` by arrival, ``priority`` by (priority, arrival). Waiting requests are
admitted in that order without skipping, so a large request is not starved by small ones.

Preemption (``preemption``): when a running request cannot grow, the last request in that order
(the lowest priority, then the latest arrival; a higher-priority arrival never preempts a running
request by itself) is preempted, by ``recompute`` (its blocks are freed; it re-enters the waiting
queue and its prompt plus output so far is prefilled again) or by ``swap`` (its blocks move to
the CPU pool and come back before any new request is admitted; falls back to recompute when the
CPU pool is full).

``mixed``: prefills and decodes share a step (one flat batch, selective batching). Without it a
step is all prefill or all decode, prefill first (vLLM before chunked prefill).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..cache.block_manager import BlockManager
from .sequence import Request, Status

BATCHING = ("continuous", "static")
POLICIES = ("fcfs", "priority")
ADMISSION = ("paged", "reserve")
PREEMPTION = ("recompute", "swap")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    batching: str = "continuous"
    policy: str = "fcfs"
    admission: str = "paged"
    preemption: str = "recompute"
    mixed: bool = True

    def __post_init__(self) -> None:
        for name, allowed in (("batching", BATCHING), ("policy", POLICIES),
                              ("admission", ADMISSION), ("preemption", PREEMPTION)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, "
                             f"got {self.max_num_batched_tokens}")


@dataclass
class SchedulerOutput:
    """One step's plan. ``requests``: those that run, each computing all its sequences'
    uncomputed tokens. Block moves for the runner to do first, in this order: ``swap_out``
    (device block, CPU block), ``swap_in`` (CPU block, device block), ``copies`` (src, dst)."""

    requests: list[Request] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, max_seq_len: int) -> None:
        self.config, self.blocks, self.max_seq_len = config, blocks, max_seq_len
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []

    # ---- queues ------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def _sorted(self, reqs: list[Request]) -> list[Request]:
        if self.config.policy == "priority":
            return sorted(reqs, key=lambda r: r.order)
        return sorted(reqs, key=lambda r: r.arrival_index)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish(self, req: Request) -> None:
        """Drop a request from every queue and free all its blocks (finished or aborted)."""
        for queue in (self.waiting, self.running, self.swapped):
            if req in queue:
                queue.remove(req)
        for seq in req.seqs:
            self.blocks.free(seq.seq_id)
        req.status = Status.FINISHED

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        static_busy = self.config.batching == "static" and (self.running or self.swapped)
        if not self.config.mixed and not static_busy and not self.swapped:
            self._admit_waiting(out)
            if out.requests:
                return out
        self._grow_running(out)
        if not out.preempted:
            self._swap_in(out)
        if self.config.mixed and not static_busy and not self.swapped and not out.preempted:
            self._admit_waiting(out)
        return out

    def _grow_running(self, out: SchedulerOutput) -> None:
        """Give every running sequence a slot for its next token, preempting from the back."""
        queue = self._sorted(self.running)
        kept: list[Request] = []
        while queue:
            req = queue.pop(0)
            while not self._can_grow(req):
                victim = queue.pop() if queue else req
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                self._grow(req, out)
                kept.append(req)
        self.running = kept

    def _can_grow(self, req: Request) -> bool:
        need = sum(self.blocks.blocks_to_reserve(s.seq_id, s.num_tokens) for s in req.seqs)
        return need <= self.blocks.num_free

    def _grow(self, req: Request, out: SchedulerOutput) -> None:
        for s in req.seqs:
            out.copies += self.blocks.reserve(s.seq_id, s.num_tokens)
        out.requests.append(req)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        ids = [s.seq_id for s in req.seqs]
        req.metrics.num_preemptions += 1
        out.preempted.append(req)
        if self.config.preemption == "swap" and self.blocks.can_swap_out(ids):
            out.swap_out += self.blocks.swap_out(ids)
            req.status = Status.SWAPPED
            self.swapped.append(req)
            return
        for s in req.seqs:
            self.blocks.free(s.seq_id)
            s.num_computed = 0
        req.status = Status.WAITING
        self.waiting.append(req)

    def _swap_in(self, out: SchedulerOutput) -> None:
        for req in self._sorted(self.swapped):
            ids = [s.seq_id for s in req.seqs]
            # room for the blocks coming back plus one new block per sequence to grow into
            if not self._seq_room(req) or not self.blocks.can_swap_in(ids, extra=len(ids)):
                break
            out.swap_in += self.blocks.swap_in(ids)
            self.swapped.remove(req)
            req.status = Status.RUNNING
            self._grow(req, out)
            self.running.append(req)

    def _seq_room(self, req: Request) -> bool:
        live = sum(len(r.seqs) for r in self.running)
        return live + len(req.seqs) <= self.config.max_num_seqs

    def _admit_waiting(self, out: SchedulerOutput) -> None:
        """Admit waiting requests in order while sequences, tokens and blocks allow."""
        budget = self.config.max_num_batched_tokens - out.num_tokens
        for req in self._sorted(self.waiting):
            need = req.num_new_tokens
            if not self._seq_room(req) or (need > budget and out.requests):
                break
            if not self.blocks.can_allocate(*self._admission_tokens(req)):
                break
            reserve = self.config.admission == "reserve"
            for s, n in zip(req.seqs, self._admission_tokens(req)):
                self.blocks.allocate(s.seq_id, s.num_tokens, reserve_tokens=n if reserve else None)
            self.waiting.remove(req)
            req.status = Status.RUNNING
            self.running.append(req)
            out.requests.append(req)
            budget -= need

    def _admission_tokens(self, req: Request) -> list[int]:
        """Slots each sequence needs on admission: what it has, or its maximum length."""
        if self.config.admission == "reserve":
            cap = min(req.max_total_tokens, self.max_seq_len)
            return [max(cap, s.num_tokens) for s in req.seqs]
        return [s.num_tokens for s in req.seqs]
