"""Attention over the paged KV cache on the CPU, reading the blocks where they lie (C++/OpenMP).

The engine's portable path (``minillm.attention.paged``, backend ``sdpa``) gathers every
sequence's blocks into a padded contiguous batch and calls SDPA with a mask: on the CPU, at 64
decoding sequences, the gather copies the whole cache once per layer and SDPA then reads the
copy again, which costs more than the attention itself. This kernel is the CPU twin of the
Triton paged kernels of chapter 05: it walks each sequence's block table and streams the keys
and values straight from ``k_cache, v_cache [num_blocks, block_size, Hkv, D]``, with the
online-softmax update per block, so each K/V byte is read once per step and nothing is copied.

Work item: one sequence, whose new tokens times its ``Hq`` query heads are its query rows (the
``Hq // Hkv`` heads of a KV head read the same keys, from L1). OpenMP threads share the items;
they are PyTorch's own OpenMP threads (this library links the same ``libgomp`` that torch has
loaded), so there is no second pool fighting torch's for the cores. While a block is worked on,
the next one is prefetched a slice of cache lines per query row: issued as one burst, the 192
prefetches of a bfloat16 block stalled the loads behind them (the A/B is in the git log).
The arithmetic is fp32 with an exp of its own (error ~1e-7 relative, float32's rounding). On
CPUs with AVX512-BF16 the bfloat16 kernel takes q . k from the cached bf16 values with
``vdpbf16ps`` (bf16 products are exact in fp32, the sums fp32) and sums 16 keys' partial dot
products with one transposing reduction; elsewhere bf16 is widened on load. Semantics are those
of ``paged_prefill_attention``: sequence i's new query r, with L = seq_lens[i] cached tokens of
which n are new, sees keys j <= L - n + r; a speculative tree's rows (optional per-row bit
masks over the last keys, at most 64) also skip the keys their mask hides, so a tree draft is
verified here too instead of being gathered for SDPA.

The C++ is ``cpu_paged_attention.cpp`` beside this file, compiled after ``cpu_build.SCALARS``
on first use by :mod:`.cpu_build` (``-O3 -march=native``, about a second) into a cache folder
keyed by the source, the flags and the CPU, and loaded with ctypes (a direct call: a
``torch.library`` custom op would add about 0.3 ms of dispatch per layer, 5% of a batch-64
step; the engine's step runs eagerly, so nothing needs to trace it).
:func:`available` says whether the build worked; the engine uses this kernel on the CPU only
when it did, else the SDPA path.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .cpu_build import SCALARS, Library, profiled_call

DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
# (q's dtype, the cache's) -> the C++ entry's suffix: the cache in q's dtype, bfloat16 below
# float32 queries, or int8 with per-token, per-head float32 scales (minillm.attention.kv_quant)
FORMATS = {(torch.float32, torch.float32): "f32", (torch.bfloat16, torch.bfloat16): "bf16",
           (torch.float32, torch.bfloat16): "f32_kvbf16", (torch.float32, torch.int8): "f32_kvi8",
           (torch.bfloat16, torch.int8): "bf16_kvi8"}
MAX_HEAD_DIM = 256

SOURCE_FILE = Path(__file__).with_name("cpu_paged_attention.cpp")   # the C++, after SCALARS
SOURCE = SCALARS + SOURCE_FILE.read_text()

_ARGS = [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + \
    [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_float] + \
    [ctypes.c_void_p] * 4
MAX_MASK = 64         # a tree mask's keys: one int64 of bits per row
LIBRARY = Library("paged_attention", SOURCE,
                  {f"paged_attention_{fmt}": _ARGS for fmt in FORMATS.values()},
                  source_file=SOURCE_FILE)


def _parts(cache) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(data, scales or None) of a layer's cache: a tensor or an ``Int8Blocks``."""
    return (cache.data, cache.scale) if hasattr(cache, "scale") else (cache, None)


def available() -> bool:
    """Can the kernel run here (a C++ compiler built it)?"""
    return LIBRARY.get() is not None


def unavailable_reason() -> str:
    """Why :func:`available` is False ('' when it is True)."""
    return LIBRARY.reason()


def attend_in_place(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seqs: torch.Tensor, out: torch.Tensor,
                    scale: float | None = None, row_bits: torch.Tensor | None = None,
                    mask_from: torch.Tensor | None = None) -> None:
    """The C++ call itself, unchecked (for the engine, which built every index it passes; use
    :func:`cpu_paged_attention` otherwise): writes sequences ``seqs``' rows of ``out``.
    ``k_cache``, ``v_cache``: tensors, or ``Int8Blocks`` (data and scales) for an int8 cache.
    Tree masks (both or neither): ``row_bits`` int64 [N], per row the keys it sees among its
    sequence's keys ``mask_from[s]`` (int32 [S]) onwards, bit j for key mask_from[s] + j (at
    most :data:`MAX_MASK` keys; -1: no mask, causal), on top of the causal rule."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    (kc, ks), (vc, vs) = _parts(k_cache), _parts(v_cache)
    fn = getattr(LIBRARY.get(), f"paged_attention_{FORMATS[q.dtype, kc.dtype]}")
    hq, d = q.shape[1:]
    args = (q.data_ptr(), kc.data_ptr(), vc.data_ptr(), block_tables.data_ptr(),
            block_tables.shape[1], seq_lens.data_ptr(), cu_seqlens_q.data_ptr(),
            seqs.data_ptr(), seqs.shape[0], out.data_ptr(), hq, kc.shape[2], d,
            kc.shape[1], scale, None if ks is None else ks.data_ptr(),
            None if vs is None else vs.data_ptr(),
            None if row_bits is None else row_bits.data_ptr(),
            None if mask_from is None else mask_from.data_ptr())
    profiled_call(fn, "cpu_paged_attention", *args)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
           seqs: torch.Tensor, out: torch.Tensor) -> None:
    """Raise ValueError naming the argument unless the call is one the kernel can do."""
    (k_cache, k_scale), (v_cache, v_scale) = _parts(k_cache), _parts(v_cache)
    for name, t in [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)]:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CPU tensor, got one on {t.device}")
    if q.dtype not in DTYPES or out.dtype != q.dtype:
        raise ValueError(f"q and out must both be float32 or bfloat16, got {q.dtype}, "
                         f"{out.dtype}")
    if (q.dtype, k_cache.dtype) not in FORMATS or v_cache.dtype != k_cache.dtype:
        allowed = [str(c).removeprefix("torch.") for qd, c in FORMATS if qd == q.dtype]
        raise ValueError(f"k_cache and v_cache must share a dtype in {allowed} for {q.dtype} "
                         f"queries, got {k_cache.dtype}, {v_cache.dtype}")
    if (k_cache.dtype == torch.int8) != (k_scale is not None and v_scale is not None):
        raise ValueError("an int8 k_cache / v_cache comes with its scales (Int8Blocks)")
    for name, sc in [("k_cache.scale", k_scale), ("v_cache.scale", v_scale)]:
        if sc is not None and (sc.dtype != torch.float32 or not sc.is_contiguous()
                               or sc.shape != k_cache.shape[:3]):
            raise ValueError(f"{name} must be contiguous float32 {list(k_cache.shape[:3])}, "
                             f"got {sc.dtype} {list(sc.shape)}")
    for name, t in [("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("cu_seqlens_q", cu_seqlens_q), ("seqs", seqs)]:
        if t.device.type != "cpu" or t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32 CPU tensor, got {t.dtype}")
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q must be [N, Hq, D] and k_cache, v_cache [blocks, block_size, Hkv, D]"
                         f", got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    hq, d = q.shape[1:]
    if k_cache.shape[3] != d or d > MAX_HEAD_DIM or hq % k_cache.shape[2]:
        raise ValueError(f"head_dim must match (q {d}, cache {k_cache.shape[3]}, at most "
                         f"{MAX_HEAD_DIM}) and Hkv ({k_cache.shape[2]}) must divide Hq ({hq})")
    if out.shape != q.shape:
        raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")


def cpu_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, seqs: torch.Tensor | None = None,
                        out: torch.Tensor | None = None, scale: float | None = None,
                        check_values: bool = True) -> torch.Tensor:
    """Causal attention of packed new queries q [N, Hq, D] over the paged cache (the contract
    of ``paged_prefill_attention``: block_tables int32 [S, W], seq_lens int32 [S] cached tokens
    including the new ones, cu_seqlens_q int32 [S + 1]). ``seqs`` int32 [M]: the sequences to
    attend (default all); only their rows of ``out`` [N, Hq, D] are written (``out`` default: a
    new tensor, the other rows uninitialised). ``check_values`` also checks the tables' and
    lengths' values against the cache (a host pass; the engine, which built them, skips it)."""
    if not available():
        raise RuntimeError(f"the CPU paged-attention kernel is unavailable: "
                           f"{unavailable_reason()}")
    seqs = torch.arange(seq_lens.shape[0], dtype=torch.int32) if seqs is None else seqs
    out = torch.empty_like(q) if out is None else out
    _check(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, seqs, out)
    if check_values:
        _check_values(q, k_cache, block_tables, seq_lens, cu_seqlens_q, seqs)
    attend_in_place(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, seqs, out, scale)
    return out


def _check_values(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, seqs: torch.Tensor) -> None:
    """Every index the kernel will follow is in range (it reads raw memory)."""
    s = seq_lens.shape[0]
    if cu_seqlens_q.shape[0] != s + 1 or block_tables.shape[0] != s:
        raise ValueError(f"cu_seqlens_q must have S + 1 = {s + 1} entries and block_tables S "
                         f"rows, got {cu_seqlens_q.shape[0]} and {block_tables.shape[0]}")
    cu, lens = cu_seqlens_q.long(), seq_lens.long()
    n_new = cu[1:] - cu[:-1]
    if cu[0] != 0 or (n_new < 0).any() or cu[-1] > q.shape[0]:
        raise ValueError(f"cu_seqlens_q must rise from 0 to at most N = {q.shape[0]}")
    if ((lens < n_new) | (lens > block_tables.shape[1] * k_cache.shape[1])).any():
        raise ValueError("seq_lens must be at least each sequence's new tokens and fit its "
                         "block table")
    if seqs.numel() and (seqs.min() < 0 or seqs.max() >= s):
        raise ValueError(f"seqs must index the S = {s} sequences")
    used = torch.arange(block_tables.shape[1]) < (-(-lens // k_cache.shape[1]))[:, None]
    blocks = block_tables[used]
    if blocks.numel() and (blocks.min() < 0 or blocks.max() >= k_cache.shape[0]):
        raise ValueError(f"block_tables entries must be block ids in [0, {k_cache.shape[0]})")
