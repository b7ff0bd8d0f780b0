"""GPTQ, AWQ and HQQ: three ways to choose int4 codes, scales and mins for a weight.

All three produce the same triple as round-to-nearest (:func:`.formats.quantize_int4`):
q [N, K] codes 0..15, scale and min [N, K/G], so one fast linear runs them all.

* **GPTQ** (Frantar et al., 2022): quantize the columns of W one at a time and push each
  column's rounding error onto the columns not yet quantized, weighted by the inverse Hessian
  H = X^T X of the layer's calibration inputs, so the *output* error ||XW^T - XQ^T|| stays small.
* **AWQ** (Lin et al., 2023): a few input channels carry large activations; scale those
  columns of W up by s = mean|x|^alpha before rounding (so they lose less) and divide the
  input by s. alpha is searched per layer on calibration inputs.
* **HQQ** (Badri & Shaji, 2023): no calibration data; fix the scale and fit the zero point by
  half-quadratic optimisation of a sparsity-promoting lp (p < 1) loss on the weight error.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .formats import check_group_size, check_weight, int4_params, quantize_int4_with


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run many small ops on one thread: on a busy machine, handing vectors of a few hundred
    numbers to a thread pool costs more in waiting than it saves (GPTQ's column loop)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _check(w: torch.Tensor, group_size: int) -> None:
    check_weight(w)
    check_group_size(w.shape[1], group_size)


# ----------------------------------------------------------------------------- GPTQ

def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, group_size: int = 32,
                  damp: float = 0.01, block_size: int = 128
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] and H = X^T X [K, K] -> (q, scale, min) int4 group-wise (GPTQ, no act-order).

    Group parameters are fitted to the error-updated columns when a group starts. ``damp`` adds
    damp * mean(diag H) to the diagonal (the paper's 1 %) so the Cholesky factor exists.
    """
    _check(w, group_size)
    n, k = w.shape
    if hessian.shape != (k, k):
        raise ValueError(f"hessian must have shape ({k}, {k}), got {tuple(hessian.shape)}")
    if not 0 <= damp < 1:
        raise ValueError(f"damp must be in [0, 1), got {damp}")
    block_size = max(group_size, block_size // group_size * group_size)
    W = w.detach().float().clone()
    H = hessian.detach().float().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H += damp * torch.diag(H).mean() * torch.eye(k, dtype=H.dtype)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    q = torch.zeros(n, k, dtype=torch.uint8)
    scale = torch.zeros(n, k // group_size)
    mn = torch.zeros_like(scale)
    with one_thread():
        _gptq_columns(W, Hinv, q, scale, mn, group_size, block_size)
    return q, scale, mn


def _gptq_columns(W, Hinv, q, scale, mn, group_size: int, block_size: int) -> None:
    """GPTQ's lazy-batch loop: columns one at a time inside a block, errors pushed right."""
    k = W.shape[1]
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = W[:, i1:i2].clone()
        Err = torch.zeros_like(W1)
        Hb = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % group_size == 0:
                g = col // group_size
                s, m = int4_params(W1[:, i:i + group_size], group_size)
                scale[:, g], mn[:, g] = s[:, 0], m[:, 0]
            g = col // group_size
            c = torch.round((W1[:, i] - mn[:, g]) / scale[:, g]).clamp(0, 15)
            q[:, col] = c.to(torch.uint8)
            err = (W1[:, i] - (c * scale[:, g] + mn[:, g])) / Hb[i, i]
            W1[:, i:] -= err[:, None] * Hb[i, i:][None, :]
            Err[:, i] = err
        W[:, i2:] -= Err @ Hinv[i1:i2, i2:]


# ----------------------------------------------------------------------------- AWQ

def awq_quantize(w: torch.Tensor, x: torch.Tensor, group_size: int = 32, n_grid: int = 11
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """W [N, K], calibration inputs x [T, K] -> (q, scale, min, in_scale [K], alpha).

    For alpha in a grid over [0, 1]: s = mean|x|^alpha (normalised so max*min = 1), quantize
    W * s (column-wise) by round-to-nearest and measure ||x W^T - (x / s) Q(W s)^T||^2; keep
    the best alpha. The layer then computes (x * in_scale) Q^T with in_scale = 1 / s.
    """
    _check(w, group_size)
    if x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [tokens, {w.shape[1]}], got {tuple(x.shape)}")
    if n_grid < 1:
        raise ValueError(f"n_grid must be >= 1, got {n_grid}")
    W, X = w.detach().float(), x.detach().float()
    ref = X @ W.t()
    mean_abs = X.abs().mean(0).clamp(min=1e-6)
    best = (float("inf"), None)
    for j in range(n_grid):
        alpha = j / max(n_grid - 1, 1)
        s = mean_abs ** alpha
        s = s / (s.max() * s.min()).sqrt()
        ws = W * s[None, :]
        sc, m = int4_params(ws, group_size)
        q = quantize_int4_with(ws, sc, m, group_size)
        deq = (q.float().reshape(*sc.shape, group_size) * sc[..., None] + m[..., None])
        err = ((X / s[None, :]) @ deq.reshape_as(W).t() - ref).pow(2).mean().item()
        if err < best[0]:
            best = (err, (q, sc, m, 1 / s, alpha))
    return best[1]


# ----------------------------------------------------------------------------- HQQ

def _shrink_lp(x: torch.Tensor, beta: float, p: float) -> torch.Tensor:
    """Generalised soft-thresholding: the proximal step of the lp norm (p < 1)."""
    return torch.sign(x) * torch.relu(x.abs() - (1 / beta) * (x.abs() + 1e-8).pow(p - 1))


def hqq_quantize(w: torch.Tensor, group_size: int = 32, iters: int = 20, p: float = 0.7,
                 beta: float = 10.0, kappa: float = 1.01
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] -> (q, scale, min) with the zero point fitted by HQQ (scale from min/max).

    In HQQ's notation q = round(W / s + z) and W_r = (q - z) s. Each iteration: W_e = the
    lp-shrunk residual W - W_r (the outliers the loss forgives), then z = mean(q - (W - W_e)/s)
    in closed form; beta grows by kappa; stop when the mean |W - W_r| stops falling.
    """
    _check(w, group_size)
    if not 0 < p <= 1:
        raise ValueError(f"p must be in (0, 1], got {p}")
    n, k = w.shape
    W = w.detach().float().reshape(n, k // group_size, group_size)
    scale, mn = int4_params(w, group_size)
    s = scale[..., None]
    z = -mn[..., None] / s
    with one_thread():
        best_z = _hqq_zero(W, s, z, iters, p, beta, kappa)
    mn = (-best_z * s)[..., 0]
    return quantize_int4_with(w, scale, mn, group_size), scale, mn


def _hqq_zero(W, s, z, iters: int, p: float, beta: float, kappa: float) -> torch.Tensor:
    best_err, best_z = float("inf"), z
    for _ in range(iters):
        q = torch.round(W / s + z).clamp(0, 15)
        Wr = (q - z) * s
        We = _shrink_lp(W - Wr, beta, p)
        err = (W - Wr).abs().mean().item()
        if err >= best_err:
            break
        best_err, best_z = err, z
        z = (q - (W - We) / s).mean(-1, keepdim=True)
        beta *= kappa
    return best_z
