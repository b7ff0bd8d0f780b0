"""Branch divergence made visible (Appendix A2): one element-wise function, two ways to branch.

Spec: x [N] -> out [N] with out[i] = slow_path(x[i]) if x[i] > 0 else fast_path(x[i]), where
the slow path is ``n_iter`` rounds of sin-and-multiply-add and the fast path one multiply.

- ``branchy``: each program (a group of ``block`` lanes, one warp with the default block=32,
  num_warps=1) takes the slow path with an ``if`` when ANY of its lanes needs it, then keeps the
  slow result only in those lanes. That is what SIMT hardware does with a data-dependent
  branch: a warp runs every path some lane takes, with the other lanes masked off. A program
  whose lanes all agree runs one path; a mixed one pays for both.
- ``branch_free``: computes both paths for every lane and selects with ``tl.where``. Its time
  does not depend on the data.

Both give the same numbers; only their speed (on a GPU) differs with how the positive
elements are spread over the warps.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device_ready, check_tensor


@triton.jit
def _slow_path(x, N_ITER: tl.constexpr):
    for _ in range(N_ITER):
        x = tl.sin(x) * 0.5 + x * 0.75
    return x


@triton.jit
def _branchy_kernel(X, Out, n, N_ITER: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0)
    slow = x > 0
    out = x * 2.0  # the fast path
    if tl.sum(slow.to(tl.int32), axis=0) > 0:  # a branch on data, taken by the whole program
        out = tl.where(slow, _slow_path(x, N_ITER), out)
    tl.store(Out + offs, out, mask=mask)


@triton.jit
def _branch_free_kernel(X, Out, n, N_ITER: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0)
    out = tl.where(x > 0, _slow_path(x, N_ITER), x * 2.0)  # both paths, every lane
    tl.store(Out + offs, out, mask=mask)


def _launch(kernel, x: torch.Tensor, n_iter: int, block: int, num_warps: int) -> torch.Tensor:
    check_tensor("x", x, ndim=1, dtypes=(torch.float32,), contiguous=True)
    if n_iter < 0:
        raise ValueError(f"n_iter must be >= 0, got {n_iter}")
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    check_device_ready(x)
    out = torch.empty_like(x)
    if x.numel():
        kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), N_ITER=n_iter, BLOCK=block,
                                                 num_warps=num_warps)
    return out


def branchy(x: torch.Tensor, n_iter: int = 64, block: int = 32,
            num_warps: int = 1) -> torch.Tensor:
    """x [N] fp32 -> [N]; a program runs the slow path only if one of its lanes needs it."""
    return _launch(_branchy_kernel, x, n_iter, block, num_warps)


def branch_free(x: torch.Tensor, n_iter: int = 64, block: int = 32,
                num_warps: int = 1) -> torch.Tensor:
    """x [N] fp32 -> [N]; every lane computes both paths, ``tl.where`` picks one."""
    return _launch(_branch_free_kernel, x, n_iter, block, num_warps)


def divergence_reference(x: torch.Tensor, n_iter: int = 64) -> torch.Tensor:
    slow = x.clone()
    for _ in range(n_iter):
        slow = torch.sin(slow) * 0.5 + slow * 0.75
    return torch.where(x > 0, slow, x * 2.0)


def groups_taking_slow_path(x: torch.Tensor, block: int = 32) -> tuple[int, int]:
    """(groups of ``block`` consecutive elements with at least one x > 0, all groups): how many
    warps/programs run the slow path in ``branchy``."""
    n = x.numel()
    pad = (-n) % block
    hot = torch.cat([x.reshape(-1) > 0, torch.zeros(pad, dtype=torch.bool, device=x.device)])
    return int(hot.view(-1, block).any(dim=1).sum()), (n + pad) // block
