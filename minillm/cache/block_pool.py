"""A pool's blocks: reference counts, the free list and the contract of a block allocator.

:class:`BlockPool` is what :class:`~.block_manager.BlockManager` keeps one of for the device and
one for the CPU swap space: each block's reference count, the free blocks (a
:class:`BlockAllocator`: which free block is handed out next) and, on the device, the prefix
cache whose unreferenced blocks wait there until evicted. Pure Python.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation needs more blocks than are free (callers check first)."""


class AllocatorError(RuntimeError):
    """A block allocator broke its contract (the message names it and the rule)."""


class BlockAllocator(Protocol):
    """Which free block is handed out next: a pool's free list. Built as ``cls(num_blocks)``
    with every block id 0..num_blocks-1 free. ``take`` removes and returns a free block (called
    only when ``len(self) > 0``); ``put`` makes a block free again; iterating gives the free
    ids in any order. The pool keeps the reference counts and checks every block ``take``
    returns (:class:`AllocatorError` for one out of range or in use)."""

    def take(self) -> int: ...

    def put(self, block: int) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[int]: ...


class FifoAllocator:
    """The least recently freed block first (vLLM's free block queue): a freed block's KV
    survives as long as possible, which a prefix cache can still use."""

    def __init__(self, num_blocks: int) -> None:
        self.free = deque(range(num_blocks))

    def take(self) -> int:
        return self.free.popleft()

    def put(self, block: int) -> None:
        self.free.append(block)

    def __len__(self) -> int:
        return len(self.free)

    def __iter__(self) -> Iterator[int]:
        return iter(self.free)


ALLOCATORS: dict[str, Callable[[int], BlockAllocator]] = {"fifo": FifoAllocator}


@dataclass
class BlockPool:
    """Reference counts of one pool of ``num_blocks`` blocks, its free list (``allocator``:
    a :class:`BlockAllocator` class or a name in :data:`ALLOCATORS`) and its prefix cache."""

    num_blocks: int
    cache: Any = None     # a prefix cache: its unreferenced blocks wait there, not on the list
    allocator: str | Callable[[int], BlockAllocator] = "fifo"
    ref: list[int] = field(init=False)
    free: BlockAllocator = field(init=False)

    def __post_init__(self) -> None:
        self.ref = [0] * self.num_blocks
        make = ALLOCATORS.get(self.allocator) if isinstance(self.allocator, str) \
            else self.allocator
        if make is None:
            raise ValueError(f"block_allocator must be one of {sorted(ALLOCATORS)} or a "
                             f"BlockAllocator class, got {self.allocator!r}")
        self.free = make(self.num_blocks)
        self.name = getattr(make, "__name__", type(self.free).__name__)

    def take(self) -> int:
        """A free block, else the least recently used unreferenced cached block."""
        if len(self.free):
            block = self._checked(self.free.take())
        elif self.cache is not None and (block := self.cache.evict()) is not None:
            pass
        else:
            raise NoFreeBlocksError(f"all {self.num_blocks} blocks are in use")
        self.ref[block] = 1
        return block

    def _checked(self, block: object) -> int:
        """``block`` if a free block id, else AllocatorError naming the allocator and rule."""
        rule = None
        if not isinstance(block, int) or isinstance(block, bool) or \
                not 0 <= block < self.num_blocks:
            rule = f"not a block id in [0, {self.num_blocks})"
        elif self.ref[block] or (self.cache is not None and block in self.cache):
            rule = f"in use ({self.ref[block]} readers)" if self.ref[block] else \
                "in use (a cached block)"
        if rule is not None:
            raise AllocatorError(f"block_allocator: {self.name}.take returned {block!r}, which "
                                 f"is {rule}: take must return a free block")
        return block

    def take_many(self, n: int) -> list[int]:
        """``n`` blocks, or none: on an AllocatorError those taken go back first."""
        taken: list[int] = []
        try:
            for _ in range(n):
                taken.append(self.take())
        except AllocatorError:
            for block in taken:
                self.release(block)
            raise
        return taken

    def share(self, block: int) -> None:
        if self.ref[block] == 0 and self.cache is not None:
            self.cache.acquire(block)        # a cached block gets a reader again
        self.ref[block] += 1

    def release(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            if self.cache is not None and block in self.cache:
                self.cache.release(block)    # kept with its KV until evicted
            else:
                self.free.put(block)

    @property
    def num_free(self) -> int:
        return len(self.free) + (self.cache.num_evictable if self.cache is not None else 0)
