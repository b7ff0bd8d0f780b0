"""Checkers for the exercises of chapter 09 (sharding the input: sequence parallelism).

Each ``check_*`` takes the student's function, compares it with the package on a few cases,
prints a one-line verdict and returns a :class:`~minillm.labs.common.Result` (``passed`` is None
while the exercise still raises NotImplementedError).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..parallel.sequence import (
    masked_attention,
    merge_states,
    rank_work,
    ring_bytes,
    shard_positions,
    take,
    ulysses_bytes,
)
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


def check_ring_attention(fn: Callable) -> Result:
    """``fn(qs, ks, vs, positions, causal)`` -> (outs, held): ring attention over P simulated
    ranks in one process. qs[r] [B, H, L, D], ks[r] / vs[r] [B, Hkv, L, D] and positions[r] [L]
    (-1 = padding) are rank r's shard. At step s = 0..P-1 rank r attends its queries to the K/V
    block that started on rank (r - s) mod P and merges the result into its running (out, lse);
    then every block moves one rank on. outs[r] [B, H, L, D] must equal attention of rank r's
    queries over every key; held[s][r] is the index of the block rank r used at step s."""

    def attempt() -> None:
        gen = torch.Generator().manual_seed(2)
        for t, p, layout, causal in ((8, 2, "contiguous", True), (12, 4, "striped", True),
                                     (13, 4, "contiguous", True), (10, 3, "striped", False),
                                     (6, 1, "contiguous", True)):
            case = f"T={t}, P={p}, {layout}, causal={causal}"
            pos = shard_positions(t, p, layout)
            q = torch.randn(1, 4, t, 8, generator=gen, dtype=torch.float64)
            k, v = (torch.randn(1, 2, t, 8, generator=gen, dtype=torch.float64) for _ in "kv")
            qs, ks, vs = ([take(x, pos[r]) for r in range(p)] for x in (q, k, v))
            outs, held = fn(qs, ks, vs, [x.clone() for x in pos], causal)
            want_held = [[(r - s) % p for r in range(p)] for s in range(p)]
            assert [[int(j) for j in row] for row in held] == want_held, (
                f"{case}: blocks held per step {held}, expected {want_held} (at step s rank r "
                f"holds the block that started on rank (r - s) mod P)")
            all_pos = torch.cat(pos)
            all_k, all_v = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
            for r in range(p):
                want, _ = masked_attention(qs[r], all_k, all_v, pos[r], all_pos, causal)
                assert outs[r].shape == want.shape, (
                    f"{case}, rank {r}: shape {tuple(outs[r].shape)}, expected "
                    f"{tuple(want.shape)}")
                assert torch.allclose(outs[r], want, atol=1e-10), (
                    f"{case}, rank {r}: output differs from attention over all keys by "
                    f"{(outs[r] - want).abs().max():.2e}")

    return check("ring_attention", attempt)


def check_shard_positions(fn: Callable[[int, int, str], list[torch.Tensor]]) -> Result:
    """``fn(seq_len, world_size, layout)`` -> list of world_size LongTensors [ceil(T/P)]: the
    positions each rank holds, -1 for padding. "contiguous": rank r holds [r L, (r+1) L) with
    L = ceil(T/P); "striped": r, r+P, r+2P, ... Positions past the sequence are -1."""

    def attempt() -> None:
        for t, p in ((8, 2), (12, 4), (13, 4), (10, 4), (5, 4), (7, 7), (9, 1)):
            for layout in ("contiguous", "striped"):
                got = [[int(i) for i in x] for x in fn(t, p, layout)]
                want = [x.tolist() for x in shard_positions(t, p, layout)]
                assert got == want, f"T={t}, P={p}, {layout}: got {got}, expected {want}"

    return check("shard_positions", attempt)


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


def check_comm_bytes(fn: Callable[[int, int, int, int, int, str], int]) -> Result:
    """``fn(seq_len, world_size, n_heads, n_kv_heads, head_dim, scheme)`` -> bytes one rank sends
    for one attention layer (batch 1, 4-byte numbers, shards of ceil(T/P) tokens). "ring": P-1
    K and V blocks plus their positions (one 8-byte int per token); "ulysses": what leaves the
    rank in the all-to-alls of q, k, v (before attention) and of the output (after)."""
    cases = ((1024, 2, 12, 12, 64), (1024, 4, 12, 12, 64), (1000, 3, 9, 3, 64),
             (256, 6, 12, 6, 32), (64, 1, 4, 2, 16), (100, 2, 8, 2, 64))

    def attempt() -> None:
        for t, p, h, hkv, d in cases:
            for scheme, want in (("ring", ring_bytes(t, p, hkv, d)),
                                 ("ulysses", ulysses_bytes(t, p, h, hkv, d))):
                got = int(fn(t, p, h, hkv, d, scheme))
                assert got == want, (f"T={t}, P={p}, H={h}, H_kv={hkv}, d={d}, {scheme}: got "
                                     f"{got:,} bytes, expected {want:,}")

    return check("comm_bytes", attempt)
