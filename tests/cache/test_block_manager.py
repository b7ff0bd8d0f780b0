"""BlockManager: allocation, reference counts, copy-on-write, swap; invariants under random use."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from properties import examples

from minillm.attention.paged import write_kv
from minillm.cache.block_manager import BlockManager, NoFreeBlocksError, blocks_for
from minillm.cache.pool import PagedKVPool
from minillm.config import get_preset


def test_allocate_grow_free():
    bm = BlockManager(8, block_size=4, watermark=0)
    bm.allocate(1, 5)                       # 2 blocks
    assert len(bm.tables[1]) == 2 and bm.num_free == 6
    assert bm.reserve(1, 8) == [] and len(bm.tables[1]) == 2   # still fits
    bm.reserve(1, 9)
    assert len(bm.tables[1]) == 3
    bm.free(1)
    assert bm.num_free == 8 and not bm.tables
    bm.check()


def test_fork_shares_then_copy_on_write_of_partial_last_block():
    bm = BlockManager(8, block_size=4, watermark=0)
    bm.allocate(1, 6)                       # blocks [a, b], b half full
    bm.fork(1, 2)
    a, b = bm.tables[1]
    assert bm.tables[2] == [a, b] and bm.device.ref[a] == bm.device.ref[b] == 2
    copies = bm.reserve(2, 7)               # child writes slot 6 in shared block b
    assert len(copies) == 1 and copies[0][0] == b
    new = copies[0][1]
    assert bm.tables[2] == [a, new] and bm.tables[1] == [a, b]
    assert bm.device.ref[b] == 1 and bm.device.ref[a] == 2
    assert bm.reserve(1, 7) == []           # the parent now owns b alone: no copy
    bm.check()


def test_fork_at_block_boundary_needs_no_copy():
    bm = BlockManager(8, block_size=4, watermark=0)
    bm.allocate(1, 8)
    bm.fork(1, 2)
    assert bm.reserve(2, 9) == [] and bm.reserve(1, 9) == []
    assert bm.tables[1][:2] == bm.tables[2][:2] and bm.tables[1][2] != bm.tables[2][2]
    bm.check()


def test_watermark_and_reservation():
    bm = BlockManager(100, block_size=16, watermark=0.1)
    assert bm.can_allocate(16 * 90) and not bm.can_allocate(16 * 91)
    bm.allocate(1, 10, reserve_tokens=100)  # Orca-style: room for 100 tokens up front
    assert len(bm.tables[1]) == blocks_for(100, 16) and bm.filled[1] == 10
    assert bm.slots_in_use() == 10
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(2, 16 * 100)
    bm.check()


def test_swap_out_and_in_keep_sharing():
    bm = BlockManager(8, block_size=4, num_cpu_blocks=8, watermark=0)
    bm.allocate(1, 6)
    bm.fork(1, 2)
    pairs = bm.swap_out([1, 2])
    assert len(pairs) == 2 and bm.num_free == 8          # shared blocks moved once
    assert bm.cpu_tables[1] == bm.cpu_tables[2]
    back = bm.swap_in([1, 2])
    assert len(back) == 2 and bm.tables[1] == bm.tables[2] and bm.cpu.num_free == 8
    bm.check()


def test_truncate_inside_a_shared_block_of_a_full_pool_takes_no_block():
    """Hypothesis' example: the pool is full, a forked sequence truncates inside the block it
    shares. Truncating only forgets slots; the next write copies the block, and that copy is
    what ``blocks_to_reserve`` counts (so the scheduler sees it before it happens)."""
    bm = BlockManager(24, block_size=4, num_cpu_blocks=12, watermark=0)
    for i in range(14):
        bm.allocate(i, 1)
    bm.allocate(14, 37)                     # 10 blocks: the pool is full
    bm.reserve(14, 37)
    bm.fork(14, 15)
    assert bm.num_free == 0
    bm.truncate(15, 1)                      # inside block 0, shared with sequence 14
    bm.check()
    assert bm.num_free == 0 and bm.tables[15] == bm.tables[14][:1]   # all still shared
    assert bm.blocks_to_reserve(15, 2) == 1           # its next write needs a copy
    bm.free(0)
    (src, dst), = bm.reserve(15, 2)
    assert src == bm.tables[14][0] and bm.tables[15] == [dst]
    bm.check()


def test_truncate_keeps_what_other_readers_of_a_block_use():
    bm = BlockManager(8, block_size=4, watermark=0)
    bm.allocate(1, 7)                       # blocks [a, b], b holds 3 slots
    bm.fork(1, 2)
    bm.truncate(2, 5)                       # 2 forgets a slot of b; 1 still reads it
    assert bm.fill[bm.tables[1][1]] == 3 and bm.slots_in_use() == 7
    bm.truncate(1, 5)                       # now nobody reads it
    assert bm.fill[bm.tables[1][1]] == 1 and bm.slots_in_use() == 5
    bm.check()
    with pytest.raises(ValueError, match="num_tokens"):
        bm.truncate(1, 6)



# ---- copy-on-write with the K/V it protects ------------------------------------------------
def _slots(bm: BlockManager, seq: int, positions: range) -> torch.Tensor:
    table = bm.tables[seq]
    return torch.tensor([table[i // bm.block_size] * bm.block_size + i % bm.block_size
                         for i in positions])


def _write(pool: PagedKVPool, bm: BlockManager, seq: int, start: int, kv: torch.Tensor) -> None:
    """Grow ``seq`` to ``start + len(kv)`` tokens (performing the copies ``reserve`` returns,
    as the runner does) and write kv [N, 2, layers, Hkv, D] at positions start.. of it."""
    pool.copy_blocks(bm.reserve(seq, start + len(kv)))
    slots = _slots(bm, seq, range(start, start + len(kv)))
    for layer in range(pool.k.shape[0]):
        write_kv(pool.k[layer], pool.v[layer], kv[:, 0, layer], kv[:, 1, layer], slots)


def _read(pool: PagedKVPool, bm: BlockManager, seq: int) -> torch.Tensor:
    """The sequence's K/V as [filled, 2, layers, Hkv, D], read through its block table."""
    slots = _slots(bm, seq, range(bm.filled[seq]))
    k, v = (x.flatten(1, 2)[:, slots] for x in (pool.k, pool.v))      # [layers, N, Hkv, D]
    return torch.stack([k, v]).permute(2, 0, 1, 3, 4)


@pytest.mark.parametrize("cut", [1, 4, 5, 6])
def test_truncating_a_fork_then_writing_leaves_the_parents_kv_alone(cut):
    """A parent's 7 tokens (blocks of 4) are forked; the child truncates to ``cut`` tokens
    (inside or at the end of a shared block), then writes 5 new tokens through ``reserve``'s
    copies into a real pool, and the parent writes 2 more. Read back through the tables, each
    sequence holds exactly its own tokens' K/V: a plain list per sequence is the reference."""
    cfg = get_preset("tiny")
    pool = PagedKVPool(cfg, 10, 4, torch.device("cpu"), torch.float32)
    bm = BlockManager(10, block_size=4, watermark=0)
    g = torch.Generator().manual_seed(cut)

    def new_kv(n: int) -> torch.Tensor:
        return torch.randn(n, 2, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, generator=g)

    parent = new_kv(7)
    bm.allocate(1, 0)
    _write(pool, bm, 1, 0, parent)
    bm.fork(1, 2)
    bm.truncate(2, cut)
    child = torch.cat([parent[:cut], new_kv(5)])
    _write(pool, bm, 2, cut, child[cut:])
    more = new_kv(2)
    _write(pool, bm, 1, 7, more)
    bm.check()
    assert torch.equal(_read(pool, bm, 1), torch.cat([parent, more])), "the parent's K/V"
    assert torch.equal(_read(pool, bm, 2), child), "the child's K/V"
    shared = [b for b in bm.tables[2] if b in bm.tables[1]]
    assert shared == bm.tables[1][:cut // 4]      # only whole blocks both still read


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0)
    with pytest.raises(ValueError, match="watermark"):
        BlockManager(4, watermark=1.5)
    bm = BlockManager(4)
    bm.allocate(1, 1)
    with pytest.raises(ValueError, match="already"):
        bm.allocate(1, 1)


OPS = st.lists(st.tuples(st.sampled_from(["alloc", "append", "fork", "free", "swap", "trunc"]),
                         st.integers(0, 7), st.integers(1, 40)), max_size=60)


@settings(max_examples=examples(200))
@given(OPS)
def test_invariants_under_random_operations(ops):
    """Any sequence of operations keeps reference counts, free list and tables consistent, and
    freeing everything returns every block."""
    bm = BlockManager(24, block_size=4, num_cpu_blocks=12, watermark=0)
    live: set[int] = set()
    next_id = 100
    for op, i, n in ops:
        ids = sorted(live)
        seq = ids[i % len(ids)] if ids else None
        if op == "alloc" and bm.can_allocate(n):
            bm.allocate(next_id, n)
            live.add(next_id)
            next_id += 1
        elif seq is None or seq in bm.cpu_tables and op != "swap" and op != "free":
            continue
        elif op == "append":
            target = bm.filled[seq] + n % 6
            if bm.blocks_to_reserve(seq, target) <= bm.num_free:
                for src, dst in bm.reserve(seq, target):
                    assert src != dst and bm.device.ref[dst] == 1
        elif op == "fork":
            bm.fork(seq, next_id)
            live.add(next_id)
            next_id += 1
        elif op == "free":
            bm.free(seq)
            live.discard(seq)
        elif op == "swap":
            if seq in bm.cpu_tables and bm.can_swap_in([seq]):
                bm.swap_in([seq])
            elif seq in bm.tables and bm.can_swap_out([seq]):
                bm.swap_out([seq])
        elif op == "trunc":
            free = bm.num_free
            bm.truncate(seq, min(bm.filled[seq], n))
            assert bm.num_free >= free          # forgetting never takes a block
        bm.check()
    for seq in list(live):
        bm.free(seq)
    bm.check()
    assert bm.num_free == 24 and bm.cpu.num_free == 12
