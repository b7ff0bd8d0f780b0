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
    matmul,
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


def softmax_rows_contiguous_rows(x, block):
    # row r read from r * n_cols, as if the rows were packed: right on a contiguous x, wrong on
    # the model's scores, whose rows are padded (and the padding is read as scores)
    m, n = x.shape
    rows = torch.as_strided(x, (m, n), (n, 1))
    return torch.softmax(rows, -1)


def softmax_rows_pads_with_zero(x, block):
    # masked lanes of a row's last tile load 0 instead of -inf: each counts exp(0 - max)
    pad = -x.shape[1] % block
    padded = torch.cat([x, x.new_zeros(x.shape[0], pad)], 1)
    return torch.softmax(padded, -1)[:, :x.shape[1]]


def _reads_past(t, shape):
    """t's memory read with t's strides over the larger ``shape``: the elements an unmasked
    load reaches past t's last column or row (0 past the end of its storage)."""
    flat = t.new_empty(0).set_(t.untyped_storage())
    reach = t.storage_offset() + sum((s - 1) * st for s, st in zip(shape, t.stride())) + 1
    flat = torch.cat([flat, flat.new_zeros(max(0, reach - flat.numel()))])
    return flat.as_strided(shape, t.stride(), t.storage_offset())


def matmul_no_k_mask(a, b, block_m, block_n, block_k):
    # masks the rows of A and the columns of B but not K: a last K tile that runs past K
    # multiplies whatever lies beyond each row of A with whatever lies beyond each column of B
    (m, k), n = a.shape, b.shape[1]
    k_tiles = -(-k // block_k) * block_k
    return _reads_past(a, (m, k_tiles)).double() @ _reads_past(b, (k_tiles, n)).double()


def matmul_contiguous_b(a, b, block_m, block_n, block_k):
    # B addressed as B + k * N + n (strides ignored): right only for a row-major B
    k, n = b.shape
    return a.double() @ torch.as_strided(b, (k, n), (n, 1)).double()


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
    (a2.check_softmax_in_model, softmax_rows, softmax_rows_contiguous_rows),
    (a2.check_softmax_in_model, softmax_rows, softmax_rows_pads_with_zero),
    (a2.check_tiled_matmul_bytes, tiled_matmul_bytes, tiled_bytes_read_once),
    (a2.check_tiled_matmul_bytes, tiled_matmul_bytes, tiled_bytes_swapped),
    (a2.check_matmul_in_model, matmul, matmul_no_k_mask),
    (a2.check_matmul_in_model, matmul, matmul_contiguous_b),
]
IDS = ["blocks_granularity", "blocks_reserved_smem", "intensity_no_output",
       "intensity_one_flop", "size_ridge_alone", "add_2d_contiguous", "add_2d_unit_stride",
       "softmax_no_max", "softmax_no_rescale", "model_softmax_contiguous_rows",
       "model_softmax_pads_with_zero", "tiled_read_once", "tiled_swapped",
       "model_matmul_no_k_mask", "model_matmul_contiguous_b"]


test_reference_passes, test_wrong_fails, test_stub_is_not_attempted = \
    checker_tests(CHECKS, IDS)


def test_package_functions_pass_their_checkers():
    from minillm.course import a2_roofline as roofline

    assert a2.check_matmul_intensity(roofline.matmul_intensity).passed is True
    assert a2.check_blocks_per_sm(
        lambda t, r, s: roofline.occupancy(t, r, s)["blocks_per_sm"]).passed is True
    assert a2.check_tiled_matmul_bytes(roofline.tiled_matmul_bytes).passed is True
