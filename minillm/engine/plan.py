"""What crosses the engine's seams in one step (vLLM v1's ``sched/output.py``, written small).

    plan = scheduler.schedule()                     # SchedulerOutput
    out  = runner.execute(plan)                     # RunnerOutput
    done = scheduler.update_from_output(plan, out)  # StepUpdate

The plan says which sequences compute how many tokens and which KV moves come first; the
runner's output says what the model sampled for each sequence that reached its end (after
verifying its draft, if it had one); the update says which requests changed. Each is a value:
the runner never writes a sequence, the scheduler never touches the device.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .sequence import Request, Sequence

if TYPE_CHECKING:
    from .config import SchedulerConfig


@dataclass
class ScheduledSeq:
    """One sequence's work in a step: compute ``num_tokens`` tokens, the token ids
    ``seq.token_ids[seq.num_computed : seq.num_computed + num_tokens]``."""

    seq: Sequence
    num_tokens: int

    @property
    def completes(self) -> bool:
        """The chunk reaches the sequence's last token: its last row's logits pick the next."""
        return self.seq.num_computed + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """One step's plan. ``requests``: those that run; ``seqs``: what each of their sequences
    computes. Block moves for the runner to do first, in this order: ``swap_out`` (device
    block, CPU block), ``swap_in`` (CPU block, device block), ``copies`` (src, dst:
    copy-on-write). ``connector_meta``: what the KV connector's worker half must do (loads
    of admitted sequences' stored KV; :mod:`.connector`). ``finished``: sequences that left
    since the last plan (a runner drops any state it keeps for them). ``failed``: requests
    ended with finish_reason "error" while planning (their ``error`` says why)."""

    requests: list[Request] = field(default_factory=list)
    seqs: list[ScheduledSeq] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    connector_meta: Any = None
    preempted: list[Request] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)   # ended by a broken component

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    def tokens_of(self, req: Request) -> int:
        """Tokens ``req`` computes in this step (all its sequences)."""
        ids = {s.seq_id for s in req.seqs}
        return sum(s.num_tokens for s in self.seqs if s.seq.seq_id in ids)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    def without(self, seq_ids: Collection[int]) -> SchedulerOutput:
        """This plan less the sequences ``seq_ids`` and their requests (those that sit the step
        out); the block moves and the rest are shared."""
        gone = set(seq_ids)
        return replace(self, seqs=[w for w in self.seqs if w.seq.seq_id not in gone],
                       requests=[r for r in self.requests
                                 if not any(s.seq_id in gone for s in r.seqs)])


@dataclass
class Sample:
    """Tokens one sequence gains in a step, in order, with their log-probabilities under the
    model (0.0 when nobody asked) and, when asked, the top alternatives of each. ``path``: the
    accepted draft nodes below the root when a draft was verified (then ``tokens`` are those
    nodes' tokens and the target's own next token), else None."""

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None = None
    path: list[int] | None = None


@dataclass
class RunnerOutput:
    """What one step's forward pass and sampling produced.

    ``samples[seq_id]``: for a sequence that reached its end, its :class:`Sample`; a list of
    n samples from the same row for a request whose first token forks it into n (parallel
    sampling: the first for the sequence itself, then one per new sequence).
    ``beams[request_id]``: for a beam-search request, the best continuations of all its beams,
    best first, as (beam index, token, log-probability of the token), 2 x beam_width of them.
    ``prompt_logprobs[request_id]``: (first prompt position, entries) this step computed.
    ``rows[seq_id]``: the sequence's rows of the flat batch; ``hidden[layer]``: [N, D] states
    (for drafters); ``move_seconds``: time spent on the KV moves before the forward.
    ``short_loads[seq_id]``: a sequence whose connector load came short sat the step out; the
    tokens of it whose KV is valid. ``errors[request_id]``: a request a component failed
    (the sampler broke its contract for its row): it gets no sample and ends with "error"."""

    samples: dict[int, list[Sample]] = field(default_factory=dict)
    beams: dict[str, list[tuple[int, int, float]]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list]] = field(default_factory=dict)
    rows: dict[int, slice] = field(default_factory=dict)
    hidden: dict[int, Any] = field(default_factory=dict)
    move_seconds: float = 0.0
    short_loads: dict[int, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


@dataclass
class StepUpdate:
    """What :meth:`Scheduler.update_from_output` did: ``changed`` requests produced tokens or
    finished (in plan order); ``starts[seq_id]``: where each scheduled sequence's committed
    tokens begin; ``kept_rows[seq_id]``: the rows of a verified draft it kept (root first);
    ``forked[child_id]``: the sequence each new parallel sample came from; ``released``:
    sequences that left the engine in this step."""

    changed: list[Request] = field(default_factory=list)
    starts: dict[int, int] = field(default_factory=dict)
    kept_rows: dict[int, list[int]] = field(default_factory=dict)
    forked: dict[int, int] = field(default_factory=dict)
    released: list[int] = field(default_factory=list)


class PlanError(ValueError):
    """A step policy's plan broke a rule the runner relies on (the message names both)."""


def check_plan(plan: SchedulerOutput, config: SchedulerConfig, tables: Mapping[int, list[int]],
               block_size: int, policy: str = "Scheduler") -> None:
    """Raise :class:`PlanError` naming ``policy`` and the rule when ``plan`` breaks one: at
    most ``config.max_num_batched_tokens`` tokens (without chunked prefill, a prompt longer than
    that may run whole, alone in its step) and ``config.max_num_seqs`` sequences; each sequence
    once, computing between 1 and its uncomputed tokens, into device blocks it owns."""
    def broken(rule: str) -> PlanError:
        return PlanError(f"step policy {policy}: {rule}")

    tokens = plan.num_tokens
    alone = not config.enable_chunked_prefill and len(plan.requests) == 1
    if tokens > config.max_num_batched_tokens and not alone:
        raise broken(f"the plan holds {tokens} tokens, over max_num_batched_tokens="
                     f"{config.max_num_batched_tokens}")
    if len(plan.seqs) > config.max_num_seqs:
        raise broken(f"the plan holds {len(plan.seqs)} sequences, over max_num_seqs="
                     f"{config.max_num_seqs}")
    seen: set[int] = set()
    for w in plan.seqs:
        s = w.seq
        if s.seq_id in seen:
            raise broken(f"sequence {s.seq_id} is scheduled twice")
        seen.add(s.seq_id)
        if not 1 <= w.num_tokens <= s.num_tokens - s.num_computed:
            raise broken(f"sequence {s.seq_id} computes {w.num_tokens} tokens; it has "
                         f"{s.num_tokens - s.num_computed} uncomputed (at least 1 a step)")
        end = s.num_computed + w.num_tokens
        if len(tables.get(s.seq_id, ())) * block_size < end:
            raise broken(f"sequence {s.seq_id} computes up to position {end} but owns "
                         f"{len(tables.get(s.seq_id, ()))} blocks of {block_size} slots")
