"""Checkers for the exercises of appendix A1 (training and quantization).

Each ``check_*`` takes the student's function, compares it with the package on a few cases,
prints a one-line verdict and returns a :class:`~minillm.labs.common.Result` (``passed`` is
None while the exercise still raises NotImplementedError).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..quant.formats import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from ..train.preference import dpo_loss
from .common import Result, check


def _weights(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(8, 64, generator=g) * 0.05, torch.randn(3, 128, generator=g)]
    w = torch.randn(5, 96, generator=g) * 0.02
    w[2, 5] = 0.7  # an outlier
    w[4] = 0.0  # an all-zero row
    return ws + [w]


def check_int8_roundtrip(fn: Callable[[torch.Tensor], torch.Tensor]) -> Result:
    """``fn(w)`` -> w quantized to int8 per output row (symmetric, scale = max|row| / 127) and
    dequantized back to float. Compared with the package's int8 format."""

    def attempt() -> None:
        for w in _weights(0):
            got = torch.as_tensor(fn(w.clone())).float()
            want = dequantize_int8(*quantize_int8(w))
            assert got.shape == w.shape, f"shape {tuple(got.shape)}, expected {tuple(w.shape)}"
            err = (got - want).abs().max().item()
            assert err < 1e-6, f"weight {tuple(w.shape)}: differs from the package by {err:.2e}"

    return check("int8_roundtrip", attempt)


def check_int4_roundtrip(fn: Callable[[torch.Tensor, int], torch.Tensor]) -> Result:
    """``fn(w, group_size)`` -> w quantized to int4 codes 0..15 in groups of ``group_size``
    along each row (scale = (max - min) / 15, offset = min) and dequantized back."""

    def attempt() -> None:
        for w in _weights(1):
            for g in (32, 64):
                if w.shape[1] % g:
                    continue
                got = torch.as_tensor(fn(w.clone(), g)).float()
                want = dequantize_int4(*quantize_int4(w, g), g)
                assert got.shape == w.shape, f"shape {tuple(got.shape)}, expected {w.shape}"
                err = (got - want).abs().max().item()
                assert err < 1e-6, (f"weight {tuple(w.shape)}, group_size={g}: differs from "
                                    f"the package by {err:.2e}")

    return check("int4_roundtrip", attempt)


def check_lora_merge(fn: Callable[..., torch.Tensor]) -> Result:
    """``fn(w, a, b, alpha)`` -> the merged weight W + (alpha / r) B A, with A [r, K],
    B [N, r] and r = A's first dimension."""

    def attempt() -> None:
        g = torch.Generator().manual_seed(2)
        for n, k, r, alpha in ((6, 10, 2, 4.0), (16, 8, 8, 8.0), (5, 7, 1, 1.0)):
            w, a, b = (torch.randn(n, k, generator=g), torch.randn(r, k, generator=g),
                       torch.randn(n, r, generator=g))
            got = torch.as_tensor(fn(w.clone(), a, b, alpha)).double()
            want = w.double() + alpha / r * b.double() @ a.double()
            err = (got - want).abs().max().item()
            assert err < 1e-5, f"n={n}, k={k}, r={r}, alpha={alpha}: off by {err:.2e}"

    return check("lora_merge", attempt)


def check_dpo_loss(fn: Callable[..., torch.Tensor]) -> Result:
    """``fn(pi_c, pi_r, ref_c, ref_r, beta)`` -> the mean DPO loss over a batch of summed
    response log-probabilities (policy and reference, chosen and rejected)."""

    def attempt() -> None:
        g = torch.Generator().manual_seed(3)
        for b, beta in ((1, 0.1), (4, 0.5), (7, 2.0)):
            args = [-10 * torch.rand(b, generator=g) for _ in range(4)]
            got = float(fn(*args, beta))
            want = dpo_loss(*args, beta)[0].item()
            assert abs(got - want) < 1e-5, f"batch {b}, beta={beta}: got {got}, expected {want}"

    return check("dpo_loss", attempt)
