"""The serving engine on a GPU: the Triton paged backend against the sdpa one, then throughput.

1. Correctness at SmolLM2's shape (seeded random weights, fp32, TF32 off): a mixed batch of
   greedy requests through the engine with the Triton paged kernels (the CUDA default) and with
   the sdpa gather backend, and each request alone through the contiguous-cache loop.
2. ``bench throughput`` (bf16): the engine vs HF transformers' static padded batches.

    python benchmarks/gpu_engine_check.py --out benchmarks/results/engine_gpu.json
On a CPU it runs too, at a small size (``--requests 4``), as a smoke test of the script.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from minillm import SamplingParams
from minillm.bench.common import machine_info
from minillm.bench.throughput import run_throughput_bench
from minillm.checkpoint import load_model
from minillm.device import resolve_device
from minillm.engine import EngineConfig, LLMEngine
from minillm.generate import generate


def backends_agree(device: torch.device, n: int) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    model, _ = load_model("smollm2-135m", device=device, dtype=torch.float32,
                          random_weights=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 49152, (int(k),), generator=g).tolist()
               for k in torch.randint(3, 300, (n,), generator=g)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    result = {"requests": n}
    alone = [generate(model, p, params) for p in prompts]
    for backend in ("triton", "sdpa") if device.type == "cuda" else ("sdpa",):
        engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=2048,
                                                     attention_backend=backend))
        for p in prompts:
            engine.add_request(p, params)
        outs = {}
        while engine.has_unfinished():
            outs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        got = [outs[str(i)] for i in range(n)]
        same = sum(a == b for a, b in zip(got, alone))
        result[f"{backend}_equal_to_alone"] = f"{same}/{n}"
        assert engine.blocks.num_free == engine.blocks.num_blocks
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/engine_gpu.json")
    ap.add_argument("--requests", type=int, default=None)
    args = ap.parse_args()
    dev = resolve_device(None)
    n = args.requests or (64 if dev.type == "cuda" else 4)
    report = {**machine_info(dev, torch.get_num_threads()),
              "backends": backends_agree(dev, min(n, 16))}
    print(report["backends"], flush=True)
    bench = run_throughput_bench("smollm2-135m", num_requests=n, random_weights=True,
                                 peers=("hf",), hf_batch=32 if dev.type == "cuda" else 2)
    report["throughput"] = {k: bench[k] for k in ("results", "ratios", "minillm_stats",
                                                  "output_tokens", "prompt_tokens")}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
