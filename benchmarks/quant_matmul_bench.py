"""minillm's CPU integer matmuls against PyTorch's weight-only ops, by rows, at SmolLM2's shapes.

    python benchmarks/quant_matmul_bench.py [--rows 1 2 4 8 16 32] [--rounds R] [--isa avx2]
                                            [--out FILE.json]

For each of a SmolLM2 layer's four matmuls (q/k/v and gate/up as one, as the engine runs them:
960x576, 576x576, 3072x576, 576x1536; random weights) and the int8 output head (49152x576),
int8 and int4 (groups of 32) weights: minillm's kernel
(:mod:`minillm.kernels.cpu_quant_matmul`, the activations quantized in blocks of 32) and
PyTorch's ops (``aten._weight_int8pack_mm``, ``aten._weight_int4pack_mm_for_cpu``, bfloat16
activations), each through the layer class that calls it (``Int8Linear`` / ``Int4Linear`` with
``KERNEL_ROWS`` moved out of the way). Both take turns ``rounds`` times; the medians of the
microseconds a call and their ratio are reported, with the CPU model and flags and the load
average. The ratio by rows is where ``minillm.quant.linear.KERNEL_ROWS`` comes from.

``--isa avx2`` measures an AVX2-only CPU's paths on this one (``MINILLM_CPU_ISA=avx2``,
:func:`minillm.device.emulated_isa`: our kernels built without AVX-512 and VNNI, so the C++
takes its AVX2 branch, 256-bit registers, ``vpmaddubsw`` + ``vpmaddwd`` for the integer dot
products; ``KERNEL_ROWS`` that CPU's; PyTorch capped at AVX2, for which the script re-runs
itself with the variables torch reads when it loads); it writes ``quant_matmul_avx2.json``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from minillm.bench.common import write_json
from minillm.device import CPU_ISA_ENV, EMULATED_TORCH_ENV, emulated_isa
from minillm.quant import linear as qlinear
from minillm.quant.formats import quantize_int8
from minillm.quant.quantize import rtn_int4
from minillm.runinfo import machine_info

KERNEL_ROWS = dict(qlinear.KERNEL_ROWS)  # the package's choice, restored after each measurement
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "head": (49152, 576)}


def per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def measure(name: str, kind: str, rows: int, rounds: int) -> dict:
    n, k = SHAPES[name]
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05
    lin = qlinear.Int8Linear(*quantize_int8(w)) if kind == "int8" else \
        qlinear.Int4Linear(*rtn_int4(w, 32), 32)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    calls = max(3, int(2e8 // (n * k * max(rows, 4))))
    times: dict[str, list[float]] = {"kernel": [], "torch": []}
    with torch.inference_mode():
        for _ in range(rounds + 1):                        # the first round warms up
            for way in times:
                qlinear.KERNEL_ROWS = dict.fromkeys(KERNEL_ROWS, 1 << 30 if way == "kernel" else 0)
                times[way].append(per_call_us(lambda: lin(x), calls))
    qlinear.KERNEL_ROWS = dict(KERNEL_ROWS)
    torch_us, kernel_us = (statistics.median(times[w][1:]) for w in ("torch", "kernel"))
    row = {"matmul": name, "shape": [n, k], "weights": kind, "rows": rows,
           "torch_us": round(torch_us, 1), "kernel_us": round(kernel_us, 1),
           "speedup": round(torch_us / kernel_us, 2)}
    print(f"{kind} {name:8s} rows {rows:3d}: torch {torch_us:8.1f} us  kernel {kernel_us:8.1f} "
          f"us  x{torch_us / kernel_us:.2f}")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--isa", choices=["native", "avx2"], default="native")
    p.add_argument("--out", default=None, help="default: benchmarks/results/quant_matmul.json, "
                                               "quant_matmul_avx2.json with --isa avx2")
    args = p.parse_args()
    args.out = args.out or ("benchmarks/results/quant_matmul" +
                            ("_avx2" if args.isa == "avx2" else "") + ".json")
    isa = {"isa": "native"}
    if args.isa == "avx2":
        want = {CPU_ISA_ENV: "avx2", **EMULATED_TORCH_ENV["avx2"]}
        if any(os.environ.get(k) != v for k, v in want.items()):     # before torch loads
            os.execve(sys.executable, [sys.executable, *sys.argv], os.environ | want)
        assert emulated_isa() == "avx2"
        isa = {"isa": "avx2", "isa_note": "an AVX2-only CPU's paths on this one: kernels built "
               "-mno-avx512f -mno-avxvnni, ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2",
               "aten_capability": torch.backends.cpu.get_cpu_capability()}
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    results = [measure(name, kind, rows, args.rounds) for kind in ("int8", "int4")
               for name in SHAPES for rows in args.rows]
    write_json({
        "benchmark": "quant_matmul", **machine_info(torch.device("cpu"), args.threads),
        "load_average": [load, os.getloadavg()[0]], "rounds": args.rounds,
        "kernel_rows": KERNEL_ROWS, **isa,
        "method": "median microseconds a call through Int8Linear/Int4Linear, bfloat16 "
                  "activations, kernel and torch taking turns, first round dropped",
        "results": results}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
