"""The engine's two CPU paged-attention backends side by side, at SmolLM2-135M's shapes.

    python benchmarks/cpu_attention_bench.py [--threads N] [--rounds R] [--out FILE.json]

Two steps of the throughput benchmark's kind, each over 30 layers' own caches (so a decode step
reads its KV from memory, as in the engine, not from the last-level cache):

- decode: 64 sequences of 350 cached tokens, one new token each;
- prefill: 14 prompts of 290 tokens with nothing cached (a 4096-token prefill step).

Each through ``cpu`` (the C++ kernel reading the blocks in place) and ``sdpa`` (padded groups of
gathered blocks, causal SDPA per prompt), interleaved, median of a few rounds; the largest
difference between them; the KV bytes a decode layer reads and the rate the kernel reads them
at. Then the decode step through the C++ kernel for each KV storage format the engine offers
(``kv_cache_dtype``: the queries' dtype, bfloat16 below float32 queries, int8 below either),
interleaved. Writes JSON with the CPU model and flags (the kernel's bf16 path needs
AVX512-BF16).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from minillm.attention.kv_quant import Int8Blocks, quantize_int8
from minillm.attention.paged import (
    build_metadata,
    cpu_paged_attention,
    sdpa_paged_attention,
    write_kv,
)
from minillm.bench.common import write_json
from minillm.device import cpu_features
from minillm.runinfo import machine_info

LAYERS, HQ, HKV, D, BS = 30, 9, 3, 64, 16
STEPS = {"decode": (64, 350, 1), "prefill": (14, 0, 290)}   # sequences, cached, new tokens


def make_step(seqs: int, cached: int, new: int, dtype: torch.dtype, seed: int = 0):
    """Per-layer caches with every sequence's blocks shuffled, the step's q/k/v and both
    backends' metadata."""
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-(cached + new) // BS)
    num_blocks = seqs * per_seq
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = [order[i * per_seq:(i + 1) * per_seq] for i in range(seqs)]
    caches = [tuple(torch.randn(num_blocks, BS, HKV, D, generator=g).to(dtype) for _ in "kv")
              for _ in range(LAYERS)]
    n = seqs * new
    q, k, v = (torch.randn(n, h, D, generator=g).to(dtype) for h in (HQ, HKV, HKV))
    metas = {direct: build_metadata(tables, [cached] * seqs, [new] * seqs, BS,
                                    torch.device("cpu"), q_per_kv=HQ // HKV, direct=direct)
             for direct in (True, False)}
    for kc, vc in caches:                # the new tokens are in the cache, as in the engine
        write_kv(kc, vc, k, v, metas[True].slot_mapping)
    return caches, (q, k, v), metas


def run(backend, caches, qkv, meta) -> torch.Tensor:
    """One step: every layer's attention; returns the last layer's output."""
    for kc, vc in caches:
        out = backend(*qkv, kc, vc, meta)
    return out


def measure(name: str, dtype: torch.dtype, rounds: int) -> dict:
    seqs, cached, new = STEPS[name]
    caches, qkv, metas = make_step(seqs, cached, new, dtype)
    runners = {"cpu": lambda: run(cpu_paged_attention, caches, qkv, metas[True]),
               "sdpa": lambda: run(sdpa_paged_attention, caches, qkv, metas[False])}
    diff = (runners["cpu"]().float() - runners["sdpa"]().float()).abs().max().item()
    times = {b: [] for b in runners}
    for _ in range(rounds):
        for b, fn in runners.items():
            t0 = time.perf_counter()
            fn()
            times[b].append((time.perf_counter() - t0) / LAYERS * 1e3)
    ms = {b: statistics.median(t) for b, t in times.items()}
    kv_bytes = seqs * (cached + new) * HKV * D * 2 * caches[0][0].element_size()
    row = {"step": name, "dtype": str(dtype).removeprefix("torch."), "sequences": seqs,
           "cached_tokens": cached, "new_tokens": new, "cpu_ms_per_layer": round(ms["cpu"], 3),
           "sdpa_ms_per_layer": round(ms["sdpa"], 3),
           "speedup": round(ms["sdpa"] / ms["cpu"], 2), "max_abs_diff": diff,
           "kv_bytes_per_layer": kv_bytes}
    note = ""
    if new == 1:     # a decode reads each cached K/V byte once: how close to memory speed
        row["cpu_kv_read_gb_s"] = round(kv_bytes / ms["cpu"] / 1e6, 1)
        note = f"KV read at {row['cpu_kv_read_gb_s']} GB/s; "
    print(f"{row['dtype']:9s} {name:8s} cpu {ms['cpu']:7.3f} ms/layer  sdpa {ms['sdpa']:7.3f}  "
          f"x{row['speedup']:.2f}  ({note}max |diff| {diff:.1e})")
    return row


FORMATS = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
           (torch.float32, torch.int8), (torch.bfloat16, torch.bfloat16),
           (torch.bfloat16, torch.int8)]


def stored(cache: torch.Tensor, fmt: torch.dtype):
    """A float32 cache in the storage format ``fmt`` (int8: with its scales)."""
    return Int8Blocks(*quantize_int8(cache)) if fmt == torch.int8 else cache.to(fmt)


def measure_formats(rounds: int) -> list[dict]:
    """The decode step through the C++ kernel for each (queries' dtype, cache format)."""
    seqs, cached, new = STEPS["decode"]
    caches, (q, k, v), metas = make_step(seqs, cached, new, torch.float32)
    cases = {(qd, fmt): ([tuple(stored(c, fmt) for c in pair) for pair in caches],
                         (q.to(qd), k.to(qd), v.to(qd))) for qd, fmt in FORMATS}
    times: dict = {key: [] for key in cases}
    for _ in range(rounds):
        for key, (layer_caches, qkv) in cases.items():
            t0 = time.perf_counter()
            run(cpu_paged_attention, layer_caches, qkv, metas[True])
            times[key].append((time.perf_counter() - t0) / LAYERS * 1e3)
    rows = []
    for (qd, fmt), t in times.items():
        ms = statistics.median(t)
        per_elem = fmt.itemsize + (4 / D if fmt == torch.int8 else 0)
        kv_bytes = seqs * (cached + new) * HKV * D * 2 * per_elem
        rows.append({"q_dtype": str(qd).removeprefix("torch."),
                     "kv_dtype": str(fmt).removeprefix("torch."), "ms_per_layer": round(ms, 3),
                     "kv_bytes_per_layer": int(kv_bytes),
                     "kv_read_gb_s": round(kv_bytes / ms / 1e6, 1)})
        print(f"decode, {rows[-1]['q_dtype']:8s} queries, KV {rows[-1]['kv_dtype']:8s}: "
              f"{ms:7.3f} ms/layer ({rows[-1]['kv_read_gb_s']} GB/s of KV)")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results/cpu_attention.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(step, dtype, args.rounds) for dtype in (torch.bfloat16, torch.float32)
            for step in STEPS]
    formats = measure_formats(args.rounds)
    report = {"benchmark": "cpu_attention", "layers": LAYERS, "heads": [HQ, HKV],
              "head_dim": D, "block_size": BS, "cpu_flags": sorted(cpu_features()),
              "load_average": list(os.getloadavg()), "rows": rows, "kv_formats": formats,
              **machine_info(torch.device("cpu"), args.threads)}
    print("wrote", write_json(report, args.out))


if __name__ == "__main__":
    main()
