"""Checkers for the exercises of Appendix B (GPU hardware), notebook ``A2_gpu_hardware``.

Each ``check_*`` takes the student's function, compares it with :mod:`minillm.course.a2_roofline`
on a
few cases, prints a one-line verdict and returns a :class:`~minillm.labs.common.Result`
(``passed`` is None while the exercise still raises NotImplementedError).
"""
from __future__ import annotations

import math
from collections.abc import Callable

from ..course.a2_roofline import GPU_SPECS, HOPPER_SM, matmul_intensity, occupancy, ridge_point
from .common import Result, check


def check_blocks_per_sm(fn: Callable[[int, int, int], int]) -> Result:
    """``fn(threads_per_block, registers_per_thread, smem_per_block)`` -> how many blocks fit on
    one H100/H200 SM at once (compute capability 9.0 limits: 64 warps, 32 blocks, 65,536
    registers handed out per warp in chunks of 256, 228 KB of shared memory with 1 KB reserved
    per block and 128-byte granularity). Compared with
    :func:`minillm.course.a2_roofline.occupancy`."""
    cases = [(256, 32, 0), (128, 128, 0), (1024, 64, 0), (32, 16, 0), (96, 40, 0),
             (128, 72, 0), (256, 255, 0), (64, 32, 48 * 1024), (128, 32, 100 * 1024),
             (128, 168, 16 * 1024), (512, 24, 4000), (33, 1, 0), (1, 0, 227 * 1024),
             (256, 128, 64 * 1024 - 1024), (256, 33, 0), (128, 100, 0),
             (64, 32, 57 * 1024)]

    def attempt() -> None:
        for threads, regs, smem in cases:
            got = fn(threads, regs, smem)
            want = occupancy(threads, regs, smem, HOPPER_SM)
            assert got == want["blocks_per_sm"], (
                f"threads_per_block={threads}, registers_per_thread={regs}, smem_per_block="
                f"{smem}: got {got} blocks, expected {want['blocks_per_sm']} (limited by "
                f"{want['limiter']})")

    return check("blocks_per_sm", attempt)


def check_matmul_intensity(fn: Callable[[int, int, int, int], float]) -> Result:
    """``fn(m, n, k, bytes_per_elem)`` -> FLOP per byte of C[m, n] = A[m, k] @ B[k, n] when A
    and B are read once and C written once (a multiply-add is two FLOPs)."""
    cases = [(1, 1, 1, 4), (4096, 4096, 4096, 2), (1, 4096, 4096, 2), (16, 11008, 4096, 2),
             (8192, 1, 8192, 1), (3, 5, 7, 4), (128, 128, 64, 2)]

    def attempt() -> None:
        for m, n, k, b in cases:
            got = float(fn(m, n, k, b))
            want = matmul_intensity(m, n, k, b)
            assert math.isclose(got, want, rel_tol=1e-9), (
                f"m={m}, n={n}, k={k}, bytes_per_elem={b}: got {got:.6g} FLOP/byte, expected "
                f"{want:.6g}")

    return check("matmul_intensity", attempt)


def smallest_compute_bound_square(bandwidth: float, peak_flops: float,
                                  bytes_per_elem: int) -> int:
    """Smallest n for which an n x n @ n x n product reaches the ridge point."""
    ridge = ridge_point(bandwidth, peak_flops)
    n = max(1, math.floor(1.5 * bytes_per_elem * ridge) - 2)
    while matmul_intensity(n, n, n, bytes_per_elem) < ridge:
        n += 1
    return n


def check_compute_bound_size(fn: Callable[[float, float, int], int]) -> Result:
    """``fn(bandwidth, peak_flops, bytes_per_elem)`` (bytes/s, FLOP/s) -> the smallest n for
    which a square n x n @ n x n matrix product, reading A and B and writing C once, has an
    arithmetic intensity at or above the ridge point (so it can be compute-bound)."""
    cases = [(s.bandwidth, s.peak_flops, b) for s in GPU_SPECS.values() for b in (1, 2, 4)]
    cases += [(20e9, 0.5e12, 4), (100e9, 3e12, 2), (1e12, 1e12, 2)]

    def attempt() -> None:
        for bw, peak, b in cases:
            got = fn(bw, peak, b)
            want = smallest_compute_bound_square(bw, peak, b)
            assert got == want, (
                f"bandwidth={bw:.3g} B/s, peak={peak:.3g} FLOP/s, bytes_per_elem={b}: got "
                f"n={got}, expected {want} (ridge {ridge_point(bw, peak):.1f} FLOP/byte)")

    return check("compute_bound_size", attempt)
