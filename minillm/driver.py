"""The engine driver: feed a workload to a server at its arrival times and time every token.

    run = drive(engine, work, arrivals=poisson_arrivals(64, 4.0))   # virtual clock
    run.percentile("ttft", 0.9), run.throughput, run.records[0].token_times

``server`` is anything with ``add_request(prompt, params, request_id=...)``, ``step()`` and
``has_unfinished()`` (``abort`` too, for ``stop_at``): an :class:`~minillm.engine.LLMEngine`,
``minillm.LLM``, ``DisaggLLM``. Two clocks:

- ``"virtual"``: the clock advances by the measured wall time of each step and jumps over idle
  gaps (nobody waits for a request to arrive), so a load sweep costs only the compute;
- ``"wall"``: real time since the start; the driver sleeps until the next arrival when idle
  (what a server with its own processes, as disaggregation's workers are, needs).

Every token is stamped with the clock at the end of the step that produced it. ``stop_at[i]``
ends request i after that many tokens (an abort, which frees its blocks, as EOS would) while
its SamplingParams still say a larger ``max_tokens``: what a server reserving for max_tokens
sees.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from .config import SamplingParams
from .engine.outputs import RequestOutput, StepRecord
from .serving_metrics import tpot
from .workloads import Workload

CLOCKS = ("virtual", "wall")


@dataclass
class RequestRecord:
    """One request of a run (seconds on the run's clock)."""

    request_id: str
    arrival: float
    prompt_len: int
    first_token: float | None = None
    finished: float | None = None
    output_len: int = 0
    num_preemptions: int = 0
    token_ids: list[int] = field(default_factory=list)     # the first completion's, so far
    token_times: list[float] = field(default_factory=list)  # when each of them arrived

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def e2e(self) -> float:
        return self.finished - self.arrival

    @property
    def tpot(self) -> float:
        return tpot(self.first_token, self.finished, self.output_len)


@dataclass
class StepTiming:
    """One engine step on the run's clock: when it started and ended, its prefill and decode
    tokens, and how many requests it ran."""

    start: float
    end: float
    prefill_tokens: int
    decode_tokens: int
    num_requests: int


@dataclass
class DriveResult:
    """One run of :func:`drive`: per-request records in workload order, per-step timings and
    the engine's step records of this run (both empty for a server without a ``trace``), and
    the makespan (first arrival to last token)."""

    records: list[RequestRecord]
    timeline: list[StepTiming]
    trace: list[StepRecord]
    makespan: float

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.records)

    @property
    def throughput(self) -> float:
        """Output tokens per second of busy-or-idle time from the first arrival to the end."""
        return self.output_tokens / self.makespan

    def mean(self, what: str) -> float:
        vals = [getattr(r, what) for r in self.records]
        return sum(vals) / len(vals)

    def percentile(self, what: str, q: float) -> float:
        """The ``q`` quantile (in [0, 1], nearest rank) of ``what`` ("ttft", "e2e", "tpot")."""
        vals = sorted(getattr(r, what) for r in self.records)
        return vals[min(len(vals) - 1, int(q * len(vals)))]

    @property
    def mean_running(self) -> float:
        """Requests in a step, averaged over the steps."""
        return sum(t.num_requests for t in self.timeline) / len(self.timeline)


def greedy_params(work: Workload) -> list[SamplingParams]:
    """Greedy, ``max_tokens`` = the workload's output length, EOS ignored: every engine then
    produces exactly the tokens asked for."""
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
            for m in work.output_lens]


def drive(server, work: Workload,
          params: SamplingParams | Sequence[SamplingParams] | None = None,
          arrivals: Sequence[float] | None = None, priorities: Sequence[int] | None = None,
          stop_at: Sequence[int] | None = None, clock: str = "virtual") -> DriveResult:
    """Submit request i of ``work`` at ``arrivals[i]`` (s; default all at 0) and step
    ``server`` until every request is done. ``params`` default: :func:`greedy_params`."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
    n = len(work.prompts)
    if params is None:
        params = greedy_params(work)
    elif isinstance(params, SamplingParams):
        params = [params] * n
    arrivals = list(arrivals) if arrivals is not None else [0.0] * n
    order = sorted(range(n), key=lambda i: arrivals[i])
    records = [RequestRecord(str(i), arrivals[i], len(work.prompts[i])) for i in range(n)]
    timeline: list[StepTiming] = []
    trace = getattr(server, "trace", None)
    steps_before = getattr(server, "num_steps", 0)
    wall0, now, nxt = time.perf_counter(), 0.0, 0
    while nxt < n or server.has_unfinished():
        while nxt < n and arrivals[order[nxt]] <= now:
            i = order[nxt]
            extra = {"priority": priorities[i]} if priorities else {}
            server.add_request(work.prompts[i], params[i], request_id=str(i), **extra)
            nxt += 1
        if not server.has_unfinished():
            if clock == "wall":
                time.sleep(max(0.0, arrivals[order[nxt]] - now))
                now = time.perf_counter() - wall0
            else:
                now = arrivals[order[nxt]]
            continue
        num_steps = getattr(server, "num_steps", 0)
        t0 = time.perf_counter()
        outs = server.step()
        start = now
        now = now + time.perf_counter() - t0 if clock == "virtual" else time.perf_counter() - wall0
        if trace is not None and server.num_steps > num_steps:
            rec = trace[-1]
            timeline.append(StepTiming(start, now, rec.prefill_tokens, rec.decode_tokens,
                                       len(rec.request_ids)))
        for out in outs:
            _record(server, records[int(out.request_id)], out, now, stop_at)
    ran = getattr(server, "num_steps", 0) - steps_before
    steps = list(trace)[-ran:] if trace is not None and ran else []
    return DriveResult(records, timeline, steps, now - min(arrivals, default=0.0))


def _record(server, r: RequestRecord, out: RequestOutput, now: float,
            stop_at: Sequence[int] | None) -> None:
    """Stamp a request's new tokens with ``now``; end it at ``stop_at`` tokens."""
    ids = list(out.token_ids)
    r.token_times += [now] * max(0, len(ids) - len(r.token_ids))
    r.token_ids = ids
    r.output_len = sum(len(c.token_ids) for c in out.outputs)
    r.num_preemptions = out.metrics.num_preemptions
    if r.first_token is None and r.output_len:
        r.first_token = now
    stop = stop_at[int(out.request_id)] if stop_at else None
    stopped = stop is not None and len(out.token_ids) >= stop
    if stopped and not out.finished:
        server.abort(out.request_id)
    if (out.finished or stopped) and r.finished is None:
        r.finished = now


__all__ = ["CLOCKS", "DriveResult", "RequestRecord", "StepTiming", "drive", "greedy_params"]
