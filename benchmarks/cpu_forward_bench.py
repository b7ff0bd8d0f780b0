"""The engine's decode step on the CPU, eager forward vs the fused fast path, by batch size.

    python benchmarks/cpu_forward_bench.py [--dtype bfloat16] [--batches 1 4 16 64]
                                           [--rounds R] [--out FILE.json]

One engine (the real model, the ``cpu`` attention backend) holds ``batch`` sequences of 200
prompt tokens that decode; its runner's ``fuse_ops`` switch picks
``Transformer.forward_layers`` (the modules, some forty PyTorch operations a layer) or
:class:`minillm.engine.cpu_forward.CpuForward` (the same maths with the small operations fused in
C++ and the packed matmuls called directly). The two alternate, ten steps at a time, for
``rounds`` rounds on the same sequences; the medians of the step times and their ratio are
reported, with the CPU model and flags and the load average.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import minillm
from minillm import SamplingParams
from minillm.bench.common import write_json
from minillm.device import cpu_features
from minillm.engine import EngineConfig, LLMEngine
from minillm.runinfo import machine_info

PROMPT, STEPS = 200, 10


def step_ms(engine: LLMEngine, fuse: bool) -> float:
    """Mean milliseconds of STEPS decode steps with the fast path on or off."""
    engine.runner.fuse_ops = fuse
    start = time.perf_counter()
    for _ in range(STEPS):
        engine.step()
    return (time.perf_counter() - start) / STEPS * 1e3


def measure(engine: LLMEngine, batch: int, rounds: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    for _ in range(batch):
        ids = torch.randint(0, engine.model.cfg.vocab_size, (PROMPT,), generator=g).tolist()
        engine.add_request(ids, SamplingParams(temperature=0.0, ignore_eos=True,
                                               max_tokens=2 * rounds * STEPS + 16))
    engine.step()
    while engine.trace[-1].prefill_tokens:              # the prompts
        engine.step()
    times = {False: [], True: []}
    for _ in range(rounds):
        for fuse in times:
            times[fuse].append(step_ms(engine, fuse))
    while engine.has_unfinished():
        engine.step()
    eager, fused = (statistics.median(times[f]) for f in (False, True))
    row = {"batch": batch, "eager_ms": round(eager, 2), "fused_ms": round(fused, 2),
           "speedup": round(eager / fused, 2)}
    print(f"batch {batch:3d}: eager {eager:6.1f} ms/step  fused {fused:6.1f}  x{eager / fused:.2f}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default="benchmarks/results/cpu_forward.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = minillm.load_model("smollm2-135m", device="cpu", dtype=args.dtype)
    engine = LLMEngine(model, tok, EngineConfig(attention_backend="cpu"))
    engine.warmup()
    if not engine.runner.cpu_forward.applies():
        raise SystemExit("the fused CPU path does not apply here (no C++ compiler, or dtype)")
    rows = [measure(engine, b, args.rounds, seed) for seed, b in enumerate(args.batches)]
    report = {"benchmark": "cpu_forward", "model": "smollm2-135m", "dtype": args.dtype,
              "prompt_tokens": PROMPT, "steps_per_sample": STEPS, "rounds": args.rounds,
              "method": "decode steps, eager and fused alternating 10 steps at a time on the "
                        "same sequences; medians", "cpu_flags": sorted(cpu_features()),
              "load_average": list(os.getloadavg()), "rows": rows,
              **machine_info(torch.device("cpu"), args.threads)}
    print("wrote", write_json(report, args.out))


if __name__ == "__main__":
    main()
