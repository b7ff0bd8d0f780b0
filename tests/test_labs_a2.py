"""Appendix B checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import math

from lab_checks import checker_tests

from minillm.labs import a2
from minillm.labs.solutions.a2 import (
    blocks_per_sm,
    compute_bound_size,
    matmul_intensity,
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


CHECKS = [
    (a2.check_blocks_per_sm, blocks_per_sm, blocks_ignoring_granularity),
    (a2.check_blocks_per_sm, blocks_per_sm, blocks_without_reserved_smem),
    (a2.check_matmul_intensity, matmul_intensity, intensity_without_output),
    (a2.check_matmul_intensity, matmul_intensity, intensity_one_flop_per_mac),
    (a2.check_compute_bound_size, compute_bound_size, size_from_ridge_alone),
]
IDS = ["blocks_granularity", "blocks_reserved_smem", "intensity_no_output",
       "intensity_one_flop", "size_ridge_alone"]


test_reference_passes, test_wrong_fails, test_stub_is_not_attempted = \
    checker_tests(CHECKS, IDS)


def test_package_functions_pass_their_checkers():
    from minillm.course import a2_roofline as roofline

    assert a2.check_matmul_intensity(roofline.matmul_intensity).passed is True
    assert a2.check_blocks_per_sm(
        lambda t, r, s: roofline.occupancy(t, r, s)["blocks_per_sm"]).passed is True
