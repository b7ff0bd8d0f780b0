"""What the engine asks of speculative decoding (chapter 06), and nothing more.

The core sees a draft only as tokens to schedule: a sequence carrying a
:class:`~.sequence.Draft` is scheduled with its last token and every drafted node; the runner
computes logits at all of those rows (a tree's mask and positions from
:meth:`~.sequence.Draft.tree_inputs`), asks the speculator's rule which nodes to keep, and
moves a tree's accepted nodes' K/V into a contiguous run; the update truncates the rest,
appends the accepted tokens and the target's own next token, and stops at EOS, a stop string
or max_tokens like any step. After the update the engine asks for the next drafts, checks them
against the contract (:func:`attach_drafts`) and attaches them; the next plan schedules them.

A :class:`Speculator` (``minillm.spec_decode`` builds them: which drafter, how it reads hidden
states, its own KV cache) supplies the decisions. ``LLM(speculative_config=...)`` finds the
builder that ``minillm.spec_decode`` registers (:func:`register_speculator_builder`), so the
core never imports the technique.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from ..config import SamplingParams
from .plan import RunnerOutput, SchedulerOutput, StepUpdate
from .sequence import Draft, Request, Sequence

if TYPE_CHECKING:
    from .engine import LLMEngine


class Speculator(Protocol):
    hidden_layers: tuple[int, ...]     # target layers whose states ``propose`` reads (-1: last)
    max_draft_tokens: int              # the most nodes a draft may have

    def propose(self, plan: SchedulerOutput, out: RunnerOutput, done: StepUpdate
                ) -> dict[int, Draft]:
        """After a step's update: the next draft of each live scheduled sequence that should
        draft now, by sequence id. ``out.rows`` / ``out.hidden`` hold the step's hidden states;
        ``done.forked`` maps a new parallel sample to the sequence it was forked from (it reads
        its parent's rows), ``done.starts`` / ``done.kept_rows`` say what each committed.
        :func:`draft_room` says how deep a draft may go."""

    def verify(self, seq: Sequence, draft: Draft, logits: torch.Tensor,
               params: SamplingParams, generator: torch.Generator | None
               ) -> tuple[list[int], int]:
        """logits [N + 1, V] (row n: the target after node n) -> (accepted nodes below the
        root, in order; the next token)."""

    def release(self, seq_id: int) -> None:
        """The sequence left (finished, aborted, failed): forget any state kept for it."""


SpeculatorBuilder = Callable[[dict, "LLMEngine"], Speculator]
_builders: list[SpeculatorBuilder] = []


def register_speculator_builder(builder: SpeculatorBuilder) -> None:
    """Make ``builder(speculative_config, engine)`` the one ``LLM`` uses
    (``minillm.spec_decode`` registers its own when imported, which ``import minillm`` does)."""
    _builders[:] = [builder]


def speculator_for(options: dict, engine: LLMEngine) -> Speculator:
    """The registered builder's speculator for ``options`` (a speculative_config dict)."""
    if not _builders:
        raise ValueError("speculative_config needs minillm.spec_decode: import it (import "
                         "minillm does) before building an LLM with speculative_config")
    return _builders[0](options, engine)


def attach_drafts(speculator: Speculator, drafts: dict[int, Draft], plan: SchedulerOutput,
                  max_seq_len: int, vocab_size: int) -> dict[str, str]:
    """Check the speculator's drafts and attach them to their sequences, cut to the room each
    has left. A draft for a sequence outside the plan, or with a token outside
    [0, vocab_size), is not attached: returns {request id: what was wrong}, for the caller to
    fail those requests."""
    live = {s.seq_id: (r, s) for r in plan.requests if not r.finished for s in r.seqs}
    name = type(speculator).__name__
    broken = {}
    for seq_id, draft in drafts.items():
        if seq_id not in live:
            raise ValueError(f"speculator {name}: proposed a draft for sequence {seq_id}, "
                             f"which is not a live sequence of this step")
        req, seq = live[seq_id]
        bad = [t for t in draft.tokens if not (isinstance(t, int) and 0 <= t < vocab_size)]
        if bad:
            broken[req.request_id] = (f"speculator {name}: draft tokens must be ints in "
                                      f"[0, {vocab_size}), got {bad[:5]}")
            continue
        draft = draft.pruned(draft_room(req, seq, max_seq_len))
        if draft is not None:
            seq.attach_draft(draft)
    return broken


def draft_room(req: Request, seq: Sequence, max_seq_len: int) -> int:
    """How deep a draft for ``seq`` may go now: 0 while its prompt is unfinished, else what
    max_tokens and the context window leave after the next token."""
    if seq.num_uncomputed != 1 or seq.finished:
        return 0
    left = min(req.params.max_tokens - len(seq.output_ids), max_seq_len - seq.num_tokens)
    return max(0, left - 1)
