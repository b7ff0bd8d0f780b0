"""Radix trees: the token-level tree with edge splitting, and the block prefix cache (match,
insert, reference marks, leaf-first LRU eviction), each against a brute-force reference."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from properties import examples

from minillm.cache.radix import RadixPrefixCache, TokenRadixTree

# ---- TokenRadixTree -----------------------------------------------------------------------


def test_insert_splits_an_edge():
    tree = TokenRadixTree()
    assert tree.insert("abcd") == 0
    assert tree.dump() == [((), tuple("abcd"))] and tree.num_nodes == 1
    assert tree.insert("abxy") == 2
    assert tree.dump() == [((), ("a", "b")), (("a", "b"), ("c", "d")), (("a", "b"), ("x", "y"))]
    assert tree.num_nodes == 3
    assert [tree.match_prefix(q) for q in ["abzz", "abcz", "abcdef", "abxy", "q", ""]] == \
        [2, 3, 4, 4, 0, 0]


def test_insert_ending_inside_an_edge_splits_it_and_repeats_change_nothing():
    tree = TokenRadixTree()
    tree.insert("abcd")
    assert tree.insert("ab") == 2
    assert tree.dump() == [((), ("a", "b")), (("a", "b"), ("c", "d"))]
    assert tree.insert("abcd") == 4 and tree.insert("") == 0 and tree.num_nodes == 2


def _reference_nodes(seqs: list[tuple]) -> set[tuple]:
    """Nodes of the compressed trie, by path: each inserted sequence's end and every prefix
    that two sequences continue differently."""
    nodes = {s for s in seqs if s}
    prefixes = {s[:n] for s in seqs for n in range(1, len(s))}
    for p in prefixes:
        if len({s[len(p)] for s in seqs if len(s) > len(p) and s[:len(p)] == p}) > 1:
            nodes.add(p)
    return nodes


def _reference_match(seqs: list[tuple], query: tuple) -> int:
    best = 0
    for s in seqs:
        n = 0
        while n < min(len(s), len(query)) and s[n] == query[n]:
            n += 1
        best = max(best, n)
    return best


tokens3 = st.lists(st.integers(0, 2), max_size=7).map(tuple)


@settings(max_examples=examples(300))
@given(st.lists(tokens3, max_size=8), st.lists(tokens3, max_size=6))
def test_token_tree_against_brute_force(seqs, queries):
    tree, seen = TokenRadixTree(), []
    for s in seqs:
        assert tree.insert(s) == _reference_match(seen, s)
        seen.append(s)
        paths = [parent + edge for parent, edge in tree.dump()]
        assert all(edge for _, edge in tree.dump())
        assert len(paths) == tree.num_nodes
        assert set(paths) == _reference_nodes(seen)
    for q in queries + seqs:
        assert tree.match_prefix(q) == _reference_match(seen, q)


# ---- RadixPrefixCache: hand-made cases ----------------------------------------------------


def test_match_after_insert_and_partial_blocks_never_match():
    cache = RadixPrefixCache(2)
    assert cache.insert([1, 2, 3, 4, 5], [10, 11]) == [10, 11]
    assert cache.match([1, 2, 3, 4, 5, 6]) == [10, 11]
    assert cache.match([1, 2, 3, 4]) == [10, 11]
    assert cache.match([1, 2, 3]) == [10]          # [3] is a partial block
    assert cache.match([1]) == [] and cache.match([]) == [] and cache.match([1, 9]) == []
    assert cache.num_cached == 2 and 10 in cache and 11 in cache and 5 not in cache


def test_equal_tokens_under_a_different_prefix_never_match():
    cache = RadixPrefixCache(2)
    cache.insert([1, 2, 3, 4], [10, 11])
    assert cache.match([7, 7, 3, 4]) == []
    assert cache.insert([7, 7, 3, 4], [20, 21]) == [20, 21]     # same [3, 4], other prefix
    assert cache.match([7, 7, 3, 4]) == [20, 21] and cache.match([1, 2, 3, 4]) == [10, 11]


def test_a_cached_prefix_under_another_block_is_not_registered():
    cache = RadixPrefixCache(2)
    cache.insert([1, 2, 3, 4], [10, 11])
    assert cache.insert([1, 2, 3, 4, 5, 6], [30, 31, 32]) == [32]
    assert 30 not in cache and 31 not in cache
    assert cache.match([1, 2, 3, 4, 5, 6]) == [10, 11, 32]
    assert cache.insert([1, 2, 3, 4], [10, 11]) == []            # already there: nothing new
    assert cache.num_cached == 3


def test_a_block_cached_elsewhere_is_an_error_and_changes_nothing():
    cache = RadixPrefixCache(2)
    cache.insert([1, 2], [10])
    with pytest.raises(ValueError, match="blocks"):
        cache.insert([3, 4, 5, 6], [12, 10])
    with pytest.raises(ValueError, match="blocks"):
        cache.insert([3, 4, 5, 6], [12, 12])
    assert 12 not in cache and cache.num_cached == 1 and cache.match([3, 4]) == []


def _chain(cache: RadixPrefixCache) -> None:
    """Blocks 10 -> 11 -> 12 for tokens 1..6, released root first (10 is the oldest)."""
    cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    for b in (10, 11, 12):
        cache.release(b)


def test_eviction_never_takes_a_referenced_block():
    cache = RadixPrefixCache(2)
    cache.insert([1, 2, 3, 4], [10, 11])            # fresh blocks count as acquired
    assert cache.num_evictable == 0 and cache.evict() is None
    cache.release(10)                               # 10 still has a referenced child
    assert cache.num_evictable == 0 and cache.evict() is None
    cache.release(11)
    assert cache.num_evictable == 2
    cache.acquire(11)
    assert cache.num_evictable == 0 and cache.evict() is None
    cache.release(11)
    assert cache.evict() == 11 and cache.evict() == 10 and cache.evict() is None


def test_leaves_go_first_even_when_their_parent_is_older():
    cache = RadixPrefixCache(2)
    _chain(cache)
    assert cache.num_evictable == 3
    cache.acquire(11)                               # the leaf 12 may go, 10 and 11 may not
    assert cache.num_evictable == 1
    cache.release(11)
    assert [cache.evict() for _ in range(4)] == [12, 11, 10, None]


def test_lru_order_among_leaves():
    cache = RadixPrefixCache(2)
    cache.insert([1, 2, 3, 4], [10, 11])
    cache.insert([1, 2, 5, 6], [10, 12])
    cache.insert([1, 2, 7, 8], [10, 13])
    for b in (11, 12, 13, 10):                      # release order: 11 oldest
        cache.release(b)
    assert cache.match([1, 2, 3, 4]) == [10, 11]    # 11 becomes the most recent leaf
    assert [cache.evict() for _ in range(5)] == [12, 13, 11, 10, None]


def test_inserting_a_cached_path_counts_as_use():
    cache = RadixPrefixCache(2)
    cache.insert([1, 2], [10])
    cache.insert([3, 4], [11])
    cache.release(10)
    cache.release(11)
    assert cache.insert([1, 2, 9], [10]) == []      # nothing new, but 10 was just used
    assert [cache.evict() for _ in range(3)] == [11, 10, None]


def test_match_stops_at_an_evicted_block_and_its_id_can_be_reused():
    cache = RadixPrefixCache(2)
    _chain(cache)
    assert cache.evict() == 12
    assert cache.match([1, 2, 3, 4, 5, 6]) == [10, 11]
    assert cache.evict() == 11
    assert cache.match([1, 2, 3, 4, 5, 6]) == [10] and cache.num_cached == 1
    assert cache.insert([9, 9], [12]) == [12] and cache.match([9, 9, 1]) == [12]


def test_bad_input_names_the_parameter():
    for bad in (0, -1):
        with pytest.raises(ValueError, match="block_size"):
            RadixPrefixCache(bad)
    cache = RadixPrefixCache(2)
    with pytest.raises(ValueError, match="token_ids"):
        cache.insert([1, 2, 3], [10, 11])
    with pytest.raises(ValueError, match="block"):
        cache.release(99)
    with pytest.raises(ValueError, match="block"):
        cache.acquire(99)
    assert cache.num_cached == 0


# ---- RadixPrefixCache against a brute-force model -----------------------------------------


class Model:
    """The cache as a dict: whole-block prefix (tuple ending at a block boundary) -> block,
    a set of referenced blocks and a last-use clock per block."""

    def __init__(self, bs: int) -> None:
        self.bs, self.blocks, self.ref, self.used, self.clock = bs, {}, set(), {}, 0

    def _touch(self, b: int) -> None:
        self.clock += 1
        self.used[b] = self.clock

    def _prefixes(self, tokens, n):
        return [tuple(tokens[:(i + 1) * self.bs]) for i in range(n)]

    def match(self, tokens):
        out = []
        for p in self._prefixes(tokens, len(tokens) // self.bs):
            if p not in self.blocks:
                break
            out.append(self.blocks[p])
            self._touch(self.blocks[p])
        return out

    def insert(self, tokens, blocks):
        if len(tokens) < len(blocks) * self.bs or len(set(blocks)) < len(blocks):
            raise ValueError
        prefixes = self._prefixes(tokens, len(blocks))
        where = {b: p for p, b in self.blocks.items()}
        if any(b in where and where[b] != p for p, b in zip(prefixes, blocks)):
            raise ValueError
        added = []
        for p, b in zip(prefixes, blocks):
            if p not in self.blocks:
                self.blocks[p] = b
                self.ref.add(b)
                added.append(b)
            self._touch(self.blocks[p])
        return added

    def _subtree(self, p):
        return [b for q, b in self.blocks.items() if q[:len(p)] == p]

    def evictable(self) -> int:
        return sum(not self.ref.intersection(self._subtree(p)) for p in self.blocks)

    def leaves(self) -> dict[int, tuple]:
        return {b: p for p, b in self.blocks.items()
                if b not in self.ref and len(self._subtree(p)) == 1}


BS, IDS = 2, 12
ops = st.one_of(
    st.tuples(st.just("insert"), st.lists(st.integers(0, 1), max_size=8),
              st.lists(st.integers(0, IDS - 1), max_size=5, unique=True),
              st.sampled_from(["fresh"] * 4 + ["raw", "too_many"]), st.booleans()),
    st.tuples(st.just("match"), st.lists(st.integers(0, 1), max_size=8)),
    st.tuples(st.just("acquire"), st.integers(0, IDS)),
    *[st.tuples(st.just("release"), st.integers(0, IDS))] * 3,       # (three times as likely)
    *[st.tuples(st.just("evict"),)] * 2,
)


@settings(max_examples=examples(500))
@given(st.lists(ops, min_size=10, max_size=60))
def test_cache_against_brute_force_model(steps):
    cache, model = RadixPrefixCache(BS), Model(BS)
    for op, *args in steps:
        cached = sorted(model.blocks.values())
        if op == "insert":
            tokens, blocks, mode, finish = args
            if mode == "fresh":                          # ids not cached anywhere yet
                blocks = [b for b in range(IDS) if b not in cached][:len(blocks)]
            blocks = blocks[:len(tokens) // BS + (mode == "too_many")]
            try:
                expected = model.insert(tokens, blocks)
            except ValueError:
                with pytest.raises(ValueError):
                    cache.insert(tokens, blocks)
            else:
                assert cache.insert(tokens, blocks) == expected
                for b in expected if finish else []:     # the request ends at once
                    cache.release(b)
                    model.ref.discard(b)
                    model._touch(b)
        elif op == "match":
            assert cache.match(args[0]) == model.match(args[0])
        elif op in ("acquire", "release"):
            i = args[0]
            if i == IDS or not cached:                   # a block the cache does not hold
                with pytest.raises(ValueError, match="block"):
                    getattr(cache, op)(IDS)
                continue
            b = cached[i % len(cached)]
            getattr(cache, op)(b)
            if op == "acquire":
                model.ref.add(b)
            else:
                model.ref.discard(b)
                model._touch(b)
        else:
            leaves = model.leaves()
            got = cache.evict()
            if not leaves:
                assert got is None
            else:
                assert got in leaves                     # unreferenced, no cached descendants
                assert got == min(leaves, key=model.used.__getitem__)   # least recently used
                del model.blocks[leaves[got]]
        assert cache.num_cached == len(model.blocks)
        assert cache.num_evictable == model.evictable()
        assert all((b in cache) == (b in model.blocks.values()) for b in range(IDS + 1))
