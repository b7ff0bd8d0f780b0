"""Where tensors live: device choice, default dtypes, synchronisation, Triton's interpreter.

Triton runs on CPU tensors only through its interpreter, and the switch (``TRITON_INTERPRET=1``)
is read when a kernel module is imported, so :func:`setup_triton` must run before that.

CPUs differ in what bf16 costs: on AVX2-only chips a bf16 matmul is several times slower than
fp32, on chips with AVX512-BF16 or AMX it is faster. :func:`fastest_cpu_dtype` measures it.
"""
from __future__ import annotations

import functools
import os
import time

import torch


def default_device() -> torch.device:
    """CUDA when a GPU is present, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    return default_device() if device is None else torch.device(device)


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """fp32 on the CPU (exact and fast enough), bf16 on a GPU, unless asked otherwise."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}") from None


def sync(device: torch.device | str | None = None) -> None:
    """Wait for queued GPU work (a no-op on the CPU): call before reading a timer."""
    if torch.device(device or default_device()).type == "cuda":
        torch.cuda.synchronize()


def setup_triton() -> bool:
    """Switch Triton to its CPU interpreter when there is no GPU. Returns True if interpreting."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return os.environ.get("TRITON_INTERPRET") == "1"


def fast_mode() -> bool:
    """True when ``MINILLM_FAST=1`` (set by CI): notebooks shrink their sizes."""
    return os.environ.get("MINILLM_FAST", "0") not in ("", "0")


CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx_vnni", "avx512_vnni",
             "amx_tile", "amx_bf16", "amx_int8")
BF16_FLAGS = ("avx512_bf16", "amx_bf16")   # native bf16 dot products
BF16_MIN_SPEEDUP = 1.15                    # bf16 must beat fp32 by this much to be chosen
CPU_DTYPE_ENV = "MINILLM_CPU_DTYPE"
CPU_DTYPE_CHOICES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CPUINFO = "/proc/cpuinfo"
# MINILLM_CPU_ISA=avx2: this process acts as an AVX2-only CPU (no AVX-512, VNNI or AMX): the
# flags below, our C++ kernels built without them, PyTorch's and oneDNN's kernels capped by
# the variables of EMULATED_TORCH_ENV (read when torch loads: `python -m minillm` restarts
# itself with them). A machine with AVX-512 then measures what an AVX2 laptop would run.
CPU_ISA_ENV = "MINILLM_CPU_ISA"
EMULATED_FLAGS = {"avx2": ("avx2", "fma")}
EMULATED_TORCH_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}


def emulated_isa() -> str | None:
    """The instruction set ``MINILLM_CPU_ISA`` caps this process to (``"avx2"``), or None."""
    isa = os.environ.get(CPU_ISA_ENV, "").strip().lower()
    if not isa:
        return None
    if isa not in EMULATED_FLAGS:
        raise ValueError(f"{CPU_ISA_ENV} must be one of {sorted(EMULATED_FLAGS)} or unset, "
                         f"got {os.environ[CPU_ISA_ENV]!r}")
    return isa


def emulated_torch_env() -> dict[str, str]:
    """The variables of :data:`EMULATED_TORCH_ENV` this process still lacks under
    ``MINILLM_CPU_ISA`` (empty when none or when it is unset); PyTorch reads them when it
    loads, so a process lacking them must start again with them."""
    isa = emulated_isa()
    want = EMULATED_TORCH_ENV[isa] if isa else {}
    return {k: v for k, v in want.items() if os.environ.get(k) != v}


def cpu_features() -> set[str]:
    """The flags of :data:`CPU_FLAGS` that ``/proc/cpuinfo`` lists (empty set if unreadable),
    capped to :data:`EMULATED_FLAGS` under ``MINILLM_CPU_ISA``."""
    flags: set[str] = set()
    try:
        with open(CPUINFO) as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.partition(":")[2].split()) & set(CPU_FLAGS)
                    break
    except OSError:
        pass
    isa = emulated_isa()
    return flags & set(EMULATED_FLAGS[isa]) if isa else flags


def _time_linear(dtype: torch.dtype, m: int = 64, k: int = 576, n: int = 1536,
                 repeats: int = 5) -> float:
    """Best-of-``repeats`` seconds for one ``F.linear`` of [m, k] x [k, n] in ``dtype``.

    Runs on one thread: the per-core speed is what the instruction set decides, and it stays
    steady when other processes hold the cores (two threads on a busy 2-core box measure noise).
    """
    x = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for _ in range(2):                   # warm-up: kernel selection, packing, caches
                torch.nn.functional.linear(x, w)
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                torch.nn.functional.linear(x, w)
                best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return best


@functools.lru_cache
def _choose_cpu_dtype(probe: bool) -> tuple[torch.dtype, str]:
    """The decision of :func:`fastest_cpu_dtype` without the override, cached per process."""
    flags = cpu_features()
    have = ", ".join(sorted(flags)) or "none found"
    if not probe:
        if flags & set(BF16_FLAGS):
            return torch.bfloat16, f"CPU flags ({have}) include native bf16: bfloat16"
        return torch.float32, f"CPU flags ({have}) lack avx512_bf16/amx_bf16: float32"
    t32, t16 = _time_linear(torch.float32), _time_linear(torch.bfloat16)
    speedup = t32 / t16
    dtype = torch.bfloat16 if speedup >= BF16_MIN_SPEEDUP else torch.float32
    verdict = "bf16 faster" if dtype == torch.bfloat16 else "bf16 not clearly faster"
    return dtype, (f"probe (1 thread): linear [64,576]x[576,1536] fp32 {t32 * 1e3:.3f} ms, "
                   f"bf16 {t16 * 1e3:.3f} ms ({speedup:.2f}x, {verdict}; "
                   f"needs {BF16_MIN_SPEEDUP}x); CPU flags: {have}")


def fastest_cpu_dtype(probe: bool = True) -> tuple[torch.dtype, str]:
    """(float32 or bfloat16, a one-line reason): the faster dtype for matmuls on this CPU.

    ``MINILLM_CPU_DTYPE=float32|bfloat16`` overrides. Otherwise, with ``probe`` a few-ms timing
    of fp32 against bf16 decides (bf16 only if :data:`BF16_MIN_SPEEDUP` times faster); without
    it the flags do (bf16 if the CPU has avx512_bf16 or amx_bf16). Cached per process.
    """
    value = os.environ.get(CPU_DTYPE_ENV, "")
    if value:
        if value not in CPU_DTYPE_CHOICES:
            raise ValueError(f"{CPU_DTYPE_ENV} must be one of {sorted(CPU_DTYPE_CHOICES)}, "
                             f"got {value!r}")
        return CPU_DTYPE_CHOICES[value], f"{CPU_DTYPE_ENV}={value} (environment override)"
    return _choose_cpu_dtype(probe)


def serving_dtype(dtype: str | torch.dtype | None, device: torch.device
                  ) -> tuple[torch.dtype, str]:
    """(dtype, why) for serving: ``dtype`` when given; else on a CPU the faster of float32 and
    bfloat16 for it (:func:`fastest_cpu_dtype`), elsewhere :func:`resolve_dtype`'s default.
    ``load_model`` keeps float32 on the CPU (parity and teaching); the engine and its
    benchmark use this."""
    if dtype is None and device.type == "cpu":
        return fastest_cpu_dtype()
    return resolve_dtype(dtype, device), "given" if dtype is not None else "the device's default"


def release_openmp_threads() -> bool:
    """Free the OpenMP worker threads that the calling thread's parallel regions started
    (``omp_pause_resource_all(omp_pause_soft)`` in the OpenMP runtime torch loaded); True if it
    was found and did so. The next parallel region on this thread starts new ones.

    Why: every thread that runs torch's parallel operators owns a team of OpenMP workers, and
    GNU libgomp counts them all. Once the count exceeds the cores (the thread that loaded the
    model keeps its team, and an engine thread starts a second), it lets idle workers spin only
    ~100 times before they sleep, so every parallel region waits for a woken thread: measured
    here (2 cores), an engine stepping on a second thread took 50-60 ms per batch-1 decode step
    instead of 35 ms. A server calls this on the loading thread before its engine thread starts.
    """
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "omp" in line.rsplit("/", 1)[-1]}
    except OSError:
        return False
    for path in sorted(paths):
        name = os.path.basename(path)
        if name.startswith(("libgomp", "libiomp", "libomp")) and ".so" in name:
            pause = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)
            if pause is not None:
                pause.argtypes = [ctypes.c_int]
                return pause(1) == 0                    # 1: omp_pause_soft
    return False
