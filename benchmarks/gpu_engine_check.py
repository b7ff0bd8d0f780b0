"""The serving engine on a GPU: every engine path against the same requests run one at a time,
then throughput.

1. Correctness at SmolLM2's and Llama-3.2-1B's shapes (seeded random weights, fp32, TF32 off):
   a batch of greedy requests through the engine with the Triton paged kernels (the CUDA
   default) and with the sdpa gather backend, each under: plain continuous batching, chunked
   prefill with a small token budget, a pool so small that swap preemption must happen, n = 3
   parallel samples, beam search; compared with each request alone on the same device (the
   contiguous-cache loop, or the engine with one request for n > 1 and beams). Every run must
   end with every block free.
2. The CUDA swap ordering: blocks swapped out and read back on the host right away.
3. ``bench throughput`` (bf16): the engine vs HF transformers' static padded batches.
4. CUDA graphs of decode steps (``EngineConfig(cuda_graphs=True)``, :mod:`minillm.engine.graphs`)
   at SmolLM2's shapes: the same requests (finishing at different steps, so batches shrink
   through sizes that are not captured) give the same greedy tokens with and without graphs
   (fp32, TF32 off); then the batch-32 decode step of the throughput workload (bf16), its wall
   time and the time the GPU sits idle in it, eager and replayed (``profile_minillm``). The
   JSON is written before the token check asserts.

    python benchmarks/gpu_engine_check.py --out benchmarks/results/engine_gpu.json
On a CPU it runs too, at a small size (``--requests 4``), as a smoke test of the script (there
``cuda_graphs`` is ignored: step 4 pads the decode steps and re-runs them eagerly instead).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from minillm import SamplingParams
from minillm.bench.throughput import make_workload, profile_minillm, run_throughput_bench
from minillm.checkpoint import load_model
from minillm.device import resolve_device, serving_dtype
from minillm.engine import EngineConfig, LLMEngine
from minillm.generate import generate
from minillm.runinfo import machine_info

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PATHS = {  # engine options and sampling of each checked path
    "continuous": ({}, GREEDY),
    "chunked_prefill": ({"max_num_batched_tokens": 64, "max_num_seqs": 16}, GREEDY),
    "swap": ({"num_kv_blocks": 40, "block_size": 16, "watermark": 0.0,
              "preemption": "swap"}, GREEDY),
    "n3": ({}, SamplingParams(temperature=0.0, max_tokens=12, n=3, ignore_eos=True)),
    "beam2": ({}, SamplingParams(beam_width=2, n=2, max_tokens=8)),
}


def run(engine: LLMEngine, prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams]) -> list[list]:
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: [c.token_ids for c in o.outputs]
                     for o in engine.step() if o.finished})
    engine.blocks.check()
    assert engine.blocks.num_free == engine.blocks.num_blocks, "blocks leaked"
    return [outs[i] for i in ids]


def paths_agree(name: str, device: torch.device, n: int) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    model, _ = load_model(name, device=device, dtype=torch.float32, random_weights=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, model.cfg.vocab_size, (int(k),), generator=g).tolist()
               for k in torch.randint(3, 300, (n,), generator=g)]
    backends = ("triton", "sdpa") if device.type == "cuda" else ("sdpa",)
    result, refs = {}, {}
    for path, (options, params) in PATHS.items():
        start = time.perf_counter()
        if params not in refs and params.n == 1 and params.beam_width == 1:
            refs[params] = [[generate(model, p, params)] for p in prompts]
        elif params not in refs:  # for forks and beams: the engine with one request at a time
            refs[params] = [run(LLMEngine(model, None, EngineConfig(num_kv_blocks=512)), [p],
                                params)[0] for p in prompts[:4]]
        alone = refs[params]
        for backend in backends:
            engine = LLMEngine(model, None, EngineConfig(
                **{"num_kv_blocks": 2048, **options, "attention_backend": backend}))
            got = run(engine, prompts[:len(alone)], params)
            same = sum(a == b for a, b in zip(got, alone))
            preempted = sum(len(r.preempted) for r in engine.trace)
            result[f"{path}/{backend}"] = {"equal_to_alone": f"{same}/{len(alone)}",
                                           "preemptions": preempted}
        result[f"{path}/seconds"] = round(time.perf_counter() - start, 2)
    return result


def swap_is_ordered(device: torch.device) -> dict:
    """Fill device blocks, swap them out, overwrite them on the device at once, and check the
    CPU pool holds the old contents (a host read before the copy finished would not)."""
    from minillm.cache.pool import PagedKVPool
    from minillm.config import get_preset

    cfg = get_preset("smollm2-135m")
    pool = PagedKVPool(cfg, 64, 16, device, torch.float32, num_cpu_blocks=64)
    want = torch.randn(pool.k[:, :32].shape, device=device)
    pool.k[:, :32] = want
    pool.swap_out([(b, b) for b in range(32)])
    pool.k.zero_()
    return {"swap_out_equal": bool(torch.equal(pool.cpu_k[:, :32], want.cpu()))}


def graph_engine(model, graphs: bool, **options) -> LLMEngine:
    """An engine with CUDA graphs of its decode steps or without; on a CPU, where
    ``cuda_graphs`` is ignored, the padded path replayed eagerly stands in for them."""
    engine = LLMEngine(model, None, EngineConfig(**options, cuda_graphs=graphs,
                                                 static_buffers=True if graphs else None))
    if graphs and engine.runner.graphs is None:
        if model.device.type == "cuda":
            raise RuntimeError("EngineConfig(cuda_graphs=True) built no graphs: does "
                               "minillm/engine/engine.py pass config.cuda_graphs to ModelRunner?")
        engine.runner.use_decode_graphs(capture=False)
    return engine


def graphs_agree_and_time(device: torch.device, n: int) -> dict:
    """Greedy tokens with and without CUDA graphs (fp32, TF32 off), then the decode step of the
    throughput workload (bf16 on CUDA) profiled both ways."""
    torch.backends.cuda.matmul.allow_tf32 = False
    name = "smollm2-135m" if device.type == "cuda" else "tiny"
    model, _ = load_model(name, device=device, dtype=torch.float32, random_weights=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, model.cfg.vocab_size, (int(k),), generator=g).tolist()
               for k in torch.randint(3, 300, (n,), generator=g)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 7 * i % 29, ignore_eos=True)
              for i in range(n)]
    result: dict = {"model": name, "requests": n}
    tokens = {}
    for graphs in (False, True):
        start = time.perf_counter()
        engine = graph_engine(model, graphs, num_kv_blocks=2048)
        tokens[graphs] = run(engine, prompts, params)
        key = "graphs" if graphs else "eager"
        result[f"tokens/{key}/seconds"] = round(time.perf_counter() - start, 2)
        if graphs:
            decode_only = sum(r.prefill_tokens == 0 for r in engine.trace)
            steps = engine.runner.graphs.steps
            result["graph_steps_by_size"] = {str(k): v for k, v in sorted(steps.items())}
            result["graph_steps_of_decode_only_steps"] = f"{sum(steps.values())}/{decode_only}"
            result["capture_seconds"] = round(engine.runner.graphs.capture_seconds, 2)
        del engine
    same = sum(a == b for a, b in zip(tokens[True], tokens[False]))
    result["equal_greedy_tokens"] = f"{same}/{n}"
    result["tokens_equal"] = same == n
    dt = serving_dtype(None, device)[0] if device.type == "cuda" else torch.float32
    model, _ = load_model(name, device=device, dtype=dt, random_weights=True)
    work = make_workload(None, n, seed=0)          # the throughput section's shape of work
    for graphs in (False, True):
        prof = profile_minillm(model, None, work, 5, num_kv_blocks=4096, cuda_graphs=graphs)
        result[f"decode_step/{'graphs' if graphs else 'eager'}"] = None if prof is None else {
            "dtype": str(dt).replace("torch.", ""),
            **{k: prof[k] for k in ("batch", "wall_ms_per_step", "op_ms_per_step",
                                    "python_ms", "ms_by_category")}}
    eager, replayed = result["decode_step/eager"], result["decode_step/graphs"]
    if eager and replayed:
        result["decode_step/speedup"] = round(eager["wall_ms_per_step"]
                                              / replayed["wall_ms_per_step"], 2)
    result["note"] = ("python_ms: wall time per step that no operator accounts for; on a GPU "
                      "the time it sits idle. Graph replays' kernels are timed by the profiler "
                      "as device kernels (op_ms_per_step near 0 would mean it missed them).")
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/engine_gpu.json")
    ap.add_argument("--requests", type=int, default=None)
    args = ap.parse_args()
    dev = resolve_device(None)
    n = args.requests or (32 if dev.type == "cuda" else 4)
    report = {**machine_info(dev, torch.get_num_threads()), "swap": swap_is_ordered(dev)}
    for name in ("smollm2-135m", "llama-3.2-1b") if dev.type == "cuda" else ("tiny",):
        report[f"paths/{name}"] = paths_agree(name, dev, min(n, 16))
        print(name, report[f"paths/{name}"], flush=True)
    bench = run_throughput_bench("smollm2-135m" if dev.type == "cuda" else "tiny",
                                 num_requests=n, random_weights=True, peers=("hf",),
                                 hf_batch=32 if dev.type == "cuda" else 2)
    report["throughput"] = {k: bench[k] for k in ("results", "ratios", "minillm_stats",
                                                  "minillm_step_profile", "output_tokens",
                                                  "prompt_tokens", "dtype")}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    report["cuda_graphs"] = graphs_agree_and_time(dev, n)
    print("cuda_graphs", report["cuda_graphs"], flush=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    assert report["cuda_graphs"]["tokens_equal"], \
        f"CUDA graphs changed greedy tokens: {report['cuda_graphs']['equal_greedy_tokens']} equal"


if __name__ == "__main__":
    main()
