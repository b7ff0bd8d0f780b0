"""Tiled matrix multiply with fp32 accumulation (Appendix A2).

Spec: a [M, K] @ b [K, N] -> c [M, N] in a's dtype. Each program computes one
BLOCK_M x BLOCK_N tile of c, walking K in BLOCK_K steps and accumulating in fp32 registers.
Programs are numbered in groups of GROUP_M tile-rows ("swizzled") so tiles that run together
share rows of a and columns of b in the L2 cache.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    FLOAT_DTYPES,
    autotuned,
    check_device_ready,
    check_tensor,
    dot_precision,
    use_autotune,
)


@triton.jit
def _matmul_kernel(A, B, C, M, N, K,
                   stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_rows
    pid_n = (pid % (GROUP_M * tiles_n)) // group_rows

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = A + rm[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak
    b_ptrs = B + rk[:, None].to(tl.int64) * stride_bk + rn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & (rk[None, :] + k0 < K), other=0.0)
        b = tl.load(b_ptrs, mask=(rk[:, None] + k0 < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = C + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _configs() -> list:
    """A short list that is good for bf16 on Hopper (H100/H200)."""
    def cfg(bm, bn, bk, warps, stages):
        return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                             num_warps=warps, num_stages=stages)
    return [cfg(128, 256, 64, 8, 3), cfg(128, 128, 64, 4, 4), cfg(128, 128, 64, 8, 3),
            cfg(64, 128, 64, 4, 4)]


_autotuned_matmul = autotuned(_matmul_kernel, _configs, key=["M", "N", "K", "DOT_PRECISION"])


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N] (fp32 accumulation, result in a's dtype)."""
    check_tensor("a", a, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("b", b, ndim=2, dtypes=(a.dtype,))
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a [M, K] and b [K, N] disagree on K: a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)}")
    check_device_ready(a)
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_()
    args = (a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            c.stride(0), c.stride(1))
    prec = dot_precision(a.dtype)
    if use_autotune(a):
        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
        _autotuned_matmul()[grid](*args, DOT_PRECISION=prec)
    else:
        bm, bn, bk = 16, 16, 16
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        _matmul_kernel[grid](*args, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4,
                             DOT_PRECISION=prec)
    return c
