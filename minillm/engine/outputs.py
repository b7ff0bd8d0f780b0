"""What the engine hands back (vLLM's names): per-request outputs, metrics and engine stats."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..cache.block_manager import BlockManager
from .plan import RunnerOutput, SchedulerOutput
from .policies import beam_score
from .sequence import Metrics, Request


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
    error: str | None = None      # why the request failed (finish_reason "error"), if it did

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
    num_held: int = 0      # sequences whose blocks a KV hand-off keeps (KVHandoff.hold_kv)

    @property
    def kv_waste(self) -> float:
        """Fraction of allocated slots that hold nothing (reserved or the tail of a block)."""
        return 1 - self.slots_used / max(1, self.blocks_used * self.block_size)


def request_output(req: Request) -> RequestOutput:
    """The request's completions now: samples in the order they were forked (so ``index`` i
    is the same sample in every output of a stream), or the n best beams. Each carries the
    text that is new since the last output (``text_delta``), which is then cleared."""
    seqs = req.done + req.seqs
    if req.params.use_beam_search:
        seqs = sorted(seqs, key=lambda s: beam_score(req, s), reverse=True)
    else:
        seqs = sorted(seqs, key=lambda s: s.seq_id)
    outs = []
    for i, s in enumerate(seqs[:max(1, req.params.n)]):
        text = s.detok.text if s.detok is not None else ""
        outs.append(CompletionOutput(
            i, text, s.output_ids,
            s.cumulative_logprob if req.params.use_beam_search else None, s.finish_reason,
            s.delta, list(s.logprobs) if req.params.logprobs else None))
    for s in seqs:
        s.delta = ""
    return RequestOutput(req.request_id, req.prompt, req.prompt_ids, outs, req.finished,
                         req.metrics, list(req.prompt_logprobs)
                         if req.params.prompt_logprobs is not None else None, req.error)


def step_record(index: int, plan: SchedulerOutput, out: RunnerOutput, start: float,
                scheduled: dict[str, int], drafted: int, blocks: BlockManager) -> StepRecord:
    """The :class:`StepRecord` of a step that started at ``start`` (perf_counter seconds) and
    ends now: a sequence that computed one token, or verified a draft, counts as a decode."""
    spec = {sid for sid, samples in out.samples.items() if samples[0].path is not None}
    prefill = sum(w.num_tokens for w in plan.seqs
                  if w.num_tokens > 1 and w.seq.seq_id not in spec)
    decode = sum(w.num_tokens == 1 or w.seq.seq_id in spec for w in plan.seqs)
    return StepRecord(index, start, time.perf_counter(), [r.request_id for r in plan.requests],
                      prefill, decode, blocks.num_used, blocks.slots_in_use(),
                      [r.request_id for r in plan.preempted], scheduled, len(plan.swap_out),
                      len(plan.swap_in), len(plan.copies), out.move_seconds, drafted)
