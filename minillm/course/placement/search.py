"""Goodput (DistServe's), the search over placements, and the simulator against the real engine."""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ...driver import drive
from ...engine.engine import LLMEngine
from ...serving_metrics import SLO, goodput_of, tpot
from ...workloads import Workload, poisson_arrivals
from .costs import TOLERANCE, CostModel
from .simulator import (
    MODES,
    DeviceClass,
    Placement,
    RequestMix,
    SimConfig,
    colocated,
    config_for,
    disaggregated,
    simulate,
)

OBJECTIVES = ("per_device", "per_dollar_hour")

# ---- goodput ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class RatePoint:
    """One simulated rate (requests/s): SLO attainment and latency percentiles (s)."""

    rate: float
    attainment: float
    ttft_p50: float
    ttft_p90: float
    tpot_p50: float
    tpot_p90: float


@dataclass(frozen=True)
class GoodputResult:
    """``goodput`` (requests/s) of a placement, and the rates tried (``curve``, by rate)."""

    goodput: float
    num_devices: int
    price_per_hour: float
    curve: tuple[RatePoint, ...]

    @property
    def per_device(self) -> float:
        return self.goodput / self.num_devices

    @property
    def per_dollar_hour(self) -> float:
        """Goodput (requests/s) per $/hour of the placement's devices."""
        return self.goodput / self.price_per_hour


def _check_attainment(attainment: float) -> None:
    if not 0 < attainment <= 1:
        raise ValueError(f"attainment must be in (0, 1], got {attainment}")


def evaluate_rate(mix: RequestMix, placement: Placement, rate: float, slo: SLO,
                  config: SimConfig = SimConfig(), seed: int = 0) -> RatePoint:
    """Simulate Poisson arrivals at ``rate`` requests/s (seeded) and summarise."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    res = simulate(mix, poisson_arrivals(len(mix), rate, seed), placement, config)
    return RatePoint(rate, res.attainment(slo), res.percentile("ttft", 0.5),
                     res.percentile("ttft", 0.9), res.percentile("tpot", 0.5),
                     res.percentile("tpot", 0.9))


def _result(placement: Placement, curve: Sequence[RatePoint], attainment: float
            ) -> GoodputResult:
    curve = sorted(curve, key=lambda p: p.rate)
    good = goodput_of([(p.rate, p.attainment) for p in curve], attainment)
    return GoodputResult(good, placement.num_devices, placement.price_per_hour, tuple(curve))


def sweep_rates(mix: RequestMix, placement: Placement, slo: SLO, rates: Sequence[float],
                attainment: float = 0.9, config: SimConfig = SimConfig(),
                seed: int = 0) -> GoodputResult:
    """Goodput on a grid of ``rates`` (requests/s), with the curve."""
    _check_attainment(attainment)
    return _result(placement, [evaluate_rate(mix, placement, r, slo, config, seed)
                               for r in rates], attainment)


def find_goodput(mix: RequestMix, placement: Placement, slo: SLO, attainment: float = 0.9,
                 config: SimConfig = SimConfig(), seed: int = 0, start_rate: float | None = None,
                 iters: int = 8, max_doublings: int = 20) -> GoodputResult:
    """Goodput by search: from ``start_rate`` (default: devices / one request's latency alone)
    double (or halve) until the attainment changes side, then bisect ``iters`` times. 0 if
    even ``start_rate`` / 2^max_doublings misses; the last rate tried if none misses."""
    _check_attainment(attainment)
    rate = start_rate if start_rate is not None else _rate_guess(mix, placement)
    if not rate > 0:
        raise ValueError(f"start_rate must be > 0 requests/s, got {rate}")
    curve: list[RatePoint] = []

    def passes(r: float) -> bool:
        curve.append(evaluate_rate(mix, placement, r, slo, config, seed))
        return curve[-1].attainment >= attainment

    up = passes(rate)
    lo, hi = (rate, None) if up else (None, rate)
    for _ in range(max_doublings):
        if lo is not None and hi is not None:
            break
        rate = rate * 2 if up else rate / 2
        lo, hi = (rate, hi) if passes(rate) else (lo, rate)
    if lo is not None and hi is not None:
        for _ in range(iters):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if passes(mid) else (lo, mid)
    return _result(placement, curve, attainment)


def _rate_guess(mix: RequestMix, placement: Placement) -> float:
    """Devices / the mean latency of one request alone on the prefill class (requests/s)."""
    c = placement.prefill_class.costs
    p, o = statistics.fmean(mix.prompt_lens), statistics.fmean(mix.output_lens)
    alone = c.prefill_time(round(p)) + (o - 1) * c.decode_time(1, round(p + o / 2))
    return placement.num_devices / max(alone, 1e-9)


# ---- placement search ------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    placement: Placement
    result: GoodputResult

    @property
    def per_device(self) -> float:
        return self.result.per_device

    @property
    def per_dollar_hour(self) -> float:
        return self.result.per_dollar_hour


@dataclass(frozen=True)
class SearchResult:
    """The ``best`` candidate by ``objective`` and every candidate tried, in search order."""

    best: Candidate
    candidates: tuple[Candidate, ...]
    objective: str

    def table(self) -> list[dict]:
        """One row per candidate: label, devices, goodput (req/s), per device, $/h, per $/h."""
        return [{"placement": c.placement.label, "devices": c.placement.num_devices,
                 "goodput": c.result.goodput, "per_device": c.per_device,
                 "price_per_hour": c.placement.price_per_hour,
                 "per_dollar_hour": c.per_dollar_hour} for c in self.candidates]


def disaggregated_splits(num_devices: int) -> list[tuple[int, int]]:
    """Every (num_prefill, num_decode) with both >= 1 summing to ``num_devices``."""
    if num_devices < 2:
        raise ValueError(f"num_devices must be >= 2 for a disaggregated split (one prefill, one "
                         f"decode), got {num_devices}; search modes=('colocated',) instead")
    return [(p, num_devices - p) for p in range(1, num_devices)]


def candidate_placements(classes: Sequence[DeviceClass], num_devices: int,
                         modes: Sequence[str] = MODES,
                         splits: Sequence[tuple[int, int]] | None = None) -> list[Placement]:
    """Colocated on each class; each split P:D with every (prefill class, decode class)."""
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"modes must be a non-empty subset of {MODES}, got {tuple(modes)}")
    out = [colocated(num_devices, c) for c in classes] if "colocated" in modes else []
    if "disaggregated" in modes:
        splits = disaggregated_splits(num_devices) if splits is None else splits
        for p, d in splits:
            if p + d != num_devices:
                raise ValueError(f"num_prefill + num_decode must equal num_devices "
                                 f"({num_devices}), got {p} + {d}")
            out += [disaggregated(p, d, pc, dc) for pc in classes for dc in classes]
    return out


def search_placement(mix: RequestMix, devices: DeviceClass | Sequence[DeviceClass],
                     num_devices: int, slo: SLO, attainment: float = 0.9,
                     config: SimConfig = SimConfig(), modes: Sequence[str] = MODES,
                     splits: Sequence[tuple[int, int]] | None = None,
                     objective: str | None = None, seed: int = 0,
                     iters: int = 8) -> SearchResult:
    """Goodput of every candidate placement of ``num_devices`` (:func:`candidate_placements`)
    and the best by ``objective``: "per_device" (default for one class) or "per_dollar_hour"
    (default for several); ties go to the earlier candidate."""
    classes = [devices] if isinstance(devices, DeviceClass) else list(devices)
    objective = objective or ("per_device" if len(classes) == 1 else "per_dollar_hour")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    _check_attainment(attainment)
    cands = tuple(Candidate(p, find_goodput(mix, p, slo, attainment, config, seed, iters=iters))
                  for p in candidate_placements(classes, num_devices, modes, splits))
    return SearchResult(max(cands, key=lambda c: getattr(c, objective)), cands, objective)


# ---- against the real engine -----------------------------------------------------------------
@dataclass(frozen=True)
class ValidationPoint:
    """Simulated and measured mean TTFT and TPOT (s) at one rate (requests/s)."""

    rate: float
    sim_ttft: float
    real_ttft: float
    sim_tpot: float
    real_tpot: float
    real_preemptions: int

    @property
    def ttft_error(self) -> float:
        return (self.sim_ttft - self.real_ttft) / self.real_ttft

    @property
    def tpot_error(self) -> float:
        return (self.sim_tpot - self.real_tpot) / self.real_tpot

    def within(self, tolerance: float = TOLERANCE) -> bool:
        return abs(self.ttft_error) <= tolerance and abs(self.tpot_error) <= tolerance


def validate(engine: LLMEngine, costs: CostModel, work: Workload, rates: Sequence[float],
             seed: int = 0, warmup: bool = True) -> list[ValidationPoint]:
    """Serve ``work`` on the real ``engine`` (ch04's :func:`serve`, a virtual clock of measured
    step times) at each Poisson rate (requests/s, seeded) and simulate the same arrivals on one
    colocated instance with the engine's scheduler settings (:func:`config_for`). ``warmup``:
    serve each rate once unmeasured first, since PyTorch runs a batch shape slower the first
    time it meets it and the cost model (medians after a warm-up) is of warm steps."""
    if engine.has_unfinished():
        raise ValueError("engine must be idle (no unfinished requests) to be validated")
    for rate in rates:
        if not rate > 0:
            raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    config, mix = config_for(engine), RequestMix.from_workload(work)
    placement = colocated(1, DeviceClass(engine.model.cfg.name, costs))
    points = []
    for rate in rates:
        arrivals = poisson_arrivals(len(mix), rate, seed)
        if warmup:
            drive(engine, work, arrivals=arrivals)
        real = drive(engine, work, arrivals=arrivals).records
        sim = simulate(mix, arrivals, placement, config)
        points.append(ValidationPoint(
            rate, sim.mean("ttft"), statistics.fmean(r.ttft for r in real), sim.mean("tpot"),
            statistics.fmean(tpot(r.first_token, r.finished, r.output_len) for r in real),
            sum(r.num_preemptions for r in real)))
    return points
