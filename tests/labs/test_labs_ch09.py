"""Chapter 09 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import torch
from lab_checks import checker_tests

from minillm.labs import ch09
from minillm.labs.solutions import ch09 as key

# --- wrong solutions -----------------------------------------------------------------------


def merge_average(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, torch.maximum(lse_a, lse_b)


def merge_unguarded(out_a, lse_a, out_b, lse_b):  # NaN where both sides saw no key
    m = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    return (out_a * wa[..., None] + out_b * wb[..., None]) / (wa + wb)[..., None], \
        m + torch.log(wa + wb)


def ring_attention_zero_start(qs, ks, vs, positions, causal):
    # starts every rank from (out 0, lse 0) instead of (0, -inf): a phantom key of score 0
    p = len(qs)
    outs = [torch.zeros_like(q) for q in qs]
    lses = [torch.zeros(q.shape[:-1], dtype=q.dtype) for q in qs]
    for s in range(p):
        for r in range(p):
            j = (r - s) % p
            out, lse = key._block(qs[r], ks[j], vs[j], positions[r], positions[j], causal)
            outs[r], lses[r] = key.merge(outs[r], lses[r], out, lse)
    return outs, [[(r - s) % p for r in range(p)] for s in range(p)]


def ring_attention_wrong_direction(qs, ks, vs, positions, causal):
    outs, held = key.ring_attention(qs, ks, vs, positions, causal)
    p = len(qs)
    return outs, [[(r + s) % p for r in range(p)] for s in range(p)]  # blocks go the other way


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


def seq_to_heads_wrong_order(shards):
    p = len(shards)
    h = shards[0].shape[1] // p
    return [torch.cat([s[:, r * h:(r + 1) * h] for s in reversed(shards)], dim=2)
            for r in range(p)]


CHECKS = [
    (ch09.check_merge, key.merge, merge_average),
    (ch09.check_merge, key.merge, merge_unguarded),
    (ch09.check_ring_attention, key.ring_attention, ring_attention_zero_start),
    (ch09.check_ring_attention, key.ring_attention, ring_attention_wrong_direction),
    (ch09.check_shard_positions, key.shard_positions, shard_positions_no_padding),
    (ch09.check_rank_work, key.rank_work, rank_work_blocks),
    (ch09.check_ulysses_all_to_all, key.seq_to_heads, seq_to_heads_wrong_order),
    (ch09.check_comm_bytes, key.comm_bytes, comm_bytes_ring_all_steps),
    (ch09.check_comm_bytes, key.comm_bytes, comm_bytes_ulysses_whole),
]
IDS = ["merge", "merge_both_sides_empty", "ring_zero_start", "ring_direction", "shard_padding",
       "rank_work", "ulysses", "bytes_ring_steps", "bytes_ulysses_whole"]


test_reference_passes, test_wrong_fails, test_stub_is_not_attempted = \
    checker_tests(CHECKS, IDS)
