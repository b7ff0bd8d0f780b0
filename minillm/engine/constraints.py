"""What the engine asks of structured outputs (constrained decoding), and nothing more.

A request whose :class:`~minillm.config.SamplingParams` carry ``structured_outputs`` gets a
:class:`Constraint` per sequence: a matcher that says which tokens may come next and advances
with each token the sequence commits. The engine uses it at two places only:

- the step sampler asks every constrained row for its allowed tokens before the draw; the
  batched sampler sets the others' logits to -inf (:class:`~.sampler.SamplingBatch`'s
  ``allowed``), so constrained and free rows share one step;
- :func:`~.policies.append_token`, where a committed token joins its sequence, advances the
  matcher; a matcher that terminates ends the sequence with finish_reason "stop". EOS is one
  more token the grammar allows only where the output may end.

Nothing rolls a matcher back: a sequence preempted by recompute keeps its tokens (only their
KV is recomputed, nothing is sampled again) and so its matcher state; ``n`` > 1 samples fork
the matcher with the sequence at the first token. Speculative decoding and beam search are
refused with structured outputs (a draft would need masked verification).

A :class:`ConstraintCompiler` turns the request's grammar into a fresh matcher (bad input:
ValueError naming ``structured_outputs``, raised at intake before any KV is allocated).
``minillm.structured`` registers the package's compiler (xgrammar) with
:func:`register_constraint_compiler_builder`, which ``LLM`` and the server install, so the core
never imports the technique; a student's compiler (a hand-written regex automaton) is passed to
:meth:`~.engine.LLMEngine.use_constraint_compiler`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from ..config import StructuredOutputsParams

if TYPE_CHECKING:
    from .engine import LLMEngine


@runtime_checkable
class Constraint(Protocol):
    """One sequence's position in a grammar (a matcher). Tokens are ids in [0, vocab_size)."""

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] bool tensor on the CPU: True for each token that may come next (EOS
        only where the grammar may end). At least one is True while not terminated. Reads
        the state, never changes it."""

    def accept(self, token_id: int) -> None:
        """Advance past ``token_id``; ValueError if ``allowed`` did not allow it (the state is
        then unchanged)."""

    def is_terminated(self) -> bool:
        """Whether the grammar has ended (it accepted EOS, or can accept nothing more)."""

    def fork(self) -> Constraint:
        """An independent copy of this state (for one more of ``n`` samples)."""


class ConstraintCompiler(Protocol):
    def compile(self, spec: StructuredOutputsParams) -> Constraint:
        """A fresh matcher at the start of ``spec``'s grammar; ValueError whose message names
        ``structured_outputs`` (and the field) if the grammar is bad or unsupported. Called at
        intake for every request (a compiler caches what it compiles)."""


def allowed_mask(constraint: Constraint, vocab_size: int) -> torch.Tensor:
    """``constraint.allowed(vocab_size)`` checked against the contract: a [vocab_size] bool CPU
    tensor with at least one True, else ValueError saying what came back."""
    mask = constraint.allowed(vocab_size)
    name = type(constraint).__name__
    if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
            and tuple(mask.shape) == (vocab_size,)):
        got = (mask.dtype, tuple(mask.shape)) if isinstance(mask, torch.Tensor) else \
            type(mask).__name__
        raise ValueError(f"{name}.allowed must return a [{vocab_size}] bool tensor, got {got}")
    mask = mask.cpu()
    if not mask.any():
        raise ValueError(f"{name}.allowed allows no token (not even EOS): the grammar is stuck")
    return mask


ConstraintCompilerBuilder = Callable[["LLMEngine"], ConstraintCompiler]
_builders: list[ConstraintCompilerBuilder] = []


def register_constraint_compiler_builder(builder: ConstraintCompilerBuilder) -> None:
    """Make ``builder(engine)`` the compiler ``LLM`` and the server install
    (``minillm.structured`` registers its own when imported, which ``import minillm`` does)."""
    _builders[:] = [builder]


def constraint_compiler_for(engine: LLMEngine) -> ConstraintCompiler | None:
    """The registered builder's compiler for ``engine`` (None if none is registered or the
    engine has no tokenizer: a grammar is over text)."""
    if not _builders or engine.tokenizer is None:
        return None
    return _builders[0](engine)
