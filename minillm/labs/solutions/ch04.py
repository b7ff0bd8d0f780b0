"""Chapter 04's key: reference solutions, written from the rules the chapter teaches."""
from __future__ import annotations

import math

import torch

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


def schedule_step(running, waiting, num_free_blocks, block_size, max_num_seqs,
                  max_batched_tokens):
    free, queue, decoded, preempted = num_free_blocks, list(range(len(running))), [], []
    while queue:
        i = queue.pop(0)
        need = 1 if running[i] % block_size == 0 else 0     # the new token starts a block
        while need > free:
            victim = queue.pop() if queue else i             # the newest one still queued
            preempted.append(victim)
            free += blocks_needed(running[victim], block_size)
            if victim == i:
                break
        if i not in preempted:
            free -= need
            decoded.append(i)
    admitted = []
    if not preempted:
        tokens = len(decoded)
        for j, n in enumerate(waiting):
            fits = tokens + n <= max_batched_tokens or not (decoded or admitted)
            if len(decoded) + len(admitted) == max_num_seqs or not fits \
                    or blocks_needed(n, block_size) > free:
                break
            admitted.append(j)
            tokens += n
            free -= blocks_needed(n, block_size)
    return decoded, admitted, preempted


class MiniBlockManager:
    """Block tables with reference counts and copy-on-write."""

    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.free_blocks = list(range(num_blocks))
        self.tables, self.filled = {}, {}

    def _take(self):
        block = self.free_blocks.pop(0)
        self.ref[block] = 1
        return block

    def _drop(self, block):
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free_blocks.append(block)

    def allocate(self, seq_id, num_tokens):
        self.tables[seq_id] = [self._take() for _ in range(blocks_needed(num_tokens,
                                                                          self.block_size))]
        self.filled[seq_id] = num_tokens

    def append(self, seq_id):
        table, pos = self.tables[seq_id], self.filled[seq_id]
        copies = []
        i = pos // self.block_size
        if i == len(table):
            table.append(self._take())
        elif self.ref[table[i]] > 1:                       # shared: write into a private copy
            src, dst = table[i], self._take()
            self._drop(src)
            table[i] = dst
            copies.append((src, dst))
        self.filled[seq_id] = pos + 1
        return copies

    def fork(self, parent_id, child_id):
        self.tables[child_id] = list(self.tables[parent_id])
        self.filled[child_id] = self.filled[parent_id]
        for block in self.tables[child_id]:
            self.ref[block] += 1

    def free(self, seq_id):
        for block in self.tables.pop(seq_id):
            self._drop(block)
        del self.filled[seq_id]


def paged_attention(q, k_cache, v_cache, block_table, seq_len):
    bs = k_cache.shape[1]
    blocks = torch.tensor(block_table[:blocks_needed(seq_len, bs)])
    k = k_cache[blocks].flatten(0, 1)[:seq_len]             # [seq_len, H, D], logical order
    v = v_cache[blocks].flatten(0, 1)[:seq_len]
    t = q.shape[0]
    scores = torch.einsum("thd,lhd->htl", q, k) / math.sqrt(q.shape[-1])
    future = torch.arange(seq_len)[None] > torch.arange(seq_len - t, seq_len)[:, None]
    return torch.einsum("htl,lhd->thd", scores.masked_fill(future, float("-inf")).softmax(-1), v)


KEY = [
    (ch04.check_blocks_needed, blocks_needed),
    (ch04.check_fcfs_admit, fcfs_admit),
    (ch04.check_kv_waste, kv_waste),
    (ch04.check_schedule_step, schedule_step),
    (ch04.check_block_manager, MiniBlockManager),
    (ch04.check_paged_attention, paged_attention),
    (ch04.check_schedule_step_in_engine, schedule_step),
    (ch04.check_paged_attention_in_engine, paged_attention),
]
