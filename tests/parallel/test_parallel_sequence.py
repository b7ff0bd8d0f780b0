"""Sequence parallelism on real gloo processes against full attention (float64 references)."""
from __future__ import annotations

import math

import pytest
import torch

from minillm import parallel
from minillm.attention import sdpa_attention
from minillm.parallel.sequence import (
    balanced_schedule,
    masked_attention,
    rank_work,
    ring_bytes,
    shard_positions,
    ulysses_bytes,
)

B, H, HKV, D = 2, 4, 2, 8


def _qkv(t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, t, D, generator=g), torch.randn(B, HKV, t, D, generator=g),
            torch.randn(B, HKV, t, D, generator=g))


def _full(q, k, v, causal):
    """Full attention in float64 written out independently: softmax(q k^T / sqrt(D) + mask) v."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        t = q.shape[2]
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v


CASES = [(scheme, world, causal, t)
         for scheme, world in (("ring", 2), ("ring", 4), ("striped", 2), ("striped", 4),
                               ("ulysses", 2), ("usp", 4))
         for causal in (True, False) for t in (13, 16)]


@pytest.mark.parametrize("scheme,world,causal,t", CASES)
def test_sequence_parallel_equals_full_attention(scheme, world, causal, t):
    q, k, v = _qkv(t)
    out, results = parallel.sequence_attention(q, k, v, world, scheme, causal, ulysses_degree=2)
    torch.testing.assert_close(out.double(), _full(q, k, v, causal), atol=2e-6, rtol=2e-6)
    seen = torch.cat([r["positions"][r["positions"] >= 0] for r in results])
    assert sorted(seen.tolist()) == list(range(t))  # every token on exactly one rank


def test_reference_is_the_package_attention():
    q, k, v = _qkv(11)
    torch.testing.assert_close(_full(q, k, v, True).float(), sdpa_attention(q, k, v),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_ring_bytes_and_work_match_formulas(world):
    t = 16
    q, k, v = _qkv(t, seed=1)
    for scheme, layout in (("ring", "contiguous"), ("striped", "striped")):
        _, results = parallel.sequence_attention(q, k, v, world, scheme, causal=True)
        for r in results:
            assert sum(e.sent for e in r["events"]) == ring_bytes(t, world, HKV, D, batch=B)
        assert [r["pairs"] for r in results] == rank_work(t, world, layout)
    total = t * (t + 1) // 2
    assert sum(rank_work(t, world, "contiguous")) == total == sum(rank_work(t, world, "striped"))


def test_striping_balances_causal_work():
    contiguous, striped = rank_work(64, 4, "contiguous"), rank_work(64, 4, "striped")
    assert max(contiguous) / min(contiguous) > 5
    assert max(striped) / min(striped) < 1.2


def test_ulysses_bytes_match_formula():
    t = 16
    q, k, v = _qkv(t, seed=2)
    _, results = parallel.sequence_attention(q, k, v, 2, "ulysses", causal=True)
    for r in results:
        sent = sum(e.sent for e in r["events"])
        assert sent == ulysses_bytes(t, 2, H, HKV, D, batch=B)


@pytest.mark.parametrize("world", [2, 4])
def test_ring_pass_q_decode_equals_full_attention(world):
    t = 13
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(B, HKV, t, D, generator=g), torch.randn(B, HKV, t, D, generator=g)
    q = torch.randn(B, H, 2 * world, D, generator=g)  # two new tokens per rank
    out, results = parallel.pass_q_attention(q, k, v, world)
    group = H // HKV
    want = (q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2)
            / math.sqrt(D)).softmax(-1) @ v.double().repeat_interleave(group, 1)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-6)
    assert all(any(e.op == "all_to_all" for e in r["events"]) for r in results)


def test_bad_input_fails_before_any_process():
    q, k, v = _qkv(8)
    with pytest.raises(ValueError, match="n_kv_heads=2"):
        parallel.sequence_attention(q, k, v, 4, "ulysses")
    with pytest.raises(ValueError, match=r"world_size must be in \[1, seq_len=3\]"):
        parallel.sequence_attention(q[:, :, :3], k[:, :, :3], v[:, :, :3], 4, "ring")
    with pytest.raises(ValueError, match="ulysses_degree must divide"):
        parallel.sequence_attention(q, k, v, 4, "usp", ulysses_degree=3)
    with pytest.raises(ValueError, match="scheme must be one of"):
        parallel.sequence_attention(q, k, v, 2, "zigzag")
    with pytest.raises(ValueError, match="multiple of world_size"):
        parallel.pass_q_attention(q[:, :, :3], k, v, 2)


def test_shard_positions_and_masked_attention():
    assert [p.tolist() for p in shard_positions(5, 2)] == [[0, 1, 2], [3, 4, -1]]
    assert [p.tolist() for p in shard_positions(5, 2, "striped")] == [[0, 2, 4], [1, 3, -1]]
    q, k, v = _qkv(6)
    pos = torch.arange(6)
    out, lse = masked_attention(q.double(), k.double(), v.double(), pos, pos, True)
    torch.testing.assert_close(out, _full(q, k, v, True))
    none = masked_attention(q, k, v, pos, torch.full((6,), -1), True)  # no visible key
    assert torch.all(none[0] == 0) and torch.all(torch.isinf(none[1]))


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_work_stealing_simulation(world):
    plain, balanced = balanced_schedule(world, False), balanced_schedule(world, True)
    blocks = world * (world + 1) // 2
    for grid in (plain, balanced):
        done = sorted(c for row in grid for c in row if c)
        assert done == sorted(f"q{i}k{j}" for i in range(world) for j in range(i + 1))
        for row in grid:  # a rank computes with its own KV shard or its own queries
            for r, c in enumerate(row):
                if c:
                    i, j = int(c[1:c.index("k")]), int(c[c.index("k") + 1:])
                    assert r in (i, j)
    assert len(plain) == world
    assert len(balanced) == math.ceil(blocks / world)


def test_ring_pass_q_with_queries_inside_the_cache():
    """The last P tokens are the new ones: causal by position against a cache that holds them."""
    t, world = 11, 2
    q, k, v = _qkv(t, seed=4)
    out, _ = parallel.pass_q_attention(q[:, :, -world:], k, v, world,
                                       q_positions=torch.arange(t - world, t))
    torch.testing.assert_close(out.double(), _full(q, k, v, True)[:, :, -world:], atol=2e-6,
                               rtol=2e-6)
