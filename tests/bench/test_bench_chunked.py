"""``bench chunked`` (``minillm.bench.chunked``) on the tiny preset with random weights: the ITL
and percentile helpers against hand computations and numpy, the summary of a hand-made run,
the workload's shape, each policy's steps doing what the policy says, the fp32 equality check,
the report, table, plot and command line."""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from engine_checks import sharp_model

from minillm.bench import chunked
from minillm.bench.chunked import (
    ChunkedWorkload,
    chunked_table,
    chunked_workload,
    inter_token_latencies,
    itl_stats,
    run_chunked_bench,
    same_outputs_check,
    summarize,
    workload_prompts,
)
from minillm.cli import build_parser
from minillm.driver import DriveResult, RequestRecord, StepTiming
from minillm.serving_metrics import percentile
from minillm.viz.bench import plot_chunked

BUDGETS = (32, 64)
NUM_DECODES, NUM_LONG, LONG_RANGE = 4, 2, (120, 200)


def test_itl_and_percentiles_by_hand():
    # gaps 1, 0.5, 2.5, 0.25 and, from the second request, 0.5
    times = [[0.0, 1.0, 1.5, 4.0, 4.25], [10.0, 10.5]]
    assert inter_token_latencies(times[0]) == [1.0, 0.5, 2.5, 0.25]
    assert inter_token_latencies([3.0]) == []
    # sorted 0.25 0.5 0.5 1 2.5: p50 is rank 2; p90 sits at rank 3.6, p99 at rank 3.96
    stats = itl_stats(times)
    assert stats["count"] == 5 and stats["max"] == 2.5
    assert stats["p50"] == pytest.approx(0.5)
    assert stats["p90"] == pytest.approx(1 + 0.6 * 1.5)
    assert stats["p99"] == pytest.approx(1 + 0.96 * 1.5)
    assert stats["mean"] == pytest.approx(4.75 / 5)
    assert stats["quantiles"][0] == 0.25 and stats["quantiles"][100] == 2.5
    gaps = [1.0, 0.5, 2.5, 0.25, 0.5]
    for q in (0, 10, 37, 50, 90, 99, 100):
        assert percentile(gaps, q) == pytest.approx(np.percentile(gaps, q))
    with pytest.raises(ValueError, match="non-decreasing"):
        inter_token_latencies([1.0, 0.5])
    with pytest.raises(ValueError, match="q must be"):
        percentile(gaps, 101)
    with pytest.raises(ValueError, match="at least one request"):
        itl_stats([[1.0]])


def test_summary_of_a_hand_made_run():
    """Two running requests and one long prompt arriving at 1 s, token times by hand."""
    work = ChunkedWorkload([[1] * 4, [2] * 6, [3] * 20], [3, 3, 2], [0.0, 0.0, 1.0],
                           ["decode", "decode", "long"])
    times = [[0.5, 1.0, 3.0], [0.5, 1.0, 3.5], [3.0, 3.5]]
    records = [RequestRecord(str(i), work.arrivals[i], len(work.prompts[i]),
                             token_ids=[7] * len(t), token_times=t) for i, t in enumerate(times)]
    steps = [(0.0, 0.5, 10, 0, 2), (0.5, 1.0, 0, 2, 2), (1.0, 3.0, 20, 0, 1), (3.0, 3.5, 0, 2, 2)]
    run = DriveResult(records, [StepTiming(*s) for s in steps], [], 3.5)
    s = summarize(work, run)
    assert s["itl"]["max"] == 2.5 and s["itl"]["count"] == 4     # gaps 0.5 0.5 2.0 2.5
    assert s["itl"]["p50"] == pytest.approx(1.25)
    assert s["ttft_long"] == {"p50": 2.0, "p90": 2.0, "max": 2.0}
    assert s["tpot_decode_mean"] == pytest.approx((1.25 + 1.5) / 2)
    assert s["tpot_long_mean"] == pytest.approx(0.5)
    assert s["makespan_s"] == 3.5 and s["output_tokens"] == 8
    assert s["output_tok_s"] == pytest.approx(8 / 3.5)
    assert s["total_tok_s"] == pytest.approx((8 + 30) / 3.5)
    assert [t["end"] - t["start"] for t in s["timeline"]] == [0.5, 0.5, 2.0, 0.5]


def test_workload_arrivals_and_decode_length():
    short, long = workload_prompts(None, 1000, 3, 2, (5, 9), (40, 60), seed=1)
    assert [len(p) for p in short] == [len(p) for p in workload_prompts(
        None, 1000, 3, 2, (5, 9), (40, 60), seed=1)[0]]
    assert all(5 <= len(p) <= 9 for p in short) and all(40 <= len(p) <= 60 for p in long)
    assert all(10 <= t < 1000 for p in short + long for t in p)
    work = chunked_workload(short, long, gap=0.5, decode_step=0.04, long_tokens=4, max_seq_len=512)
    assert work.arrivals == [0.0, 0.0, 0.0, 0.5, 1.0]
    assert work.output_lens == [math.ceil(3 * 0.5 / 0.04)] * 3 + [4, 4]
    assert work.ids("long") == ["3", "4"]
    capped = chunked_workload(short, long, 0.5, 0.001, 4, max_seq_len=100)
    assert [len(p) + n for p, n in zip(capped.prompts[:3], capped.output_lens)] == [100] * 3
    with pytest.raises(ValueError, match="long_range"):
        workload_prompts(None, 1000, 3, 2, (5, 9), (60, 40))


@pytest.fixture(scope="module")
def report():
    """The whole benchmark on the tiny preset with random weights (whose greedy tokens hardly
    depend on the context, so the fp32 check is on :func:`sharp`'s run below)."""
    return run_chunked_bench("tiny", budgets=BUDGETS, num_decodes=NUM_DECODES,
                             num_long=NUM_LONG, long_range=LONG_RANGE, dtype="float32",
                             random_weights=True, decode_range=(8, 16), long_tokens=4,
                             gap_steps=4, log=lambda s: None)


@pytest.fixture(scope="module")
def sharp():
    """The tiny shape with peaked attention: its greedy tokens follow the context."""
    return sharp_model(torch.float32)


def check_of(model) -> dict:
    short, long = workload_prompts(None, model.cfg.vocab_size, 2, 1, (8, 16), LONG_RANGE, seed=0)
    return same_outputs_check(model, None, short, long[0], BUDGETS)


def test_report_keys_and_every_token_served(report):
    for key in ("machine_info", "load_average_before", "load_average_after", "config",
                "calibration", "runs", "ratios", "itl_p99_ratio", "throughput_ratio",
                "same_outputs", "dtype", "seconds"):
        assert key in report
    assert {"device", "git_commit", "threads", "torch"} <= set(report["machine_info"])
    cfg = report["config"]
    assert [r["label"] for r in report["runs"]] == ["prefill_first", "decode_first",
                                                    "chunked 32", "chunked 64"]
    for r in report["runs"]:
        reqs = r["requests"]
        assert len(reqs) == NUM_DECODES + NUM_LONG and r["preemptions"] == 0
        assert [q["output_len"] for q in reqs] == \
            [cfg["decode_tokens"]] * NUM_DECODES + [cfg["long_tokens"]] * NUM_LONG
        # without preemption a request computes its prompt and all but its last output token
        computed = sum(s["prefill"] + s["decode"] for s in r["timeline"])
        assert computed == sum(q["prompt_len"] + q["output_len"] - 1 for q in reqs)
        assert r["itl"]["count"] == NUM_DECODES * (cfg["decode_tokens"] - 1)
        assert r["itl"]["p50"] <= r["itl"]["p90"] <= r["itl"]["p99"] <= r["itl"]["max"]
        assert all(s["prefill"] + s["decode"] <= r["budget"] for s in r["timeline"])
        # two interleaved rounds; the row is the one with the shortest makespan
        assert len(r["repeats"]) == 2
        assert r["makespan_s"] == min(t["makespan_s"] for t in r["repeats"])
        assert r["itl"]["p99"] in [t["itl_p99"] for t in r["repeats"]]


def test_each_policy_shares_steps_as_it_says(report):
    runs = {r["label"]: r for r in report["runs"]}
    shortest = min(report["config"]["long_prompt_lens"])
    pf = runs["prefill_first"]
    whole = [s for s in pf["timeline"] if s["prefill"] >= shortest]
    assert len(whole) == NUM_LONG and all(s["decode"] == 0 for s in whole)   # decodes stall
    assert pf["itl"]["max"] >= max(s["end"] - s["start"] for s in whole)
    df = runs["decode_first"]
    decodes_end = max(q["arrival"] + q["ttft"] + q["tpot"] * (q["output_len"] - 1)
                      for q in df["requests"] if q["kind"] == "decode")
    first_long = min(s["start"] for s in df["timeline"] if s["prefill"] >= shortest)
    assert first_long >= decodes_end - 1e-6   # prompts wait for the decodes (times: 1 us)
    assert not any(s["prefill"] and s["decode"] for s in df["timeline"])
    for b in BUDGETS:                                     # no step runs a whole long prompt
        ch = runs[f"chunked {b}"]
        assert all(s["prefill"] < shortest for s in ch["timeline"])
        assert any(s["prefill"] and s["decode"] for s in ch["timeline"])


def test_ratios_and_fp32_equality(report):
    runs = {r["label"]: r for r in report["runs"]}
    for b in BUDGETS:
        r = report["ratios"][str(b)]
        assert r["itl_p99_ratio"] == pytest.approx(
            runs["prefill_first"]["itl"]["p99"] / runs[f"chunked {b}"]["itl"]["p99"])
        assert r["throughput_ratio"] == pytest.approx(
            runs[f"chunked {b}"]["output_tok_s"] / runs["prefill_first"]["output_tok_s"])
    assert report["itl_p99_ratio"] == report["ratios"]["32"]["itl_p99_ratio"]
    check = report["same_outputs_check"]
    assert report["same_outputs"] is True and check["differ"] == [] and check["dtype"] == "float32"
    assert set(check["token_ids"]) == {"prefill_first", "decode_first", "chunked 32", "chunked 64"}
    assert all(len(ids) == check["max_tokens"] for v in check["token_ids"].values() for ids in v)


def test_fp32_outputs_agree_across_policies_and_the_check_can_fail(sharp, monkeypatch):
    check = check_of(sharp)
    ids = check["token_ids"]["prefill_first"]
    assert check["same_outputs"] is True and check["differ"] == []
    assert len({tuple(x) for x in ids}) == 3 and all(len(x) == 8 for x in ids)
    other = sharp_model(torch.float32, seed=4)
    real = chunked.engine_for

    def swapped(model, tok, policy, budget, work):     # chunked runs get another model
        return real(other if policy == "chunked" else model, tok, policy, budget, work)

    monkeypatch.setattr(chunked, "engine_for", swapped)
    bad = check_of(sharp)
    assert bad["same_outputs"] is False and bad["differ"] == ["chunked 32", "chunked 64"]


def test_table_and_plot(report):
    table = chunked_table(report)
    assert "prefill_first" in table and "chunked 64" in table and "same greedy ids" in table
    fig = plot_chunked(report)
    assert isinstance(fig, plt.Figure) and len(fig.axes) == 4
    plt.close(fig)


def test_bad_budget_names_the_parameter():
    with pytest.raises(ValueError, match="budgets"):
        run_chunked_bench("tiny", budgets=(4,), num_decodes=4, num_long=2, long_range=(50, 60),
                          dtype="float32", random_weights=True, log=lambda s: None)


def test_cli_accepts_the_options():
    args = build_parser().parse_args(
        ["bench", "chunked", "--budgets", "128", "256", "--num-decodes", "4", "--num-long", "2",
         "--long-range", "100", "200", "--dtype", "float32", "--gap-steps", "8",
         "--long-tokens", "4", "--repeats", "3", "--out", "x.json", "--figure", "none"])
    assert (args.budgets, args.num_decodes, args.num_long, args.long_range, args.dtype) == \
        ([128, 256], 4, 2, [100, 200], "float32")
    assert (args.gap_steps, args.long_tokens, args.repeats, args.out, args.figure) == \
        (8, 4, 3, "x.json", "none")
    assert args.func is chunked.main
    default = build_parser().parse_args(["bench", "chunked"])
    assert default.budgets == [256, 512] and default.out == "benchmarks/results/chunked.json"
