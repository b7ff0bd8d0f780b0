"""Chapter 09 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import torch
from lab_checks import checker_tests

from minillm.labs import ch09
from minillm.labs.solutions import ch09 as key

# --- wrong solutions -----------------------------------------------------------------------


def merge_average(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, torch.maximum(lse_a, lse_b)


def merge_unguarded(out_a, lse_a, out_b, lse_b):  # NaN where both sides saw no key
    m = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    return (out_a * wa[..., None] + out_b * wb[..., None]) / (wa + wb)[..., None], \
        m + torch.log(wa + wb)


def rank_work_blocks(seq_len, world_size, layout):
    return [seq_len // world_size * (r + 1) for r in range(world_size)]  # counts blocks, not pairs


def seq_to_heads_wrong_order(shards):
    p = len(shards)
    h = shards[0].shape[1] // p
    return [torch.cat([s[:, r * h:(r + 1) * h] for s in reversed(shards)], dim=2)
            for r in range(p)]


CHECKS = [
    (ch09.check_merge, key.merge, merge_average),
    (ch09.check_merge, key.merge, merge_unguarded),
    (ch09.check_rank_work, key.rank_work, rank_work_blocks),
    (ch09.check_ulysses_all_to_all, key.seq_to_heads, seq_to_heads_wrong_order),
]
IDS = ["merge", "merge_both_sides_empty", "rank_work", "ulysses"]


test_reference_passes, test_wrong_fails, test_stub_is_not_attempted = \
    checker_tests(CHECKS, IDS)
