"""Prefix caching with hashed full blocks (vLLM's automatic prefix caching). Pure Python.

A full block's key is ``hash((parent key, its block_size tokens))``: it names the block's tokens
*and everything before them*, so equal tokens under another prefix never share a key. The cache
maps keys to the physical block that holds their KV. A cached block that no sequence references
stays in the pool, evictable; the block manager takes such blocks back (least recently used
first) only when its free list is empty. :class:`minillm.cache.radix.RadixPrefixCache` offers
the same interface over a radix tree (SGLang's RadixAttention).

The interface the block manager uses is :class:`PrefixCache`; ``EngineConfig(prefix_cache=...)``
takes the name of one of these two or a factory of any other (a student's).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

PREFIX_CACHE_MEMBERS = ("block_size", "match", "insert", "acquire", "release", "evict",
                        "num_evictable", "__contains__")


class PrefixCache(Protocol):
    """Which physical KV blocks hold which prefixes: the block manager's prefix cache.

    Only whole blocks are cached. Block i of a token list covers its tokens
    [i * block_size, (i + 1) * block_size), and its key is *all* tokens up to the block's end
    (the block's KV depends on every earlier token), so equal tokens under another prefix are a
    different key. A block id is cached under at most one key at a time.

    A cached block is *referenced* while some sequence's block table holds it, else *idle*:
    it keeps its KV, and the pool counts it as free, taking it back through ``evict`` only when
    its free list is empty. The block manager calls:

    - ``match(token_ids) -> list[int]``: the blocks of the longest run of cached whole blocks
      at the start of ``token_ids``: entry i holds block i's KV, so there are at most
      ``len(token_ids) // block_size``, each cached, none repeated. Marks them used (LRU);
      does not change whether they are referenced (the caller ``acquire`` s those it keeps).
    - ``insert(token_ids, blocks) -> list[int]``: ``blocks[i]`` now holds the KV of block i of
      ``token_ids`` (``len(token_ids) >= len(blocks) * block_size``). A key already cached
      keeps its block; returns the blocks newly registered, which count as referenced (the
      caller holds them). ValueError if a block is already cached under another key.
    - ``acquire(block)``: a cached, idle block gained a reader: it is referenced, never
      evicted until released.
    - ``release(block)``: a cached block lost its last reader: idle now, evictable.
    - ``evict() -> int | None``: forget one idle block and return it (it is no longer cached;
      the caller reuses it), least recently used first (a cache may restrict which idle blocks
      go first: the radix tree takes leaves only, so every cached block stays reachable); None
      when none can go. Never a referenced block.
    - ``num_evictable``: how many blocks repeated ``evict`` calls would return now (the pool
      counts them as free).
    - ``block in cache``: whether ``block`` is cached.

    ``block_size`` is the engine's: each engine builds its own cache (``EngineConfig``'s
    ``prefix_cache`` is a name or a factory ``block_size -> cache``).
    """

    block_size: int

    def match(self, token_ids: Sequence[int]) -> list[int]: ...

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int]) -> list[int]: ...

    def acquire(self, block: int) -> None: ...

    def release(self, block: int) -> None: ...

    def evict(self) -> int | None: ...

    @property
    def num_evictable(self) -> int: ...

    def __contains__(self, block: int) -> bool: ...


PrefixCacheFactory = Callable[[int], PrefixCache]


class PrefixCacheError(ValueError):
    """A prefix cache answered against the :class:`PrefixCache` contract."""


def check_match(cache: PrefixCache, hit: Sequence[int], whole_blocks: int,
                num_blocks: int) -> None:
    """PrefixCacheError naming ``prefix_cache`` and the broken rule unless ``hit``, what
    ``cache.match`` returned for tokens of ``whole_blocks`` whole blocks, is at most that many
    distinct cached block ids of a ``num_blocks``-block pool."""
    name = type(cache).__name__
    if len(hit) > whole_blocks:
        raise PrefixCacheError(f"prefix_cache: {name}.match returned {len(hit)} blocks for "
                               f"tokens that fill {whole_blocks} whole blocks; it may return at "
                               f"most one block per whole block of the tokens it is given")
    for block in hit:
        if not isinstance(block, int) or not 0 <= block < num_blocks:
            raise PrefixCacheError(f"prefix_cache: {name}.match returned {block!r}, not a "
                                   f"block id of this pool (an int in [0, {num_blocks}))")
        if block not in cache:
            raise PrefixCacheError(f"prefix_cache: {name}.match returned block {block}, which "
                                   f"is not cached (`{block} in cache` is False); match may "
                                   f"return only cached blocks")
    if len(set(hit)) != len(hit):
        raise PrefixCacheError(f"prefix_cache: {name}.match returned a block twice "
                               f"({list(hit)}); each block holds one block of the prefix")


def check_prefix_cache(cache: object, block_size: int) -> PrefixCache:
    """``cache`` if it implements :class:`PrefixCache` for ``block_size``-token blocks, else
    ValueError naming ``prefix_cache`` and what is missing or wrong."""
    missing = [m for m in PREFIX_CACHE_MEMBERS if not hasattr(cache, m)]
    if missing:
        raise ValueError(f"prefix_cache: the factory built a {type(cache).__name__}, which does "
                         f"not implement PrefixCache: it lacks {', '.join(missing)}")
    if cache.block_size != block_size:
        raise ValueError(f"prefix_cache: the factory built a cache for block_size="
                         f"{cache.block_size!r}, but the engine's blocks hold {block_size} "
                         f"tokens")
    return cache                                    # type: ignore[return-value]


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
