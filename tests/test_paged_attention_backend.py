"""The engine's paged attention (sdpa backend) against the float64 reference of the kernels,
on shuffled physical blocks, mixed decode / prefill / prefill-over-a-cached-prefix batches."""
from __future__ import annotations

import pytest
import torch

from minillm.attention.paged import build_metadata, sdpa_paged_attention, write_kv
from minillm.device import setup_triton

setup_triton()  # before any kernel module is imported
from minillm.kernels.paged_attention import paged_prefill_reference  # noqa: E402


@pytest.mark.parametrize("hq,hkv,d,block_size", [(9, 3, 64, 16), (8, 8, 32, 4), (8, 1, 16, 7)])
def test_sdpa_paged_attention_matches_reference(hq, hkv, d, block_size):
    g = torch.Generator().manual_seed(hq * 100 + block_size)
    # (cached before this step, new tokens): decodes first, then prefills with and without prefix
    # 19 decode sequences: two decode groups (DECODE_GROUP = 16) of different padded widths
    decodes = [(int(n), 1) for n in torch.randint(0, 60, (19,), generator=g)]
    shapes = decodes + [(0, 23), (17, 9), (block_size, 3)]
    num_decode = len(decodes)
    num_blocks = 512
    order = torch.randperm(num_blocks, generator=g).tolist()   # shuffled physical blocks
    tables, used = [], 0
    for ctx, n in shapes:
        k = -(-(ctx + n) // block_size)
        tables.append(order[used:used + k])
        used += k
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g, dtype=torch.float64)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g, dtype=torch.float64)
    meta = build_metadata(tables, [c for c, _ in shapes], [n for _, n in shapes], num_decode,
                          block_size, torch.device("cpu"))
    total = sum(n for _, n in shapes)
    q = torch.randn(total, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(total, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(total, hkv, d, generator=g, dtype=torch.float64)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = sdpa_paged_attention(q, k, v, k_cache, v_cache, meta)
    ref, _ = paged_prefill_reference(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                     meta.seq_lens)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_slot_mapping_follows_block_tables():
    meta = build_metadata([[7, 2], [5]], [17, 0], [1, 3], 1, 16, torch.device("cpu"))
    # position 17 of the first sequence: logical block 1 -> physical 2, offset 1
    assert meta.slot_mapping.tolist() == [2 * 16 + 1, 5 * 16, 5 * 16 + 1, 5 * 16 + 2]
    assert meta.seq_lens.tolist() == [18, 3] and meta.cu_seqlens_q.tolist() == [0, 1, 4]
