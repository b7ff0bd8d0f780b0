"""Chapter 08 on a GPU: the tiered KV store's CUDA paths and CacheBlend, at SmolLM2's shapes
(seeded random weights: the model file cannot travel to the GPU machine).

1. The store behind the prefix cache: requests that share a prompt, with an unrelated request
   between them that evicts it from a small device pool, so each later one loads its prefix from
   the CPU tier (pinned staging, a side stream and per-layer events with ``layerwise``) or, on a
   second engine, from the disk tier; greedy tokens must equal a cold engine's, every block must
   end free. Records the load time the forward waited for (exposed; host-side, so on CUDA it
   counts waits for the copy thread, not for the stream) and the bytes moved.
2. CacheBlend on CUDA: recompute ratio 1.0 equals a full prefill (logits, fp32), and the time of
   full recompute, full KV reuse and blends at 0.15 / 0.5 on 4 passages of 512 tokens.

    python benchmarks/gpu_offload_check.py --out benchmarks/results/offload_gpu.json
On a CPU it runs too, on the tiny preset, as a smoke test of the script.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

from minillm import SamplingParams
from minillm.bench.common import write_json
from minillm.cache import blend
from minillm.checkpoint import random_model
from minillm.config import get_preset
from minillm.device import resolve_device, sync
from minillm.engine import EngineConfig, LLMEngine
from minillm.runinfo import machine_info

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt alone, in turn; then every block must be free."""
    outs = []
    for p in prompts:
        engine.add_request(p, GREEDY)
        while engine.has_unfinished():
            outs += [o.token_ids for o in engine.step() if o.finished]
    engine.blocks.check()
    assert engine.blocks.num_free == engine.blocks.num_blocks, "blocks leaked"
    return outs


def store_check(model, prompt_len: int) -> dict:
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(5, 5000, (prompt_len,), generator=g).tolist()
    filler = torch.randint(5, 5000, (2 * prompt_len + 3,), generator=g).tolist()
    prompts = [p for i in range(4) for p in (shared + [100 + i], filler[: 2 * prompt_len + i])]
    cold = run(LLMEngine(model, None, EngineConfig(num_kv_blocks=1024)), prompts)
    blocks = -(-(2 * prompt_len + 3 + 16) // 16) + 1    # the filler fits and evicts the rest
    out = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, store in [("whole", {"layerwise": False}), ("layerwise", {}),
                            ("disk", {"disk_dir": folder}), ("restart", {"disk_dir": folder})]:
            engine = LLMEngine(model, None, EngineConfig(
                num_kv_blocks=blocks, enable_prefix_caching=True,
                kv_offload={"cpu_bytes": 1 << 30, "chunk_tokens": 64, **store}))
            t0 = time.perf_counter()
            same = run(engine, prompts) == cold
            engine.offload.flush()
            st = engine.offload.stats()
            out[name] = {"same_tokens_as_cold": same, "seconds": time.perf_counter() - t0,
                         "loads": st["loads"], "load_seconds": st["load_seconds"],
                         "exposed_seconds": st["exposed_seconds"],
                         "store_to_device_bytes": st["store_to_device_bytes"],
                         "disk": st.get("disk")}
            print(name, out[name], flush=True)
    return out


def blend_check(model, passage_tokens: int) -> dict:
    g = torch.Generator().manual_seed(1)
    chunks = [blend.precompute_chunk(model, torch.randint(5, 5000, (passage_tokens,),
                                                          generator=g).tolist())
              for _ in range(4)]
    suffix = list(range(200, 232))
    ids = [t for c in chunks for t in c.token_ids] + suffix
    full = blend.full_prefill(model, ids)
    same = blend.blend_prefill(model, chunks, suffix, 1.0)
    err = float((same.logits - full.logits).abs().max())
    times = {}
    for name, fn in [("full recompute", lambda: blend.full_prefill(model, ids)),
                     ("full KV reuse", lambda: blend.full_reuse(model, chunks, suffix)),
                     ("blend 0.15", lambda: blend.blend_prefill(model, chunks, suffix, 0.15)),
                     ("blend 0.5", lambda: blend.blend_prefill(model, chunks, suffix, 0.5))]:
        fn()                                                   # warm-up
        sync(model.device)
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            sync(model.device)
            runs.append(time.perf_counter() - t0)
        times[name] = min(runs)
    print("blend", err, times, flush=True)
    return {"ratio_1_max_logit_error": err, "seconds_min_of_5": times,
            "ttft_ratio_0.15": times["full recompute"] / times["blend 0.15"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/offload_gpu.json")
    args = ap.parse_args()
    dev = resolve_device(None)
    torch.backends.cuda.matmul.allow_tf32 = False
    preset = "smollm2-135m" if dev.type == "cuda" else "tiny"
    model = random_model(get_preset(preset), 0).to(device=dev, dtype=torch.float32).eval()
    model.requires_grad_(False)
    report = {**machine_info(dev, torch.get_num_threads()), "model": f"{preset} (random)",
              "store": store_check(model, 512 if dev.type == "cuda" else 96),
              "blend": blend_check(model, 512 if dev.type == "cuda" else 48)}
    report["ok"] = all(r["same_tokens_as_cold"] for r in report["store"].values()) and \
        report["blend"]["ratio_1_max_logit_error"] < 1e-3
    print(f"wrote {write_json(report, args.out)}; ok = {report['ok']}")


if __name__ == "__main__":
    main()
