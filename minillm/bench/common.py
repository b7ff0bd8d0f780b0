"""What every benchmark shares: machine facts, one timer, the batch-1 runners of each engine,
JSON output and one table formatter. Each benchmark is a module beside this one (``decode``,
``throughput``, ``quant``) and writes its report with :func:`write_json`.

The command line helpers at the end (:func:`add_common_args`, :func:`add_peers`,
:func:`peers_of`, :func:`write_report`, :func:`log_to_stderr`, :func:`use_threads`) serve each
benchmark module's ``add_arguments(parser)`` and ``main(args)``, which ``minillm.cli`` registers
as ``minillm bench NAME``.
"""
from __future__ import annotations

import argparse
import inspect
import json
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cache import KVCache
from ..checkpoint.gguf import find_smollm2_gguf
from ..checkpoint.loader import REAL_MODEL, load_model
from ..checkpoint.tokenizer import Tokenizer
from ..config import SamplingParams
from ..device import sync
from ..generate import generate
from ..model.transformer import Transformer

PROMPT_TEXT = (
    "The history of computing is a story of machines that learned to remember. Early "
    "calculators kept a few digits in gears; later machines stored programs as holes in paper, "
    "as charges on tubes, as magnetic rings threaded by hand. Each step made memory larger, "
    "faster and cheaper, and each step changed what people asked computers to do. ")


# machine facts (available_cores, device_name, git_commit, machine_info): minillm.runinfo

# ----------------------------------------------------------------------------- timing

@dataclass
class Runner:
    """One engine at one dtype: ``prefill()`` and ``generate()`` closures; ``output`` holds
    the ids of the latest generate call."""

    engine: str
    dtype: str
    prefill: Callable[[], object]
    generate: Callable[[], object]
    output: list[int]
    note: str = ""


def timed(fn: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call of ``fn``, with the device
    synchronised before and after. CPU time (all threads) is disturbed less than wall time by
    other work on a shared machine."""
    sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    sync(device)
    return time.perf_counter() - wall, time.process_time() - cpu


def read_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes per second this process reads from memory with its torch threads: the best of
    ``repeats`` sums over a buffer of ``nbytes`` (far larger than the caches), the yardstick
    of a batch-1 decode step's roofline (it reads every weight once)."""
    buf = torch.ones(nbytes // 8, dtype=torch.int64)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def median_times(runners: Sequence[Runner], repeats: int,
                 device: torch.device) -> list[tuple[float, float]]:
    """(median prefill s, median generate s) per runner.

    Each runner is warmed up once; then the ``repeats`` rounds are interleaved (every runner
    once per round), so a slow spell of a shared machine hits all engines alike.
    """
    for r in runners:
        r.prefill()
        r.generate()
    times: list[tuple[list[float], list[float]]] = [([], []) for _ in runners]
    for _ in range(repeats):
        for r, (pre, gen) in zip(runners, times):
            pre.append(timed(r.prefill, device)[0])
            gen.append(timed(r.generate, device)[0])
    return [(statistics.median(pre), statistics.median(gen)) for pre, gen in times]


def rates(prompt_len: int, new_tokens: int, prefill_s: float,
          generate_s: float) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) from the prefill time and the whole generate time."""
    decode_s = max(generate_s - prefill_s, 1e-9)
    return prompt_len / prefill_s, (new_tokens - 1) / decode_s


def bench_prompt(tok: Tokenizer | None, vocab_size: int, prompt_len: int,
                 seed: int = 0) -> list[int]:
    """``prompt_len`` token ids: English text when there is a tokenizer, else seeded random ids."""
    if tok is not None:
        ids: list[int] = []
        while len(ids) < prompt_len:
            ids += tok.encode(PROMPT_TEXT)
        return ids[:prompt_len]
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (prompt_len,), generator=gen).tolist()


# ----------------------------------------------------------------------------- engines

def minillm_runner(model: Transformer, prompt: list[int], new_tokens: int) -> Runner:
    """minillm: one cached forward (prefill) and :func:`minillm.generate.generate` (greedy)."""
    x = torch.tensor([prompt], device=model.device)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    out: list[int] = []

    @torch.inference_mode()
    def prefill() -> torch.Tensor:
        cache = KVCache(model.cfg, 1, len(prompt) + new_tokens, model.device, model.dtype)
        return model(x, cache=cache, last_only=True)

    def run() -> None:
        out[:] = generate(model, prompt, params)

    return Runner("minillm", dtype_name(model.dtype), prefill, run, out)


def _keep_last_logits_kwarg(hf_model) -> dict:
    """The forward() argument that computes logits for the last position only, if any."""
    params = inspect.signature(hf_model.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return {name: 1}
    return {}


def hf_runner(hf_model, prompt: list[int], new_tokens: int, pad_id: int) -> Runner:
    """HF transformers: one forward with ``use_cache`` and ``model.generate`` (greedy)."""
    x = torch.tensor([prompt], device=hf_model.device)
    mask = torch.ones_like(x)
    last_only = _keep_last_logits_kwarg(hf_model)
    out: list[int] = []

    @torch.inference_mode()
    def prefill():
        return hf_model(input_ids=x, attention_mask=mask, use_cache=True, **last_only)

    @torch.inference_mode()
    def run() -> None:
        seq = hf_model.generate(x, attention_mask=mask, do_sample=False, use_cache=True,
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                pad_token_id=pad_id, temperature=None, top_p=None, top_k=None)
        out[:] = seq[0, len(prompt):].tolist()

    return Runner("hf", dtype_name(hf_model.dtype), prefill, run, out)


def llama_cpp_runner(gguf: Path, prompt: list[int], new_tokens: int, threads: int) -> Runner:
    """llama-cpp-python on the GGUF file (CPU): ``eval`` of the prompt, greedy ``generate``."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=len(prompt) + new_tokens + 8,
                n_batch=max(512, len(prompt)), n_threads=threads, n_threads_batch=threads,
                n_gpu_layers=0, verbose=False)
    out: list[int] = []

    def prefill() -> None:
        llm.reset()  # forget the previous run so the whole prompt is evaluated again
        llm.eval(prompt)

    def run() -> None:
        llm.reset()
        out.clear()
        for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, reset=True):
            out.append(token)
            if len(out) == new_tokens:
                break

    return Runner("llama.cpp", "Q4_1", prefill, run, out,
                  f"runs the GGUF file's Q4_1 weights on the CPU (built for {llama_cpp_isa()})")


def llama_cpp_isa() -> str:
    """The x86 extensions the loaded llama.cpp was built for, from its system info (``AVX2
    FMA AVX512 ...``): an AVX2-only build says so in the results."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    on = [name for name, value in re.findall(r"([A-Z0-9_]+) = (\d)", info) if value == "1"]
    wanted = ("AVX2", "FMA", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AVX_VNNI", "AMX_INT8")
    return " ".join(n for n in wanted if n in on) or "no AVX2"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def load_hf_peer(name: str, device: torch.device):
    """The HF model for ``name`` in fp32 on ``device``.

    The real model is read by transformers from the same GGUF file; any other model gets
    minillm's (seeded, so identical) weights through
    :func:`minillm.checkpoint.hf_interop.to_hf_model`.
    """
    path = Path(name)
    if name == REAL_MODEL or path.suffix == ".gguf":
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        gguf = find_smollm2_gguf() if name == REAL_MODEL else path
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  dtype=torch.float32)
        return hf.to(device).eval().requires_grad_(False)
    from ..checkpoint.hf_interop import to_hf_model

    return to_hf_model(load_model(name, device=device, dtype=torch.float32)[0])


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


# ----------------------------------------------------------------------------- the run


# ----------------------------------------------------------------------------- output

def write_json(report: dict, path: str | Path) -> Path:
    """Write the report as indented JSON (folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def format_table(columns: Sequence[tuple[str, str]], rows: Iterable[Sequence]) -> str:
    """A fixed-width text table. ``columns``: (title, format spec) pairs such as
    ("engine", "<10") or ("decode tok/s", ">13.1f"); ``rows``: one value per column. A title
    takes the spec's alignment and width; a rule of dashes separates it from the rows."""
    def title(name: str, spec: str) -> str:
        align, width = re.match(r"([<>^]?)(\d*)", spec).groups()
        return format(name, f"{align or '<'}{width}")

    lines = ["  ".join(title(name, spec) for name, spec in columns).rstrip()]
    body = ["  ".join(format(v, spec) for (_, spec), v in zip(columns, row)).rstrip()
            for row in rows]
    lines.append("-" * max(len(line) for line in lines + body))
    return "\n".join(lines + body)


# ----------------------------------------------------------------------------- command line

def add_common_args(p: argparse.ArgumentParser, name: str) -> None:
    """The options every ``bench NAME`` parser shares; it writes benchmarks/results/NAME.json and
    figures/bench_NAME.png unless told otherwise."""
    p.add_argument("--model", default="smollm2-135m", help="model or preset (default: %(default)s)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch (and llama.cpp) threads (default: the available cores)")
    p.add_argument("--out", default=f"benchmarks/results/{name}.json", help="JSON path")
    p.add_argument("--figure", default=f"figures/bench_{name}.png",
                   help="PNG path ('none' to skip the plot)")


def add_peers(p) -> None:
    p.add_argument("--peers", nargs="+", default=["hf", "llama.cpp"],
                   help="engines to compare with: hf, llama.cpp, vllm (make setup-vllm), or "
                        "none")


def peers_of(args: argparse.Namespace) -> list[str]:
    return [] if args.peers == ["none"] else args.peers


def write_report(args: argparse.Namespace, report: dict, table: str, plot) -> int:
    """Print the table, write the JSON and (unless --figure none) the plot."""
    import matplotlib.pyplot as plt

    from ..viz import save

    print(table)
    print(f"wrote {write_json(report, args.out)}")
    if args.figure != "none":
        fig = plot(report)
        print(f"wrote {save(fig, args.figure, dpi=110)}")
        plt.close(fig)
    return 0


def log_to_stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def use_threads(args: argparse.Namespace) -> None:
    """--threads for benchmarks that run on this process's torch threads (CPU only)."""
    if args.threads:
        torch.set_num_threads(args.threads)
