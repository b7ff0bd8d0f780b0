"""FlashAttention forward (Dao et al., 2022) in Triton, dense and variable-length ("varlen").

Spec (dense):  q [B, Hq, T, D], k/v [B, Hkv, S, D] -> out [B, Hq, T, D], lse [B, Hq, T] fp32.
Spec (varlen): q [total_q, Hq, D], k/v [total_k, Hkv, D], cu_seqlens_q/k int32 [n + 1]
               -> out [total_q, Hq, D], lse [total_q, Hq] fp32.
In both, ``lse`` has the shape of ``out`` without its last axis.

- GQA: query head h reads kv head h // (Hq // Hkv); K/V are never repeated in memory.
- Causal masks are aligned to the END (the queries are the last T of S positions, as in
  ``minillm.attention``): query i sees key j when j <= S - T + i. Causal needs S >= T.
- ``lse`` is the natural-log log-sum-exp of each query's scaled scores: what
  ``merge_attention_states`` needs to combine attention over disjoint key sets.

The algorithm: one program owns BLOCK_M query rows of one (batch, head). It keeps those rows
of q in registers and streams K/V in BLOCK_N-row tiles, never writing the [T, S] score matrix to
memory. For each tile it updates a running max m, running denominator l and un-normalised
output acc ("online softmax", Milakov & Gimelshein 2018); ``online_softmax_update`` below is
that update, shared with the paged kernels. Exponentials are base 2 (``exp2`` is one
instruction): scores are pre-multiplied by scale * log2(e). Key tiles that every row of the
program may see are processed without a mask; only the last tiles (the causal diagonal, the
ragged end of S) pay for one.
"""
from __future__ import annotations

import math

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
    softmax_scale,
    use_autotune,
)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# ----------------------------------------------------------------------------- shared pieces
@triton.jit
def online_softmax_update(acc, m_i, l_i, s, v, DOT_PRECISION: tl.constexpr):
    """Fold one tile of scores into the running state.

    acc [M, D] fp32 un-normalised output; m_i, l_i [M] running max and denominator (log2
    units); s [M, N] scores already scaled by scale*log2(e), -inf where masked; v [N, D].
    A row whose scores are all -inf so far keeps m = -inf, l = 0, acc = 0 (no NaN).
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_ref)
    p = tl.math.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def finalize_softmax(acc, m_i, l_i):
    """-> out = acc / l, lse = ln(sum exp(scores)) (natural log); empty rows give 0 and -inf."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = (m_i + tl.math.log2(l_safe)) * 0.6931471805599453  # log2 units -> natural log
    return acc / l_safe[:, None], tl.where(empty, float("-inf"), lse)


@triton.jit
def _attend_rows(q_ptr, k_ptr, v_ptr, stride_qt, stride_kt, stride_vt, T, S, start_m, qk_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Attention of rows [start_m, start_m + BLOCK_M) of one head over S keys -> (acc, m, l).

    q_ptr/k_ptr/v_ptr point at row 0 of this head; rows are ``stride_*t`` elements apart and
    the head dimension is contiguous.
    """
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=offs_m[:, None] < T, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    shift = S - T  # query i is position shift + i
    if CAUSAL:
        full_end = tl.minimum(shift + start_m + 1, S)  # keys every row of the tile may see
        hi = tl.minimum(shift + start_m + BLOCK_M, S)  # keys some row of the tile may see
    else:
        full_end = S
        hi = S
    full_end = (full_end // BLOCK_N) * BLOCK_N

    # Phase 1: whole tiles visible to every row, no mask.
    for start_n in range(0, full_end, BLOCK_N):
        rows = start_n + offs_n
        k = tl.load(k_ptr + rows[:, None] * stride_kt + offs_d[None, :])
        v = tl.load(v_ptr + rows[:, None] * stride_vt + offs_d[None, :])
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        acc, m_i, l_i = online_softmax_update(acc, m_i, l_i, s, v, DOT_PRECISION)

    # Phase 2: the causal diagonal and the ragged end of S, masked.
    for start_n in range(full_end, hi, BLOCK_N):
        rows = start_n + offs_n
        in_range = rows < S
        k = tl.load(k_ptr + rows[:, None] * stride_kt + offs_d[None, :],
                    mask=in_range[:, None], other=0.0)
        v = tl.load(v_ptr + rows[:, None] * stride_vt + offs_d[None, :],
                    mask=in_range[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        visible = in_range[None, :]
        if CAUSAL:
            visible = visible & (rows[None, :] <= shift + offs_m[:, None])
        s = tl.where(visible, s, float("-inf"))
        acc, m_i, l_i = online_softmax_update(acc, m_i, l_i, s, v, DOT_PRECISION)
    return acc, m_i, l_i


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _flash_fwd_kernel(Q, K, V, Out, Lse,
                      stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                      stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
                      stride_lb, stride_lh,
                      Hq, T, S, GROUP, qk_scale,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Grid (cdiv(T, BLOCK_M), B * Hq): one program per (query tile, batch, query head)."""
    start_m = tl.program_id(0) * BLOCK_M
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    kvh = h // GROUP
    acc, m_i, l_i = _attend_rows(Q + b * stride_qb + h * stride_qh,
                                 K + b * stride_kb + kvh * stride_kh,
                                 V + b * stride_vb + kvh * stride_vh,
                                 stride_qt, stride_kt, stride_vt, T, S, start_m, qk_scale,
                                 HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, DOT_PRECISION)
    out, lse = finalize_softmax(acc, m_i, l_i)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    o_ptrs = Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_m[:, None] < T)
    tl.store(Lse + b * stride_lb + h * stride_lh + offs_m, lse, mask=offs_m < T)


@triton.jit
def _flash_varlen_kernel(Q, K, V, Out, Lse, CuQ, CuK,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_ot, stride_oh, stride_lt, stride_lh,
                         Hq, GROUP, qk_scale,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Grid (cdiv(max_seqlen_q, BLOCK_M), n_seqs * Hq); tiles past a sequence's end exit."""
    start_m = tl.program_id(0) * BLOCK_M
    pid_sh = tl.program_id(1)
    seq = pid_sh // Hq
    h = (pid_sh % Hq).to(tl.int64)
    kvh = h // GROUP
    q_start = tl.load(CuQ + seq).to(tl.int64)
    T = (tl.load(CuQ + seq + 1) - tl.load(CuQ + seq)).to(tl.int32)
    k_start = tl.load(CuK + seq).to(tl.int64)
    S = (tl.load(CuK + seq + 1) - tl.load(CuK + seq)).to(tl.int32)
    if start_m < T:
        acc, m_i, l_i = _attend_rows(Q + q_start * stride_qt + h * stride_qh,
                                     K + k_start * stride_kt + kvh * stride_kh,
                                     V + k_start * stride_vt + kvh * stride_vh,
                                     stride_qt, stride_kt, stride_vt, T, S, start_m, qk_scale,
                                     HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, DOT_PRECISION)
        out, lse = finalize_softmax(acc, m_i, l_i)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        rows = q_start + offs_m
        o_ptrs = Out + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_m[:, None] < T)
        tl.store(Lse + rows * stride_lt + h * stride_lh, lse, mask=offs_m < T)


# ----------------------------------------------------------------------------- launch choices
INTERPRETER_BLOCKS = {"BLOCK_M": 32, "BLOCK_N": 16}  # small tiles: many tiles in tiny tests


def _configs() -> list:
    """Few configs that are good for bf16, head_dim 64/128, on Hopper (H100/H200)."""
    def cfg(bm, bn, warps, stages):
        return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)
    return [cfg(128, 64, 4, 3), cfg(128, 64, 8, 3), cfg(128, 128, 8, 2), cfg(64, 64, 4, 3)]


_autotuned_fwd = autotuned(_flash_fwd_kernel, _configs, key=["HEAD_DIM", "CAUSAL",
                                                             "DOT_PRECISION"])
_autotuned_varlen = autotuned(_flash_varlen_kernel, _configs, key=["HEAD_DIM", "CAUSAL",
                                                                   "DOT_PRECISION"])


def _launch(kernel, autotuned_kernel, like: torch.Tensor, rows: int, programs: int,
            args: tuple, **constexprs) -> None:
    """Launch with autotuned blocks on a GPU, fixed small blocks in the interpreter."""
    if use_autotune(like):
        def grid(meta):
            return (triton.cdiv(rows, meta["BLOCK_M"]), programs)
        autotuned_kernel()[grid](*args, **constexprs)
    else:
        grid = (triton.cdiv(rows, INTERPRETER_BLOCKS["BLOCK_M"]), programs)
        kernel[grid](*args, **constexprs, **INTERPRETER_BLOCKS)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ndim: int) -> None:
    check_tensor("q", q, ndim=ndim, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor("k", k, ndim=ndim, dtypes=(q.dtype,), last_dim_contiguous=True)
    check_tensor("v", v, ndim=ndim, dtypes=(q.dtype,), last_dim_contiguous=True)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[-1]} and "
                         f"{k.shape[-1]}")
    check_head_dim("q", q.shape[-1])
    check_same_device(q=q, k=k, v=v)


# ----------------------------------------------------------------------------- wrappers
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale [+ causal mask]) v without materialising the scores.

    q [B, Hq, T, D], k/v [B, Hkv, S, D] (Hkv divides Hq; D a power of two in [16, 256];
    fp16/bf16/fp32; last dim contiguous) -> out [B, Hq, T, D] in q's dtype, lse [B, Hq, T] fp32.
    ``scale`` defaults to 1/sqrt(D). Causal: query i sees keys j <= S - T + i (needs S >= T).
    """
    _check_qkv(q, k, v, ndim=4)
    b, hq, t, d = q.shape
    if k.shape[0] != b:
        raise ValueError(f"q and k must have the same batch size, got {b} and {k.shape[0]}")
    hkv, s = k.shape[1], k.shape[2]
    group = check_heads(hq, hkv)
    if causal and s < t:
        raise ValueError(f"causal attention needs at least as many keys as queries "
                         f"(the queries are the last T of S positions), got T={t}, S={s}")
    scale = softmax_scale(scale, d)
    check_device_ready(q)
    out = torch.empty((b, hq, t, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, t), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if s == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    args = (q, k, v, out, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *out.stride()[:3], *lse.stride()[:2], hq, t, s, group, scale * LOG2E)
    _launch(_flash_fwd_kernel, _autotuned_fwd, q, t, b * hq, args, HEAD_DIM=d,
            CAUSAL=bool(causal), DOT_PRECISION=dot_precision(q.dtype))
    return out, lse


def _check_cu_seqlens(name: str, cu: torch.Tensor, total: int, n_seqs: int | None) -> None:
    check_tensor(name, cu, ndim=1, dtypes=(torch.int32,), contiguous=True)
    if cu.numel() < 2:
        raise ValueError(f"{name} must have n + 1 >= 2 entries, got {cu.numel()}")
    if n_seqs is not None and cu.numel() != n_seqs + 1:
        raise ValueError(f"{name} must have {n_seqs + 1} entries, got {cu.numel()}")
    vals = cu.tolist()
    if vals[0] != 0 or vals[-1] != total:
        raise ValueError(f"{name} must start at 0 and end at the packed length {total}, got "
                         f"{vals[0]} ... {vals[-1]}")
    if any(b < a for a, b in zip(vals, vals[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {vals}")


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           causal: bool = True, scale: float | None = None, *,
                           max_seqlen_q: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention over n packed sequences (no padding).

    q [total_q, Hq, D], k/v [total_k, Hkv, D]; sequence i owns q rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1] and k/v rows cu_seqlens_k[i]:cu_seqlens_k[i+1]
    (cu_seqlens int32 [n + 1], starting at 0). -> out [total_q, Hq, D], lse [total_q, Hq] fp32.
    The offsets are read on the host to check them (one sync); ``max_seqlen_q`` is then known.
    """
    _check_qkv(q, k, v, ndim=3)
    total_q, hq, d = q.shape
    total_k, hkv = k.shape[0], k.shape[1]
    group = check_heads(hq, hkv)
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, None)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, cu_seqlens_q.numel() - 1)
    check_same_device(q=q, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    lens_q = cu_seqlens_q.diff().tolist()
    lens_k = cu_seqlens_k.diff().tolist()
    if causal and any(lk < lq for lq, lk in zip(lens_q, lens_k)):
        raise ValueError(f"causal attention needs seqlen_k >= seqlen_q for every sequence, got "
                         f"q lengths {lens_q} and k lengths {lens_k}")
    if max_seqlen_q is None:
        max_seqlen_q = max(lens_q)
    elif max_seqlen_q < max(lens_q):
        raise ValueError(f"max_seqlen_q={max_seqlen_q} is below the longest query "
                         f"sequence ({max(lens_q)})")
    scale = softmax_scale(scale, d)
    check_device_ready(q)
    out = torch.empty((total_q, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((total_q, hq), dtype=torch.float32, device=q.device)
    if total_q == 0 or max_seqlen_q == 0:
        return out, lse
    n = cu_seqlens_q.numel() - 1
    args = (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *q.stride()[:2], *k.stride()[:2],
            *v.stride()[:2], *out.stride()[:2], *lse.stride(), hq, group, scale * LOG2E)
    _launch(_flash_varlen_kernel, _autotuned_varlen, q, max_seqlen_q, n * hq, args,
            HEAD_DIM=d, CAUSAL=bool(causal), DOT_PRECISION=dot_precision(q.dtype))
    return out, lse


# ----------------------------------------------------------------------------- reference
def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                        scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, scores materialised: q [..., Hq, T, D], k/v [..., Hkv, S, D] -> (out, lse).

    Computed in q's dtype (pass float64 tensors for a high-precision reference). Rows with no
    visible key give out 0 and lse -inf.
    """
    group = q.shape[-3] // k.shape[-3]
    k = k.repeat_interleave(group, dim=-3)
    v = v.repeat_interleave(group, dim=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        t, s = q.shape[-2], k.shape[-2]
        i = torch.arange(t, device=q.device)[:, None]
        j = torch.arange(s, device=q.device)[None, :]
        scores = scores.masked_fill(j > s - t + i, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None].clamp_min(torch.finfo(scores.dtype).min))
    return probs @ v, lse


def attention_varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                               causal: bool = True, scale: float | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Loop over the packed sequences and call ``attention_reference`` on each."""
    outs, lses = [], []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        qi = q[cq[i]:cq[i + 1]].transpose(0, 1)  # [Hq, Tq, D]
        ki = k[ck[i]:ck[i + 1]].transpose(0, 1)
        vi = v[ck[i]:ck[i + 1]].transpose(0, 1)
        o, lse = attention_reference(qi, ki, vi, causal, scale)
        outs.append(o.transpose(0, 1))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)
