"""Checkers for the exercises of chapter 09 (sharding the input: sequence parallelism).

Each ``check_*`` takes the student's function, compares it with the package on a few cases,
prints a one-line verdict and returns a :class:`~minillm.labs.common.Result` (``passed`` is None
while the exercise still raises NotImplementedError).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..parallel.sequence import masked_attention, merge_states, rank_work
from .common import Result, check


def check_merge(fn: Callable) -> Result:
    """``fn(out_a, lse_a, out_b, lse_b)`` -> (out, lse): attention over keys A and B from the
    attention over A and over B alone (out [..., D], lse [...] natural log). Tested on real
    halves of an attention computation, and on rows where one side saw no key (lse = -inf)."""

    def attempt() -> None:
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(2, 3, 5, 8, generator=gen, dtype=torch.float64)
        k = torch.randn(2, 3, 9, 8, generator=gen, dtype=torch.float64)
        v = torch.randn(2, 3, 9, 8, generator=gen, dtype=torch.float64)
        qp, kp = torch.arange(4, 9), torch.arange(9)
        full, full_lse = masked_attention(q, k, v, qp, kp, True)
        for cut in (1, 4, 6):
            a = masked_attention(q, k[:, :, :cut], v[:, :, :cut], qp, kp[:cut], True)
            b = masked_attention(q, k[:, :, cut:], v[:, :, cut:], qp, kp[cut:], True)
            out, lse = fn(*a, *b)
            assert torch.allclose(out, full, atol=1e-10), (
                f"keys split at {cut}: merged output differs from attention over all keys by "
                f"{(out - full).abs().max():.2e}")
            assert torch.allclose(lse, full_lse, atol=1e-10), f"keys split at {cut}: wrong lse"
        # one side empty for every row: the merge must return the other side unchanged
        none = masked_attention(q, k, v, qp, torch.full((9,), -1), True)
        out, lse = fn(*none, full, full_lse)
        want = merge_states(*none, full, full_lse)
        assert torch.allclose(out, want[0]) and torch.allclose(lse, want[1]), (
            "merging with a side that saw no key (lse = -inf, out 0) must return the other side")
        # both sides empty: no key at all, so out 0 and lse -inf, never NaN
        out, lse = fn(*none, *none)
        assert not out.isnan().any() and not lse.isnan().any(), (
            "merging two sides that saw no key gave NaN: guard the weights when both lse are "
            "-inf (out must be 0, lse -inf)")
        assert (out == 0).all() and (lse == float("-inf")).all(), (
            "merging two sides that saw no key must give out 0 and lse -inf")

    return check("merge", attempt)


def check_rank_work(fn: Callable[[int, int, str], list[int]]) -> Result:
    """``fn(seq_len, world_size, layout)`` -> [world_size] ints: the causal (query, key) pairs
    each rank computes in ring attention, with "contiguous" shards (rank r holds the r-th block
    of ceil(T/P) tokens) or "striped" ones (rank r holds r, r+P, r+2P, ...)."""

    def attempt() -> None:
        for t, p in ((8, 2), (16, 4), (13, 4), (100, 8), (5, 5)):
            for layout in ("contiguous", "striped"):
                got = [int(x) for x in fn(t, p, layout)]
                want = rank_work(t, p, layout)
                assert got == want, f"T={t}, P={p}, {layout}: got {got}, expected {want}"

    return check("rank_work", attempt)


def _seq_to_heads(shards: list[torch.Tensor]) -> list[torch.Tensor]:
    p = len(shards)
    h = shards[0].shape[1] // p
    return [torch.cat([s[:, r * h:(r + 1) * h] for s in shards], dim=2) for r in range(p)]


def check_ulysses_all_to_all(fn: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> Result:
    """``fn(shards)`` -> list: simulate Ulysses' first all-to-all in one process. shards[r] is
    rank r's [B, H, L, D] (all heads, its L tokens); output[r] must be [B, H/P, P L, D]: rank
    r's H/P heads over the whole sequence, tokens in rank order."""

    def attempt() -> None:
        gen = torch.Generator().manual_seed(1)
        for b, h, l, d, p in ((1, 4, 3, 2, 2), (2, 8, 5, 4, 4), (1, 9, 2, 3, 3)):
            full = torch.randn(b, h, l * p, d, generator=gen)
            shards = list(full.split(l, dim=2))
            got = fn([s.clone() for s in shards])
            assert len(got) == p, f"P={p}: expected {p} outputs, got {len(got)}"
            for r, (g, w) in enumerate(zip(got, _seq_to_heads(shards))):
                assert tuple(g.shape) == tuple(w.shape), (
                    f"P={p}, rank {r}: shape {tuple(g.shape)}, expected {tuple(w.shape)}")
                assert torch.equal(g, w), f"P={p}, rank {r}: wrong heads or token order"
                assert torch.equal(g, full[:, r * (h // p):(r + 1) * (h // p)])

    return check("ulysses_all_to_all", attempt)
