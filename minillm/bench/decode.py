"""The decode benchmark: minillm against HF transformers and llama.cpp, in one run.

Same machine, same thread count, same prompt, same dtype. For each engine and dtype:

* **prefill tokens/s**: ``prompt_len`` / the time of one forward pass over the prompt that fills
  a KV cache and returns the last position's logits (what a generate call does first);
* **decode tokens/s**: greedy batch-1 generation of ``new_tokens`` tokens with a KV cache and EOS
  ignored; the first token comes from the prefill, so decode is
  ``(new_tokens - 1) / (generate time - prefill time)``.

Each engine is warmed up once, then the median of ``repeats`` rounds is taken; within a dtype
the engines take turns in every round (llama.cpp joins the first dtype's rounds), so a busy
spell on a shared machine slows all of them alike. Engines:
``minillm`` (:func:`minillm.generate.generate`), ``hf`` (``model.generate`` with
``do_sample=False`` and ``min_new_tokens = max_new_tokens``; the real model is read from the same
GGUF file, a preset gets our random weights through
:func:`minillm.checkpoint.hf_interop.to_hf_model`), and
``llama.cpp`` (llama-cpp-python on the GGUF file itself, so its dtype is the file's Q4_1).

    report = run_decode_bench("smollm2-135m", dtypes=("float32", "bfloat16"))
    write_json(report, "benchmarks/results/decode.json")
    viz.save(plot_decode(report), "figures/bench_decode.png")   # minillm.viz.bench
"""
from __future__ import annotations

import argparse
import copy
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..checkpoint.gguf import find_smollm2_gguf
from ..checkpoint.loader import REAL_MODEL, load_model
from ..device import resolve_device, resolve_dtype
from ..runinfo import available_cores, machine_info
from .common import (
    Runner,
    add_peers,
    bench_prompt,
    dtype_name,
    format_table,
    hf_runner,
    llama_cpp_available,
    llama_cpp_runner,
    load_hf_peer,
    log_to_stderr,
    median_times,
    minillm_runner,
    peers_of,
    rates,
    write_report,
)

PEERS = ("hf", "llama.cpp")


@dataclass
class EngineResult:
    """One bar pair of the chart: an engine at one dtype."""

    engine: str
    dtype: str
    prefill_tok_s: float
    decode_tok_s: float
    prefill_s: float
    generate_s: float
    note: str = ""


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two generations share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def check_sizes(prompt_len: int, new_tokens: int, repeats: int, peers: Sequence[str]) -> None:
    """ValueError naming the parameter when a size or peer name is out of range."""
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 (one prefill token + decode), got {new_tokens}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise ValueError(f"peers must be among {list(PEERS)} or 'none', got {sorted(unknown)}")


def measure(runners: Sequence[Runner], prompt_len: int, new_tokens: int, repeats: int,
            device: torch.device) -> list[EngineResult]:
    """Time the runners together (interleaved) and turn the medians into rates."""
    out = []
    for r, (p_s, g_s) in zip(runners, median_times(runners, repeats, device)):
        out.append(EngineResult(r.engine, r.dtype, *rates(prompt_len, new_tokens, p_s, g_s),
                                p_s, g_s, r.note))
    ours = runners[0].output
    for r, res in zip(runners[1:], out[1:]):
        res.note = res.note or (f"same greedy tokens as minillm: "
                                f"{common_prefix(ours, r.output)}/{new_tokens}")
    return out


def run_decode_bench(model_name: str = REAL_MODEL, dtypes: Sequence[str] = ("float32", "bfloat16"),
                     prompt_len: int = 128, new_tokens: int = 64, repeats: int = 3,
                     device: str | torch.device | None = None, threads: int | None = None,
                     peers: Sequence[str] = PEERS,
                     log: Callable[[str], None] | None = print) -> dict:
    """Measure every engine at every dtype; return the JSON-ready report."""
    check_sizes(prompt_len, new_tokens, repeats, peers)
    dev = resolve_device(device)
    dts = [resolve_dtype(d, dev) for d in dtypes]
    threads = threads or available_cores()
    torch.set_num_threads(threads)
    say = log or (lambda _msg: None)
    is_gguf = model_name == REAL_MODEL or str(model_name).endswith(".gguf")

    results: list[EngineResult] = []
    hf32 = None
    prompt: list[int] = []
    for i, dt in enumerate(dts):
        model, tok = load_model(model_name, device=dev, dtype=dt)
        if not prompt:
            prompt = bench_prompt(tok, model.cfg.vocab_size, prompt_len)
            if prompt_len + new_tokens > model.cfg.max_seq_len:
                raise ValueError(f"prompt_len + new_tokens must fit max_seq_len "
                                 f"{model.cfg.max_seq_len}")
        runners = [minillm_runner(model, prompt, new_tokens)]
        if "hf" in peers:
            if hf32 is None:
                say("loading the HF transformers model ...")
                hf32 = load_hf_peer(model_name, dev)
            hf = hf32 if dt == torch.float32 else copy.deepcopy(hf32).to(dt)
            runners.append(hf_runner(hf, prompt, new_tokens, model.cfg.eos_token_id))
        if i == 0 and "llama.cpp" in peers:  # its own dtype; timed in the first dtype's rounds
            if is_gguf and llama_cpp_available():
                gguf = find_smollm2_gguf() if model_name == REAL_MODEL else Path(model_name)
                runners.append(llama_cpp_runner(gguf, prompt, new_tokens, threads))
            else:
                say("llama.cpp skipped: " + ("llama_cpp is not installed" if is_gguf
                                             else "the model is not a GGUF file"))
        say(" and ".join(r.engine for r in runners) + f" at {dtype_name(dt)} ...")
        results += measure(runners, prompt_len, new_tokens, repeats, dev)
        del model, runners
    results.sort(key=lambda r: r.engine == "llama.cpp")  # the quantised peer last

    return {"benchmark": "decode", "model": str(model_name), "prompt_len": prompt_len,
            "new_tokens": new_tokens, "repeats": repeats, **machine_info(dev, threads),
            "torch_threads": torch.get_num_threads(),
            "method": "prefill: one forward over the prompt into a KV cache, last logits only; "
                      "decode: (new_tokens-1)/(generate time - prefill time), greedy, EOS "
                      "ignored; one warm-up, then the median of `repeats` rounds in which "
                      "the engines of one dtype take turns",
            "results": [asdict(r) for r in results]}


def decode_table(report: dict) -> str:
    """The results as a fixed-width text table, with minillm / HF ratios per dtype."""
    rows = report["results"]
    lines = [format_table([("engine", "<10"), ("dtype", "<9"), ("prefill tok/s", ">14.1f"),
                           ("decode tok/s", ">13.1f"), ("note", "")],
                          [(r["engine"], r["dtype"], r["prefill_tok_s"], r["decode_tok_s"],
                            r["note"]) for r in rows])]
    by_key = {(r["engine"], r["dtype"]): r for r in rows}
    for (engine, dt), r in by_key.items():
        peer = by_key.get(("hf", dt))
        if engine == "minillm" and peer:
            pre = r["prefill_tok_s"] / peer["prefill_tok_s"]
            dec = r["decode_tok_s"] / peer["decode_tok_s"]
            lines.append(f"minillm / hf at {dt}: prefill x{pre:.2f}, decode x{dec:.2f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line

HELP = "prefill and batch-1 decode tokens/s vs HF and llama.cpp"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``minillm bench decode``'s options (the shared ones: :func:`.common.add_common_args`)."""
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        help="dtypes of minillm and HF (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default: 128)")
    parser.add_argument("--new-tokens", type=int, default=64,
                        help="tokens generated (default: 64)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; median (default: 3)")
    add_peers(parser)


def main(args: argparse.Namespace) -> int:
    """Run ``minillm bench decode``; print the table, write the JSON and the plot."""
    from ..viz.bench import plot_decode

    report = run_decode_bench(args.model, dtypes=args.dtypes, prompt_len=args.prompt_len,
                              new_tokens=args.new_tokens, repeats=args.repeats,
                              device=args.device, threads=args.threads,
                              peers=peers_of(args), log=log_to_stderr)
    return write_report(args, report, decode_table(report), plot_decode)
