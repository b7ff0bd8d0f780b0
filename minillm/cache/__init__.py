"""KV caches (core), behind one interface (:class:`Cache`): the contiguous one, bounded ones
(sliding window, attention sinks, H2O), and for the serving engine the block manager (pure
Python: block tables, reference counts, copy-on-write, swap) and the paged KV pool (``pool``)."""
from .base import Cache
from .bounded import H2OCache, SinkCache, SlidingWindowCache
from .contiguous import KVCache

__all__ = ["Cache", "H2OCache", "KVCache", "SinkCache", "SlidingWindowCache"]
