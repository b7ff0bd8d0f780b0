"""Checkers for the exercises of chapter 08 (KV cache management and offload).

- :func:`check_block_hashes`: a key for every full block that names the block's tokens *and
  everything before them* (vLLM's hash chain), checked by what keys must tell apart.
- :func:`check_block_hashes_in_engine`: those keys are the engine's prefix cache
  (:class:`FunctionHashCache`) on a shared-prompt workload.
- :func:`check_radix_insert`: insert into a radix tree of plain dict nodes, splitting edges,
  compared with :class:`minillm.cache.radix.TokenRadixTree` on seeded insert sequences.
- :func:`check_radix_cache`: a block prefix cache over a radix tree (one node per block, LRU
  eviction of unreferenced leaves) next to :class:`minillm.cache.radix.RadixPrefixCache` under
  two block managers driven alike.
- :func:`check_radix_cache_in_engine`: that cache serves the engine's prefix hits, with
  evictions.
- :func:`check_blocks_to_load`: which blocks a tiered KV store loads for a request, compared
  with the package's scheduler half of the store's connector.
- :func:`check_select_tokens`: CacheBlend's choice of tokens to recompute (the ``always`` ones
  plus the ``num`` others whose KV deviates most), compared with :func:`select_tokens` below
  (the rule of ``minillm.cache.blend.select_tokens``, not imported here).

The radix exercise's tree is plain data: a node is ``{"edge": tuple of tokens, "children":
{first token: node}}`` and the root has an empty edge (:func:`new_tree`); :func:`dump_tree`
lists its edges in the order of ``TokenRadixTree.dump``.
"""
from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from ..cache.block_manager import BlockManager, blocks_for
from ..cache.block_pool import NoFreeBlocksError
from ..cache.offload import OffloadConfig, TieredKVStore
from ..cache.prefix import HashPrefixCache
from ..cache.radix import RadixPrefixCache, TokenRadixTree
from ..engine import EngineConfig, LLMEngine
from ..engine.connector import StoreConnector
from ..model.transformer import Transformer
from .common import Result, check
from .in_engine import assert_same_outputs, demo_model, serve_in_turn

# --- hashed full blocks --------------------------------------------------------------------


def _hash_groups() -> list[tuple[list[list[int]], int]]:
    """(token lists, block_size): lists that share prefixes, hold equal blocks under different
    prefixes (shifted by whole blocks) and repeat a block, over small alphabets."""
    groups = [([[1, 2, 7, 7], [3, 4, 7, 7]], 2), ([[], [1, 2, 3]], 4),
              ([[1, 2, 3, 4], [1, 2, 3, 4, 5]], 4), ([[5] * 9, [5] * 4], 4),
              ([[1, 2, 3], [1, 2, 4]], 1), ([[1, 2, 3, 4, 5, 6], [9, 9, 3, 4, 5, 6]], 2)]
    rng = random.Random(8)
    for _ in range(40):
        bs = rng.choice([1, 2, 3, 4, 8, 16])
        base = [rng.randint(0, 3) for _ in range(rng.randint(0, 5 * bs + 3))]
        group = [base]
        for _ in range(rng.randint(1, 4)):
            cut = rng.randint(0, len(base))
            kind = rng.random()
            if kind < 0.4:      # the same start, then other tokens
                group.append(base[:cut] + [rng.randint(0, 3) for _ in range(rng.randint(0, 9))])
            elif kind < 0.7:    # the same blocks under another prefix
                shift = bs * rng.randint(1, 3)
                group.append([rng.randint(0, 3) for _ in range(shift)] + base)
            else:               # the base without its first blocks
                group.append(base[bs * rng.randint(1, 2):])
        groups.append((group, bs))
    return groups


def check_block_hashes(fn: Callable) -> Result:
    """``fn(token_ids, block_size)`` -> one int key per full block (a partial last block has
    none), such that block i of two token lists gets equal keys exactly when the lists agree
    on every token up to the end of block i: a key names its block's tokens and everything
    before them. Checked first on an equal block under two different prefixes, then on seeded
    groups of lists (shared starts, equal blocks under other prefixes, repeated blocks): every
    key of every list is compared with every other; the same call twice gives the same keys."""
    groups = _hash_groups()

    def attempt() -> None:
        a, b = fn([1, 2, 7, 7], 2), fn([3, 4, 7, 7], 2)
        assert len(a) == len(b) == 2, f"two full blocks of 2 tokens each: got {a} and {b}"
        assert a[1] != b[1], ("the block [7, 7] after [1, 2] and after [3, 4] got the same key "
                              f"{a[1]}: a key must cover its parent's key, not only its tokens")
        for group, bs in groups:
            key_of: dict[tuple, Any] = {}              # prefix -> its key
            for ids in group:
                keys = list(fn(list(ids), bs))
                what = f"token_ids={ids}, block_size={bs}"
                assert len(keys) == len(ids) // bs, (
                    f"{what}: expected {len(ids) // bs} keys (one per full block), got "
                    f"{len(keys)}: {keys}")
                assert all(isinstance(k, int) and not isinstance(k, bool) for k in keys), (
                    f"{what}: the keys must be ints (Python's hash gives one), got {keys}")
                assert list(fn(list(ids), bs)) == keys, f"{what}: a second call gave other keys"
                for i, key in enumerate(keys):
                    prefix = tuple(ids[:(i + 1) * bs])
                    seen = key_of.setdefault(prefix, key)
                    assert seen == key, (f"block_size={bs}: the prefix {list(prefix)} got the "
                                         f"keys {seen} and {key}")
            by_key: dict[Any, tuple] = {}
            for prefix, key in key_of.items():
                other = by_key.setdefault(key, prefix)
                assert other == prefix, (
                    f"block_size={bs}: the prefixes {list(other)} and {list(prefix)} got the "
                    f"same key {key}: a block's key must cover its parent's key and its tokens")

    return check("block_hashes", attempt)


# --- radix tree insert ---------------------------------------------------------------------


def new_tree() -> dict:
    """An empty tree: the root node (empty edge, no children)."""
    return {"edge": (), "children": {}}


def dump_tree(root: dict) -> list[tuple[tuple, tuple]]:
    """Every edge as ``(parent_path, edge)``, depth first, children by first token: the format
    and order of :meth:`minillm.cache.radix.TokenRadixTree.dump`."""
    out: list[tuple[tuple, tuple]] = []

    def walk(node: dict, path: tuple) -> None:
        for key in sorted(node["children"], key=repr):
            child = node["children"][key]
            out.append((path, tuple(child["edge"])))
            walk(child, path + tuple(child["edge"]))

    walk(root, ())
    return out


def _radix_cases():
    """Insert sequences: hand-made ones (split, end inside an edge, repeat, extension), then
    seeded random ones over small alphabets so that sequences share prefixes."""
    cases = [["abcd", "abxy"], ["abcd", "ab"], ["ab", "abcd"], ["abc", "abc"],
             ["abcd", "abxy", "abxz", "a", "b"], ["hello", "help", "helium", "he"]]
    rng = random.Random(3)
    for _ in range(80):
        alphabet = rng.choice(["ab", "abc", "abcd"])
        base = [rng.choice(alphabet) for _ in range(rng.randint(1, 8))]
        seqs = []
        for _ in range(rng.randint(1, 7)):
            keep = base[:rng.randint(0, len(base))]
            seqs.append("".join(keep + [rng.choice(alphabet) for _ in range(rng.randint(0, 5))])
                        or "a")
        cases.append(seqs)
    cases.append([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4, 6], [7]])
    return cases


def check_radix_insert(fn: Callable) -> Result:
    """``fn(root, tokens)`` inserts the sequence ``tokens`` into the tree under ``root`` (dict
    nodes, see the module doc) in place and returns how many of its leading tokens the tree
    already held. A sequence that leaves an edge part-way, or ends inside one, splits that edge
    so that a node stands where it diverges (or ends). After every insert, the returned count
    and the whole tree (:func:`dump_tree`) are compared with ``TokenRadixTree``'s."""
    cases = _radix_cases()

    def attempt() -> None:
        for seqs in cases:
            root, ref = new_tree(), TokenRadixTree()
            for k, seq in enumerate(seqs):
                tokens = list(seq)
                want_n, got_n = ref.insert(tokens), fn(root, tokens)
                before = f"after inserting {seqs[:k]}, inserting {seq!r}"
                assert got_n == want_n, (f"{before}: expected {want_n} tokens already in the "
                                         f"tree, got {got_n}")
                want, got = ref.dump(), dump_tree(root)
                assert got == want, (f"{before}: expected the edges (parent path, edge) "
                                     f"{want}, got {got}")

    return check("radix_insert", attempt)


# --- a radix tree as the block manager's prefix cache ----------------------------------------

Event = tuple  # ("admit", k, token_ids) | ("compute", k) | ("finish", k)


def _cache_cases() -> list[tuple[int, int, list[Event]]]:
    """(block_size, num_blocks, events) for two block managers driven alike: hand-made ones
    (a hit; a prefix left unreferenced under a block still in use; eviction under a small pool),
    then seeded random ones whose prompts share system prompts over a small alphabet."""
    cyclic = [[1, 2, 3, 4, 0], [5, 6, 7, 8, 0], [1, 2, 3, 4, 1], [9, 9, 9, 9, 0],
              [1, 2, 3, 4, 2], [5, 6, 7, 8, 1]]
    cases: list[tuple[int, int, list[Event]]] = [
        (2, 8, [("admit", 0, [1, 2, 3, 4, 5]), ("compute", 0), ("finish", 0),
                ("admit", 1, [1, 2, 3, 4, 9]), ("compute", 1), ("finish", 1),
                ("admit", 2, [1, 2, 7, 7, 7]), ("compute", 2), ("finish", 2)]),
        (2, 10, [("admit", 0, [1, 2, 3, 4, 9]), ("admit", 1, [1, 2, 3, 4, 5, 6, 9]),
                 ("compute", 0), ("compute", 1), ("finish", 0), ("admit", 2, [1, 2, 3, 8, 8]),
                 ("compute", 2), ("finish", 1), ("finish", 2)]),
        (2, 6, [e for k, ids in enumerate(cyclic)
                for e in (("admit", k, ids), ("compute", k), ("finish", k))]),
    ]
    rng = random.Random(11)
    for _ in range(30):
        bs = rng.choice([1, 2, 3, 4])
        systems = [[rng.randrange(4) for _ in range(bs * rng.randint(1, 4))] for _ in range(3)]
        events: list[Event] = []
        admitted: list[int] = []
        computed: set[int] = set()
        for k in range(rng.randint(4, 14)):
            question = [rng.randrange(4) for _ in range(rng.randint(1, 2 * bs + 1))]
            ids = rng.choice(systems) + question
            events.append(("admit", k, ids))
            admitted.append(k)
            while admitted and rng.random() < 0.6:
                j = rng.choice(admitted)
                if j not in computed and rng.random() < 0.8:
                    events.append(("compute", j))
                    computed.add(j)
                else:
                    events.append(("finish", j))
                    admitted.remove(j)
        events += [("finish", j) for j in admitted]
        cases.append((bs, rng.randint(6, 16), events))
    return cases


def _cached(cache: Any, num_blocks: int) -> list[int]:
    return [b for b in range(num_blocks) if b in cache]


def _drive(cls: Callable[[int], Any], block_size: int, num_blocks: int,
           events: list[Event]) -> None:
    """Drive a block manager over ``cls(block_size)`` and one over the package's
    RadixPrefixCache through ``events`` (an admission that does not fit the package's pool is
    skipped); AssertionError at the first difference in what they find, hold, count free or
    cache, and in the order repeated evictions give at the end."""
    mine_cache, ref_cache = cls(block_size), RadixPrefixCache(block_size)
    mine, ref = (BlockManager(num_blocks, block_size, watermark=0.0, prefix_cache=c)
                 for c in (mine_cache, ref_cache))
    live: dict[int, list[int]] = {}
    log: list[str] = []

    def where() -> str:
        shown = "; ".join(log[-6:])
        more = f"{len(log) - 6} earlier events; " if len(log) > 6 else ""
        return f"block_size={block_size}, pool of {num_blocks} blocks, after {more}{shown}"

    for event in events:
        kind, k = event[0], event[1]
        if kind == "admit":
            ids = event[2]
            if ref.cached_need(ids, len(ids)) > ref.num_free:
                continue
            live[k] = ids
            want = ref.allocate_cached(k, ids, len(ids))
            log.append(f"admit {k} {ids}")
            got = mine.allocate_cached(k, ids, len(ids))
            assert got == want, (f"{where()}: match found {got // block_size} cached blocks "
                                 f"of request {k}, expected {want // block_size}")
            assert mine.tables[k] == ref.tables[k], (
                f"{where()}: request {k} holds blocks {mine.tables[k]}, expected "
                f"{ref.tables[k]} (a different block was evicted or matched)")
        elif k not in live:
            continue
        elif kind == "compute":
            log.append(f"compute {k}")
            ref.cache_computed(k, live[k], len(live[k]))
            mine.cache_computed(k, live[k], len(live[k]))
        else:
            log.append(f"finish {k}")
            del live[k]
            ref.free(k)
            mine.free(k)
        got_cached, want_cached = _cached(mine_cache, num_blocks), _cached(ref_cache, num_blocks)
        assert got_cached == want_cached, (f"{where()}: cached blocks {got_cached}, expected "
                                           f"{want_cached}")
        assert mine_cache.num_evictable == ref_cache.num_evictable, (
            f"{where()}: num_evictable {mine_cache.num_evictable}, expected "
            f"{ref_cache.num_evictable} (cached blocks {want_cached})")
    order, want_order = [], []
    while (block := ref_cache.evict()) is not None:
        want_order.append(block)
    while len(order) <= len(want_order) and (block := mine_cache.evict()) is not None:
        order.append(block)
    assert order == want_order, (f"{where()}; then evict() until None: {order}, expected "
                                 f"{want_order} (least recently used leaves first)")


def check_radix_cache(cls: Callable[[int], Any]) -> Result:
    """``cls(block_size)``: a prefix cache over a radix tree with one node per cached block,
    implementing :class:`minillm.cache.prefix.PrefixCache` (``match``, ``insert``,
    ``acquire``, ``release``, ``evict``, ``num_evictable``, ``block in cache``). Its
    least-recently-used order: the blocks ``match`` returns and those ``insert`` walks
    through, in order, then a released block, count as used now. ``evict`` takes the least
    recently used leaf that is not referenced. Two :class:`BlockManager` s, one over it and
    one over :class:`~minillm.cache.radix.RadixPrefixCache`, admit, compute and finish the
    same requests (hand-made and seeded sequences, pools small enough to evict): after every
    event the same cached blocks found and held, the same blocks cached and evictable; at
    the end, the same order of evictions."""
    cases = _cache_cases()

    def attempt() -> None:
        for bs, nb, events in cases:
            _drive(cls, bs, nb, events)

    return check("radix_cache", attempt)


# --- the student's caches inside the engine ------------------------------------------------


class FunctionHashCache(HashPrefixCache):
    """The package's hash prefix cache (vLLM's) with every key computed by ``fn``, a function
    with :func:`check_block_hashes`'s contract: ``fn(token_ids, block_size)`` -> the key of
    each full block. The cache looks a prompt up one key at a time, stopping at the first
    miss, and registers each newly filled block under its key. Build one per engine with
    ``EngineConfig(enable_prefix_caching=True, prefix_cache=functools.partial(
    FunctionHashCache, fn))``."""

    def __init__(self, fn: Callable[[list[int], int], Sequence], block_size: int) -> None:
        super().__init__(block_size)
        self.fn = fn

    def keys(self, token_ids: Sequence[int]):
        return iter(self.fn(list(token_ids), self.block_size))


class CountingRadixCache(RadixPrefixCache):
    """The package's radix cache, counting the blocks it evicts (``evictions``)."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.evictions = 0

    def evict(self) -> int | None:
        block = super().evict()
        self.evictions += block is not None
        return block


def demo_shared_prompts(block_size: int = 4) -> tuple[list[list[int]], list[int]]:
    """Eight seeded prompts over three system prompts of six blocks and one token each, in
    the order 0 1 0 2 0 1 0 2 (the first comes back every other request), each with a question
    of 2-6 tokens; output lengths of 4-8 tokens."""
    g = torch.Generator().manual_seed(8)
    systems = [torch.randint(5, 2000, (6 * block_size + 1,), generator=g).tolist()
               for _ in range(3)]
    prompts = [systems[s] + torch.randint(5, 2000, (int(torch.randint(2, 7, (1,),
                                                                      generator=g)),),
                                          generator=g).tolist()
               for s in (0, 1, 0, 2, 0, 1, 0, 2)]
    return prompts, torch.randint(4, 9, (len(prompts),), generator=g).tolist()


def _ms(run: dict) -> str:
    return f"{1e3 * sum(run['ttft']) / len(run['ttft']):.1f} ms"


def check_block_hashes_in_engine(fn: Callable, model: Transformer | None = None,
                                 prompts: list[list[int]] | None = None,
                                 output_lens: list[int] | None = None,
                                 block_size: int = 4) -> Result:
    """Exercise 1's ``block_hashes`` keys the engine's prefix cache
    (:class:`FunctionHashCache`): ``prompts`` (default :func:`demo_shared_prompts`) and, after
    them, the first prompt without its first block (its blocks are the first prompt's, under
    another prefix) are served one after another on ``model`` (default: the tiny preset,
    random weights, float64). Passes when every request gets the tokens of the engine without
    a cache with the same log-probabilities (``in_engine.assert_same_outputs``), the hit rate is the
    package's hash cache's (above zero), and every block is free at the end; prints the hit
    rates and mean TTFTs."""
    model = model or demo_model()
    if prompts is None:
        prompts, output_lens = demo_shared_prompts(block_size)
    prompts = list(prompts) + [list(prompts[0][block_size:])]
    output_lens = list(output_lens) + [output_lens[0]]
    pool = sum(blocks_for(len(p) + m, block_size) for p, m in zip(prompts, output_lens)) + 8
    opts = dict(num_kv_blocks=pool, block_size=block_size)

    def attempt() -> None:
        fn([1, 2, 3, 4], 2)                    # a stub raises NotImplementedError here
        none = serve_in_turn(LLMEngine(model, None, EngineConfig(**opts)), prompts, output_lens)
        ref = serve_in_turn(LLMEngine(model, None, EngineConfig(
            enable_prefix_caching=True, prefix_cache="hash", **opts)), prompts, output_lens)
        mine = serve_in_turn(LLMEngine(model, None, EngineConfig(
            enable_prefix_caching=True, prefix_cache=functools.partial(FunctionHashCache, fn),
            **opts)), prompts, output_lens)
        assert_same_outputs(mine, none, next(model.parameters()).dtype)
        assert ref["hit_rate"] > 0, "no prompt shares a full block with an earlier one"
        assert abs(mine["hit_rate"] - ref["hit_rate"]) < 1e-12, (
            f"the same outputs, but a hit rate of {mine['hit_rate']:.3f} where the package's "
            f"hash cache finds {ref['hit_rate']:.3f}")
        print(f"{len(prompts)} requests in turn: your keys: hit rate {mine['hit_rate']:.2f}, "
              f"mean TTFT {_ms(mine)}; the package's hash cache: {ref['hit_rate']:.2f}, "
              f"{_ms(ref)}; no cache: {_ms(none)}")

    return check("block_hashes_in_engine", attempt)


def _probe(cls: Callable[[int], Any], block_size: int) -> None:
    """One block through a new ``cls(block_size)``: insert, match, release, num_evictable,
    evict. NotImplementedError passes through (not attempted); any other error is a FAIL."""
    cache = cls(block_size)
    try:
        cache.insert(list(range(block_size)), [0])
        cache.match(list(range(block_size)))
        cache.release(0)
        found, evictable, evicted = cache.match(list(range(block_size))), \
            cache.num_evictable, cache.evict()
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - the student's error, with what was being done
        raise AssertionError(f"one block inserted, matched, released and evicted: "
                             f"{type(e).__name__}: {e}") from e
    assert (found, evictable, evicted) == ([0], 1, 0), (
        f"one block 0 inserted and released: match found {found}, num_evictable "
        f"{evictable}, evict() gave {evicted}; expected [0], 1 and 0")


def check_radix_cache_in_engine(cls: Callable[[int], Any], model: Transformer | None = None,
                                prompts: list[list[int]] | None = None,
                                output_lens: list[int] | None = None, block_size: int = 4,
                                num_kv_blocks: int | None = None) -> Result:
    """Exercise 3's cache class is the engine's prefix cache
    (``EngineConfig(prefix_cache=cls)``): ``prompts`` (default :func:`demo_shared_prompts`)
    are served one after another on ``model`` (default: the tiny preset, random weights,
    float64) in a pool of ``num_kv_blocks`` (default: room for the two largest requests and
    one block more), small enough that the package's radix cache evicts. Passes when every
    request gets the tokens of the engine without a cache with the same log-probabilities
    (``in_engine.assert_same_outputs``), the hit rate is the package's radix cache's (above zero),
    the package's cache evicted, and every block is free at the end; prints the hit rates,
    evictions and mean TTFTs."""
    model = model or demo_model()
    if prompts is None:
        prompts, output_lens = demo_shared_prompts(block_size)
    if num_kv_blocks is None:
        largest = sorted(blocks_for(len(p) + m, block_size) for p, m in zip(prompts, output_lens))
        num_kv_blocks = sum(largest[-2:]) + 1
    opts = dict(num_kv_blocks=num_kv_blocks, block_size=block_size, watermark=0.0)

    def attempt() -> None:
        _probe(cls, block_size)                # a stub raises NotImplementedError here
        none = serve_in_turn(LLMEngine(model, None, EngineConfig(**opts)), prompts, output_lens)
        package = LLMEngine(model, None, EngineConfig(enable_prefix_caching=True,
                                                      prefix_cache=CountingRadixCache, **opts))
        ref = serve_in_turn(package, prompts, output_lens)
        try:
            mine = serve_in_turn(LLMEngine(model, None, EngineConfig(
                enable_prefix_caching=True, prefix_cache=cls, **opts)), prompts, output_lens)
        except NoFreeBlocksError as e:
            raise AssertionError(f"the pool ran dry ({e}): num_evictable promised blocks that "
                                 f"evict() did not give") from e
        assert_same_outputs(mine, none, next(model.parameters()).dtype)
        evictions = package.blocks.prefix.evictions
        assert ref["hit_rate"] > 0 and evictions > 0, (
            f"the package's radix cache found {ref['hit_rate']:.2f} of the prompt tokens and "
            f"evicted {evictions} blocks: give a workload with shared prefixes and a pool "
            f"({num_kv_blocks} blocks) too small for all of them")
        assert abs(mine["hit_rate"] - ref["hit_rate"]) < 1e-12, (
            f"the same outputs, but a hit rate of {mine['hit_rate']:.3f} where the package's "
            f"radix cache finds {ref['hit_rate']:.3f} (which blocks are evicted decides what "
            f"is found)")
        print(f"{len(prompts)} requests in turn, a pool of {num_kv_blocks} blocks: your cache: "
              f"hit rate {mine['hit_rate']:.2f}, mean TTFT {_ms(mine)}; the package's radix "
              f"cache: {ref['hit_rate']:.2f} ({evictions} blocks evicted), {_ms(ref)}; no "
              f"cache: {_ms(none)}")

    return check("radix_cache_in_engine", attempt)


# --- the tiered store: which blocks to load --------------------------------------------------


def _load_range(num_tokens: int, device_blocks: int, stored: Sequence[bool], block_size: int,
                chunk_tokens: int) -> tuple[int, int]:
    """What the package loads: a store holding exactly the ``stored`` chunks of a prompt of
    ``num_tokens`` tokens, asked through its connector's scheduler half as the scheduler asks
    it; the load covers the blocks past the device hit."""
    token_ids = list(range(100, 100 + num_tokens))
    store = TieredKVStore(OffloadConfig(cpu_bytes=1 << 20, chunk_tokens=chunk_tokens), b"",
                          block_size)
    for key, held in zip(store.keys(token_ids), stored):
        if held:
            store.cpu.put(key, torch.zeros(1))
    found = StoreConnector(store).num_external_tokens(SimpleNamespace(token_ids=token_ids),
                                                      device_blocks * block_size)
    return device_blocks, max(device_blocks, found // block_size)


def _load_cases() -> list[tuple[int, int, list[bool], int, int]]:
    cases = [(64, 0, [True, True], 4, 32), (64, 0, [True, False], 4, 32),
             (65, 0, [True, True], 4, 32), (64, 3, [True, True], 4, 32),
             (70, 10, [True, True], 4, 32), (40, 2, [False], 4, 32), (10, 0, [], 4, 16),
             (48, 0, [False, True, True], 4, 16), (33, 1, [True, True], 16, 16)]
    rng = random.Random(6)
    for _ in range(80):
        bs = rng.choice([1, 2, 4, 8, 16])
        chunk = bs * rng.choice([1, 2, 4])
        n = rng.randint(1, 12 * chunk)
        run = rng.randint(0, n // chunk)
        stored = [i < run or rng.random() < 0.3 for i in range(n // chunk)]
        cases.append((n, rng.randint(0, (n - 1) // bs), stored, bs, chunk))
    return cases


def check_blocks_to_load(fn: Callable[..., tuple[int, int]]) -> Result:
    """``fn(num_tokens, device_blocks, stored, block_size, chunk_tokens)`` -> ``(first,
    last)``: the blocks [first, last) a tiered KV store loads into a new request's blocks. The
    prompt has ``num_tokens`` tokens; the device's prefix cache found its first
    ``device_blocks`` blocks; ``stored[c]`` says whether the store holds whole chunk c of the
    prompt (``chunk_tokens`` tokens, a multiple of ``block_size``). The store supplies the
    leading run of stored chunks, never the last token's block, and loads only what the
    device lacks: ``(device_blocks, device_blocks)`` when that is nothing. Compared with the
    package's store asked through its connector (:class:`StoreConnector`) as the scheduler
    asks it, on hand-made and seeded cases."""
    cases = _load_cases()

    def attempt() -> None:
        for n, device, stored, bs, chunk in cases:
            got = tuple(fn(n, device, list(stored), bs, chunk))
            want = _load_range(n, device, stored, bs, chunk)
            assert got == want, (f"num_tokens={n}, device_blocks={device}, stored={stored}, "
                                 f"block_size={bs}, chunk_tokens={chunk}: got {got}, expected "
                                 f"{want}")

    return check("blocks_to_load", attempt)


# --- CacheBlend: which tokens to recompute -------------------------------------------------


def select_tokens(deviation: torch.Tensor, num: int,
                  always: torch.Tensor | Sequence[int] = ()) -> torch.Tensor:
    """The checker's reference: every index of ``always`` plus the ``num`` other indices with
    the largest ``deviation`` (ties: the lower index first; ``num`` clipped to the indices left),
    sorted ascending, as a LongTensor."""
    dev = torch.as_tensor(deviation).flatten()
    keep = torch.zeros(dev.numel(), dtype=torch.bool)
    keep[torch.as_tensor(always, dtype=torch.long).flatten()] = True
    rest = (~keep).nonzero().flatten()
    order = torch.sort(dev[rest], descending=True, stable=True).indices
    keep[rest[order[:max(0, min(num, rest.numel()))]]] = True
    return keep.nonzero().flatten()


def _select_cases():
    rng = random.Random(5)
    cases = [([0.1, 0.9, 0.5, 0.9], 2, []), ([0.1, 0.9, 0.5, 0.9], 1, [1]),
             ([3.0, 3.0, 3.0], 2, []), ([1.0, 2.0], 5, [0]), ([0.5, 0.2, 0.7], 0, [2]),
             ([0.5], 1, [0]), ([0.0, 0.0, 1.0, 0.0], 2, [3])]
    for _ in range(60):
        n = rng.randint(1, 40)
        dev = [round(rng.random(), 1) for _ in range(n)]        # one decimal: many ties
        always = sorted(rng.sample(range(n), rng.randint(0, min(3, n))))
        cases.append((dev, rng.randint(0, n + 2), always))
    return cases


def check_select_tokens(fn: Callable) -> Result:
    """``fn(deviation, num, always)`` -> sorted ascending LongTensor of token indices: every
    index in ``always`` (a 1-D LongTensor, maybe empty) plus the ``num`` indices not in
    ``always`` with the largest ``deviation`` (a 1-D float tensor); ties go to the lower index;
    ``num`` is clipped to the indices available. The rule (and the call) of
    ``minillm.cache.blend.select_tokens``; compared with :func:`select_tokens` on seeded cases."""
    cases = _select_cases()

    def attempt() -> None:
        for dev, num, always in cases:
            want = select_tokens(torch.tensor(dev), num, always)
            got = fn(torch.tensor(dev), num, torch.tensor(always, dtype=torch.long))
            what = f"deviation={dev}, num={num}, always={always}"
            assert isinstance(got, torch.Tensor) and got.dtype == torch.long, (
                f"{what}: expected a LongTensor, got {type(got).__name__} "
                f"{getattr(got, 'dtype', '')}")
            assert got.tolist() == want.tolist(), (f"{what}: expected {want.tolist()}, "
                                                   f"got {got.tolist()}")

    return check("select_tokens", attempt)


__all__ = ["CountingRadixCache", "FunctionHashCache", "check_block_hashes",
           "check_block_hashes_in_engine", "check_blocks_to_load", "check_radix_cache",
           "check_radix_cache_in_engine", "check_radix_insert", "check_select_tokens",
           "demo_shared_prompts", "dump_tree", "new_tree", "select_tokens", "serve_in_turn"]
