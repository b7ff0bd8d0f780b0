"""Chapter 05 kernels on a GPU: correctness, FlashAttention vs SDPA, paged decode bandwidth.

    python benchmarks/kernels_bench.py --out benchmarks/results/kernels_h200.json
    python benchmarks/kernels_bench.py --out /tmp/smoke.json --smoke    # tiny, also on CPU

Writes one JSON file (device, date, git commit, versions, every measurement) and prints tables:

1. Correctness of every kernel in compiled mode: max abs error against a float32/float64 torch
   computation (SDPA for attention) for one shape per kernel.
2. FlashAttention forward TFLOP/s vs ``scaled_dot_product_attention`` forced onto its flash
   backend, bf16, B=4, H=16, N in 1k..16k, head_dim 64/128, causal and not.
3. Paged decode achieved GB/s (K/V bytes read + q and out) against the device's measured copy
   bandwidth, batch {1, 16, 64} x context {1k, 4k, 16k}, Hq=32, Hkv=8, D=128, block_size 16.
4. Split-KV (flash-decoding) on (automatic split count) vs off (one split) at batch 1.

Each call is timed twice: eagerly with ``triton.testing.do_bench`` (CUDA events, L2 flushed;
includes Python and launch overhead, which dominates microsecond decode calls) and replayed
from a CUDA graph (the kernels alone; TFLOP/s and GB/s use this one). For decode the graph
cycles through copies of the inputs that together far exceed the L2 cache. The whole run,
Triton compilation and autotuning included, is sized to finish in a few minutes on an H100/H200.
Without ``--smoke`` a GPU is required; with it, shapes are tiny and the kernels may run in the
Triton interpreter on the CPU (fp16 there, no bf16), which only checks that the script works.
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import math
import os
import platform
import sys
import time
import types
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- setup
def setup_interpreter_if_no_gpu() -> bool:
    """Same switch as ``minillm.device.setup_triton``: set before any kernel module import."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return os.environ.get("TRITON_INTERPRET") == "1"


def import_kernels() -> types.ModuleType:
    """``minillm.kernels`` when installed, else loaded from this checkout's ``kernels/``.

    The fallback lets the script run on a machine where only torch and triton are installed
    (the package's other dependencies are not needed by the kernels).
    """
    try:
        import minillm.kernels as kernels
        return kernels
    except ImportError:
        pass
    for name in [m for m in sys.modules if m == "minillm" or m.startswith("minillm.")]:
        del sys.modules[name]
    pkg = types.ModuleType("minillm")
    pkg.__path__ = [str(ROOT / "minillm")]
    sys.modules["minillm"] = pkg
    spec = importlib.util.spec_from_file_location(
        "minillm.kernels", ROOT / "kernels" / "__init__.py",
        submodule_search_locations=[str(ROOT / "kernels")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["minillm.kernels"] = module
    spec.loader.exec_module(module)
    pkg.kernels = module
    return module


def load_kernel_modules() -> types.SimpleNamespace:
    import_kernels()
    import importlib

    names = ["flash_attention", "paged_attention", "merge_attention", "vector_add", "softmax",
             "rmsnorm", "rope", "matmul"]
    return types.SimpleNamespace(**{n: importlib.import_module(f"minillm.kernels.{n}")
                                    for n in names})


# ----------------------------------------------------------------------------- timing
def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Mean milliseconds per call: do_bench on a GPU, a wall clock in the interpreter."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100))
    fn()
    start = time.perf_counter()
    reps = 2
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def time_ms_graph(calls: list[Callable[[], object]], device: torch.device, est_ms: float,
                  budget_ms: float = 50.0) -> float | None:
    """Milliseconds per call, replayed from one CUDA graph: no Python or launch overhead.

    The graph cycles through ``calls`` (the same work on different copies of the inputs), so
    when their inputs together are several times the L2 cache every call reads from HBM, as
    in a real decode step. ``est_ms`` (an eager timing) sizes the graph to about ``budget_ms``.
    None on the CPU, or if capture fails (then only the eager time is reported).
    """
    if device.type != "cuda":
        return None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (compile, autotune) outside the capture
            for call in calls:
                call()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        rounds = max(1, min(2000, int(budget_ms / max(est_ms, 1e-3) / len(calls))))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(rounds):
                for call in calls:
                    call()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / (rounds * len(calls)))
        del graph
        return sorted(times)[len(times) // 2]
    except Exception as exc:  # report and carry on with the eager timing
        print(f"  (CUDA graph timing failed: {type(exc).__name__}: {exc})")
        return None


def copy_bandwidth_gbps(device: torch.device, nbytes: int) -> float:
    """Device-to-device copy, bytes read + written per second (GB/s, 1e9)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(partial(dst.copy_, src), device)
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9


# ----------------------------------------------------------------------------- correctness
def paged_inputs(batch: int, context: int, hq: int, hkv: int, d: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Random q and a paged cache with shuffled physical blocks (every sequence ``context``)."""
    g = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = -(-context // block_size)
    n_blocks = batch * blocks_per_seq
    k_cache = torch.randn(n_blocks, block_size, hkv, d, generator=g, device=device, dtype=dtype)
    v_cache = torch.randn(n_blocks, block_size, hkv, d, generator=g, device=device, dtype=dtype)
    perm = torch.randperm(n_blocks, generator=g, device=device).to(torch.int32)
    tables = perm.view(batch, blocks_per_seq).contiguous()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, hq, d, generator=g, device=device, dtype=dtype)
    return q, k_cache, v_cache, tables, seq_lens


def sdpa_reference(q, k, v, causal: bool) -> torch.Tensor:
    """fp32 SDPA (math backend allowed) with GQA by repeating K/V; causal aligned to the end."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    mask = None
    if causal:
        t, s = q.shape[2], k.shape[2]
        i = torch.arange(t, device=q.device)[:, None]
        mask = torch.arange(s, device=q.device)[None, :] <= s - t + i
    return torch.nn.functional.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask)


def check_correctness(km, device: torch.device, dtype: torch.dtype, smoke: bool) -> dict:
    """Max abs error of each kernel against a torch computation, one shape each."""
    errs: dict[str, float] = {}
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=g, device=device, dtype=dt)

    def err(a, b) -> float:
        return float((a.float() - b.float()).abs().max())

    fa, pa = km.flash_attention, km.paged_attention
    t, s, d = (40, 70, 64) if smoke else (1000, 1500, 128)
    q, kk, vv = rand(2, 8, t, d), rand(2, 2, s, d), rand(2, 2, s, d)
    out, lse = fa.flash_attention(q, kk, vv, causal=True)
    errs["flash_attention_gqa_causal_vs_sdpa"] = err(out, sdpa_reference(q, kk, vv, True))
    _, ref_lse = fa.attention_reference(q.float(), kk.float(), vv.float(), causal=True)
    errs["flash_attention_lse"] = err(lse, ref_lse)

    lens_q, lens_k = ([5, 30], [9, 40]) if smoke else ([300, 1, 777], [300, 900, 1200])
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)
    q, kk, vv = rand(sum(lens_q), 8, d), rand(sum(lens_k), 2, d), rand(sum(lens_k), 2, d)
    out, _ = fa.flash_attention_varlen(q, kk, vv, cu_q, cu_k, causal=True)
    ref, _ = fa.attention_varlen_reference(q.float(), kk.float(), vv.float(), cu_q, cu_k)
    errs["flash_attention_varlen"] = err(out, ref)

    ctx, hq, hkv = (100, 8, 2) if smoke else (3000, 32, 8)
    q, k_cache, v_cache, tables, seq_lens = paged_inputs(3, ctx, hq, hkv, d, 16, dtype,
                                                         device)
    seq_lens[1] = ctx // 3  # ragged
    k_full = torch.stack([pa.gather_kv(k_cache, tables[0], ctx)])  # [1, Hkv, ctx, D]
    v_full = torch.stack([pa.gather_kv(v_cache, tables[0], ctx)])
    ref0 = sdpa_reference(q[:1, :, None], k_full, v_full, False)[:, :, 0]
    ref_all, _ = pa.paged_decode_reference(q.float(), k_cache.float(), v_cache.float(), tables,
                                           seq_lens)
    for splits in (1, 7, None):
        out, _ = pa.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens,
                                           num_splits=splits)
        errs[f"paged_decode_splits_{splits or 'auto'}_vs_sdpa"] = err(out[:1], ref0)
        errs[f"paged_decode_splits_{splits or 'auto'}_ragged"] = err(out, ref_all)

    new = [ctx // 4, 1, ctx // 3] if not smoke else [17, 1, 33]
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    qp = rand(sum(new), hq, d)
    out, _ = pa.paged_prefill_attention(qp, k_cache, v_cache, tables, cu, seq_lens)
    ref, _ = pa.paged_prefill_reference(qp.float(), k_cache.float(), v_cache.float(), tables,
                                        cu, seq_lens)
    errs["paged_prefill"] = err(out, ref)

    q, kk, vv = rand(2, 8, 33, d), rand(2, 2, 90, d), rand(2, 2, 90, d)
    oa, la = fa.flash_attention(q, kk[:, :, :50], vv[:, :, :50], causal=False)
    ob, lb = fa.flash_attention(q, kk[:, :, 50:], vv[:, :, 50:], causal=True)
    om, _ = km.merge_attention.merge_attention_states(oa, la, ob, lb)
    errs["merge_attention_states_vs_sdpa"] = err(om, sdpa_reference(q, kk, vv, True))

    n, rows, k_dim = (3000, 7, 48) if smoke else (100_000, 37, 200)
    x, y = rand(n), rand(n)
    errs["vector_add"] = err(km.vector_add.vector_add(x, y), x.float() + y.float())
    x = rand(rows, 1000) * 3
    errs["softmax"] = err(km.softmax.softmax(x), torch.softmax(x.float(), -1))
    x, w = rand(rows, 576), 1 + 0.1 * rand(576)
    errs["rmsnorm"] = err(km.rmsnorm.rmsnorm(x, w), km.rmsnorm.rmsnorm_reference(x, w))
    x = rand(1, 2, 50, 64)
    ang = torch.arange(50, device=device)[:, None] * torch.rand(32, device=device)[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    errs["rope"] = err(km.rope.apply_rope(x, cos.to(dtype), sin.to(dtype)),
                       km.rope.apply_rope_reference(x.float(), cos, sin))
    a, b = rand(5 * rows, k_dim), rand(k_dim, 7 * rows) / math.sqrt(k_dim)  # outputs ~ N(0, 1)
    errs["matmul"] = err(km.matmul.matmul(a, b), a.float() @ b.float())
    return errs


# ----------------------------------------------------------------------------- benchmarks
def bench_flash(km, device, dtype, seqlens, head_dims, batch, heads) -> list[dict]:
    """Triton FlashAttention vs SDPA (flash backend on CUDA), forward TFLOP/s.

    Both are timed eagerly (do_bench) and from a CUDA graph; TFLOP/s use the graph time.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.FLASH_ATTENTION if device.type == "cuda" else SDPBackend.MATH
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = []
    for d in head_dims:
        for n in seqlens:
            shape = (batch, heads, n, d)
            q, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))
            for causal in (False, True):
                flops = 4 * batch * heads * n * n * d * (0.5 if causal else 1.0)
                row = dict(N=n, d=d, causal=causal, batch=batch, heads=heads)
                triton_call = partial(km.flash_attention.flash_attention, q, k, v, causal=causal)
                sdpa_call = partial(sdpa, q, k, v, is_causal=causal)
                for name, call in (("triton", triton_call), ("sdpa", sdpa_call)):
                    with sdpa_kernel(backend):
                        eager = time_ms(call, device)
                        graph = time_ms_graph([call], device, eager)
                    best = graph if graph is not None else eager
                    row.update({f"{name}_ms_eager": eager, f"{name}_ms_graph": graph,
                                f"{name}_tflops": flops / best / 1e9})
                row["triton_over_sdpa"] = row["triton_tflops"] / row["sdpa_tflops"]
                rows.append(row)
            del q, k, v
    return rows


def decode_bytes(batch: int, context: int, hq: int, hkv: int, d: int, elem: int) -> int:
    """K and V of every cached token once, plus q read and out written."""
    return 2 * batch * context * hkv * d * elem + 2 * batch * hq * d * elem


def bench_decode(km, device, dtype, batches, contexts, hq, hkv, d, block_size,
                 copy_gbps: float, split_modes: dict[str, int | None],
                 cold_bytes: int) -> list[dict]:
    """Paged decode GB/s for each (batch, context) and split mode.

    Small problems are replicated (distinct blocks of one cache, distinct q) until the copies
    hold ``cold_bytes`` so the graph timing cycles through more data than the L2 holds.
    """
    pa = km.paged_attention
    rows = []
    for context in contexts:
        for batch in batches:
            nbytes = decode_bytes(batch, context, hq, hkv, d, torch.finfo(dtype).bits // 8)
            copies = max(1, -(-cold_bytes // nbytes))
            q, k_cache, v_cache, tables, seq_lens = paged_inputs(
                batch * copies, context, hq, hkv, d, block_size, dtype, device)
            for mode, splits in split_modes.items():
                calls = [partial(pa.paged_decode_attention, q[sl], k_cache, v_cache, tables[sl],
                                 seq_lens[sl], num_splits=splits, check_values=False)
                         for sl in (slice(i * batch, (i + 1) * batch) for i in range(copies))]
                used = splits or pa.choose_num_splits(batch, hkv, tables.shape[1] * block_size,
                                                      _sms(device))
                eager = time_ms(calls[0], device)  # what a Python caller sees, launches included
                graph = time_ms_graph(calls, device, eager)  # the kernels alone, HBM-cold
                best = graph if graph is not None else eager
                gbps = nbytes / (best * 1e-3) / 1e9
                rows.append(dict(batch=batch, context=context, mode=mode, num_splits=used,
                                 bytes=nbytes, copies=copies, us_eager=eager * 1e3,
                                 us_graph=None if graph is None else graph * 1e3,
                                 GBps=gbps, fraction_of_copy_bw=gbps / copy_gbps))
            del q, k_cache, v_cache, tables, seq_lens
    return rows


def _sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


# ----------------------------------------------------------------------------- printing
def print_table(title: str, rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """columns: (key, format spec) pairs."""
    print(f"\n{title}")
    widths = [max(len(k), 9) for k, _ in columns]
    print("  ".join(k.rjust(w) for (k, _), w in zip(columns, widths)))
    for r in rows:
        cells = []
        for (k, spec), w in zip(columns, widths):
            v = r[k]
            cells.append((format(v, spec) if spec and v is not None else str(v)).rjust(w))
        print("  ".join(cells))


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path of the JSON file to write")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes: checks the script runs (CPU interpreter or GPU)")
    args = parser.parse_args(argv)

    t_start = time.time()
    interpreting = setup_interpreter_if_no_gpu()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        parser.error("no GPU: run with --smoke to check the script in the Triton interpreter")
    km = load_kernel_modules()
    import triton

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    if args.smoke:
        seqlens, head_dims, batch, heads = [64, 96], [64], 1, 2
        batches, contexts, hq, hkv, d = [1, 2], [64, 160], 4, 2, 64
        copy_bytes, cold_bytes = 1 << 20, 0
    else:
        seqlens, head_dims, batch, heads = [1024, 2048, 4096, 8192, 16384], [64, 128], 4, 16
        batches, contexts, hq, hkv, d = [1, 16, 64], [1024, 4096, 16384], 32, 8, 128
        copy_bytes, cold_bytes = 2 << 30, 512 << 20  # several times the 50-60 MB L2
    block_size = 16

    from minillm.runinfo import git_commit

    result: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
        f"cpu ({platform.processor() or platform.machine()}, Triton interpreter)",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(dirty=("kernels", "benchmarks")) or "unknown",
        "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "dtype": str(dtype).replace("torch.", ""),
        "smoke": args.smoke, "interpreter": interpreting,
    }
    result["copy_bandwidth_GBps"] = copy_bandwidth_gbps(device, copy_bytes)
    print(f"{result['device']} | torch {torch.__version__} | triton {triton.__version__} | "
          f"copy bandwidth {result['copy_bandwidth_GBps']:.0f} GB/s")

    t0 = time.time()
    result["max_abs_error"] = check_correctness(km, device, dtype, args.smoke)
    result["correctness_s"] = time.time() - t0
    print(f"\nmax abs error vs torch ({dtype}, {result['correctness_s']:.0f} s incl. compile)")
    for name, e in result["max_abs_error"].items():
        flag = "" if math.isfinite(e) and e < 0.1 else "   <-- CHECK"
        print(f"  {name:44s} {e:.2e}{flag}")

    t0 = time.time()
    result["flash_attention"] = bench_flash(km, device, dtype, seqlens, head_dims, batch, heads)
    result["flash_attention_s"] = time.time() - t0
    print_table(f"FlashAttention forward, {result['dtype']}, B={batch}, H={heads} (TFLOP/s)",
                result["flash_attention"],
                [("N", ""), ("d", ""), ("causal", ""), ("triton_tflops", ".1f"),
                 ("sdpa_tflops", ".1f"), ("triton_over_sdpa", ".2f")])

    t0 = time.time()
    result["paged_decode"] = bench_decode(km, device, dtype, batches, contexts, hq, hkv, d,
                                          block_size, result["copy_bandwidth_GBps"],
                                          {"auto": None}, cold_bytes)
    result["split_kv_batch1"] = bench_decode(km, device, dtype, [1], contexts, hq, hkv, d,
                                             block_size, result["copy_bandwidth_GBps"],
                                             {"off": 1, "on": None}, cold_bytes)
    result["paged_decode_s"] = time.time() - t0
    result["paged_decode_config"] = dict(hq=hq, hkv=hkv, head_dim=d, block_size=block_size)
    print_table(f"Paged decode, Hq={hq}, Hkv={hkv}, D={d}, block_size={block_size} "
                f"(copy bandwidth {result['copy_bandwidth_GBps']:.0f} GB/s)",
                result["paged_decode"],
                [("batch", ""), ("context", ""), ("num_splits", ""), ("us_eager", ".1f"),
                 ("us_graph", ".1f"), ("GBps", ".0f"), ("fraction_of_copy_bw", ".2f")])
    print_table("Split-KV at batch 1: off (1 split) vs on (automatic)", result["split_kv_batch1"],
                [("context", ""), ("mode", ""), ("num_splits", ""), ("us_eager", ".1f"),
                 ("us_graph", ".1f"), ("GBps", ".0f"), ("fraction_of_copy_bw", ".2f")])

    result["elapsed_s"] = time.time() - t_start
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out} ({result['elapsed_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
