"""Requests and the sequences they grow (pure Python).

A :class:`Request` is what a user sent: one prompt and its SamplingParams. It owns one or more
:class:`Sequence` s: one normally, ``n`` for parallel sampling, up to ``beam_width`` beams for
beam search. The scheduler moves whole requests between its queues (waiting, running, swapped),
so the sequences of one request always run, pause and resume together.
"""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..config import SamplingParams

if TYPE_CHECKING:
    from .constraints import Constraint
    from .detokenizer import IncrementalDetokenizer


class Status(enum.Enum):
    WAITING = "waiting"      # no KV in the device pool (new, or preempted by recompute)
    RUNNING = "running"
    SWAPPED = "swapped"      # KV in the CPU swap pool
    FINISHED = "finished"


_seq_ids = itertools.count()


def new_seq_id() -> int:
    """A sequence id no other sequence in this process has (for blocks allocated before their
    sequence exists, e.g. KV pulled from a prefill worker)."""
    return next(_seq_ids)


@dataclass
class Draft:
    """Tokens a drafter proposes after a sequence's last token, as a tree (a chain is the tree
    whose every parent is the node before). Node 0 is the sequence's last token (the root);
    ``tokens[i]`` is node i + 1, ``parents[i]`` its parent node (< i + 1), so parents come first.
    ``q`` [N, V], when the draft was *sampled*: the drafter's distribution each node was drawn
    from (chains only); None when the nodes are the drafter's deterministic picks (top-k,
    n-gram), which verification treats as proposals with certainty."""

    tokens: list[int]
    parents: list[int]
    q: Any = None

    def __post_init__(self) -> None:
        if len(self.parents) != len(self.tokens):
            raise ValueError(f"a Draft needs one parent per token, got {len(self.parents)} "
                             f"parents for {len(self.tokens)} tokens")
        bad = [i for i, p in enumerate(self.parents) if not 0 <= p <= i]
        if bad:
            raise ValueError(f"Draft.parents[i] must be in [0, i] (node i + 1's parent), bad "
                             f"at {bad[:5]}")

    @classmethod
    def chain(cls, tokens: list[int], q: Any = None) -> Draft:
        return cls(list(tokens), list(range(len(tokens))), q)

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(len(self.tokens)))

    def depths(self) -> list[int]:
        """Depth of every node, the root's 0 first: [N + 1]."""
        depth = [0]
        for p in self.parents:
            depth.append(depth[p] + 1)
        return depth

    def children(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents):
            out.setdefault(p, []).append(i + 1)
        return out

    def tree_inputs(self, root: int) -> tuple[list[list[bool]], list[int]]:
        """What verifying this draft as a tree needs: the attention mask [N + 1][N + 1] over
        the root and its nodes (True: node i sees node j, its ancestors and itself) and their
        positions (``root``, the root's position, plus each node's depth)."""
        depth = self.depths()
        mask = [[j == 0 for j in range(len(depth))]]
        for i, p in enumerate(self.parents, start=1):
            mask.append([seen or j == i for j, seen in enumerate(mask[p])])
        return mask, [root + d for d in depth]

    def pruned(self, max_depth: int) -> Draft | None:
        """The nodes at depth <= max_depth (None if none is left; itself if all are)."""
        depth = self.depths()
        keep = [i for i in range(1, len(depth)) if depth[i] <= max_depth]
        if len(keep) == len(self.tokens):
            return self
        if not keep:
            return None
        new = {0: 0, **{old: j + 1 for j, old in enumerate(keep)}}
        q = self.q[[i - 1 for i in keep]] if self.q is not None else None
        return Draft([self.tokens[i - 1] for i in keep],
                     [new[self.parents[i - 1]] for i in keep], q)


@dataclass
class Sequence:
    """One token stream. ``num_computed`` tokens have K/V in the cache; the tokens after them
    are what the next step computes (the whole prompt at first, then the last sampled token)."""

    token_ids: list[int]
    prompt_len: int
    seq_id: int = field(default_factory=new_seq_id)
    num_computed: int = 0
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None   # "stop" (EOS or a stop string), "length", "abort",
    #                                    "error" (a component broke its contract for it)
    detok: IncrementalDetokenizer | None = None   # the text so far, grown token by token
    delta: str = ""                    # text added since the last output
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per output token, if asked
    draft: Draft | None = None         # speculative tokens at the end of token_ids, unverified
    constraint: Constraint | None = None   # structured outputs: the grammar's matcher, advanced
    #                                        with each appended token (.constraints)

    @property
    def num_draft(self) -> int:
        return len(self.draft.tokens) if self.draft is not None else 0

    def attach_draft(self, draft: Draft) -> None:
        """Put ``draft``'s tokens after the last token, for the next step to verify."""
        if self.draft is not None or self.num_uncomputed != 1:
            raise ValueError("a draft goes after a sequence's one uncomputed token, once")
        self.draft = draft
        self.token_ids += draft.tokens

    def drop_draft(self) -> None:
        """Forget an unverified draft (preemption)."""
        if self.draft is not None:
            del self.token_ids[len(self.token_ids) - self.num_draft:]
            self.draft = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def fork(self) -> Sequence:
        """A copy with a new id (its blocks are forked by the block manager, its detokenizer
        and constraint by :func:`~.policies.copy_seq`)."""
        return Sequence(list(self.token_ids), self.prompt_len, num_computed=self.num_computed,
                        cumulative_logprob=self.cumulative_logprob,
                        logprobs=list(self.logprobs))


@dataclass
class Metrics:
    """Times (time.perf_counter seconds) of one request's life."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    num_preemptions: int = 0
    cached_tokens: int = 0      # prompt tokens whose KV came from the prefix cache

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival -> first output token."""
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


@dataclass
class Request:
    """A prompt, how to sample it, and its live and finished sequences."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0          # lower runs first (vLLM's convention)
    prompt: str | None = None
    status: Status = Status.WAITING
    seqs: list[Sequence] = field(default_factory=list)     # live sequences
    done: list[Sequence] = field(default_factory=list)     # finished sequences (beams, samples)
    metrics: Metrics = field(default_factory=lambda: Metrics(time.perf_counter()))
    arrival_index: int = field(default_factory=lambda: next(_seq_ids))
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    generator: Any = None      # torch.Generator of a seeded request (None: the global RNG)
    error: str | None = None   # why it failed, when a component broke its contract for it

    @property
    def width(self) -> int:
        """Live sequences it holds once its first token forks it (n samples, beam_width beams);
        until then its one sequence stands for all of them."""
        if len(self.seqs) + len(self.done) > 1:
            return len(self.seqs)
        return max(len(self.seqs), self.params.n, self.params.beam_width)

    def __post_init__(self) -> None:
        if not self.seqs:
            self.seqs = [Sequence(list(self.prompt_ids), len(self.prompt_ids))]

    @property
    def order(self) -> tuple[int, int]:
        """Scheduling order: priority, then arrival (FCFS)."""
        return (self.priority, self.arrival_index)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def num_new_tokens(self) -> int:
        """Tokens the next step computes for this request (all its live sequences)."""
        return sum(s.num_uncomputed for s in self.seqs)

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most tokens a sequence may generate (for max-length reservation)."""
        return len(self.prompt_ids) + self.params.max_tokens
