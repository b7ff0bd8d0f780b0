"""The runner's sampling: a step's logits -> the tokens each sequence gains (a value, no state
written).

For every sequence whose chunk reached its end, one of:
- a plain draw: one batched :func:`~.sampler.sample_rows` call for all such rows of the step
  (an n > 1 request's first token: n draws from its one row, the first for the sequence, the
  rest for the samples it forks into); a sequence with a structured-outputs constraint gives
  its row's allowed tokens (:mod:`.constraints`), the others allow every token, and a drawn
  token the grammar does not allow fails its request (a sampler that ignored the mask);
- a verification, for a sequence that carried a draft: the speculator's rule over its rows
  [N + 1, V] (row n: the target after node n) gives the accepted path and the target's own
  next token;
- beam candidates, for a beam-search request: the 2 x beam_width best (beam, token) pairs by
  summed log-probability.
Prompt log-probabilities are computed chunk by chunk (the last row of a chunk predicts the next
chunk's first token: that row is kept here between steps).
"""
from __future__ import annotations

import torch

from .constraints import allowed_mask
from .plan import RunnerOutput, Sample, SchedulerOutput
from .policies import forks_at_first_token
from .sampler import (
    Sampler,
    SamplingBatch,
    prompt_logprobs,
    sample_rows,
    sampler_violations,
)
from .sequence import Request, Sequence
from .speculation import Speculator


def collects_prompt_logprobs(req: Request) -> bool:
    """Whether ``req`` still needs log-probabilities of prompt tokens (every prompt row)."""
    return req.params.prompt_logprobs is not None and \
        len(req.prompt_logprobs) < len(req.prompt_ids)


class StepSampler:
    """Samples, verifies and scores one step's logits for the plan that produced them."""

    def __init__(self, sampler: Sampler = sample_rows) -> None:
        """``sampler`` draws the plain rows (:class:`~.sampler.Sampler`)."""
        self.sampler = sampler
        self.speculator: Speculator | None = None
        self._prompt_tail: dict[int, torch.Tensor] = {}   # seq id -> [1, V], last chunk's row

    def sample(self, plan: SchedulerOutput, logits: torch.Tensor,
               logit_rows: dict[int, slice], out: RunnerOutput) -> None:
        """Fill ``out.samples``, ``out.beams`` and ``out.prompt_logprobs`` from ``logits``
        [R, V] (``logit_rows[seq_id]``: that sequence's rows of it)."""
        for seq_id in plan.finished:
            self._prompt_tail.pop(seq_id, None)
        done = {w.seq.seq_id for w in plan.seqs if w.completes}
        owner = {s.seq_id: r for r in plan.requests for s in r.seqs}
        for w in plan.seqs:
            req = owner[w.seq.seq_id]
            if collects_prompt_logprobs(req):
                out.prompt_logprobs[req.request_id] = self._prompt_chunk(
                    req, w.seq, w.num_tokens, logits[logit_rows[w.seq.seq_id]], w.completes)
        ready = [r for r in plan.requests if r.seqs and all(s.seq_id in done for s in r.seqs)]
        draws: list[tuple[Sequence, int, Request]] = []      # (sequence, row, request)
        for req in ready:
            if req.params.use_beam_search:
                rows = [logit_rows[s.seq_id].stop - 1 for s in req.seqs]
                out.beams[req.request_id] = beam_candidates(req, logits[rows])
                continue
            copies = req.params.n if forks_at_first_token(req) else 1
            for s in req.seqs:
                if s.draft is not None:
                    out.samples[s.seq_id] = [self._verify(req, s, logits[logit_rows[s.seq_id]])]
                else:
                    draws += [(s, logit_rows[s.seq_id].stop - 1, req)] * copies
        if draws:
            self._draw(draws, logits, out)

    def _draw(self, draws: list[tuple[Sequence, int, Request]], logits: torch.Tensor,
              out: RunnerOutput) -> None:
        """One batched draw for every row in ``draws`` (a row may appear n times)."""
        draws = sorted(draws, key=lambda d: d[1])    # logits' order: each row once, no copy
        rows = [r for _, r, _ in draws]
        masks = self._masks(draws, logits.shape[-1], out)
        allowed = None if all(m is None for m in masks) else torch.stack(
            [torch.ones(logits.shape[-1], dtype=torch.bool) if m is None else m for m in masks]
        ).to(logits.device, non_blocking=True)
        batch = SamplingBatch.from_params([req.params for _, _, req in draws],
                                          [req.generator for _, _, req in draws], logits.device,
                                          allowed=allowed)
        picked = logits if rows == list(range(len(logits))) else \
            logits[torch.tensor(rows, device=logits.device)]      # (a copy: only if needed)
        drawn = self.sampler(picked, batch)
        bad = sampler_violations(drawn, len(rows), logits.shape[-1])
        for i, (s, _, req) in enumerate(draws):
            if i in bad:
                out.errors[req.request_id] = f"sampler: {_name(self.sampler)} {bad[i]}"
                out.samples.pop(s.seq_id, None)
                continue
            if req.request_id in out.errors:
                continue
            if masks[i] is not None and not masks[i][drawn.token_ids[i]]:
                out.errors[req.request_id] = (
                    f"sampler: {_name(self.sampler)} returned token {drawn.token_ids[i]} for row "
                    f"{i}, which its structured_outputs grammar does not allow")
                out.samples.pop(s.seq_id, None)
                continue
            k = req.params.logprobs
            top = [drawn.top[i][:k]] if k else None
            out.samples.setdefault(s.seq_id, []).append(
                Sample([drawn.token_ids[i]], [drawn.logprobs[i]], top))

    @staticmethod
    def _masks(draws: list[tuple[Sequence, int, Request]], vocab: int,
               out: RunnerOutput) -> list[torch.Tensor | None]:
        """Each draw row's allowed tokens, [vocab] bool on the CPU (None: no constraint); one
        call per constraint (n draws from one row share it). A constraint that breaks its
        contract fails its request."""
        masks: dict[int, torch.Tensor | None] = {}
        for s, _, req in draws:
            c = s.constraint
            if c is None or id(c) in masks:
                continue
            try:
                masks[id(c)] = allowed_mask(c, vocab)
            except Exception as e:  # a student's matcher, or the library's, failed: this request
                masks[id(c)] = None
                out.errors[req.request_id] = f"structured_outputs: {e}"
        return [None if s.constraint is None else masks[id(s.constraint)] for s, _, _ in draws]

    def _verify(self, req: Request, seq: Sequence, logits: torch.Tensor) -> Sample:
        """The accepted path of ``seq``'s draft and the target's next token (``logits``
        [N + 1, V], row n after node n), with their log-probabilities when asked."""
        draft = seq.draft
        path, bonus = self.speculator.verify(seq, draft, logits, req.params, req.generator)
        tokens = [draft.tokens[n - 1] for n in path] + [bonus]
        k = req.params.logprobs
        if k is None:
            return Sample(tokens, [0.0] * len(tokens), None, path)
        logp = logits.float().log_softmax(-1)
        nodes = [0] + path
        lps = [float(logp[n, t]) for n, t in zip(nodes, tokens)]
        top = []
        for n in nodes:
            best = logp[n].topk(k) if k else None
            top.append(list(zip(best.indices.tolist(), best.values.tolist())) if best else [])
        return Sample(tokens, lps, top, path)

    def _prompt_chunk(self, req: Request, seq: Sequence, n: int, rows: torch.Tensor,
                      completes: bool) -> tuple[int, list]:
        """(first position, entries) of this chunk's prompt tokens. Entries go by position, so
        a prompt recomputed after preemption rewrites, not repeats, them."""
        start = seq.num_computed
        if start:
            rows = torch.cat([self._prompt_tail[seq.seq_id], rows])
        ids = req.prompt_ids[max(start - 1, 0):start + n]
        entries = prompt_logprobs(rows[:len(ids)], ids, req.params.prompt_logprobs)
        if completes:
            self._prompt_tail.pop(seq.seq_id, None)
        else:
            self._prompt_tail[seq.seq_id] = rows[-1:]
        return start, entries[1:] if start else entries


def _name(sampler: Sampler) -> str:
    return getattr(sampler, "__name__", type(sampler).__name__)


def beam_candidates(req: Request, logits: torch.Tensor) -> list[tuple[int, int, float]]:
    """logits [beams, V] (row i after beam i) -> the 2 x beam_width best continuations of all
    beams by summed log-probability, best first: (beam index, token, token log-probability)."""
    vocab = logits.shape[-1]
    logprobs = torch.log_softmax(logits, dim=-1)
    base = torch.tensor([s.cumulative_logprob for s in req.seqs], device=logits.device)
    scores, flat = (base[:, None] + logprobs).view(-1).topk(
        min(2 * req.params.beam_width, logprobs.numel()))
    out = []
    for score, f in zip(scores.tolist(), flat.tolist()):
        parent, tok = divmod(f, vocab)
        out.append((parent, tok, score - req.seqs[parent].cumulative_logprob))
    return out
