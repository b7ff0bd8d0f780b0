"""Checkers for the exercises of chapter 03 (sharding a model).

Each ``check_*`` takes the student's function, compares it with the package on a few cases,
prints a one-line verdict and returns a :class:`~minillm.labs.common.Result` (``passed`` is None
while the exercise still raises NotImplementedError).
"""
from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import PRESETS
from ..model.layers import Attention, SwiGLU, rope_cos_sin
from ..model.transformer import _heads_axis
from ..parallel.pipeline import bubble_formula, simulate_pipeline
from ..parallel.tensor import check_tp, kv_heads_of_rank
from .common import Result, check


def _ffn_partial(ffn: SwiGLU, x: torch.Tensor, rank: int, p: int) -> torch.Tensor:
    """Rank ``rank``'s partial output: its columns of w_gate/w_up, its rows of w_down."""
    per = ffn.w_gate.weight.shape[0] // p
    cols = slice(rank * per, (rank + 1) * per)
    h = F.silu(x @ ffn.w_gate.weight[cols].T) * (x @ ffn.w_up.weight[cols].T)
    return h @ ffn.w_down.weight[:, cols].T


def check_ffn_partials(fn: Callable) -> Result:
    """``fn(ffn, x, world_size)`` -> list of world_size tensors [N, D]: each rank's partial
    output of a SwiGLU FFN split Megatron-style (w_gate, w_up by columns, w_down by rows).
    Their sum must be ffn(x); each must be what that rank alone can compute."""

    def attempt() -> None:
        gen = torch.Generator().manual_seed(0)
        for d, ffn_dim, p in ((16, 32, 2), (24, 48, 4), (8, 24, 3)):
            torch.manual_seed(p)
            ffn = SwiGLU(d, ffn_dim).double()
            x = torch.randn(5, d, generator=gen, dtype=torch.float64)
            with torch.no_grad():
                parts = fn(ffn, x, p)
                assert len(parts) == p, f"world_size={p}: expected {p} partials, got {len(parts)}"
                full = ffn(x)
                total = sum(parts)
                assert torch.allclose(total, full, atol=1e-10), (
                    f"d={d}, ffn_dim={ffn_dim}, world_size={p}: the partials do not add up to "
                    f"ffn(x) (max |diff| {(total - full).abs().max():.2e})")
                for r, part in enumerate(parts):
                    want = _ffn_partial(ffn, x, r, p)
                    assert torch.allclose(part, want, atol=1e-10), (
                        f"world_size={p}: partial {r} is not rank {r}'s share (its columns "
                        f"{r * ffn_dim // p}..{(r + 1) * ffn_dim // p - 1} of ffn_dim)")

    return check("ffn_partials", attempt)


def _linear(weight: torch.Tensor) -> nn.Linear:
    """A bias-free nn.Linear holding ``weight`` [out, in]."""
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    out.weight = nn.Parameter(weight.clone(), requires_grad=False)
    return out


def _attention_partial(attn: Attention, cfg, x: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, rank: int, p: int) -> torch.Tensor:
    """Rank ``rank``'s partial output [B, T, D]: the package's Attention on its query heads,
    the KV heads they read, and its rows of wo (the columns of wo's weight)."""
    hd, per = cfg.head_dim, cfg.n_heads // p
    q_rows = slice(rank * per * hd, (rank + 1) * per * hd)
    kv = kv_heads_of_rank(cfg, rank, p)
    kv_rows = slice(kv.start * hd, kv.stop * hd)
    shard = copy.deepcopy(attn)
    shard.wq, shard.wo = _linear(attn.wq.weight[q_rows]), _linear(attn.wo.weight[:, q_rows])
    shard.wk, shard.wv = _linear(attn.wk.weight[kv_rows]), _linear(attn.wv.weight[kv_rows])
    shard.n_heads, shard.n_kv_heads = per, len(kv)
    return shard(x, cos, sin)


def check_attention_partials(fn: Callable) -> Result:
    """``fn(attn, x, cos, sin, world_size)`` -> list of world_size tensors [B, T, D]: each
    rank's partial output of a causal grouped-query attention layer split by heads. Rank r
    keeps query heads [r H/P, (r+1) H/P), the KV heads those read (query head h reads KV head
    h // (H / H_kv), so a KV head is copied when P > H_kv), and the matching columns of wo's
    weight. x is [B, T, D], cos/sin [1, 1, T, head_dim] (RoPE). The sum of the partials must be
    attn(x, cos, sin), and each partial what that rank alone computes."""
    base = PRESETS["tiny"]
    shapes = ((4, 2, 2), (4, 2, 4), (6, 3, 3), (8, 2, 2), (4, 4, 1))  # (H, H_kv, P)

    def attempt() -> None:
        gen = torch.Generator().manual_seed(0)
        for hq, hkv, p in shapes:
            cfg = base.with_(n_heads=hq, n_kv_heads=hkv, d_model=8 * hq, head_dim=8)
            torch.manual_seed(hq + hkv + p)
            attn = Attention(cfg, 0).double().eval()
            x = torch.randn(2, 5, cfg.d_model, generator=gen, dtype=torch.float64)
            cos, sin = (_heads_axis(t) for t in rope_cos_sin(torch.arange(5), cfg.head_dim,
                                                              cfg.rope_theta, torch.float64))
            case = f"H={hq}, H_kv={hkv}, world_size={p}"
            with torch.no_grad():
                parts = fn(attn, x, cos, sin, p)
                assert len(parts) == p, f"{case}: expected {p} partials, got {len(parts)}"
                full = attn(x, cos, sin)
                total = sum(parts)
                assert torch.allclose(total, full, atol=1e-10), (
                    f"{case}: the partials do not add up to attn(x) (max |diff| "
                    f"{(total - full).abs().max():.2e})")
                for r, part in enumerate(parts):
                    want = _attention_partial(attn, cfg, x, cos, sin, r, p)
                    assert torch.allclose(part, want, atol=1e-10), (
                        f"{case}: partial {r} is not rank {r}'s share (query heads "
                        f"{r * hq // p}..{(r + 1) * hq // p - 1})")

    return check("attention_partials", attempt)


def check_gpipe_slots(fn: Callable[[int, int], list[list[int]]]) -> Result:
    """``fn(p, m)`` -> start[s][i]: the time slot in which stage s runs micro-batch i on a GPipe
    forward schedule where every stage takes one slot per micro-batch and starts as early as
    it can. The bubble fraction of your schedule is compared with (p-1)/(m+p-1)."""

    def attempt() -> None:
        for p in (1, 2, 3, 4, 8):
            for m in (1, 2, 4, 7, 16):
                start = [list(row) for row in fn(p, m)]
                want = [[s + i for i in range(m)] for s in range(p)]
                assert start == want, f"p={p}, m={m}: got {start}, expected {want}"
                span = max(max(row) for row in start) + 1
                bubble = 1 - p * m / (p * span)
                assert abs(bubble - bubble_formula(p, m)) < 1e-12

    return check("gpipe_slots", attempt)


def check_gpipe_times(fn: Callable[[list[list[float]]], list[list[float]]]) -> Result:
    """``fn(costs)`` -> start[s][i]: when stage s starts micro-batch i, where costs[s][i] is
    the time stage s spends on micro-batch i ([p][m], stages of unequal speed allowed). Each
    stage takes its micro-batches in order and starts one as soon as the stage is free and the
    previous stage has finished that micro-batch (transfers are free)."""
    gen = torch.Generator().manual_seed(0)
    tables = {"equal stages p=2, m=4": [[1.0] * 4] * 2,
              "slow first stage": [[3.0] * 4, [1.0] * 4],
              "slow last stage": [[1.0] * 5, [2.0] * 5, [4.0] * 5],
              "one stage": [[0.5, 2.0, 1.0]], "one micro-batch": [[1.0], [2.0], [0.5]],
              "random p=4, m=6": (torch.rand(4, 6, generator=gen, dtype=torch.float64)
                                  + 0.1).tolist(),
              "zero-cost stage": [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [2.0, 0.5, 1.0]]}

    def attempt() -> None:
        for name, costs in tables.items():
            got = [[float(t) for t in row] for row in fn([list(row) for row in costs])]
            want = [[start for _, start, _ in tl] for tl in simulate_pipeline(costs)]
            assert len(got) == len(want) and all(len(g) == len(w) for g, w in zip(got, want)), (
                f"{name}: expected {len(want)} rows of {len(want[0])} start times")
            for s, (g, w) in enumerate(zip(got, want)):
                for i, (a, b) in enumerate(zip(g, w)):
                    assert abs(a - b) < 1e-9, (f"{name} (costs {costs}): stage {s} starts "
                                               f"micro-batch {i} at {a:.3g}, expected {b:.3g}")

    return check("gpipe_times", attempt)


def check_dispatch_counts(fn: Callable[[torch.Tensor, int, int], list[int]]) -> Result:
    """``fn(experts, n_experts, world_size)`` -> [world_size] ints: how many token slots this
    rank sends to each rank, where experts [N, k] are the chosen expert ids and rank r holds the
    contiguous block of experts [r E/P, (r+1) E/P)."""

    def attempt() -> None:
        gen = torch.Generator().manual_seed(0)
        for n, k, e, p in ((10, 2, 8, 2), (33, 2, 8, 4), (7, 1, 6, 3), (50, 4, 16, 8)):
            experts = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
            got = [int(c) for c in fn(experts, e, p)]
            want = torch.bincount(experts.flatten() // (e // p), minlength=p).tolist()
            assert got == want, f"N={n}, k={k}, E={e}, P={p}: got {got}, expected {want}"
            assert sum(got) == n * k, "every (token, expert) slot must go somewhere"

    return check("dispatch_counts", attempt)


def check_kv_heads(fn: Callable[[object, int, int], list[int]]) -> Result:
    """``fn(cfg, rank, world_size)`` -> the KV heads that rank keeps under tensor parallelism:
    its share when world_size divides n_kv_heads, the one head it replicates when world_size is
    a multiple of n_kv_heads; raise ValueError when the heads cannot be split."""
    base = PRESETS["tiny"]
    shapes = ((9, 3), (8, 8), (4, 2), (16, 4), (12, 6), (32, 8), (6, 2))

    def attempt() -> None:
        for hq, hkv in shapes:
            cfg = base.with_(n_heads=hq, n_kv_heads=hkv, ffn_dim=48 * 8, vocab_size=48 * 64)
            for p in (1, 2, 3, 4, 8):
                try:
                    check_tp(cfg, p)
                except ValueError:
                    try:
                        got = fn(cfg, 0, p)
                    except ValueError:
                        continue
                    raise AssertionError(f"n_heads={hq}, n_kv_heads={hkv}, world_size={p} "
                                         f"cannot be split, but you returned {got}") from None
                for r in range(p):
                    got = [int(h) for h in fn(cfg, r, p)]
                    want = list(kv_heads_of_rank(cfg, r, p))
                    assert got == want, (f"n_heads={hq}, n_kv_heads={hkv}, world_size={p}, "
                                         f"rank {r}: got {got}, expected {want}")

    return check("kv_heads", attempt)
