"""Chapter 04 helpers on the tiny model: the measuring driver agrees with the engine's own
bookkeeping, the workloads are seeded, and every plot and the explorer widget build."""
from __future__ import annotations

import math

import matplotlib
import pytest

matplotlib.use("Agg")

import minillm  # noqa: E402
from minillm import SamplingParams  # noqa: E402
from minillm import workloads as WL  # noqa: E402
from minillm.cache.block_manager import blocks_for  # noqa: E402
from minillm.course import ch04_workload as W  # noqa: E402
from minillm.engine import EngineConfig, LLMEngine  # noqa: E402
from minillm.viz import ch04 as P  # noqa: E402
from minillm.workloads import make_workload  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return minillm.load_model("tiny", device="cpu")


def engine(tiny, **options):
    return LLMEngine(*tiny, EngineConfig(**{"num_kv_blocks": 64, "block_size": 8, **options}))


def test_workloads_are_seeded_and_in_range(tiny):
    _, tok = tiny
    a = WL.sharegpt_like_workload(tok, 20, 30, 20, prompt_max=64, output_max=40, seed=3)
    b = WL.sharegpt_like_workload(tok, 20, 30, 20, prompt_max=64, output_max=40, seed=3)
    assert a == b
    assert all(4 <= len(p) <= 64 for p in a.prompts) and all(2 <= n <= 40 for n in a.output_lens)
    t = WL.poisson_arrivals(200, 5.0, seed=1)
    assert t == sorted(t) and t[0] == 0 and 25 < t[-1] < 60   # about 200 / 5 s
    assert WL.poisson_arrivals(3, math.inf) == [0.0] * 3
    assert WL.offered_rate([0.0, 1.0, 4.0]) == 0.5 and WL.offered_rate([0.0, 0.0]) == math.inf


def test_serve_records_match_engine(tiny):
    _, tok = tiny
    work = make_workload(tok, 5, (5, 30), (3, 9), seed=0)
    run = W.record_run(engine(tiny, max_num_seqs=2), work, arrivals=[0, 0, 0.5, 10, 10],
                  snapshots=True)
    assert [r.output_len for r in run.records] == work.output_lens
    assert all(r.first_token <= r.finished for r in run.records)
    assert run.makespan >= 10                     # the clock jumped to the late arrivals
    assert len(run.recorder.plans) == len(run.trace) == len(run.recorder.snapshots)
    for plan, rec in zip(run.recorder.plans, run.trace):
        assert sum(plan.new_tokens.values()) == rec.prefill_tokens + rec.decode_tokens
    for snap, rec in zip(run.recorder.snapshots, run.trace):
        assert snap.blocks_used == rec.blocks_used and sum(snap.fill) == rec.slots_used
    flat, padded = W.padded_tokens(run.recorder.plans)
    assert flat == sum(r.prefill_tokens + r.decode_tokens for r in run.trace) <= padded
    assert W.recomputed_tokens(run) == 0


def test_stop_at_and_reservation_waste(tiny):
    _, tok = tiny
    work = WL.sharegpt_like_workload(tok, 6, 20, 10, prompt_max=40, output_max=20, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    runs = {a: W.record_run(engine(tiny, admission=a), work, params, stop_at=work.output_lens)
            for a in ("paged", "reserve")}
    for run in runs.values():
        assert [r.output_len for r in run.records] == work.output_lens
    assert runs["reserve"].kv_waste > runs["paged"].kv_waste
    first = runs["reserve"].trace[0]   # everything admitted at once: each reserved 40 more
    want = sum(blocks_for(len(p) + 40, 8) for p in work.prompts)
    assert first.blocks_used == want


def test_recompute_counted(tiny):
    _, tok = tiny
    work = make_workload(tok, 6, (8, 40), (8, 12), seed=0)
    run = W.record_run(engine(tiny, num_kv_blocks=16, block_size=4, watermark=0), work)
    assert sum(r.num_preemptions for r in run.records) > 0
    assert W.recomputed_tokens(run) > 0
    swap = W.record_run(engine(tiny, num_kv_blocks=16, block_size=4, watermark=0,
                               preemption="swap"), work)
    assert sum(p.swap_out for p in swap.recorder.plans) > 0 and W.recomputed_tokens(swap) == 0


def test_plots_and_widget_build(tiny):
    from minillm.viz import widgets

    _, tok = tiny
    work = make_workload(tok, 3, (10, 20), (3, 5), seed=0)
    params = [SamplingParams(temperature=1.0, n=2, max_tokens=4, seed=0),
              SamplingParams(beam_width=2, max_tokens=4), SamplingParams(max_tokens=4)]
    run = W.record_run(engine(tiny), work, params, snapshots=True)
    snaps = run.recorder.snapshots
    assert any(r > 1 for r in snaps[0].ref) and snaps[0].blocks_unshared > snaps[0].blocks_used
    figs = [P.plot_batch_timeline({"a": run, "b": run}, slots=4),
            P.plot_padding(run.recorder.plans),
            P.plot_kv_usage({"a": run}), P.plot_memory_map(snaps[0]), P.plot_memory_timeline(snaps),
            P.plot_load_sweep(W.load_sweep(lambda: engine(tiny), lambda s: work, 50.0, [0.5, 2],
                                           [0, 1]), saturated=10.0, latency="ttft"),
            P.plot_sharing({"x": (3, 5)}),
            P.plot_preemption([dict(block_size=8, mode=m, moved_tokens=1, recomputed=2,
                                    extra_seconds=0.1, seconds=1) for m in ("swap", "recompute")])]
    assert all(isinstance(f, matplotlib.figure.Figure) for f in figs)
    assert "block table" in widgets.block_tables_text(snaps[0])
    assert widgets.memory_explorer(snaps).children


def test_explore_redraws_on_change():
    import matplotlib.pyplot as plt

    from minillm.viz import widgets

    calls = []

    def plot(size, scale):
        calls.append((size, scale))
        fig, ax = plt.subplots()
        ax.plot([0, size * scale])
        return fig

    box = widgets.explore(plot, size=[1, 2, 4], scale=3)
    assert calls == [(2, 3)]  # the middle value; a single value stays fixed
    box.children[0].value = 4
    assert calls[-1] == (4, 3)
    with pytest.raises(ValueError, match="size"):
        widgets.explore(plot, size=[], scale=3)
