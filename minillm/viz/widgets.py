"""ipywidgets explorers for the chapters. Each returns a widget to display in a notebook.

Chapter 04: :func:`memory_explorer`, a slider over engine steps showing the KV pool's memory
map (which request owns each physical block, reference counts of shared blocks) and the block
tables of the running sequences.

Chapter 08: :func:`radix_stepper`, Play / a slider through the frames of
:func:`minillm.viz.ch08.radix_frames` (requests entering and leaving the engine's radix prefix
cache: hits, evictions), the tree after each event. Widgets only live in a running kernel: a
notebook shows :func:`minillm.viz.ch08.plot_radix_steps` next to it for a static copy.

Appendix A3: :func:`serving_explorer`, a slider over the request rates of the serving benchmark
(``serve.json``): every server at that rate (:func:`minillm.viz.a3.plot_serving_at`, which the
notebook also shows as a static copy).

Any chapter: :func:`explore`, one control per keyword argument of a ``plot_*`` function.
"""
from __future__ import annotations

import matplotlib.pyplot as plt


def memory_explorer(snapshots, cols: int = 16):
    """A slider over :class:`~minillm.course.ch04_workload.MemorySnapshot` s (record them with
    ``serve(..., snapshots=True)``): the memory map of the chosen step and its block tables."""
    import ipywidgets as widgets
    from IPython.display import display

    from .ch04 import plot_memory_map

    if not snapshots:
        raise ValueError("snapshots must not be empty: run serve(..., snapshots=True)")
    slider = widgets.IntSlider(value=len(snapshots) // 2, min=0, max=len(snapshots) - 1,
                               description="step", continuous_update=False)
    out = widgets.Output()

    def show(change=None) -> None:
        snap = snapshots[slider.value]
        with out:
            out.clear_output(wait=True)
            fig = plot_memory_map(snap, cols=cols)
            display(fig)
            plt.close(fig)
            print(block_tables_text(snap))

    slider.observe(show, names="value")
    show()
    return widgets.VBox([slider, out])


def block_tables_text(snap, max_rows: int = 12) -> str:
    """The block tables of a snapshot as text: seq id, request, tokens, physical blocks."""
    lines = [f"{'seq':>5} {'request':>8} {'tokens':>7}  block table (physical ids; * = shared)"]
    for seq_id, (rid, table, n) in list(snap.tables.items())[:max_rows]:
        blocks = " ".join(f"{b}{'*' if snap.ref[b] > 1 else ''}" for b in table)
        lines.append(f"{seq_id:>5} {rid:>8} {n:>7}  {blocks}")
    if len(snap.tables) > max_rows:
        lines.append(f"... {len(snap.tables) - max_rows} more sequences")
    return "\n".join(lines)


def radix_stepper(frames, label=None, interval_ms: int = 1500):
    """Play / a slider through ``frames`` (:func:`minillm.viz.ch08.radix_frames`): the radix
    tree after each event, its text and the prompt tokens found in the cache."""
    import ipywidgets as widgets
    from IPython.display import display

    from .ch08 import plot_radix_frame

    if not frames:
        raise ValueError("frames must not be empty: build them with radix_frames(events, ...)")
    slider = widgets.IntSlider(value=1, min=1, max=len(frames), description="step",
                               continuous_update=False)
    play = widgets.Play(value=1, min=1, max=len(frames), interval=interval_ms)
    widgets.jslink((play, "value"), (slider, "value"))
    out = widgets.Output()

    def show(change=None) -> None:
        frame = frames[slider.value - 1]
        with out:
            out.clear_output(wait=True)
            fig = plot_radix_frame(frame, label)
            display(fig)
            plt.close(fig)
            print(f"step {slider.value}: {frame['event']}")

    slider.observe(show, names="value")
    show()
    return widgets.VBox([widgets.HBox([play, slider]), out])


def serving_explorer(report: dict):
    """A slider over the rates of a serving report: TTFT, TPOT and SLO attainment of every
    server that ran, at the chosen rate."""
    import ipywidgets as widgets
    from IPython.display import display

    from .a3 import plot_serving_at, ran_servers

    ran, _ = ran_servers(report)
    rates = sorted({r["rate"] for s in ran["servers"].values() for r in s["runs"]})
    if not rates:
        raise ValueError("the report has no server with runs: run `python -m minillm bench "
                         "serve` first")
    slider = widgets.SelectionSlider(options=rates, value=rates[len(rates) // 2],
                                     description="req/s", continuous_update=False)
    out = widgets.Output()

    def show(change=None) -> None:
        with out:
            out.clear_output(wait=True)
            fig = plot_serving_at(report, slider.value)
            display(fig)
            plt.close(fig)

    slider.observe(show, names="value")
    show()
    return widgets.VBox([slider, out])


def explore(plot, **choices):
    """Controls for the keyword arguments of ``plot`` (a function returning a Figure) and the
    figure they give, redrawn on every change. Each choice is a list or tuple of values (a
    SelectionSlider starting at the middle value) or a single value (fixed). Widgets only live in
    a running kernel: show ``plot(...)`` at the default values too, as the static copy.

    e.g. ``explore(viz.a1.plot_group_error, table=table, group_size=[16, 32, 64], bits=[4, 8])``"""
    import ipywidgets as widgets
    from IPython.display import display

    controls = {}
    for name, values in choices.items():
        if isinstance(values, (list, tuple)):
            if not values:
                raise ValueError(f"{name} must list at least one value")
            controls[name] = widgets.SelectionSlider(options=list(values),
                                                     value=values[len(values) // 2],
                                                     description=name, continuous_update=False)
    out = widgets.Output()

    def show(change=None) -> None:
        kwargs = {**choices, **{n: c.value for n, c in controls.items()}}
        with out:
            out.clear_output(wait=True)
            fig = plot(**kwargs)
            display(fig)
            plt.close(fig)

    for control in controls.values():
        control.observe(show, names="value")
    show()
    return widgets.VBox([*controls.values(), out])


__all__ = ["block_tables_text", "explore", "memory_explorer", "radix_stepper",
           "serving_explorer"]
