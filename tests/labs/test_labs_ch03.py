"""Chapter 03 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import functools

import pytest
import torch
from lab_checks import checker_tests

from minillm.labs import ch03
from minillm.labs.in_engine import demo_model
from minillm.labs.solutions.ch03 import (
    _rope,
    attention_on_rank,
    attention_partials,
    dispatch_counts,
    ffn_partials,
    gpipe_slots,
    gpipe_times,
    kv_heads,
    mlp_on_rank,
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


def _mlp(block, rank, world_size, all_reduce, units=None, copy=True, residual_first=False):
    # the key's MLP step with one thing changed: the shares, copies or views, where x is added
    ffn, f = block.ffn, block.ffn.w_gate.weight.shape[0]
    units = units or slice(rank * f // world_size, (rank + 1) * f // world_size)
    keep = (lambda w: w.clone()) if copy else (lambda w: w)
    w_gate, w_up = keep(ffn.w_gate.weight[units]), keep(ffn.w_up.weight[units])
    w_down, norm = keep(ffn.w_down.weight[:, units]), block.ffn_norm

    def forward(x):
        h = norm(x)
        partial = (torch.nn.functional.silu(h @ w_gate.T) * (h @ w_up.T)) @ w_down.T
        return all_reduce(x + partial) if residual_first else x + all_reduce(partial)

    return forward


def mlp_on_rank_residual_every_rank(block, rank, world_size, all_reduce):
    # adds the residual to its partial, so the all-reduce adds x P times
    return _mlp(block, rank, world_size, all_reduce, residual_first=True)


def mlp_on_rank_even_shares(block, rank, world_size, all_reduce):
    # F // P units each: when P does not divide F the last F % P units are never computed
    per = block.ffn.w_gate.weight.shape[0] // world_size
    return _mlp(block, rank, world_size, all_reduce, units=slice(rank * per, (rank + 1) * per))


def mlp_on_rank_keeps_views(block, rank, world_size, all_reduce):
    # right numbers, but its slices are views: every rank keeps the whole FFN alive
    return _mlp(block, rank, world_size, all_reduce, copy=False)


def _attention(block, rank, world_size, all_reduce, kv_of=None, residual_first=False):
    # the key's attention step with one thing changed: which KV heads, where x is added
    attn, norm = block.attn, block.attn_norm
    h, hkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    per, group = h // world_size, h // hkv
    heads = range(rank * per, (rank + 1) * per)
    kv = (kv_of or (lambda: range(heads.start // group, (heads.stop - 1) // group + 1)))()
    q_rows = slice(heads.start * hd, heads.stop * hd)
    wq, wo = attn.wq.weight[q_rows].clone(), attn.wo.weight[:, q_rows].clone()
    wk = torch.cat([attn.wk.weight[i * hd:(i + 1) * hd] for i in kv])
    wv = torch.cat([attn.wv.weight[i * hd:(i + 1) * hd] for i in kv])

    def forward(x, cos, sin):
        b, t, _ = x.shape
        y = norm(x)
        q = _rope((y @ wq.T).view(b, t, per, hd).transpose(1, 2), cos, sin)
        k = _rope((y @ wk.T).view(b, t, len(kv), hd).transpose(1, 2), cos, sin)
        v = (y @ wv.T).view(b, t, len(kv), hd).transpose(1, 2)
        if len(kv) == hkv:  # every KV head kept: each query head picks its own
            k, v = (z.repeat_interleave(group, dim=1)[:, heads.start:heads.stop] for z in (k, v))
        else:
            k, v = (z.repeat_interleave(per // len(kv), dim=1) for z in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        partial = out.transpose(1, 2).reshape(b, t, per * hd) @ wo.T
        return all_reduce(x + partial) if residual_first else x + all_reduce(partial)

    return forward


def attention_on_rank_residual_every_rank(block, rank, world_size, all_reduce):
    return _attention(block, rank, world_size, all_reduce, residual_first=True)


def attention_on_rank_every_kv_head(block, rank, world_size, all_reduce):
    # right numbers, but every rank keeps all the KV heads, not those of its query groups
    return _attention(block, rank, world_size, all_reduce,
                      kv_of=lambda: range(block.attn.n_kv_heads))


def attention_on_rank_kv_round_robin(block, rank, world_size, all_reduce):
    # with more ranks than KV heads, deals the KV heads out in turn: rank r gets r % H_kv,
    # not the head its query heads read
    hkv = block.attn.n_kv_heads
    if world_size <= hkv:
        return attention_on_rank(block, rank, world_size, all_reduce)
    return _attention(block, rank, world_size, all_reduce, kv_of=lambda: [rank % hkv])


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
    (ch03.check_mlp_on_ranks, mlp_on_rank, mlp_on_rank_residual_every_rank),
    (ch03.check_mlp_on_ranks, mlp_on_rank, mlp_on_rank_even_shares),
    (ch03.check_mlp_on_ranks, mlp_on_rank, mlp_on_rank_keeps_views),
    (ch03.check_attention_partials, attention_partials, attention_partials_whole_layer),
    (ch03.check_attention_partials, attention_partials, attention_partials_no_rope),
    (ch03.check_attention_on_ranks, attention_on_rank, attention_on_rank_residual_every_rank),
    (ch03.check_attention_on_ranks, attention_on_rank, attention_on_rank_every_kv_head),
    (ch03.check_attention_on_ranks, attention_on_rank, attention_on_rank_kv_round_robin),
    (ch03.check_gpipe_slots, gpipe_slots, gpipe_slots_sequential),
    (ch03.check_gpipe_times, gpipe_times, gpipe_times_no_waiting),
    (ch03.check_dispatch_counts, dispatch_counts, dispatch_counts_by_expert_modulo),
    (ch03.check_kv_heads, kv_heads, kv_heads_no_replication),
]
IDS = ["ffn_even", "ffn_silu", "mlp_residual_every_rank", "mlp_even_shares", "mlp_views",
       "attn_whole", "attn_no_rope", "attn_residual_every_rank", "attn_every_kv_head",
       "attn_kv_round_robin", "gpipe", "gpipe_times", "dispatch", "kv_heads"]


test_reference_passes, test_wrong_fails, test_stub_is_not_attempted = \
    checker_tests(CHECKS, IDS)


def test_simulate_equal_stages_gives_the_gpipe_bubble():
    for p, m in ((1, 1), (2, 1), (2, 8), (4, 3)):
        timelines = simulate_pipeline([[1.0] * m for _ in range(p)])
        assert [[s for _, s, _ in tl] for tl in timelines] == gpipe_slots(p, m)
        assert measured_bubble(timelines) == pytest.approx(bubble_formula(p, m))


def test_both_steps_make_the_whole_tensor_parallel_layer():
    """The key's MLP and attention together in every layer, on 2 gloo ranks: the logits of one
    process, two all-reduces of [B, T, D] per layer, and the package's TP beside them."""
    model = demo_model()
    ids = torch.randint(5, 2000, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = model(ids)
    ranks = ch03.tp_logits_with(model, ids, 2, mlp=mlp_on_rank, attention=attention_on_rank)
    for r in ranks:
        assert torch.allclose(r["logits"], want, atol=1e-12)
        assert torch.allclose(r["package_logits"], want, atol=1e-12)
        assert r["reduces"] == [(1, 7, model.cfg.d_model)] * (2 * model.cfg.n_layers)
        assert max(r["held"]["mlp"]) == ch03.share("mlp", model.cfg, 2)
        assert max(r["held"]["attention"]) == ch03.share("attention", model.cfg, 2)


def test_numbers_held_counts_whole_storages_once():
    w = torch.zeros(10, 4)
    view, copy = w[:2], w[:2].clone()
    assert ch03.numbers_held(lambda: view) == 40  # a view keeps its whole matrix
    assert ch03.numbers_held(lambda: (copy, copy, [copy])) == 8
    module = torch.nn.Linear(4, 3, bias=False)
    assert ch03.numbers_held(functools.partial(print, {"m": module})) == 12
    assert ch03.numbers_held(lambda: (view, module), skip=(module,)) == 40
