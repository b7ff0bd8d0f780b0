"""Prefix caching with hashed full blocks (vLLM's automatic prefix caching). Pure Python.

A full block's key is ``hash((parent key, its block_size tokens))``: it names the block's tokens
*and everything before them*, so equal tokens under another prefix never share a key. The cache
maps keys to the physical block that holds their KV. A cached block that no sequence references
stays in the pool, evictable; the block manager takes such blocks back (least recently used
first) only when its free list is empty. :class:`minillm.cache.radix.RadixPrefixCache` offers
the same interface over a radix tree (SGLang's RadixAttention).

The interface the block manager uses: ``match`` (blocks of the longest cached run of whole
blocks at the start of some tokens), ``insert`` (register computed full blocks), ``acquire`` /
``release`` (a block gains its first reader / loses its last), ``evict``, ``num_evictable``.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence


class HashPrefixCache:
    """Full blocks keyed by a hash chain over their tokens."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.block_of: dict[int, int] = {}        # key -> block
        self.key_of: dict[int, int] = {}          # block -> key
        self.idle: OrderedDict[int, None] = OrderedDict()   # unreferenced cached blocks, LRU

    def keys(self, token_ids: Sequence[int]) -> Iterator[int]:
        """The key of every whole block of ``token_ids``, in order (each covers its prefix)."""
        key, bs = 0, self.block_size
        for i in range(len(token_ids) // bs):
            key = hash((key, tuple(token_ids[i * bs:(i + 1) * bs])))
            yield key

    def match(self, token_ids: Sequence[int]) -> list[int]:
        blocks = []
        for key in self.keys(token_ids):
            block = self.block_of.get(key)
            if block is None:
                break
            blocks.append(block)
            if block in self.idle:
                self.idle.move_to_end(block)
        return blocks

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int]) -> list[int]:
        if len(token_ids) < len(blocks) * self.block_size:
            raise ValueError(f"token_ids must cover the {len(blocks)} blocks "
                             f"({len(blocks) * self.block_size} tokens), got {len(token_ids)}")
        added = []
        for key, block in zip(self.keys(token_ids), blocks):
            if key in self.block_of:
                continue                       # cached already (maybe by this very block)
            if block in self.key_of:
                raise ValueError(f"blocks: block {block} is cached for other tokens")
            self.block_of[key], self.key_of[block] = block, key
            added.append(block)
        return added

    def acquire(self, block: int) -> None:
        self.idle.pop(block, None)

    def release(self, block: int) -> None:
        if block not in self.key_of:
            raise ValueError(f"block {block} is not cached")
        self.idle[block] = None

    def evict(self) -> int | None:
        if not self.idle:
            return None
        block, _ = self.idle.popitem(last=False)
        del self.block_of[self.key_of.pop(block)]
        return block

    def __contains__(self, block: int) -> bool:
        return block in self.key_of

    @property
    def num_evictable(self) -> int:
        return len(self.idle)

    @property
    def num_cached(self) -> int:
        return len(self.key_of)
