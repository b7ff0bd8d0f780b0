"""Merge two attention states computed over disjoint key sets (cascade / shared-prefix attention).

If (out_a, lse_a) is attention of some queries over keys A and (out_b, lse_b) over keys B, then
attention over A u B is

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

(the same rule as one step of online softmax and as the merge of flash-decoding splits). With a
shared prompt prefix, the prefix part is computed once for all requests and merged with each
request's own suffix part. Inputs: out_a/out_b [..., D], lse_a/lse_b [...] fp32 natural-log,
shaped like out without its last axis (as returned by the attention kernels). A state with
lse = -inf (no keys) contributes nothing; if both are -inf the result is out 0, lse -inf.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_device_ready, check_same_device, check_tensor, next_pow2


@triton.jit
def _merge_kernel(OutA, LseA, OutB, LseB, Out, Lse, n_rows, D,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (cdiv(n_rows, BLOCK_R),): BLOCK_R rows of D values each, all tensors contiguous."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols[None, :] < D)
    lse_a = tl.load(LseA + rows, mask=row_ok, other=float("-inf"))
    lse_b = tl.load(LseB + rows, mask=row_ok, other=float("-inf"))
    m = tl.maximum(lse_a, lse_b)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - m_ref)
    w_b = tl.exp(lse_b - m_ref)
    total = w_a + w_b
    safe = tl.where(total == 0.0, 1.0, total)
    offs = rows[:, None] * D + cols[None, :]
    a = tl.load(OutA + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(OutB + offs, mask=mask, other=0.0).to(tl.float32)
    out = (a * (w_a / safe)[:, None]) + (b * (w_b / safe)[:, None])
    tl.store(Out + offs, out.to(Out.dtype.element_ty), mask=mask)
    tl.store(Lse + rows, tl.where(total == 0.0, float("-inf"), m_ref + tl.log(safe)), mask=row_ok)


def merge_attention_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_a [..., D], lse_a [...]) + (out_b, lse_b) -> (out [..., D] in out_a's dtype,
    lse [...] fp32). All four tensors contiguous; lse fp32."""
    check_tensor("out_a", out_a, dtypes=FLOAT_DTYPES, contiguous=True)
    check_tensor("out_b", out_b, dtypes=(out_a.dtype,), contiguous=True)
    check_tensor("lse_a", lse_a, dtypes=(torch.float32,), contiguous=True)
    check_tensor("lse_b", lse_b, dtypes=(torch.float32,), contiguous=True)
    if out_a.dim() < 1:
        raise ValueError("out_a must have at least one dimension (the head dim D)")
    if out_b.shape != out_a.shape:
        raise ValueError(f"out_b must have out_a's shape {tuple(out_a.shape)}, got "
                         f"{tuple(out_b.shape)}")
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if lse.shape != out_a.shape[:-1]:
            raise ValueError(f"{name} must have shape {tuple(out_a.shape[:-1])} (out without "
                             f"its last axis), got {tuple(lse.shape)}")
    check_same_device(out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)
    check_device_ready(out_a)
    out = torch.empty_like(out_a)
    lse = torch.empty_like(lse_a)
    d = out_a.shape[-1]
    n_rows = lse_a.numel()
    if n_rows == 0 or d == 0:  # nothing for a kernel to do
        return out, torch.logaddexp(lse_a, lse_b)
    block_d = next_pow2(d)
    block_r = max(1, min(16, 4096 // block_d))
    _merge_kernel[(triton.cdiv(n_rows, block_r),)](out_a, lse_a, out_b, lse_b, out, lse,
                                                   n_rows, d, BLOCK_R=block_r, BLOCK_D=block_d)
    return out, lse


def merge_attention_states_reference(out_a: torch.Tensor, lse_a: torch.Tensor,
                                     out_b: torch.Tensor, lse_b: torch.Tensor
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule in plain torch (computed in lse's dtype; use float64 for a reference)."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse) & (lse < 0), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe)[..., None]
    w_b = torch.exp(lse_b - safe)[..., None]
    out = w_a * out_a.to(lse.dtype) + w_b * out_b.to(lse.dtype)
    return out.to(out_a.dtype), lse
