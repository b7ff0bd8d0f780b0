"""Chapter 06b plots: each returns a Figure for small real-shaped data."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from minillm.spec_decode.trees import best_first_tree  # noqa: E402
from minillm.viz import ch06b  # noqa: E402


def test_plots_return_figures():
    logps = [[-0.1, -2.5], [-0.7, -0.9], [-0.2, -1.8]]
    parents, picks = best_first_tree(logps, 6)
    mask = torch.zeros(10, 10, dtype=torch.bool)
    mask[6:, :6] = True
    figs = [ch06b.plot_drafter_cost([1, 2, 4], {"mtp": [3.0, 6.1, 12.0], "dflash": [5.0] * 3}),
            ch06b.plot_block_mask(mask, 6, 2),
            ch06b.plot_ddtree([f"t{d}{r}\n" for d, r in picks], parents,
                              [0.9 ** (d + 1) for d, _ in picks], accepted=[1, 2],
                              root_label="'The'"),
            ch06b.plot_reliability({"served": [[0.15, 0.1, 30], [0.55, 0.5, 12]],
                                    "held out": [[0.9, 0.85, 100]], "empty": []}),
            ch06b.plot_budget([1, 4, 16], {"dflash": [7, 7, 7], "dspark": [5.2, 4.0, 1.0]},
                              speedup={"dflash": [1.2, 1.0, 0.7]}, budget=16, k=7),
            ch06b.plot_budget([1, 2], {"dspark": [3.0, 2.0]}),
            ch06b.plot_early_exit([0.05, 0.1, 0.3], [6.0, 4.0, 1.5], [1.0, 0.9, 0.6],
                                  rate=[30.0, 33.0, 31.0]),
            ch06b.plot_early_exit([0.1], [4.0], [1.0]),
            ch06b.plot_methods({"none": dict(tokens_per_round=1, speedup=1, draft_ms=0),
                                "dflash": dict(tokens_per_round=2.1, speedup=1.3,
                                               draft_ms=9.0)}, highlight=["dflash"])]
    assert all(isinstance(f, plt.Figure) for f in figs)
    plt.close("all")


def test_bad_shapes_are_errors():
    with pytest.raises(ValueError, match="one entry per node"):
        ch06b.plot_ddtree(["a"], [0, 0], [0.5, 0.5])
    with pytest.raises(ValueError, match="square"):
        ch06b.plot_block_mask(torch.zeros(3, 4), 2, 1)
