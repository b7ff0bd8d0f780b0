"""Serving metrics against sums and loops written out here: SLO attainment of one run (a request
exactly at a limit meets it, a failed request meets none), DistServe's goodput over rates, and
percentiles against numpy's default method."""
from __future__ import annotations

import random

import numpy as np
import pytest

from minillm.serving_metrics import SLO, goodput_of, percentile, slo_attainment


def test_attainment_counts_requests_at_the_limits_and_failures():
    slo = SLO(2.0, 0.2)
    pairs = [(2.0, 0.2), (1.0, 0.25), (3.0, 0.1), (0.5, 0.0)]    # at both limits; over; over; under
    attainment, per_s = slo_attainment(pairs, slo, num_requests=5, duration_s=4.0)
    assert attainment == pytest.approx(2 / 5) and per_s == pytest.approx(2 / 4.0)
    assert slo_attainment([], slo, 1, 0.0) == (0.0, 0.0)
    with pytest.raises(ValueError, match="num_requests"):
        slo_attainment([], slo, 0, 1.0)


def test_goodput_is_the_highest_rate_before_the_first_miss():
    rng = random.Random(0)
    for _ in range(200):
        points = [(rng.choice([0.5, 1, 2, 3, 4, 8]), rng.random())
                  for _ in range(rng.randint(1, 6))]
        target = rng.choice([0.5, 0.9, 1.0])
        want = 0.0
        for rate, att in sorted(points):          # written out: walk up the rates
            if att < target:
                break
            want = rate
        assert goodput_of(points, target) == want
    assert goodput_of([(1.0, 0.9), (2.0, 0.95), (4.0, 0.5), (8.0, 1.0)]) == 2.0


def test_percentile_equals_numpy():
    rng = np.random.default_rng(1)
    for n in (1, 2, 7, 100):
        xs = rng.random(n).tolist()
        for q in (0, 10, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(np.percentile(xs, q))
