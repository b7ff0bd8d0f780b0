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

``step_policy`` names the three classic ways to share steps between the two phases and sets
``mixed`` and ``enable_chunked_prefill`` for them (None leaves those two as given):
- ``prefill_first``: a step with waiting prompts runs only prompts, whole; running decodes stall
  until they are done (vLLM v0, Orca-style): best TTFT, the worst inter-token stalls.
- ``decode_first``: while any request decodes, steps run only decodes; prompts wait for a step
  with none (FasterTransformer's request-level rhythm): smooth decodes, the worst TTFT.
- ``chunked``: Sarathi-Serve's stall-free batching: every step fills ``max_num_batched_tokens``
  with the running decodes first, then prompt chunks.

The plan is in tokens: each scheduled sequence computes ``num_tokens`` tokens from its
``num_computed``, and ``max_num_batched_tokens`` bounds their sum in every step. Decodes are
served first; the room left goes to prompts in order. With ``enable_chunked_prefill`` (Sarathi,
vLLM's default) a prompt longer than the room left is split: its first chunk runs now, the rest
in the following steps, and no logits are sampled until its last chunk. Without it a prompt runs
whole or waits for the next step.
"""
from __future__ import annotations

from ..cache.block_manager import BlockManager, blocks_for
from ..cache.block_pool import AllocatorError
from ..cache.prefix import PrefixCacheError
from .config import SchedulerConfig
from .connector import ConnectorError, KVConnector, check_external_tokens
from .plan import ScheduledSeq, SchedulerOutput
from .sequence import Request, Sequence, Status
from .update import StepUpdater


class Scheduler(StepUpdater):
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, max_seq_len: int,
                 connector: KVConnector | None = None, eos_token_id: int | None = None
                 ) -> None:
        """``connector``: a KV connector's scheduler half (:mod:`.connector`): admission counts
        the leading tokens it can supply past the device's cached prefix as computed (the
        engine adds its metadata to each plan). ``eos_token_id`` ends a sequence that samples it
        (unless its request ignores EOS)."""
        self.config, self.blocks, self.max_seq_len = config, blocks, max_seq_len
        self.connector, self.eos_token_id = connector, eos_token_id
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self._finished: list[int] = []                 # sequences gone since the last plan

    # ---- queues ------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def _sorted(self, reqs: list[Request]) -> list[Request]:
        if self.config.policy == "priority":
            return sorted(reqs, key=lambda r: r.order)
        return sorted(reqs, key=lambda r: r.arrival_index)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish(self, req: Request) -> list[int]:
        """Drop a request from every queue and free all its blocks (finished or aborted);
        returns the ids of its sequences that were live."""
        for queue in (self.waiting, self.running, self.swapped):
            if req in queue:
                queue.remove(req)
        ids = [seq.seq_id for seq in req.seqs]
        for seq_id in ids:
            self.blocks.free(seq_id)
        self._finished += ids
        req.status = Status.FINISHED
        return ids

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step's plan (see the module docstring). Admission and preemption set
        ``num_computed`` (a prefix hit counts as computed; a recomputed sequence starts over);
        nothing else here does."""
        out = SchedulerOutput(finished=self._finished)
        self._finished = []
        budget = self.config.max_num_batched_tokens
        static_busy = self.config.batching == "static" and (self.running or self.swapped)
        decodes_first = self.config.step_policy == "decode_first" and \
            any(not self._prefilling(r) for r in self.running)
        if not self.config.mixed and not static_busy and not self.swapped and not decodes_first:
            self._grow_running(out, budget, prefills=True, decodes=False)
            self._admit_waiting(out, budget - out.num_tokens)
            if out.requests:
                return out
        self._grow_running(out, budget, prefills=self.config.mixed, decodes=True)
        if not out.preempted:
            self._swap_in(out, budget)
        if self.config.mixed and not static_busy and not self.swapped and not out.preempted:
            self._admit_waiting(out, budget - out.num_tokens)
        return out

    @staticmethod
    def _prefilling(req: Request) -> bool:
        """A prompt (or a recomputed sequence) still being computed in chunks (a decode with a
        draft to verify is not)."""
        return any(s.num_uncomputed - s.num_draft > 1 for s in req.seqs)

    def _grow_running(self, out: SchedulerOutput, budget: int, prefills: bool,
                      decodes: bool) -> None:
        """Give running sequences slots for this step's tokens, preempting from the back when
        blocks run out: decodes first, then the rest of ``budget`` to prompts in chunks."""
        queue = self._sorted(self.running)
        room = budget - (sum(r.num_new_tokens for r in queue if not self._prefilling(r))
                         if decodes else 0)
        kept: list[Request] = []
        while queue:
            req = queue.pop(0)
            if self._prefilling(req):
                plan = self._prefill_plan(req, room) if prefills else []
                room -= sum(n for _, n in plan)
            else:
                plan = [(s, s.num_uncomputed) for s in req.seqs] if decodes else []
            preempted = False
            while plan and not self._can_grow(plan):
                victim = queue.pop() if queue else req
                self._preempt(victim, out)
                preempted = victim is req
                if preempted:
                    break
            if not preempted:
                if plan and not self._grow_or_fail(req, plan, out):
                    continue
                kept.append(req)
        self.running = kept

    def _prefill_plan(self, req: Request, room: int) -> list[tuple[Sequence, int]]:
        """(sequence, tokens) of a prompt (or a recomputed request) that run in ``room`` tokens:
        everything if it fits; else, with chunked prefill, a chunk that stops short of each
        sequence's last token, so that all of a request's sequences reach their ends (and
        sample) in the same step; else nothing."""
        if sum(s.num_uncomputed for s in req.seqs) <= room:
            return [(s, s.num_uncomputed) for s in req.seqs if s.num_uncomputed]
        if not self.config.enable_chunked_prefill:
            return []
        plan = []
        for s in req.seqs:
            n = min(s.num_uncomputed - 1, room)
            if n > 0:
                plan.append((s, n))
                room -= n
        return plan

    def _can_grow(self, plan: list[tuple[Sequence, int]]) -> bool:
        need = sum(self.blocks.blocks_to_reserve(s.seq_id, s.num_computed + n) for s, n in plan)
        return need <= self.blocks.num_free

    def _grow(self, req: Request, plan: list[tuple[Sequence, int]], out: SchedulerOutput) -> None:
        for s, n in plan:
            out.copies += self.blocks.reserve(s.seq_id, s.num_computed + n)
            out.seqs.append(ScheduledSeq(s, n))
        out.requests.append(req)

    def _grow_or_fail(self, req: Request, plan: list[tuple[Sequence, int]],
                      out: SchedulerOutput) -> bool:
        """:meth:`_grow`, or (the block allocator broke its contract) fail ``req`` alone."""
        try:
            self._grow(req, plan, out)
        except AllocatorError as e:
            self._fail(req, out, e)
            return False
        return True

    def _fail(self, req: Request, out: SchedulerOutput, error: Exception) -> None:
        """End ``req`` with finish_reason "error" while planning (a component broke its
        contract): out of this plan, every block freed, reported in ``out.failed``."""
        ids = {s.seq_id for s in req.seqs}
        out.seqs = [w for w in out.seqs if w.seq.seq_id not in ids]
        if req in out.requests:
            out.requests.remove(req)
        req.error = str(error)
        self.finish_request(req, "error")
        out.failed.append(req)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        ids = [s.seq_id for s in req.seqs]
        for s in req.seqs:
            s.drop_draft()
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

    def _swap_in(self, out: SchedulerOutput, budget: int) -> None:
        for req in self._sorted(self.swapped):
            ids = [s.seq_id for s in req.seqs]
            room = budget - out.num_tokens
            plan = self._prefill_plan(req, room) if self._prefilling(req) else \
                [(s, s.num_uncomputed) for s in req.seqs]
            if not plan or sum(n for _, n in plan) > room:
                break
            # room for the blocks coming back, the ones they grow into, and a copy-on-write each
            bs = self.blocks.block_size
            grow = sum(blocks_for(s.num_computed + n, bs) - blocks_for(s.num_computed, bs)
                       for s, n in plan) + len(ids)
            if not self._seq_room(req) or not self.blocks.can_swap_in(ids, extra=grow):
                break
            try:
                out.swap_in += self.blocks.swap_in(ids)
            except AllocatorError as e:
                self._fail(req, out, e)
                continue
            self.swapped.remove(req)
            req.status = Status.RUNNING
            if self._grow_or_fail(req, plan, out):
                self.running.append(req)

    def _seq_room(self, req: Request) -> bool:
        """Whether ``req`` fits the sequence limit next to the running requests, each counted
        at the width it will have once its first token forks it (n samples, beams)."""
        live = sum(r.width for r in self.running)
        return live + req.width <= self.config.max_num_seqs

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in order while sequences, tokens and blocks allow. Without
        chunked prefill the first request of an otherwise empty step always gets in. A request
        whose admission breaks the prefix cache's, the KV connector's or the block allocator's
        contract fails alone (``out.failed``)."""
        for req in self._sorted(self.waiting):
            try:
                used = self._admit(req, out, budget)
            except (PrefixCacheError, ConnectorError, AllocatorError) as e:
                self._fail(req, out, e)
                continue
            if used is None:
                break
            budget -= used

    def _admit(self, req: Request, out: SchedulerOutput, budget: int) -> int | None:
        """Admit ``req`` into this step's plan; returns the tokens it computes now, or None
        (nothing changed) when there is no room for it."""
        cached = self._uses_prefix_cache(req)
        for s in req.seqs if cached else ():   # a prefix hit is computed already
            s.num_computed = self._cached_blocks(s) * self.blocks.block_size
        plan = self._prefill_plan(req, budget)
        if not plan and not out.requests:
            plan = [(s, s.num_uncomputed) for s in req.seqs]
        slots = self._admission_tokens(req, dict((s.seq_id, n) for s, n in plan))
        if not plan or not self._seq_room(req) or not self._can_admit(req, slots, cached):
            for s in req.seqs if cached else ():
                s.num_computed = 0
            return None
        reserve = self.config.admission == "reserve"
        for s, n in zip(req.seqs, slots):
            if cached:
                found = self.blocks.allocate_cached(s.seq_id, s.token_ids, n)
                if self.connector is not None:
                    self.connector.on_allocated(s, found)
                req.metrics.cached_tokens += s.num_computed
                continue
            self.blocks.allocate(s.seq_id, s.num_computed if reserve else n,
                                 reserve_tokens=n if reserve else None)
        for s, n in plan:
            if reserve:
                self.blocks.reserve(s.seq_id, s.num_computed + n)
            out.seqs.append(ScheduledSeq(s, n))
        self.waiting.remove(req)
        req.status = Status.RUNNING
        self.running.append(req)
        out.requests.append(req)
        return sum(n for _, n in plan)

    def _cached_blocks(self, s: Sequence) -> int:
        """Leading blocks of the sequence whose KV is cached on the device or that the
        connector can supply."""
        hit = len(self.blocks.match_prefix(s.token_ids))
        if self.connector is None:
            return hit
        bs = self.blocks.block_size
        n = check_external_tokens(self.connector, s,
                                  self.connector.num_external_tokens(s, hit * bs))
        return max(hit, n // bs)

    def _uses_prefix_cache(self, req: Request) -> bool:
        """Prefix caching applies to paged admission of requests that need no prompt
        logprobs (those need every prompt row computed)."""
        return self.blocks.prefix is not None and self.config.admission == "paged" and \
            req.params.prompt_logprobs is None

    def _can_admit(self, req: Request, slots: list[int], cached: bool) -> bool:
        if not cached:
            return self.blocks.can_allocate(*slots)
        need = sum(self.blocks.cached_need(s.token_ids, n) for s, n in zip(req.seqs, slots))
        return self.blocks.num_free - need >= self.blocks.watermark_blocks

    def _admission_tokens(self, req: Request, plan: dict[int, int]) -> list[int]:
        """Slots each sequence needs on admission: what it computes now (``plan``: seq id ->
        tokens), or (reserve) its maximum length."""
        if self.config.admission == "reserve":
            cap = min(req.max_total_tokens, self.max_seq_len)
            return [max(cap, s.num_tokens) for s in req.seqs]
        return [s.num_computed + plan.get(s.seq_id, 0) for s in req.seqs]
