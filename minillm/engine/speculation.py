"""What the engine asks of speculative decoding (chapter 06), and nothing more.

The engine runs the frame: a sequence carrying a :class:`~.sequence.Draft` is scheduled with
its last token and every drafted node; the runner verifies them in that one forward pass
(logits at every row, the tree mask and tree positions for a tree) and moves a tree's accepted
nodes' K/V into a contiguous run; the update truncates the rest, appends the accepted tokens
and the target's own next token, and stops at EOS, a stop string or max_tokens like any step;
then :func:`propose_drafts` asks for the next drafts.

A :class:`Speculator` (``minillm.spec`` builds them) supplies the two decisions:

- ``propose``: after every step, it sees what each scheduled sequence committed (positions
  ``start`` onwards, with the target's hidden states at ``rows`` of the step's flat batch) and
  returns a draft for those that asked for one;
- ``verify``: given a drafted sequence's rows of logits [N + 1, V] (row n: the target after
  node n), the accepted path of nodes and the next token.

It also learns when sequences fork (n > 1) and leave (finished, aborted), to keep or free any
state of its own (a drafter's KV cache).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..config import SamplingParams
from .plan import RunnerOutput, SchedulerOutput, StepUpdate
from .sequence import Draft, Request, Sequence


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


class Speculator(Protocol):
    hidden_layers: tuple[int, ...]     # target layers whose states ``propose`` reads (-1: last)
    max_draft_tokens: int              # the most nodes a draft may have

    def propose(self, inputs: list[SpecInput], hidden: dict[int, torch.Tensor]
                ) -> list[Draft | None]:
        """One draft (or None) per input, for those with max_depth > 0."""

    def verify(self, seq: Sequence, draft: Draft, logits: torch.Tensor,
               params: SamplingParams, generator: torch.Generator | None
               ) -> tuple[list[int], int]:
        """logits [N + 1, V] -> (accepted nodes below the root, in order; the next token)."""

    def fork(self, parent_id: int, child_id: int) -> None: ...

    def release(self, seq_id: int) -> None: ...


def tree_inputs(draft: Draft, root: int) -> tuple[torch.Tensor, list[int]]:
    """The verification pass's mask [N + 1, N + 1] (True: node i sees node j, its ancestors
    and itself) and positions (the root's plus each node's depth) for a tree draft."""
    depth = draft.depths()
    n = len(depth)
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[0, 0] = True
    for i, p in enumerate(draft.parents, start=1):
        mask[i] = mask[p]
        mask[i, i] = True
    return mask, [root + d for d in depth]


def propose_drafts(speculator: Speculator, plan: SchedulerOutput, out: RunnerOutput,
                   done: StepUpdate, max_seq_len: int, vocab_size: int
                   ) -> dict[str, str]:
    """After a step's update: give the speculator what every live scheduled sequence committed
    (a new parallel sample reads its parent's rows) and attach the drafts it returns, for the
    next plan to schedule. A draft that breaks the contract (a token outside [0, vocab_size))
    is not attached: returns {request id: what was wrong} for the caller to fail them."""
    for child, parent in done.forked.items():
        speculator.fork(parent, child)
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
    drafts = speculator.propose(inputs, out.hidden) if inputs else []
    owner = {s.seq_id: r.request_id for r in plan.requests for s in r.seqs}
    broken = {}
    for inp, draft in zip(inputs, drafts):
        if draft is None or inp.max_depth <= 0:
            continue
        bad = [t for t in draft.tokens if not (isinstance(t, int) and 0 <= t < vocab_size)]
        if bad:
            broken[owner[inp.seq.seq_id]] = (
                f"speculator {type(speculator).__name__}: draft tokens must be ints in "
                f"[0, {vocab_size}), got {bad[:5]}")
            continue
        draft = draft.pruned(inp.max_depth)
        if draft is not None:
            inp.seq.attach_draft(draft)
    return broken


def draft_room(req: Request, seq: Sequence, max_seq_len: int) -> int:
    """How deep a draft for ``seq`` may go now: 0 while its prompt is unfinished, else what
    max_tokens and the context window leave after the next token."""
    if seq.num_uncomputed != 1 or seq.finished:
        return 0
    left = min(req.params.max_tokens - len(seq.output_ids), max_seq_len - seq.num_tokens)
    return max(0, left - 1)
