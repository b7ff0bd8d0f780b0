"""The bfloat16 matrix-vector kernel against oneDNN's packed matmul, by rows: where the CPU fast
path should switch from one to the other (``minillm.model.packed.GEMV_ROWS``).

    python benchmarks/cpu_gemv_bench.py [--rows 1 2 4 6 8 12 16] [--reps 15] [--out FILE.json]

A decode step of b sequences multiplies b rows by each weight; a speculative verify step of
one sequence multiplies 1 + k rows. SmolLM2's four matmuls a layer ([Wq Wk Wv], Wo, [Wg Wu],
Wd), 30 layers of them with random bfloat16 weights (so each layer's weights are out of cache
when it runs, as in the model), are run through ``minillm.kernels.cpu_bf16_gemv`` and through
``torch.ops.mkldnn`` on the same weights packed, alternating, ``reps`` times a row count; the
medians of the 30-layer times are reported with the CPU model, flags and load average.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from minillm.kernels import cpu_bf16_gemv

from minillm.bench.common import write_json
from minillm.device import cpu_features
from minillm.model.packed import pack_weight, packed_matmul
from minillm.runinfo import machine_info

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))    # [N, K] of a SmolLM2 layer
LAYERS = 30


def step_ms(calls: list, inputs: dict[int, torch.Tensor]) -> float:
    """Milliseconds of one pass over ``calls`` ((function, K) each), each on the contiguous
    input of its K (as the engine hands them)."""
    start = time.perf_counter()
    for f, k in calls:
        f(inputs[k])
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 6, 8, 9, 12, 16])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default="benchmarks/results/cpu_gemv.json")
    args = ap.parse_args()
    if not cpu_bf16_gemv.available():
        raise SystemExit("the bf16 matrix-vector kernel does not run here (it needs AVX-512 "
                         "BF16 and a C++ compiler)")
    torch.manual_seed(0)
    weights = [torch.randn(n, k, dtype=torch.bfloat16) * 0.05 for _ in range(LAYERS)
               for n, k in SHAPES]
    gemv = [(cpu_bf16_gemv.Bf16Weight(w), w.shape[1]) for w in weights]
    packed = [pack_weight(w) for w in weights]
    onednn = [((lambda x, p=p: packed_matmul(x, p)), w.shape[1]) for p, w in zip(packed, weights)]
    rows = []
    with torch.inference_mode():
        for m in args.rows:
            x = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in {k for _, k in SHAPES}}
            times = {"gemv": [], "onednn": []}
            for _ in range(args.reps + 2):
                for name, calls in (("gemv", gemv), ("onednn", onednn)):
                    times[name].append(step_ms(calls, x))
            row = {"rows": m, **{f"{name}_ms": statistics.median(t[2:])
                                 for name, t in times.items()}}
            row["onednn_over_gemv"] = row["onednn_ms"] / row["gemv_ms"]
            rows.append(row)
            print(f"rows {m:3d}  gemv {row['gemv_ms']:6.2f} ms  oneDNN {row['onednn_ms']:6.2f} ms"
                  f"  oneDNN / gemv {row['onednn_over_gemv']:.2f}", flush=True)
    report = {"benchmark": "cpu_gemv", "shapes": [list(s) for s in SHAPES], "layers": LAYERS,
              "reps": args.reps, "method": "30 layers of SmolLM2's four matmuls, random bf16 "
              "weights, the two kernels alternating; medians", "rows": rows,
              "cpu_flags": sorted(cpu_features()), "load_average": list(os.getloadavg()),
              **machine_info(torch.device("cpu"), torch.get_num_threads())}
    print("wrote", write_json(report, args.out))


if __name__ == "__main__":
    main()
