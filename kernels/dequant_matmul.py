"""Dequantize-matmul: x @ W^T with W stored as int4 codes in groups (Appendix A1).

Spec: x [M, K] float, packed [N, K/2] uint8 (byte j of a row holds the codes of columns 2j in
its low nibble and 2j+1 in its high nibble), scale and mn [N, K/G] float32
-> y [M, N] in x's dtype, where W[n, k] = code[n, k] * scale[n, k // G] + mn[n, k // G].

Each program computes one BLOCK_M x BLOCK_N tile of y. It walks K in BLOCK_K steps; for each
step it loads the packed bytes of a [BLOCK_N, BLOCK_K] tile of W (each byte twice, once per
nibble), shifts out the nibble, applies the group's scale and min in registers, and
accumulates x_tile @ W_tile^T in fp32. The weight crosses memory at 4 bits (plus the group
parameters) instead of 16, which is what makes batch-1 decode faster: it is bound by bytes.
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
def _dequant_matmul_kernel(X, P, S, Z, Y, M, N, K, G,
                           stride_xm, stride_xk, stride_pn, stride_sn, stride_ym, stride_yn,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           DOT_PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        x = tl.load(X + rm[:, None].to(tl.int64) * stride_xm + k[None, :] * stride_xk,
                    mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        wmask = (rn[:, None] < N) & (k[None, :] < K)
        byte = tl.load(P + rn[:, None].to(tl.int64) * stride_pn + k[None, :] // 2,
                       mask=wmask, other=0)
        code = (byte >> ((k[None, :] % 2) * 4).to(tl.uint8)) & 0xF
        g = rn[:, None].to(tl.int64) * stride_sn + k[None, :] // G
        scale = tl.load(S + g, mask=wmask, other=0.0)
        mn = tl.load(Z + g, mask=wmask, other=0.0)
        w = (code.to(tl.float32) * scale + mn).to(x.dtype)  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    y_ptrs = Y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _configs() -> list:
    """Decode (M small) wants narrow M tiles and long K steps; prefill wants square tiles."""
    def cfg(bm, bn, bk, warps, stages):
        return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk},
                             num_warps=warps, num_stages=stages)
    return [cfg(16, 64, 128, 4, 4), cfg(16, 128, 64, 4, 4), cfg(32, 64, 64, 4, 3),
            cfg(64, 128, 32, 4, 3), cfg(128, 128, 32, 8, 3)]


_autotuned = autotuned(_dequant_matmul_kernel, _configs, key=["M", "N", "K", "G"])


def dequant_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                   mn: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [M, K] @ dequantized(packed, scale, mn)^T -> [M, N] (fp32 accumulation)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor("packed", packed, ndim=2, dtypes=(torch.uint8,), contiguous=True)
    m, k = x.shape
    n = packed.shape[0]
    if packed.shape[1] * 2 != k:
        raise ValueError(f"packed must have shape [N, K/2] = [{n}, {k // 2}] for x with K={k}, "
                         f"got {tuple(packed.shape)}")
    if group_size < 2 or k % group_size:
        raise ValueError(f"group_size must be >= 2 and divide K={k}, got {group_size}")
    for name, t in (("scale", scale), ("mn", mn)):
        check_tensor(name, t, ndim=2, dtypes=(torch.float32,), contiguous=True)
        if tuple(t.shape) != (n, k // group_size):
            raise ValueError(f"{name} must have shape [N, K/group_size] = "
                             f"[{n}, {k // group_size}], got {tuple(t.shape)}")
    check_device_ready(x)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    args = (x, packed, scale, mn, y, m, n, k, group_size, x.stride(0), x.stride(1),
            packed.stride(0), scale.stride(0), y.stride(0), y.stride(1))
    prec = dot_precision(x.dtype)
    if use_autotune(x):
        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))
        _autotuned()[grid](*args, DOT_PRECISION=prec)
    else:
        bm, bn, bk = 16, 16, 32
        _dequant_matmul_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            *args, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PRECISION=prec)
    return y


def dequant_matmul_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                             mn: torch.Tensor, group_size: int) -> torch.Tensor:
    """Plain torch: unpack the nibbles, dequantize in fp32, matmul, cast to x's dtype."""
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    n, k = codes.shape
    w = codes.float().reshape(n, k // group_size, group_size)
    w = (w * scale.float()[..., None] + mn.float()[..., None]).reshape(n, k)
    return (x.float() @ w.t()).to(x.dtype)
