"""Chapter 04 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import torch
from lab_checks import checker_tests

from minillm.labs import ch04
from minillm.labs.solutions import ch04 as key

# --- wrong solutions -----------------------------------------------------------------------


def blocks_floor(num_tokens, block_size):
    return num_tokens // block_size


def fcfs_skipping(prompt_lens, num_free_blocks, block_size, max_num_seqs, max_batched_tokens):
    """Admits any request that fits, skipping over the ones that do not (not FCFS)."""
    admitted, free = 0, num_free_blocks
    for n in prompt_lens:
        if admitted < max_num_seqs and key.blocks_needed(n, block_size) <= free:
            admitted, free = admitted + 1, free - key.blocks_needed(n, block_size)
    return admitted


def waste_ignoring_blocks(seq_lens, max_lens, block_size, reserve):
    caps = max_lens if reserve else seq_lens
    return 1 - sum(seq_lens) / sum(caps)


def schedule_preempting_oldest(running, waiting, num_free_blocks, block_size, max_num_seqs,
                               max_batched_tokens):
    """Evicts the oldest queued request instead of the newest (starves long-running ones)."""
    flipped = [len(running) - 1 - i for i in range(len(running))]
    decoded, admitted, preempted = key.schedule_step(running[::-1], waiting, num_free_blocks,
                                                     block_size, max_num_seqs,
                                                     max_batched_tokens)
    return sorted(flipped[i] for i in decoded), admitted, [flipped[i] for i in preempted]


def schedule_admitting_after_preemption(running, waiting, num_free_blocks, block_size,
                                        max_num_seqs, max_batched_tokens):
    """Keeps admitting new requests in a step that had to preempt (they would be preempted
    next)."""
    decoded, _, preempted = key.schedule_step(running, [], num_free_blocks, block_size,
                                              max_num_seqs, max_batched_tokens)
    free = num_free_blocks + sum(key.blocks_needed(running[i], block_size) for i in preempted) \
        - sum(running[i] % block_size == 0 for i in decoded)
    _, admitted, _ = key.schedule_step([], waiting, free, block_size,
                                       max_num_seqs - len(decoded),
                                       max_batched_tokens - len(decoded))
    return decoded, admitted, preempted


class BlockManagerWithoutCopyOnWrite(key.MiniBlockManager):
    """Appends into a shared block in place: the other sequences' K/V would be overwritten."""

    def append(self, seq_id):
        table, pos = self.tables[seq_id], self.filled[seq_id]
        if pos // self.block_size == len(table):
            table.append(self._take())
        self.filled[seq_id] = pos + 1
        return []


class BlockManagerForkCopies(key.MiniBlockManager):
    """Forks by copying every block (correct content, none of the sharing)."""

    def fork(self, parent_id, child_id):
        self.tables[child_id] = [self._take() for _ in self.tables[parent_id]]
        self.filled[child_id] = self.filled[parent_id]


def paged_attention_contiguous(q, k_cache, v_cache, block_table, seq_len):
    """Reads the pool's first slots as if the sequence were stored contiguously."""
    return key.paged_attention(q, k_cache, v_cache, list(range(len(block_table))), seq_len)


def paged_attention_whole_blocks(q, k_cache, v_cache, block_table, seq_len):
    """Attends to every slot of the last block, including the garbage past seq_len."""
    bs = k_cache.shape[1]
    padded = len(block_table[:key.blocks_needed(seq_len, bs)]) * bs
    t = q.shape[0]
    k = k_cache[torch.tensor(block_table)].flatten(0, 1)[:padded]
    v = v_cache[torch.tensor(block_table)].flatten(0, 1)[:padded]
    scores = torch.einsum("thd,lhd->htl", q, k) / q.shape[-1] ** 0.5
    future = torch.arange(padded)[None] > torch.arange(seq_len - t, seq_len)[:, None]
    future[:, seq_len:] = False
    return torch.einsum("htl,lhd->thd", scores.masked_fill(future, float("-inf")).softmax(-1), v)


def schedule_never_preempting(running, waiting, num_free_blocks, block_size, max_num_seqs,
                              max_batched_tokens):
    """Decodes every running request whether or not a block is free (the pool runs dry)."""
    decoded, admitted, _ = key.schedule_step(running, waiting, 10**6, block_size, max_num_seqs,
                                             max_batched_tokens)
    return list(range(len(running))), admitted if not running else [], []


def schedule_forgetting_a_request(running, waiting, num_free_blocks, block_size, max_num_seqs,
                                  max_batched_tokens):
    """Leaves the newest running request out of the step without preempting it."""
    decoded, admitted, preempted = key.schedule_step(running, waiting, num_free_blocks,
                                                     block_size, max_num_seqs,
                                                     max_batched_tokens)
    return decoded[:-1] if len(decoded) > 2 else decoded, admitted, preempted


def paged_attention_not_causal(q, k_cache, v_cache, block_table, seq_len):
    """Every query attends to all seq_len positions, its own future included."""
    k = k_cache[torch.tensor(block_table)].flatten(0, 1)[:seq_len]
    v = v_cache[torch.tensor(block_table)].flatten(0, 1)[:seq_len]
    scores = torch.einsum("thd,lhd->htl", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("htl,lhd->thd", scores.softmax(-1), v)


CHECKS = [
    (ch04.check_blocks_needed, key.blocks_needed, blocks_floor),
    (ch04.check_fcfs_admit, key.fcfs_admit, fcfs_skipping),
    (ch04.check_kv_waste, key.kv_waste, waste_ignoring_blocks),
    (ch04.check_schedule_step, key.schedule_step, schedule_preempting_oldest),
    (ch04.check_schedule_step, key.schedule_step, schedule_admitting_after_preemption),
    (ch04.check_block_manager, key.MiniBlockManager, BlockManagerWithoutCopyOnWrite),
    (ch04.check_block_manager, key.MiniBlockManager, BlockManagerForkCopies),
    (ch04.check_paged_attention, key.paged_attention, paged_attention_contiguous),
    (ch04.check_paged_attention, key.paged_attention, paged_attention_whole_blocks),
    (ch04.check_schedule_step_in_engine, key.schedule_step, schedule_preempting_oldest),
    (ch04.check_schedule_step_in_engine, key.schedule_step, schedule_never_preempting),
    (ch04.check_schedule_step_in_engine, key.schedule_step, schedule_forgetting_a_request),
    (ch04.check_paged_attention_in_engine, key.paged_attention, paged_attention_contiguous),
    (ch04.check_paged_attention_in_engine, key.paged_attention, paged_attention_not_causal),
]
IDS = ["blocks_needed", "fcfs_admit", "kv_waste", "schedule_preempts_oldest",
       "schedule_admits_after_preemption", "block_manager_no_cow", "block_manager_fork_copies",
       "paged_attention_contiguous", "paged_attention_whole_blocks", "engine_preempts_oldest",
       "engine_never_preempts", "engine_forgets_a_request", "engine_attention_contiguous",
       "engine_attention_not_causal"]


test_reference_passes, test_wrong_fails, test_stub_is_not_attempted = \
    checker_tests(CHECKS, IDS)
