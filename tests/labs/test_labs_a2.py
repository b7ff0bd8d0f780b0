"""Appendix A2 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import math

import torch
from lab_checks import checker_tests

from minillm.labs import a2
from minillm.labs.solutions.a2 import (
    add_2d,
    blocks_per_sm,
    compute_bound_size,
    matmul_intensity,
    softmax_rows,
    tiled_matmul_bytes,
)

# --- wrong solutions -----------------------------------------------------------------------


def blocks_ignoring_granularity(threads, regs, smem):
    warps = math.ceil(threads / 32)
    limits = [64 // warps, 32, 228 * 1024 // (smem + 1024)]
    if regs:
        limits.append(65536 // (regs * 32 * warps))  # no rounding to 256 per warp
    return min(limits)


def blocks_without_reserved_smem(threads, regs, smem):
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(regs * 32 / 256) * 256
    limits = [64 // warps, 32]
    if smem:
        limits.append(228 * 1024 // (math.ceil(smem / 128) * 128))
    if regs_per_warp:
        limits.append(65536 // (regs_per_warp * warps))
    return min(limits)


def intensity_without_output(m, n, k, bytes_per_elem):
    return 2 * m * n * k / ((m * k + k * n) * bytes_per_elem)  # forgot writing C


def intensity_one_flop_per_mac(m, n, k, bytes_per_elem):
    return m * n * k / ((m * k + k * n + m * n) * bytes_per_elem)


def size_from_ridge_alone(bandwidth, peak_flops, bytes_per_elem):
    return math.ceil(peak_flops / bandwidth)  # n = ridge, forgetting 2n/(3b)


def add_2d_assumes_contiguous(x, y, block_m, block_n):
    # offsets i * N + j, as if every input were a contiguous row-major matrix
    m, n = x.shape
    return (torch.as_strided(x, (m, n), (n, 1)) + torch.as_strided(y, (m, n), (n, 1))).clone()


def add_2d_unit_column_stride(x, y, block_m, block_n):
    # uses the row strides but assumes the columns are adjacent (stride 1)
    m, n = x.shape
    return (torch.as_strided(x, (m, n), (x.stride(0), 1))
            + torch.as_strided(y, (m, n), (y.stride(0), 1))).clone()


def softmax_rows_no_max(x, block):
    e = torch.exp(x)  # overflows for scores in the hundreds
    return e / e.sum(-1, keepdim=True)


def softmax_rows_no_rescale(x, block):
    # each tile's exps are taken against the max so far, and old sums are never rescaled
    m = torch.full((x.shape[0], 1), float("-inf"))
    total = torch.zeros(x.shape[0], 1)
    for start in range(0, x.shape[1], block):
        tile = x[:, start:start + block]
        m = torch.maximum(m, tile.max(-1, keepdim=True).values)
        total = total + torch.exp(tile - m).sum(-1, keepdim=True)
    return torch.exp(x - m) / total


def tiled_bytes_read_once(m, n, k, block_m, block_n, bytes_per_elem):
    return (m * k + k * n + m * n) * bytes_per_elem  # the ideal, not what a tiled kernel moves


def tiled_bytes_swapped(m, n, k, block_m, block_n, bytes_per_elem):
    # A re-read once per row tile and B once per column tile: the wrong way round
    return (m * k * -(-m // block_m) + k * n * -(-n // block_n) + m * n) * bytes_per_elem


CHECKS = [
    (a2.check_blocks_per_sm, blocks_per_sm, blocks_ignoring_granularity),
    (a2.check_blocks_per_sm, blocks_per_sm, blocks_without_reserved_smem),
    (a2.check_matmul_intensity, matmul_intensity, intensity_without_output),
    (a2.check_matmul_intensity, matmul_intensity, intensity_one_flop_per_mac),
    (a2.check_compute_bound_size, compute_bound_size, size_from_ridge_alone),
    (a2.check_add_2d, add_2d, add_2d_assumes_contiguous),
    (a2.check_add_2d, add_2d, add_2d_unit_column_stride),
    (a2.check_softmax_rows, softmax_rows, softmax_rows_no_max),
    (a2.check_softmax_rows, softmax_rows, softmax_rows_no_rescale),
    (a2.check_tiled_matmul_bytes, tiled_matmul_bytes, tiled_bytes_read_once),
    (a2.check_tiled_matmul_bytes, tiled_matmul_bytes, tiled_bytes_swapped),
]
IDS = ["blocks_granularity", "blocks_reserved_smem", "intensity_no_output",
       "intensity_one_flop", "size_ridge_alone", "add_2d_contiguous", "add_2d_unit_stride",
       "softmax_no_max", "softmax_no_rescale", "tiled_read_once", "tiled_swapped"]


test_reference_passes, test_wrong_fails, test_stub_is_not_attempted = \
    checker_tests(CHECKS, IDS)


def test_package_functions_pass_their_checkers():
    from minillm.course import a2_roofline as roofline

    assert a2.check_matmul_intensity(roofline.matmul_intensity).passed is True
    assert a2.check_blocks_per_sm(
        lambda t, r, s: roofline.occupancy(t, r, s)["blocks_per_sm"]).passed is True
    assert a2.check_tiled_matmul_bytes(roofline.tiled_matmul_bytes).passed is True
