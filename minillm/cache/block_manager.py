"""Which physical KV block holds which tokens (PagedAttention, Kwon et al. 2023). Pure Python.

The device pool (:mod:`minillm.cache.pool`) is an array of ``num_blocks`` blocks of
``block_size`` token slots. The block manager only does the bookkeeping:

- a *block table* per sequence: logical block i (positions i*block_size ...) -> physical block id;
- *reference counts*: a block shared by several tables (a forked prompt for parallel sampling or
  beam search) is freed when its last reader lets go;
- *copy-on-write*: before a sequence writes into a shared block, it gets its own copy; the copy
  (src, dst) is returned for the model runner to perform on the device;
- *swap*: a sequence's blocks can move to a second, CPU-side pool and back;
- a *watermark* of blocks kept free when admitting new sequences, so that running sequences can
  still grow for a while without preemption (vLLM keeps 1% by default);
- *holds*: a held sequence's blocks outlive ``free`` (kept under the key ``~seq_id``) until
  ``release``: a disaggregated prefill keeps a prompt's KV until the decode side has pulled it.

Invariants (``check``): a block's reference count equals the number of tables holding it; a block
is on the free list exactly when its count is 0; every table holds at least
``ceil(filled / block_size)`` blocks, where ``filled`` counts the sequence's token slots; the
slots of a block in use are the most that any table holding it uses (writes into a shared block
copy it first; a truncation only forgets, which leaves the readers of a shared block using
different slots of it: a *ragged* block), kept as a running count.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from .block_pool import AllocatorError, BlockAllocator, BlockPool, NoFreeBlocksError


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Block tables for sequences (keyed by integer id) over a device pool and a CPU swap pool."""

    def __init__(self, num_blocks: int, block_size: int = 16, num_cpu_blocks: int = 0,
                 watermark: float = 0.01, prefix_cache=None,
                 allocator: str | Callable[[int], BlockAllocator] = "fifo") -> None:
        """``allocator``: the device pool's free list (:class:`BlockAllocator`)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.device = BlockPool(num_blocks, prefix_cache, allocator)
        self.prefix = prefix_cache                  # None: no prefix caching
        self.cached_blocks: dict[int, int] = {}     # seq id -> its leading blocks registered
        self.prefix_queried = self.prefix_hit = 0   # prompt tokens looked up / found
        self.cpu = BlockPool(num_cpu_blocks)
        self.watermark_blocks = int(watermark * num_blocks)
        self.tables: dict[int, list[int]] = {}      # seq id -> device block ids
        self.cpu_tables: dict[int, list[int]] = {}  # seq id -> CPU block ids (swapped out)
        self.filled: dict[int, int] = {}            # seq id -> token slots in use
        self.fill = [0] * num_blocks                # device block -> its slots holding K/V
        self.slots = 0                              # sum of fill: slots in use, O(1) to read
        self.holds: set[int] = set()                # seq ids whose blocks outlive free()
        self.ragged: set[int] = set()               # shared blocks whose readers use
        #                                             different slots (after a truncation)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.device.num_blocks

    @property
    def num_free(self) -> int:
        return self.device.num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def slots_in_use(self) -> int:
        """Token slots holding K/V in the device pool, a shared slot counted once (kept up to
        date as blocks fill and empty, so O(1))."""
        return self.slots

    def _slots_by_scan(self) -> int:
        """The same count from the tables (what ``check`` compares with)."""
        fill: dict[int, int] = {}
        for s, table in self.tables.items():
            n = self.filled[s]
            for i, block in enumerate(table):
                used = min(self.block_size, max(0, n - i * self.block_size))
                fill[block] = max(fill.get(block, 0), used)
        return sum(fill.values())

    def can_allocate(self, *num_tokens: int) -> bool:
        """Can new sequences of ``num_tokens[i]`` slots be admitted now (above the watermark)?"""
        need = sum(blocks_for(n, self.block_size) for n in num_tokens)
        return self.num_free - need >= self.watermark_blocks

    def blocks_to_reserve(self, seq_id: int, num_tokens: int) -> int:
        """New blocks ``reserve(seq_id, num_tokens)`` would take (growth plus copy-on-write)."""
        table, filled = self.tables[seq_id], self.filled[seq_id]
        grow = max(0, blocks_for(num_tokens, self.block_size) - len(table))
        return grow + len(self._shared_blocks_written(table, filled, num_tokens))

    # ---- prefix caching --------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Cached blocks holding the KV of the start of ``token_ids``: whole blocks only, and
        never the last token (its logits must be computed). A cache whose answer breaks the
        :class:`~.prefix.PrefixCache` contract raises :class:`~.prefix.PrefixCacheError`
        before any block is taken."""
        from .prefix import check_match

        if self.prefix is None:
            return []
        usable = (len(token_ids) - 1) // self.block_size * self.block_size
        hit = self.prefix.match(token_ids[:usable])
        check_match(self.prefix, hit, usable // self.block_size, self.num_blocks)
        return list(hit)

    def allocate_cached(self, seq_id: int, token_ids: list[int], num_tokens: int) -> int:
        """Like ``allocate(seq_id, num_tokens)``, but the blocks of the longest cached prefix of
        ``token_ids`` are shared, not new; returns how many tokens they cover (computed)."""
        if seq_id in self.tables or seq_id in self.cpu_tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        hit = self.match_prefix(token_ids)
        need = self._need(hit, num_tokens)
        if need > self.num_free:
            raise NoFreeBlocksError(f"need {need} blocks, {self.num_free} free")
        for block in hit:                   # first: a hit block must not be evicted below
            self.device.share(block)
        try:
            fresh = self.device.take_many(blocks_for(num_tokens, self.block_size) - len(hit))
        except AllocatorError:
            for block in hit:
                self.device.release(block)
            raise
        table = hit + fresh
        self.tables[seq_id] = table
        self.filled[seq_id] = max(num_tokens, len(hit) * self.block_size)
        self._fill_from(seq_id, 0)
        self.cached_blocks[seq_id] = len(hit)
        self.prefix_queried += len(token_ids)
        self.prefix_hit += len(hit) * self.block_size
        return len(hit) * self.block_size

    def cached_need(self, token_ids: list[int], num_tokens: int) -> int:
        """Free blocks ``allocate_cached`` would use: new ones, and the cached ones it reuses
        that nobody references (they stop being evictable)."""
        return self._need(self.match_prefix(token_ids), num_tokens)

    def _need(self, hit: list[int], num_tokens: int) -> int:
        idle = sum(self.device.ref[b] == 0 for b in hit)
        return max(0, blocks_for(num_tokens, self.block_size) - len(hit)) + idle

    def cache_computed(self, seq_id: int, token_ids: list[int], num_computed: int) -> None:
        """Register the sequence's full blocks whose ``num_computed`` tokens have K/V now."""
        if self.prefix is None or seq_id not in self.tables:
            return
        full = min(num_computed // self.block_size, len(self.tables[seq_id]))
        if full > self.cached_blocks.get(seq_id, 0):
            self.prefix.insert(token_ids[:full * self.block_size], self.tables[seq_id][:full])
            self.cached_blocks[seq_id] = full

    # ---- allocation ------------------------------------------------------------------------
    def allocate(self, seq_id: int, num_tokens: int, reserve_tokens: int | None = None) -> None:
        """A new table for ``num_tokens`` slots; ``reserve_tokens`` (>= num_tokens) allocates room
        for that many up front (Orca-style max-length reservation)."""
        if seq_id in self.tables or seq_id in self.cpu_tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        capacity = max(num_tokens, reserve_tokens or 0)
        need = blocks_for(capacity, self.block_size)
        if need > self.num_free:
            raise NoFreeBlocksError(f"need {need} blocks, {self.num_free} free")
        self.tables[seq_id] = self.device.take_many(need)
        self.filled[seq_id] = num_tokens
        self._fill_from(seq_id, 0)

    def reserve(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]]:
        """Make slots for ``num_tokens`` tokens in total (grow on demand). Returns the
        copy-on-write pairs (src, dst): shared blocks about to be written get a private copy."""
        if self.blocks_to_reserve(seq_id, num_tokens) > self.num_free:
            raise NoFreeBlocksError(f"sequence {seq_id} needs more blocks than are free")
        table, filled = self.tables[seq_id], self.filled[seq_id]
        written = list(self._shared_blocks_written(table, filled, num_tokens))
        fresh = self.device.take_many(     # a copy for each, then the growth: all or none
            len(written) + max(0, blocks_for(num_tokens, self.block_size) - len(table)))
        copies = []
        for i, dst in zip(written, fresh):
            src = table[i]
            table[i] = dst
            self._release(src)
            copies.append((src, dst))
        table += fresh[len(written):]
        self.filled[seq_id] = max(filled, num_tokens)
        self._fill_from(seq_id, filled // self.block_size)
        return copies

    def _used(self, num_tokens: int, i: int) -> int:
        """Slots of logical block i that ``num_tokens`` tokens fill."""
        return min(self.block_size, max(0, num_tokens - i * self.block_size))

    def _fill_from(self, seq_id: int, first: int) -> None:
        """Bring the fill of the sequence's blocks from logical block ``first`` on up to date
        (a block shared by several tables holds the longest of their prefixes)."""
        n = self.filled[seq_id]
        for i, block in enumerate(self.tables[seq_id][first:], start=first):
            self._set_fill(block, max(self.fill[block], self._used(n, i)))

    def _set_fill(self, block: int, n: int) -> None:
        self.slots += n - self.fill[block]
        self.fill[block] = n

    def _release(self, block: int) -> None:
        """Drop one reference to a device block (the caller has taken it out of the table);
        an unreferenced block holds nothing."""
        self.device.release(block)
        self._refill(block)

    def _refill(self, block: int) -> None:
        """Bring a block's fill up to date after a reader let go of it: 0 when nobody reads
        it; for a ragged block (readers using different slots), the most any reader uses."""
        if self.device.ref[block] == 0:
            self._set_fill(block, 0)
            self.ragged.discard(block)
        elif block in self.ragged:
            self._set_fill(block, self._fill_by_readers(block))
            if self.device.ref[block] == 1:
                self.ragged.discard(block)

    def _shared_blocks_written(self, table: list[int], filled: int, num_tokens: int) -> list[int]:
        """Logical indices of existing shared blocks that slots [filled, num_tokens) fall in."""
        if num_tokens <= filled:
            return []
        first, last = filled // self.block_size, (num_tokens - 1) // self.block_size
        return [i for i in range(first, min(last + 1, len(table))) if self.device.ref[table[i]] > 1]

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Forget slots past ``num_tokens`` (rolled-back tokens); whole blocks past it are freed.
        Never takes a block: a cut inside a block that other tables share leaves it shared
        (they still need the slots this sequence forgets), and this sequence's next write
        there gets its own copy from :meth:`reserve`, which the scheduler counts
        (:meth:`blocks_to_reserve`)."""
        table, filled = self.tables[seq_id], self.filled[seq_id]
        if not 0 <= num_tokens <= filled:
            raise ValueError(f"num_tokens must be in [0, {filled}], got {num_tokens}")
        keep = blocks_for(num_tokens, self.block_size)
        gone = table[keep:]
        del table[keep:]
        for block in gone:
            self._release(block)
        self.filled[seq_id] = num_tokens
        if keep and self._used(num_tokens, keep - 1) < self._used(filled, keep - 1):
            last = table[-1]
            if self.device.ref[last] > 1:      # its readers now use different slots of it
                self.ragged.add(last)
                self._set_fill(last, self._fill_by_readers(last))
            else:
                self._set_fill(last, self._used(num_tokens, keep - 1))

    def _fill_by_readers(self, block: int) -> int:
        """Slots of ``block`` in use: the most that any table holding it uses (a scan of the
        tables, done only for ragged blocks)."""
        return max((self._used(self.filled[s], i) for s, table in self.tables.items()
                    for i, b in enumerate(table) if b == block), default=0)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (reference counts go up, nothing copied)."""
        if child_id in self.tables or child_id in self.cpu_tables:
            raise ValueError(f"sequence {child_id} already has blocks")
        table = self.tables[parent_id]
        for block in table:
            self.device.share(block)
        self.tables[child_id] = list(table)
        self.filled[child_id] = self.filled[parent_id]
        self.cached_blocks[child_id] = self.cached_blocks.get(parent_id, 0)

    def hold(self, seq_id: int) -> None:
        """Keep the sequence's device blocks when it is freed, until ``release(seq_id)``."""
        self.holds.add(seq_id)

    def release(self, seq_id: int) -> None:
        """Free what a hold kept (and end the hold); unknown ids are ignored."""
        self.holds.discard(seq_id)
        self.free(~seq_id)

    def held_table(self, seq_id: int) -> list[int] | None:
        """The blocks a hold kept for a freed sequence (None if there are none)."""
        return self.tables.get(~seq_id)

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks (device or swapped); unknown ids are ignored. A held
        sequence's device table moves to ``~seq_id`` instead (replacing an older one)."""
        if seq_id in self.holds and seq_id in self.tables:
            self.free(~seq_id)
            self.tables[~seq_id] = self.tables.pop(seq_id)
            self.filled[~seq_id] = self.filled.pop(seq_id)
        for block in reversed(self.tables.pop(seq_id, [])):
            self._release(block)    # tail first: LRU then evicts a chain from its end (vLLM)
        for block in self.cpu_tables.pop(seq_id, []):
            self.cpu.release(block)
        self.filled.pop(seq_id, None)
        self.cached_blocks.pop(seq_id, None)

    # ---- swapping ---------------------------------------------------------------------------
    def can_swap_out(self, seq_ids: list[int]) -> bool:
        return len({b for s in seq_ids for b in self.tables[s]}) <= self.cpu.num_free

    def can_swap_in(self, seq_ids: list[int], extra: int = 0) -> bool:
        """Room above the watermark for the sequences' blocks plus ``extra`` more?"""
        need = extra + len({b for s in seq_ids for b in self.cpu_tables[s]})
        return self.num_free - need >= self.watermark_blocks

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move the sequences' blocks to the CPU pool. Returns (device block, CPU block) copies;
        a block shared inside the group is copied once and stays shared."""
        pairs = self._move(seq_ids, self.tables, self.cpu_tables, self.device, self.cpu)
        for block, _ in pairs:
            self._refill(block)
        return pairs

    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move swapped sequences back. Returns (CPU block, device block) copies."""
        pairs = self._move(seq_ids, self.cpu_tables, self.tables, self.cpu, self.device)
        for s in seq_ids:
            self._fill_from(s, 0)
        return pairs

    @staticmethod
    def _move(seq_ids, src_tables, dst_tables, src_pool: BlockPool, dst_pool: BlockPool):
        distinct = list(dict.fromkeys(b for s in seq_ids for b in src_tables[s]))
        mapping = dict(zip(distinct, dst_pool.take_many(len(distinct))))   # each once
        placed: set[int] = set()
        for s in seq_ids:
            table = src_tables.pop(s)
            for block in table:
                if block in placed:
                    dst_pool.share(mapping[block])
                placed.add(block)
                src_pool.release(block)
            dst_tables[s] = [mapping[b] for b in table]
        return list(mapping.items())

    # ---- invariants -------------------------------------------------------------------------
    def check(self) -> None:
        """Assert the invariants in the module docstring (tests call this)."""
        for pool, tables in ((self.device, self.tables), (self.cpu, self.cpu_tables)):
            counts = Counter(b for t in tables.values() for b in t)
            for block in range(pool.num_blocks):
                assert pool.ref[block] == counts.get(block, 0), f"block {block} refcount wrong"
            idle = [b for b in range(pool.num_blocks) if pool.ref[b] == 0]
            if pool.cache is not None:
                assert pool.cache.num_evictable == sum(b in pool.cache for b in idle)
                idle = [b for b in idle if b not in pool.cache]
            assert sorted(pool.free) == idle
        for s, n in self.filled.items():
            table = self.tables.get(s, self.cpu_tables.get(s))
            assert table is not None and len(table) >= blocks_for(n, self.block_size)
        assert self.slots == self._slots_by_scan() == sum(self.fill), "slot count wrong"
