"""Chapter 07 plots: each returns a Figure for small real-shaped data."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from minillm.course.placement import CostModel  # noqa: E402
from minillm.viz import ch07  # noqa: E402


def test_plots_return_figures():
    steps = [{"start": 0.0, "end": 0.1, "prefill": 0, "decode": 4},
             {"start": 0.1, "end": 0.3, "prefill": 60, "decode": 4},
             {"start": 0.3, "end": 0.5, "prefill": 100, "decode": 0}]
    costs = CostModel((1e-3, 1e-5, 1e-9), (2e-3, 1e-4, 1e-7), 9216,
                      prefill_points=((16, 0.0012), (64, 0.0017)),
                      decode_points=((1, 32, 0.0021), (4, 32, 0.0024), (1, 128, 0.0022),
                                     (4, 128, 0.0025)))
    figs = [ch07.plot_step_timeline({"chunked": steps, "prefill_first": steps[::2]}),
            ch07.plot_latency_dists({"chunked": {"itl": [0.01, 0.02], "ttft": [0.3]},
                                     "decode_first": {"itl": [0.01], "ttft": []}}),
            ch07.plot_request_timelines(
                {"layerwise": [{"rid": "0", "arrival": 0.0, "kv_ready": 1.0, "start": 0.5,
                                "end": 1.01, "first_decode": 1.1}],
                 "whole": [{"rid": "0", "arrival": 0.0, "kv_ready": 1.0, "start": 1.0,
                            "end": 1.05, "first_decode": 1.2},
                           {"rid": "1", "arrival": 0.2, "kv_ready": 2.0, "start": 2.0,
                            "end": 2.05, "first_decode": 2.1}]}),
            ch07.plot_cost_fit(costs),
            ch07.plot_goodput({"colocated x2": ([1, 2, 4], [1, 0.95, 0.4]),
                               "P1:D1": ([1, 2], [1, 0.8])},
                              per_device={"colocated x2": 2, "P1:D1": 2})]
    assert all(isinstance(f, plt.Figure) for f in figs)
    plt.close("all")
