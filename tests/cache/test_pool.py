"""The paged KV pool's swap to and from the CPU pool."""
from __future__ import annotations

import torch

from minillm.cache.pool import PagedKVPool
from minillm.config import get_preset


def test_swap_out_is_complete_when_it_returns():
    """Blocks swapped out and overwritten on the device right away: the CPU pool holds the old
    contents. On CUDA this catches a host read of an unfinished device-to-host copy."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pool = PagedKVPool(get_preset("tiny"), 64, 16, device, torch.float32, num_cpu_blocks=64)
    want = torch.randn(pool.k[:, :32].shape, device=device)
    pool.k[:, :32] = want
    pool.swap_out([(b, 63 - b) for b in range(32)])
    pool.k.zero_()
    assert torch.equal(pool.cpu_k[:, 63 - torch.arange(32)], want.cpu())
    pool.swap_in([(63 - b, b) for b in range(32)])
    assert torch.equal(pool.k[:, :32], want)
