"""Constrained decoding by hand (chapter A3): a pattern as a finite automaton over characters,
the token mask it allows in each state, and a matcher the engine runs.

A grammar is over text, the sampler over token ids. To constrain the sampler, walk each token's
text through the automaton from the current state: the token is allowed if the walk never
falls off (EOS is allowed where the text may end). Doing that for 49,152 tokens at every step
costs tens of milliseconds in Python; but the mask depends only on the state, and a small
automaton has few states, so Outlines (Willard and Louf, 2023) computes each state's mask once
and looks it up afterwards: :class:`DfaConstraint` keeps that index. xgrammar
(:mod:`minillm.structured`) does the same for a pushdown automaton (JSON's nesting needs a
stack), splitting each state's vocabulary into tokens it can decide ahead of time and the few it
must check at run time.

:class:`DfaConstraint` implements the engine's :class:`~minillm.engine.constraints.Constraint`
and :class:`DfaCompiler` its compiler, so ``engine.use_constraint_compiler(DfaCompiler(...))``
makes the engine decode through them.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..config import StructuredOutputsParams

DIGITS = frozenset("0123456789")
#: A token mask function: (dfa, state, token texts, eos id) -> [V] bool.
MaskFn = Callable[["Dfa", int, Sequence[str], int], torch.Tensor]


@dataclass(frozen=True)
class Dfa:
    """A deterministic finite automaton over characters. ``edges[s]``: the (characters, next
    state) pairs leaving state s (their character sets disjoint); ``accepting``: the states
    where the text may end. The start state is 0."""

    edges: tuple[tuple[tuple[frozenset[str], int], ...], ...]
    accepting: frozenset[int]

    def step(self, state: int, char: str) -> int | None:
        """The state after ``char`` from ``state``; None if the automaton rejects it."""
        return next((nxt for chars, nxt in self.edges[state] if char in chars), None)

    def walk(self, state: int, text: str) -> int | None:
        """The state after every character of ``text``, or None once one is rejected."""
        for char in text:
            state = self.step(state, char)
            if state is None:
                return None
        return state

    @property
    def num_states(self) -> int:
        return len(self.edges)


def sequence_dfa(parts: Sequence[tuple[str | frozenset[str], int]]) -> Dfa:
    """The automaton of a regex that is a fixed sequence of character classes, each repeated
    a fixed number of times: ``[(DIGITS, 4), ("-", 1), (DIGITS, 2)]`` is ``[0-9]{4}-[0-9]{2}``.
    One state per character read; the last state accepts."""
    edges = []
    for chars, count in parts:
        for _ in range(count):
            edges.append(((frozenset(chars), len(edges) + 1),))
    return Dfa(tuple(edges) + ((),), frozenset({len(edges)}))


def choice_dfa(words: Sequence[str]) -> Dfa:
    """The automaton of ``word1|word2|...``: a trie of the words, a word's end accepting."""
    edges: list[dict[str, int]] = [{}]
    accepting = set()
    for word in words:
        state = 0
        for char in word:
            if char not in edges[state]:
                edges[state][char] = len(edges)
                edges.append({})
            state = edges[state][char]
        accepting.add(state)
    return Dfa(tuple(tuple((frozenset(c), nxt) for c, nxt in e.items()) for e in edges),
               frozenset(accepting))


def walk_mask(dfa: Dfa, state: int, texts: Sequence[str], eos_id: int) -> torch.Tensor:
    """[len(texts)] bool: the tokens allowed next in ``state``. A token is allowed when its
    whole text walks from ``state`` without being rejected (an empty text, a control token,
    never is); EOS where ``state`` accepts. One walk per token: tens of milliseconds for
    SmolLM2's 49,152 tokens, which is why :class:`DfaConstraint` keeps an index."""
    mask = torch.tensor([bool(t) and dfa.walk(state, t) is not None for t in texts])
    mask[eos_id] = state in dfa.accepting
    return mask


def token_texts(tokenizer) -> list[str]:
    """Every token's bytes as a string of one character per byte (latin-1), ``""`` for the
    control tokens (:func:`minillm.structured.token_bytes`): the alphabet an automaton over
    bytes walks."""
    from ..structured import token_bytes

    return [b.decode("latin-1") for b in token_bytes(tokenizer)]


@dataclass
class DfaConstraint:
    """One sequence's state in a :class:`Dfa`, as the engine's Constraint. ``mask_fn`` computes
    a state's allowed tokens; ``index`` keeps each state's mask once computed (shared by the
    forks of a sequence and by every sequence of one compiler)."""

    dfa: Dfa
    texts: Sequence[str]
    eos_id: int
    mask_fn: MaskFn
    index: dict[int, torch.Tensor] = field(default_factory=dict)
    state: int = 0
    ended: bool = False

    def allowed(self, vocab_size: int) -> torch.Tensor:
        if self.state not in self.index:
            self.index[self.state] = self.mask_fn(self.dfa, self.state, self.texts, self.eos_id)
        mask = self.index[self.state]
        if mask.shape != (vocab_size,):
            mask = torch.cat([mask, mask.new_zeros(vocab_size - len(mask))])[:vocab_size]
        return mask

    def accept(self, token_id: int) -> None:
        if token_id == self.eos_id and self.state in self.dfa.accepting:
            self.ended = True
            return
        nxt = self.dfa.walk(self.state, self.texts[token_id]) if self.texts[token_id] else None
        if nxt is None:
            raise ValueError(f"token {token_id} ({self.texts[token_id]!r}) is not allowed in "
                             f"state {self.state}")
        self.state = nxt

    def is_terminated(self) -> bool:
        return self.ended

    def fork(self) -> DfaConstraint:
        return DfaConstraint(self.dfa, self.texts, self.eos_id, self.mask_fn, self.index,
                             self.state, self.ended)


class DfaCompiler:
    """The engine's constraint compiler for the regexes in ``dfas`` (regex text -> its
    automaton, built by hand) and the choice lists :func:`choice_dfa` builds; anything else is
    a ValueError naming ``structured_outputs``."""

    def __init__(self, dfas: dict[str, Dfa], texts: Sequence[str], eos_id: int,
                 mask_fn: MaskFn) -> None:
        self.dfas, self.texts, self.eos_id, self.mask_fn = dfas, texts, eos_id, mask_fn
        self.indexes: dict[int, dict[int, torch.Tensor]] = {}     # id(dfa) -> state -> mask

    def compile(self, spec: StructuredOutputsParams) -> DfaConstraint:
        if spec.regex is not None and spec.regex in self.dfas:
            dfa = self.dfas[spec.regex]
        elif spec.choice is not None:
            dfa = self.dfas.setdefault("|".join(spec.choice), choice_dfa(spec.choice))
        else:
            raise ValueError(f"structured_outputs: this hand-built compiler knows the regexes "
                             f"{sorted(self.dfas)} and choice lists, got {spec.kind}")
        index = self.indexes.setdefault(id(dfa), {})
        return DfaConstraint(dfa, self.texts, self.eos_id, self.mask_fn, index)


def forced_steps(constraint_factory: Callable[[], object], tokens: Sequence[int],
                 vocab_size: int) -> list[int]:
    """Replay ``tokens`` through a fresh matcher: for each step, how many tokens it allowed.
    A step that allowed exactly one token was forced: jump-forward decoding (SGLang) appends
    such tokens without running the model."""
    matcher = constraint_factory()
    counts = []
    for t in tokens:
        counts.append(int(matcher.allowed(vocab_size).sum()))
        matcher.accept(t)
    return counts
