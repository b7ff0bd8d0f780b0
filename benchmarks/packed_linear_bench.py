"""oneDNN-packed linears against F.linear, fp32 and bf16, at the model's shapes (CPU).

    python benchmarks/packed_linear_bench.py [--threads N]
        [--out benchmarks/results/packed_linear.json]

For each weight shape of SmolLM2-135M (q/k/v grouped, gate/up grouped, down, the tied output
head) and each row count (1 = one decode step at batch 1, up to 256), times ``F.linear`` and
``torch.ops.mkldnn._linear_pointwise`` on the reordered weight (what
``minillm.model.PackedLinear`` and ``PackedGroup`` call), interleaved, best of a few rounds, and
records the largest difference between the two. Writes JSON with the CPU model and flags.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from minillm.bench.common import write_json
from minillm.device import cpu_features
from minillm.model.packed import can_pack_linears
from minillm.runinfo import machine_info

SHAPES = {"qkv (grouped)": (576 + 2 * 192, 576), "gate+up (grouped)": (2 * 1536, 576),
          "down": (576, 1536), "lm_head": (49152, 576)}
ROWS = (1, 16, 64, 256)


def best_ms(fn, rounds: int = 5, calls: int = 10) -> float:
    """Best of ``rounds`` means of ``calls`` calls, in ms (after two warm-up calls)."""
    fn(), fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e3


def measure(dtype: torch.dtype) -> list[dict]:
    rows = []
    for name, (out_f, in_f) in SHAPES.items():
        w = torch.randn(out_f, in_f).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        for m in ROWS:
            x = torch.randn(m, in_f).to(dtype)

            def plain(x=x, w=w):
                return F.linear(x, w)

            def onednn(x=x, packed=packed):
                return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

            t_plain, t_packed = best_ms(plain), best_ms(onednn)
            diff = (plain().float() - onednn().float()).abs().max().item()
            rows.append({"dtype": str(dtype).removeprefix("torch."), "weight": name,
                         "shape": [out_f, in_f], "rows": m, "f_linear_ms": round(t_plain, 4),
                         "packed_ms": round(t_packed, 4), "speedup": round(t_plain / t_packed, 2),
                         "max_abs_diff": diff})
            print(f"{rows[-1]['dtype']:9s} {name:18s} M={m:4d}  F.linear {t_plain:8.3f} ms  "
                  f"packed {t_packed:8.3f} ms  x{t_plain / t_packed:4.2f}  diff {diff:.2g}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default="benchmarks/results/packed_linear.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = [d for d in (torch.float32, torch.bfloat16)
              if can_pack_linears(torch.device("cpu"), d)]
    with torch.inference_mode():
        rows = [r for d in dtypes for r in measure(d)]
    report = {**machine_info(torch.device("cpu"), args.threads),
              "cpu_flags": sorted(cpu_features()), "packs": [str(d)[6:] for d in dtypes],
              "results": rows}
    print("wrote", write_json(report, args.out))


if __name__ == "__main__":
    main()
