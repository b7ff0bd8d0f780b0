"""Chapter 08 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import importlib.util
import random

import pytest
import torch
from lab_checks import checker_tests

from minillm.labs import ch08
from minillm.labs.solutions.ch08 import (
    RadixCache,
    block_hashes,
    blocks_to_load,
    radix_insert,
    select_tokens,
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The in-engine checks run a tiny model: one thread is faster, most of all on a shared
    machine's busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- plausible mistakes ----------------------------------------------------------------------


def independent_block_hashes(token_ids, block_size):
    """Each block hashed on its own: equal blocks under different prefixes collide."""
    return [hash(tuple(token_ids[s:s + block_size]))
            for s in range(0, len(token_ids) - block_size + 1, block_size)]


def hashes_with_partial_block(token_ids, block_size):
    """The partial last block gets a key too."""
    keys, parent = [], 0
    for start in range(0, len(token_ids), block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        keys.append(parent)
    return keys


def hashes_chained_on_previous_tokens(token_ids, block_size):
    """Chains on the previous block's tokens instead of its key: A X Y and B X Y agree at Y."""
    blocks = [tuple(token_ids[s:s + block_size])
              for s in range(0, len(token_ids) - block_size + 1, block_size)]
    return [hash((blocks[i - 1] if i else (), b)) for i, b in enumerate(blocks)]


def hashes_missing_the_last_block(token_ids, block_size):
    """An off-by-one range: a list of whole blocks loses its last key."""
    keys, parent = [], 0
    for start in range(0, len(token_ids) - block_size, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        keys.append(parent)
    return keys


def insert_without_split(root, tokens):
    """Leaving an edge part-way replaces the child by the rest: the old branch is lost."""
    return radix_insert(root, tokens, split=False)


def trie_one_token_per_edge(root, tokens):
    """An uncompressed trie: right counts, but every edge is one token."""
    node, i = root, 0
    for i, t in enumerate(tokens):
        if t not in node["children"]:
            node["children"][t] = {"edge": (t,), "children": {}}
            for u in tokens[i + 1:]:
                node = node["children"][t]
                node["children"][u] = {"edge": (u,), "children": {}}
                t = u
            return i
        node = node["children"][t]
    return len(tokens)


class RadixCacheCountingUnreferenced(RadixCache):
    """Counts every unreferenced block as evictable, also one above a block still in use."""

    @property
    def num_evictable(self):
        return sum(not n["referenced"] for n in self.nodes.values())


class RadixCacheMostRecentFirst(RadixCache):
    """Evicts the most recently used leaf."""

    def evict(self):
        leaves = [n for n in self.nodes.values() if not n["children"] and not n["referenced"]]
        if not leaves:
            return None
        node = max(leaves, key=lambda n: n["last_use"])
        del node["parent"]["children"][node["key"]]
        del self.nodes[node["block"]]
        return node["block"]


class RadixCacheInsertionOrder(RadixCache):
    """A hit does not count as a use: blocks go in the order they were cached (FIFO)."""

    def match(self, token_ids):
        node, found = self.root, []
        for key in self._keys(token_ids, len(token_ids) // self.block_size):
            node = node["children"].get(key)
            if node is None:
                break
            found.append(node["block"])
        return found

    def release(self, block):
        self.nodes[block]["referenced"] = False


class RadixCacheEvictingInnerNodes(RadixCache):
    """Evicts the least recently used unreferenced block, leaf or not: its subtree is lost."""

    def evict(self):
        idle = [n for n in self.nodes.values() if not n["referenced"]
                and not any(c["referenced"] for c in n["children"].values())]
        if not idle:
            return None
        node = min(idle, key=lambda n: n["last_use"])
        del node["parent"]["children"][node["key"]]
        stack = [node]
        while stack:
            n = stack.pop()
            self.nodes.pop(n["block"], None)
            stack += n["children"].values()
        return node["block"]


class RadixCacheLeavingEvictedLinked(RadixCache):
    """Forgets an evicted block but leaves its node in the tree: a later match still walks
    into it, though the block now holds other KV."""

    def evict(self):
        leaves = [n for n in self.nodes.values() if not n["children"] and not n["referenced"]]
        if not leaves:
            return None
        node = min(leaves, key=lambda n: n["last_use"])
        del self.nodes[node["block"]]
        return node["block"]


def load_ignoring_the_device(num_tokens, device_blocks, stored, block_size, chunk_tokens):
    """Loads the stored chunks from block 0, over what the device already holds."""
    _, last = blocks_to_load(num_tokens, 0, stored, block_size, chunk_tokens)
    return 0, last


def load_every_stored_chunk(num_tokens, device_blocks, stored, block_size, chunk_tokens):
    """Counts all stored chunks, not the leading run: a gap is loaded over."""
    last = min((num_tokens - 1) // block_size, sum(stored) * chunk_tokens // block_size)
    return device_blocks, max(device_blocks, last)


def load_the_last_token(num_tokens, device_blocks, stored, block_size, chunk_tokens):
    """Loads the last token's block too (its logits must be computed)."""
    return blocks_to_load(num_tokens + 1, device_blocks, stored, block_size, chunk_tokens)


def topk_ignoring_always(deviation, num, always):
    """Top-num over all tokens, then always added: an always index eats a slot."""
    top = torch.topk(torch.as_tensor(deviation), min(num, len(deviation))).indices.tolist()
    return torch.tensor(sorted(set(top) | set(always.tolist())), dtype=torch.long)


def ties_to_higher_index(deviation, num, always):
    chosen = set(always.tolist())
    others = sorted((i for i in range(len(deviation)) if i not in chosen),
                    key=lambda i: (-float(deviation[i]), -i))
    return torch.tensor(sorted(chosen | set(others[:num])), dtype=torch.long)


CHECKS = [
    (ch08.check_block_hashes, block_hashes, independent_block_hashes),
    (ch08.check_block_hashes, block_hashes, hashes_with_partial_block),
    (ch08.check_block_hashes, block_hashes, hashes_chained_on_previous_tokens),
    (ch08.check_block_hashes, block_hashes, hashes_missing_the_last_block),
    (ch08.check_block_hashes_in_engine, block_hashes, independent_block_hashes),
    (ch08.check_block_hashes_in_engine, block_hashes, hashes_missing_the_last_block),
    (ch08.check_radix_insert, radix_insert, insert_without_split),
    (ch08.check_radix_insert, radix_insert, trie_one_token_per_edge),
    (ch08.check_radix_cache, RadixCache, RadixCacheCountingUnreferenced),
    (ch08.check_radix_cache, RadixCache, RadixCacheMostRecentFirst),
    (ch08.check_radix_cache, RadixCache, RadixCacheInsertionOrder),
    (ch08.check_radix_cache, RadixCache, RadixCacheEvictingInnerNodes),
    (ch08.check_radix_cache_in_engine, RadixCache, RadixCacheMostRecentFirst),
    (ch08.check_radix_cache, RadixCache, RadixCacheLeavingEvictedLinked),
    (ch08.check_radix_cache_in_engine, RadixCache, RadixCacheLeavingEvictedLinked),
    (ch08.check_blocks_to_load, blocks_to_load, load_ignoring_the_device),
    (ch08.check_blocks_to_load, blocks_to_load, load_every_stored_chunk),
    (ch08.check_blocks_to_load, blocks_to_load, load_the_last_token),
    (ch08.check_select_tokens, select_tokens, topk_ignoring_always),
    (ch08.check_select_tokens, select_tokens, ties_to_higher_index),
]
IDS = ["hash-independent", "hash-partial", "hash-previous-tokens", "hash-missing-last",
       "engine-hash-independent", "engine-hash-missing-last", "radix-no-split", "radix-trie",
       "cache-counts-unreferenced", "cache-most-recent", "cache-insertion-order",
       "cache-evicts-inner", "engine-cache-most-recent", "cache-evicted-linked",
       "engine-cache-evicted-linked", "load-ignores-device", "load-every-chunk",
       "load-last-token", "select-ignores-always", "select-ties"]
test_reference_passes, test_wrong_fails, test_stub_is_not_attempted = checker_tests(CHECKS, IDS)


def test_independent_hashing_is_caught_by_the_prefix_case():
    msg = ch08.check_block_hashes(independent_block_hashes).message
    assert "parent" in msg and "[7, 7]" in msg


def test_the_package_keys_pass():
    from minillm.cache.prefix import HashPrefixCache

    assert ch08.check_block_hashes(lambda ids, bs: list(HashPrefixCache(bs).keys(ids))).passed


def test_keys_not_chained_on_the_prefix_change_what_the_engine_computes():
    msg = ch08.check_block_hashes_in_engine(independent_block_hashes).message
    assert "log-probability" in msg and "own prefix" in msg


def test_radix_failure_names_the_inserts():
    assert "inserting" in ch08.check_radix_insert(insert_without_split).message


def test_radix_cache_failure_names_the_events():
    msg = ch08.check_radix_cache(RadixCacheCountingUnreferenced).message
    assert "num_evictable" in msg and "admit 1" in msg


def test_a_cache_half_written_is_not_attempted():
    class Half(RadixCache):
        def evict(self):
            raise NotImplementedError

    assert ch08.check_radix_cache(Half).passed is None
    assert ch08.check_radix_cache_in_engine(Half).passed is None


def test_blocks_to_load_agrees_with_the_package_on_more_cases():
    rng = random.Random(1)
    for _ in range(300):
        bs = rng.choice([1, 2, 4, 8])
        chunk = bs * rng.choice([1, 2, 3])
        n = rng.randint(1, 10 * chunk)
        stored = [rng.random() < 0.7 for _ in range(n // chunk)]
        device = rng.randint(0, (n - 1) // bs)
        want = ch08._load_range(n, device, stored, bs, chunk)
        assert blocks_to_load(n, device, stored, bs, chunk) == want


def test_select_reference_agrees_with_the_rules():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 30)
        dev = torch.tensor([round(rng.random(), 1) for _ in range(n)])
        always = torch.tensor(rng.sample(range(n), rng.randint(0, min(4, n))), dtype=torch.long)
        num = rng.randint(0, n + 3)
        got = ch08.select_tokens(dev, num, always)
        assert got.tolist() == select_tokens(dev, num, always).tolist()
        assert got.dtype == torch.long and len(got) == min(n, len(always) + num)


@pytest.mark.skipif(importlib.util.find_spec("minillm.cache.blend") is None,
                    reason="minillm.cache.blend not written yet")
def test_select_reference_matches_the_package():
    from minillm.cache.blend import select_tokens as package_select

    assert ch08.check_select_tokens(package_select).passed is True


def test_dump_tree_matches_the_package_format():
    root, ref = ch08.new_tree(), ch08.TokenRadixTree()
    for seq in ("abcd", "abxy", "ab", "b"):
        radix_insert(root, list(seq))
        ref.insert(list(seq))
    assert ch08.dump_tree(root) == ref.dump()


# --- the chapter's radix pictures (minillm.viz.ch08) -------------------------------------------


def test_radix_frames_rank_first_the_leaf_evict_takes():
    import matplotlib

    matplotlib.use("Agg")
    from minillm.cache.block_manager import BlockManager
    from minillm.cache.radix import RadixPrefixCache
    from minillm.viz import ch08 as v8

    rng = random.Random(1)
    shared = [rng.randrange(50) for _ in range(8)]
    prompts = [shared + [rng.randrange(50) for _ in range(rng.randint(2, 9))] for _ in range(6)]
    events = [e for k, p in enumerate(prompts) for e in (("add", k, p), ("finish", k))]
    frames = v8.radix_frames(events, num_blocks=6, block_size=4)
    assert any(f["evicted"] for f in frames) and any(f["hit"] for f in frames)
    cache = RadixPrefixCache(4)                       # the same replay, then ask the cache
    bm = BlockManager(6, 4, watermark=0.0, prefix_cache=cache)
    for k, p in enumerate(prompts):
        bm.allocate_cached(k, p, len(p))
        bm.cache_computed(k, p, len(p))
        bm.free(k)
    last = frames[-1]
    order = sorted(last["lru"], key=last["lru"].get)
    assert all(last["state"][p] == "evictable" for p in order)
    assert cache.evict() == last["block"][order[0]]
    assert len(v8.plot_radix_steps(frames[:3], cols=3).axes) == 3
