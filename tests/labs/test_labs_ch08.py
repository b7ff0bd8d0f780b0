"""Chapter 08 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import importlib.util
import random

import pytest
import torch
from lab_checks import checker_tests

from minillm.labs import ch08
from minillm.labs.solutions.ch08 import (
    block_hashes,
    radix_insert,
    select_tokens,
)

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


def topk_ignoring_always(deviation, num, always):
    """Top-num over all tokens, then always added: an always index eats a slot."""
    top = torch.topk(torch.as_tensor(deviation), min(num, len(deviation))).indices.tolist()
    return torch.tensor(sorted(set(top) | set(always.tolist())), dtype=torch.long)


def ties_to_higher_index(deviation, num, always):
    chosen = set(always.tolist())
    others = sorted((i for i in range(len(deviation)) if i not in chosen),
                    key=lambda i: (-float(deviation[i]), -i))
    return torch.tensor(sorted(chosen | set(others[:num])), dtype=torch.long)


CHECKS = [(ch08.check_block_hashes, block_hashes, independent_block_hashes),
          (ch08.check_block_hashes, block_hashes, hashes_with_partial_block),
          (ch08.check_radix_insert, radix_insert, insert_without_split),
          (ch08.check_radix_insert, radix_insert, trie_one_token_per_edge),
          (ch08.check_select_tokens, select_tokens, topk_ignoring_always),
          (ch08.check_select_tokens, select_tokens, ties_to_higher_index)]
test_reference_passes, test_wrong_fails, test_stub_is_not_attempted = checker_tests(
    CHECKS, ids=["hash-independent", "hash-partial", "radix-no-split", "radix-trie",
                 "select-ignores-always", "select-ties"])


def test_independent_hashing_is_caught_by_the_prefix_case():
    msg = ch08.check_block_hashes(independent_block_hashes).message
    assert "parent" in msg and "[7, 7]" in msg


def test_radix_failure_names_the_inserts():
    assert "inserting" in ch08.check_radix_insert(insert_without_split).message


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
