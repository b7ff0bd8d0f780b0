"""Chapter 03 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import torch
from lab_checks import checker_tests

from minillm.labs import ch03
from minillm.labs.solutions.ch03 import (
    dispatch_counts,
    ffn_partials,
    gpipe_slots,
    kv_heads,
)

# --- wrong solutions -----------------------------------------------------------------------


def ffn_partials_even_split(ffn, x, world_size):
    return [ffn(x) / world_size for _ in range(world_size)]  # right sum, wrong shares


def ffn_partials_activation_after(ffn, x, world_size):
    per = ffn.w_gate.weight.shape[0] // world_size
    parts = []
    for r in range(world_size):
        cols = slice(r * per, (r + 1) * per)
        h = (x @ ffn.w_gate.weight[cols].T) * (x @ ffn.w_up.weight[cols].T)
        parts.append(h @ ffn.w_down.weight[:, cols].T)
    return parts  # forgot the SiLU


def gpipe_slots_sequential(p, m):
    return [[s * m + i for i in range(m)] for s in range(p)]  # no overlap between stages


def dispatch_counts_by_expert_modulo(experts, n_experts, world_size):
    return torch.bincount(experts.flatten() % world_size, minlength=world_size).tolist()


def kv_heads_no_replication(cfg, rank, world_size):
    if cfg.n_kv_heads % world_size:
        raise ValueError("KV heads do not split")
    per = cfg.n_kv_heads // world_size
    return list(range(rank * per, (rank + 1) * per))


CHECKS = [
    (ch03.check_ffn_partials, ffn_partials, ffn_partials_even_split),
    (ch03.check_ffn_partials, ffn_partials, ffn_partials_activation_after),
    (ch03.check_gpipe_slots, gpipe_slots, gpipe_slots_sequential),
    (ch03.check_dispatch_counts, dispatch_counts, dispatch_counts_by_expert_modulo),
    (ch03.check_kv_heads, kv_heads, kv_heads_no_replication),
]
IDS = ["ffn_even", "ffn_silu", "gpipe", "dispatch", "kv_heads"]


test_reference_passes, test_wrong_fails, test_stub_is_not_attempted = \
    checker_tests(CHECKS, IDS)
