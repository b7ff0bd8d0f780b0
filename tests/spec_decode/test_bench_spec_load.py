"""Speculation under load (``minillm.bench.spec_load``) on the tiny model with random drafters:
equal-budget options verify what they say, the Poisson loop serves every request and frees
every block, the break-even rate is where the latency speedup crosses 1, the report plots."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import torch
from engine_checks import assert_all_free, prompts_of, sharp_model
from test_spec_blocks import block_drafter
from test_spec_engine import assert_drafter_free

from minillm import SamplingParams
from minillm.bench.spec import (
    ALL_METHODS,
    DEFAULT_K,
    make_engine,
    measure,
    measure_paired,
    report_of,
    warm_up,
)
from minillm.bench.spec_load import (
    LoadConfig,
    break_even,
    budget_options,
    load_configs,
    run_load_sweeps,
    serve_at_rate,
    spec_load_tables,
    with_speedups,
)
from minillm.checkpoint import load_model
from minillm.cli import build_parser
from minillm.spec_decode.config import MAX_TOKENS, TREE_METHODS, SpeculativeConfig
from minillm.viz.bench import plot_spec, plot_spec_load

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return sharp_model(torch.float32)


@pytest.fixture(scope="module")
def drafters(model):
    return {m: block_drafter(model, block=8) for m in ("dflash", "ddtree", "dspark")}


@pytest.mark.parametrize("method", ALL_METHODS)
@pytest.mark.parametrize("nodes", [4, 8, 16])
def test_equal_budget_options_verify_at_most_the_budget(method, nodes):
    k, extra = budget_options(method, nodes, max_seqs=5)
    cfg = SpeculativeConfig.from_dict({"method": method, "num_speculative_tokens": k, **extra})
    if method in TREE_METHODS:       # a tree's budget is its node count, at its usual depth
        assert (k, cfg.tree_nodes, cfg.max_draft_tokens) == (DEFAULT_K[method], nodes, nodes)
    else:                            # a chain drafts as many, up to its most
        assert k == cfg.max_draft_tokens == min(nodes, MAX_TOKENS[method])
    assert cfg.verify_budget == (nodes * 5 if method == "dspark" else None)


def test_load_configs_give_dspark_two_budgets():
    configs = load_configs(["ngram", "dspark"], max_seqs=6)
    assert [c.label for c in configs] == ["none", "ngram", "dspark (budget 6)",
                                          "dspark (budget 24)"]
    assert configs[0].method is None and configs[2].extra == {"verify_budget": 6}


@pytest.mark.parametrize("method", [None, "ngram", "dspark"])
def test_poisson_loop_serves_every_request_and_frees_every_block(model, drafters, method):
    prompts = prompts_of([5, 12, 7, 9], seed=4)
    engine = make_engine(model, None, method, 3, len(prompts), drafter=drafters.get(method),
                         extra={"verify_budget": 4} if method == "dspark" else None)
    warm_up(engine, prompts[0])
    for rate in (2.0, math.inf):
        row = serve_at_rate(engine, prompts, PARAMS, rate, seed=1)
        assert row["tokens"] == len(prompts) * PARAMS.max_tokens
        assert 0 < row["ttft"] <= row["latency"] <= row["seconds"]
        assert row["throughput"] == pytest.approx(row["tokens"] / row["seconds"])
        assert_all_free(engine)
        if method is not None:
            assert_drafter_free(engine)
            assert row["mean_accepted"] >= 1


def rows_of(label, latencies, rates=(0.5, 1.0, 2.0, 4.0)):
    method = "none" if label == "none" else label
    return [{"label": label, "method": method, "rate": r, "throughput": 1.0, "latency": lat}
            for r, lat in zip(rates, latencies)]


def test_break_even_is_where_the_latency_speedup_crosses_one():
    rows = with_speedups(rows_of("none", [1, 1, 2, 4]) + rows_of("a", [0.5, 0.8, 8 / 3, 5])
                         + rows_of("b", [2, 2, 3, 5]) + rows_of("c", [0.5, 0.5, 1, 2]))
    even = break_even(rows)
    # a: speedup 1.25 at 1 req/s, 0.75 at 2 req/s -> crosses halfway in log rate
    assert even["a"] == pytest.approx(math.sqrt(2.0))
    assert even["b"] == 0.0 and even["c"] is None


def test_load_sweeps_report_tables_and_plot(model, drafters):
    prompts = prompts_of([6, 10, 8], seed=2)
    load = run_load_sweeps(model, None, ["ngram", "dspark"], budgets=(2, 4), rates=(1.0, 50.0),
                           max_tokens=6, prompts=prompts, drafters=drafters, log=lambda s: None)
    assert [(r["method"], r["budget"]) for r in load["equal_budget"]] == \
        [("ngram", 2), ("ngram", 4), ("dspark", 2), ("dspark", 4)]
    assert all(r["nodes_per_round"] <= r["budget"] for r in load["equal_budget"])
    assert {r["label"] for r in load["rates"]} == {"none", "ngram", "dspark (budget 3)",
                                                   "dspark (budget 12)"}
    assert all(r["speedup"] == 1.0 for r in load["rates"] if r["method"] == "none")
    runs = [{"method": m, "kind": "mixed", "k": DEFAULT_K.get(m, 0), "batch": b, "speedup": 1.0}
            for m in ("none", "ngram", "dspark") for b in (1, 4)]
    report = {"runs": runs, "config": {"default_k": DEFAULT_K}, "load": load,
              "drafter_cost": []}
    assert "break-even" in spec_load_tables(report)
    fig = plot_spec_load(report)
    assert isinstance(fig, plt.Figure) and len(fig.axes) == 6
    plt.close(fig)


def test_drafter_cost_per_round_and_the_part1_plot(model):
    """Batch-1 runs at the default k give the drafter's ms per round next to the plain
    engine's ms per token; the other runs do not count."""
    prompts = prompts_of([6, 10], seed=3)
    k = DEFAULT_K["ngram"]
    base = measure(model, None, None, 0, "chat", prompts, 1, PARAMS)
    runs = [base, measure(model, None, "ngram", k, "mixed", prompts, 1, PARAMS),
            measure(model, None, "ngram", 2, "mixed", prompts, 1, PARAMS),
            measure(model, None, None, 0, "mixed", prompts, 2, PARAMS),
            measure(model, None, "ngram", k, "mixed", prompts, 2, PARAMS)]
    report = report_of(runs, {"chat": base}, {}, {"default_k": DEFAULT_K})
    (cost,) = report["drafter_cost"]
    spec = runs[1]
    assert cost["method"] == "ngram" and cost["k"] == k
    assert cost["draft_ms_per_round"] == pytest.approx(1e3 * spec.propose_seconds / spec.rounds)
    assert cost["plain_ms_per_token"] == pytest.approx(1e3 * base.seconds / base.tokens)
    fig = plot_spec(report)
    assert isinstance(fig, plt.Figure) and len(fig.axes) == 3      # k = 2 and 6: a sweep
    plt.close(fig)
    no_sweep = dict(report, runs=[r for r in report["runs"] if r["k"] != 2])
    fig = plot_spec(no_sweep)
    assert len(fig.axes) == 2                                        # no k panel
    plt.close(fig)


def test_paired_runs_alternate_plain_and_speculative_and_report_their_median(model):
    """--repeats: one speedup per pair of runs, the report's speedup is their median, and the
    paired engines serve every request and free every block."""
    prompts = prompts_of([6, 10, 8, 7], seed=3)
    run, other = measure_paired(model, None, "ngram", {"mixed": prompts, "chat": prompts[:2]},
                                2, PARAMS, 3,
                                calibration_prompts=prompts_of([12, 9, 11, 10], seed=4))
    assert len(run.paired_speedups) == 3 and all(x > 0 for x in run.paired_speedups)
    assert run.method == "ngram auto" and run.batch == 2 and run.tokens == 3 * 4 * 8
    assert other.kind == "chat" and other.tokens == 3 * 2 * 8      # its own rounds
    base = measure(model, None, None, 0, "mixed", prompts, 1, PARAMS)
    plain2 = measure(model, None, None, 0, "mixed", prompts, 2, PARAMS)
    row = next(r for r in report_of([base, plain2, run], {"mixed": base}, {},
                                    {"default_k": DEFAULT_K})["runs"]
               if r["batch"] == 2 and r["method"] != "none")
    assert row["speedup"] == sorted(run.paired_speedups)[1]
    with pytest.raises(ValueError, match="repeats"):
        from minillm.bench.spec import run_spec_bench
        run_spec_bench("tiny", methods=["ngram"], auto=True, repeats=0)


def test_cli_part1_switch():
    args = build_parser().parse_args(["bench", "spec", "--part1", "--rates", "1", "3"])
    assert args.part1 and args.methods is None and args.rates == [1.0, 3.0]
    assert build_parser().parse_args(["bench", "spec", "--no-load"]).load is False
    assert LoadConfig("none", None).extra == {}


def test_gpu_spec_check_sweeps_every_method_on_the_tiny_model():
    """benchmarks/gpu_spec_check.py's batch sweep, at the tiny preset's shape on the CPU (the
    GPU machine runs it at real shapes): every method at every batch, nothing skipped."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_spec_check.py"
    spec = importlib.util.spec_from_file_location("gpu_spec_check", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    tiny, _ = load_model("tiny", device="cpu", dtype=torch.float32, random_weights=True)
    assert check.block_layers(30) == (1, 10, 20, 28) and check.block_layers(2) == (0, 1)
    out = check.batch_sweep(tiny, check.repeating_prompts(2, 24), (1, 2), math.inf)
    assert out["skipped"] == [] and set(out["speedup"]) == set(ALL_METHODS)
    assert all(set(by) == {1, 2} for by in out["speedup"].values())
