"""What a drafter reads after a step: one :class:`SpecInput` per live scheduled sequence."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import SamplingParams
from ..engine.plan import RunnerOutput, SchedulerOutput, StepUpdate
from ..engine.sequence import Sequence
from ..engine.speculation import draft_room


@dataclass
class SpecInput:
    """One scheduled sequence after a step. Its tokens from ``start`` on were computed (and
    kept) in this step; ``rows``: their rows of the step's flat batch, in order (for hidden
    states). ``max_depth``: how deep a draft may go now (0: no draft wanted: the sequence is
    still in its prompt, or has no room left). ``params`` and ``generator``: its request's,
    for drafters that sample."""

    seq: Sequence
    start: int
    rows: list[int]
    max_depth: int
    params: SamplingParams
    generator: torch.Generator | None = None


def spec_inputs(plan: SchedulerOutput, out: RunnerOutput, done: StepUpdate,
                max_seq_len: int) -> list[SpecInput]:
    """What every live sequence of the step committed (a new parallel sample reads its
    parent's rows; beam search does not speculate)."""
    inputs = []
    for req in plan.requests:
        if req.finished or req.params.use_beam_search:
            continue
        for s in req.seqs:
            src = done.forked.get(s.seq_id, s.seq_id)
            if src not in out.rows:
                continue
            r = out.rows[src]
            kept = done.kept_rows.get(src)
            rows = [r.start + n for n in kept] if kept else list(range(r.start, r.stop))
            inputs.append(SpecInput(s, done.starts[src], rows, draft_room(req, s, max_seq_len),
                                    req.params, req.generator))
    return inputs
