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

import time

from ..cache.block_manager import BlockManager, blocks_for
from ..cache.prefix import PrefixCacheError
from .config import SchedulerConfig
from .plan import RunnerOutput, Sample, ScheduledSeq, SchedulerOutput, StepUpdate
from .policies import append_token, beam_step, fork_seq
from .sequence import Request, Sequence, Status


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, max_seq_len: int,
                 offload=None, eos_token_id: int | None = None) -> None:
        """``offload``: a KV store behind the prefix cache (:class:`minillm.cache.offload.
        TieredKVStore`); admission loads the blocks it holds past the device's cached prefix.
        ``eos_token_id`` ends a sequence that samples it (unless its request ignores EOS)."""
        self.config, self.blocks, self.max_seq_len = config, blocks, max_seq_len
        self.offload, self.eos_token_id = offload, eos_token_id
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
                kept.append(req)
                if plan:
                    self._grow(req, plan, out)
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
            out.swap_in += self.blocks.swap_in(ids)
            self.swapped.remove(req)
            req.status = Status.RUNNING
            self._grow(req, plan, out)
            self.running.append(req)

    def _seq_room(self, req: Request) -> bool:
        live = sum(len(r.seqs) for r in self.running)
        return live + len(req.seqs) <= self.config.max_num_seqs

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in order while sequences, tokens and blocks allow. Without
        chunked prefill the first request of an otherwise empty step always gets in. A request
        whose prefix lookup breaks the prefix cache's contract fails alone (``out.failed``)."""
        for req in self._sorted(self.waiting):
            try:
                used = self._admit(req, out, budget)
            except PrefixCacheError as e:
                ids = {s.seq_id for s in req.seqs}
                out.loads = [x for x in out.loads if x.seq_id not in ids]
                req.error = str(e)
                self.finish_request(req, "error")
                out.failed.append(req)
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
                self._load_stored(s, found, out)
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
        """Leading blocks of the sequence whose KV is cached on the device or in the store."""
        hit = len(self.blocks.match_prefix(s.token_ids))
        if self.offload is None:
            return hit
        usable = (len(s.token_ids) - 1) // self.blocks.block_size   # never the last token
        return max(hit, self.offload.stored_blocks(s.token_ids, usable))

    def _load_stored(self, s: Sequence, device_hit: int, out: SchedulerOutput) -> None:
        """Fetch the store's KV for the blocks past the device hit (``device_hit`` tokens) that
        admission counted as computed; what the store fails to give (a corrupt or evicted
        entry) is computed instead."""
        if s.num_computed <= device_hit:
            return
        bs = self.blocks.block_size
        load = self.offload.fetch(s.seq_id, s.token_ids, device_hit // bs, s.num_computed // bs)
        got = 0 if load is None else load.kv.shape[2]
        s.num_computed = device_hit + got
        if load is not None:
            out.loads.append(load)

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

    # ---- after the step ------------------------------------------------------------------------
    def update_from_output(self, plan: SchedulerOutput, out: RunnerOutput) -> StepUpdate:
        """Apply one step's result: every scheduled sequence advances by what it computed (its
        full blocks go to the prefix cache), a verified draft keeps its accepted path (the
        runner moved a tree's accepted nodes' KV after the root; the rest is truncated), sampled
        tokens are appended, n > 1 requests fork at their first token, beam search picks its
        beams, and finished sequences leave and free their blocks. The one writer of
        ``num_computed`` in a step (admission and preemption in ``schedule`` set it too)."""
        upd = StepUpdate()
        for w in plan.seqs:
            s = w.seq
            upd.starts[s.seq_id] = s.num_computed
            s.num_computed += w.num_tokens
            self.blocks.cache_computed(s.seq_id, s.token_ids, s.num_computed)
        for req in plan.requests:
            if req.request_id in out.prompt_logprobs:
                start, entries = out.prompt_logprobs[req.request_id]
                req.prompt_logprobs[start:] = entries
            if req.request_id in out.beams:
                dropped = beam_step(req, out.beams[req.request_id], self.blocks,
                                    self.eos_token_id, self.max_seq_len)
                self._finished += dropped          # the runner hears of them too
                upd.released += dropped
            elif any(s.seq_id in out.samples for s in req.seqs):
                for s in list(req.seqs):
                    self._take_samples(req, s, out.samples.get(s.seq_id, []), upd)
            else:
                continue
            upd.released += self._retire_finished(req)
            if req.metrics.first_token is None:
                req.metrics.first_token = time.perf_counter()
            if not req.seqs or (req.params.use_beam_search
                                and len(req.done) >= req.params.beam_width):
                upd.released += self.finish_request(req)
            upd.changed.append(req)
        return upd

    def finish_request(self, req: Request, reason: str = "length") -> list[int]:
        """End ``req`` now: live sequences end with ``reason`` (unless they already ended),
        their text is flushed, every block is freed. Returns the ids of the sequences that
        were live."""
        for s in req.seqs:
            s.draft = None
            s.finish_reason = s.finish_reason or reason
            if s.detok is not None:
                s.delta += s.detok.finish()
        ids = self.finish(req)
        req.done += req.seqs
        req.seqs = []
        req.metrics.finished = time.perf_counter()
        return ids

    def _take_samples(self, req: Request, seq: Sequence, samples: list[Sample],
                      upd: StepUpdate) -> None:
        """Give ``seq`` its sample; further samples (n > 1) go to new sequences forked from it
        (before the token is appended: they share the prompt's blocks)."""
        children = [fork_seq(self.blocks, req, seq) for _ in samples[1:]]
        upd.forked.update((c.seq_id, seq.seq_id) for c in children)
        for s, sample in zip([seq] + children, samples):
            if sample.path is not None:
                self._keep_path(s, sample.path)
                upd.kept_rows[s.seq_id] = [0] + sample.path
            for i, tok in enumerate(sample.tokens):
                append_token(req, s, tok, self.eos_token_id, self.max_seq_len,
                             sample.logprobs[i], sample.top[i] if sample.top else None)
                if s.finished:
                    break
            s.num_computed = min(s.num_computed, s.num_tokens - 1)

    def _keep_path(self, seq: Sequence, path: list[int]) -> None:
        """Roll a verified draft back to its accepted ``path`` of nodes (whose KV the runner
        has moved into a contiguous run after the root): the rest is forgotten."""
        root = seq.num_tokens - seq.num_draft - 1
        seq.draft = None
        self.blocks.truncate(seq.seq_id, root + 1 + len(path))
        del seq.token_ids[root + 1:]            # the accepted tokens come back as the sample
        seq.num_computed = min(seq.num_computed, root + 1 + len(path))

    def _retire_finished(self, req: Request) -> list[int]:
        """Finished sequences of ``req`` leave its live list and free their blocks; returns
        their ids. The request finishes when none is left (or enough beams are done)."""
        gone = [s for s in req.seqs if s.finished]
        for seq in gone:
            req.seqs.remove(seq)
            req.done.append(seq)
            self.blocks.free(seq.seq_id)
        ids = [s.seq_id for s in gone]
        self._finished += ids
        return ids
