"""Serving metrics, one home each.

- per request: TTFT (arrival to first token), :func:`tpot` (time per output token after the
  first), ITL (the gaps between tokens), end-to-end latency;
- over a run: :func:`percentile`, :func:`spread` (p50/p90/p99/mean under a prefix), and
  :func:`slo_attainment`: the share of requests meeting an :class:`SLO` and those requests per
  second of the run (``slo_met_per_s``; vLLM's ``bench serve`` prints this per-run number as
  "request goodput");
- over runs at several rates: :func:`goodput_of`, goodput in DistServe's sense (the highest
  request rate at which the attainment stays at or above a target, 90% by default). In this
  package "goodput" means only this.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SLO:
    """Service-level objectives: time to first token and time per output token, seconds."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")

    def met(self, ttft: float, tpot: float) -> bool:
        return ttft <= self.ttft_s and tpot <= self.tpot_s


def tpot(first_token: float, finished: float, output_len: int) -> float:
    """Seconds per output token after the first; 0 for a one-token output."""
    return (finished - first_token) / (output_len - 1) if output_len > 1 else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (q in [0, 100]) of ``values``, linear between the two closest
    ranks (numpy's default method)."""
    if not values:
        raise ValueError("values must not be empty")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spread(values: Sequence[float], prefix: str) -> dict[str, float | None]:
    """``{prefix}_p50/p90/p99/mean`` of ``values`` (None when there are none)."""
    out: dict[str, float | None] = {f"{prefix}_p{q}": percentile(values, q) if values else None
                                    for q in (50, 90, 99)}
    out[f"{prefix}_mean"] = sum(values) / len(values) if values else None
    return out


def slo_attainment(pairs: Iterable[tuple[float, float]], slo: SLO, num_requests: int,
                   duration_s: float) -> tuple[float, float]:
    """(attainment, slo_met_per_s) of one run: ``pairs`` are the (TTFT, TPOT) of its completed
    requests (s), ``num_requests`` all it sent (a failed request meets no SLO), ``duration_s``
    the run's span. Attainment is the share of the ``num_requests`` meeting both SLOs
    (``SLO.met``: at or under each limit); slo_met_per_s those requests per second (0 for an
    empty span)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    met = sum(slo.met(ttft, tpot) for ttft, tpot in pairs)
    return met / num_requests, (met / duration_s if duration_s > 0 else 0.0)


def goodput_of(points: Iterable[tuple[float, float]], attainment: float = 0.9) -> float:
    """DistServe's goodput from (rate, attainment) points: the highest rate below the lowest
    one whose attainment misses ``attainment`` (0 if the lowest misses)."""
    good = 0.0
    for rate, att in sorted(points):
        if att < attainment:
            break
        good = rate
    return good


__all__ = ["SLO", "goodput_of", "percentile", "slo_attainment", "spread", "tpot"]
