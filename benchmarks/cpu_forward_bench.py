"""The engine's decode step on the CPU: eager forward, the fused fast path, and the fast path's
recorded steps replayed, by weights and batch size.

    python benchmarks/cpu_forward_bench.py [--dtype bfloat16] [--weights float int8 int4]
                                           [--batches 1 4 16 64] [--rounds R] [--out FILE.json]

One engine (the real model, the ``cpu`` attention backend; weights as loaded or quantized
with ``minillm.quant.quantize_model``) holds ``batch`` sequences of 200 prompt tokens that
decode. Its runner's ``fuse_ops`` switch picks ``Transformer.forward_layers`` (the modules,
some forty PyTorch operations a layer) or :class:`minillm.engine.cpu_forward.CpuForward`
(the same maths with the small operations fused in C++ and the packed matmuls called
directly); the fast path's ``replay`` switch records a decode step whose every call is C++
once and replays it (:mod:`minillm.engine.cpu_replay`: bfloat16 weights at the rows the
matrix-vector kernel takes, quantized ones at the rows the integer kernels take; elsewhere
the column is empty). The modes alternate, ten steps at a
time, for ``rounds`` rounds on the same sequences; the medians of the step times and their
ratios are reported, with the CPU model and flags and the load average.
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
from minillm.engine.cpu_replay import StepShape
from minillm.quant import quantize_model
from minillm.runinfo import machine_info

PROMPT, STEPS = 200, 10
MODES = ("eager", "fused", "replayed")


def step_ms(engine: LLMEngine, mode: str) -> float:
    """Mean milliseconds of STEPS decode steps in ``mode`` (one of MODES)."""
    engine.runner.fuse_ops = mode != "eager"
    engine.runner.cpu_forward.replay = mode == "replayed"
    start = time.perf_counter()
    for _ in range(STEPS):
        engine.step()
    return (time.perf_counter() - start) / STEPS * 1e3


def measure(engine: LLMEngine, weights: str, batch: int, rounds: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    for _ in range(batch):
        ids = torch.randint(0, engine.model.cfg.vocab_size, (PROMPT,), generator=g).tolist()
        engine.add_request(ids, SamplingParams(temperature=0.0, ignore_eos=True,
                                               max_tokens=3 * rounds * STEPS + 16))
    engine.step()
    while engine.trace[-1].prefill_tokens:              # the prompts
        engine.step()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(rounds):
        for mode in MODES:
            times[mode].append(step_ms(engine, mode))
    recorded = engine.runner.cpu_forward.recorded.get(StepShape.decode(batch))
    while engine.has_unfinished():
        engine.step()
    ms = {m: statistics.median(t) for m, t in times.items()}
    replayed = ms["replayed"] if recorded is not None and recorded.replays else None
    row = {"weights": weights, "batch": batch, "eager_ms": round(ms["eager"], 2),
           "fused_ms": round(ms["fused"], 2), "speedup": round(ms["eager"] / ms["fused"], 2),
           "replayed_ms": None if replayed is None else round(replayed, 2),
           "replay_speedup": None if replayed is None else round(ms["fused"] / replayed, 2)}
    print(f"{weights:5s} batch {batch:3d}: eager {ms['eager']:6.1f} ms/step  fused "
          f"{ms['fused']:6.1f}  x{ms['eager'] / ms['fused']:.2f}" +
          ("" if replayed is None else f"  replayed {replayed:6.1f}  "
                                       f"x{ms['fused'] / replayed:.2f} over fused"))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--weights", nargs="+", default=["float", "int8", "int4"],
                    choices=["float", "int8", "int4"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--quantized-batches", type=int, nargs="+", default=[1, 4],
                    help="the batches of the int8 / int4 rows")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default="benchmarks/results/cpu_forward.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows, seed = [], 0
    for weights in args.weights:
        model, tok = minillm.load_model("smollm2-135m", device="cpu", dtype=args.dtype)
        if weights != "float":
            quantize_model(model, weights)
        engine = LLMEngine(model, tok, EngineConfig(attention_backend="cpu"))
        engine.warmup()
        if not engine.runner.cpu_forward.applies():
            raise SystemExit("the fused CPU path does not apply here (no C++ compiler, or "
                             "dtype)")
        for b in args.batches if weights == "float" else args.quantized_batches:
            rows.append(measure(engine, weights, b, args.rounds, seed))
            seed += 1
    report = {"benchmark": "cpu_forward", "model": "smollm2-135m", "dtype": args.dtype,
              "prompt_tokens": PROMPT, "steps_per_sample": STEPS, "rounds": args.rounds,
              "method": "decode steps, eager, fused and replayed alternating 10 steps at a "
                        "time on the same sequences; medians", "cpu_flags": sorted(cpu_features()),
              "load_average": list(os.getloadavg()), "rows": rows,
              **machine_info(torch.device("cpu"), args.threads)}
    print("wrote", write_json(report, args.out))


if __name__ == "__main__":
    main()
