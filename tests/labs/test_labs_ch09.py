"""Chapter 09 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import pickle

import pytest
import torch
from lab_checks import checker_tests

from minillm.labs import ch09, ranks
from minillm.labs.solutions import ch09 as key

# --- wrong solutions -----------------------------------------------------------------------


def merge_average(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, torch.maximum(lse_a, lse_b)


def merge_unguarded(out_a, lse_a, out_b, lse_b):  # NaN where both sides saw no key
    m = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    return (out_a * wa[..., None] + out_b * wb[..., None]) / (wa + wb)[..., None], \
        m + torch.log(wa + wb)


def _ring(q, k, v, pos, causal, world_size, pass_on, start_lse=float("-inf"), passes=None,
          send=lambda block, q: block):
    # the key's ring with one thing changed: where lse starts, how many passes, what is sent
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], start_lse, dtype=q.dtype)
    block = [k, v, pos]
    for step in range(world_size):
        out, lse = key.merge(out, lse, *key._block(q, *block[:2], pos, block[2], causal))
        if step < (world_size - 1 if passes is None else passes(step, block)):
            block = pass_on(send(block, q))[-3:]
    return out


def ring_attention_zero_start(q, k, v, pos, causal, world_size, pass_on):
    # starts from (out 0, lse 0) instead of (0, -inf): a phantom key of score 0
    return _ring(q, k, v, pos, causal, world_size, pass_on, start_lse=0.0)


def ring_attention_passes_every_step(q, k, v, pos, causal, world_size, pass_on):
    # passes after the last step too: P passes where P-1 do
    return _ring(q, k, v, pos, causal, world_size, pass_on, passes=lambda step, block: step + 1)


def ring_attention_skips_future_passes(q, k, v, pos, causal, world_size, pass_on):
    # skips passing on a block whose keys all lie after this rank's queries (skipping the
    # block's *compute* is right; the next rank still needs it): ranks fall out of step
    def passes(step, block):
        seen = ((block[2][None, :] <= pos[:, None]) & (block[2] >= 0)).any() or not causal
        return world_size - 1 if seen else step
    return _ring(q, k, v, pos, causal, world_size, pass_on, passes=passes)


def ring_attention_own_positions(q, k, v, pos, causal, world_size, pass_on):
    # passes K and V but not their positions: masks every block with its own positions
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    k_blk, v_blk = k, v
    for step in range(world_size):
        out, lse = key.merge(out, lse, *key._block(q, k_blk, v_blk, pos, pos, causal))
        if step < world_size - 1:
            k_blk, v_blk = pass_on([k_blk, v_blk])
    return out


def ring_attention_sends_queries(q, k, v, pos, causal, world_size, pass_on):
    # right outputs, but the queries travel with every block: more than the ring's bytes
    return _ring(q, k, v, pos, causal, world_size, pass_on, send=lambda block, q: [q, *block])


def shard_positions_no_padding(seq_len, world_size, layout):
    if layout == "striped":
        return [torch.arange(r, seq_len, world_size) for r in range(world_size)]
    return list(torch.arange(seq_len).tensor_split(world_size))  # uneven, unpadded shards


def comm_bytes_ring_all_steps(seq_len, world_size, n_heads, n_kv_heads, head_dim, scheme):
    if scheme == "ring":  # counts P sends: the last step's block needs no sending
        shard = -(-seq_len // world_size)
        return world_size * (2 * n_kv_heads * shard * head_dim * 4 + 8 * shard)
    return key.comm_bytes(seq_len, world_size, n_heads, n_kv_heads, head_dim, scheme)


def comm_bytes_ulysses_whole(seq_len, world_size, n_heads, n_kv_heads, head_dim, scheme):
    if scheme == "ulysses":  # forgets that each rank keeps its own chunk
        shard = -(-seq_len // world_size)
        return (2 * n_heads + 2 * n_kv_heads) * shard * head_dim * 4
    return key.comm_bytes(seq_len, world_size, n_heads, n_kv_heads, head_dim, scheme)


def rank_work_blocks(seq_len, world_size, layout):
    return [seq_len // world_size * (r + 1) for r in range(world_size)]  # counts blocks, not pairs


def seq_to_heads_wrong_order(x, world_size, all_to_all):
    got = all_to_all([c.contiguous() for c in x.chunk(world_size, dim=1)])
    return torch.cat(got[::-1], dim=2)  # tokens of the last rank first


def seq_to_heads_splits_tokens(x, world_size, all_to_all):
    got = all_to_all([c.contiguous() for c in x.chunk(world_size, dim=2)])  # tokens, not heads
    return torch.cat(got, dim=1)


CHECKS = [
    (ch09.check_merge, key.merge, merge_average),
    (ch09.check_merge, key.merge, merge_unguarded),
    (ch09.check_ring_attention, key.ring_attention, ring_attention_zero_start),
    (ch09.check_ring_attention, key.ring_attention, ring_attention_passes_every_step),
    (ch09.check_ring_attention, key.ring_attention, ring_attention_skips_future_passes),
    (ch09.check_ring_attention, key.ring_attention, ring_attention_own_positions),
    (ch09.check_ring_attention_on_ranks, key.ring_attention, ring_attention_zero_start),
    (ch09.check_ring_attention_on_ranks, key.ring_attention, ring_attention_sends_queries),
    (ch09.check_shard_positions, key.shard_positions, shard_positions_no_padding),
    (ch09.check_rank_work, key.rank_work, rank_work_blocks),
    (ch09.check_ulysses_all_to_all, key.seq_to_heads, seq_to_heads_wrong_order),
    (ch09.check_ulysses_all_to_all, key.seq_to_heads, seq_to_heads_splits_tokens),
    (ch09.check_ulysses_on_ranks, key.seq_to_heads, seq_to_heads_wrong_order),
    (ch09.check_comm_bytes, key.comm_bytes, comm_bytes_ring_all_steps),
    (ch09.check_comm_bytes, key.comm_bytes, comm_bytes_ulysses_whole),
]
IDS = ["merge", "merge_both_sides_empty", "ring_zero_start", "ring_passes_every_step",
       "ring_skips_future_passes", "ring_own_positions", "ranks_zero_start",
       "ranks_sends_queries", "shard_padding", "rank_work", "ulysses_order", "ulysses_tokens",
       "ranks_ulysses_order", "bytes_ring_steps", "bytes_ulysses_whole"]


test_reference_passes, test_wrong_fails, test_stub_is_not_attempted = \
    checker_tests(CHECKS, IDS)


def _scaled(x, factor, then=lambda y: y - 1):
    return then(helper(x) * factor)  # a global function of this module, shipped with it


def helper(x):
    return torch.as_tensor(x).double() + 1


def test_shipped_function_round_trip():
    """A function no other process can import (this test module's) travels by value: its code,
    the module-level functions and modules it uses, its defaults (a lambda among them)."""
    shipped = ranks.shippable(_scaled)
    assert isinstance(shipped, ranks.ShippedFunction)
    again = pickle.loads(pickle.dumps(shipped))
    assert again(torch.tensor([1.0, 2.0]), 3).tolist() == [5.0, 8.0]
    assert ranks.shippable(key.merge) is key.merge  # importable: sent by name


def test_a_stranded_rank_is_named():
    """A rank that exchanges once more than the others fails with the counts, not a hang."""
    sim = ranks.SimulatedRanks(2, timeout_s=5)
    with pytest.raises(AssertionError, match=r"exchanges per rank: \[2, 1\]"):
        sim.run(lambda r: [sim.pass_on(r)([torch.zeros(1)]) for _ in range(2 - r)])
