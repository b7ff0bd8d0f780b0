"""Two of the engine's seams are real: a second, deliberately simple implementation of each,
passed in through ``EngineConfig``, serves the engine end to end and gives the package's greedy
tokens and logprobs (float64, the sharpened tiny model, prompts sharing a prefix so that the
cache hits; the logprobs, the final distribution's, show a wrong context where greedy tokens
might not: ``test_a_backend_that_forgets_the_cached_prefix_is_caught``).

- the paged attention backend (:class:`minillm.attention.paged.PagedAttentionBackend`):
  :class:`DenseBackend` gathers each sequence's K/V from the pool through its block table and
  runs causal attention written out in float64;
- the prefix cache (:class:`minillm.cache.prefix.PrefixCache`): :class:`DictPrefixCache` is a
  plain dict from the tuple of all tokens up to a block's end to the block, LRU by a counter.

A component that breaks its contract gets a ValueError naming the option and the rule; a
request whose prefix lookup fails leaves no block taken.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
from engine_checks import assert_all_free, prompts_of, run_all, sharp_model

from minillm import SamplingParams
from minillm.attention.paged import PagedMetadata
from minillm.course.ch04_workload import AttentionRecorder
from minillm.engine import EngineConfig, LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
BS = 8
SYSTEM = prompts_of([41], seed=9, vocab=2000)[0]     # 41 shared tokens: 5 whole blocks of 8


class DenseBackend:
    """Each sequence alone: its positions' K/V read slot by slot through its block table, the
    query heads of a KV head sharing it, causal softmax(q k^T / sqrt(D)) v in float64."""

    name = "dense reference"
    reads_direct = False
    cpu_fast_path = False

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: PagedMetadata) -> torch.Tensor:
        assert not meta.has_masks, "this reference has no tree masks"
        self.calls += 1
        block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
        out = torch.empty_like(q)
        for s, (start, ctx, n) in enumerate(zip(meta.starts, meta.ctx_lens, meta.q_lens)):
            table = meta.block_tables[s].tolist()
            slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                                  for p in range(ctx + n)], device=q.device)
            keys, values = (c.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
                            for c in (k_cache, v_cache))                    # [L, Hq, D]
            query = q[start:start + n].double()                            # [n, Hq, D]
            scores = torch.einsum("nhd,lhd->hnl", query, keys) / math.sqrt(q.shape[-1])
            seen = torch.arange(ctx + n)[None, :] <= ctx + torch.arange(n)[:, None]   # [n, L]
            scores = scores.masked_fill(~seen.to(q.device), float("-inf"))
            out[start:start + n] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1),
                                                values).to(q.dtype)
        return out


class DictPrefixCache:
    """Whole blocks in a dict keyed by every token up to the block's end; idle blocks evicted
    least recently used first (a counter stamps each use)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.block_of: dict[tuple[int, ...], int] = {}
        self.key_of: dict[int, tuple[int, ...]] = {}
        self.idle: set[int] = set()
        self.used: dict[int, int] = {}
        self.clock = self.evicted = 0

    def _use(self, block: int) -> None:
        self.clock += 1
        self.used[block] = self.clock

    def match(self, token_ids: Sequence[int]) -> list[int]:
        blocks = []
        for end in range(self.block_size, len(token_ids) + 1, self.block_size):
            block = self.block_of.get(tuple(token_ids[:end]))
            if block is None:
                break
            blocks.append(block)
            self._use(block)
        return blocks

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int]) -> list[int]:
        added = []
        for i, block in enumerate(blocks):
            key = tuple(token_ids[:(i + 1) * self.block_size])
            if key in self.block_of:
                continue
            if block in self.key_of:
                raise ValueError(f"block {block} is cached for other tokens")
            self.block_of[key], self.key_of[block] = block, key
            added.append(block)
            self._use(block)
        return added

    def acquire(self, block: int) -> None:
        self.idle.discard(block)

    def release(self, block: int) -> None:
        self.idle.add(block)
        self._use(block)

    def evict(self) -> int | None:
        if not self.idle:
            return None
        block = min(self.idle, key=self.used.__getitem__)
        self.idle.remove(block)
        del self.block_of[self.key_of.pop(block)], self.used[block]
        self.evicted += 1
        return block

    @property
    def num_evictable(self) -> int:
        return len(self.idle)

    def __contains__(self, block: int) -> bool:
        return block in self.key_of


@pytest.fixture(scope="module")
def model():
    return sharp_model(max_seq_len=256, vocab_size=2000)


def shared_prompts() -> list[list[int]]:
    return [SYSTEM + q for q in prompts_of([3, 11, 17, 6, 25], seed=4)]


def engine_of(model, **options) -> LLMEngine:
    return LLMEngine(model, None, EngineConfig(**{"num_kv_blocks": 120, "block_size": BS,
                                                  **options}))


Result = list[tuple[list[int], list[dict[int, float]]]]


def results(outputs) -> Result:
    """Each request's greedy tokens and, per token, the logprobs of the top two."""
    return [(o.token_ids, o.outputs[0].logprobs) for o in outputs]


def served(engine: LLMEngine, prompts) -> Result:
    """The first prompt alone (it fills the cache), then all of them."""
    first = run_all(engine, prompts[:1], GREEDY)
    return results(first + run_all(engine, prompts, GREEDY))


def assert_same(got: Result, want: Result) -> None:
    """The same tokens, and logprobs within 1e-8 (float64)."""
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        for x, y in zip(a, b, strict=True):
            assert x.keys() == y.keys()
            assert all(abs(x[t] - y[t]) < 1e-8 for t in x), (x, y)


@pytest.fixture(scope="module")
def expected(model) -> Result:
    """The package's: sdpa, no prefix cache."""
    return served(engine_of(model, attention_backend="sdpa"), shared_prompts())


# ---- the attention backend ----------------------------------------------------------------------
def test_a_dense_reference_backend_serves_the_engine(model, expected):
    backend = DenseBackend()
    engine = engine_of(model, attention_backend=backend)
    assert engine.runner.attn is backend and engine.runner.attention_backend == "dense reference"
    assert_same(served(engine, shared_prompts()), expected)
    assert backend.calls == engine.num_steps * model.cfg.n_layers     # every layer, every step


class ForgetsPrefix(DenseBackend):
    """Wrong on purpose: each sequence attends causally over its new tokens' k, v only, as if
    nothing were cached (right for a prompt's first chunk, wrong for everything after)."""

    def __call__(self, q, k, v, k_cache, v_cache, meta):
        group = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        for start, n in zip(meta.starts, meta.q_lens):
            rows = slice(start, start + n)
            keys, values = (x[rows].repeat_interleave(group, dim=1).transpose(0, 1)
                            for x in (k, v))
            out[rows] = F.scaled_dot_product_attention(q[rows].transpose(0, 1), keys, values,
                                                       is_causal=True).transpose(0, 1)
        return out


def test_a_backend_that_forgets_the_cached_prefix_is_caught(model, expected):
    """The comparison can fail: a backend wrong only where a sequence has a cached prefix."""
    got = served(engine_of(model, attention_backend=ForgetsPrefix()), shared_prompts())
    with pytest.raises(AssertionError):
        assert_same(got, expected)


def test_a_recording_wrapper_sees_every_step_and_changes_nothing(model, expected):
    recorder = AttentionRecorder("sdpa")
    engine = engine_of(model, attention_backend=recorder)
    assert_same(served(engine, shared_prompts()), expected)
    assert len(recorder.steps) == engine.num_steps
    first = recorder.steps[0]
    assert first["q"].shape == first["out"].shape == (len(SYSTEM) + 3, model.cfg.n_heads,
                                                      model.cfg.head_dim)


def test_a_backend_breaking_the_protocol_is_refused_by_name():
    class NoCall:
        name, reads_direct, cpu_fast_path = "x", False, False

    class NoFlags:
        name = "x"

        def __call__(self, q, k, v, k_cache, v_cache, meta):
            return q

    with pytest.raises(ValueError, match=r"attention_backend.*NoCall.*callable"):
        EngineConfig(attention_backend=NoCall())
    with pytest.raises(ValueError, match=r"attention_backend.*`reads_direct`.*`cpu_fast_path`"):
        EngineConfig(attention_backend=NoFlags())
    with pytest.raises(ValueError, match=r"attention_backend.*`name`"):
        EngineConfig(attention_backend=lambda *args: args[0])
    with pytest.raises(ValueError, match=r"attention_backend must be one of \['cpu', 'sdpa', "
                                         r"'triton'\].*'flash'"):
        EngineConfig(attention_backend="flash")


# ---- the prefix cache ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["hash", "radix", DictPrefixCache])
def test_a_dict_prefix_cache_gives_the_package_caches_tokens(model, expected, kind):
    engine = engine_of(model, attention_backend="sdpa", enable_prefix_caching=True,
                       prefix_cache=kind)
    assert_same(served(engine, shared_prompts()), expected)
    assert engine.blocks.prefix_hit >= len(shared_prompts()) * len(SYSTEM) // BS * BS
    if kind is DictPrefixCache:
        assert isinstance(engine.blocks.prefix, DictPrefixCache)


def test_both_seams_at_once_under_eviction(model, expected):
    """A pool too small to keep every prefix: the dict cache evicts, hits still happen, the
    tokens are the package's, and every block ends free."""
    engine = engine_of(model, num_kv_blocks=14, max_num_seqs=2, attention_backend=DenseBackend(),
                       enable_prefix_caching=True, prefix_cache=DictPrefixCache)
    assert_same(served(engine, shared_prompts()), expected)
    cache = engine.blocks.prefix
    assert cache.evicted > 0 and engine.blocks.prefix_hit > 0
    assert_all_free(engine)


def test_each_engine_builds_its_own_cache(model):
    config = EngineConfig(num_kv_blocks=40, block_size=BS, enable_prefix_caching=True,
                          prefix_cache=DictPrefixCache)
    a, b = LLMEngine(model, None, config), LLMEngine(model, None, config)
    assert a.blocks.prefix is not b.blocks.prefix and a.blocks.prefix.block_size == BS


def test_a_prefix_cache_breaking_the_protocol_is_refused_by_name(model):
    with pytest.raises(ValueError, match=r"prefix_cache.*factory.*DictPrefixCache"):
        EngineConfig(enable_prefix_caching=True, prefix_cache=DictPrefixCache(BS))
    with pytest.raises(ValueError, match=r"prefix_cache must be one of \('hash', 'radix'\)"):
        EngineConfig(enable_prefix_caching=True, prefix_cache="lru")

    class Lacking:
        def __init__(self, block_size: int) -> None:
            self.block_size = block_size

        def match(self, token_ids):
            return []

    with pytest.raises(ValueError, match=r"prefix_cache.*Lacking.*lacks insert, acquire, "
                                         r"release, evict, num_evictable, __contains__"):
        engine_of(model, enable_prefix_caching=True, prefix_cache=Lacking)
    with pytest.raises(ValueError, match=r"prefix_cache.*block_size=4.*8 tokens"):
        engine_of(model, enable_prefix_caching=True, prefix_cache=lambda bs: DictPrefixCache(4))


class Poisoned(DictPrefixCache):
    """Right for every prompt but those starting with token 7, for which ``match`` breaks the
    contract in the way ``how`` says."""

    how = "uncached"

    def match(self, token_ids: Sequence[int]) -> list[int]:
        blocks = super().match(token_ids)
        if not token_ids or token_ids[0] != 7:
            return blocks
        if self.how == "uncached":
            return blocks + [next(b for b in range(10_000) if b not in self)]
        if self.how == "too_many":
            return blocks + list(range(len(token_ids) // self.block_size + 1))
        return blocks + blocks[:1]                                  # a repeat


@pytest.mark.parametrize("how, rule", [
    ("uncached", r"returned block \d+, which is not cached.*only cached blocks"),
    ("too_many", r"returned \d+ blocks for tokens that fill \d+ whole blocks"),
])
def test_a_bad_match_fails_that_request_and_leaks_nothing(model, expected, how, rule):
    """The lookup's answer is checked before any block is taken: the request whose lookup
    broke the contract ends with finish_reason "error" and a message naming ``prefix_cache``
    and the rule; the engine serves the others with the package's tokens, and every block
    ends free."""
    cache_type = type("Poisoned_" + how, (Poisoned,), {"how": how})
    engine = engine_of(model, enable_prefix_caching=True, prefix_cache=cache_type,
                       attention_backend="sdpa")
    prompts = shared_prompts()
    assert_same(results(run_all(engine, prompts[:1], GREEDY)), expected[:1])
    good = [engine.add_request(p, GREEDY) for p in prompts[1:3]]
    bad = engine.add_request([7] + SYSTEM, GREEDY)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.blocks.check()
    assert done[bad].outputs[0].finish_reason == "error"
    assert re.search(r"prefix_cache: Poisoned_\w+\.match " + rule, done[bad].error)
    assert_same(results([done[r] for r in good]), expected[2:4])
    assert_all_free(engine)
