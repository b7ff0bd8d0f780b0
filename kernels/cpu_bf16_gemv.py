"""A bfloat16 matrix-vector product for a decode step's few rows (CPU, AVX-512 BF16).

At batch 1 a bfloat16 linear reads each 2-byte weight once and multiplies it once: its time is
the bytes it moves, if the arithmetic keeps up. oneDNN's packed matmul, built for many rows,
reads a SmolLM2 layer's weights at 17-24 GB/s at one row where the memory gives 30-37. Here the
weights are laid out once (:func:`pack`) so that a 512-bit register holds one pair of adjacent
elements of sixteen weight rows, one row a 32-bit lane; ``vdpbf16ps`` multiplies it by the
activation row's matching pair, broadcast to every lane, and adds both products into each
lane's float32 sum. After K / 2 such steps the sixteen lanes are sixteen finished outputs: no
sum crosses lanes, every register is full whatever K is. Two groups of sixteen weight rows are
done side by side, so each broadcast pair of the activations serves two weight vectors, and a
tile of up to twelve activation rows reuses each loaded weight vector (the broadcasts, not the
multiplies, are what limit it otherwise); independent chains of sums (at least eight in flight)
hide the instruction's latency. While a tile computes, it asks for the next pair of groups'
weights to come into L2 (a software prefetch a loaded vector), so the memory never waits for
the arithmetic: up to twelve rows cost about what one does. A step of 13 to 24 rows is two
equal tiles. Pairs of groups (32 output columns) are shared by OpenMP threads. On SmolLM2's
shapes it beats oneDNN's packed matmul at every row count up to 128 on a 2-core AVX-512 BF16
EPYC, most at the few rows of a decode or verify step
(``python benchmarks/cpu_gemv_bench.py``, ``benchmarks/results/cpu_gemv.json``).

Only CPUs with AVX-512 BF16 run it (:func:`available`: where the engine computes in bfloat16
at all); the C++ has a plain-loop branch so that it compiles and is tested everywhere. The C++
is ``cpu_bf16_gemv.cpp`` beside this file, compiled by :mod:`.cpu_build` after its shared
``SCALARS``; :func:`reference` is the float64 statement of what it computes
(``tests/kernel_tests/test_cpu_bf16_gemv.py`` holds one to the other).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .cpu_build import SCALARS, Library, profiled_call

ROWS = 16           # weight rows whose sums one 512-bit register holds
SOURCE_FILE = Path(__file__).with_name("cpu_bf16_gemv.cpp")
SOURCE = SCALARS + SOURCE_FILE.read_text()
_P, _I = ctypes.c_void_p, ctypes.c_int64
LIBRARY = Library("bf16_gemv", SOURCE, {"bf16_gemv": [_P, _I, _P, _P, _I, _I, _I, _I]},
                  source_file=SOURCE_FILE)


def available() -> bool:
    """Does the kernel run fast here: it built, and the CPU has AVX-512 BF16?"""
    from minillm.device import cpu_features

    return "avx512_bf16" in cpu_features() and LIBRARY.get() is not None


def fits(weight: torch.Tensor) -> bool:
    """Whether :func:`pack` takes ``weight``: a CPU bfloat16 [N, K] with N a multiple of 16
    and K of 8."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 \
        and weight.dim() == 2 and weight.shape[0] % ROWS == 0 and weight.shape[1] % 8 == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 weight [N, K] (:func:`fits`) -> the kernel's layout: int32 [N / 16, K / 2, 16],
    element [g, c, l] holding row 16g + l's elements 2c (low half) and 2c + 1 (high half)."""
    if not fits(weight):
        raise ValueError(f"weight must be a CPU bfloat16 [N, K] tensor with N a multiple of "
                         f"{ROWS} and K of 8, got {weight.dtype} {tuple(weight.shape)} on "
                         f"{weight.device}")
    n, k = weight.shape
    pairs = weight.detach().contiguous().view(torch.int32)               # [N, K / 2]
    return pairs.reshape(n // ROWS, ROWS, k // 2).transpose(1, 2).contiguous()


class Bf16Weight:
    """One packed weight, its pointer and function looked up once: ``w(x, out=None)`` = x [M, K]
    W^T -> [M, N] bfloat16 (written into ``out`` when given). Unchecked: x must be a CPU
    bfloat16 [M, K] tensor with contiguous rows."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = pack(weight)
        self.n, self.k = weight.shape
        if (lib := LIBRARY.get()) is None:
            raise RuntimeError(f"the CPU bf16 kernel is unavailable: {LIBRARY.reason()}")
        self.function, self.pointer = lib.bf16_gemv, self.packed.data_ptr()

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.n, dtype=torch.bfloat16) if out is None else out
        profiled_call(self.function, "bf16_gemv", x.data_ptr(), x.stride(0), self.pointer,
                      out.data_ptr(), out.stride(0), x.shape[0], self.n, self.k)
        return out


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64 (before its bfloat16 rounding): x [M, K] @ W^T."""
    return x.double() @ weight.double().t()
