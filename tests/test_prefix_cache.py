"""Prefix caching (chapter 08): hashed blocks (and the radix tree) inside the block manager.
A hit gives the cold run's greedy tokens; equal tokens under another prefix never match; eviction
never takes a referenced block; cached blocks are never written; every block ends free."""
from __future__ import annotations

import pytest
import torch
from engine_checks import assert_all_free, prompts_of, run_all, sharp_model
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import SamplingParams
from minillm.cache.block_manager import BlockManager
from minillm.cache.prefix import HashPrefixCache
from minillm.engine import EngineConfig, LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SYSTEM = list(range(100, 161))                  # 61 shared tokens
KINDS = ["hash", "radix"]


@pytest.fixture(scope="module")
def tiny64():
    from minillm.checkpoint.loader import smollm2_tokenizer

    return sharp_model(max_seq_len=512), smollm2_tokenizer()


def prompts():
    return [SYSTEM + q for q in prompts_of([5, 9, 17, 3, 30, 12], seed=1)]


def cold(model, tok, ps, params=GREEDY, **kw):
    engine = LLMEngine(model, tok, EngineConfig(num_kv_blocks=300, block_size=8, **kw))
    return [o.token_ids for o in run_all(engine, ps, params)]


def cached_engine(model, tok, kind, **kw):
    kw = {"num_kv_blocks": 300, "block_size": 8, **kw}
    return LLMEngine(model, tok, EngineConfig(enable_prefix_caching=True, prefix_cache=kind,
                                              **kw))


@pytest.mark.parametrize("kind", KINDS)
def test_a_hit_gives_the_cold_tokens_and_skips_the_shared_prefix(tiny64, kind):
    model, tok = tiny64
    ps = prompts()
    engine = cached_engine(model, tok, kind)
    run_all(engine, ps[:1], GREEDY)                              # warms the system prompt
    outs = run_all(engine, ps, GREEDY)
    assert [o.token_ids for o in outs] == cold(model, tok, ps)
    bs = 8
    assert outs[0].metrics.cached_tokens == (len(ps[0]) - 1) // bs * bs   # all but the last
    assert all(o.metrics.cached_tokens == len(SYSTEM) // bs * bs for o in outs[1:])
    assert_all_free(engine)
    engine.blocks.check()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("options", [
    dict(num_kv_blocks=24, preemption="recompute", watermark=0),
    dict(num_kv_blocks=24, preemption="swap", watermark=0),
    dict(max_num_batched_tokens=16, max_num_seqs=4),              # chunked prefill
])
def test_preemption_and_chunks_keep_working_on_cached_blocks(tiny64, kind, options):
    model, tok = tiny64
    ps = prompts()
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine = cached_engine(model, tok, kind, **options)
    outs = run_all(engine, ps, params)
    assert [o.token_ids for o in outs] == cold(model, tok, ps, params)
    assert_all_free(engine)
    engine.blocks.check()


@pytest.mark.parametrize("kind", KINDS)
def test_parallel_sampling_and_beams_share_cached_prompts(tiny64, kind):
    model, tok = tiny64
    ps = prompts()[:3]
    for params in (SamplingParams(temperature=0.0, max_tokens=6, n=3, ignore_eos=True),
                   SamplingParams(max_tokens=6, beam_width=3, n=2, ignore_eos=True)):
        engine = cached_engine(model, tok, kind)
        run_all(engine, ps[:1], params)
        got = [[c.token_ids for c in o.outputs] for o in run_all(engine, ps, params)]
        engine0 = LLMEngine(model, tok, EngineConfig(num_kv_blocks=300, block_size=8))
        want = [[c.token_ids for c in o.outputs] for o in run_all(engine0, ps, params)]
        assert got == want
        assert_all_free(engine)


@pytest.mark.parametrize("kind", KINDS)
def test_cached_blocks_are_never_written(tiny64, kind):
    """Request B shares A's prefix and diverges: the K/V of A's cached blocks stays bitwise."""
    model, tok = tiny64
    engine = cached_engine(model, tok, kind)
    a = SYSTEM + [5, 6, 7]
    run_all(engine, [a], GREEDY)
    hit = engine.blocks.match_prefix(a)
    assert hit
    pool = engine.runner.pool
    k, v = pool.k[:, hit].clone(), pool.v[:, hit].clone()
    run_all(engine, [SYSTEM[:40] + [9] * 30, a[:48] + [1, 2, 3]], GREEDY)
    assert torch.equal(pool.k[:, hit], k) and torch.equal(pool.v[:, hit], v)


def test_equal_tokens_under_another_prefix_never_match():
    cache = HashPrefixCache(4)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], [10, 11])
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8, 9]) == [10, 11]
    assert cache.match([0, 0, 0, 0, 5, 6, 7, 8]) == []          # block 2's tokens, new prefix
    assert cache.match([1, 2, 3, 4, 5, 6, 7]) == [10]           # a partial block never matches
    assert cache.insert([1, 2, 3, 4], [12]) == []               # cached already, under 10


def test_a_freed_chain_is_evicted_from_its_tail():
    """A freed sequence's blocks wait tail first, so eviction shortens a cached chain and never
    cuts its head off (which would leave the rest stored but unreachable)."""
    blocks = BlockManager(4, 4, watermark=0, prefix_cache=HashPrefixCache(4))
    toks = list(range(16))
    blocks.allocate_cached(0, toks, 16)
    blocks.cache_computed(0, toks, 16)
    head = blocks.tables[0]
    blocks.free(0)
    blocks.allocate(1, 4)                      # takes one cached block back
    assert blocks.tables[1] == [head[-1]]
    assert blocks.match_prefix(toks + [99]) == head[:3]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(1, 30)),
                min_size=1, max_size=40))
def test_eviction_never_takes_a_referenced_block(ops):
    """Random admissions (prompts from 4 prefixes), completions and frees: every live
    sequence's blocks keep holding its own tokens (a block is 'written' with the token ids it
    computes), and the block manager's invariants hold throughout."""
    bs = 4
    blocks = BlockManager(12, bs, watermark=0, prefix_cache=HashPrefixCache(bs))
    content: dict[int, list[int]] = {}             # block -> the tokens whose K/V it holds
    live: dict[int, list[int]] = {}
    for i, (prefix, action, length) in enumerate(ops):
        if action < 2:
            toks = [prefix] * 8 + list(range(length))
            if blocks.cached_need(toks, len(toks)) > blocks.num_free:
                continue
            hit = blocks.allocate_cached(i, toks, len(toks))
            table = blocks.tables[i]
            for j, b in enumerate(table):
                if j * bs >= hit:                    # computed now: written
                    content[b] = toks[j * bs:(j + 1) * bs]
            blocks.cache_computed(i, toks, len(toks))
            live[i] = toks
        elif live:
            seq = sorted(live)[length % len(live)]
            blocks.free(seq)
            del live[seq]
        for seq, toks in live.items():
            for j, b in enumerate(blocks.tables[seq]):
                assert content[b] == toks[j * bs:(j + 1) * bs], "a live block was reused"
        blocks.check()


def test_bad_prefix_options_are_refused_by_name(tiny64):
    with pytest.raises(ValueError, match="prefix_cache"):
        EngineConfig(enable_prefix_caching=True, prefix_cache="lru")
    from minillm.spec.speculator import build_speculator

    model, tok = tiny64
    engine = cached_engine(model, tok, "hash", max_num_batched_tokens=512)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        engine.use_speculator(build_speculator({"method": "ngram",
                                                "num_speculative_tokens": 2}, engine))
