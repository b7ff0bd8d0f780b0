"""What the engine asks of speculative decoding (chapter 06), and nothing more.

The engine runs the frame: a sequence carrying a :class:`~.sequence.Draft` is scheduled with
its last token and every drafted node, verified in that one forward pass (logits at every row,
the tree mask and tree positions for a tree), and then the engine keeps the accepted path's
K/V (moving tree nodes into a contiguous run), truncates the rest, appends the accepted tokens
and the target's own next token, and stops at EOS, a stop string or max_tokens like any step.

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
from .sequence import Draft, Sequence


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
