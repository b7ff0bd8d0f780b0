"""Chapter 06 plots: each returns a Figure for real-shaped data (a tree, bars, lines)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minillm.spec_decode.trees import medusa_tree, tree_parents  # noqa: E402
from minillm.viz import ch06  # noqa: E402


def test_tree_layout_centres_parents_over_children():
    x, depth = ch06.tree_layout([0, 0, 1, 1])
    assert depth == [0, 1, 1, 2, 2]
    assert x[3] < x[4] and x[1] == (x[3] + x[4]) / 2 and x[0] == (x[1] + x[2]) / 2


def test_plots_return_figures():
    parents = tree_parents(medusa_tree([[0.6, 0.2, 0.1], [0.4, 0.2], [0.3]], 8))
    figs = [ch06.plot_forward_cost([1, 2, 4, 8], [10.0, 10.5, 11.0, 13.0]),
            ch06.plot_distribution_check([0.5, 0.5], [0.49, 0.51], [0.3, 0.7], q=[0.2, 0.8]),
            ch06.plot_tree(list(range(len(parents))), parents, [f"t{i}\n" for i in parents],
                           kept=[1, 2, 3], accepted=[1, 3]),
            ch06.plot_acceptance({"a": [0.8, 0.5], "b": []}),
            ch06.plot_speedups({"a": (1.5, 1.7), "b": (0.9, 1.1)})]
    assert all(isinstance(f, plt.Figure) for f in figs)
    plt.close("all")


def test_plot_tree_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="one entry per node"):
        ch06.plot_tree([1, 2], [0], ["a", "b"])


def test_new_plots_return_figures():
    from collections import Counter

    from minillm.course.ch06_sampling import SampledComparison

    exact = {(1, 2): 0.5, (1, 3): 0.3, (4, 2): 0.2}
    comp = SampledComparison(exact, Counter({(1, 2): 5, (1, 3): 3, (4, 2): 2}),
                             Counter({(1, 2): 4, (1, 3): 4, (4, 2): 2}), 10, 2, [0.5], (1, 2))
    figs = [ch06.plot_leviathan(0.6, 4, 0.1, {"eagle": (5, 0.4, 0.2, 1.1)}),
            ch06.plot_k_choice({"ngram": {1: 1.1, 2: 1.3, 3: 1.2}}, {"ngram": 2},
                               {"ngram": {2: 1.25}}, margin=1.1),
            ch06.plot_sampled_positions({"chain": comp, "tree": comp}, str)]
    assert all(isinstance(f, plt.Figure) for f in figs)
    plt.close("all")


def test_ttt_mask_plot_draws_one_block_per_step():
    from minillm.spec_decode.training.eagle3 import ttt_mask

    fig = ch06.plot_ttt_mask(ttt_mask(3, 6), 3)
    ax = fig.axes[0]
    assert len(ax.lines) == 2 and len(ax.texts) == 3            # 2 separators, 3 step labels
    assert ax.images[0].get_array().shape == (6, 18)
    plt.close(fig)
