"""A decode step as a composition of kernels: ``torch.profiler`` over a few eager steps.

Every operator the step dispatches is counted with its own (self) time, then grouped into
what it does: matmuls (the weights streamed once per token), attention, norms and other
elementwise arithmetic, copies and indexing, the rest. On a GPU the times are the kernels'
device times; on a CPU, the operators' CPU times.

    prof = profile_decode(model, prompt_len=128, steps=8)
    print(prof.table()); prof.by_category(); prof.export_trace("decode_trace.json")
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ..cache.contiguous import KVCache
from ..device import sync
from ..model.transformer import Transformer

#: substrings of operator or kernel names, checked in this order
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("attention", "flash", "softmax", "fmha")),
    # nvjet / xmma: cuBLAS's GEMM kernels on Hopper (their names say neither gemm nor mm)
    ("matmul", ("mm", "gemm", "gemv", "matmul", "linear", "int4pack", "int8pack", "cutlass",
                "nvjet", "xmma")),
    ("copy/index", ("copy", "index", "slice", "select", "view", "transpose", "as_strided",
                    "cat", "embedding", "empty", "expand", "reshape", "contiguous", "_to",
                    "scatter", "gather", "memcpy", "memset", "unsqueeze", "clone", "item")),
    ("norm/elementwise", ("mul", "add", "sub", "div", "pow", "mean", "rsqrt", "silu", "neg",
                          "sum", "exp", "elementwise", "reduce", "norm", "sqrt", "where",
                          "arange", "cos", "sin", "argmax", "max", "rope")),
)


def categorize(name: str) -> str:
    """The category of an operator or kernel name (``"other"`` if none matches)."""
    low = name.lower()
    for category, keys in CATEGORIES:
        if any(k in low for k in keys):
            return category
    return "other"


@dataclass
class DecodeProfile:
    """``rows``: one dict per operator (name, category, calls per step, self_ms_per_step,
    share of the step), largest first. ``step_ms``: the summed self time per step."""

    rows: list[dict]
    steps: int
    device: str
    step_ms: float
    _prof: object = field(default=None, repr=False)

    def by_category(self) -> dict[str, float]:
        """Milliseconds per step in each category, largest first."""
        total: dict[str, float] = defaultdict(float)
        for r in self.rows:
            total[r["category"]] += r["self_ms_per_step"]
        return dict(sorted(total.items(), key=lambda kv: -kv[1]))

    def launches_per_step(self, category: str | None = None) -> float:
        """Operator calls per step (in one category, or all)."""
        return sum(r["calls"] for r in self.rows if category in (None, r["category"]))

    def table(self, n: int = 12) -> str:
        """The ``n`` largest operators as a fixed-width table."""
        lines = [f"{'operator':<48} {'category':<17} {'calls/step':>10} {'ms/step':>8} "
                 f"{'share':>6}"]
        for r in self.rows[:n]:
            lines.append(f"{r['name'][:48]:<48} {r['category']:<17} {r['calls']:>10.0f} "
                         f"{r['self_ms_per_step']:>8.3f} {r['share']:>6.1%}")
        lines.append(f"{'total':<48} {'':<17} {self.launches_per_step():>10.0f} "
                     f"{self.step_ms:>8.3f} {1:>6.0%}")
        return "\n".join(lines)

    def export_trace(self, path: str | Path) -> Path:
        """The profile as a Chrome trace (open it in chrome://tracing or Perfetto)."""
        self._prof.export_chrome_trace(str(path))
        return Path(path)


@torch.inference_mode()
def profile_decode(model: Transformer, prompt_len: int = 128, steps: int = 8,
                   warmup: int = 3) -> DecodeProfile:
    """Profile ``steps`` eager batch-1 decode steps after a ``prompt_len`` prefill."""
    if prompt_len < 1 or steps < 1:
        raise ValueError(f"prompt_len and steps must be >= 1, got {prompt_len}, {steps}")
    if prompt_len + warmup + steps > model.cfg.max_seq_len:
        raise ValueError(f"prompt_len + warmup + steps must fit max_seq_len "
                         f"{model.cfg.max_seq_len}")
    dev = model.device
    cache = KVCache(model.cfg, 1, prompt_len + warmup + steps, dev, model.dtype)
    ids = torch.arange(1, prompt_len + 1, device=dev)[None] % model.cfg.vocab_size
    model(ids, cache=cache, last_only=True)
    x = torch.tensor([[1]], device=dev)
    for _ in range(warmup):
        model(x, cache=cache, last_only=True)
    cuda = dev.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(dev)
    with profile(activities=acts) as prof:
        for _ in range(steps):
            model(x, cache=cache, last_only=True)
        sync(dev)
    return profile_summary(prof, steps, cuda, str(dev))


def profile_engine_steps(engine, steps: int = 5) -> DecodeProfile:
    """Profile the next ``steps`` steps of a running :class:`~minillm.engine.LLMEngine` (a
    batched paged decode once every request has been prefilled): schedule, run, sample. Stops
    early when the engine runs out of work (``steps`` of the profile: those it ran)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not engine.has_unfinished():
        raise ValueError("the engine has no request to step: add requests first")
    dev = engine.model.device
    cuda = dev.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(dev)
    ran = 0
    with profile(activities=acts) as prof:
        while ran < steps and engine.has_unfinished():
            engine.step()
            ran += 1
        sync(dev)
    return profile_summary(prof, ran, cuda, str(dev))


def profile_summary(prof, steps: int, cuda: bool, device: str) -> DecodeProfile:
    """Group the profiler's per-operator averages into rows (device kernels on a GPU)."""
    rows = []
    for e in prof.key_averages():
        if cuda:
            us = getattr(e, "self_device_time_total", 0.0)
            if e.device_type != torch.autograd.DeviceType.CUDA or us <= 0:
                continue
        else:
            us = e.self_cpu_time_total
        if us <= 0 or e.key.startswith(("ProfilerStep", "Torch-Compiled", "## ")):
            continue
        rows.append({"name": e.key, "category": categorize(e.key), "calls": e.count / steps,
                     "self_ms_per_step": us / 1e3 / steps})
    rows.sort(key=lambda r: -r["self_ms_per_step"])
    total = sum(r["self_ms_per_step"] for r in rows) or 1.0
    for r in rows:
        r["share"] = r["self_ms_per_step"] / total
    return DecodeProfile(rows, steps, device, total, prof)
