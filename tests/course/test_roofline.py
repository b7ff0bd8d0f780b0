"""minillm.course.a2_roofline: the roofline model on hand cases, the measurements on the CPU, the
spec table,
the occupancy calculator, and the divergence teaching kernel in Triton's interpreter."""
from minillm.device import setup_triton

setup_triton()  # before any kernel module is imported

import json  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from minillm.course import a2_roofline as roofline  # noqa: E402
from minillm.course.a2_roofline import (  # noqa: E402
    GPU_SPECS,
    HOPPER_SM,
    KernelPoint,
    attainable,
    kernel_points,
    occupancy,
    ridge_point,
)

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- the model
def test_ridge_point_hand_cases():
    assert ridge_point(2e12, 100e12) == 50.0
    assert ridge_point(4.8, 989) == pytest.approx(206.0417, rel=1e-5)  # TB/s and TFLOP/s
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="bandwidth"):
            ridge_point(bad, 1.0)
        with pytest.raises(ValueError, match="peak_flops"):
            ridge_point(1.0, bad)


def test_attainable_is_min_of_the_two_roofs():
    bw, peak = 2e12, 100e12  # ridge at 50 FLOP/byte
    assert attainable(1.0, bw, peak) == 2e12  # memory-bound: bw x I
    assert attainable(10, bw, peak) == 20e12
    assert attainable(50, bw, peak) == 100e12  # exactly at the ridge both roofs agree
    assert attainable(1000, bw, peak) == 100e12  # compute-bound: the peak
    assert attainable(0, bw, peak) == 0.0
    xs = np.array([0.5, 25, 50, 75, 1e6])
    np.testing.assert_array_equal(attainable(xs, bw, peak), np.minimum(bw * xs, peak))
    assert isinstance(attainable(3, bw, peak), float)
    with pytest.raises(ValueError, match="intensity"):
        attainable(-1, bw, peak)


def test_kernel_points_hand_case():
    pts = kernel_points([
        {"name": "copy", "flops": 0, "bytes": 2e9, "seconds": 1e-3},
        ("gemm", 2 * 4096**3, 3 * 4096**2 * 2, 0.2e-3),
    ])
    copy, gemm = pts
    assert copy.name == "copy" and copy.intensity == 0 and copy.rate == 0
    assert copy.bandwidth == pytest.approx(2e12)
    assert gemm.intensity == pytest.approx(4096 / 3)  # 2n^3 / (3 n^2 x 2 bytes)
    assert gemm.rate == pytest.approx(2 * 4096**3 / 0.2e-3)
    # on a 1 TB/s, 1000 TFLOP/s machine the gemm (I = 1365) may reach the peak
    assert gemm.fraction_of_roof(1e12, 1000e12) == pytest.approx(gemm.rate / 1000e12)
    assert copy.fraction_of_roof(4e12, 1000e12) == pytest.approx(0.5)  # memory roof
    with pytest.raises(ValueError, match="seconds"):
        KernelPoint("bad", 1.0, 1.0, 0.0)


def test_matmul_and_attention_costs():
    flops, nbytes = roofline.matmul_cost(2, 3, 4, 2)
    assert (flops, nbytes) == (48, (8 + 12 + 6) * 2)
    assert roofline.matmul_intensity(1, 4096, 4096, 2) < 1.0  # a matrix-vector product
    f, b = roofline.attention_cost(1, 1, 1024, 64, causal=False, bytes_per_elem=2)
    assert f / b == pytest.approx(1024 / 2)  # N/2 FLOP/byte for 16-bit q, k, v, out
    fc, _ = roofline.attention_cost(1, 1, 1024, 64, causal=True, bytes_per_elem=2)
    assert fc == f / 2
    f, b = roofline.decode_attention_cost(1, 100_000, 32, 8, 128, 2)
    assert f / b == pytest.approx(4.0, rel=1e-3)  # about q_heads / kv_heads


def test_points_from_the_h200_benchmark_json():
    result = json.loads((ROOT / "benchmarks/results/kernels_gpu.json").read_text())
    pts = roofline.points_from_kernel_benchmark(result)
    assert len(pts) == len(result["flash_attention"]) + len(result["paged_decode"])
    fa = result["flash_attention"][0]
    p = pts[0]
    assert p.rate == pytest.approx(fa["triton_tflops"] * 1e12)
    dec = result["paged_decode"][-1]
    q = pts[-1]
    assert q.bandwidth == pytest.approx(dec["GBps"] * 1e9)
    assert 3.9 < q.intensity < 4.1  # GQA 32/8: four query heads per K/V byte pair


# ----------------------------------------------------------------------------- measuring
def test_measure_bandwidth_cpu_small():
    gbps = roofline.measure_bandwidth("cpu", nbytes=1 << 16, repeats=1)
    assert math.isfinite(gbps) and gbps > 0


@pytest.mark.parametrize("dtype", ["float32", torch.bfloat16])
def test_measure_matmul_rate_cpu_small(dtype):
    tflops = roofline.measure_matmul_rate("cpu", dtype, n=64, repeats=1)
    assert math.isfinite(tflops) and tflops > 0


def test_measure_rejects_bad_arguments():
    with pytest.raises(ValueError, match="nbytes"):
        roofline.measure_bandwidth("cpu", nbytes=0)
    with pytest.raises(ValueError, match="dtype"):
        roofline.measure_matmul_rate("cpu", "float8", n=8)


# ----------------------------------------------------------------------------- the spec table
def test_gpu_specs_are_complete_and_consistent():
    assert set(GPU_SPECS) == {"A100 SXM 80GB", "H100 SXM", "H200 SXM", "MI300X", "B200"}
    for s in GPU_SPECS.values():
        assert s.hbm_tb_s > 0 and s.bf16_tflops > 0 and s.hbm_gb > 0
        assert "datasheet" in s.source and s.name.split()[0] in s.source
        assert 100 < s.ridge < 400  # every modern GPU needs hundreds of FLOPs per byte
    h100, h200 = GPU_SPECS["H100 SXM"], GPU_SPECS["H200 SXM"]
    assert h200.bf16_tflops == h100.bf16_tflops and h200.units == h100.units == 132
    assert h200.hbm_tb_s > h100.hbm_tb_s  # same chip, faster memory
    assert GPU_SPECS["MI300X"].warp_size == 64 and h200.warp_size == 32


# ----------------------------------------------------------------------------- occupancy
def test_occupancy_hand_cases():
    full = occupancy(256, 32, 0)  # 8 warps, 8 x 32 x 32 regs: 8 blocks, 64 warps
    assert full["blocks_per_sm"] == 8 and full["occupancy"] == 1.0 and full["limiter"] == "warps"
    regs = occupancy(128, 128, 0)  # 4096 regs per warp x 4 warps -> 4 blocks
    assert regs["blocks_per_sm"] == 4 and regs["limiter"] == "registers"
    assert regs["occupancy"] == 0.25
    smem = occupancy(128, 32, 100 * 1024)  # 101 KB with the reserved KB -> 2 in 228 KB
    assert smem["blocks_per_sm"] == 2 and smem["limiter"] == "shared memory"
    tiny = occupancy(32, 16, 0)  # one warp per block: the 32-block limit binds
    assert tiny["blocks_per_sm"] == 32 and tiny["limiter"] == "blocks"
    assert tiny["occupancy"] == 0.5
    odd = occupancy(256, 33, 0)  # 33 x 32 = 1056 -> 1280 registers per warp
    assert odd["blocks_per_sm"] == 65536 // (1280 * 8)
    assert occupancy(128, 32, 48 * 1024, roofline.AMPERE_SM)["blocks_per_sm"] == 3


@pytest.mark.parametrize("kwargs,match", [
    (dict(threads_per_block=0, registers_per_thread=32), "threads_per_block"),
    (dict(threads_per_block=2048, registers_per_thread=32), "threads_per_block"),
    (dict(threads_per_block=128, registers_per_thread=256), "registers_per_thread"),
    (dict(threads_per_block=128, registers_per_thread=32, smem_per_block=HOPPER_SM.smem_per_sm),
     "smem_per_block"),
])
def test_occupancy_rejects_impossible_blocks(kwargs, match):
    with pytest.raises(ValueError, match=match):
        occupancy(**kwargs)


# ----------------------------------------------------------------------------- divergence kernel
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU only)")
@pytest.mark.parametrize("fraction", [0.0, 0.03, 0.5, 1.0])
def test_divergence_kernels_match_reference(fraction):
    from minillm.kernels import divergence as dv

    g = torch.Generator().manual_seed(0)
    x = -torch.rand(203, generator=g) - 0.1  # all on the fast path ...
    hot = torch.rand(203, generator=g) < fraction
    x[hot] = -x[hot]  # ... except a random fraction
    ref = dv.divergence_reference(x.double(), 5)
    for fn in (dv.branchy, dv.branch_free):
        torch.testing.assert_close(fn(x, n_iter=5).double(), ref, atol=1e-5, rtol=1e-5)
    groups, total = dv.groups_taking_slow_path(x)
    assert total == 7 and groups == sum(bool(c.any()) for c in (x > 0).split(32))


def test_divergence_rejects_bad_input():
    from minillm.kernels import divergence as dv

    with pytest.raises(ValueError, match="x must have dtype"):
        dv.branchy(torch.zeros(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="block"):
        dv.branch_free(torch.zeros(4), block=24)
