"""Speculative decoding on a GPU (chapter 06), at SmolLM2's shapes with seeded random weights.

The trained drafters fit only the real model (their manifests name it) and the model file does
not travel to the GPU machine, so this checks the frame, not acceptance:

1. Every method (ngram, suffix; draft_model, eagle, mtp, medusa, and dflash, ddtree, dspark on one
   block drafter, all with random drafters) at temperature 0 gives the plain engine's tokens
   exactly, with the Triton backend (tree drafts fall back to sdpa for their step) and every
   block of target and drafter free at the end.
2. Batch-1 time per forward against the number of tokens in it (what speculation exploits),
   and n-gram speculation's speedup on prompts that repeat themselves.
3. Speedup against the batch size (1, 4, 16, 64 requests at once, output tokens/s over the
   plain engine's at the same batch) for every method at SmolLM2-135M's and Llama-3.2-1B's
   shapes. With random drafters almost nothing is accepted, so this measures what speculation
   costs at each batch size (n-gram, on self-repeating prompts, also what it gains). The sweep
   stops at ``--budget-s`` seconds after the start and lists what it skipped.

    python benchmarks/gpu_spec_check.py --out benchmarks/results/spec_gpu.json
On a CPU it runs at the tiny preset's shape, batches 1 and 4, as a smoke test.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from minillm import SamplingParams
from minillm.bench.spec import ALL_METHODS, DEFAULT_K
from minillm.checkpoint import load_model
from minillm.device import resolve_device, sync
from minillm.engine import EngineConfig, LLMEngine
from minillm.runinfo import machine_info
from minillm.spec_decode.config import BLOCK_METHODS, MODEL_FREE
from minillm.spec_decode.drafters import DrafterConfig, DraftHead, build_drafter, eagle3_layers
from minillm.spec_decode.speculator import build_speculator

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
SWEEP = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
DRAFT_VOCAB = 4096


def block_layers(n_layers: int) -> tuple[int, ...]:
    """The target layers a block drafter reads: early, a third, two thirds, late (like the
    trained one's, ``minillm.spec_decode.training.train.CONFIGS["dflash"]``)."""
    return tuple(sorted({1, n_layers // 3, 2 * n_layers // 3, n_layers - 2}
                        & set(range(n_layers))))


def random_drafter(method: str, model):
    """(module, head, manifest) at the target's shape, seeded random weights; one block
    drafter (2 layers, block 8, DSpark's heads of rank 32) serves dflash, ddtree and dspark;
    EAGLE-3's reads its low, middle and high layers."""
    c = model.cfg
    block = method in BLOCK_METHODS
    cfg = DrafterConfig("dflash" if block else method, d_model=c.d_model, n_heads=c.n_heads,
                        n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, ffn_dim=c.ffn_dim,
                        num_heads=4, layers=2 if block else 1,
                        **(dict(target_layers=block_layers(c.n_layers), block_size=8,
                                markov_rank=32, draft_vocab=DRAFT_VOCAB) if block else {}),
                        **(dict(target_layers=eagle3_layers(c.n_layers))
                           if method == "eagle3" else {}))
    torch.manual_seed(0)
    module = build_drafter(cfg, model).to(model.device, model.dtype).eval()
    head = DraftHead(model.lm_head.weight, torch.arange(DRAFT_VOCAB, device=model.device))
    return module, head, {"head_accuracy": [[0.6, 0.2, 0.1], [0.4, 0.1], [0.3], [0.2]]}


def engine(model, method: str | None, k: int = 4, max_seqs: int = 16,
           drafter=None) -> LLMEngine:
    """``drafter`` None: a fresh random one (none for ngram)."""
    eng = LLMEngine(model, None, EngineConfig(max_num_seqs=max_seqs,
                                              num_kv_blocks=max(512, 10 * max_seqs)))
    if method:
        if drafter is None and method not in MODEL_FREE:
            drafter = random_drafter(method, model)
        eng.use_speculator(build_speculator({"method": method, "num_speculative_tokens": k},
                                            eng, drafter=drafter))
    return eng


def run(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY
        ) -> tuple[list[list[int]], float]:
    start = time.perf_counter()
    ids = [eng.add_request(p, params) for p in prompts]
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


def batch_sweep(model, prompts: list[list[int]], batches, deadline: float) -> dict:
    """Output tokens/s of ``batch`` prompts at once (cycled from ``prompts``) per method
    (None: plain, at every batch first) and the speedup over plain; configs not started by
    ``deadline`` (time.perf_counter s) are listed under ``skipped``."""
    tok_s: dict[str, dict[int, float]] = {}
    skipped = []
    block = random_drafter("dflash", model)                 # built once, shared by the three
    drafters = {m: block if m in BLOCK_METHODS else random_drafter(m, model)
                for m in ALL_METHODS if m not in MODEL_FREE}
    for b in batches:
        for method in (None, *ALL_METHODS):
            label = method or "none"
            if time.perf_counter() > deadline:
                skipped.append(f"{label}@{b}")
                continue
            eng = engine(model, method, DEFAULT_K.get(method, 4), b, drafters.get(method))
            run(eng, prompts[:1], SWEEP)                                    # warm-up
            _, seconds = run(eng, (prompts * b)[:b], SWEEP)
            tok_s.setdefault(label, {})[b] = b * SWEEP.max_tokens / seconds
        print(f"batch {b}: " + ", ".join(f"{m} {v[b]:.0f}" for m, v in tok_s.items() if b in v)
              + " tok/s", flush=True)
    speedup = {m: {b: v / tok_s["none"][b] for b, v in by.items() if b in tok_s.get("none", {})}
               for m, by in tok_s.items() if m != "none"}
    return {"batches": list(batches), "max_tokens": SWEEP.max_tokens, "tok_s": tok_s,
            "speedup": speedup, "skipped": skipped}


def repeating_prompts(n: int = 6, length: int = 64) -> list[list[int]]:
    """Seeded prompts that repeat a 12-token phrase (prompt lookup finds matches)."""
    g = torch.Generator().manual_seed(0)
    phrases = [torch.randint(10, 4000, (12,), generator=g).tolist() for _ in range(n)]
    return [(p * 6)[:length] for p in phrases]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/spec_gpu.json")
    ap.add_argument("--budget-s", type=float, default=120.0,
                    help="the batch sweep starts no run after this many seconds (default: 120)")
    args = ap.parse_args()
    start = time.perf_counter()
    dev = resolve_device(None)
    cuda = dev.type == "cuda"
    names = ("smollm2-135m", "llama-3.2-1b") if cuda else ("tiny",)
    batches = (1, 4, 16, 64) if cuda else (1, 4)
    dtype = torch.bfloat16 if cuda else torch.float32
    model, _ = load_model(names[0], device=dev, dtype=dtype, random_weights=True)
    prompts = repeating_prompts()
    want, _ = run(engine(model, None), prompts)
    report = {**machine_info(dev, torch.get_num_threads()), "model": names[0],
              "dtype": str(dtype), "greedy_equal": {}, "forward_ms": forward_ms(model)}
    for method in ALL_METHODS:
        got, _ = run(engine(model, method), prompts)
        report["greedy_equal"][method] = got == want
        print(method, "equal" if got == want else "DIFFERENT", flush=True)
    alone = [run(engine(model, m), [p])[1] for m in (None, "ngram") for p in prompts[:3]]
    report["ngram_batch1_speedup"] = sum(alone[:3]) / sum(alone[3:])
    report["batch_sweep"] = {}
    for i, name in enumerate(names):
        if i:
            del model
            model, _ = load_model(name, device=dev, dtype=dtype, random_weights=True)
        report["batch_sweep"][name] = batch_sweep(model, prompts, batches,
                                                  start + args.budget_s)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("greedy_equal", "forward_ms",
                                             "ngram_batch1_speedup")}))
    print(json.dumps({n: {"speedup": s["speedup"], "skipped": s["skipped"]}
                      for n, s in report["batch_sweep"].items()}))
    if not all(report["greedy_equal"].values()):
        raise SystemExit("speculative output differs from the plain engine")


if __name__ == "__main__":
    main()
