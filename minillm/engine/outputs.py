"""What the engine hands back (vLLM's names): per-request outputs, metrics and engine stats."""
from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Metrics


@dataclass
class CompletionOutput:
    """One generated sequence of a request (one of n samples or beams). ``text`` is all of
    it so far, ``text_delta`` what is new since the previous output of the request (streaming).
    ``logprobs`` (when asked for): per output token, {token: logprob} with the chosen token
    first and then the top alternatives (log_softmax of the model's raw logits)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    finish_reason: str | None     # "stop", "length", "abort"; None while running
    text_delta: str = ""
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    """A request's prompt and its completions so far. ``text`` / ``token_ids`` are the first
    completion's (the only one unless n > 1)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Metrics
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def ttft(self) -> float | None:
        return self.metrics.ttft

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (mean over the first completion)."""
        n = len(self.outputs[0].token_ids)
        m = self.metrics
        if m.finished is None or m.first_token is None or n < 2:
            return None
        return (m.finished - m.first_token) / (n - 1)


@dataclass
class StepRecord:
    """One engine step, for timelines: which requests ran and how many tokens each computed
    (``scheduled``), tokens of each kind (sequences computing one token count as decode), the
    KV pool after it (blocks in use, token slots holding K/V), the block moves before the
    forward (blocks swapped out, in, copied on write) and the seconds they took. A decode that
    verifies a draft counts as one decode."""

    index: int
    start: float
    end: float
    request_ids: list[str]
    prefill_tokens: int
    decode_tokens: int
    blocks_used: int
    slots_used: int
    preempted: list[str] = field(default_factory=list)
    scheduled: dict[str, int] = field(default_factory=dict)
    swapped_out: int = 0
    swapped_in: int = 0
    copied: int = 0
    move_seconds: float = 0.0
    drafted_tokens: int = 0      # draft nodes verified in this step (speculative decoding)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    blocks_used: int
    blocks_free: int
    slots_used: int        # token slots holding K/V (a shared slot counted once)
    block_size: int

    @property
    def kv_waste(self) -> float:
        """Fraction of allocated slots that hold nothing (reserved or the tail of a block)."""
        return 1 - self.slots_used / max(1, self.blocks_used * self.block_size)
