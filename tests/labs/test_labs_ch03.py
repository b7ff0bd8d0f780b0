"""Chapter 03 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import pytest
import torch
from lab_checks import checker_tests

from minillm.labs import ch03
from minillm.labs.solutions.ch03 import (
    attention_partials,
    dispatch_counts,
    ffn_partials,
    gpipe_slots,
    gpipe_times,
    kv_heads,
)
from minillm.parallel.pipeline import bubble_formula, measured_bubble, simulate_pipeline

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


def attention_partials_whole_layer(attn, x, cos, sin, world_size):
    return [attn(x, cos, sin) / world_size for _ in range(world_size)]  # right sum, no split


def attention_partials_no_rope(attn, x, cos, sin, world_size):
    one, zero = torch.ones_like(cos), torch.zeros_like(sin)
    return attention_partials(attn, x, one, zero, world_size)  # forgot to rotate q and k


def gpipe_slots_sequential(p, m):
    return [[s * m + i for i in range(m)] for s in range(p)]  # no overlap between stages


def gpipe_times_no_waiting(costs):
    # each stage starts when its first input arrives, then runs back to back
    start = []
    for s, row in enumerate(costs):
        first = sum(costs[j][0] for j in range(s))
        start.append([first + sum(row[:i]) for i in range(len(row))])
    return start


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
    (ch03.check_attention_partials, attention_partials, attention_partials_whole_layer),
    (ch03.check_attention_partials, attention_partials, attention_partials_no_rope),
    (ch03.check_gpipe_slots, gpipe_slots, gpipe_slots_sequential),
    (ch03.check_gpipe_times, gpipe_times, gpipe_times_no_waiting),
    (ch03.check_dispatch_counts, dispatch_counts, dispatch_counts_by_expert_modulo),
    (ch03.check_kv_heads, kv_heads, kv_heads_no_replication),
]
IDS = ["ffn_even", "ffn_silu", "attn_whole", "attn_no_rope", "gpipe", "gpipe_times",
       "dispatch", "kv_heads"]


test_reference_passes, test_wrong_fails, test_stub_is_not_attempted = \
    checker_tests(CHECKS, IDS)


def test_simulate_equal_stages_gives_the_gpipe_bubble():
    for p, m in ((1, 1), (2, 1), (2, 8), (4, 3)):
        timelines = simulate_pipeline([[1.0] * m for _ in range(p)])
        assert [[s for _, s, _ in tl] for tl in timelines] == gpipe_slots(p, m)
        assert measured_bubble(timelines) == pytest.approx(bubble_formula(p, m))
