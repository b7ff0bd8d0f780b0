"""The runtime benchmark (``python -m minillm bench runtime``; appendix C).

Part 1, batch-1 decode with every option the package has, against llama.cpp in the same run:
each *config* names the weights (``fp32``, ``bf16``, ``int8``, ``int4``: group-wise, g32),
optionally the activation dtype of a quantized model (``int4@bf16``; default float32) and how
the step runs: eager :func:`minillm.generate.generate`, ``+compile`` (a
:class:`~minillm.runtime.StaticDecoder` under ``torch.compile``), ``+graphs`` (its step
captured as a CUDA graph; CUDA only; ``+compile+graphs`` both) or ``+engine`` (the serving
engine, :class:`~minillm.engine.LLMEngine`, one request: on the CPU its fused fast path).
Decode tokens/s = (new_tokens - 1) / (generate time - prefill time), greedy, EOS ignored; one
warm-up (which compiles), then the median of ``repeats`` rounds in which all configs take turns
(:func:`~minillm.bench.common.median_times`). llama.cpp runs the GGUF file's Q4_1 weights.

Each batch-1 row also records the bytes a decode step reads (the weights of every linear as
stored, :func:`minillm.quant.quantize.weight_bytes`, or the GGUF file for llama.cpp, plus the
KV cache at the run's mean context) and its *roofline fraction*: those bytes at the memory
bandwidth this process measures (:func:`~minillm.bench.common.read_bandwidth`) over the
measured step time, 1.0 being as fast as memory allows.

Part 2 (``batch_sizes``), the decode step alone at several batch sizes: ms per step of the
eager static step and of each compiled/captured config, batches padded to the next captured
size (:func:`~minillm.runtime.pad_to_captured`).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..checkpoint.gguf import find_smollm2_gguf
from ..checkpoint.loader import REAL_MODEL, load_model
from ..config import SamplingParams
from ..device import resolve_device, sync
from ..engine import EngineConfig, LLMEngine
from ..model.transformer import Transformer
from ..quant.quantize import quantize_model, weight_bytes
from ..runinfo import available_cores, machine_info
from ..runtime import StaticDecoder, capture_sizes
from .common import (
    Runner,
    bench_prompt,
    dtype_name,
    format_table,
    llama_cpp_available,
    llama_cpp_runner,
    log_to_stderr,
    median_times,
    minillm_runner,
    rates,
    read_bandwidth,
    write_report,
)
from .decode import common_prefix

WEIGHTS = ("fp32", "bf16", "int8", "int4")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CPU_CONFIGS = ("fp32", "bf16", "fp32+compile", "bf16+compile", "int8", "int8+compile",
               "int4", "int4+compile", "bf16+engine", "int8@bf16+engine", "int4@bf16+engine")
GPU_CONFIGS = ("bf16", "bf16+compile", "bf16+graphs", "bf16+compile+graphs")


@dataclass(frozen=True)
class Config:
    """One way to run the decode step."""

    name: str
    weights: str
    dtype: torch.dtype
    compile: bool
    graphs: bool
    engine: bool = False


def parse_config(name: str) -> Config:
    """``WEIGHTS[@ACT][+compile][+graphs]`` or ``WEIGHTS[@ACT]+engine`` -> Config (ValueError
    naming ``configs``)."""
    head, *flags = name.split("+")
    weights, _, act = head.partition("@")
    bad = set(flags) - {"compile", "graphs", "engine"}
    if weights not in WEIGHTS or bad or (act and act not in DTYPES) \
            or ("engine" in flags and len(flags) > 1):
        raise ValueError(f"configs: {name!r} is not WEIGHTS[@fp32|@bf16][+compile][+graphs] "
                         f"or WEIGHTS[@fp32|@bf16]+engine with WEIGHTS one of {list(WEIGHTS)}")
    if act and weights in DTYPES:
        raise ValueError(f"configs: {name!r}: @dtype applies to int8/int4 weights only")
    dtype = DTYPES.get(weights) or DTYPES[act or "fp32"]
    return Config(name, weights, dtype, "compile" in flags, "graphs" in flags, "engine" in flags)


def build_model(model_name: str, cfg: Config, device: torch.device,
                random_weights: bool = False) -> Transformer:
    model, _ = load_model(model_name, device=device, dtype=cfg.dtype,
                          random_weights=random_weights)
    if cfg.weights in ("int8", "int4"):
        quantize_model(model, cfg.weights)
    return model


def decoder_runner(model: Transformer, cfg: Config, prompt: list[int], new_tokens: int
                   ) -> tuple[Runner, StaticDecoder]:
    """A Runner over a StaticDecoder (compiled and/or captured at batch 1)."""
    dec = StaticDecoder(model, max_len=len(prompt) + new_tokens, compile=cfg.compile,
                        cuda_graph_sizes=[1] if cfg.graphs else None)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    out: list[int] = []

    def run() -> None:
        out[:] = dec.generate(prompt, params)

    runner = Runner(cfg.name, dtype_name(model.dtype), lambda: dec.prefill(0, prompt), run,
                    out)
    return runner, dec


def engine_runner(model: Transformer, cfg: Config, prompt: list[int], new_tokens: int
                  ) -> Runner:
    """A Runner over :class:`~minillm.engine.LLMEngine` serving one request at a time: the
    prefill is a request for one token, the generate one for ``new_tokens`` (greedy)."""
    engine = LLMEngine(model, None, EngineConfig())
    engine.warmup()
    out: list[int] = []

    def serve(max_tokens: int) -> list[int]:
        rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                        ignore_eos=True))
        done: list[int] = []
        while engine.has_unfinished():
            done += [t for o in engine.step() if o.request_id == rid and o.finished
                     for t in o.token_ids]
        return done

    def run() -> None:
        out[:] = serve(new_tokens)

    return Runner(cfg.name, dtype_name(model.dtype), lambda: serve(1), run, out)


@dataclass
class RuntimeResult:
    config: str
    weights: str
    dtype: str
    compiled: bool
    graphs: bool
    decode_tok_s: float
    step_ms: float
    compile_s: float
    same_tokens: int
    note: str = ""
    bytes_per_token: int = 0
    roofline_fraction: float | None = None


def batch_1(model_name: str, configs: Sequence[Config], prompt: list[int], new_tokens: int,
            repeats: int, dev: torch.device, threads: int, llama: bool,
            say: Callable[[str], None], random_weights: bool = False
            ) -> tuple[list[RuntimeResult], float | None]:
    """Part 1: every config (and llama.cpp) at batch 1, interleaved; and the memory read
    bandwidth (bytes/s, on a CPU) its roofline fractions use."""
    runners, decoders, read = [], [], []
    context = len(prompt) + new_tokens // 2          # the mean context of a decode step
    for cfg in configs:
        say(f"building {cfg.name} ...")
        model = build_model(model_name, cfg, dev, random_weights)
        shape = model.cfg
        read.append(weight_bytes(model) + context * shape.kv_bytes_per_token(
            model.dtype.itemsize))
        if cfg.engine:
            runner, dec = engine_runner(model, cfg, prompt, new_tokens), None
        elif cfg.compile or cfg.graphs:
            runner, dec = decoder_runner(model, cfg, prompt, new_tokens)
        else:
            runner, dec = minillm_runner(model, prompt, new_tokens), None
            runner.engine = cfg.name
        runners.append(runner)
        decoders.append(dec)
    if llama:
        gguf = find_smollm2_gguf() if model_name == REAL_MODEL else Path(model_name)
        runners.append(llama_cpp_runner(gguf, prompt, new_tokens, threads))
        read.append(gguf.stat().st_size + context * shape.kv_bytes_per_token(2))  # f16 KV
    say("timing " + ", ".join(r.engine for r in runners) + " ...")
    times = median_times(runners, repeats, dev)
    bandwidth = read_bandwidth() if dev.type == "cpu" else None
    ref = runners[0].output
    out = []
    for i, (r, (p_s, g_s)) in enumerate(zip(runners, times)):
        tok_s = rates(len(prompt), new_tokens, p_s, g_s)[1]
        cfg = configs[i] if i < len(configs) else None
        dec = decoders[i] if cfg else None
        same = common_prefix(ref, r.output)
        out.append(RuntimeResult(r.engine, cfg.weights if cfg else "Q4_1", r.dtype,
                                 bool(cfg and cfg.compile), bool(cfg and cfg.graphs), tok_s,
                                 1e3 / tok_s, dec.compile_seconds if dec else 0.0, same,
                                 r.note, int(read[i]),
                                 read[i] / bandwidth * tok_s if bandwidth else None))
    return out, bandwidth


def step_ms(dec: StaticDecoder, batch: int, prompt: list[int], steps: int, repeats: int
            ) -> float:
    """Median ms of one decode step of ``batch`` rows (after a prefill of each row)."""
    for row in range(batch):
        dec.prefill(row, prompt)
    pos, tokens = [len(prompt)] * batch, [1] * batch
    dec.decode(tokens, pos)  # warm-up (compiles this size)
    times = []
    for _ in range(repeats):
        sync(dec.device)
        start = time.perf_counter()
        for i in range(steps):
            dec.decode(tokens, [p + 1 + i for p in pos])
        sync(dec.device)
        times.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(times)


def batch_sweep(model_name: str, configs: Sequence[Config], batch_sizes: Sequence[int],
                prompt: list[int], steps: int, repeats: int, dev: torch.device,
                say: Callable[[str], None], random_weights: bool = False) -> list[dict]:
    """Part 2: ms per decode step at each batch size, the eager static step first."""
    rows = []
    sizes = capture_sizes(max(batch_sizes))
    max_len = len(prompt) + steps * (repeats + 1) + 2
    heads = dict.fromkeys(c.name.split("+")[0] for c in configs)
    plan = [parse_config(h) for h in heads] + [c for c in configs if c.compile or c.graphs]
    for cfg in plan:
        say(f"batch sweep: {cfg.name} ...")
        model = build_model(model_name, cfg, dev, random_weights)
        dec = StaticDecoder(model, max_len=max_len, max_batch=max(batch_sizes),
                            compile=cfg.compile,
                            cuda_graph_sizes=sizes if cfg.graphs else None)
        for b in batch_sizes:
            ms = step_ms(dec, b, prompt, steps, repeats)
            rows.append({"config": cfg.name, "batch": b, "step_ms": ms,
                         "tok_s": b / ms * 1e3, "padded_to": dec.padded_size(b)})
        del model, dec
    return rows


def run_runtime_bench(model_name: str = REAL_MODEL, configs: Sequence[str] | None = None,
                      prompt_len: int = 128, new_tokens: int = 64, repeats: int = 3,
                      batch_sizes: Sequence[int] = (), device: str | torch.device | None = None,
                      threads: int | None = None, llama: bool = True,
                      log: Callable[[str], None] | None = print,
                      random_weights: bool = False) -> dict:
    """Both parts; the JSON-ready report (``configs`` default: CPU_CONFIGS or GPU_CONFIGS).
    ``random_weights``: the model's shape with seeded random weights (where the file is not)."""
    dev = resolve_device(device)
    cfgs = [parse_config(c) for c in (configs or (GPU_CONFIGS if dev.type == "cuda"
                                                  else CPU_CONFIGS))]
    if any(c.graphs for c in cfgs) and dev.type != "cuda":
        raise ValueError("configs: +graphs needs --device cuda")
    if prompt_len < 1 or new_tokens < 2 or repeats < 1:
        raise ValueError("prompt_len >= 1, new_tokens >= 2 and repeats >= 1 are required")
    threads = threads or available_cores()
    torch.set_num_threads(threads)
    say = log or (lambda _msg: None)
    load_at_start = os.getloadavg()[0]
    model, tok = load_model(model_name, device=dev, random_weights=random_weights)
    prompt = bench_prompt(tok, model.cfg.vocab_size, prompt_len)
    del model
    use_llama = llama and dev.type == "cpu" and llama_cpp_available() and (
        model_name == REAL_MODEL or str(model_name).endswith(".gguf"))
    if llama and not use_llama:
        say("llama.cpp skipped: needs the CPU, llama_cpp and a GGUF model")
    results, bandwidth = batch_1(model_name, cfgs, prompt, new_tokens, repeats, dev, threads,
                                 use_llama, say, random_weights)
    sweep = batch_sweep(model_name, cfgs, batch_sizes, prompt, 16, repeats, dev, say,
                        random_weights) if batch_sizes else []
    return {"benchmark": "runtime", "model": str(model_name), "prompt_len": prompt_len,
            "new_tokens": new_tokens, "repeats": repeats, "random_weights": random_weights,
            **machine_info(dev, threads),
            "load_average": [load_at_start, os.getloadavg()[0]],
            "method": "batch-1 decode tok/s = (new_tokens-1)/(generate - prefill), greedy, "
                      "EOS ignored, one warm-up (compiles) then the median of `repeats` "
                      "interleaved rounds; batch sweep: median ms of 16 decode steps",
            "read_bandwidth_gb_s": bandwidth / 1e9 if bandwidth else None,
            "results": [asdict(r) for r in results], "batch_sweep": sweep}


def runtime_table(report: dict) -> str:
    """Part 1 as a table, with each config's ratio to llama.cpp and to the first config."""
    rows = report["results"]
    base = rows[0]["decode_tok_s"]
    llama = next((r["decode_tok_s"] for r in rows if r["config"] == "llama.cpp"), None)
    table = format_table(
        [("config", "<22"), ("dtype", "<9"), ("decode tok/s", ">13.1f"), ("ms/token", ">9.1f"),
         ("x first", ">8.2f"), ("x llama.cpp", ">12"), ("compile s", ">10.1f"),
         ("same tokens", ">12"), ("MB/token", ">9.1f"), ("roofline", ">9")],
        [(r["config"], r["dtype"], r["decode_tok_s"], r["step_ms"], r["decode_tok_s"] / base,
          f"{r['decode_tok_s'] / llama:.2f}" if llama else "-", r["compile_s"],
          f"{r['same_tokens']}/{report['new_tokens']}", r.get("bytes_per_token", 0) / 1e6,
          f"{r['roofline_fraction']:.0%}" if r.get("roofline_fraction") else "-")
         for r in rows])
    lines = [table]
    if report.get("read_bandwidth_gb_s"):
        lines.append(f"roofline: bytes a decode step reads (weights as stored + KV) at the "
                     f"measured {report['read_bandwidth_gb_s']:.1f} GB/s, over the step time")
    for r in report.get("batch_sweep", []):
        lines.append(f"batch {r['batch']:>3} {r['config']:<24} {r['step_ms']:8.2f} ms/step "
                     f"{r['tok_s']:8.1f} tok/s (padded to {r['padded_to']})")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line

HELP = ("batch-1 decode eager / compiled / CUDA graphs / int8 / int4 vs llama.cpp; decode step "
        "time by batch size")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``minillm bench runtime``'s options (the shared ones: :func:`.common.add_common_args`)."""
    parser.add_argument("--configs", nargs="+", default=None,
                        help="WEIGHTS[@fp32|@bf16][+compile][+graphs] or "
                             "WEIGHTS[@fp32|@bf16]+engine, WEIGHTS fp32, bf16, int8 or int4 "
                             "(default: a CPU or a GPU set)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default: 128)")
    parser.add_argument("--new-tokens", type=int, default=64,
                        help="tokens generated (default: 64)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; median (default: 3)")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[],
                        help="also time the decode step at these batch sizes")
    parser.add_argument("--no-llama", action="store_true", help="skip llama.cpp")


def main(args: argparse.Namespace) -> int:
    """Run ``minillm bench runtime``; print the table, write the JSON and the plot."""
    from ..viz.a3 import plot_runtime

    report = run_runtime_bench(args.model, args.configs, args.prompt_len, args.new_tokens,
                               args.repeats, args.batch_sizes, args.device, args.threads,
                               llama=not args.no_llama, log=log_to_stderr)
    return write_report(args, report, runtime_table(report), plot_runtime)
