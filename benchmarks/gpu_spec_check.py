"""Speculative decoding on a GPU (chapter 06), at SmolLM2's shapes with seeded random weights.

The trained drafters fit only the real model (their manifests name it) and the model file does
not travel to the GPU machine, so this checks the frame, not acceptance:

1. Every method (ngram; draft_model, eagle, mtp, medusa with random drafters) at temperature 0
   gives the plain engine's tokens exactly, with the Triton backend (tree drafts fall back to
   sdpa for their step) and every block of target and drafter free at the end.
2. Batch-1 time per forward against the number of tokens in it (what speculation exploits),
   and n-gram speculation's speedup on prompts that repeat themselves.

    python benchmarks/gpu_spec_check.py --out benchmarks/results/spec_gpu.json
On a CPU it runs at the tiny preset's shape as a smoke test.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from minillm import SamplingParams
from minillm.bench.common import machine_info
from minillm.checkpoint import load_model
from minillm.device import resolve_device, sync
from minillm.engine import EngineConfig, LLMEngine
from minillm.spec.drafters import DrafterConfig, DraftHead, build_drafter
from minillm.spec.speculator import build_speculator

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def random_drafter(method: str, model):
    c = model.cfg
    cfg = DrafterConfig(method, d_model=c.d_model, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads,
                        head_dim=c.head_dim, ffn_dim=c.ffn_dim, num_heads=4, layers=1)
    torch.manual_seed(0)
    module = build_drafter(cfg, model).to(model.device, model.dtype).eval()
    head = DraftHead(model.lm_head.weight, torch.arange(4096, device=model.device))
    return module, head, {"head_accuracy": [[0.6, 0.2, 0.1], [0.4, 0.1], [0.3], [0.2]]}


def engine(model, method: str | None, k: int = 4) -> LLMEngine:
    eng = LLMEngine(model, None, EngineConfig(max_num_seqs=16, num_kv_blocks=512))
    if method:
        drafter = None if method == "ngram" else random_drafter(method, model)
        eng.use_speculator(build_speculator({"method": method, "num_speculative_tokens": k},
                                            eng, drafter=drafter))
    return eng


def run(eng: LLMEngine, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    start = time.perf_counter()
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
    sync(eng.model.device)
    eng.blocks.check()
    assert eng.blocks.num_free == eng.blocks.num_blocks, "target blocks leaked"
    cache = getattr(eng.speculator.proposer, "cache", None) if eng.speculator else None
    assert cache is None or not cache.blocks.tables, "drafter blocks leaked"
    return [outs[i] for i in ids], time.perf_counter() - start


@torch.inference_mode()
def forward_ms(model, sizes=(1, 2, 4, 8, 16, 32, 64)) -> dict[int, float]:
    out = {}
    for t in sizes:
        ids = torch.randint(10, 1000, (1, t), device=model.device)
        for _ in range(3):
            model(ids)
        sync(model.device)
        start = time.perf_counter()
        for _ in range(10):
            model(ids)
        sync(model.device)
        out[t] = (time.perf_counter() - start) / 10 * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/spec_gpu.json")
    args = ap.parse_args()
    dev = resolve_device(None)
    name = "smollm2-135m" if dev.type == "cuda" else "tiny"
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model, _ = load_model(name, device=dev, dtype=dtype, random_weights=True)
    g = torch.Generator().manual_seed(0)
    phrases = [torch.randint(10, 4000, (12,), generator=g).tolist() for _ in range(6)]
    prompts = [(p * 6)[:64] for p in phrases]
    want, _ = run(engine(model, None), prompts)
    report = {**machine_info(dev, torch.get_num_threads()), "model": name,
              "dtype": str(dtype), "greedy_equal": {}, "forward_ms": forward_ms(model)}
    for method in ("ngram", "draft_model", "eagle", "mtp", "medusa"):
        got, _ = run(engine(model, method), prompts)
        report["greedy_equal"][method] = got == want
        print(method, "equal" if got == want else "DIFFERENT", flush=True)
    alone = [run(engine(model, m), [p])[1] for m in (None, "ngram") for p in prompts[:3]]
    report["ngram_batch1_speedup"] = sum(alone[:3]) / sum(alone[3:])
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("greedy_equal", "forward_ms",
                                             "ngram_batch1_speedup")}))
    if not all(report["greedy_equal"].values()):
        raise SystemExit("speculative output differs from the plain engine")


if __name__ == "__main__":
    main()
