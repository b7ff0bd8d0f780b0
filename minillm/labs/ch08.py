"""Checkers for the exercises of chapter 08 (KV cache management and offload).

- :func:`check_block_hashes`: the key of every full block, a hash chain as in vLLM's automatic
  prefix caching, compared with :meth:`minillm.cache.prefix.HashPrefixCache.keys`.
- :func:`check_radix_insert`: insert into a radix tree of plain dict nodes, splitting edges,
  compared with :class:`minillm.cache.radix.TokenRadixTree` on seeded insert sequences.
- :func:`check_select_tokens`: CacheBlend's choice of tokens to recompute (the ``always`` ones
  plus the ``num`` others whose KV deviates most), compared with :func:`select_tokens` below
  (the rule of ``minillm.cache.blend.select_tokens``, not imported here).

The radix exercise's tree is plain data: a node is ``{"edge": tuple of tokens, "children":
{first token: node}}`` and the root has an empty edge (:func:`new_tree`); :func:`dump_tree`
lists its edges in the order of ``TokenRadixTree.dump``.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from ..cache.prefix import HashPrefixCache
from ..cache.radix import TokenRadixTree
from .common import Result, check

# --- hashed full blocks --------------------------------------------------------------------


def _hash_cases():
    rng = random.Random(8)
    cases = [([], 4), ([1, 2, 3], 4), ([1, 2, 3, 4], 4), ([5] * 9, 4), ([1, 2, 3], 1)]
    for _ in range(60):
        bs = rng.choice([1, 2, 3, 4, 8, 16])
        cases.append(([rng.randint(0, 9) for _ in range(rng.randint(0, 5 * bs + 3))], bs))
    return cases


def check_block_hashes(fn: Callable) -> Result:
    """``fn(token_ids, block_size)`` -> [key of each full block]: block i's key is
    ``hash((key of block i-1, tuple(its block_size tokens)))``, the first block's parent key
    being 0; a partial last block has no key. Checked first on equal blocks under different
    prefixes (they must get different keys), then against the package on seeded cases."""
    cases = _hash_cases()

    def attempt() -> None:
        a, b = fn([1, 2, 7, 7], 2), fn([3, 4, 7, 7], 2)
        assert len(a) == len(b) == 2, f"two full blocks of 2 tokens each: got {a} and {b}"
        assert a[1] != b[1], ("the block [7, 7] after [1, 2] and after [3, 4] got the same key "
                              f"{a[1]}: a key must cover its parent's key, not only its tokens")
        for ids, bs in cases:
            want = list(HashPrefixCache(bs).keys(ids))
            got = list(fn(list(ids), bs))
            assert got == want, (f"token_ids={ids}, block_size={bs}: expected {len(want)} keys "
                                 f"{want}, got {len(got)} keys {got}")

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
