"""Sequence (context) parallelism: one long sequence split over the ranks (chapter 09).

Every rank holds a shard of the tokens: their q, k, v [B, H, L, D] and their positions [L] in
the full sequence (-1 marks padding, so any length splits: shards are ceil(T/P) long). All
schemes compute attention with an explicit position mask, so the same code serves causal and
bidirectional attention, contiguous and striped shards:

- :func:`ring_attention` (Liu et al. 2023): K/V blocks travel round the ring; each rank merges the
  partial result of every block into its running (out, lse) with the log-sum-exp rule. The next
  block's send/recv is started before the current block is computed, so they overlap.
- striped shards (Brandon et al. 2023): rank r holds positions r, r+P, r+2P, ... With contiguous
  shards the causal mask leaves rank 0 almost idle and rank P-1 with the most work; striping
  gives every rank the same work.
- :func:`ulysses_attention` (DeepSpeed-Ulysses, Jacobs et al. 2023): an all-to-all turns sequence
  shards into head shards (every rank then has the whole sequence for H/P heads), attention is
  local, a second all-to-all turns it back. P must divide the query and the KV heads.
- :func:`usp_attention` (USP, Fang & Zhao 2024): Ulysses inside groups of u ranks, ring across
  the P/u groups.
- :func:`ring_pass_q` (for decode, as in Meta's context-parallel inference): the KV cache stays
  put and the small query blocks travel; partial results go home with one all-to-all.
- :func:`balanced_schedule` simulates DistFlashAttn's load balancing of the causal ring: idle
  ranks take blocks of busy ones.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..attention import attention_with_lse
from ..device import setup_triton
from . import comm

setup_triton()  # before importing a kernel module (no-op with a GPU); we use its torch path
from ..kernels.merge_attention import merge_attention_states_reference as merge_states  # noqa: E402

LAYOUTS = ("contiguous", "striped")


# ---------------------------------------------------------------------------- shards and masks
def shard_positions(seq_len: int, world_size: int,
                    layout: str = "contiguous") -> list[torch.Tensor]:
    """Each rank's positions [ceil(T/P)], padded with -1. contiguous: rank r holds
    [r L, (r+1) L); striped: r, r+P, r+2P, ..."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not 1 <= world_size <= seq_len:
        raise ValueError(f"world_size must be in [1, seq_len={seq_len}] (every rank needs a "
                         f"token), got {world_size}")
    shard = math.ceil(seq_len / world_size)
    out = []
    for r in range(world_size):
        pos = (torch.arange(r * shard, (r + 1) * shard) if layout == "contiguous"
               else torch.arange(r, shard * world_size, world_size))
        out.append(torch.where(pos < seq_len, pos, -1))
    return out


def take(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows ``positions`` of x [B, H, T, D] along T (zeros where the position is -1)."""
    out = x[:, :, positions.clamp_min(0)]
    return out * (positions >= 0).to(x.dtype)[:, None]


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> torch.Tensor:
    """[Tq, Tk] bool: key j is real and (if causal) not after query i."""
    mask = (k_pos >= 0)[None, :].expand(q_pos.shape[0], -1)
    return mask & (k_pos[None, :] <= q_pos[:, None]) if causal else mask


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                     k_pos: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B, H, Tq, D] over k, v [B, Hkv, Tk, D] (GQA) under the position mask
    :func:`visible`: :func:`minillm.attention.attention_with_lse` with positions for the mask.

    Returns (out [B, H, Tq, D] in q's dtype, lse [B, H, Tq] fp32, fp64 for fp64 q). Rows with
    no visible key give out 0 and lse -inf, which the merge rule ignores.
    """
    return attention_with_lse(q, k, v, visible(q_pos, k_pos, causal))


def pairs(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> int:
    """(query, key) pairs a block computes: the work of one attention block."""
    return int((visible(q_pos, k_pos, causal) & (q_pos >= 0)[:, None]).sum())


# ------------------------------------------------------------------------------------ ring
def _ring_exchange(tensors: list[torch.Tensor], group, tag: str) -> tuple[list, list]:
    """Start sending ``tensors`` to the next rank and receiving the previous rank's."""
    rank, p = comm.world(group)
    nxt, prv = _global((rank + 1) % p, group), _global((rank - 1) % p, group)
    bufs = [torch.empty_like(t) for t in tensors]
    works = []
    for t, buf in zip(tensors, bufs):
        works.append(dist.isend(t.contiguous(), nxt, group=group))
        works.append(dist.irecv(buf, prv, group=group))
        comm.log_p2p("send", t, tag)
    return bufs, works


def _global(group_rank: int, group) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                   k_pos: torch.Tensor, causal: bool, group=None,
                   stats: dict | None = None) -> torch.Tensor:
    """Attention of the local queries over the keys of every rank, passing K/V round a ring.

    q [B, H, L, D], k/v [B, Hkv, L, D] and positions [L] are this rank's shard (the same L on
    every rank). Step s computes the block that started on rank (r - s) mod P while the next one
    is already in flight. Returns out [B, H, L, D]. ``stats`` (optional) receives "pairs" (the
    query-key pairs computed) and "blocks" (blocks with at least one visible pair).
    """
    _, p = comm.world(group)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    kv, pos = torch.stack([k, v]), k_pos
    work, blocks = 0, 0
    for step in range(p):
        if step < p - 1:  # overlap: the next block moves while this one is computed
            (next_kv, next_pos), works = _ring_exchange([kv, pos], group, f"ring step {step}")
        n = pairs(q_pos, pos, causal)
        if n:  # a block entirely in the future is skipped (causal)
            o, l = masked_attention(q, kv[0], kv[1], q_pos, pos, causal)
            out, lse = merge_states(out, lse, o, l)
            work, blocks = work + n, blocks + 1
        if step < p - 1:
            for w in works:
                w.wait()
            kv, pos = next_kv, next_pos
    if stats is not None:
        stats.update(pairs=work, blocks=blocks)
    return out


# --------------------------------------------------------------------------------- Ulysses
def check_ulysses(n_heads: int, n_kv_heads: int, world_size: int) -> None:
    """ValueError unless ``world_size`` ranks can each take whole query and KV heads."""
    if n_heads % world_size or n_kv_heads % world_size:
        raise ValueError(
            f"Ulysses gives each rank whole heads: world_size must divide n_heads={n_heads} "
            f"and n_kv_heads={n_kv_heads}, got {world_size}"
            + (f" (more ranks than KV heads: use ring attention, or USP with a Ulysses degree "
               f"that divides {n_kv_heads})" if world_size > n_kv_heads else ""))


def seq_to_heads(x: torch.Tensor, group=None, tag: str = "") -> torch.Tensor:
    """All-to-all: x [B, H, L, D] (all heads, my L tokens) -> [B, H/P, P L, D] (my heads, every
    rank's tokens in rank order)."""
    _, p = comm.world(group)
    b, h, l, d = x.shape
    chunks = x.reshape(b, p, h // p, l, d).transpose(0, 1).contiguous()  # [P, B, H/P, L, D]
    got = comm.all_to_all(chunks, [1] * p, [1] * p, group, tag)          # [P(src), B, H/P, L, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // p, p * l, d)


def heads_to_seq(x: torch.Tensor, group=None, tag: str = "") -> torch.Tensor:
    """The inverse all-to-all: [B, H/P, P L, D] -> [B, H, L, D]."""
    _, p = comm.world(group)
    b, hp, pl, d = x.shape
    chunks = x.reshape(b, hp, p, pl // p, d).permute(2, 0, 1, 3, 4).contiguous()
    got = comm.all_to_all(chunks, [1] * p, [1] * p, group, tag)          # [P(src), B, H/P, L, D]
    return got.transpose(0, 1).reshape(b, p * hp, pl // p, d)


def gather_positions(pos: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's positions [L] -> [P L] in rank order."""
    _, p = comm.world(group)
    parts = [torch.empty_like(pos) for _ in range(p)]
    dist.all_gather(parts, pos, group=group)
    return torch.cat(parts)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                      causal: bool, group=None) -> torch.Tensor:
    """DeepSpeed-Ulysses: q [B, H, L, D], k/v [B, Hkv, L, D], pos [L] (my shard) -> out
    [B, H, L, D]. Four all-to-alls (q, k, v in, out back) and a local attention."""
    _, p = comm.world(group)
    check_ulysses(q.shape[1], k.shape[1], p)
    all_pos = gather_positions(pos, group)
    qh, kh, vh = (seq_to_heads(t, group, f"ulysses {n}") for t, n in ((q, "q"), (k, "k"),
                                                                         (v, "v")))
    out, _ = masked_attention(qh, kh, vh, all_pos, all_pos, causal)
    return heads_to_seq(out, group, "ulysses out")


# ------------------------------------------------------------------------------------- USP
def usp_groups(ulysses_degree: int) -> tuple[object, object]:
    """(my Ulysses group, my ring group) for ``ulysses_degree`` u: Ulysses groups are runs of u
    consecutive ranks, ring groups the ranks at the same place in each run. Call on every rank."""
    rank, p = comm.world()
    if ulysses_degree < 1 or p % ulysses_degree:
        raise ValueError(f"ulysses_degree must divide world_size={p}, got {ulysses_degree}")
    u = ulysses_degree
    mine = [None, None]
    for g in range(p // u):  # every rank must create every group, in the same order
        grp = dist.new_group(list(range(g * u, (g + 1) * u)))
        if rank // u == g:
            mine[0] = grp
    for i in range(u):
        grp = dist.new_group(list(range(i, p, u)))
        if rank % u == i:
            mine[1] = grp
    return mine[0], mine[1]


def usp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                  causal: bool, ulysses_group, ring_group, stats: dict | None = None
                  ) -> torch.Tensor:
    """Unified sequence parallelism: Ulysses all-to-all inside ``ulysses_group`` (to H/u heads of
    u shards), ring attention across ``ring_group`` on those heads, all-to-all back."""
    _, u = comm.world(ulysses_group)
    check_ulysses(q.shape[1], k.shape[1], u)
    all_pos = gather_positions(pos, ulysses_group)
    qh, kh, vh = (seq_to_heads(t, ulysses_group, f"usp ulysses {n}")
                  for t, n in ((q, "q"), (k, "k"), (v, "v")))
    out = ring_attention(qh, kh, vh, all_pos, all_pos, causal, ring_group, stats)
    return heads_to_seq(out, ulysses_group, "usp ulysses out")


# -------------------------------------------------------------------------------- pass-Q
def ring_pass_q(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                k_pos: torch.Tensor, group=None) -> torch.Tensor:
    """Decode-time context parallelism: the KV cache k/v [B, Hkv, Lk, D] stays on its rank and
    the queries q [B, H, Lq, D] (same Lq everywhere) travel round the ring. Each rank computes
    the partial (out, lse) of every visiting query block against its cache; one all-to-all sends
    the partials home, where they are merged. Causal by position. Returns out [B, H, Lq, D]."""
    rank, p = comm.world(group)
    partial_out = [None] * p
    partial_lse = [None] * p
    cur, cur_pos = q, q_pos
    for step in range(p):
        origin = (rank - step) % p
        if step < p - 1:
            (nxt, nxt_pos), works = _ring_exchange([cur, cur_pos], group, f"pass-q step {step}")
        partial_out[origin], partial_lse[origin] = masked_attention(cur, k, v, cur_pos, k_pos,
                                                                    True)
        if step < p - 1:
            for w in works:
                w.wait()
            cur, cur_pos = nxt, nxt_pos
    outs = comm.all_to_all(torch.stack(partial_out), [1] * p, [1] * p, group, "pass-q out")
    lses = comm.all_to_all(torch.stack(partial_lse), [1] * p, [1] * p, group, "pass-q lse")
    out, lse = outs[0], lses[0]
    for i in range(1, p):
        out, lse = merge_states(out, lse, outs[i], lses[i])
    return out


# -------------------------------------------------------------------------- work and bytes
def rank_work(seq_len: int, world_size: int, layout: str, causal: bool = True) -> list[int]:
    """Query-key pairs each rank computes in ring attention (the sum over its blocks)."""
    pos = shard_positions(seq_len, world_size, layout)
    return [sum(pairs(pos[r], pos[j], causal) for j in range(world_size))
            for r in range(world_size)]


def ring_bytes(seq_len: int, world_size: int, n_kv_heads: int, head_dim: int, batch: int = 1,
               bytes_per_elem: int = 4) -> int:
    """Bytes one rank sends in ring attention: P-1 K and V blocks of ceil(T/P) tokens (plus
    their positions, 8 bytes each)."""
    shard = math.ceil(seq_len / world_size)
    kv = 2 * batch * n_kv_heads * shard * head_dim * bytes_per_elem
    return (world_size - 1) * (kv + 8 * shard)


def ulysses_bytes(seq_len: int, world_size: int, n_heads: int, n_kv_heads: int, head_dim: int,
                  batch: int = 1, bytes_per_elem: int = 4) -> int:
    """Bytes one rank sends in Ulysses: (P-1)/P of its q, k, v and output shards."""
    shard = math.ceil(seq_len / world_size)
    per_head = batch * shard * head_dim * bytes_per_elem
    return (world_size - 1) * (2 * n_heads + 2 * n_kv_heads) * per_head // world_size


# ---------------------------------------------------------------- DistFlashAttn simulation
def balanced_schedule(world_size: int, balance: bool) -> list[list[str | None]]:
    """Simulate the causal ring on P ranks, one attention block per rank per step.

    Block (i, j) is query shard i against KV shard j <= i; rank i owns it. Without balancing
    rank i computes its own i + 1 blocks and then idles. With balancing (DistFlashAttn, Li et
    al. 2023) a rank with nothing left takes a pending block (i, j) of a busier rank, which it
    can compute when it holds KV shard j (its own, j = rank), receiving q_i and sending the
    partial result back. Returns grid[step][rank] = "q{i}k{j}" or None (idle).
    """
    pending = {i: [(i, j) for j in range(i, -1, -1)] for i in range(world_size)}
    grid = []
    while any(pending.values()):
        row: list[str | None] = [None] * world_size
        for r in range(world_size):
            if pending[r]:
                i, j = pending[r].pop(0)
                row[r] = f"q{i}k{j}"
        if balance:
            for r in range(world_size):
                if row[r] is None:
                    owners = [i for i in range(world_size)
                              if (i, r) in pending[i] and len(pending[i]) > 0]
                    if owners:
                        i = max(owners, key=lambda o: len(pending[o]))
                        pending[i].remove((i, r))
                        row[r] = f"q{i}k{r}"
        grid.append(row)
    return grid
