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
    from .detokenizer import IncrementalDetokenizer


class Status(enum.Enum):
    WAITING = "waiting"      # no KV in the device pool (new, or preempted by recompute)
    RUNNING = "running"
    SWAPPED = "swapped"      # KV in the CPU swap pool
    FINISHED = "finished"


_seq_ids = itertools.count()


@dataclass
class Sequence:
    """One token stream. ``num_computed`` tokens have K/V in the cache; the tokens after them
    are what the next step computes (the whole prompt at first, then the last sampled token)."""

    token_ids: list[int]
    prompt_len: int
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed: int = 0
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None   # "stop" (EOS or a stop string), "length", "abort"
    detok: IncrementalDetokenizer | None = None   # the text so far, grown token by token
    delta: str = ""                    # text added since the last output
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per output token, if asked

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
        by the engine)."""
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
    last_prompt_logits: Any = None   # [1, vocab], predicts the next chunk's first token

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
