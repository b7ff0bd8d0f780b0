"""Appendix A3 on a GPU: CUDA-graph capture and torch.compile of the decode step, at SmolLM2's
shapes (seeded random weights: the model file cannot travel to the GPU machine).

1. Correctness: a StaticDecoder with graphs captured for batch sizes 1, 2, 4, 8 (compiled: 4
   alone) gives the plain generate loop's greedy tokens for 3 prompts of different lengths run
   as one batch (padded to 4), in float32.
2. ``bench runtime`` at batch 1: bf16 eager, compiled, captured, compiled + captured.
3. The decode step by batch size 1..64, eager static step vs captured graphs (padded sizes).
4. The eager step's profile by kernel category (device time).

    python benchmarks/gpu_runtime_check.py --out benchmarks/results/runtime_gpu.json
On a CPU it runs a smoke test of the script (tiny preset, no graphs).
"""
from __future__ import annotations

import argparse
import time

import torch

from minillm import SamplingParams
from minillm.bench.common import write_json
from minillm.bench.runtime import GPU_CONFIGS, batch_sweep, parse_config, run_runtime_bench
from minillm.checkpoint import load_model
from minillm.device import resolve_device
from minillm.generate import generate
from minillm.runinfo import machine_info
from minillm.runtime import StaticDecoder, profile_decode

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def correctness(name: str, dev: torch.device, cuda: bool) -> dict:
    model, _ = load_model(name, device=dev, dtype=torch.float32, random_weights=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 5000, (n,), generator=g).tolist() for n in (37, 5, 120)]
    ref = [generate(model, p, GREEDY) for p in prompts]
    out = {}
    for compiled in (False, True):
        start = time.perf_counter()
        # compiled, only the size the 3 prompts pad to: each more size costs a compile
        # (float32 at 4 sizes took 99 s of the check's 200 s on the H200, 2026-12-04)
        sizes = ([4] if compiled else [1, 2, 4, 8]) if cuda else None
        dec = StaticDecoder(model, max_len=160, max_batch=8, compile=compiled,
                            cuda_graph_sizes=sizes)
        built = time.perf_counter() - start
        got = dec.generate_batch(prompts, GREEDY)
        out["compiled" if compiled else "eager"] = {
            "graphs": sorted(dec.graphs), "build_s": built, "padded_to": dec.padded_size(3),
            "same_as_generate": got == ref,
            "matching_tokens": [sum(a == b for a, b in zip(x, y)) for x, y in zip(got, ref)]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/runtime_gpu.json")
    args = ap.parse_args()
    dev = resolve_device(None)
    cuda = dev.type == "cuda"
    name = "smollm2-135m" if cuda else "tiny"
    report = {"check": "runtime_gpu", **machine_info(dev, torch.get_num_threads()),
              "model": f"{name} (random weights)"}
    report["correctness"] = correctness(name, dev, cuda)
    print(report["correctness"], flush=True)
    write_json(report, args.out)  # each part is saved as it ends: a timeout keeps the rest
    configs = GPU_CONFIGS if cuda else ("fp32", "fp32+compile")
    bench = run_runtime_bench(name, configs, prompt_len=128, new_tokens=64, repeats=3,
                              device=dev, llama=False, log=print, random_weights=True)
    # the CPU report's keys, so that runtime_table and plot_runtime read this one too
    report.update({k: bench[k] for k in ("prompt_len", "new_tokens", "repeats", "method",
                                         "results")})
    print(report["results"], flush=True)
    write_json(report, args.out)
    sizes = [1, 2, 3, 4, 8, 13, 16, 32, 64] if cuda else [1, 2]
    sweep_cfg = [parse_config("bf16+graphs" if cuda else "fp32")]
    prompt = list(range(5, 133))
    report["batch_sweep"] = batch_sweep(name, sweep_cfg, sizes, prompt, 16, 3, dev, print,
                                        random_weights=True)
    write_json(report, args.out)
    model, _ = load_model(name, device=dev, dtype=torch.bfloat16 if cuda else torch.float32,
                          random_weights=True)
    prof = profile_decode(model, prompt_len=128, steps=8)
    report["profile"] = {"step_ms": prof.step_ms, "by_category": prof.by_category(),
                         "launches_per_step": prof.launches_per_step(),
                         "top": prof.rows[:12]}
    print(prof.table(), flush=True)
    print(f"wrote {write_json(report, args.out)}")


if __name__ == "__main__":
    main()
