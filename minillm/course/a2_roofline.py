"""The roofline model and the GPU facts behind it (Appendix A2).

A kernel that does F floating-point operations and moves B bytes between memory and the chip has
an *arithmetic intensity* I = F / B (FLOP per byte). On a processor whose memory delivers ``bw``
bytes/s and whose arithmetic peaks at ``peak`` FLOP/s, the kernel can run no faster than

    attainable(I) = min(bw * I, peak)          (Williams, Waterman & Patterson, 2009)

The two lines meet at the *ridge point* I* = peak / bw: below it a kernel is memory-bound, above
it compute-bound. This module measures the two peaks of the machine at hand
(:func:`measure_bandwidth`, :func:`measure_matmul_rate`), holds vendor numbers for a few data-centre
GPUs (:data:`GPU_SPECS`), turns kernel measurements into roofline points (:func:`kernel_points`)
and has a small occupancy calculator for NVIDIA SMs (:func:`occupancy`).

Units: bandwidths in bytes/s and rates in FLOP/s unless a name says otherwise (``_tb_s``,
``_tflops``, ``_gb_s``); vendors' TB/s and GB are powers of ten.
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..device import resolve_device, sync


# ----------------------------------------------------------------------------- the model
def ridge_point(bandwidth: float, peak_flops: float) -> float:
    """Arithmetic intensity (FLOP/byte) where the memory roof meets the compute roof.

    ``bandwidth`` in bytes/s and ``peak_flops`` in FLOP/s (or TB/s and TFLOP/s: only the ratio
    matters, so the units must match).
    """
    if not (bandwidth > 0 and math.isfinite(bandwidth)):
        raise ValueError(f"bandwidth must be a positive finite number, got {bandwidth!r}")
    if not (peak_flops > 0 and math.isfinite(peak_flops)):
        raise ValueError(f"peak_flops must be a positive finite number, got {peak_flops!r}")
    return peak_flops / bandwidth


def attainable(intensity, bandwidth: float, peak_flops: float):
    """The roof: min(bandwidth * intensity, peak_flops), for a number or an array of intensities.

    Returns a float for a scalar ``intensity``, else a numpy array.
    """
    import numpy as np

    ridge_point(bandwidth, peak_flops)  # validates both
    i = np.asarray(intensity, dtype=float)
    if np.any(i < 0) or np.any(np.isnan(i)):
        raise ValueError("intensity must be >= 0 (FLOP per byte)")
    roof = np.minimum(bandwidth * i, peak_flops)
    return float(roof) if roof.ndim == 0 else roof


@dataclass(frozen=True)
class KernelPoint:
    """One measured kernel call: the work it did, the bytes it moved and the time it took."""

    name: str
    flops: float
    bytes: float
    seconds: float
    group: str = ""  # a legend label shared by related points (e.g. "FlashAttention, d=128")

    def __post_init__(self) -> None:
        if self.flops < 0 or self.bytes <= 0 or self.seconds <= 0:
            raise ValueError(f"{self.name}: need flops >= 0, bytes > 0 and seconds > 0, got "
                             f"flops={self.flops}, bytes={self.bytes}, seconds={self.seconds}")

    @property
    def intensity(self) -> float:
        """FLOP per byte moved."""
        return self.flops / self.bytes

    @property
    def rate(self) -> float:
        """Achieved FLOP/s."""
        return self.flops / self.seconds

    @property
    def bandwidth(self) -> float:
        """Achieved bytes/s."""
        return self.bytes / self.seconds

    def fraction_of_roof(self, bandwidth: float, peak_flops: float) -> float:
        """Achieved rate / what the roofline allows at this intensity (1.0 = on the roof).

        A kernel with no FLOPs (a copy) is measured against the memory roof: bytes/s / bandwidth.
        """
        if self.flops == 0:
            return self.bandwidth / bandwidth
        return self.rate / attainable(self.intensity, bandwidth, peak_flops)


def kernel_points(measurements: Iterable[Mapping | tuple]) -> list[KernelPoint]:
    """Turn measured kernels into roofline points.

    Each measurement is a mapping with keys ``flops``, ``bytes``, ``seconds`` (and optional
    ``name``, ``group``) or a tuple ``(name, flops, bytes, seconds)``. The points carry
    ``intensity`` (FLOP/byte) and ``rate`` (FLOP/s).
    """
    points = []
    for i, m in enumerate(measurements):
        if isinstance(m, Mapping):
            points.append(KernelPoint(str(m.get("name", f"kernel {i}")), float(m["flops"]),
                                      float(m["bytes"]), float(m["seconds"]),
                                      str(m.get("group", ""))))
        else:
            name, flops, nbytes, seconds = m
            points.append(KernelPoint(str(name), float(flops), float(nbytes), float(seconds)))
    return points


# ----------------------------------------------------------------------------- analytic costs
def matmul_cost(m: int, n: int, k: int, bytes_per_elem: int = 2) -> tuple[int, int]:
    """(FLOPs, minimum bytes) of C[m, n] = A[m, k] @ B[k, n]: 2mnk multiply-adds counted as two
    FLOPs each; A and B read once, C written once."""
    if min(m, n, k) < 1 or bytes_per_elem < 1:
        raise ValueError(f"m, n, k and bytes_per_elem must be >= 1, got {(m, n, k)}, "
                         f"{bytes_per_elem}")
    return 2 * m * n * k, (m * k + k * n + m * n) * bytes_per_elem


def matmul_intensity(m: int, n: int, k: int, bytes_per_elem: int = 2) -> float:
    """FLOP per byte of an [m, k] @ [k, n] product that reads its inputs and writes C once."""
    flops, nbytes = matmul_cost(m, n, k, bytes_per_elem)
    return flops / nbytes


def tiled_matmul_bytes(m: int, n: int, k: int, block_m: int, block_n: int,
                       bytes_per_elem: int = 2) -> int:
    """HBM bytes of C[m, n] = A[m, k] @ B[k, n] by a tiled kernel with no cache reuse.

    One program per ``block_m x block_n`` tile of C reads its whole strip of A (its rows, all k)
    and of B (all k, its columns) and writes its tile once; tiles at the edges are clipped. So
    A is read ceil(n / block_n) times, B ceil(m / block_m) times and C written once; bigger
    tiles mean fewer re-reads, hence more FLOPs per byte (an L2 cache can only do better).
    """
    if min(m, n, k, block_m, block_n, bytes_per_elem) < 1:
        raise ValueError(f"m, n, k, block_m, block_n and bytes_per_elem must be >= 1, got "
                         f"{(m, n, k, block_m, block_n, bytes_per_elem)}")
    reads = m * k * math.ceil(n / block_n) + k * n * math.ceil(m / block_m)
    return (reads + m * n) * bytes_per_elem


def pipelined_tile_smem(block_m: int, block_n: int, block_k: int, stages: int,
                        bytes_per_elem: int = 2) -> int:
    """Shared memory (bytes) of a pipelined matmul program: ``stages`` buffers each holding a
    ``block_m x block_k`` tile of A and a ``block_k x block_n`` tile of B."""
    return stages * (block_m * block_k + block_k * block_n) * bytes_per_elem


def vector_add_cost(n: int, bytes_per_elem: int = 2) -> tuple[int, int]:
    """(FLOPs, bytes) of out = x + y over n elements: one add each; x, y read and out written."""
    return n, 3 * n * bytes_per_elem


def softmax_cost(rows: int, cols: int, bytes_per_elem: int = 2) -> tuple[int, int]:
    """(FLOPs, minimum bytes) of a row softmax: about five operations per element (max,
    subtract, exp, sum, divide; an exp counted as one), the input read and the output written
    once, which is what the fused kernel moves."""
    return 5 * rows * cols, 2 * rows * cols * bytes_per_elem


def attention_cost(batch: int, heads: int, seqlen: int, head_dim: int, causal: bool,
                   bytes_per_elem: int = 2) -> tuple[float, int]:
    """(FLOPs, minimum bytes) of a FlashAttention forward with q, k, v [B, H, N, d].

    FLOPs: q.k and p.v, 2 x N x N x d each per head (half of it when causal), the convention of
    the FlashAttention papers and of ``benchmarks/kernels_bench.py``. Bytes: q, k, v read and out
    written once, which is what a fused kernel achieves (the N x N scores never reach memory).
    """
    flops = 4 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
    return flops, 4 * batch * heads * seqlen * head_dim * bytes_per_elem


def decode_attention_cost(batch: int, context: int, q_heads: int, kv_heads: int, head_dim: int,
                          bytes_per_elem: int = 2) -> tuple[int, int]:
    """(FLOPs, bytes) of one decode step of attention over a KV cache of ``context`` tokens.

    Bytes as in ``benchmarks/kernels_bench.py``: K and V of every cached token once, q read and
    out written. Each query head does 2 x context x d for q.k and as much for p.v, so the
    intensity is about q_heads / kv_heads FLOP/byte for 16-bit values, whatever the context.
    """
    flops = 4 * batch * q_heads * context * head_dim
    nbytes = (2 * batch * context * kv_heads * head_dim + 2 * batch * q_heads * head_dim)
    return flops, nbytes * bytes_per_elem


def points_from_kernel_benchmark(result: Mapping) -> list[KernelPoint]:
    """Roofline points from the JSON that ``benchmarks/kernels_bench.py`` writes.

    FlashAttention rows give TFLOP/s, so the time is FLOPs / rate and the bytes come from
    :func:`attention_cost`; paged-decode rows give bytes and GB/s, so the time is bytes / rate
    and the FLOPs come from :func:`decode_attention_cost`.
    """
    elem = 2 if result.get("dtype") in ("bfloat16", "float16") else 4
    points = []
    for r in result.get("flash_attention", []):
        flops, nbytes = attention_cost(r["batch"], r["heads"], r["N"], r["d"], r["causal"], elem)
        seconds = flops / (r["triton_tflops"] * 1e12)
        points.append(KernelPoint(
            f"flash N={r['N']} d={r['d']}{' causal' if r['causal'] else ''}", flops, nbytes,
            seconds, f"FlashAttention fwd, d={r['d']}{', causal' if r['causal'] else ''}"))
    cfg = result.get("paged_decode_config", {})
    for r in result.get("paged_decode", []):
        flops, _ = decode_attention_cost(r["batch"], r["context"], cfg["hq"], cfg["hkv"],
                                         cfg["head_dim"], elem)
        seconds = r["bytes"] / (r["GBps"] * 1e9)
        points.append(KernelPoint(f"decode B={r['batch']} ctx={r['context']}", flops,
                                  r["bytes"], seconds, "paged decode attention"))
    return points


def triton_kernel_resources(compiled) -> dict:
    """Registers per thread, spills, shared memory (bytes) and warps of a compiled Triton kernel
    (what ``kernel[grid](...)`` returns on a GPU); None for what the object does not say (the
    interpreter returns no compiled kernel)."""
    meta = getattr(compiled, "metadata", None)
    return {"registers": getattr(compiled, "n_regs", None),
            "spills": getattr(compiled, "n_spills", None),
            "shared_bytes": getattr(meta, "shared", None),
            "num_warps": getattr(meta, "num_warps", None)}


# ----------------------------------------------------------------------------- measuring
class _OpTraffic(TorchDispatchMode):
    """Adds up the bytes of every tensor each operation reads (inputs) and writes (outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(t, torch.Tensor)]
        self.ops.append((str(func.overloadpacket.__name__),
                         sum(t.numel() * t.element_size() for t in ins),
                         sum(t.numel() * t.element_size() for t in outs)))
        return out


def op_traffic(fn) -> list[tuple[str, int, int]]:
    """Run ``fn()`` and list (op name, bytes read, bytes written) for every PyTorch operation it
    launched: the memory traffic of an unfused computation if each op is one kernel that reads
    its inputs and writes its outputs once (a view moves nothing but is listed too)."""
    mode = _OpTraffic()
    with mode:
        fn()
    return mode.ops


def cpu_seconds(fn, min_runs: int = 10, min_total: float = 0.5) -> float:
    """Best (minimum) wall-clock time of one call of fn() on the CPU: a warm-up call, then at
    least ``min_runs`` calls and at least ``min_total`` seconds of them. The minimum is the run
    least disturbed by other programs on a shared machine."""
    fn()
    best, spent, runs = math.inf, 0.0, 0
    while runs < min_runs or spent < min_total:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, runs = min(best, dt), spent + dt, runs + 1
    return best


def _best_seconds(fn, device: torch.device, repeats: int, inner: int) -> float:
    """Best of ``repeats`` timings of ``inner`` back-to-back calls of fn(), per call."""
    fn()  # warm up: allocation, kernel selection
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync(device)
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def _graph_seconds(fn, repeats: int, inner: int) -> float | None:
    """Per-call seconds of ``inner`` calls replayed from one CUDA graph (no launch overhead),
    best of ``repeats``; None if capture fails."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) * 1e-3 / inner)
        return best
    except Exception:  # noqa: BLE001 - fall back to eager timing
        return None


def measure_bandwidth(device: str | torch.device | None = None, nbytes: int | None = None,
                      repeats: int = 5) -> float:
    """GB/s (1e9 bytes/s) of a device-to-device copy of ``nbytes``, bytes read + written.

    Default size: 1 GiB on a GPU (far more than any L2 cache, so the copy streams from HBM),
    256 MiB on the CPU. On a GPU, copies under 256 MiB (which may sit in L2) are replayed from a
    CUDA graph so that the time is the memory's, not the launch's; larger ones are timed as
    issued (inside a graph a copy can be handed to the slower copy engines instead of the SMs).
    """
    device = resolve_device(device)
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    if nbytes < 1 or repeats < 1:
        raise ValueError(f"nbytes and repeats must be >= 1, got {nbytes}, {repeats}")
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def copy():
        dst.copy_(src)

    # enough copies per timing that each timing moves at least 2 GiB (GPU) / 256 MiB (CPU)
    inner = max(1, min(200, ((2 << 30) if device.type == "cuda" else (256 << 20)) // nbytes))
    seconds = None
    if device.type == "cuda" and nbytes < (256 << 20):
        seconds = _graph_seconds(copy, repeats, inner)
    if seconds is None:
        seconds = _best_seconds(copy, device, repeats, inner)
    return 2 * nbytes / seconds / 1e9


def measure_matmul_rate(device: str | torch.device | None = None,
                        dtype: str | torch.dtype | None = None, n: int | None = None,
                        repeats: int = 3, tf32: bool = False) -> float:
    """TFLOP/s of an n x n @ n x n matrix product (2 n^3 FLOPs) in ``dtype``.

    Defaults: n = 8192 on a GPU, 1024 on the CPU; dtype float32. ``tf32=True`` lets a CUDA GPU
    run float32 products on its tensor cores in TF32 (10-bit mantissa inputs); by default
    float32 products use the ordinary fp32 units, as PyTorch does out of the box.
    """
    from ..device import DTYPES

    device = resolve_device(device)
    if dtype is None:
        dtype = torch.float32
    elif isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    if n is None:
        n = 8192 if device.type == "cuda" else 1024
    if n < 1 or repeats < 1:
        raise ValueError(f"n and repeats must be >= 1, got {n}, {repeats}")
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
    try:
        inner = 1 if device.type == "cpu" else 5
        seconds = _best_seconds(lambda: torch.mm(a, b), device, repeats, inner)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return 2 * n**3 / seconds / 1e12


# ----------------------------------------------------------------------------- vendor numbers
@dataclass(frozen=True)
class GPUSpec:
    """Peak numbers of one accelerator as its vendor publishes them (None: not published).

    ``bf16_tflops`` is the dense tensor-core (NVIDIA) or matrix-core (AMD) rate; datasheets
    often print twice as much "with sparsity" (2:4 structured zeros), which is not used here.
    ``fp32_tflops`` is the ordinary (non-tensor) fp32 rate. ``units`` counts SMs (NVIDIA) or
    CUs (AMD); ``smem_kb`` is the shared memory (LDS on AMD) one SM/CU can give its blocks and
    ``regs_kb`` its register file.
    """

    name: str
    vendor: str
    hbm_tb_s: float
    bf16_tflops: float
    fp32_tflops: float | None
    units: int | None
    unit_name: str
    hbm_gb: float
    l2_mb: float | None
    smem_kb: float | None
    regs_kb: float | None
    warp_size: int
    source: str

    @property
    def ridge(self) -> float:
        """Dense bf16 ridge point, FLOP per byte of HBM traffic."""
        return ridge_point(self.hbm_tb_s * 1e12, self.bf16_tflops * 1e12)

    @property
    def bandwidth(self) -> float:
        """HBM bandwidth in bytes/s."""
        return self.hbm_tb_s * 1e12

    @property
    def peak_flops(self) -> float:
        """Dense bf16 peak in FLOP/s."""
        return self.bf16_tflops * 1e12


GPU_SPECS: dict[str, GPUSpec] = {s.name: s for s in (
    GPUSpec("A100 SXM 80GB", "NVIDIA", hbm_tb_s=2.039, bf16_tflops=312, fp32_tflops=19.5,
            units=108, unit_name="SM", hbm_gb=80, l2_mb=40, smem_kb=164, regs_kb=256,
            warp_size=32,
            source="NVIDIA A100 Tensor Core GPU datasheet (bandwidth, TFLOPS, memory); NVIDIA "
                   "A100 Tensor Core GPU Architecture whitepaper (108 SMs, 40 MB L2, 164 KB "
                   "shared memory and 256 KB registers per SM)"),
    GPUSpec("H100 SXM", "NVIDIA", hbm_tb_s=3.35, bf16_tflops=989, fp32_tflops=67,
            units=132, unit_name="SM", hbm_gb=80, l2_mb=50, smem_kb=228, regs_kb=256,
            warp_size=32,
            source="NVIDIA H100 Tensor Core GPU datasheet (3.35 TB/s, 80 GB, BF16 1,979 TFLOPS "
                   "with sparsity = 989 dense, FP32 67 TFLOPS); NVIDIA H100 Tensor Core GPU "
                   "Architecture whitepaper (132 SMs, 50 MB L2, 228 KB shared memory and 256 KB "
                   "registers per SM)"),
    GPUSpec("H200 SXM", "NVIDIA", hbm_tb_s=4.8, bf16_tflops=989, fp32_tflops=67,
            units=132, unit_name="SM", hbm_gb=141, l2_mb=50, smem_kb=228, regs_kb=256,
            warp_size=32,
            source="NVIDIA H200 Tensor Core GPU datasheet (4.8 TB/s, 141 GB, BF16 1,979 TFLOPS "
                   "with sparsity = 989 dense, FP32 67 TFLOPS); same GH100 chip as the H100 SXM, "
                   "so SMs, L2 and per-SM numbers from the H100 Architecture whitepaper"),
    GPUSpec("MI300X", "AMD", hbm_tb_s=5.3, bf16_tflops=1307.4, fp32_tflops=163.4,
            units=304, unit_name="CU", hbm_gb=192, l2_mb=32, smem_kb=64, regs_kb=512,
            warp_size=64,
            source="AMD Instinct MI300X datasheet (5.3 TB/s, 192 GB, 304 CUs, BF16 1,307.4 "
                   "TFLOPS dense, FP32 vector 163.4 TFLOPS); AMD CDNA 3 architecture whitepaper "
                   "(4 MB L2 per XCD x 8 = 32 MB, plus a 256 MB Infinity Cache; 64 KB LDS and "
                   "512 KB vector registers per CU; 64-wide wavefronts)"),
    GPUSpec("B200", "NVIDIA", hbm_tb_s=8.0, bf16_tflops=2250, fp32_tflops=None,
            units=None, unit_name="SM", hbm_gb=180, l2_mb=None, smem_kb=None, regs_kb=None,
            warp_size=32,
            source="NVIDIA DGX B200 datasheet, per GPU (1,440 GB and 64 TB/s for 8 GPUs; FP8 "
                   "72 PFLOPS with sparsity for 8 GPUs -> BF16 2.25 PFLOPS dense per GPU); the "
                   "datasheet gives no SM count or L2 size"),
)}


# ----------------------------------------------------------------------------- occupancy
@dataclass(frozen=True)
class SMLimits:
    """Per-SM resource limits of one NVIDIA compute capability (CUDA C++ Programming Guide,
    "Technical Specifications per Compute Capability")."""

    name: str
    warp_size: int = 32
    max_threads_per_block: int = 1024
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    registers_per_sm: int = 65536  # 32-bit registers: a 256 KB register file
    max_registers_per_thread: int = 255
    register_alloc_unit: int = 256  # registers are given to a warp in chunks of 256
    smem_per_sm: int = 228 * 1024  # bytes of shared memory the SM can hand out
    max_smem_per_block: int = 227 * 1024
    smem_reserved_per_block: int = 1024  # the system keeps 1 KB of each block's shared memory
    smem_alloc_unit: int = 128


HOPPER_SM = SMLimits("compute capability 9.0 (H100, H200)")
AMPERE_SM = SMLimits("compute capability 8.0 (A100)", smem_per_sm=164 * 1024,
                     max_smem_per_block=163 * 1024)


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def occupancy(threads_per_block: int, registers_per_thread: int, smem_per_block: int = 0,
              limits: SMLimits = HOPPER_SM) -> dict:
    """How many blocks of a kernel fit on one SM at once, and what limits them.

    A block needs ceil(threads / 32) warps; each warp needs ``registers_per_thread x 32``
    registers rounded up to a multiple of 256; each block needs its shared memory plus 1 KB
    reserved, rounded up to 128 bytes. The SM takes as many blocks as the tightest of four
    limits allows: warps (64), blocks (32), registers (65,536) and shared memory. (The real
    hardware also splits the register file among four sub-partitions; ignored here.)

    Returns ``blocks_per_sm``, ``warps_per_sm``, ``occupancy`` (active warps / max warps) and
    ``limiter`` (which limit binds; ties go to the first of warps, blocks, registers, shared
    memory), plus the per-limit block counts under ``limits_blocks``.
    """
    if not 1 <= threads_per_block <= limits.max_threads_per_block:
        raise ValueError(f"threads_per_block must be in [1, {limits.max_threads_per_block}], "
                         f"got {threads_per_block}")
    if not 0 <= registers_per_thread <= limits.max_registers_per_thread:
        raise ValueError(f"registers_per_thread must be in [0, "
                         f"{limits.max_registers_per_thread}], got {registers_per_thread}")
    if not 0 <= smem_per_block <= limits.max_smem_per_block:
        raise ValueError(f"smem_per_block must be in [0, {limits.max_smem_per_block}] bytes, "
                         f"got {smem_per_block}")
    warps = -(-threads_per_block // limits.warp_size)
    regs_per_warp = _round_up(registers_per_thread * limits.warp_size, limits.register_alloc_unit)
    smem = _round_up(smem_per_block + limits.smem_reserved_per_block, limits.smem_alloc_unit)
    by = {
        "warps": limits.max_warps_per_sm // warps,
        "blocks": limits.max_blocks_per_sm,
        "registers": (limits.registers_per_sm // (regs_per_warp * warps) if regs_per_warp
                      else limits.max_blocks_per_sm),
        "shared memory": limits.smem_per_sm // smem,
    }
    limiter = min(by, key=by.get)  # dicts keep order, so ties go to the first
    blocks = by[limiter]
    return {"blocks_per_sm": blocks, "warps_per_sm": blocks * warps,
            "occupancy": blocks * warps / limits.max_warps_per_sm, "limiter": limiter,
            "limits_blocks": by}
