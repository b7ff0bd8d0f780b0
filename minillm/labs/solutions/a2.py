"""Appendix A2's key: reference solutions, written from the rules the chapter teaches."""
from __future__ import annotations

import math

import torch

from minillm.device import setup_triton
from minillm.labs import a2

setup_triton()  # interpreter mode on a CPU: before triton is imported and the kernels defined
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


def blocks_per_sm(threads, regs, smem):
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(regs * 32 / 256) * 256
    smem_per_block = math.ceil((smem + 1024) / 128) * 128
    limits = [64 // warps, 32, 228 * 1024 // smem_per_block]
    if regs_per_warp:
        limits.append(65536 // (regs_per_warp * warps))
    return min(limits)


def matmul_intensity(m, n, k, bytes_per_elem):
    return 2 * m * n * k / ((m * k + k * n + m * n) * bytes_per_elem)


def compute_bound_size(bandwidth, peak_flops, bytes_per_elem):
    # 2n^3 / (3 n^2 b) >= peak / bw  <=>  n >= 1.5 b peak / bw
    return math.ceil(1.5 * bytes_per_elem * peak_flops / bandwidth - 1e-9)


@triton.jit
def _add_2d_kernel(X, Y, Out, m, n, sxm, sxn, sym, syn, som, son,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < m) & (cols[None, :] < n)
    x = tl.load(X + rows[:, None] * sxm + cols[None, :] * sxn, mask=mask)
    y = tl.load(Y + rows[:, None] * sym + cols[None, :] * syn, mask=mask)
    tl.store(Out + rows[:, None] * som + cols[None, :] * son, x + y, mask=mask)


def add_2d(x, y, block_m, block_n):
    m, n = x.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _add_2d_kernel[grid](x, y, out, m, n, *x.stride(), *y.stride(), *out.stride(),
                         BLOCK_M=block_m, BLOCK_N=block_n)
    return out


@triton.jit
def _softmax_rows_kernel(X, Out, n, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)  # per-lane running max and sum
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        x = tl.load(X + row * stride_x + start + cols, mask=start + cols < n, other=float("-inf"))
        m_new = tl.maximum(m, x)
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.exp(m - ref) + tl.exp(x - ref)
        m = m_new
    row_max = tl.max(m, 0)
    den = tl.sum(total * tl.exp(tl.where(m == float("-inf"), row_max, m) - row_max), 0)
    for start in range(0, n, BLOCK):
        mask = start + cols < n
        x = tl.load(X + row * stride_x + start + cols, mask=mask, other=float("-inf"))
        tl.store(Out + row * stride_o + start + cols, tl.exp(x - row_max) / den, mask=mask)


def softmax_rows(x, block):
    out = torch.empty_like(x)
    _softmax_rows_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), out.stride(0),
                                        BLOCK=block)
    return out


@triton.jit
def _matmul_kernel(A, B, C, m, n, k, sam, sak, sbk, sbn, scm, scn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        a = tl.load(A + rows[:, None] * sam + (k0 + ks)[None, :] * sak,
                    mask=(rows[:, None] < m) & (k0 + ks[None, :] < k), other=0.0)
        b = tl.load(B + (k0 + ks)[:, None] * sbk + cols[None, :] * sbn,
                    mask=(k0 + ks[:, None] < k) & (cols[None, :] < n), other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    tl.store(C + rows[:, None] * scm + cols[None, :] * scn, acc,
             mask=(rows[:, None] < m) & (cols[None, :] < n))


def matmul(a, b, block_m, block_n, block_k):
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty(m, n, dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _matmul_kernel[grid](a, b, c, m, n, k, *a.stride(), *b.stride(), *c.stride(),
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return c


def tiled_matmul_bytes(m, n, k, block_m, block_n, bytes_per_elem):
    col_tiles, row_tiles = -(-n // block_n), -(-m // block_m)
    return (m * k * col_tiles + k * n * row_tiles + m * n) * bytes_per_elem


KEY = [
    (a2.check_blocks_per_sm, blocks_per_sm),
    (a2.check_matmul_intensity, matmul_intensity),
    (a2.check_compute_bound_size, compute_bound_size),
    (a2.check_add_2d, add_2d),
    (a2.check_softmax_rows, softmax_rows),
    (a2.check_softmax_in_model, softmax_rows),
    (a2.check_tiled_matmul_bytes, tiled_matmul_bytes),
    (a2.check_matmul_in_model, matmul),
]
