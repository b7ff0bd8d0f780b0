"""``python -m minillm bench quant``: perplexity and batch-1 decode speed of every format, one run.

For the real model at ``dtype`` (bf16 by default) and each quantization spec ("int8", "int4",
"gptq:64", ... ``method[:group_size]``): quantize a copy, score perplexity on held-out prose
(:func:`minillm.evaluate.sample_ids`, one forward pass, disjoint from the calibration text), then
time prefill and greedy decode. The models take turns in every timing round
(:func:`minillm.bench.common.median_times`), so a busy spell on a shared machine slows all
alike, and speed-ups are ratios measured side by side.

    report = run_quant_bench()
    write_json(report, "benchmarks/results/quant.json")
"""
from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable, Sequence

import torch

from ..checkpoint.loader import REAL_MODEL, load_model
from ..device import resolve_device
from ..evaluate import perplexity, sample_ids
from ..quant.ggml_blocks import BLOCKS, bits_per_weight
from ..quant.linear import DequantizedLinear, Int4Linear, Int8Linear
from ..quant.quantize import (
    DEFAULT_GROUP_SIZE,
    INT4_METHODS,
    check_method,
    quantize_model,
    weight_bytes,
)
from ..runinfo import machine_info
from .common import (
    bench_prompt,
    format_table,
    log_to_stderr,
    median_times,
    minillm_runner,
    rates,
    write_report,
)

DEFAULT_SPECS = ("int8", "int4", "gptq", "awq", "hqq", "int4:64", "hqq:64", "q8_0", "q4_1",
                 "q4_k")


def parse_spec(spec: str) -> tuple[str, int]:
    """"gptq:64" -> ("gptq", 64); "int8" -> ("int8", DEFAULT_GROUP_SIZE)."""
    method, _, g = spec.partition(":")
    check_method(method)
    if g and method not in INT4_METHODS:
        raise ValueError(f"a group size applies to {list(INT4_METHODS)} only, got {spec!r}")
    try:
        return method, int(g) if g else DEFAULT_GROUP_SIZE
    except ValueError:
        raise ValueError(f"group size in {spec!r} must be an integer") from None


def describe(model: torch.nn.Module) -> tuple[str, float]:
    """(kernel used by the block linears, mean stored bits per block weight)."""
    kinds, bits, n = set(), 0.0, 0
    for layer in model.layers:
        for m in layer.modules():
            if isinstance(m, Int8Linear):
                kinds.add("int8 packed")
                bits += m.q.numel() * (8 + 32 / m.in_features)
            elif isinstance(m, Int4Linear):
                kinds.add(f"int4 packed g{m.group_size}")
                bits += m.packed.numel() * 2 * (4 + 2 * 16 / m.group_size)
            elif isinstance(m, DequantizedLinear):
                kinds.add(f"{m.fmt} decoded to float")
                bits += m.weight.numel() * bits_per_weight(m.fmt)
            elif isinstance(m, torch.nn.Linear):
                kinds.add("float")
                bits += m.weight.numel() * m.weight.element_size() * 8
            else:
                continue
            n += m.in_features * m.out_features
    return ", ".join(sorted(kinds)), bits / max(n, 1)


def run_quant_bench(model_name: str = REAL_MODEL, specs: Sequence[str] = DEFAULT_SPECS,
                    dtype: str = "bfloat16", eval_tokens: int = 512, prompt_len: int = 64,
                    new_tokens: int = 32, repeats: int = 3, device: str | None = None,
                    threads: int | None = None, include_fp32: bool = True,
                    log: Callable[[str], None] | None = None) -> dict:
    """Quantize, score and time every spec against the float model; return the report."""
    say = log or (lambda _msg: None)
    parsed = [(s, *parse_spec(s)) for s in specs]
    dev = resolve_device(device)
    if threads:
        torch.set_num_threads(threads)
    base, tok = load_model(model_name, device=dev, dtype=dtype)
    if tok is None:
        raise ValueError(f"model {model_name!r} has no tokenizer: perplexity needs text")
    ids = sample_ids(eval_tokens, tok)
    prompt = bench_prompt(tok, base.cfg.vocab_size, prompt_len)
    label = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[base.dtype]
    models: list[tuple[str, str, int | None, torch.nn.Module, float]] = [
        (label, "none", None, base, 0.0)]
    if include_fp32 and base.dtype != torch.float32:
        models.append(("fp32", "none", None, load_model(model_name, device=dev,
                                                        dtype="float32")[0], 0.0))
    for spec, method, group in parsed:
        say(f"quantizing {spec} ...")
        t0 = time.perf_counter()
        q = quantize_model(copy.deepcopy(base), method, group_size=group, tokenizer=tok)
        models.append((spec, method, group if method in INT4_METHODS else None, q,
                       time.perf_counter() - t0))
    rows = []
    for name, method, group, model, qs in models:
        say(f"perplexity of {name} ...")
        kernel, bits = describe(model)
        rows.append({"name": name, "method": method, "group_size": group,
                     "bits_per_weight": round(bits, 3),
                     "weight_mb": round(weight_bytes(model) / 1e6, 1),
                     "ppl": perplexity(model, ids, prefill=len(ids)), "kernel": kernel,
                     "quantize_s": round(qs, 1)})
    say(f"timing decode of {len(models)} models, taking turns ...")
    runners = [minillm_runner(m, prompt, new_tokens) for *_, m, _ in models]
    for (pre, gen), row in zip(median_times(runners, repeats, dev), rows):
        row["prefill_tok_s"], row["decode_tok_s"] = rates(prompt_len, new_tokens, pre, gen)
    ref = rows[0]
    for row in rows:
        row["ppl_ratio"] = row["ppl"] / ref["ppl"]
        row["decode_speedup"] = row["decode_tok_s"] / ref["decode_tok_s"]
    return {"benchmark": "quant", "model": str(model_name), "dtype": label,
            "eval_tokens": len(ids), "prompt_len": prompt_len, "new_tokens": new_tokens,
            "repeats": repeats, **machine_info(dev, torch.get_num_threads()),
            "method": ("perplexity: one forward over held-out reference-manual prose; decode: "
                       "greedy batch-1, (new_tokens-1)/(generate - prefill), one warm-up then "
                       "the median of `repeats` rounds in which all models take turns; "
                       "group_size applies to int4 methods; the output head is int8 in every "
                       "quantized model; GGUF block sizes: "
                       + ", ".join(f"{k} {v[0]}" for k, v in BLOCKS.items())),
            "results": rows}


def quant_table(report: dict) -> str:
    """The report as a fixed-width table."""
    ref = report["results"][0]["name"]
    return format_table(
        [("format", "<9"), ("bits/w", ">6.2f"), ("MB", ">6.1f"), ("ppl", ">8.3f"),
         ("ppl/" + ref, ">9.3f"), ("prefill/s", ">9.1f"), ("decode/s", ">8.1f"),
         ("x " + ref, ">7.2f"), ("kernel", "")],
        [(r["name"], r["bits_per_weight"], r["weight_mb"], r["ppl"], r["ppl_ratio"],
          r["prefill_tok_s"], r["decode_tok_s"], r["decode_speedup"], r["kernel"])
         for r in report["results"]])


# ----------------------------------------------------------------------------- command line

HELP = "perplexity and batch-1 decode of every quantization format against bf16"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``minillm bench quant``'s options (the shared ones: :func:`.common.add_common_args`)."""
    parser.add_argument("--dtype", default="bfloat16",
                        help="the float reference and activation dtype (default: %(default)s)")
    parser.add_argument("--specs", nargs="+", default=list(DEFAULT_SPECS),
                        help="formats, method[:group_size] (default: %(default)s)")
    parser.add_argument("--eval-tokens", type=int, default=512,
                        help="held-out tokens for perplexity")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default: 64)")
    parser.add_argument("--new-tokens", type=int, default=32,
                        help="tokens generated (default: 32)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed rounds; median (default: 3)")


def main(args: argparse.Namespace) -> int:
    """Run ``minillm bench quant``; print the table, write the JSON and the plot."""
    from ..viz.a1 import plot_quant_bench

    report = run_quant_bench(args.model, specs=args.specs, dtype=args.dtype,
                             eval_tokens=args.eval_tokens, prompt_len=args.prompt_len,
                             new_tokens=args.new_tokens, repeats=args.repeats,
                             device=args.device, threads=args.threads, log=log_to_stderr)
    return write_report(args, report, quant_table(report), plot_quant_bench)
