"""Counting what attention moves through HBM, and the Blockwise Parallel Transformer (chapter 05).

A GPU has a little fast on-chip memory (SRAM: registers and shared memory, of size M) and a lot
of slow off-chip memory (HBM). Kernels whose arithmetic is cheap are limited by the bytes they
move between the two, so we count those bytes:

- **Naive attention** (three kernels: ``S = Q K^T``, ``P = softmax(S)``, ``O = P V``) reads Q, K
  and V, writes the N x N matrix S, reads it back, writes P, reads it back, and writes O:
  ``4 N d + 4 N^2`` numbers per head. The N^2 terms dominate once N > d.
- **FlashAttention** (Dao et al., 2022) keeps a tile of B_r query rows on chip and streams K and
  V past it in tiles, so S and P never reach HBM. Q is read once and O written once; K and V are
  read once per query tile, ``ceil(N / B_r)`` times. With the tile size the SRAM allows,
  ``B_r ~ M / (4 d)``, that is ``2 N d + 8 N^2 d^2 / M`` numbers per head: the
  ``Theta(N^2 d^2 / M)`` of the paper's Theorem 2, which for d^2 < M is fewer than N^2.
  (This is the loop order of FlashAttention-2 and of ``minillm.kernels.flash_attention``; the
  paper's Algorithm 1 puts K/V in the outer loop and re-reads Q and O instead, same order.)
- **Paged decode** (one new query per sequence) must read the K and V of every cached token once,
  plus q and out; with split-KV each split also writes a partial output and log-sum-exp (fp32)
  that a second kernel reads back. Nothing else is large, so decode is a streaming copy.

All counts are in bytes, for ``batch`` sequences of ``heads`` heads, ``dtype_bytes`` per number.
``sram_bytes`` is M in bytes (on an H100/H200: up to 228 KiB of shared memory per SM).

The **Blockwise Parallel Transformer** (BPT, Liu & Abbeel, 2023) applies the same idea to a
whole layer: for each block of ``q_block`` query rows, run attention over the keys, then the FFN
on those rows at once, so the ``[T, ffn_dim]`` FFN activation only ever exists for one block.
:func:`bpt_block` is that loop; :func:`layer_sublayers` cuts a minillm decoder layer into the
two pieces it needs; :func:`layer_peak_bytes` counts the peak activation memory and
:func:`largest_intermediate_bytes` measures the largest tensor a call creates.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


# ----------------------------------------------------------------------------- FLOPs
def attention_flops(n: int, d: int, heads: int = 1, batch: int = 1, causal: bool = False) -> int:
    """Multiply-adds x 2 of ``Q K^T`` and ``P V`` over N queries and N keys: ``4 N^2 d`` per head
    (half of it when causal, the convention FlashAttention's benchmarks use)."""
    _check_positive(n=n, d=d, heads=heads, batch=batch)
    flops = 4 * batch * heads * n * n * d
    return flops // 2 if causal else flops


def decode_flops(context: int, d: int, q_heads: int, batch: int = 1) -> int:
    """One new query per sequence against ``context`` keys: ``4 context d`` per query head."""
    _check_positive(context=context, d=d, q_heads=q_heads, batch=batch)
    return 4 * batch * q_heads * context * d


# ----------------------------------------------------------------------------- naive attention
def naive_attention_io(n: int, d: int, heads: int = 1, batch: int = 1,
                       dtype_bytes: int = 2) -> dict[str, int]:
    """Bytes moved by unfused attention, one entry per transfer (sum them for the total).

    Kernel 1 reads Q and K and writes S [N, N]; kernel 2 reads S and writes P; kernel 3 reads P
    and V and writes O. Scores are stored in the input dtype (as ``q @ k.T`` in PyTorch does).
    """
    _check_positive(n=n, d=d, heads=heads, batch=batch, dtype_bytes=dtype_bytes)
    vec = batch * heads * n * d * dtype_bytes  # one of Q, K, V, O
    mat = batch * heads * n * n * dtype_bytes  # one of S, P
    return {"read Q": vec, "read K": vec, "write S": mat, "read S": mat, "write P": mat,
            "read P": mat, "read V": vec, "write O": vec}


def naive_attention_bytes(n: int, d: int, heads: int = 1, batch: int = 1,
                          dtype_bytes: int = 2) -> int:
    """``(4 N d + 4 N^2) x heads x batch x dtype_bytes``: see :func:`naive_attention_io`."""
    return sum(naive_attention_io(n, d, heads, batch, dtype_bytes).values())


# ----------------------------------------------------------------------------- flash attention
def flash_block_rows(d: int, sram_bytes: int, dtype_bytes: int = 2) -> int:
    """Query rows per tile that fit in SRAM: ``M / (4 d)`` numbers, as in Algorithm 1 of the
    paper (a Q tile, a K tile, a V tile and an output tile of about that many rows each)."""
    _check_positive(d=d, sram_bytes=sram_bytes, dtype_bytes=dtype_bytes)
    rows = sram_bytes // dtype_bytes // (4 * d)
    if rows < 1:
        raise ValueError(f"sram_bytes={sram_bytes} cannot hold even one row of each of four "
                         f"{d}-wide tiles ({4 * d * dtype_bytes} bytes)")
    return rows


def flash_attention_io(n: int, d: int, heads: int = 1, batch: int = 1, dtype_bytes: int = 2,
                       sram_bytes: int | None = None, block_rows: int | None = None,
                       causal: bool = False) -> dict[str, int]:
    """Bytes moved by FlashAttention, one entry per transfer.

    Give ``sram_bytes`` (the tile height follows from :func:`flash_block_rows`) or
    ``block_rows`` (a kernel's BLOCK_M). Each query tile reads its rows of Q once, streams the
    K and V rows it may see (all N, or with ``causal`` only those up to its last row), and
    writes its rows of O. The fp32 log-sum-exp a kernel may also write (N numbers) is left out.
    """
    _check_positive(n=n, d=d, heads=heads, batch=batch, dtype_bytes=dtype_bytes)
    if (sram_bytes is None) == (block_rows is None):
        raise ValueError("give exactly one of sram_bytes and block_rows")
    rows = flash_block_rows(d, sram_bytes, dtype_bytes) if block_rows is None else block_rows
    _check_positive(block_rows=rows)
    rows = min(rows, n)
    tiles = math.ceil(n / rows)
    if causal:  # tile i sees keys 0 .. min((i + 1) rows, N) - 1
        kv_rows = sum(min((i + 1) * rows, n) for i in range(tiles))
    else:
        kv_rows = tiles * n
    per_row = batch * heads * d * dtype_bytes
    return {"read Q": n * per_row, "read K": kv_rows * per_row, "read V": kv_rows * per_row,
            "write O": n * per_row}


def flash_attention_bytes(n: int, d: int, heads: int = 1, batch: int = 1, dtype_bytes: int = 2,
                          sram_bytes: int | None = None, block_rows: int | None = None,
                          causal: bool = False) -> int:
    """Total of :func:`flash_attention_io`. With ``sram_bytes`` and N a multiple of the tile
    height this is ``(2 N d + 8 N^2 d^2 / M) x heads x batch x dtype_bytes``, M in numbers."""
    return sum(flash_attention_io(n, d, heads, batch, dtype_bytes, sram_bytes, block_rows,
                                  causal).values())


# ----------------------------------------------------------------------------- paged decode
def paged_decode_io(context: int, d: int, q_heads: int, kv_heads: int, batch: int = 1,
                    dtype_bytes: int = 2, block_size: int | None = None,
                    num_splits: int = 1) -> dict[str, int]:
    """Bytes moved by one decode step of attention over a paged KV cache, per transfer.

    Every sequence has ``context`` cached tokens (the new one included). K and V are read once
    per kv head, shared by its ``q_heads // kv_heads`` query heads. ``block_size`` adds the block
    table (int32, one entry per block). ``num_splits > 1`` (split-KV / flash-decoding) adds the
    fp32 partial outputs and log-sum-exps that each split writes and the merge reads back.
    """
    _check_positive(context=context, d=d, q_heads=q_heads, kv_heads=kv_heads, batch=batch,
                    dtype_bytes=dtype_bytes, num_splits=num_splits)
    kv = batch * context * kv_heads * d * dtype_bytes
    io = {"read q": batch * q_heads * d * dtype_bytes, "read K": kv, "read V": kv,
          "write out": batch * q_heads * d * dtype_bytes}
    if block_size is not None:
        _check_positive(block_size=block_size)
        io["read block table"] = batch * math.ceil(context / block_size) * 4
    if num_splits > 1:
        partial = batch * q_heads * num_splits * (d + 1) * 4
        io["write partials"] = partial
        io["read partials"] = partial
    return io


def paged_decode_bytes(context: int, d: int, q_heads: int, kv_heads: int, batch: int = 1,
                       dtype_bytes: int = 2, block_size: int | None = None,
                       num_splits: int = 1) -> int:
    """Total of :func:`paged_decode_io`; without table and splits,
    ``2 B context H_kv d + 2 B H_q d`` numbers."""
    return sum(paged_decode_io(context, d, q_heads, kv_heads, batch, dtype_bytes, block_size,
                               num_splits).values())


# ----------------------------------------------------------------------------- BPT
AttnPart = Callable[[torch.Tensor, int, int], torch.Tensor]
FfnPart = Callable[[torch.Tensor], torch.Tensor]


def bpt_block(x: torch.Tensor, attn_fn: AttnPart, ffn: FfnPart, q_block: int) -> torch.Tensor:
    """One pre-norm decoder layer computed block by block over the queries (BPT).

    x [B, T, D]. ``attn_fn(x, start, stop)`` -> [B, stop - start, D]: the attention sublayer's
    output (before the residual add) for query rows start:stop, which attend over keys
    0:stop of x (causal). ``ffn(h)`` -> the FFN sublayer's output for the rows h [B, n, D].
    Blocks are visited in order, so the FFN's [n, ffn_dim] activations exist for at most
    ``q_block`` rows at a time. Returns [B, T, D], equal to the layer applied to all rows.
    """
    _check_positive(q_block=q_block)
    out = torch.empty_like(x)
    for start in range(0, x.shape[1], q_block):
        stop = min(start + q_block, x.shape[1])
        h = x[:, start:stop] + attn_fn(x, start, stop)
        out[:, start:stop] = h + ffn(h)
    return out


class _LayerKV:
    """K/V of one layer for the rows seen so far (a :class:`minillm.cache.Cache` look-alike)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.seen = 0

    def attend(self, layer: int, q, k, v, attn_fn):
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        return attn_fn(q, k, v)


def layer_sublayers(layer, cos: torch.Tensor, sin: torch.Tensor) -> tuple[AttnPart, FfnPart]:
    """(attn_fn, ffn) for :func:`bpt_block` from a :class:`minillm.model.Block`.

    cos/sin [1, 1, T, hd] are the RoPE tables of the T positions. ``attn_fn`` runs the layer's
    own attention module on rows start:stop, keeping the K/V of earlier rows as a KV cache
    does, so it must be called for consecutive blocks starting at row 0 (as bpt_block does).
    """
    kv = _LayerKV()

    def attn_fn(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        if start != kv.seen:
            raise ValueError(f"blocks must come in order: expected start={kv.seen}, got {start}")
        rows = layer.attn_norm(x[:, start:stop])
        out = layer.attn(rows, cos[..., start:stop, :], sin[..., start:stop, :], kv)
        kv.seen = stop
        return out

    def ffn(h: torch.Tensor) -> torch.Tensor:
        return layer.ffn(layer.ffn_norm(h))

    return attn_fn, ffn


def layer_peak_bytes(t: int, d_model: int, ffn_dim: int, n_heads: int,
                     q_block: int | None = None, batch: int = 1, dtype_bytes: int = 4,
                     scores: bool = False) -> dict[str, int]:
    """Activation bytes live at the peak of one decoder layer over T tokens (weights excluded).

    ``q_block`` None is the plain layer (all T rows at once), else BPT with that block. Counted:
    the residual stream in and out ([T, D] each, always whole); the FFN's gate, up and their
    product for the rows in flight ([rows, ffn_dim] each); with ``scores`` (unfused attention)
    the [heads, rows, T] score matrix, else nothing for attention (a fused kernel).
    The FFN and attention intermediates are not alive together, so the peak takes the larger.
    """
    _check_positive(t=t, d_model=d_model, ffn_dim=ffn_dim, n_heads=n_heads, batch=batch,
                    dtype_bytes=dtype_bytes)
    rows = t if q_block is None else min(q_block, t)
    unit = batch * dtype_bytes
    parts = {"residual in + out": 2 * t * d_model * unit,
             "FFN gate, up, product": 3 * rows * ffn_dim * unit,
             "attention scores": n_heads * rows * t * unit if scores else 0}
    parts["peak"] = parts["residual in + out"] + max(parts["FFN gate, up, product"],
                                                     parts["attention scores"])
    return parts


class _LargestTensor(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def largest_intermediate_bytes(fn: Callable[[], object]) -> int:
    """Run ``fn()`` and return the bytes of the largest tensor any operation inside created
    (views included, so a slice of a big tensor counts as big only if it is big itself)."""
    mode = _LargestTensor()
    with mode:
        fn()
    return mode.largest
