"""KV caches (core), behind one interface (:class:`Cache`): the contiguous one (and
``QuantizedKVCache``, which stores K/V as int8 or a narrower float), bounded ones
(sliding window, attention sinks, H2O), and for the serving engine the block manager (pure
Python: block tables, reference counts, copy-on-write, swap, holds), the paged KV pool
(``pool``) and the prefix caches it can keep blocks in (``prefix``: hashed blocks; ``radix``:
SGLang's radix tree)."""
from .base import Cache
from .bounded import H2OCache, SinkCache, SlidingWindowCache
from .contiguous import KVCache
from .prefix import HashPrefixCache
from .quantized import QuantizedKVCache
from .radix import RadixPrefixCache, TokenRadixTree

__all__ = ["Cache", "H2OCache", "HashPrefixCache", "KVCache", "QuantizedKVCache",
           "RadixPrefixCache", "SinkCache",
           "SlidingWindowCache", "TokenRadixTree"]
