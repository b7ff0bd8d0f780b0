"""Attention over a paged KV cache: split-KV decode (flash-decoding) and chunked prefill.

Paged KV layout (the layout minillm's serving engine adopts, one pair per layer):

    k_cache, v_cache: [num_blocks, block_size, Hkv, D]

A physical block holds ``block_size`` consecutive token positions of one sequence, all kv heads.
Sequence b's logical block i (its positions i*block_size ... (i+1)*block_size - 1) lives in
physical block ``block_tables[b, i]``; ``block_tables`` is int32 [B, max_blocks] and entries past
a sequence's last block are never read. ``seq_lens`` int32 [B] counts the cached tokens of each
sequence, including any tokens whose attention is being computed now (their K/V are written
into the cache before the call).

Decode (one new query per sequence), q [B, Hq, D]. Flash-decoding splits each sequence's keys
into ``num_splits`` ranges so that a batch of one long sequence still fills the GPU. Kernel 1:
one program per (sequence, kv head, split) loads the ``Hq // Hkv`` query heads that share the kv
head (so each K/V byte is read once, not once per query head), streams its range of tokens,
and writes a partial (out, lse) per query head. Kernel 2 merges the splits with their
log-sum-exps. With one split kernel 1 writes the final result and kernel 2 is skipped.

Prefill/extend, packed q [total_q, Hq, D]: sequence i's new queries (rows
cu_seqlens_q[i]:cu_seqlens_q[i+1]) attend over its whole cached prefix plus themselves,
causal aligned to the end: new query r of a sequence with L = seq_lens[i] cached tokens and
n new tokens is position L - n + r and sees keys j <= L - n + r.

Both return (out, lse): lse (natural log, fp32) has out's shape without the last axis, so a
result can be merged with attention over other keys (``merge_attention_states``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    FLOAT_DTYPES,
    autotuned,
    check_device_ready,
    check_head_dim,
    check_heads,
    check_same_device,
    check_tensor,
    dot_precision,
    next_pow2,
    num_sms,
    softmax_scale,
    use_autotune,
)
from .flash_attention import LOG2E, attention_reference, finalize_softmax, online_softmax_update


# ----------------------------------------------------------------------------- shared piece
@triton.jit
def _load_paged_kv(KC, VC, table_row, tok, valid, kvh,
                   stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                   HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Gather K/V rows for token positions ``tok`` [N] of one sequence and kv head -> k, v [N, D].

    ``table_row`` points at the sequence's row of the block table; rows where ``valid`` is
    false read zeros (and touch no memory).
    """
    offs_d = tl.arange(0, HEAD_DIM)
    block = tl.load(table_row + tok // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    slot = tok % PAGE_SIZE
    k_rows = KC + block * stride_kb + slot * stride_kt + kvh * stride_kh
    v_rows = VC + block * stride_vb + slot * stride_vt + kvh * stride_vh
    k = tl.load(k_rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(v_rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    return k, v


# ----------------------------------------------------------------------------- decode kernels
@triton.jit
def _paged_decode_kernel(Q, KC, VC, BlockTables, SeqLens, Out, Lse,
                         stride_qb, stride_qh,
                         stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                         stride_tb,
                         stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_ls,
                         num_splits, qk_scale,
                         GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                         PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """Grid (B, Hkv, num_splits). Writes out/lse of split ``split`` for the GROUP query heads.

    Out [B, Hq, splits, D] / Lse [B, Hq, splits] (strides given; with one split these are the
    final out [B, Hq, D] and lse [B, Hq] seen with a unit split axis).
    """
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    # Split boundaries in tokens, rounded to whole BLOCK_N tiles.
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = (kvh * GROUP + offs_h).to(tl.int64)
    head_ok = offs_h < GROUP
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=head_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    table_row = BlockTables + b * stride_tb
    for start_n in range(start, end, BLOCK_N):
        tok = start_n + offs_n
        valid = tok < end
        k, v = _load_paged_kv(KC, VC, table_row, tok, valid, kvh,
                              stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                              HEAD_DIM, PAGE_SIZE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        acc, m_i, l_i = online_softmax_update(acc, m_i, l_i, s, v, DOT_PRECISION)
    out, lse = finalize_softmax(acc, m_i, l_i)
    o_ptrs = (Out + b * stride_ob + heads[:, None] * stride_oh + split * stride_os
              + offs_d[None, :])
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=head_ok[:, None])
    tl.store(Lse + b * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=head_ok)


@triton.jit
def _merge_splits_kernel(OutP, LseP, Out, Lse, Hq, num_splits,
                         stride_pb, stride_ph, stride_ps, stride_qb, stride_qh, stride_qs,
                         stride_ob, stride_oh, stride_lb, stride_lh,
                         HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    """Grid (B * Hq,): out = sum_s w_s out_s / sum_s w_s with w_s = exp(lse_s - max lse)."""
    pid = tl.program_id(0)
    b = (pid // Hq).to(tl.int64)
    h = (pid % Hq).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs_s < num_splits
    lse = tl.load(LseP + b * stride_qb + h * stride_qh + offs_s * stride_qs, mask=ok,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_ref)  # 0 for empty splits
    parts = tl.load(OutP + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps
                    + offs_d[None, :], mask=ok[:, None], other=0.0)
    total = tl.sum(w, 0)
    safe = tl.where(total == 0.0, 1.0, total)
    out = tl.sum(w[:, None] * parts, 0) / safe
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty))
    tl.store(Lse + b * stride_lb + h * stride_lh,
             tl.where(total == 0.0, float("-inf"), m_ref + tl.log(safe)))


# ----------------------------------------------------------------------------- prefill kernel
@triton.jit
def _paged_prefill_kernel(Q, KC, VC, BlockTables, CuQ, SeqLens, Out, Lse,
                          stride_qt, stride_qh,
                          stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                          stride_tb, stride_ot, stride_oh, stride_lt, stride_lh,
                          Hq, GROUP, qk_scale,
                          HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          DOT_PRECISION: tl.constexpr):
    """Grid (cdiv(max_q_len, BLOCK_M), n_seqs * Hq): BLOCK_M new queries of one head."""
    start_m = tl.program_id(0) * BLOCK_M
    pid_sh = tl.program_id(1)
    seq = pid_sh // Hq
    h = (pid_sh % Hq).to(tl.int64)
    kvh = h // GROUP
    q_start = tl.load(CuQ + seq).to(tl.int64)
    n_new = (tl.load(CuQ + seq + 1) - tl.load(CuQ + seq)).to(tl.int32)
    if start_m < n_new:
        seq_len = tl.load(SeqLens + seq)
        shift = seq_len - n_new  # new query r is position shift + r
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        rows = q_start + offs_m
        row_ok = offs_m < n_new
        q = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        table_row = BlockTables + seq.to(tl.int64) * stride_tb
        full_end = (tl.minimum(shift + start_m + 1, seq_len) // BLOCK_N) * BLOCK_N
        hi = tl.minimum(shift + start_m + BLOCK_M, seq_len)
        all_valid = offs_n >= 0
        for start_n in range(0, full_end, BLOCK_N):  # keys every row sees: no mask
            k, v = _load_paged_kv(KC, VC, table_row, start_n + offs_n, all_valid, kvh,
                                  stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                  stride_vh, HEAD_DIM, PAGE_SIZE)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            acc, m_i, l_i = online_softmax_update(acc, m_i, l_i, s, v, DOT_PRECISION)
        for start_n in range(full_end, hi, BLOCK_N):  # the causal diagonal
            tok = start_n + offs_n
            valid = tok < seq_len
            k, v = _load_paged_kv(KC, VC, table_row, tok, valid, kvh,
                                  stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                  stride_vh, HEAD_DIM, PAGE_SIZE)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            visible = valid[None, :] & (tok[None, :] <= shift + offs_m[:, None])
            s = tl.where(visible, s, float("-inf"))
            acc, m_i, l_i = online_softmax_update(acc, m_i, l_i, s, v, DOT_PRECISION)
        out, lse = finalize_softmax(acc, m_i, l_i)
        tl.store(Out + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None])
        tl.store(Lse + rows * stride_lt + h * stride_lh, lse, mask=row_ok)


# ----------------------------------------------------------------------------- launch choices
def _decode_configs() -> list:
    """Decode is memory-bound: tiles of 64-128 tokens, enough loads in flight (Hopper)."""
    return [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
            for bn, w, st in ((64, 4, 2), (128, 4, 2), (64, 4, 3), (128, 8, 3))]


def _prefill_configs() -> list:
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
            for bm, bn, w, st in ((128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3))]


_autotuned_decode = autotuned(_paged_decode_kernel, _decode_configs,
                              key=["GROUP", "HEAD_DIM", "PAGE_SIZE", "DOT_PRECISION"])
_autotuned_prefill = autotuned(_paged_prefill_kernel, _prefill_configs,
                               key=["HEAD_DIM", "PAGE_SIZE", "DOT_PRECISION"])

INTERPRETER_DECODE_BLOCK_N = 16
INTERPRETER_PREFILL_BLOCKS = {"BLOCK_M": 32, "BLOCK_N": 16}


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, sms: int = 132,
                      min_tokens_per_split: int = 256, max_splits: int = 64) -> int:
    """How many KV splits a decode call should use.

    One program per (sequence, kv head) already fills the GPU for a large batch: then 1. A
    small batch with a long context gets more programs, aiming at about 4 per multiprocessor,
    but never splits shorter than ``min_tokens_per_split`` tokens (merging has a cost).
    """
    programs = batch * num_kv_heads
    if programs >= sms or max_context <= min_tokens_per_split:
        return 1
    by_occupancy = triton.cdiv(4 * sms, programs)
    by_context = max(1, max_context // min_tokens_per_split)
    return max(1, min(by_occupancy, by_context, max_splits))


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, n_seqs: int) -> int:
    """Shared checks of the paged inputs; returns the GQA group size."""
    check_tensor("k_cache", k_cache, ndim=4, dtypes=(q.dtype,), last_dim_contiguous=True)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(q.dtype,), last_dim_contiguous=True)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape [num_blocks, "
                         f"block_size, Hkv, D], got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if k_cache.shape[-1] != q.shape[-1]:
        raise ValueError(f"q and k_cache must have the same head_dim, got {q.shape[-1]} and "
                         f"{k_cache.shape[-1]}")
    check_head_dim("q", q.shape[-1])
    group = check_heads(q.shape[-2], k_cache.shape[2])
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,),
                 last_dim_contiguous=True)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), contiguous=True)
    if block_tables.shape[0] != n_seqs:
        raise ValueError(f"block_tables must have one row per sequence ({n_seqs}), got shape "
                         f"{tuple(block_tables.shape)}")
    if seq_lens.shape[0] != n_seqs:
        raise ValueError(f"seq_lens must have one entry per sequence ({n_seqs}), got shape "
                         f"{tuple(seq_lens.shape)}")
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                      seq_lens=seq_lens)
    return group


def _check_cache_values(k_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor) -> None:
    """Checks that read tensor values (a host sync): lengths fit the tables, ids fit the cache."""
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    capacity = block_tables.shape[1] * block_size
    if seq_lens.numel() == 0:
        return
    lo, hi = int(seq_lens.min()), int(seq_lens.max())
    if lo < 0 or hi > capacity:
        raise ValueError(f"seq_lens must be in [0, max_blocks * block_size = {capacity}], got "
                         f"values in [{lo}, {hi}]")
    used = (torch.arange(block_tables.shape[1], device=seq_lens.device)[None, :] * block_size
            < seq_lens[:, None])
    ids = block_tables[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"block_tables entries in use must be in [0, {num_blocks}), got "
                         f"values in [{int(ids.min())}, {int(ids.max())}]")


# ----------------------------------------------------------------------------- wrappers
def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float | None = None, num_splits: int | None = None, *,
                           check_values: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One new query per sequence over its paged K/V (split-KV / flash-decoding).

    q [B, Hq, D]; k_cache/v_cache [num_blocks, block_size, Hkv, D]; block_tables int32
    [B, max_blocks]; seq_lens int32 [B] (0 allowed: out 0, lse -inf).
    -> out [B, Hq, D] in q's dtype, lse [B, Hq] fp32.
    ``num_splits`` None picks from batch size and context (``choose_num_splits``) without
    reading seq_lens; ``check_values`` False skips the checks that sync with the host (for
    CUDA graphs and timing).
    """
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    b, hq, d = q.shape
    group = _check_cache(q, k_cache, v_cache, block_tables, seq_lens, b)
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    if num_splits is None:
        num_splits = choose_num_splits(b, hkv, block_tables.shape[1] * block_size,
                                       num_sms(q.device))
    elif not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    scale = softmax_scale(scale, d)
    if check_values:
        _check_cache_values(k_cache, block_tables, seq_lens)
    check_device_ready(q)
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq), dtype=torch.float32, device=q.device)
    if b == 0:
        return out, lse
    if num_splits == 1:  # write the final result directly, seen with a unit split axis
        part_out, part_lse = out.unsqueeze(2), lse.unsqueeze(2)
    else:
        part_out = torch.empty((b, hq, num_splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((b, hq, num_splits), dtype=torch.float32, device=q.device)
    args = (q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
            *part_out.stride()[:3], *part_lse.stride(), num_splits, scale * LOG2E)
    consts = dict(GROUP=group, BLOCK_H=max(16, next_pow2(group)), HEAD_DIM=d,
                  PAGE_SIZE=block_size, DOT_PRECISION=dot_precision(q.dtype))
    grid = (b, hkv, num_splits)
    if use_autotune(q):
        _autotuned_decode()[grid](*args, **consts)
    else:
        _paged_decode_kernel[grid](*args, **consts, BLOCK_N=INTERPRETER_DECODE_BLOCK_N)
    if num_splits > 1:
        _merge_splits_kernel[(b * hq,)](part_out, part_lse, out, lse, hq, num_splits,
                                        *part_out.stride()[:3], *part_lse.stride(),
                                        *out.stride()[:2], *lse.stride(),
                                        HEAD_DIM=d, BLOCK_S=next_pow2(num_splits))
    return out, lse


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float | None = None, *,
                            max_seqlen_q: int | None = None, check_values: bool = True
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk of new queries per sequence over its cached prefix plus itself (causal).

    q [total_q, Hq, D] packed; cu_seqlens_q int32 [n + 1] (sequence i's new queries are rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1]); seq_lens int32 [n] cached tokens including the new
    ones (their K/V already written); k_cache/v_cache [num_blocks, block_size, Hkv, D];
    block_tables int32 [n, max_blocks]. -> out [total_q, Hq, D], lse [total_q, Hq] fp32.
    ``max_seqlen_q`` (the most new tokens of one sequence) is read from cu_seqlens_q if None.
    """
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    total_q, hq, d = q.shape
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32,), contiguous=True)
    n = cu_seqlens_q.numel() - 1
    if n < 1:
        raise ValueError(f"cu_seqlens_q must have n + 1 >= 2 entries, got {cu_seqlens_q.numel()}")
    group = _check_cache(q, k_cache, v_cache, block_tables, seq_lens, n)
    check_same_device(q=q, cu_seqlens_q=cu_seqlens_q)
    scale = softmax_scale(scale, d)
    if check_values or max_seqlen_q is None:
        cu = cu_seqlens_q.tolist()
        n_new = [b - a for a, b in zip(cu, cu[1:])]
        if cu[0] != 0 or cu[-1] != total_q or min(n_new) < 0:
            raise ValueError(f"cu_seqlens_q must be non-decreasing from 0 to total_q={total_q}, "
                             f"got {cu}")
        if max_seqlen_q is None:
            max_seqlen_q = max(n_new)
    if check_values:
        _check_cache_values(k_cache, block_tables, seq_lens)
        lens = seq_lens.tolist()
        if any(q_len > kv_len for q_len, kv_len in zip(n_new, lens)):
            raise ValueError(f"seq_lens must include the new tokens (seq_lens >= new tokens per "
                             f"sequence), got seq_lens {lens} and new tokens {n_new}")
        if max_seqlen_q < max(n_new):
            raise ValueError(f"max_seqlen_q={max_seqlen_q} is below the most new tokens of a "
                             f"sequence ({max(n_new)})")
    check_device_ready(q)
    out = torch.empty((total_q, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((total_q, hq), dtype=torch.float32, device=q.device)
    if total_q == 0 or max_seqlen_q == 0:
        return out, lse
    args = (q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, lse,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
            *out.stride()[:2], *lse.stride(), hq, group, scale * LOG2E)
    consts = dict(HEAD_DIM=d, PAGE_SIZE=k_cache.shape[1], DOT_PRECISION=dot_precision(q.dtype))
    if use_autotune(q):
        def grid(meta):
            return (triton.cdiv(max_seqlen_q, meta["BLOCK_M"]), n * hq)
        _autotuned_prefill()[grid](*args, **consts)
    else:
        grid = (triton.cdiv(max_seqlen_q, INTERPRETER_PREFILL_BLOCKS["BLOCK_M"]), n * hq)
        _paged_prefill_kernel[grid](*args, **consts, **INTERPRETER_PREFILL_BLOCKS)
    return out, lse


# ----------------------------------------------------------------------------- reference
def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's keys (or values) from the paged cache -> [Hkv, seq_len, D]."""
    block_size = cache.shape[1]
    n_blocks = -(-seq_len // block_size)
    rows = cache[block_table[:n_blocks].long()]  # [n_blocks, block_size, Hkv, D]
    return rows.reshape(-1, *cache.shape[2:])[:seq_len].transpose(0, 1)


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather each sequence's K/V and run plain attention: q [B, Hq, D] -> (out, lse)."""
    outs, lses = [], []
    for i, n in enumerate(seq_lens.tolist()):
        k = gather_kv(k_cache, block_tables[i], n)
        v = gather_kv(v_cache, block_tables[i], n)
        o, lse = attention_reference(q[i][:, None], k, v, causal=False, scale=scale)
        outs.append(o[:, 0])
        lses.append(lse[:, 0])
    return torch.stack(outs), torch.stack(lses)


def paged_prefill_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather each sequence's K/V and run causal attention (aligned to the end) on its chunk."""
    outs, lses = [], []
    cu = cu_seqlens_q.tolist()
    for i, n in enumerate(seq_lens.tolist()):
        k = gather_kv(k_cache, block_tables[i], n)
        v = gather_kv(v_cache, block_tables[i], n)
        o, lse = attention_reference(q[cu[i]:cu[i + 1]].transpose(0, 1), k, v, causal=True,
                                     scale=scale)
        outs.append(o.transpose(0, 1))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)
