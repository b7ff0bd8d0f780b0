"""KV caches: the contiguous one, and (in bounded.py) bounded ones: window, sinks, H2O."""
from .base import Cache
from .bounded import H2OCache, SinkCache, SlidingWindowCache
from .contiguous import KVCache

__all__ = ["Cache", "H2OCache", "KVCache", "SinkCache", "SlidingWindowCache"]
