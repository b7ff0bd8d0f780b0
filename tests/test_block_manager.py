"""BlockManager: allocation, reference counts, copy-on-write, swap; invariants under random use."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.cache.block_manager import BlockManager, NoFreeBlocksError, blocks_for


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


@settings(max_examples=200, deadline=None)
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
            bm.truncate(seq, min(bm.filled[seq], n))
        bm.check()
    for seq in list(live):
        bm.free(seq)
    bm.check()
    assert bm.num_free == 24 and bm.cpu.num_free == 12
