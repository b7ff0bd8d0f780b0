"""Appendix A2's key: reference solutions, written from the rules the chapter teaches."""
from __future__ import annotations

import math

from minillm.labs import a2

# ----------------


def blocks_per_sm(threads, regs, smem):
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(regs * 32 / 256) * 256
    smem_per_block = math.ceil((smem + 1024) / 128) * 128
    limits = [64 // warps, 32, 228 * 1024 // smem_per_block]
    if regs_per_warp:
        limits.append(65536 // (regs_per_warp * warps))
    return min(limits)


def matmul_intensity(m, n, k, bytes_per_elem):
    return 2 * m * n * k / ((m * k + k * n + m * n) * bytes_per_elem)


def compute_bound_size(bandwidth, peak_flops, bytes_per_elem):
    # 2n^3 / (3 n^2 b) >= peak / bw  <=>  n >= 1.5 b peak / bw
    return math.ceil(1.5 * bytes_per_elem * peak_flops / bandwidth - 1e-9)


KEY = [
    (a2.check_blocks_per_sm, blocks_per_sm),
    (a2.check_matmul_intensity, matmul_intensity),
    (a2.check_compute_bound_size, compute_bound_size),
]
