"""Prefix caching (chapter 08): hashed blocks (and the radix tree) inside the block manager.
A hit gives the cold run's greedy tokens, a block-aligned prompt's included (its last block is
computed again); equal tokens under another prefix never match, wherever they sit; eviction never
takes a referenced block; cached blocks are never written; every block ends free."""
from __future__ import annotations

import random

import pytest
import torch
from engine_checks import assert_all_free, prompts_of, run_all, sharp_model
from hypothesis import given, settings
from hypothesis import strategies as st
from properties import examples

from minillm import SamplingParams
from minillm.cache.block_manager import BlockManager
from minillm.cache.prefix import HashPrefixCache
from minillm.cache.radix import RadixPrefixCache
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


def make_cache(kind: str, block_size: int):
    return HashPrefixCache(block_size) if kind == "hash" else RadixPrefixCache(block_size)


@pytest.mark.parametrize("kind", KINDS)
def test_equal_blocks_after_different_earlier_blocks_never_match(kind):
    """Blocks 1 and 2 of b hold the same tokens as a's, but b's block 0 differs: a block's
    identity is its tokens and everything before them, so nothing of a's serves b (and c,
    which shares a's block 0 only, gets that block only)."""
    cache = make_cache(kind, 4)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9]
    b = [0, 0, 0, 0, 5, 6, 7, 8, 9, 9, 9, 9]
    c = [1, 2, 3, 4, 0, 0, 0, 0, 9, 9, 9, 9]
    assert cache.insert(a, [10, 11, 12]) == [10, 11, 12]
    assert cache.match(b) == [] and cache.match(c) == [10]
    assert cache.insert(b, [20, 21, 22]) == [20, 21, 22]         # all new: none is a's
    assert cache.match(b + [1]) == [20, 21, 22] and cache.match(a) == [10, 11, 12]
    assert cache.insert(c, [10, 31, 32]) == [31, 32]
    assert cache.match(c) == [10, 31, 32]


@pytest.mark.parametrize("kind", KINDS)
def test_matches_equal_a_dictionary_keyed_by_the_whole_prefix(kind):
    """Random prompts over 2 token values and 2-token blocks (so equal blocks recur under many
    prefixes): after every insert, each match equals that of a plain dictionary from the
    tuple of all tokens up to a block's end to the first block registered for it."""
    bs, rng = 2, random.Random(0)
    cache, by_prefix = make_cache(kind, bs), {}
    next_block = 0
    for _ in range(200):
        tokens = [rng.randint(0, 1) for _ in range(rng.randint(0, 10))]
        n = len(tokens) // bs
        blocks = list(range(next_block, next_block + n))
        next_block += n
        want_added = []
        for i, block in enumerate(blocks):
            key = tuple(tokens[:(i + 1) * bs])
            if key not in by_prefix:
                by_prefix[key] = block
                want_added.append(block)
        assert cache.insert(tokens, blocks) == want_added
        query = [rng.randint(0, 1) for _ in range(rng.randint(0, 10))]
        want = []
        for end in range(bs, len(query) + 1, bs):
            if tuple(query[:end]) not in by_prefix:
                break
            want.append(by_prefix[tuple(query[:end])])
        assert cache.match(query) == want, f"query {query}"


@pytest.mark.parametrize("kind", KINDS)
def test_a_block_aligned_prompt_sent_twice(kind):
    """A 48-token prompt (6 whole blocks of 8) runs, then runs again: the second run reuses
    every block but the last (its last token's logits must be computed), gives the first run's
    greedy tokens, and ends with every block free. Steps are bounded, so a run that stops
    making progress fails rather than hangs."""
    model, tok = sharp_model(max_seq_len=128, vocab_size=2000), None
    prompt = SYSTEM[:48]
    engine = cached_engine(model, tok, kind)
    runs = []
    for _ in range(2):
        rid = engine.add_request(prompt, GREEDY)
        done = None
        for _ in range(3 * GREEDY.max_tokens):
            done = next((o for o in engine.step() if o.finished), done)
            if not engine.has_unfinished():
                break
        assert done is not None and done.request_id == rid and not engine.has_unfinished()
        assert_all_free(engine)
        runs.append(done)
    assert runs[1].metrics.cached_tokens == 40
    assert runs[1].outputs[0].token_ids == runs[0].outputs[0].token_ids
    assert runs[0].outputs[0].token_ids == cold(model, tok, [prompt])[0]


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


@settings(max_examples=examples(60))
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
    from minillm.spec_decode.speculator import build_speculator

    model, tok = tiny64
    engine = cached_engine(model, tok, "hash", max_num_batched_tokens=512)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        engine.use_speculator(build_speculator({"method": "ngram",
                                                "num_speculative_tokens": 2}, engine))


@pytest.mark.parametrize("answer, rule", [
    (lambda hit: hit + [7], r"block 7, which is not cached"),
    (lambda hit: hit + hit[:1], r"a block twice"),
    (lambda hit: hit + [99], r"99, not a block id of this pool"),
    (lambda hit: hit * 3, r"3 blocks for tokens that fill 2 whole blocks"),
])
def test_a_match_against_the_contract_is_refused_before_any_block_is_taken(answer, rule):
    """The block manager checks what ``match`` returns: at most one cached, distinct block of
    its pool per whole block of the tokens it asked about."""
    from minillm.cache.prefix import PrefixCacheError

    class Wrong(HashPrefixCache):
        def match(self, token_ids):
            hit = super().match(token_ids)
            return answer(hit) if hit else hit

    blocks = BlockManager(8, 4, watermark=0, prefix_cache=Wrong(4))
    toks = list(range(12))
    blocks.allocate_cached(0, toks, 12)
    blocks.cache_computed(0, toks, 8)                       # caches blocks 0 and 1 of seq 0
    free = blocks.num_free
    with pytest.raises(PrefixCacheError, match="prefix_cache: Wrong.match returned " + rule):
        blocks.allocate_cached(1, toks[:4] + [50] * 5, 9)   # asks about 2 whole blocks
    assert 1 not in blocks.tables and blocks.num_free == free
    blocks.check()


def test_the_package_caches_implement_the_protocol():
    from minillm.cache.prefix import check_prefix_cache
    from minillm.engine.config import make_prefix_cache

    for kind, cls in (("hash", HashPrefixCache), ("radix", RadixPrefixCache)):
        cache = make_prefix_cache(kind, 8)
        assert type(cache) is cls and check_prefix_cache(cache, 8) is cache
        assert type(make_prefix_cache(cls, 8)) is cls            # the class is a factory
