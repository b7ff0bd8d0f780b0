"""Checkers for the exercises of chapter 05 (I/O-aware kernels).

Each ``check_*`` takes the student's function, compares it with a float64 computation or with
:mod:`minillm.course.ch05_io_model` on a few cases (edge cases included), prints a one-line verdict
and
returns a :class:`~minillm.labs.common.Result` (``passed`` is None while the exercise still
raises NotImplementedError).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..course import ch05_io_model as io_model
from .common import Result, check


def _softmax_attention(s: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(s) v and logsumexp(s) in float64; rows with no finite score give 0 and -inf."""
    s, v = s.double(), v.double()
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(s - safe[..., None]) @ v, lse


def check_online_softmax(fn: Callable) -> Result:
    """``fn(m, l, acc, s, v)`` -> (m, l, acc): fold one tile of scores into the running state.

    m [R] running max, l [R] running sum of exp(score - m), acc [R, D] running sum of
    exp(score - m) * v (not yet divided by l); s [R, N] the tile's scores (natural units, -inf
    where masked), v [N, D]. Start: m = -inf, l = 0, acc = 0; after the last tile,
    out = acc / l. The checker streams tiles of random scores (some large enough that exp
    overflows without the max, some tiles masked for some rows, one row masked in the first
    tiles) and compares acc / l with softmax(scores) @ v in float64.
    """
    gen = torch.Generator().manual_seed(5)

    def run(s: torch.Tensor, v: torch.Tensor, tile: int) -> torch.Tensor:
        rows, d = s.shape[0], v.shape[1]
        m = torch.full((rows,), float("-inf"))
        l = torch.zeros(rows)
        acc = torch.zeros(rows, d)
        for start in range(0, s.shape[1], tile):
            m, l, acc = fn(m, l, acc, s[:, start:start + tile], v[start:start + tile])
            assert not torch.isnan(acc).any() and not torch.isnan(l).any(), (
                f"NaN in the state after the tile starting at key {start} (a row whose "
                "scores so far are all -inf must keep m = -inf, l = 0, acc = 0)")
        return acc / l[:, None]

    def attempt() -> None:
        for rows, n, d, tile, scale in ((1, 8, 4, 8, 1.0), (3, 20, 5, 4, 3.0),
                                        (4, 37, 8, 16, 150.0), (2, 9, 3, 1, 1.0)):
            s = torch.randn(rows, n, generator=gen) * scale
            v = torch.randn(n, d, generator=gen)
            got = run(s, v, tile)
            want, _ = _softmax_attention(s, v)
            err = (got.double() - want).abs().max().item()
            assert err < 1e-4, (f"{rows} rows, {n} keys in tiles of {tile}, scores up to "
                                f"{s.abs().max():.0f}: acc / l differs from softmax(s) @ v by "
                                f"{err:.2e}")
        s = torch.randn(3, 24, generator=gen)
        s[0, 14:] = float("-inf")  # a ragged end: later tiles fully masked for row 0
        s[1, :10] = float("-inf")  # row 1 sees nothing in the first tiles
        s[2, ::2] = float("-inf")
        v = torch.randn(24, 6, generator=gen)
        got = run(s, v, 5)
        want, _ = _softmax_attention(s, v)
        err = (got.double() - want).abs().max().item()
        assert err < 1e-5, f"with masked (-inf) scores: off by {err:.2e}"

    return check("online_softmax", attempt)


def check_merge(fn: Callable) -> Result:
    """``fn(outs, lses)`` -> (out, lse): combine attention computed over disjoint key sets.

    outs: list of [..., D] tensors, lses: list of [...] natural-log log-sum-exps of each part's
    scores (-inf for a part with no keys). Returns attention over the union of the keys and its
    log-sum-exp. Checked against attention over the concatenated keys (float64), for 2 to 5
    parts, with huge score offsets and with empty parts.
    """
    gen = torch.Generator().manual_seed(6)

    def attempt() -> None:
        cases = ((2, [7, 9], 1.0), (3, [1, 16, 5], 4.0), (5, [3, 3, 3, 3, 3], 80.0),
                 (3, [6, 0, 4], 1.0))
        for rows, sizes, scale in cases:
            s = torch.randn(rows, sum(sizes), generator=gen, dtype=torch.float64) * scale
            v = torch.randn(sum(sizes), 4, generator=gen, dtype=torch.float64)
            outs, lses = [], []
            for part_s, part_v in zip(s.split(sizes, dim=1), v.split(sizes)):
                o, lse = _softmax_attention(part_s, part_v)
                outs.append(o)
                lses.append(lse)
            out, lse = fn(outs, lses)
            want_out, want_lse = _softmax_attention(s, v)
            where = f"{len(sizes)} parts of {sizes} keys, score scale {scale}"
            assert tuple(out.shape) == tuple(want_out.shape), (
                f"{where}: out has shape {tuple(out.shape)}, expected {tuple(want_out.shape)}")
            err = (out - want_out).abs().max().item()
            assert err < 1e-9, (f"{where}: merged out differs from attention over all keys "
                                f"by {err:.2e}")
            err = (lse - want_lse).abs().max().item()
            assert err < 1e-9, (f"{where}: merged lse differs from logsumexp over all keys "
                                f"by {err:.2e}")
        empty = [torch.zeros(2, 4, dtype=torch.float64)] * 2
        out, lse = fn(empty, [torch.full((2,), float("-inf"), dtype=torch.float64)] * 2)
        assert torch.all(out == 0) and torch.all(lse == float("-inf")), (
            "two parts with no keys must merge to out 0, lse -inf (and no NaN)")

    return check("merge", attempt)


def check_fused_softmax_bytes(fn: Callable[..., int]) -> Result:
    """``fn(n, d, heads=1, batch=1, dtype_bytes=2)`` -> HBM bytes of attention done in two
    kernels: kernel 1 computes S = Q K^T *and* its softmax on chip, writing only P; kernel 2
    reads P and V and writes O. Compared with the naive count of
    :mod:`minillm.course.ch05_io_model` minus
    the traffic of S."""
    cases = ((3, 2, 1, 1, 2), (1024, 64, 1, 1, 2), (4096, 128, 32, 4, 2), (17, 16, 3, 2, 4))

    def attempt() -> None:
        for n, d, h, b, bpe in cases:
            got = fn(n, d, heads=h, batch=b, dtype_bytes=bpe)
            io = io_model.naive_attention_io(n, d, h, b, bpe)
            want = sum(io.values()) - io["write S"] - io["read S"]
            assert got == want, (f"n={n}, d={d}, heads={h}, batch={b}, dtype_bytes={bpe}: got "
                                 f"{got}, expected {want}")

    return check("fused_softmax_bytes", attempt)
