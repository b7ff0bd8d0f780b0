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
GGUF file, a preset gets our random weights through :func:`minillm.hf_interop.to_hf_model`), and
``llama.cpp`` (llama-cpp-python on the GGUF file itself, so its dtype is the file's Q4_1).

    report = run_decode_bench("smollm2-135m", dtypes=("float32", "bfloat16"))
    write_json(report, "benchmarks/results/decode.json")
    save_figure(plot_decode(report), "figures/bench_decode.png")
"""
from __future__ import annotations

import copy
import datetime
import inspect
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .cache import KVCache
from .config import SamplingParams
from .device import resolve_device, resolve_dtype, sync
from .generate import generate
from .loader import REAL_MODEL, load_model
from .model import Transformer
from .tokenizer import Tokenizer
from .weights import find_smollm2_gguf

PEERS = ("hf", "llama.cpp")
PROMPT_TEXT = (
    "The history of computing is a story of machines that learned to remember. Early "
    "calculators kept a few digits in gears; later machines stored programs as holes in paper, "
    "as charges on tubes, as magnetic rings threaded by hand. Each step made memory larger, "
    "faster and cheaper, and each step changed what people asked computers to do. ")


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


# ----------------------------------------------------------------------------- machine facts

def available_cores() -> int:
    """CPU cores this process may run on (the container's share, not the host's)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU model from /proc/cpuinfo."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    """``git rev-parse HEAD`` of the working directory, or None outside a repository."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def package_version(name: str) -> str | None:
    """Installed version of a distribution, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def machine_info(device: torch.device, threads: int) -> dict:
    """Where and when the numbers were measured."""
    return {
        "device": device_name(device), "device_type": device.type,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": package_version("transformers"),
        "llama_cpp_python": package_version("llama_cpp_python"), "threads": threads,
        "cores": available_cores()}


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


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall time of one call, with the device synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


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
            pre.append(timed(r.prefill, device))
            gen.append(timed(r.generate, device))
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
                  "runs the GGUF file's Q4_1 weights on the CPU")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def load_hf_peer(name: str, device: torch.device):
    """The HF model for ``name`` in fp32 on ``device``.

    The real model is read by transformers from the same GGUF file; any other model gets
    minillm's (seeded, so identical) weights through :func:`minillm.hf_interop.to_hf_model`.
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
    from .hf_interop import to_hf_model

    return to_hf_model(load_model(name, device=device, dtype=torch.float32)[0])


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two generations share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


# ----------------------------------------------------------------------------- the run

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


# ----------------------------------------------------------------------------- output

def write_json(report: dict, path: str | Path) -> Path:
    """Write the report as indented JSON (folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def format_table(report: dict) -> str:
    """The results as a fixed-width text table, with minillm / HF ratios per dtype."""
    rows = report["results"]
    lines = [f"{'engine':<10} {'dtype':<9} {'prefill tok/s':>14} {'decode tok/s':>13}  note",
             "-" * 72]
    for r in rows:
        lines.append(f"{r['engine']:<10} {r['dtype']:<9} {r['prefill_tok_s']:>14.1f} "
                     f"{r['decode_tok_s']:>13.1f}  {r['note']}")
    by_key = {(r["engine"], r["dtype"]): r for r in rows}
    for (engine, dt), r in by_key.items():
        peer = by_key.get(("hf", dt))
        if engine == "minillm" and peer:
            pre = r["prefill_tok_s"] / peer["prefill_tok_s"]
            dec = r["decode_tok_s"] / peer["decode_tok_s"]
            lines.append(f"minillm / hf at {dt}: prefill x{pre:.2f}, decode x{dec:.2f}")
    return "\n".join(lines)


def plot_decode(report: dict):
    """Bar charts of prefill and decode tokens/s, grouped by dtype, one colour per engine."""
    import matplotlib.pyplot as plt

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


def save_figure(fig, path: str | Path, dpi: int = 110) -> Path:
    """Save a Figure as PNG (folders created) and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
