"""CacheBlend (minillm.cache.blend) against independent references: K computed directly at an
offset, a full prefill of the concatenated prompt, a naive concatenation built here from chunks
computed at their offsets, a brute-force top-k, the deviation measured from two full passes."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from minillm import SamplingParams
from minillm.cache import KVCache
from minillm.cache.blend import (
    ChunkKV,
    answer_match,
    answer_nll,
    blend_prefill,
    full_prefill,
    full_reuse,
    greedy_continue,
    precompute_chunk,
    prefix_prefill,
    reposition,
    select_tokens,
    selection_schedule,
)
from minillm.checkpoint import random_model
from minillm.config import get_preset
from minillm.generate import generate

LENGTHS = (20, 15, 25)   # three chunks
SUFFIX = 6


@pytest.fixture(scope="module")
def model():
    """The tiny preset's shape with 6 layers, float64, attention weights x 4 (peaked attention,
    so that the chunks' cross-attention matters)."""
    m = random_model(get_preset("tiny").with_(n_layers=6), seed=1)
    with torch.no_grad():
        for block in m.layers:
            for lin in (block.attn.wq, block.attn.wk, block.attn.wv, block.attn.wo):
                lin.weight.mul_(4.0)
    return m.double().eval()


def ids_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 2000, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def prompt(model):
    """(chunk ids, suffix ids, ChunkKVs, the full prefill of the concatenation)."""
    *chunk_ids, suffix = ids_of(LENGTHS + (SUFFIX,))
    chunks = [precompute_chunk(model, c) for c in chunk_ids]
    return chunk_ids, suffix, chunks, full_prefill(model, sum(chunk_ids, []) + suffix)


@torch.no_grad()
def kv_at(model, ids, offset):
    """K, V [n_layers, H_kv, T, hd] of ``ids`` computed alone at positions offset.. (no reuse)."""
    cache = KVCache(model.cfg, 1, len(ids), dtype=model.dtype)
    model.hidden_states(torch.tensor([ids]), cache, torch.arange(offset, offset + len(ids)))
    return cache.k[:, 0], cache.v[:, 0]


def kv_error(a, b) -> float:
    n = a.length
    return float((a.cache.k[..., :n, :] - b.cache.k[..., :n, :]).norm()
                 + (a.cache.v[..., :n, :] - b.cache.v[..., :n, :]).norm())


@pytest.mark.parametrize("offset", [1, 37, 300])
def test_reposition_equals_k_computed_at_offset(model, offset):
    ids = ids_of([24], seed=2)[0]
    chunk = precompute_chunk(model, ids)
    k_direct, v_direct = kv_at(model, ids, offset)
    torch.testing.assert_close(reposition(chunk.k, offset, model.cfg), k_direct,
                               rtol=1e-5, atol=1e-5)
    # rope_cos_sin computes angles in float32: equal to ~1e-6 even in a float64 model
    torch.testing.assert_close(chunk.v, v_direct, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(reposition(chunk.k, offset + 1, model.cfg), k_direct, atol=1e-3)
    assert chunk.nbytes == 2 * chunk.k.numel() * 8


@pytest.mark.parametrize("check_layers,gradual", [(0, False), (1, True), (2, False)])
def test_ratio_one_is_full_prefill(model, prompt, check_layers, gradual):
    _, suffix, chunks, full = prompt
    r = blend_prefill(model, chunks, suffix, 1.0, check_layers, gradual)
    torch.testing.assert_close(r.logits, full.logits, rtol=1e-10, atol=1e-10)
    assert r.length == full.length and kv_error(r, full) < 1e-10
    assert r.recomputed_fraction == 1.0


def naive_concatenation(model, chunk_ids, suffix):
    """Each chunk computed alone at its offset, KV side by side, then only the suffix."""
    n = sum(map(len, chunk_ids))
    cache = KVCache(model.cfg, 1, n + len(suffix), dtype=model.dtype)
    offsets = itertools.accumulate([0] + [len(c) for c in chunk_ids])
    for ids, start in zip(chunk_ids, offsets):
        cache.k[:, 0, :, start:start + len(ids)], cache.v[:, 0, :, start:start + len(ids)] = \
            kv_at(model, ids, start)
    cache.seen = n
    with torch.no_grad():
        logits = model(torch.tensor([suffix]), cache=cache)[0, -1]
    return logits, cache


def test_ratio_zero_is_naive_concatenation(model, prompt):
    chunk_ids, suffix, chunks, full = prompt
    logits, cache = naive_concatenation(model, chunk_ids, suffix)
    for r in (blend_prefill(model, chunks, suffix, 0.0), full_reuse(model, chunks, suffix)):
        torch.testing.assert_close(r.logits, logits, rtol=1e-5, atol=1e-5)
        n = r.length
        torch.testing.assert_close(r.cache.k[..., :n, :], cache.k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r.cache.v[..., :n, :], cache.v, rtol=1e-5, atol=1e-5)
        assert all(rows.tolist() == list(range(60, 66)) for layer, rows in r.selected.items()
                   if layer >= 1)
    assert full_reuse(model, chunks, suffix).recomputed_fraction == 0.0
    assert (logits - full.logits).abs().max() > 1e-2  # reuse is not free: the test can fail


@pytest.mark.parametrize("ratio", [0.0, 0.15, 0.6])
def test_single_chunk_is_exact(model, ratio):
    ids, suffix = ids_of([30, 5], seed=4)
    r = blend_prefill(model, [precompute_chunk(model, ids)], suffix, ratio)
    full = full_prefill(model, ids + suffix)
    torch.testing.assert_close(r.logits, full.logits, rtol=1e-9, atol=1e-9)
    assert kv_error(r, full) < 1e-9


def brute_select(dev: list[float], num: int, always: set[int]) -> list[int]:
    rest = sorted((i for i in range(len(dev)) if i not in always), key=lambda i: (-dev[i], i))
    return sorted(always | set(rest[:max(0, num)]))


def test_select_tokens_examples():
    dev = torch.tensor([1.0, 3.0, 3.0, 2.0])
    assert select_tokens(dev, 1).tolist() == [1]                       # tie: lower index
    assert select_tokens(dev, 2).tolist() == [1, 2]
    assert select_tokens(dev, 1, torch.tensor([1])).tolist() == [1, 2]
    assert select_tokens(dev, 9, torch.tensor([0])).tolist() == [0, 1, 2, 3]
    assert select_tokens(dev, -1, torch.tensor([3])).tolist() == [3]
    assert select_tokens(dev, 0).tolist() == []
    assert select_tokens(dev, 2).dtype == torch.long


@pytest.mark.parametrize("seed", range(40))
def test_select_tokens_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 30, (1,), generator=g))
    dev = torch.randint(0, 4, (n,), generator=g).double()             # many ties
    always = sorted(set(torch.randint(0, n, (int(torch.randint(0, 4, (1,), generator=g)),),
                                      generator=g).tolist()))
    num = int(torch.randint(-1, n + 2, (1,), generator=g))
    got = select_tokens(dev, num, torch.tensor(always, dtype=torch.long) if always else None)
    assert got.tolist() == brute_select(dev.tolist(), num, set(always))


def test_selection_schedule():
    assert selection_schedule(30, 0.15, 1, gradual=False) == {1: 0.15}
    got = selection_schedule(30, 0.15, 1)
    assert list(got) == [1, 2, 3, 4]
    assert [round(f, 6) for f in got.values()] == [0.3, 0.25, 0.2, 0.15]
    assert selection_schedule(30, 0.8, 0)[0] == 1.0                  # clipped
    assert selection_schedule(3, 0.15, 1) == pytest.approx({1: 0.3, 2: 0.25})


def test_selection_follows_deviation_from_full_prefill(model, prompt):
    """At the check layer (whose input is exact) the fresh K/V are the full prefill's, the
    reused ones the naive concatenation's: the chosen tokens are the top of their distance."""
    chunk_ids, suffix, chunks, full = prompt
    n = sum(LENGTHS)
    _, naive = naive_concatenation(model, chunk_ids, suffix)
    dev = ((full.cache.k[1, 0, :, :n] - naive.k[1, 0, :, :n]) ** 2).sum((0, 2)) \
        + ((full.cache.v[1, 0, :, :n] - naive.v[1, 0, :, :n]) ** 2).sum((0, 2))
    num = math.floor(0.15 * n + 0.5)
    expected = brute_select(dev.tolist(), num, set()) + list(range(n, n + SUFFIX))
    r = blend_prefill(model, chunks, suffix, 0.15, check_layers=1, gradual=False)
    assert r.selected[0].tolist() == list(range(n + SUFFIX))
    assert r.selected[1].tolist() == expected
    assert r.recomputed_fraction == pytest.approx((n + 5 * num) / (6 * n))


def test_gradual_selection_is_nested(model, prompt):
    _, suffix, chunks, _ = prompt
    n = sum(LENGTHS)
    r = blend_prefill(model, chunks, suffix, 0.2)
    sizes = [len(r.selected[layer]) - SUFFIX for layer in range(6)]
    assert sizes == [n] + [math.floor(f * n + 0.5) for f in (0.4, 1 / 3, 0.8 / 3, 0.2, 0.2)]
    for a, b in zip(range(5), range(1, 6)):
        assert set(r.selected[b].tolist()) <= set(r.selected[a].tolist())
        assert set(range(n, n + SUFFIX)) <= set(r.selected[b].tolist())


def test_more_recompute_less_kv_error(model, prompt):
    _, suffix, chunks, full = prompt
    errors = [kv_error(blend_prefill(model, chunks, suffix, r), full) for r in (0, 0.15, 0.5, 1)]
    assert errors[0] > errors[1] > errors[2] > errors[3] == 0.0
    assert kv_error(prefix_prefill(model, chunks, suffix), full) < 1e-10  # chunk_1 is a prefix


def test_decoding_from_the_blended_cache(model, prompt):
    chunk_ids, suffix, chunks, full = prompt
    ids = sum(chunk_ids, []) + suffix
    want = generate(model, ids, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    r = blend_prefill(model, chunks, suffix, 1.0)
    assert greedy_continue(model, r, 5) == want == greedy_continue(model, full, 5)
    with torch.no_grad():
        logits = model(torch.tensor([ids + want[:-1]]))[0, len(ids) - 1:]
    ref = F.cross_entropy(logits, torch.tensor(want)).item()
    assert answer_nll(model, r, want) == pytest.approx(ref, rel=1e-9)
    assert answer_nll(model, full_reuse(model, chunks, suffix), want) != pytest.approx(ref)
    match = (logits.argmax(-1) == torch.tensor(want)).float().mean().item()
    assert answer_match(model, r, want) == match == 1.0                  # its own greedy answer
    assert answer_match(model, r, [int(logits[0].argmin())] + want[1:]) == pytest.approx(0.8)
    assert greedy_continue(model, r, 5) == want                       # the result is unchanged


def test_bad_input_names_the_parameter(model, prompt):
    _, suffix, chunks, _ = prompt
    cases = [
        (lambda: blend_prefill(model, chunks, suffix, 1.5), "recompute_ratio"),
        (lambda: blend_prefill(model, chunks, suffix, -0.1), "recompute_ratio"),
        (lambda: blend_prefill(model, chunks, suffix, check_layers=7), "check_layers"),
        (lambda: blend_prefill(model, [], suffix), "chunks"),
        (lambda: blend_prefill(model, chunks + [ChunkKV([], chunks[0].k[:, :, :0],
                                                        chunks[0].v[:, :, :0])], suffix),
         r"chunks\[3\]"),
        (lambda: blend_prefill(model, chunks, []), "suffix_ids"),
        (lambda: blend_prefill(model, chunks, [5] * 500), "max_seq_len"),
        (lambda: prefix_prefill(model, chunks, []), "suffix_ids"),
        (lambda: precompute_chunk(model, []), "token_ids"),
        (lambda: full_prefill(model, [10 ** 6]), "token_ids"),
        (lambda: greedy_continue(model, full_prefill(model, [5]), 0), "max_tokens"),
        (lambda: answer_nll(model, full_prefill(model, [5]), []), "answer_ids"),
    ]
    for call, name in cases:
        with pytest.raises(ValueError, match=name):
            call()


def test_real_model_blend_beats_full_reuse(real):
    """SmolLM2-135M, three chunks of prose: 30% recompute shrinks the KV error of full reuse."""
    from minillm.evaluate import sample_text

    model, tok = real
    ids = tok.encode(sample_text(120, tok))
    chunk_ids, suffix = [ids[0:40], ids[40:80], ids[80:120]], tok.encode(" The answer is")
    chunks = [precompute_chunk(model, c) for c in chunk_ids]
    full = full_prefill(model, sum(chunk_ids, []) + suffix)
    blend = blend_prefill(model, chunks, suffix, 0.3)
    assert kv_error(blend, full) < 0.7 * kv_error(full_reuse(model, chunks, suffix), full)
    torch.testing.assert_close(blend_prefill(model, chunks, suffix, 1.0).logits, full.logits,
                               rtol=1e-3, atol=1e-3)
