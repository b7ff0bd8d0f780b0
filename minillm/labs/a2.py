"""Checkers for the exercises of Appendix A2 (GPU hardware), notebook ``A2_gpu_hardware``.

Each ``check_*`` takes the student's function, compares it with :mod:`minillm.course.a2_roofline`
or with torch on a few cases, prints a one-line verdict and returns a
:class:`~minillm.labs.common.Result` (``passed`` is None while the exercise still raises
NotImplementedError). :func:`check_add_2d`, :func:`check_softmax_rows`,
:func:`check_softmax_in_model` and :func:`check_matmul_in_model` run the student's Triton
launchers, so on a CPU Triton must already be in interpreter mode
(:func:`minillm.device.setup_triton` before the kernel is defined); this module imports no
Triton itself.

The two builds run inside the model: the student's row softmax becomes the softmax of every
attention layer (:func:`softmax_attention`), the student's tiled matrix product the output
projection of every attention layer (:func:`matmul_replaced`); the model must then generate
the package's greedy tokens with the package's logits
(:func:`minillm.labs.in_engine.assert_runs_in_model`).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import nn

from ..attention import AttentionFn, causal_mask
from ..checkpoint.tokenizer import Tokenizer
from ..course.a2_roofline import (
    GPU_SPECS,
    HOPPER_SM,
    matmul_intensity,
    occupancy,
    ridge_point,
    tiled_matmul_bytes,
)
from ..device import default_device
from ..model.transformer import Transformer
from .common import Result, check
from .in_engine import assert_runs_in_model, attention_set, demo_model, demo_prompts, full_precision


def check_blocks_per_sm(fn: Callable[[int, int, int], int]) -> Result:
    """``fn(threads_per_block, registers_per_thread, smem_per_block)`` -> how many blocks fit on
    one H100/H200 SM at once (compute capability 9.0 limits: 64 warps, 32 blocks, 65,536
    registers handed out per warp in chunks of 256, 228 KB of shared memory with 1 KB reserved
    per block and 128-byte granularity). Compared with
    :func:`minillm.course.a2_roofline.occupancy`."""
    cases = [(256, 32, 0), (128, 128, 0), (1024, 64, 0), (32, 16, 0), (96, 40, 0),
             (128, 72, 0), (256, 255, 0), (64, 32, 48 * 1024), (128, 32, 100 * 1024),
             (128, 168, 16 * 1024), (512, 24, 4000), (33, 1, 0), (1, 0, 227 * 1024),
             (256, 128, 64 * 1024 - 1024), (256, 33, 0), (128, 100, 0),
             (64, 32, 57 * 1024)]

    def attempt() -> None:
        for threads, regs, smem in cases:
            got = fn(threads, regs, smem)
            want = occupancy(threads, regs, smem, HOPPER_SM)
            assert got == want["blocks_per_sm"], (
                f"threads_per_block={threads}, registers_per_thread={regs}, smem_per_block="
                f"{smem}: got {got} blocks, expected {want['blocks_per_sm']} (limited by "
                f"{want['limiter']})")

    return check("blocks_per_sm", attempt)


def check_matmul_intensity(fn: Callable[[int, int, int, int], float]) -> Result:
    """``fn(m, n, k, bytes_per_elem)`` -> FLOP per byte of C[m, n] = A[m, k] @ B[k, n] when A
    and B are read once and C written once (a multiply-add is two FLOPs)."""
    cases = [(1, 1, 1, 4), (4096, 4096, 4096, 2), (1, 4096, 4096, 2), (16, 11008, 4096, 2),
             (8192, 1, 8192, 1), (3, 5, 7, 4), (128, 128, 64, 2)]

    def attempt() -> None:
        for m, n, k, b in cases:
            got = float(fn(m, n, k, b))
            want = matmul_intensity(m, n, k, b)
            assert math.isclose(got, want, rel_tol=1e-9), (
                f"m={m}, n={n}, k={k}, bytes_per_elem={b}: got {got:.6g} FLOP/byte, expected "
                f"{want:.6g}")

    return check("matmul_intensity", attempt)


def smallest_compute_bound_square(bandwidth: float, peak_flops: float,
                                  bytes_per_elem: int) -> int:
    """Smallest n for which an n x n @ n x n product reaches the ridge point."""
    ridge = ridge_point(bandwidth, peak_flops)
    n = max(1, math.floor(1.5 * bytes_per_elem * ridge) - 2)
    while matmul_intensity(n, n, n, bytes_per_elem) < ridge:
        n += 1
    return n


def check_compute_bound_size(fn: Callable[[float, float, int], int]) -> Result:
    """``fn(bandwidth, peak_flops, bytes_per_elem)`` (bytes/s, FLOP/s) -> the smallest n for
    which a square n x n @ n x n matrix product, reading A and B and writing C once, has an
    arithmetic intensity at or above the ridge point (so it can be compute-bound)."""
    cases = [(s.bandwidth, s.peak_flops, b) for s in GPU_SPECS.values() for b in (1, 2, 4)]
    cases += [(20e9, 0.5e12, 4), (100e9, 3e12, 2), (1e12, 1e12, 2)]

    def attempt() -> None:
        for bw, peak, b in cases:
            got = fn(bw, peak, b)
            want = smallest_compute_bound_square(bw, peak, b)
            assert got == want, (
                f"bandwidth={bw:.3g} B/s, peak={peak:.3g} FLOP/s, bytes_per_elem={b}: got "
                f"n={got}, expected {want} (ridge {ridge_point(bw, peak):.1f} FLOP/byte)")

    return check("compute_bound_size", attempt)


def _strided_pairs(gen: torch.Generator, device: torch.device
                   ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(description, x, y) pairs of 2-D fp32 tensors on ``device``: contiguous, transposed,
    sliced (the views are taken on the device, so they keep their strides)."""
    def r(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    return [("1x1 contiguous", r(1, 1), r(1, 1)),
            ("5x7 contiguous", r(5, 7), r(5, 7)),
            ("33x17 contiguous", r(33, 17), r(33, 17)),
            ("x transposed (20x9, strides (1, 20))", r(9, 20).t(), r(20, 9)),
            ("both sliced with steps (12x10)", r(24, 31)[::2, 1::3], r(12, 40)[:, ::4]),
            ("one column (16x1) of a wide matrix", r(16, 5)[:, 2:3], r(16, 1))]


def check_add_2d(fn: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]) -> Result:
    """``fn(x, y, block_m, block_n)`` -> x + y, a new contiguous [M, N] tensor, computed by the
    student's Triton kernel over a 2-D grid of ``block_m x block_n`` tiles.

    x and y are fp32 [M, N] with *any* strides (transposed or sliced views), so the kernel must
    address element (i, j) as ``X + i * stride_x0 + j * stride_x1``, and mask the tiles that
    run past M or N (shapes are not multiples of the tiles). Compared with torch exactly.
    """
    gen = torch.Generator().manual_seed(11)
    device = default_device()  # the GPU when there is one, else the interpreter's CPU

    def attempt() -> None:
        for bm, bn in ((4, 8), (16, 16)):
            for where, x, y in _strided_pairs(gen, device):
                got = fn(x, y, bm, bn)
                assert tuple(got.shape) == tuple(x.shape), (
                    f"{where}, tiles {bm}x{bn}: out has shape {tuple(got.shape)}, expected "
                    f"{tuple(x.shape)}")
                assert torch.equal(got, x + y), (
                    f"{where}, tiles {bm}x{bn}: wrong at {int((got != x + y).sum())} of "
                    f"{x.numel()} elements (use the strides of x, y and out, and mask both "
                    "axes)")

    return check("add_2d", attempt)


def check_softmax_rows(fn: Callable[[torch.Tensor, int], torch.Tensor]) -> Result:
    """``fn(x, block)`` -> softmax over each row of x [M, N] fp32, computed by the student's
    Triton kernel with one program per row and tiles of ``block`` columns (a power of two,
    often much less than N): one pass over the row keeps a running max and a running sum of
    exp(x - max), rescaled when the max grows; a second pass writes exp(x - max) / sum.

    Compared with float64 torch.softmax for rows shorter than, equal to and several times
    longer than ``block``, scores in the hundreds (exp overflows without the max) and rows
    with some -inf entries.
    """
    gen = torch.Generator().manual_seed(12)

    def attempt() -> None:
        for m, n, block, scale in ((1, 1, 16, 1.0), (3, 16, 16, 1.0), (4, 37, 16, 1.0),
                                   (2, 100, 8, 80.0), (5, 257, 32, 10.0), (2, 64, 4, 1.0)):
            x = torch.randn(m, n, generator=gen) * scale
            if n > 8:
                x[0, 1:n:3] = float("-inf")
                x[-1, -1] = 400.0  # a late maximum: the running sum must be rescaled
            got = fn(x.to(default_device()), block).cpu()
            want = torch.softmax(x.double(), -1)
            where = f"{m}x{n} rows, block {block}, scores up to {x[x.isfinite()].abs().max():.0f}"
            assert tuple(got.shape) == tuple(x.shape), (
                f"{where}: out has shape {tuple(got.shape)}, expected {tuple(x.shape)}")
            assert not got.isnan().any(), f"{where}: NaN in the output"
            err = (got.double() - want).abs().max().item()
            assert err < 1e-5, f"{where}: differs from softmax by {err:.2e}"

    return check("softmax_rows", attempt)


def check_tiled_matmul_bytes(fn: Callable[[int, int, int, int, int, int], int]) -> Result:
    """``fn(m, n, k, block_m, block_n, bytes_per_elem)`` -> HBM bytes of C[m, n] = A[m, k] @
    B[k, n] by a kernel with one program per ``block_m x block_n`` tile of C that reads its
    strips of A and B whole (no cache reuse between programs) and writes its tile once; edge
    tiles are clipped. Compared with :func:`minillm.course.a2_roofline.tiled_matmul_bytes`."""
    cases = [(64, 64, 64, 64, 64, 2), (4096, 4096, 4096, 128, 128, 2), (100, 60, 76, 16, 16, 4),
             (1, 4096, 4096, 64, 128, 2), (4096, 11008, 4096, 128, 256, 2),
             (33, 17, 5, 32, 8, 1), (8, 8, 8, 1, 1, 4)]

    def attempt() -> None:
        for m, n, k, bm, bn, b in cases:
            got = int(fn(m, n, k, bm, bn, b))
            want = tiled_matmul_bytes(m, n, k, bm, bn, b)
            assert got == want, (f"m={m}, n={n}, k={k}, tiles {bm}x{bn}, bytes_per_elem={b}: "
                                 f"got {got:,} bytes, expected {want:,}")

    return check("tiled_matmul_bytes", attempt)


# --- the student's kernels inside the model ---------------------------------------------------

ROW_ALIGN = 16  # the attention scores' rows are padded to a multiple of this many columns


def _in_model(replaced: Callable[[Transformer, list[str]], AbstractContextManager[int]],
              what: str, model: Transformer | None, prompts: list[list[int]] | None,
              output_lens: list[int] | None, tok: Tokenizer | None) -> None:
    """:func:`~minillm.labs.in_engine.assert_runs_in_model` with the Triton builds' defaults: the
    demo model on the device Triton runs on (the GPU, else the CPU's interpreter) and two short
    seeded prompts (the interpreter runs one program at a time); a 16-bit model is checked as a
    float32 copy (:func:`~minillm.labs.in_engine.full_precision`). ``replaced(model, wrong)``
    puts the student's kernel in place and describes its first wrong result in ``wrong``,
    which a failure's message then ends with."""
    model = full_precision(model) if model is not None else demo_model().to(default_device())
    if prompts is None:
        prompts, output_lens = [p[:n] for p, n in zip(demo_prompts(2)[0], (7, 5))], [4, 3]
    if output_lens is None:
        raise ValueError("output_lens must be given with prompts: one length per prompt")
    wrong: list[str] = []
    try:
        assert_runs_in_model(model, prompts, output_lens, lambda: replaced(model, wrong), what,
                             tok)
    except AssertionError as e:
        raise AssertionError("; ".join([str(e), *wrong])) from None


def _note_first_wrong(wrong: list[str], got: torch.Tensor, want: torch.Tensor, what: str,
                      rtol: float) -> None:
    """Describe ``what`` in ``wrong`` unless an earlier result is there already or ``got`` is
    within ``rtol`` of the largest |want| (want in float64)."""
    if wrong:
        return
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    if not err <= rtol:
        wrong.append(f"the first wrong {what} " + ("gives NaN" if math.isnan(err) else
                                                   f"is off by {err:.1e} of its largest value"))


def softmax_attention(softmax_fn: Callable[[torch.Tensor, int], torch.Tensor], block: int,
                      wrong: list[str] | None = None) -> AttentionFn:
    """Causal attention whose softmax is ``softmax_fn(x, block)`` (exercise 3's contract: x
    [rows, L] fp32 -> its row softmax): q [B, H, T, d], k/v [B, H_kv, L, d] (the T queries are
    the last T of the L positions) -> [B, H, T, d] in q's dtype, the contract of
    :data:`minillm.attention.AttentionFn`.

    The scores q k^T / sqrt(d), with -inf above the causal diagonal, are handed to
    ``softmax_fn`` as fp32 rows [B * H * T, L] that live in a buffer whose rows are padded to a
    multiple of :data:`ROW_ALIGN` columns (NaN in the padding): the row stride is not L. The
    probabilities come back in q's dtype and multiply v. The first call whose probabilities
    differ from torch.softmax is described in ``wrong``."""
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, h, t, d = q.shape
        length, group = k.shape[-2], h // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        scores = scores.masked_fill(~causal_mask(t, length, q.device), float("-inf"))
        padded = -(-length // ROW_ALIGN) * ROW_ALIGN
        rows = torch.full((b * h * t, padded), float("nan"), dtype=torch.float32,
                          device=q.device)[:, :length]
        rows.copy_(scores.reshape(-1, length))
        probs = softmax_fn(rows, block)
        assert isinstance(probs, torch.Tensor) and probs.shape == rows.shape, (
            f"softmax_rows returned {getattr(probs, 'shape', type(probs).__name__)} for scores "
            f"of shape {tuple(rows.shape)}")
        if wrong is not None:
            _note_first_wrong(wrong, probs, torch.softmax(rows.double(), -1),
                              f"softmax, of {rows.shape[0]} rows of {length} scores (row stride "
                              f"{rows.stride(0)}) in tiles of {block},", 1e-5)
        return probs.to(q.dtype).reshape(b, h, t, length) @ v

    return attention


def check_softmax_in_model(fn: Callable[[torch.Tensor, int], torch.Tensor],
                           model: Transformer | None = None,
                           prompts: list[list[int]] | None = None,
                           output_lens: list[int] | None = None, tok: Tokenizer | None = None,
                           block: int = 4) -> Result:
    """Exercise 3's ``softmax_rows`` is the softmax of every attention layer
    (:func:`softmax_attention` with tiles of ``block`` columns, so most rows span several
    tiles and end in a ragged one): ``model`` (default: the tiny preset, random weights,
    float64; a 16-bit model as a float32 copy) must generate the package's greedy tokens for
    ``prompts`` (default: two short seeded random ones) and give the package's logits in one
    uncached pass. The scores reach the kernel as a strided view (rows padded to
    :data:`ROW_ALIGN` columns). Prints both runs' seconds."""
    def attempt() -> None:
        fn(torch.zeros(1, 4, device=default_device()), 4)  # a stub raises NotImplementedError
        _in_model(lambda m, wrong: attention_set(m, softmax_attention(fn, block, wrong)),
                  f"Triton softmax (tiles of {block})", model, prompts, output_lens, tok)

    return check("softmax_in_model", attempt)


class FunctionLinear(nn.Module):
    """A bias-free linear layer (y = x W^T) of the model computed by ``fn(a, b, block_m,
    block_n, block_k)`` (exercise 6's contract): a = x as fp32 [tokens, in_features], b = W^T
    [in_features, out_features], a transposed view of a fp32 copy of the weight (strides
    (1, in_features)), the result fp32 [tokens, out_features]. Each product is also computed in
    float64; ``wrong`` collects those that differ (a description each), for the checker's
    message."""

    def __init__(self, linear: nn.Linear, fn: Callable[..., torch.Tensor],
                 blocks: tuple[int, int, int], name: str, wrong: list[str]) -> None:
        super().__init__()
        self.weight, self.fn, self.blocks, self.name, self.wrong = (
            linear.weight, fn, blocks, name, wrong)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x.reshape(-1, x.shape[-1]).to(torch.float32)
        b = self.weight.detach().t().to(torch.float32, copy=True)
        out = self.fn(a, b, *self.blocks)
        m, (k, n) = a.shape[0], b.shape
        assert isinstance(out, torch.Tensor) and out.shape == (m, n), (
            f"matmul returned {getattr(out, 'shape', type(out).__name__)} for a [{m}, {k}] @ "
            f"b [{k}, {n}]")
        _note_first_wrong(self.wrong, out, a.double() @ b.double(),
                          f"product, x [{m}, {k}] @ {self.name}^T [{k}, {n}] in tiles "
                          "BLOCK_M={}, BLOCK_N={}, BLOCK_K={},".format(*self.blocks), 1e-4)
        return out.to(x.dtype).reshape(*x.shape[:-1], n)


@contextmanager
def matmul_replaced(model: Transformer, fn: Callable[..., torch.Tensor],
                    blocks: tuple[int, int, int], wrong: list[str] | None = None
                    ) -> Iterator[int]:
    """Inside the ``with`` block every attention layer's output projection (``attn.wo``) is a
    :class:`FunctionLinear` of ``fn`` with tiles ``blocks`` = (block_m, block_n, block_k)
    (wrong products are described in ``wrong``); the layers' own are put back on exit. Yields
    the number of layers."""
    saved = [layer.attn.wo for layer in model.layers]
    wrong = [] if wrong is None else wrong
    for layer in model.layers:
        layer.attn.wo = FunctionLinear(layer.attn.wo, fn, blocks, "wo", wrong)
    try:
        yield len(saved)
    finally:
        for layer, wo in zip(model.layers, saved):
            layer.attn.wo = wo


def check_matmul_in_model(fn: Callable[..., torch.Tensor], model: Transformer | None = None,
                          prompts: list[list[int]] | None = None,
                          output_lens: list[int] | None = None, tok: Tokenizer | None = None,
                          blocks: tuple[int, int, int] = (16, 128, 128)) -> Result:
    """Exercise 6's ``matmul(a, b, block_m, block_n, block_k)`` -> a [M, K] @ b [K, N], fp32,
    by the student's tiled Triton kernel (one program per ``block_m x block_n`` tile of the
    result, walking K in ``block_k`` steps; a and b with any strides).

    First one product whose sizes are multiples of its 16 x 16 x 16 tiles, b a transposed view
    as the model's weights are; then the kernel is the output projection of every attention
    layer (:func:`matmul_replaced`, tiles ``blocks``) of ``model`` (default: the tiny preset,
    random weights, float64; a 16-bit model as a float32 copy), where no size is a multiple of
    its tile: the tokens of a prompt or one decode step (M), and the model's width (N and K;
    64 < 128 in the tiny preset, 576 = 4.5 x 128 in SmolLM2). Passes when the model generates
    the package's greedy tokens for ``prompts`` (default: two short seeded random ones) with
    the package's logits in one uncached pass; prints both runs' seconds."""
    gen = torch.Generator().manual_seed(13)

    def attempt() -> None:
        a = torch.randn(32, 64, generator=gen).to(default_device())
        b = torch.randn(48, 64, generator=gen).to(default_device()).t()
        got = fn(a, b, 16, 16, 16)
        want = a.double() @ b.double()
        assert isinstance(got, torch.Tensor) and tuple(got.shape) == (32, 48), (
            f"a [32, 64] @ b [64, 48]: got {getattr(got, 'shape', type(got).__name__)}, "
            "expected a tensor of shape (32, 48)")
        err = (got.double() - want).abs().max().item()
        assert err < 1e-3, (f"a [32, 64] @ b [64, 48] (b a transposed view, strides "
                            f"{b.stride()}) in 16 x 16 x 16 tiles: off by {err:.1e}")
        _in_model(lambda m, wrong: matmul_replaced(m, fn, blocks, wrong),
                  "Triton matmul (tiles {} x {} x {})".format(*blocks), model, prompts,
                  output_lens, tok)

    return check("matmul_in_model", attempt)
