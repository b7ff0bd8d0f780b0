"""Chapter 04's key: reference solutions, written from the rules the chapter teaches."""
from __future__ import annotations

from minillm.labs import ch04


def blocks_needed(num_tokens, block_size):
    return (num_tokens + block_size - 1) // block_size


def fcfs_admit(prompt_lens, num_free_blocks, block_size, max_num_seqs, max_batched_tokens):
    admitted, tokens, free = 0, 0, num_free_blocks
    for n in prompt_lens:
        need = blocks_needed(n, block_size)
        if admitted == max_num_seqs or (admitted and tokens + n > max_batched_tokens) \
                or need > free:
            break
        admitted, tokens, free = admitted + 1, tokens + n, free - need
    return admitted


def kv_waste(seq_lens, max_lens, block_size, reserve):
    caps = max_lens if reserve else seq_lens
    allocated = sum(blocks_needed(c, block_size) * block_size for c in caps)
    return 1 - sum(seq_lens) / allocated


KEY = [
    (ch04.check_blocks_needed, blocks_needed),
    (ch04.check_fcfs_admit, fcfs_admit),
    (ch04.check_kv_waste, kv_waste),
]
