"""Appendix A2 (chapters/A2_gpu_hardware.ipynb) measurements on a GPU, written to one JSON file.

    python benchmarks/a2_gpu_check.py --out benchmarks/results/a2_gpu.json
    python benchmarks/a2_gpu_check.py --out /tmp/a2_smoke.json --smoke   # tiny, also on CPU

1. The device's properties as PyTorch reports them (SMs, L2, registers and shared memory per SM).
2. Copy bandwidth against buffer size (1 MiB .. 4 GiB): the L2 plateau, then HBM.
3. Matrix-product TFLOP/s of torch.mm at 8192^3 in fp32 (CUDA cores), TF32, fp16 and bf16
   (tensor cores).
4. The teaching kernels (vector add, fused softmax, tiled matmul) against torch: time, FLOPs and
   bytes, i.e. roofline points.
5. Branch divergence: ``minillm.kernels.divergence`` branchy vs branch-free against the fraction
   of elements on the slow path, placed at random or sorted.
6. Registers, spills, shared memory and warps of the compiled kernels (for the occupancy
   calculator).

The file is rewritten after every section, so a run cut short still leaves what it measured.
Sized to take well under two minutes on an H100/H200, compilation included.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minillm.course import a2_roofline as roofline  # noqa: E402
from minillm.device import setup_triton  # noqa: E402

INTERPRETING = setup_triton()
from minillm.kernels import divergence, softmax, vector_add  # noqa: E402
from minillm.kernels import matmul as mm  # noqa: E402


def seconds(fn, device: torch.device) -> float:
    """Median seconds per call: triton's do_bench (CUDA events, L2 flushed) on a GPU."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e-3
    fn()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def device_properties(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"name": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    p = torch.cuda.get_device_properties(device)
    keys = ["name", "multi_processor_count", "L2_cache_size", "regs_per_multiprocessor",
            "shared_memory_per_multiprocessor", "shared_memory_per_block_optin",
            "max_threads_per_multi_processor", "warp_size", "total_memory", "major", "minor"]
    return {k: getattr(p, k, None) for k in keys}


def bandwidth_sweep(device: torch.device, smoke: bool) -> list[dict]:
    sizes = [1, 4] if smoke else [1, 2, 4, 8, 16, 24, 32, 64, 128, 512, 2048, 4096]
    rows = []
    for mib in sizes:
        gbps = roofline.measure_bandwidth(device, nbytes=mib << 20, repeats=3 if smoke else 5)
        rows.append({"mib": mib, "GBps": gbps})
        print(f"  copy {mib:5d} MiB: {gbps:8.0f} GB/s")
    return rows


def matmul_rates(device: torch.device, smoke: bool) -> dict:
    n = 128 if smoke else 8192
    formats = {"fp32": (torch.float32, False)} if smoke else {
        "fp32": (torch.float32, False), "tf32": (torch.float32, True),
        "fp16": (torch.float16, False), "bf16": (torch.bfloat16, False)}
    rates = {}
    for name, (dtype, tf32) in formats.items():
        rates[name] = roofline.measure_matmul_rate(device, dtype, n=n, tf32=tf32)
        print(f"  torch.mm {n}^3 {name}: {rates[name]:.1f} TFLOP/s")
    return {"n": n, "tflops": rates}


def teaching_kernels(device: torch.device, smoke: bool) -> list[dict]:
    """Roofline points (name, group, flops, bytes, seconds) of our kernels and torch's."""
    dtype = torch.float16 if device.type == "cpu" else torch.bfloat16
    elem = 2
    rows = []

    def add(name, group, cost, fn):
        s = seconds(fn, device)
        rows.append({"name": name, "group": group, "flops": cost[0], "bytes": cost[1],
                     "seconds": s})
        print(f"  {name:28s} {s * 1e6:10.1f} us  {cost[1] / s / 1e9:8.0f} GB/s  "
              f"{cost[0] / s / 1e12:8.2f} TFLOP/s")

    def vector_adds(n: int) -> None:
        x, y = (torch.randn(n, device=device, dtype=dtype) for _ in range(2))
        cost = roofline.vector_add_cost(n, elem)
        add(f"vector_add n={n}", "Triton (ours)", cost, lambda: vector_add.vector_add(x, y))
        add(f"torch add n={n}", "torch", cost, lambda: torch.add(x, y))

    def softmaxes(rows_: int, cols: int) -> None:
        x = torch.randn(rows_, cols, device=device, dtype=dtype)
        cost = roofline.softmax_cost(rows_, cols, elem)
        add(f"softmax {rows_}x{cols}", "Triton (ours)", cost, lambda: softmax.softmax(x))
        add(f"torch.softmax {rows_}x{cols}", "torch", cost, lambda: torch.softmax(x, -1))
        add(f"unfused softmax {rows_}x{cols}", "torch, unfused", cost,
            lambda: softmax.softmax_reference(x))

    vector_adds(4096 if smoke else 1 << 28)
    softmaxes(*((8, 1000) if smoke else (32768, 4096)))
    for n in ([64] if smoke else [1024, 4096, 8192]):
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        cost = roofline.matmul_cost(n, n, n, elem)
        add(f"matmul {n}^3", "Triton (ours)", cost, lambda a=a, b=b: mm.matmul(a, b))
        add(f"torch.mm {n}^3", "torch", cost, lambda a=a, b=b: torch.mm(a, b))
    return rows


def divergence_sweep(device: torch.device, smoke: bool) -> dict:
    n = 4096 if smoke else 1 << 22
    n_iter = 4 if smoke else 64
    fractions = [0.0, 1 / 4096, 1 / 1024, 1 / 256, 1 / 64, 1 / 16, 1 / 4, 1 / 2, 1.0]
    g = torch.Generator().manual_seed(0)
    base = -(torch.rand(n, generator=g) + 0.1)
    perm = torch.randperm(n, generator=g)
    out = {"n": n, "n_iter": n_iter, "block": 32, "num_warps": 1, "rows": []}
    for layout in ("random", "sorted"):
        for f in fractions if layout == "random" else [1 / 4, 1 / 2]:
            k = round(f * n)
            idx = perm[:k] if layout == "random" else torch.arange(k)
            x = base.clone()
            x[idx] = -x[idx]
            groups, total = divergence.groups_taking_slow_path(x)
            x = x.to(device)
            ref = divergence.divergence_reference(x.double(), n_iter)
            row = {"layout": layout, "fraction": f, "slow_groups": groups, "groups": total}
            for name, fn in (("branchy", divergence.branchy),
                             ("branch_free", divergence.branch_free)):
                err = float((fn(x, n_iter).double() - ref).abs().max())
                row[f"{name}_ms"] = seconds(lambda fn=fn, x=x: fn(x, n_iter), device) * 1e3
                row[f"{name}_max_err"] = err
            out["rows"].append(row)
            print(f"  {layout:6s} f={f:.5f} warps on slow path {groups / total:6.3f}  "
                  f"branchy {row['branchy_ms']:.3f} ms  branch-free {row['branch_free_ms']:.3f} ms")
    return out


def compiled_resources(device: torch.device) -> dict:
    """Launch each kernel once directly and read what the compiler gave it."""
    if device.type != "cuda":
        return {}
    import triton

    res = {}
    x = torch.randn(1 << 20, device=device, dtype=torch.bfloat16)
    o = torch.empty_like(x)
    k = vector_add._vector_add_kernel[(triton.cdiv(x.numel(), 1024),)](x, x, o, x.numel(),
                                                                        BLOCK=1024)
    res["vector_add (BLOCK=1024)"] = roofline.triton_kernel_resources(k)
    s = torch.randn(64, 4096, device=device, dtype=torch.bfloat16)
    so = torch.empty_like(s)
    k = softmax._softmax_kernel[(64,)](s, so, 4096, 4096, 4096, BLOCK=4096, num_warps=16)
    res["softmax (row of 4096, 16 warps)"] = roofline.triton_kernel_resources(k)
    a = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    mm.matmul(a, a)  # autotunes
    best = mm._autotuned_matmul().best_config
    cfg = dict(best.all_kwargs())
    grid = (triton.cdiv(2048, cfg["BLOCK_M"]) * triton.cdiv(2048, cfg["BLOCK_N"]),)
    k = mm._matmul_kernel[grid](a, a, c, 2048, 2048, 2048, a.stride(0), a.stride(1), a.stride(0),
                                a.stride(1), c.stride(0), c.stride(1), DOT_PRECISION="tf32",
                                **cfg)
    label = "matmul (autotuned {}x{}x{}, {} stages)".format(
        cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg.get("num_stages"))
    res[label] = roofline.triton_kernel_resources(k)
    d = torch.randn(1 << 16, device=device)
    do = torch.empty_like(d)
    for name, kern in (("branchy", divergence._branchy_kernel),
                       ("branch_free", divergence._branch_free_kernel)):
        k = kern[(d.numel() // 32,)](d, do, d.numel(), N_ITER=64, BLOCK=32, num_warps=1)
        res[f"divergence {name} (BLOCK=32, 1 warp)"] = roofline.triton_kernel_resources(k)
    for name, r in res.items():
        print(f"  {name:44s} {r}")
    return res


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        parser.error("no GPU: run with --smoke to check the script in the Triton interpreter")
    import triton

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
        f"cpu ({platform.processor() or platform.machine()}, Triton interpreter)",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "script": "benchmarks/a2_gpu_check.py", "torch": torch.__version__,
        "triton": triton.__version__, "smoke": args.smoke, "interpreter": INTERPRETING,
    }
    t_start = time.time()
    sections = [("properties", device_properties), ("bandwidth_by_size", bandwidth_sweep),
                ("matmul", matmul_rates), ("kernels", teaching_kernels),
                ("divergence", divergence_sweep), ("compiled", compiled_resources)]
    for key, fn in sections:
        t0 = time.time()
        print(f"\n{key}")
        try:
            result[key] = fn(device) if key in ("properties", "compiled") else fn(device,
                                                                                args.smoke)
        except Exception as exc:  # record and go on: one failure should not lose the rest
            result[key] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"  FAILED: {type(exc).__name__}: {exc}")
        result[f"{key}_s"] = time.time() - t0
        result["elapsed_s"] = time.time() - t_start
        out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out} ({result['elapsed_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
