"""KV caches: the contiguous one, and (in bounded.py) caches that keep a bounded number of tokens."""
from .base import Cache
from .contiguous import KVCache

__all__ = ["Cache", "KVCache"]
