"""Checkers for the exercises of appendix A1 (training and quantization).

Each ``check_*`` takes the student's function (or class), compares it with the package or a
float64 reference on a few cases, prints a one-line verdict and returns a
:class:`~minillm.labs.common.Result` (``passed`` is None while the exercise still raises
NotImplementedError).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..quant.formats import (
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from ..quant.methods import awq_quantize, gptq_quantize
from ..train.preference import bradley_terry_loss, dpo_loss
from .common import Result, check


def _weights(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(8, 64, generator=g) * 0.05, torch.randn(3, 128, generator=g)]
    w = torch.randn(5, 96, generator=g) * 0.02
    w[2, 5] = 0.7  # an outlier
    w[4] = 0.0  # an all-zero row
    return ws + [w]


# ----------------------------------------------------------------------------- LoRA

def check_lora_layer(cls: Callable[..., nn.Module]) -> Result:
    """``cls(base, rank, alpha)`` -> a module wrapping a frozen ``nn.Linear`` base (W [N, K],
    optional bias) with trainable ``lora_a`` [r, K] (small random) and ``lora_b`` [N, r]
    (zeros). ``forward(x [..., K])`` -> base(x) + (alpha / r) x A^T B^T [..., N];
    ``merged_weight()`` -> W + (alpha / r) B A [N, K]. Checked: the layer starts equal to its
    base, only A and B train, the forward and the merged weight after A and B have moved."""

    def attempt() -> None:
        g = torch.Generator().manual_seed(2)
        for n, k, r, alpha, bias in ((6, 10, 2, 4.0, True), (16, 8, 8, 8.0, False),
                                     (5, 7, 1, 1.0, True)):
            case = f"N={n}, K={k}, r={r}, alpha={alpha}, bias={bias}"
            base = nn.Linear(k, n, bias=bias)
            w0 = base.weight.detach().clone()
            layer = cls(base, r, alpha)
            x = torch.randn(2, 3, k, generator=g)
            with torch.no_grad():
                want0 = F.linear(x, w0, base.bias)
                got0 = layer(x)
            assert tuple(got0.shape) == (2, 3, n), (
                f"{case}: output shape {tuple(got0.shape)}, expected (2, 3, {n})")
            assert torch.allclose(got0, want0, atol=1e-6), (
                f"{case}: a fresh layer must equal its base (B starts at zero), off by "
                f"{(got0 - want0).abs().max():.2e}")
            a, b = layer.lora_a, layer.lora_b
            assert tuple(a.shape) == (r, k) and tuple(b.shape) == (n, r), (
                f"{case}: lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)}, expected "
                f"({r}, {k}) and ({n}, {r})")
            assert (b == 0).all() and (a != 0).any(), (
                f"{case}: initialise lora_b to zeros and lora_a small random (if both are "
                f"zero, no gradient ever reaches them)")
            trainable = {id(p) for p in layer.parameters() if p.requires_grad}
            assert trainable == {id(a), id(b)}, (
                f"{case}: only lora_a and lora_b may train; freeze the base "
                f"({len(trainable)} trainable tensors found)")
            with torch.no_grad():
                a.copy_(torch.randn(r, k, generator=g))
                b.copy_(torch.randn(n, r, generator=g))
                got = layer(x).double()
                delta = alpha / r * b.double() @ a.double()
                want = F.linear(x.double(), w0.double() + delta,
                                None if base.bias is None else base.bias.double())
                err = (got - want).abs().max().item()
                assert err < 1e-4, f"{case}: forward with trained A, B off by {err:.2e}"
                merged = torch.as_tensor(layer.merged_weight()).double()
                err = (merged - (w0.double() + delta)).abs().max().item()
                assert err < 1e-4, f"{case}: merged_weight() off by {err:.2e}"
                assert torch.equal(base.weight, w0), (
                    f"{case}: merged_weight() must not change the frozen base weight")

    return check("lora_layer", attempt)


# ----------------------------------------------------------------------------- formats

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


def check_int4_groups(cls: Callable[[torch.Tensor, int], object]) -> Result:
    """``cls(w, group_size)`` -> an object holding W [N, K] in int4 groups of ``group_size``
    along each row: ``.packed`` uint8 [N, K/2] (byte j = code 2j in the low nibble, code 2j+1
    in the high one), ``.scale`` and ``.min`` [N, K/G] (scale = (max - min) / 15, codes
    round((w - min) / scale) in 0..15), and ``.dequantize()`` -> float [N, K]. A group whose
    values are all equal may use any tiny positive scale. Compared with minillm.quant."""

    def attempt() -> None:
        for w in _weights(1):
            for gs in (32, 64):
                if w.shape[1] % gs:
                    continue
                case = f"weight {tuple(w.shape)}, group_size={gs}"
                q, scale, mn = quantize_int4(w, gs)
                got = cls(w.clone(), gs)
                packed = torch.as_tensor(got.packed)
                assert packed.dtype == torch.uint8 and tuple(packed.shape) == (
                    w.shape[0], w.shape[1] // 2), (
                    f"{case}: packed must be uint8 {(w.shape[0], w.shape[1] // 2)}, got "
                    f"{packed.dtype} {tuple(packed.shape)}")
                flat = (scale < 1e-9)[..., None].expand(-1, -1, gs).reshape(w.shape)
                wrong = ((unpack_int4(packed) != q) & ~flat).nonzero()
                if len(wrong):
                    r, c = (int(v) for v in wrong[0])
                    raise AssertionError(
                        f"{case}: byte [{r}, {c // 2}] is {int(packed[r, c // 2])}, expected "
                        f"{int(pack_int4(q)[r, c // 2])} (the codes are {int(q[r, c // 2 * 2])}, "
                        f"{int(q[r, c // 2 * 2 + 1])}; the even column goes in the low nibble)")
                live = scale >= 1e-9
                for name, mine, ref in (("scale", got.scale, scale), ("min", got.min, mn)):
                    mine = torch.as_tensor(mine).float()
                    assert tuple(mine.shape) == tuple(ref.shape), (
                        f"{case}: {name} shape {tuple(mine.shape)}, expected {tuple(ref.shape)}")
                    assert torch.allclose(mine[live], ref[live], atol=1e-7, rtol=1e-5), (
                        f"{case}: {name} differs from the package's")
                deq = torch.as_tensor(got.dequantize()).float()
                err = (deq - dequantize_int4(q, scale, mn, gs)).abs().max().item()
                assert err < 1e-6, f"{case}: dequantize() differs from the package by {err:.2e}"

    return check("int4_groups", attempt)


# ----------------------------------------------------------------------------- preferences

def _stable(fn: Callable[..., torch.Tensor], args: list[torch.Tensor], want: float,
            case: str) -> None:
    got = float(fn(*args))
    assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (
        f"{case}: got {got}, expected {want:.6g}" + (
            " (use logsigmoid: log(sigmoid(m)) overflows for large margins)"
            if got != got or abs(got) == float("inf") else ""))


def check_bradley_terry(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Result:
    """``fn(r_chosen [B], r_rejected [B])`` -> the mean Bradley-Terry loss
    -log sigmoid(r_c - r_r) over the batch (a 0-d tensor), finite for any margin."""

    def attempt() -> None:
        g = torch.Generator().manual_seed(4)
        cases = [(f"batch {b}", [3 * torch.randn(b, generator=g) for _ in range(2)])
                 for b in (1, 4, 9)]
        cases.append(("margins of -200 and +150", [torch.tensor([-100.0, 80.0]),
                                                   torch.tensor([100.0, -70.0])]))
        for case, args in cases:
            want = bradley_terry_loss(*[a.double() for a in args]).item()
            _stable(fn, args, want, case)

    return check("bradley_terry", attempt)


def check_dpo_loss(fn: Callable[..., torch.Tensor]) -> Result:
    """``fn(pi_c, pi_r, ref_c, ref_r, beta)`` -> the mean DPO loss over a batch of summed
    response log-probabilities [B] (policy and reference, chosen and rejected), finite for any
    margin."""

    def attempt() -> None:
        g = torch.Generator().manual_seed(3)
        cases = [(f"batch {b}, beta={beta}", [-10 * torch.rand(b, generator=g)
                                              for _ in range(4)], beta)
                 for b, beta in ((1, 0.1), (4, 0.5), (7, 2.0))]
        cases.append(("a policy far below its reference on the chosen answer, beta=0.5",
                      [torch.tensor([-2000.0, -30.0]), torch.tensor([-20.0, -25.0]),
                       torch.tensor([-10.0, -28.0]), torch.tensor([-20.0, -40.0])], 0.5))
        for case, args, beta in cases:
            want = dpo_loss(*[a.double() for a in args], beta)[0].item()
            _stable(lambda *a, beta=beta: fn(*a, beta), args, want, case)

    return check("dpo_loss", attempt)


# ----------------------------------------------------------------------------- AWQ, GPTQ

def _outlier_layer(seed: int, n: int, k: int, t: int, outliers: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] and activations [T, K] where a few input channels are 20x larger."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(t, k, generator=g)
    x[:, torch.randperm(k, generator=g)[:outliers]] *= 20
    return w, x


def _awq_errors(w: torch.Tensor, x: torch.Tensor, gs: int, n_grid: int
                ) -> dict[float, float]:
    """Output error of AWQ's scaled round-to-nearest for every alpha of the grid (float64)."""
    errs = {}
    for j in range(n_grid):
        alpha = j / max(n_grid - 1, 1)
        s = _awq_scale(x, alpha)
        deq = dequantize_int4(*quantize_int4(w * s[None, :], gs), gs).double()
        errs[alpha] = ((x.double() / s.double()) @ deq.t() - x.double() @ w.double().t()
                       ).pow(2).mean().item()
    return errs


def _awq_scale(x: torch.Tensor, alpha: float) -> torch.Tensor:
    s = x.abs().mean(0).clamp(min=1e-6) ** alpha
    return s / (s.max() * s.min()).sqrt()


def check_awq_search(fn: Callable[..., tuple[float, torch.Tensor]]) -> Result:
    """``fn(w [N, K], x [T, K], group_size, n_grid)`` -> (alpha, s [K]): AWQ's per-channel
    scale search. For alpha in linspace(0, 1, n_grid): s = mean_t |x|^alpha, normalised so
    sqrt(max(s) min(s)) = 1; quantize W * s (columns scaled) with int4 round-to-nearest groups;
    the error is mean((x / s) Q(W s)^T - x W^T)^2. Return the best alpha and its s. Tested on
    layers whose activations have a few outlier channels, and one without."""

    def attempt() -> None:
        for seed, n, k, t, outliers, gs, n_grid in ((0, 16, 64, 48, 3, 32, 11),
                                                    (1, 8, 128, 32, 2, 64, 6),
                                                    (2, 12, 64, 40, 0, 32, 5)):
            case = f"N={n}, K={k}, {outliers} outlier channels, group_size={gs}, n_grid={n_grid}"
            w, x = _outlier_layer(seed, n, k, t, outliers)
            alpha, s = fn(w.clone(), x.clone(), gs, n_grid)
            alpha, s = float(alpha), torch.as_tensor(s).float()
            errs = _awq_errors(w, x, gs, n_grid)
            grid = min(errs, key=lambda a: abs(a - alpha))
            assert abs(grid - alpha) < 1e-6, (
                f"{case}: alpha={alpha} is not on the grid {sorted(errs)}")
            best = min(errs.values())
            assert errs[grid] <= best * (1 + 1e-3), (
                f"{case}: alpha={alpha} gives output error {errs[grid]:.3e}, but alpha="
                f"{min(errs, key=errs.get)} gives {best:.3e}")
            want = _awq_scale(x, grid)
            assert tuple(s.shape) == (k,) and torch.allclose(s, want, rtol=1e-4), (
                f"{case}: s is not mean|x|^alpha normalised to sqrt(max * min) = 1")
        w, x = _outlier_layer(0, 16, 64, 48, 3)
        assert awq_quantize(w, x, 32, 11)[4] > 0, (  # the package agrees that scaling helps
            "minillm.quant.awq_quantize kept alpha = 0 on the outlier layer: a package bug")

    return check("awq_search", attempt)


def _output_error(w: torch.Tensor, deq: torch.Tensor, h: torch.Tensor) -> float:
    """tr((W - Q) H (W - Q)^T) = ||X W^T - X Q^T||^2 for H = X^T X."""
    d = (w.double() - deq.double())
    return torch.einsum("nk,kj,nj->", d, h.double(), d).item()


def check_gptq(fn: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> Result:
    """``fn(w [N, K], hessian [K, K], group_size)`` -> (q uint8 [N, K] codes 0..15, scale
    [N, K/G], min [N, K/G]): GPTQ without act-order. Add 0.01 * mean(diag H) to H's diagonal,
    take U = the upper Cholesky factor of H^-1; for each column i left to right: when a group
    starts, fit its (scale, min) by min/max to the current (error-updated) columns of the
    group; quantize column i; err = (w_i - deq_i) / U[i, i]; W[:, i:] -= err U[i, i:].
    Judged by the output error tr((W - Q) H (W - Q)^T) against the package's GPTQ."""

    def attempt() -> None:
        g = torch.Generator().manual_seed(5)
        for n, k, t, gs in ((8, 64, 96, 32), (16, 128, 160, 64), (4, 64, 40, 64)):
            case = f"N={n}, K={k}, {t} calibration tokens, group_size={gs}"
            w = torch.randn(n, k, generator=g) * 0.05
            mix = torch.eye(k) + 0.6 * torch.randn(k, k, generator=g) / k ** 0.5
            x = torch.randn(t, k, generator=g) @ mix  # correlated inputs: feedback pays
            h = x.t() @ x
            q, scale, mn = (torch.as_tensor(v) for v in fn(w.clone(), h.clone(), gs))
            assert tuple(q.shape) == (n, k) and tuple(scale.shape) == (n, k // gs), (
                f"{case}: shapes q {tuple(q.shape)}, scale {tuple(scale.shape)}, expected "
                f"{(n, k)} and {(n, k // gs)}")
            assert int(q.min()) >= 0 and int(q.max()) <= 15, f"{case}: codes outside 0..15"
            mine = _output_error(w, dequantize_int4(q.to(torch.uint8), scale.float(),
                                                    torch.as_tensor(mn).float(), gs), h)
            ref = _output_error(w, dequantize_int4(*gptq_quantize(w, h, gs), gs), h)
            rtn = _output_error(w, dequantize_int4(*quantize_int4(w, gs), gs), h)
            assert mine <= ref * 1.02, (
                f"{case}: output error {mine:.4e}; the package's GPTQ reaches {ref:.4e} "
                f"(round-to-nearest: {rtn:.4e})")

    return check("gptq", attempt)
