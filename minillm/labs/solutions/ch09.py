"""Chapter 09's key: reference solutions (sharding the input), written from the rules."""
from __future__ import annotations

import math

import torch

from .. import ch09


def merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # both sides empty: no NaN
    return (torch.exp(lse_a - safe)[..., None] * out_a
            + torch.exp(lse_b - safe)[..., None] * out_b), lse


def ring_attention(q, k, v, pos, causal, world_size, pass_on):
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)  # none yet
    block = [k, v, pos]  # the K/V block this rank holds now, and its positions
    for step in range(world_size):
        out, lse = merge(out, lse, *_block(q, *block[:2], pos, block[2], causal))
        if step < world_size - 1:  # after the last step no block has to move
            block = pass_on(block)
    return out


def _block(q, k, v, q_pos, k_pos, causal):
    # attention with the log-sum-exp, masked by position (-1 = padding), GQA by repetition
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    seen = (k_pos >= 0)[None, :] & ((k_pos[None, :] <= q_pos[:, None]) if causal else True)
    scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - torch.where(torch.isinf(lse), 0, lse)[..., None])
    return weights @ v, lse


def shard_positions(seq_len, world_size, layout):
    shard = math.ceil(seq_len / world_size)
    out = []
    for r in range(world_size):
        if layout == "contiguous":
            pos = list(range(r * shard, (r + 1) * shard))
        else:
            pos = [r + i * world_size for i in range(shard)]
        out.append(torch.tensor([i if i < seq_len else -1 for i in pos]))
    return out


def rank_work(seq_len, world_size, layout):
    shard = math.ceil(seq_len / world_size)
    work = []
    for r in range(world_size):
        mine = (range(r * shard, min((r + 1) * shard, seq_len)) if layout == "contiguous"
                else range(r, seq_len, world_size))
        work.append(sum(i + 1 for i in mine))  # query i sees keys 0..i
    return work


def seq_to_heads(x, world_size, all_to_all):
    chunks = x.chunk(world_size, dim=1)  # chunk j: the heads of rank j, my tokens
    return torch.cat(all_to_all([c.contiguous() for c in chunks]), dim=2)  # tokens in rank order


def comm_bytes(seq_len, world_size, n_heads, n_kv_heads, head_dim, scheme):
    shard = math.ceil(seq_len / world_size)
    if scheme == "ring":  # P-1 steps, each: K and V of my block, and its positions
        return (world_size - 1) * (2 * n_kv_heads * shard * head_dim * 4 + 8 * shard)
    # Ulysses: four all-to-alls (q, k, v, then the output); in each, a tensor of n heads is
    # cut into P chunks of n/P heads and all but my own chunk leave
    chunk = shard * head_dim * 4
    return sum(n // world_size * (world_size - 1) * chunk
               for n in (n_heads, n_kv_heads, n_kv_heads, n_heads))


KEY = [
    (ch09.check_merge, merge),
    (ch09.check_ring_attention, ring_attention),
    (ch09.check_ring_attention_on_ranks, ring_attention),
    (ch09.check_shard_positions, shard_positions),
    (ch09.check_rank_work, rank_work),
    (ch09.check_ulysses_all_to_all, seq_to_heads),
    (ch09.check_ulysses_on_ranks, seq_to_heads),
    (ch09.check_comm_bytes, comm_bytes),
]
