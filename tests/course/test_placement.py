"""The placement simulator (minillm.course.placement): closed-form cases on a hand-made cost model,
determinism, goodput sanity, the search, the cost model measured on our engine and checked
against a real run, and every bad-input error."""
from __future__ import annotations

import functools
import gc
import json
import random

import pytest
import torch

import minillm
from minillm.course import placement as pl
from minillm.workloads import make_workload, poisson_arrivals

# a hand-made cost model: prefill p0 + p1 n + p2 n^2, decode d0 + d1 batch + d2 context (s);
# a step mixing both costs the two parts less OVERLAP
P0, P1, P2 = 0.01, 1e-4, 1e-7
D0, D1, D2 = 0.005, 2e-4, 1e-6
KV_BYTES, OVERLAP = 1000, 0.002
COSTS = pl.CostModel((P0, P1, P2), (D0, D1, D2), KV_BYTES, mixed_overlap=OVERLAP)
DEV = pl.DeviceClass("dev", COSTS)


def prefill(n: int, start: int = 0) -> float:
    """A chunk of n prompt tokens after ``start`` earlier ones, with its step's fixed cost."""
    return P0 + P1 * n + P2 * ((start + n) ** 2 - start ** 2)


def decode(batch: int, context: int) -> float:
    return D0 + D1 * batch + D2 * context


def alone(p: int, m: int) -> tuple[float, float]:
    """(TTFT, TPOT) of one request alone: its prefill, then m - 1 decodes of growing context."""
    steps = [decode(1, p + g) for g in range(1, m)]
    return prefill(p), sum(steps) / len(steps)


def random_mix(n: int, seed: int = 0) -> pl.RequestMix:
    rng = random.Random(seed)
    return pl.RequestMix(tuple(rng.randint(16, 400) for _ in range(n)),
                         tuple(rng.randint(2, 40) for _ in range(n)))


# ---- closed forms ----------------------------------------------------------------------------
@pytest.mark.parametrize("policy", pl.POLICIES)
def test_one_request_alone_colocated(policy):
    res = pl.simulate(pl.RequestMix((100,), (6,)), [3.0], pl.colocated(1, DEV),
                      pl.SimConfig(policy=policy))
    ttft, tpot = alone(100, 6)
    (r,) = res.requests
    assert r.ttft == pytest.approx(ttft, rel=1e-12)
    assert r.tpot == pytest.approx(tpot, rel=1e-12)
    assert r.first_token == pytest.approx(3.0 + ttft, rel=1e-12)


def test_one_request_alone_disaggregated_adds_the_transfer():
    slow_decode = pl.DeviceClass("slow", COSTS.scaled(decode=3.0))
    bandwidth = 1e6
    res = pl.simulate(pl.RequestMix((100,), (6,)), [0.0], pl.disaggregated(1, 1, DEV, slow_decode),
                      pl.SimConfig(link_bandwidth=bandwidth))
    ttft, tpot = alone(100, 6)
    (r,) = res.requests
    assert r.ttft == pytest.approx(ttft + 100 * KV_BYTES / bandwidth, rel=1e-12)
    assert r.tpot == pytest.approx(3 * tpot, rel=1e-12)       # the decode class's costs


@pytest.mark.parametrize("placement", [pl.colocated(2, DEV), pl.disaggregated(2, 1, DEV)],
                         ids=["colocated", "disaggregated"])
@pytest.mark.parametrize("routing", pl.ROUTING)
def test_requests_far_apart_never_queue(placement, routing):
    mix = pl.RequestMix((10, 300, 50, 120, 7), (2, 9, 1, 4, 30))
    config = pl.SimConfig(routing=routing)
    res = pl.simulate(mix, [1000.0 * i for i in range(5)], placement, config)
    for r, p, m in zip(res.requests, mix.prompt_lens, mix.output_lens):
        ttft, tpot = alone(p, m) if m > 1 else (prefill(p), 0.0)
        if placement.mode == "disaggregated" and m > 1:      # a 1-token output never moves
            ttft += COSTS.transfer_time(p, config.link_bandwidth)
        assert (r.ttft, r.tpot) == pytest.approx((ttft, tpot), rel=1e-12)


def test_prefill_first_runs_whole_prompts_and_stalls_decodes():
    """Budget 60: the 30-token prompt runs alone (30 + 50 does not fit), then the 50 one while
    the first waits, then both decode together."""
    res = pl.simulate(pl.RequestMix((30, 50), (3, 3)), [0.0, 0.0], pl.colocated(1, DEV),
                      pl.SimConfig(policy="prefill_first", token_budget=60, max_batch=2))
    first, second = res.requests
    end = prefill(30) + prefill(50) + decode(2, 31 + 51) + decode(2, 32 + 52)
    assert first.first_token == pytest.approx(prefill(30), rel=1e-12)
    assert second.first_token == pytest.approx(prefill(30) + prefill(50), rel=1e-12)
    assert first.finished == pytest.approx(end, rel=1e-12)
    assert second.finished == pytest.approx(end, rel=1e-12)


def test_chunked_serves_decodes_first_then_prompt_chunks():
    """The engine's rule, budget 60: step 1 = 30 + a 30-token chunk of the 50; step 2 = the
    first's decode + the last 20 (attending to the 30 before); then decodes."""
    res = pl.simulate(pl.RequestMix((30, 50), (3, 3)), [0.0, 0.0], pl.colocated(1, DEV),
                      pl.SimConfig(policy="chunked", token_budget=60, max_batch=2))
    first, second = res.requests
    step1 = P0 + P1 * 60 + P2 * (30 ** 2 + 30 ** 2)
    step2 = prefill(20, start=30) + decode(1, 31) - OVERLAP
    step3 = decode(2, 32 + 51)
    assert first.first_token == pytest.approx(step1, rel=1e-12)
    assert second.first_token == pytest.approx(step1 + step2, rel=1e-12)
    assert first.finished == pytest.approx(step1 + step2 + step3, rel=1e-12)
    assert second.finished == pytest.approx(step1 + step2 + step3 + decode(1, 52), rel=1e-12)


def test_chunked_decodes_take_their_token_of_the_budget_first():
    """Budget 4: while A decodes, B's prompt gets 3 tokens a step, the last step 1."""
    res = pl.simulate(pl.RequestMix((2, 10), (5, 2)), [0.0, 1e-9], pl.colocated(1, DEV),
                      pl.SimConfig(token_budget=4, max_batch=2))
    a, b = res.requests
    t = prefill(2)
    for start, n, ctx in ((0, 3, 3), (3, 3, 4), (6, 3, 5), (9, 1, 6)):
        t += prefill(n, start) + decode(1, ctx) - OVERLAP
    assert a.finished == pytest.approx(t, rel=1e-12)
    assert b.first_token == pytest.approx(t, rel=1e-12)
    assert b.finished == pytest.approx(t + decode(1, 11), rel=1e-12)


def test_least_loaded_routing_avoids_the_busy_instance():
    """A long request holds one instance; a short one comes and goes on the other; a third
    then finds that one idle (least loaded) or, round robin, queues behind the long one."""
    mix, arrivals = pl.RequestMix((50, 50, 80), (2000, 2, 10)), [0.0, 1.0, 2.0]
    ttft, tpot = alone(80, 10)
    least = pl.simulate(mix, arrivals, pl.colocated(2, DEV), pl.SimConfig(routing="least_loaded"))
    assert (least.requests[2].ttft, least.requests[2].tpot) == pytest.approx((ttft, tpot))
    rr = pl.simulate(mix, arrivals, pl.colocated(2, DEV), pl.SimConfig(routing="round_robin"))
    assert rr.requests[2].ttft > ttft and rr.requests[2].tpot > tpot


def test_a_long_prompt_is_chunked_with_attention_to_earlier_chunks():
    res = pl.simulate(pl.RequestMix((10,), (1,)), [0.0], pl.colocated(1, DEV),
                      pl.SimConfig(token_budget=4, max_batch=1))
    assert res.requests[0].ttft == pytest.approx(3 * P0 + 10 * P1 + 100 * P2, rel=1e-12)


# ---- determinism and goodput -----------------------------------------------------------------
@pytest.mark.parametrize("placement", [pl.colocated(2, DEV), pl.disaggregated(1, 2, DEV)],
                         ids=["colocated", "disaggregated"])
def test_same_seed_same_result_different_seed_different_arrivals(placement):
    mix, config = random_mix(80), pl.SimConfig(routing="least_loaded")
    a = pl.simulate(mix, poisson_arrivals(80, 20.0, 0), placement, config)
    b = pl.simulate(mix, poisson_arrivals(80, 20.0, 0), placement, config)
    c = pl.simulate(mix, poisson_arrivals(80, 20.0, 1), placement, config)
    assert a == b
    assert [r.arrival for r in a.requests] != [r.arrival for r in c.requests]
    assert a != c
    slo = pl.SLO(0.5, 0.05)
    assert pl.evaluate_rate(mix, placement, 20.0, slo, config, seed=3) == \
        pl.evaluate_rate(mix, placement, 20.0, slo, config, seed=3)


@pytest.mark.parametrize("placement", [pl.colocated(1, DEV), pl.disaggregated(1, 1, DEV)],
                         ids=["colocated", "disaggregated"])
def test_attainment_falls_with_rate_and_a_looser_slo_never_lowers_goodput(placement):
    mix, rates = random_mix(150), [2.0 * 1.5 ** i for i in range(10)]
    tight, loose = pl.SLO(0.15, 0.012), pl.SLO(0.3, 0.024)
    t = pl.sweep_rates(mix, placement, tight, rates)
    lo = pl.sweep_rates(mix, placement, loose, rates)
    att = [p.attainment for p in t.curve]
    assert att == sorted(att, reverse=True) and att[0] >= 0.9 > att[-1]
    assert all(b.attainment >= a.attainment for a, b in zip(t.curve, lo.curve))
    assert 0 < t.goodput <= lo.goodput
    found_t = pl.find_goodput(mix, placement, tight)
    found_lo = pl.find_goodput(mix, placement, loose)
    assert 0 < found_t.goodput <= found_lo.goodput
    # bisection converged: a passing rate, the next rate it tried above misses, 2^-8 apart
    curve = found_t.curve
    i = [p.rate for p in curve].index(found_t.goodput)
    assert curve[i].attainment >= 0.9 > curve[i + 1].attainment
    assert curve[i + 1].rate - curve[i].rate <= curve[i].rate / 2 ** 8
    assert all(p.attainment >= 0.9 for p in curve[:i])
    # and near the grid's answer (attainment is not exactly monotone at fine steps)
    first_miss = next(p.rate for p in t.curve if p.attainment < 0.9)
    assert 0.9 * t.goodput <= found_t.goodput <= first_miss
    assert found_t.per_device == found_t.goodput / placement.num_devices


def test_goodput_is_zero_when_even_one_request_alone_misses():
    res = pl.find_goodput(random_mix(20), pl.colocated(1, DEV), pl.SLO(1e-4, 1.0),
                          max_doublings=4)
    assert res.goodput == 0.0


# ---- the search ------------------------------------------------------------------------------
def test_search_returns_the_best_per_device_candidate_it_lists():
    """Long prompts, short outputs and a tight TPOT: prefills stall colocated decodes."""
    mix = pl.RequestMix(tuple([800] * 60), tuple([20] * 60))
    config = pl.SimConfig(policy="prefill_first")
    res = pl.search_placement(mix, DEV, 3, pl.SLO(1.0, 0.02), config=config, iters=6)
    labels = [c.placement.label for c in res.candidates]
    assert labels == ["colocated x3 (dev)", "P1:D2 (dev/dev)", "P2:D1 (dev/dev)"]
    assert res.best.per_device == max(c.per_device for c in res.candidates)
    assert res.best.placement.mode == "disaggregated"
    again = pl.find_goodput(mix, res.best.placement, pl.SLO(1.0, 0.02), config=config, iters=6)
    assert again == res.best.result
    assert [row["placement"] for row in res.table()] == labels


def test_heterogeneous_search_puts_decode_on_the_cheaper_class():
    """Equal decode costs, the expensive class prefills twice as fast: per dollar-hour, decode
    belongs on the cheap class whatever runs prefill."""
    fast = pl.DeviceClass("fast", COSTS.scaled(prefill=0.5), price_per_hour=3.0)
    cheap = pl.DeviceClass("cheap", COSTS, price_per_hour=1.0)
    res = pl.search_placement(random_mix(100), [fast, cheap], 3, pl.SLO(0.3, 0.02), iters=5)
    assert res.objective == "per_dollar_hour"
    assert res.best.per_dollar_hour == max(c.per_dollar_hour for c in res.candidates)
    assert res.best.placement.mode == "disaggregated"
    assert res.best.placement.decode_class is cheap
    by = {(c.placement.num_prefill, c.placement.prefill_class.name,
           c.placement.decode_class.name): c for c in res.candidates
          if c.placement.mode == "disaggregated"}
    for (p, pre, dec), c in by.items():
        if dec == "cheap":      # same goodput as on the expensive class, for less
            assert c.result.goodput == by[(p, pre, "fast")].result.goodput
            assert c.per_dollar_hour > by[(p, pre, "fast")].per_dollar_hour or c.result.goodput == 0


# ---- the cost model --------------------------------------------------------------------------
def test_fit_recovers_exact_coefficients_and_stays_non_negative():
    ns = [8, 32, 100, 250, 600, 1000]
    coef = pl.fit_nonnegative([(1, n, n * n) for n in ns], [prefill(n) for n in ns])
    assert coef == pytest.approx((P0, P1, P2), rel=1e-9)
    # a line with a negative intercept: the best non-negative fit has none
    coef = pl.fit_nonnegative([(1, n, n * n) for n in ns], [1e-5 * n - 1e-5 for n in ns])
    assert min(coef) >= 0 and coef[0] == 0


def test_cost_model_json_round_trip_and_scaling_is_labelled_assumed():
    model = pl.CostModel((P0, P1, P2), (D0, D1, D2), KV_BYTES, OVERLAP,
                         prefill_points=((16, 0.01), (64, 0.02)),
                         decode_points=((1, 32, 0.004), (4, 140, 0.006)),
                         mixed_points=((64, 4, 140, 0.02),), source="measured: test")
    assert pl.CostModel.from_dict(json.loads(json.dumps(model.to_dict()))) == model
    fast = model.scaled(prefill=0.5)
    assert fast.prefill_time(100) == pytest.approx(0.5 * model.prefill_time(100))
    assert fast.decode_time(4, 400) == model.decode_time(4, 400)
    assert fast.source.startswith("assumed") and not fast.prefill_points


@pytest.fixture(scope="module")
def engine():
    llm = minillm.LLM("tiny", random_weights=True, dtype=torch.float32, num_kv_blocks=1024,
                      max_num_seqs=32, max_num_batched_tokens=256)
    return llm.engine


def warm_every_step_size(engine) -> None:
    """On the CPU PyTorch runs a step of a token count it has not met yet about twice as slow
    (for the tiny model); the cost model is of warm steps, so meet them all once."""
    params = minillm.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for n in range(1, engine.config.max_num_batched_tokens + 1):
        engine.add_request([7] * n, params)
        engine.step()


# The module's TOLERANCE is what chapter 07 shows on the real model. The tiny model's steps last
# 1-3 ms, and on a shared 2-core machine the same step measured a few seconds apart varies by up
# to 2x (Python and allocator overhead dominate), so the test asks for twice the tolerance: a
# simulator that lost its queueing, its decode cost or its mixed steps misses by far more.
REAL_RUN_BOUND = 2 * pl.TOLERANCE


def test_measured_costs_predict_a_real_run(engine):
    """Fit on the tiny model's own steps, then serve a Poisson workload for real at a light
    and a loaded rate: the simulated mean TTFT and TPOT are within REAL_RUN_BOUND.
    Wall-clock timings: one measurement thrown away first (the first ones after warm-up run
    slow), then up to three tries (measure, then serve), with the garbage collector off while
    timing (as ``timeit`` does): in a long test session one collection stalls a step and a
    stalled step delays every request that arrives meanwhile."""
    warm_every_step_size(engine)
    work = make_workload(None, 60, (16, 200), (8, 48), seed=1)
    measure = functools.partial(pl.measure_costs, engine, prompt_lens=(16, 64, 128, 256),
                                batches=(1, 4, 16, 32), contexts=(32, 128), repeats=7)
    tries = []
    gc.collect()
    gc.disable()
    try:
        measure()
        for _ in range(3):
            costs = measure()
            points = pl.validate(engine, costs, work, rates=(5.0, 50.0))
            tries.append(points)
            if all(p.within(REAL_RUN_BOUND) for p in points):
                break
    finally:
        gc.enable()
    assert costs.source.startswith("measured") and len(costs.decode_points) == 8
    assert len(costs.mixed_points) == 6 and costs.mixed_overlap >= 0   # batch 32 = max_num_seqs
    assert costs.kv_bytes_per_token == engine.model.cfg.kv_bytes_per_token(4)   # float32
    assert [p.rate for p in points] == [5.0, 50.0]
    assert all(p.real_preemptions == 0 for p in points)
    assert points[1].sim_ttft > points[0].sim_ttft         # the loaded rate queues
    errors = [[(p.rate, round(p.ttft_error, 3), round(p.tpot_error, 3)) for p in t] for t in tries]
    assert all(p.within(REAL_RUN_BOUND) for p in points), errors
    assert points[1].real_ttft > points[0].real_ttft       # and so does the real engine


# ---- bad input -------------------------------------------------------------------------------
BAD = {
    "ttft_s": lambda: pl.SLO(0.0, 0.1),
    "tpot_s": lambda: pl.SLO(0.1, -1.0),
    "attainment": lambda: pl.sweep_rates(random_mix(5), pl.colocated(1, DEV), pl.SLO(1, 1), [1],
                                         attainment=0.0),
    "attainment ": lambda: pl.find_goodput(random_mix(5), pl.colocated(1, DEV), pl.SLO(1, 1),
                                           attainment=1.5),
    "rate": lambda: pl.evaluate_rate(random_mix(5), pl.colocated(1, DEV), 0.0, pl.SLO(1, 1)),
    "rate ": lambda: pl.sweep_rates(random_mix(5), pl.colocated(1, DEV), pl.SLO(1, 1), [1, -2]),
    "start_rate": lambda: pl.find_goodput(random_mix(5), pl.colocated(1, DEV), pl.SLO(1, 1),
                                          start_rate=-1.0),
    "num_devices": lambda: pl.search_placement(random_mix(5), DEV, 1, pl.SLO(1, 1)),
    "num_devices ": lambda: pl.disaggregated_splits(1),
    r"num_prefill \+ num_decode": lambda: pl.candidate_placements([DEV], 4, splits=[(1, 2)]),
    "num_prefill": lambda: pl.disaggregated(0, 2, DEV),
    "num_decode": lambda: pl.disaggregated(2, 0, DEV),
    "num_prefill ": lambda: pl.colocated(0, DEV),
    "token_budget": lambda: pl.SimConfig(token_budget=0),
    "token_budget ": lambda: pl.SimConfig(token_budget=8, max_batch=16),
    "max_batch": lambda: pl.SimConfig(max_batch=0),
    "policy": lambda: pl.SimConfig(policy="decode_first"),
    "routing": lambda: pl.SimConfig(routing="random"),
    "link_bandwidth": lambda: pl.SimConfig(link_bandwidth=0),
    "objective": lambda: pl.search_placement(random_mix(5), DEV, 2, pl.SLO(1, 1),
                                             objective="cheapest"),
    "modes": lambda: pl.candidate_placements([DEV], 2, modes=("split",)),
    "arrivals": lambda: pl.simulate(random_mix(5), [0.0], pl.colocated(1, DEV)),
    "prompt_lens": lambda: pl.RequestMix((0, 4), (1, 1)),
    "price_per_hour": lambda: pl.DeviceClass("x", COSTS, 0.0),
    "prefill_coef": lambda: pl.CostModel((-1.0, 0, 0), (0, 0, 0), 0),
    "mixed_overlap": lambda: pl.CostModel((P0, P1, P2), (D0, D1, D2), 0, mixed_overlap=0.006),
    "prefill": lambda: COSTS.scaled(prefill=0),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_names_the_option(name):
    with pytest.raises(ValueError, match=name.strip()):
        BAD[name]()


@pytest.mark.parametrize("option, kwargs", [
    ("prompt_lens", {"prompt_lens": (16, 64, 1000)}),      # over max_num_batched_tokens
    ("prompt_lens", {"prompt_lens": (16, 16, 64)}),        # fewer than 3 distinct lengths
    ("batches", {"batches": (1, 64)}),                     # over max_num_seqs
    ("contexts", {"contexts": (32,)}),
    ("repeats", {"repeats": 0}),
])
def test_bad_measure_grids_name_the_option(engine, option, kwargs):
    with pytest.raises(ValueError, match=option):
        pl.measure_costs(engine, **kwargs)


def test_validate_rejects_bad_rates_and_an_engine_it_cannot_mirror(engine):
    work = make_workload(None, 4, (8, 16), (2, 4))
    with pytest.raises(ValueError, match="rate"):
        pl.validate(engine, COSTS, work, rates=(5.0, 0.0))
    other = minillm.LLM("tiny", random_weights=True, dtype=torch.float32, num_kv_blocks=64,
                        enable_chunked_prefill=False).engine
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        pl.validate(other, COSTS, work, rates=(5.0,))
