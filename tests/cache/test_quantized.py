"""QuantizedKVCache against the plain contiguous cache and the formats' own arithmetic."""
from __future__ import annotations

import torch

from minillm.attention.kv_quant import dequantize_int8, quantize_int8
from minillm.cache import KVCache, QuantizedKVCache


def test_what_attention_reads_is_the_stored_format_read_back(tiny):
    cfg = tiny[0].cfg
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(2, cfg.n_kv_heads, t, cfg.head_dim, generator=g) for t in (5, 1, 3)]
    caches = {kv: QuantizedKVCache(cfg, 2, 9, kv_dtype=kv) for kv in ("float32", "bfloat16",
                                                                      "int8")}
    plain = KVCache(cfg, 2, 9)
    for x in chunks:
        want = plain.update(1, x, -x)
        for kv, cache in caches.items():
            k, v = cache.update(1, x, -x)
            assert k.dtype == v.dtype == torch.float32
            if kv == "float32":
                assert torch.equal(k, want[0]) and torch.equal(v, want[1])
            elif kv == "bfloat16":
                assert torch.equal(k, want[0].bfloat16().float())
            else:
                assert torch.equal(k, dequantize_int8(*quantize_int8(want[0]), torch.float32))
                assert torch.equal(v, dequantize_int8(*quantize_int8(want[1]), torch.float32))
        for cache in (plain, *caches.values()):
            cache.advance(x.shape[2])
    assert caches["int8"].nbytes() < caches["bfloat16"].nbytes() < caches["float32"].nbytes()
