"""The KV cache storage benchmark (``python -m minillm bench kvcache``): what storing keys and
values as bfloat16 or int8 (``EngineConfig.kv_cache_dtype``) costs in accuracy and buys in
memory and serving, on this machine, in one run.

- **accuracy**: perplexity of ``ppl_tokens`` tokens of held-out prose (the Python reference
  manual, :func:`minillm.evaluate.sample_text`) with the float32 model reading its cache back
  from each format (:func:`minillm.evaluate.kv_dtype_perplexity`), so the storage is the only
  change;
- **memory**: bytes per token of each format (int8 with its scales);
- **serving**: one workload (``num_requests`` requests at once, seeded prompt and output
  lengths, greedy, EOS ignored) through the engine in its serving dtype with the same KV memory
  budget (``kv_memory_mib``) in each format: blocks, the most requests running at once,
  preemptions, output tokens/s, the seconds of steps that prefilled and of decode-only steps,
  and the mean decode-only step.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from ..cache.pool import block_bytes
from ..checkpoint.loader import REAL_MODEL, load_model
from ..device import resolve_device, serving_dtype
from ..evaluate import kv_dtype_perplexity, sample_text
from ..runinfo import machine_info
from ..workloads import make_workload
from .common import dtype_name, format_table, log_to_stderr, write_report
from .throughput import loaded_engine, run_minillm

HELP = "KV cache as bfloat16 or int8: perplexity, bytes per token, capacity and throughput"
PPL_FORMATS = ("float32", "bfloat16", "int8")
MiB = 1 << 20


def perplexity_rows(model, tok, n_tokens: int, formats=PPL_FORMATS) -> list[dict]:
    """[{kv_cache_dtype, ppl, ppl_change}] on ``n_tokens`` of held-out prose; the float32
    ``model`` reads its cache from each format (change relative to the first format)."""
    ids = tok.encode(sample_text(n_tokens, tok))[:n_tokens]
    rows = []
    for fmt in formats:
        ppl = kv_dtype_perplexity(model, ids, fmt)
        rows.append({"kv_cache_dtype": fmt, "ppl": ppl, "tokens": len(ids),
                     "ppl_change": ppl / rows[0]["ppl"] - 1 if rows else 0.0})
    return rows


def serving_formats(dtype: torch.dtype) -> tuple[str, ...]:
    """The formats worth serving a ``dtype`` model with: its own, bfloat16 below float32,
    int8."""
    return ("auto", "bfloat16", "int8") if dtype == torch.float32 else ("auto", "int8")


def serving_rows(model, tok, formats, kv_memory: int, num_requests: int, prompt_range,
                 output_range, max_num_seqs: int, seed: int = 0, say=print) -> list[dict]:
    """The workload through one engine per format, each with ``kv_memory`` bytes of KV."""
    work = make_workload(tok, num_requests, prompt_range, output_range, seed)
    rows = []
    for fmt in formats:
        engine = loaded_engine(model, tok, work, kv_cache_dtype=fmt, kv_cache_memory=kv_memory,
                               max_num_seqs=max_num_seqs)
        engine.warmup()
        start = time.perf_counter()
        stats = run_minillm(engine)
        wall = time.perf_counter() - start
        kv = engine.runner.pool.kv_dtype
        per_token = block_bytes(model.cfg, 1, kv)
        rows.append({"kv_cache_dtype": fmt, "stored_as": dtype_name(kv),
                     "bytes_per_token": per_token, "num_blocks": engine.blocks.num_blocks,
                     "token_capacity": engine.blocks.num_blocks * engine.config.block_size,
                     "peak_running": max(len(r.request_ids) for r in engine.trace),
                     "preemptions": stats["preemptions"], "seconds": round(wall, 3),
                     "output_tok_s": work.output_tokens / wall,
                     "prefill_step_seconds": stats["prefill_step_seconds"],
                     "decode_step_seconds": stats["decode_step_seconds"],
                     "decode_ms_per_step": 1e3 * stats["decode_step_seconds"]
                     / max(stats["decode_steps"], 1)})
        say(f"{fmt}: {rows[-1]}")
        del engine
    return rows


def run_kvcache_bench(model_name: str = REAL_MODEL, device: str | None = None,
                      dtype: str | None = None, ppl_tokens: int = 1024,
                      kv_memory_mib: int = 256, num_requests: int = 64,
                      prompt_range=(256, 512), output_range=(64, 128), max_num_seqs: int = 64,
                      seed: int = 0, say=print) -> dict:
    """Both parts; returns the report (JSON-ready)."""
    dev = resolve_device(device)
    dt, reason = serving_dtype(dtype, dev)
    model32, tok = load_model(model_name, device=dev, dtype=torch.float32)
    ppl = perplexity_rows(model32, tok, ppl_tokens)
    say(f"perplexity: {ppl}")
    model = model32 if dt == torch.float32 else model32.to(dt)
    serving = serving_rows(model, tok, serving_formats(dt), kv_memory_mib * MiB, num_requests,
                           prompt_range, output_range, max_num_seqs, seed, say)
    return {"benchmark": "kvcache", "model": model_name, "dtype": dtype_name(dt),
            "dtype_reason": reason, "perplexity": ppl, "serving": serving,
            "workload": {"num_requests": num_requests, "prompt_range": list(prompt_range),
                         "output_range": list(output_range), "max_num_seqs": max_num_seqs,
                         "kv_memory_mib": kv_memory_mib, "seed": seed},
            **machine_info(dev, torch.get_num_threads()),
            "load_average": list(os.getloadavg())}


def kvcache_table(report: dict) -> str:
    """Perplexity per format, then the serving rows."""
    ppl = format_table([("KV stored as", "<13"), ("perplexity", ">11.3f"), ("change", ">8.2%")],
                       [(r["kv_cache_dtype"], r["ppl"], r["ppl_change"])
                        for r in report["perplexity"]])
    serve = format_table([("kv_cache_dtype", "<15"), ("bytes/token", ">12"), ("tokens", ">8"),
                          ("peak running", ">13"), ("preempted", ">10"),
                          ("output tok/s", ">13.1f"), ("decode ms/step", ">15.1f")],
                         [(f"{r['kv_cache_dtype']} ({r['stored_as']})", r["bytes_per_token"],
                           r["token_capacity"], r["peak_running"], r["preemptions"],
                           r["output_tok_s"], r["decode_ms_per_step"])
                          for r in report["serving"]])
    w = report["workload"]
    return (f"{ppl}\n\n{w['num_requests']} requests, {w['kv_memory_mib']} MiB of KV, model in "
            f"{report['dtype']}:\n{serve}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``minillm bench kvcache``'s options (the shared ones: :func:`.common.add_common_args`)."""
    parser.add_argument("--dtype", default=None,
                        help="the serving part's model dtype (default: as minillm.LLM picks)")
    parser.add_argument("--ppl-tokens", type=int, default=1024,
                        help="held-out tokens for perplexity (default: %(default)s)")
    parser.add_argument("--kv-memory-mib", type=int, default=256,
                        help="KV memory of every engine (default: %(default)s)")
    parser.add_argument("--num-requests", type=int, default=64,
                        help="requests (default: %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=64,
                        help="engine batch (default: %(default)s)")


def main(args: argparse.Namespace) -> int:
    """Run ``minillm bench kvcache``; print the tables, write the JSON and the plot."""
    from ..viz.bench import plot_kvcache

    if args.threads:
        torch.set_num_threads(args.threads)
    report = run_kvcache_bench(args.model, args.device, args.dtype, args.ppl_tokens,
                               args.kv_memory_mib, args.num_requests,
                               max_num_seqs=args.max_num_seqs, say=log_to_stderr)
    return write_report(args, report, kvcache_table(report), plot_kvcache)


__all__ = ["perplexity_rows", "run_kvcache_bench", "serving_rows", "kvcache_table"]
