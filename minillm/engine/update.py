"""The scheduler's second half: apply one step's :class:`~.plan.RunnerOutput` to the sequences
(the one writer of ``num_computed`` within a step), then finish and free what ended.

:class:`StepUpdater` is mixed into :class:`~.scheduler.Scheduler`; it uses the scheduler's
``blocks``, ``eos_token_id``, ``max_seq_len``, ``finish`` and ``_finished``.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .plan import RunnerOutput, Sample, SchedulerOutput, StepUpdate
from .policies import append_token, beam_step, fork_seq
from .sequence import Request, Sequence

if TYPE_CHECKING:
    from ..cache.block_manager import BlockManager


class StepUpdater:
    """``update_from_output`` and ``finish_request`` (see :mod:`.scheduler` for the plan)."""

    blocks: BlockManager
    eos_token_id: int | None
    max_seq_len: int
    _finished: list[int]

    def finish(self, req: Request) -> list[int]:
        """Drop ``req`` from every queue and free its blocks (the scheduler's own)."""
        raise NotImplementedError

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
            if s.seq_id in out.short_loads:         # sat the step out: compute the rest later
                self._short_load(plan, s, out.short_loads[s.seq_id])
                continue
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

    @staticmethod
    def _short_load(plan: SchedulerOutput, seq: Sequence, valid: int) -> None:
        """Only ``valid`` tokens of ``seq`` came from the connector: the rest, counted as
        cached at admission, are computed in later steps."""
        req = next(r for r in plan.requests if seq in r.seqs)
        req.metrics.cached_tokens -= seq.num_computed - valid
        seq.num_computed = valid

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
