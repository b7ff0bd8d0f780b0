"""Chapter 04 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import pytest

from minillm.labs import ch04
from minillm.labs.solutions.ch04 import (
    blocks_needed,
    fcfs_admit,
    kv_waste,
)

# --- reference solutions (written from the chapter's text, not from the package) -------------








# --- wrong solutions -----------------------------------------------------------------------


def blocks_floor(num_tokens, block_size):
    return num_tokens // block_size


def fcfs_skipping(prompt_lens, num_free_blocks, block_size, max_num_seqs, max_batched_tokens):
    """Admits any request that fits, skipping over the ones that do not (not FCFS)."""
    admitted, free = 0, num_free_blocks
    for n in prompt_lens:
        if admitted < max_num_seqs and blocks_needed(n, block_size) <= free:
            admitted, free = admitted + 1, free - blocks_needed(n, block_size)
    return admitted


def waste_ignoring_blocks(seq_lens, max_lens, block_size, reserve):
    caps = max_lens if reserve else seq_lens
    return 1 - sum(seq_lens) / sum(caps)


def todo(*args):
    raise NotImplementedError


@pytest.mark.parametrize("checker,right,wrong", [
    (ch04.check_blocks_needed, blocks_needed, blocks_floor),
    (ch04.check_fcfs_admit, fcfs_admit, fcfs_skipping),
    (ch04.check_kv_waste, kv_waste, waste_ignoring_blocks),
])
def test_checker(checker, right, wrong):
    assert checker(right).passed is True
    assert checker(wrong).passed is False
    assert checker(todo).passed is None
