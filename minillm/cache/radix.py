"""Radix trees for prefix caching (SGLang's RadixAttention, Zheng et al. 2024). Pure Python.

Two structures:

- :class:`TokenRadixTree`, the textbook form the chapter teaches: a compressed trie over token
  sequences whose edges carry runs of tokens. Inserting a sequence that leaves an edge part-way
  *splits* that edge ("abcd" then "abxy": ``ab`` -> {``cd``, ``xy``}). Every inserted sequence
  ends at a node, as in SGLang, where nodes carry the KV indices of their edge.
- :class:`RadixPrefixCache`, the prefix cache the block manager uses. The engine's KV lives in
  blocks of ``block_size`` token slots and only whole blocks are shared, so this tree has one
  node per cached block and every edge is exactly one block of tokens: a node's children are
  keyed by the tuple of the next block's tokens. A sequence that diverges inside a block gets a
  different key, i.e. a sibling, so no edge ever needs a split. A node's path from the root is
  the block's whole prefix, which is why equal tokens under a different prefix never match.

Cache invariants: a node is *referenced* while some reader holds its block (``acquire`` ..
``release``, a fresh insert counts as acquired); ``node.pins`` = (1 if referenced) + the number
of children with ``pins > 0``, so ``pins == 0`` exactly when no block in the node's subtree is
referenced, and ``num_evictable`` counts those nodes. ``evict`` removes only leaves with
``pins == 0`` (least recently used first), so every cached block stays reachable by ``match``.
Both this and the vLLM-style hash cache implement :class:`minillm.cache.prefix.PrefixCache`, so
the block manager can use either.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


def _common_length(edge: tuple, tokens: Sequence, start: int) -> int:
    """Length of the common prefix of ``edge`` and ``tokens[start:]``."""
    n = 0
    while n < len(edge) and start + n < len(tokens) and edge[n] == tokens[start + n]:
        n += 1
    return n


@dataclass(eq=False)
class _TokenNode:
    edge: tuple                                                   # tokens on the edge into it
    children: dict[Hashable, _TokenNode] = field(default_factory=dict)   # first token -> child


class TokenRadixTree:
    """Compressed trie of token sequences with edge splitting (no KV attached: the structure).

    Tokens are any hashable items (ints from a tokenizer; a ``str`` is handy for drawing).
    Invariants: edges are non-empty; a node's children start with distinct tokens; a node
    exists exactly at each end of an inserted sequence and at each point where two diverge.
    """

    def __init__(self) -> None:
        self.root = _TokenNode(())
        self.num_nodes = 0                      # nodes other than the root

    def match_prefix(self, tokens: Sequence[Hashable]) -> int:
        """Length of the longest prefix of ``tokens`` shared with some inserted sequence."""
        node, i = self.root, 0
        while i < len(tokens) and tokens[i] in node.children:
            child = node.children[tokens[i]]
            n = _common_length(child.edge, tokens, i)
            i += n
            if n < len(child.edge):
                break
            node = child
        return i

    def insert(self, tokens: Sequence[Hashable]) -> int:
        """Add ``tokens``; return how many of its leading tokens the tree already held."""
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:                   # a new branch: one edge for the rest
                node.children[tokens[i]] = _TokenNode(tuple(tokens[i:]))
                self.num_nodes += 1
                return i
            n = _common_length(child.edge, tokens, i)
            if n < len(child.edge):             # the sequence leaves (or ends) inside the edge
                child = self._split(node, child, n)
            node, i = child, i + n
        return i

    def _split(self, parent: _TokenNode, child: _TokenNode, n: int) -> _TokenNode:
        """Cut ``child``'s edge after ``n`` tokens (0 < n < len): a new node takes the head."""
        head = _TokenNode(child.edge[:n])
        child.edge = child.edge[n:]
        head.children[child.edge[0]] = child
        parent.children[head.edge[0]] = head
        self.num_nodes += 1
        return head

    def dump(self) -> list[tuple[tuple, tuple]]:
        """Every edge as ``(parent_path, edge)``, depth first, children by first token. A node is
        named by its path from the root (``parent_path + edge``; the root is ``()``)."""
        out: list[tuple[tuple, tuple]] = []

        def walk(node: _TokenNode, path: tuple) -> None:
            for key in sorted(node.children, key=repr):
                child = node.children[key]
                out.append((path, child.edge))
                walk(child, path + child.edge)

        walk(self.root, ())
        return out


@dataclass(eq=False)
class _BlockNode:
    block: int                          # physical block id (-1 for the root)
    key: tuple[int, ...]                # the block's tokens: the edge from the parent
    parent: _BlockNode | None
    children: dict[tuple[int, ...], _BlockNode] = field(default_factory=dict)
    referenced: bool = False
    pins: int = 0                       # (1 if referenced) + children with pins > 0
    stamp: int = 0                      # last use (a global clock): LRU order


class RadixPrefixCache:
    """Block prefix cache: a radix tree with one node per cached block (see the module doc)."""

    def __init__(self, block_size: int) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.block_size = block_size
        self._root = _BlockNode(-1, (), None)
        self._nodes: dict[int, _BlockNode] = {}          # block id -> its node
        self._num_evictable = 0
        self._clock = itertools.count(1)
        self._heap: list[tuple[int, int]] = []           # (stamp, block); stale entries skipped

    # ---- queries -------------------------------------------------------------------------
    def __contains__(self, block: int) -> bool:
        return block in self._nodes

    @property
    def num_cached(self) -> int:
        return len(self._nodes)

    @property
    def num_evictable(self) -> int:
        """Blocks repeated ``evict`` calls could free now: those with no referenced block in
        their subtree (evicting a leaf makes its parent a leaf)."""
        return self._num_evictable

    def _keys(self, token_ids: Sequence[int], n: int) -> list[tuple[int, ...]]:
        bs = self.block_size
        return [tuple(token_ids[i * bs:(i + 1) * bs]) for i in range(n)]

    def _path(self, token_ids: Sequence[int], n: int) -> list[_BlockNode]:
        """Cached nodes of the first (up to ``n``) whole blocks of ``token_ids``."""
        node, path = self._root, []
        for key in self._keys(token_ids, n):
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
        return path

    def match(self, token_ids: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached run of whole blocks at the start of ``token_ids``
        (block i covers tokens [i*bs, (i+1)*bs)); marks them used. Evictability is unchanged:
        the caller acquires each block it keeps."""
        path = self._path(token_ids, len(token_ids) // self.block_size)
        for node in path:
            self._touch(node)
        return [node.block for node in path]

    # ---- updates -------------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], blocks: Sequence[int]) -> list[int]:
        """Cache ``blocks[i]`` as the KV of ``token_ids[i*bs:(i+1)*bs]`` after the prefix
        ``token_ids[:i*bs]``. Returns the newly registered blocks, which count as acquired.
        A block whose prefix+tokens is already cached (under it or another block) is not
        registered; the rest of the chain goes under the cached one. The path counts as used."""
        bs = self.block_size
        if len(token_ids) < len(blocks) * bs:
            raise ValueError(f"token_ids has {len(token_ids)} tokens, fewer than "
                             f"len(blocks) * block_size = {len(blocks) * bs}")
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"blocks has a repeated block id: {list(blocks)}")
        cached = self._path(token_ids, len(blocks))
        for i, block in enumerate(blocks):
            if block in self._nodes and (i >= len(cached) or cached[i].block != block):
                raise ValueError(f"blocks[{i}] = {block} is already cached for other tokens")
        node, added = self._root, []
        for key, block in zip(self._keys(token_ids, len(blocks)), blocks):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _BlockNode(block, key, node)
                self._nodes[block] = child
                self._num_evictable += 1                 # pins == 0 until acquired below
                self._acquire(child)
                added.append(block)
            self._touch(child)
            node = child
        return added

    def _node(self, block: int) -> _BlockNode:
        if block not in self._nodes:
            raise ValueError(f"block {block} is not cached")
        return self._nodes[block]

    def acquire(self, block: int) -> None:
        """A reader took the cached ``block``: it is not evictable (idempotent)."""
        self._acquire(self._node(block))

    def release(self, block: int) -> None:
        """The last reader of ``block`` let go: evictable once its subtree is (idempotent);
        the most recently released block is evicted last."""
        node = self._node(block)
        if node.referenced:
            node.referenced = False
            self._unpin(node)
        self._touch(node)

    def evict(self) -> int | None:
        """Forget the least recently used unreferenced leaf; return its block (None if none)."""
        while self._heap:
            stamp, block = heapq.heappop(self._heap)
            node = self._nodes.get(block)
            if node is None or node.stamp != stamp or not self._is_evictable_leaf(node):
                continue                                 # a stale entry
            del node.parent.children[node.key]
            del self._nodes[block]
            self._num_evictable -= 1
            self._push(node.parent)                      # it may have become a leaf
            return block
        return None

    # ---- bookkeeping ---------------------------------------------------------------------
    def _acquire(self, node: _BlockNode) -> None:
        if not node.referenced:
            node.referenced = True
            self._pin(node)

    def _pin(self, node: _BlockNode) -> None:
        """Add one to ``node.pins``; a subtree going from unpinned to pinned tells its parent."""
        while node is not self._root:
            node.pins += 1
            if node.pins > 1:
                return
            self._num_evictable -= 1
            node = node.parent

    def _unpin(self, node: _BlockNode) -> None:
        """Take one from ``node.pins``; a subtree going unpinned tells its parent."""
        while node is not self._root:
            node.pins -= 1
            if node.pins > 0:
                return
            self._num_evictable += 1
            node = node.parent

    def _is_evictable_leaf(self, node: _BlockNode) -> bool:
        return node is not self._root and node.pins == 0 and not node.children

    def _touch(self, node: _BlockNode) -> None:
        node.stamp = next(self._clock)
        self._push(node)

    def _push(self, node: _BlockNode) -> None:
        """Offer an evictable leaf to the heap; rebuild the heap when stale entries pile up."""
        if self._is_evictable_leaf(node):
            heapq.heappush(self._heap, (node.stamp, node.block))
        if len(self._heap) > 2 * len(self._nodes) + 64:
            self._heap = [(n.stamp, n.block) for n in self._nodes.values()
                          if self._is_evictable_leaf(n)]
            heapq.heapify(self._heap)
