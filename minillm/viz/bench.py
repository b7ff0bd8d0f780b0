"""Plots of the benchmark reports (``python -m minillm bench ...``): each returns a Figure."""
from __future__ import annotations

import matplotlib.pyplot as plt


def plot_decode(report: dict):
    """Bar charts of prefill and decode tokens/s, grouped by dtype, one colour per engine."""

    rows = report["results"]
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    colours = {e: f"C{i}" for i, e in enumerate(engines)}
    width = 0.8 / max(len(engines), 1)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in zip(axes, ("prefill_tok_s", "decode_tok_s"),
                              (f"prefill ({report['prompt_len']}-token prompt)",
                               f"decode (batch 1, {report['new_tokens']} tokens)")):
        for j, dt in enumerate(dtypes):
            group = [r for r in rows if r["dtype"] == dt]  # bars centred on their dtype
            for k, r in enumerate(group):
                x = j + (k - (len(group) - 1) / 2) * width
                bars = ax.bar([x], [r[key]], width, color=colours[r["engine"]],
                              label=r["engine"])
                ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks(range(len(dtypes)), dtypes)
        ax.set_ylabel("tokens / s")
        ax.set_title(title)
    handles, labels = axes[0].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axes[0].legend(unique.values(), unique.keys())
    fig.suptitle(f"{report['model']} on {report['device']} (torch threads={report['threads']})",
                 fontsize=10)
    fig.tight_layout()
    return fig


def plot_throughput(report: dict):
    """Bar chart of output tokens/s per engine."""

    rows = report["results"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar([f"{r['engine']}\n({r['dtype']})" for r in rows],
                  [r["output_tok_s"] for r in rows], color=[f"C{i}" for i in range(len(rows))])
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{report['num_requests']} requests on {report['device']} "
                 f"({report['threads']} threads)", fontsize=10)
    fig.tight_layout()
    return fig


def plot_kvcache(report: dict):
    """KV cache formats: perplexity change (float32 model), bytes per token, and the serving
    run's output tokens/s with the most requests running at once on each bar."""
    ppl, serve = report["perplexity"], report["serving"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    bars = axes[0].bar([r["kv_cache_dtype"] for r in ppl],
                       [100 * r["ppl_change"] for r in ppl], color="C0")
    axes[0].bar_label(bars, labels=[f"{r['ppl']:.3f}" for r in ppl])
    axes[0].set_ylabel(f"perplexity change, % ({ppl[0]['tokens']} tokens)")
    axes[0].set_title("accuracy (labels: perplexity)", fontsize=10)
    axes[0].margins(y=0.15)
    names = [f"{r['kv_cache_dtype']}\n({r['stored_as']})" for r in serve]
    bars = axes[1].bar(names, [r["bytes_per_token"] / 1024 for r in serve], color="C1")
    axes[1].bar_label(bars, fmt="%.1f")
    axes[1].set_ylabel("KiB per token (all layers, K and V)")
    axes[1].set_title("memory", fontsize=10)
    axes[1].margins(y=0.15)
    bars = axes[2].bar(names, [r["output_tok_s"] for r in serve], color="C2")
    axes[2].bar_label(bars, labels=[f"{r['output_tok_s']:.0f} tok/s\n{r['peak_running']} running"
                                    for r in serve], fontsize=8)
    axes[2].set_ylabel("output tokens / s")
    axes[2].margins(y=0.25)
    w = report["workload"]
    axes[2].set_title(f"{w['num_requests']} requests, {w['kv_memory_mib']} MiB of KV, "
                      f"{report['dtype']} model", fontsize=10)
    fig.tight_layout()
    return fig


def plot_spec(report: dict):
    """Speculative decoding: acceptance by draft position (batch 1), speedup vs lookahead k
    (batch 1; only when the report swept k) and speedup vs batch size, one colour per
    method."""
    runs = [r for r in report["runs"] if r["method"] != "none"]
    methods = list(dict.fromkeys(r["method"] for r in runs))
    default = report["config"]["default_k"]
    mixed1 = {m: [r for r in runs if r["method"] == m and r["kind"] == "mixed" and r["batch"] == 1]
              for m in methods}
    swept = any(len({r["k"] for r in rows}) > 1 for rows in mixed1.values())
    fig, axes = plt.subplots(1, 3 if swept else 2, figsize=(15 if swept else 10, 4))
    for i, m in enumerate(methods):
        c = f"C{i}"
        best = max((r for r in mixed1[m] if r["k"] == default.get(m, r["k"])),
                   key=lambda r: r["rounds"], default=None)
        if best and best["acceptance"]:
            acc = best["acceptance"]
            axes[0].plot(range(1, len(acc) + 1), acc, "o-", color=c, label=f"{m} (k={best['k']})")
        if swept:
            sweep = sorted(mixed1[m], key=lambda r: r["k"])
            axes[1].plot([r["k"] for r in sweep], [r["speedup"] for r in sweep], "o-", color=c,
                         label=m)
    speedup_by_batch(axes[-1], report)
    axes[0].set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.02),
                title="acceptance by position (batch 1)")
    if swept:
        axes[1].set(xlabel="lookahead k (tree depth)", ylabel="speedup over no speculation",
                    title="speedup vs k (batch 1)")
        axes[1].axhline(1.0, color="grey", lw=0.8, ls="--")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def spec_colours(report: dict) -> dict[str, str]:
    """One colour per speculative method, in the order of the report's runs."""
    methods = dict.fromkeys(r["method"] for r in report["runs"] if r["method"] != "none")
    return {m: f"C{i}" for i, m in enumerate(methods)}


def log_ticks(ax, values, axis: str = "x") -> None:
    """A log ``axis`` ("x" or "y") labelled at ``values`` only (batch sizes, budgets, rates)."""
    ticks = sorted(set(values))
    getattr(ax, f"set_{axis}scale")("log")
    getattr(ax, f"set_{axis}ticks")(ticks, [f"{v:g}" for v in ticks])
    getattr(ax, f"{axis}axis").set_minor_locator(plt.NullLocator())


def log_ticks_between(ax, lo: float, hi: float, axis: str = "x") -> None:
    """A log ``axis`` labelled at the 1-2-5 values between ``lo`` and ``hi`` (e.g. ms)."""
    nice = [m * 10 ** e for e in range(-3, 7) for m in (1, 2, 5)]
    log_ticks(ax, [v for v in nice if lo / 1.5 <= v <= hi * 1.5] or [lo, hi], axis)


def speedup_by_batch(ax, report: dict) -> None:
    """Speedup over the plain engine at the same batch size (default k, all kinds), one line
    per method, on ``ax``."""
    default = report["config"]["default_k"]
    for m, c in spec_colours(report).items():
        runs = sorted((r for r in report["runs"] if r["method"] == m and r["kind"] == "mixed"
                       and r["k"] == default.get(m, r["k"])), key=lambda r: r["batch"])
        ax.plot([r["batch"] for r in runs], [r["speedup"] for r in runs], "o-", color=c, label=m)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="batch size", ylabel="speedup over no speculation",
           title="speedup vs batch size")
    log_ticks(ax, [r["batch"] for r in report["runs"]])


def plot_spec_load(report: dict):
    """Speculation under load (``report["load"]`` of ``bench spec``). Top: speedup vs batch
    size; tokens per round vs the verification budget (draft tokens per sequence per round);
    the drafters' ms per round at batch 1 against the plain engine's ms per token. Bottom, vs
    the Poisson request rate: the throughput speedup, the latency speedup (plain mean latency
    / its own; the break-even is where it crosses 1) and the mean latency (the plain engine in
    black; DSpark's budgets share a colour, the larger one dashed)."""
    load = report["load"]
    colours = spec_colours(report)
    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    speedup_by_batch(axes[0, 0], report)
    for m, c in colours.items():
        rows = sorted((r for r in load["equal_budget"] if r["method"] == m),
                      key=lambda r: r["budget"])
        axes[0, 1].plot([r["budget"] for r in rows], [r["mean_accepted"] for r in rows], "o-",
                        color=c, label=m)
    axes[0, 1].set(xlabel="draft tokens verified per sequence per round",
                   ylabel="tokens per round", title="acceptance length at equal budgets")
    log_ticks(axes[0, 1], load["config"]["budgets"])
    draw_drafter_cost(axes[0, 2], report.get("drafter_cost", []), colours)
    dashed = {r["label"] for r in load["rates"] if r.get("verify_budget", 0) >
              load["config"]["max_num_seqs"]}
    for label in dict.fromkeys(r["label"] for r in load["rates"]):
        rows = sorted((r for r in load["rates"] if r["label"] == label), key=lambda r: r["rate"])
        style = dict(color=colours.get(rows[0]["method"], "black"), label=label,
                     ls="--" if label in dashed else "-", marker="o")
        rates = [r["rate"] for r in rows]
        if rows[0]["method"] != "none":
            axes[1, 0].plot(rates, [r["speedup"] for r in rows], **style)
            axes[1, 1].plot(rates, [r["latency_speedup"] for r in rows], **style)
        axes[1, 2].plot(rates, [r["latency"] for r in rows], **style)
    n, t = load["config"]["num_requests"], load["config"]["max_tokens"]
    axes[1, 0].set(ylabel="output tokens/s over no speculation",
                   title=f"throughput speedup ({n} requests, {t} tokens)")
    axes[1, 1].set(ylabel="plain mean latency / its own", title="latency speedup")
    axes[1, 2].set(ylabel="mean end-to-end latency (s)", title="latency")
    for ax in axes[1]:
        ax.set_xlabel("requests / s (Poisson arrivals)")
        log_ticks(ax, load["config"]["rates"])
    for ax in axes[1, :2]:
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def draw_drafter_cost(ax, costs: list[dict], colours: dict[str, str]) -> None:
    """Bars: each drafter's ms per round at batch 1 (``drafter_cost`` of the spec report); a
    dashed line: the plain engine's ms per token."""
    bars = ax.bar([c["method"] for c in costs], [c["draft_ms_per_round"] for c in costs],
                  color=[colours.get(c["method"], "grey") for c in costs])
    ax.bar_label(bars, fmt="%.1f", fontsize=7)
    if costs:
        ax.axhline(costs[0]["plain_ms_per_token"], color="black", lw=0.8, ls="--",
                   label="plain engine, ms per token")
    ax.tick_params(axis="x", labelrotation=45)
    ax.set(ylabel="ms", title="drafter time per round (batch 1)")


def plot_chunked(report: dict):
    """Chunked prefill against prefill_first and decode_first (``bench chunked``). Top: the
    CDF of the running requests' inter-token latency (log ms); the long prompts' TTFT (p50,
    p90, max; log s); output tokens/s. Bottom: each run's steps on the virtual clock, coloured
    by what they computed (decodes only, prompts only, both), the long prompts' arrivals
    as ticks."""
    runs = report["runs"]
    colours = {r["label"]: f"C{i}" for i, r in enumerate(runs)}
    fig = plt.figure(figsize=(15, 8))
    grid = fig.add_gridspec(2, 3, height_ratios=[1.0, 0.8])
    cdf, ttft, tput = (fig.add_subplot(grid[0, i]) for i in range(3))
    timeline = fig.add_subplot(grid[1, :])
    for r in runs:
        q = r["itl"]["quantiles"]
        cdf.plot([1e3 * v for v in q], [i / (len(q) - 1) for i in range(len(q))],
                 color=colours[r["label"]], label=r["label"])
    cdf.axhline(0.99, color="grey", lw=0.8, ls="--")
    gaps = [1e3 * v for r in runs for v in r["itl"]["quantiles"]]
    log_ticks_between(cdf, min(gaps), max(gaps))
    cdf.set(xlabel="inter-token latency (ms)", ylabel="fraction of gaps",
            title=f"ITL of the {report['config']['num_decodes']} running requests")
    width = 0.8 / len(runs)
    for i, r in enumerate(runs):
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(3)]
        ttft.bar(xs, [r["ttft_long"][k] for k in ("p50", "p90", "max")], width,
                 color=colours[r["label"]], label=r["label"])
    ttft.set_xticks(range(3), ["p50", "p90", "max"])
    ttft.set_yscale("log")
    ttft.set(ylabel="seconds", title=f"TTFT of the {report['config']['num_long']} long prompts")
    bars = tput.bar([r["label"].replace(" ", "\n") for r in runs],
                    [r["output_tok_s"] for r in runs], color=[colours[r["label"]] for r in runs])
    tput.bar_label(bars, fmt="%.0f", fontsize=8)
    tput.set(ylabel="output tokens / s", title="throughput over the makespan")
    kinds = {"decodes only": "C0", "prompts only": "C3", "both": "C2"}
    for row, r in enumerate(runs):
        spans = {k: [] for k in kinds}
        for s in r["timeline"]:
            kind = "both" if s["prefill"] and s["decode"] else \
                "prompts only" if s["prefill"] else "decodes only"
            spans[kind].append((s["start"], s["end"] - s["start"]))
        for kind, c in kinds.items():
            timeline.broken_barh(spans[kind], (row - 0.4, 0.8), color=c,
                                 label=kind if row == 0 else None)
    arrivals = report["config"]["long_arrivals_s"]
    timeline.vlines(arrivals, -0.5, len(runs) - 0.5, color="black", lw=0.8, ls=":",
                    label="long prompt arrives")
    timeline.set_yticks(range(len(runs)), [r["label"] for r in runs])
    timeline.invert_yaxis()
    timeline.set(xlabel="virtual clock (s)", title="steps")
    timeline.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4)
    cdf.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_disagg(report: dict):
    """Colocated vs 1P1D: TTFT and TPOT (p50 bars, p90 ticks), the requests meeting both
    SLOs per second, and per pair the KV
    transfer time split into hidden and exposed."""
    import matplotlib.pyplot as plt

    runs = report["runs"]
    names = list(runs)
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.4))
    for ax, what, scale, unit in ((axes[0], "ttft", 1, "s"), (axes[1], "tpot", 1e3, "ms")):
        p50 = [runs[n][f"{what}_p50"] * scale for n in names]
        p90 = [runs[n][f"{what}_p90"] * scale for n in names]
        ax.bar(names, p50, color="#4c72b0", label="p50")
        ax.scatter(names, p90, color="black", marker="_", s=400, label="p90")
        ax.set_title(f"{what.upper()} ({unit})")
        ax.legend(fontsize=8)
    axes[2].bar(names, [runs[n]["slo_met_per_s"] for n in names], color="#55a868")
    axes[2].set_title(f"requests meeting both SLOs per s\n(TTFT <= {report['slo']['ttft_s']} s, "
                      f"TPOT <= {report['slo']['tpot_s']} s)", fontsize=9)
    pairs = [n for n in names if runs[n].get("requests")]
    exposed = [runs[n]["exposed_s_mean"] * 1e3 for n in pairs]
    hidden = [(runs[n]["transfer_s_mean"] - runs[n]["exposed_s_mean"]) * 1e3 for n in pairs]
    axes[3].bar(pairs, exposed, color="#c44e52", label="exposed")
    axes[3].bar(pairs, hidden, bottom=exposed, color="#8172b2", label="hidden")
    axes[3].set_title("KV transfer per request (ms)")
    axes[3].legend(fontsize=8)
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8, rotation=15)
    fig.tight_layout()
    return fig


def plot_prefix(report: dict):
    """Prefix caching and offload: one panel per part of the report that is present (TTFT on
    the shared prompt per cache kind; TTFT and hit rate against pool size; multi-turn hit rates;
    the tiers' TTFT and traffic; CacheBlend's TTFT and quality)."""
    import matplotlib.pyplot as plt

    panels = [(key, fn) for key, fn in (("shared_prompt", _prefix_shared),
                                        ("cache_size", _prefix_sizes),
                                        ("multi_turn", _prefix_turns), ("tiers", plot_tier_ttft_on),
                                        ("tiers", plot_tier_traffic_on),
                                        ("blend", plot_blend_on)) if key in report]
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.9 * rows), squeeze=False)
    for ax, (key, fn) in zip(axes.flat, panels):
        fn(ax, report[key])
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def _prefix_shared(ax, shared: dict) -> None:
    rates = list(shared)
    for j, (kind, colour) in enumerate((("none", "#c44e52"), ("hash", "#4c72b0"),
                                         ("radix", "#55a868"))):
        ax.bar([i + 0.27 * (j - 1) for i in range(len(rates))],
               [shared[r][kind]["ttft_mean"] * 1e3 for r in rates], 0.27, color=colour,
               label=kind)
    ax.set_xticks(range(len(rates)), [f"{r} req/s" for r in rates])
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("shared system prompt: mean TTFT (ms)", fontsize=9)


def _prefix_sizes(ax, sizes: dict) -> None:
    n = [int(k) for k in sizes]
    ax.plot(n, [r["ttft_mean"] * 1e3 for r in sizes.values()], "o-", label="TTFT ms")
    ax.set_xscale("log")
    ax.set_xlabel("KV pool blocks")
    ax.set_ylabel("mean TTFT (ms)")
    twin = ax.twinx()
    twin.plot(n, [r["hit_rate"] for r in sizes.values()], "s--", color="#dd8452")
    twin.set_ylabel("hit rate")
    ax.set_title("hash cache: TTFT and hit rate vs pool size", fontsize=9)


def _prefix_turns(ax, turns: dict) -> None:
    ax.bar(list(turns), [r["hit_rate"] for r in turns.values()], color="#8172b2")
    ax.set_title("multi-turn chat: prompt tokens found cached", fontsize=9)


def tier_traffic(run: dict) -> dict[str, float]:
    """MiB each tier boundary carried in one tiers run (0 where a tier is absent)."""
    st = run.get("store", {})
    disk = st.get("disk", {})
    mib = 1 / (1 << 20)
    return {"device -> CPU": st.get("device_to_cpu_bytes", 0) * mib,
            "CPU -> disk": disk.get("bytes_in", 0) * mib,
            "disk -> CPU": disk.get("bytes_out", 0) * mib,
            "store -> device": st.get("store_to_device_bytes", 0) * mib}


def _tier_names(ax, names: list[str]) -> None:
    ax.set_xticks(range(len(names)), [n.replace(", ", ",\n").replace(": ", ":\n")
                                      for n in names], fontsize=8)


def plot_tier_ttft_on(ax, tiers: dict) -> None:
    """Per tiers configuration: the mean TTFT (ms), each bar labelled with its value."""
    runs = tiers["runs"]
    bars = ax.bar(range(len(runs)), [r["ttft_mean"] * 1e3 for r in runs.values()],
                  color="#999999")
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.margins(y=0.12)
    ax.set_ylabel("mean TTFT (ms)")
    _tier_names(ax, list(runs))
    ax.set_title(f"tiered store: {tiers['num_prompts']} prompts in turn, the device holds "
                 f"{tiers['device_prompts']}", fontsize=9)


def plot_tier_traffic_on(ax, tiers: dict) -> None:
    """Per tiers configuration: the MiB each tier boundary carried, one bar per boundary."""
    runs = tiers["runs"]
    edges = list(tier_traffic({}))
    width = 0.8 / len(edges)
    for i, edge in enumerate(edges):
        xs = [j + (i - (len(edges) - 1) / 2) * width for j in range(len(runs))]
        ax.bar(xs, [tier_traffic(r)[edge] for r in runs.values()], width, label=edge)
    ax.set_ylabel("MiB moved")
    _tier_names(ax, list(runs))
    ax.legend(fontsize=8, frameon=False)
    ax.set_title("KV moved across each tier boundary", fontsize=9)


def plot_blend_on(ax, blend: dict) -> None:
    """Per prefill method: TTFT lower than full recompute (x) against answer quality."""
    for i, (name, m) in enumerate(blend["methods"].items()):
        ax.scatter(m["ttft_ratio"], m["token_match"], s=30)
        ax.annotate(name.replace("CacheBlend ", "blend "), (m["ttft_ratio"], m["token_match"]),
                    fontsize=7, xytext=(4, -10 * (i % 3)), textcoords="offset points")
    ax.set_xlabel("TTFT lower than full recompute (x)")
    ax.set_ylabel("answer tokens matching full recompute")
    ax.set_title(f"CacheBlend: {blend['per_query']} passages of {blend['passage_tokens']} "
                 f"tokens, reordered", fontsize=9)


MARKERS = "os^Dv"    # one per server, so that equal values stay visible
LEGEND_BELOW = (0, 0.07, 1, 1)    # tight_layout's rect: room for a figure legend underneath


def plot_serve(report: dict):
    """The serving sweep: TTFT and TPOT (p50 solid, p99 dashed; log scale, a saturated server's
    queue puts them far above the SLO line) and output tokens/s against the request rate, one
    colour and marker per server; one legend under the panels."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    servers = {n: s["runs"] for n, s in report["servers"].items() if s.get("runs")}
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.9))
    for i, runs in enumerate(servers.values()):
        rates = [r["rate"] for r in runs]
        style = dict(marker=MARKERS[i % len(MARKERS)], color=f"C{i}", alpha=0.85)
        for ax, what, scale in ((axes[0], "ttft", 1), (axes[1], "tpot", 1e3)):
            for q, line in (("p50", "-"), ("p99", "--")):
                ax.plot(rates, [(r[f"{what}_{q}"] or float("nan")) * scale for r in runs], line,
                        **style)
        axes[2].plot(rates, [r["output_tok_s"] for r in runs], **style)
    slo = report["slo"]
    for ax, title, limit in ((axes[0], "TTFT (s)", slo["ttft_s"]),
                             (axes[1], "TPOT (ms)", slo["tpot_s"] * 1e3),
                             (axes[2], "output tokens / s", None)):
        if limit is not None:
            ax.axhline(limit, color="grey", lw=0.8, ls=":")
            values = [v for line in ax.get_lines() for v in line.get_ydata() if v == v and v > 0]
            log_ticks_between(ax, min(values), max(values), "y")
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=f"C{i}", marker=MARKERS[i % len(MARKERS)], label=name)
               for i, name in enumerate(servers)]
    handles += [Line2D([], [], color="black", ls=ls, label=label) for ls, label in
                (("-", "p50"), ("--", "p99"), (":", "SLO"))]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False,
               fontsize=9)
    w = report["workload"]
    fig.suptitle(f"{w['num_requests']} requests per rate on {report['machine']['device']} "
                 f"({report['machine']['threads']} threads)", fontsize=10)
    fig.tight_layout(rect=LEGEND_BELOW)
    return fig

