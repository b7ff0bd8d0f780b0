"""Chapter 08's key: reference solutions, written from the rules the chapter teaches."""
from __future__ import annotations

import torch

from minillm.labs import ch08


def block_hashes(token_ids, block_size):
    keys, parent = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        keys.append(parent)
    return keys


def radix_insert(root, tokens, split=True):
    node, i = root, 0
    while i < len(tokens):
        child = node["children"].get(tokens[i])
        if child is None:                                   # a new branch for the rest
            node["children"][tokens[i]] = {"edge": tuple(tokens[i:]), "children": {}}
            return i
        edge, n = child["edge"], 0
        while n < len(edge) and i + n < len(tokens) and edge[n] == tokens[i + n]:
            n += 1
        if n < len(edge) and not split:                     # the mistake below
            node["children"][tokens[i]] = {"edge": tuple(tokens[i:]), "children": {}}
            return i
        if n < len(edge):                                   # leaves or ends inside: split
            head = {"edge": edge[:n], "children": {edge[n]: child}}
            child["edge"] = edge[n:]
            node["children"][tokens[i]] = child = head
        node, i = child, i + n
    return i


class RadixCache:
    """One node per cached block: {"block", "key" (its tokens), "parent", "children" (key ->
    node), "referenced", "last_use"}; the root holds no block."""

    def __init__(self, block_size):
        self.block_size = block_size
        self.root = {"block": None, "key": (), "parent": None, "children": {},
                     "referenced": False, "last_use": 0}
        self.nodes = {}                        # block id -> its node
        self.clock = 0

    def __contains__(self, block):
        return block in self.nodes

    def _use(self, node):
        self.clock += 1
        node["last_use"] = self.clock

    def _keys(self, token_ids, n):
        bs = self.block_size
        return [tuple(token_ids[i * bs:(i + 1) * bs]) for i in range(n)]

    def match(self, token_ids):
        node, found = self.root, []
        for key in self._keys(token_ids, len(token_ids) // self.block_size):
            node = node["children"].get(key)
            if node is None:
                break
            self._use(node)
            found.append(node["block"])
        return found

    def insert(self, token_ids, blocks):
        node, added = self.root, []
        for key, block in zip(self._keys(token_ids, len(blocks)), blocks):
            child = node["children"].get(key)
            if child is None:
                if block in self.nodes:
                    raise ValueError(f"block {block} is cached for other tokens")
                child = {"block": block, "key": key, "parent": node, "children": {},
                         "referenced": True, "last_use": 0}
                node["children"][key] = self.nodes[block] = child
                added.append(block)
            self._use(child)
            node = child
        return added

    def acquire(self, block):
        self.nodes[block]["referenced"] = True

    def release(self, block):
        node = self.nodes[block]
        node["referenced"] = False
        self._use(node)

    def evict(self):
        leaves = [n for n in self.nodes.values() if not n["children"] and not n["referenced"]]
        if not leaves:
            return None
        node = min(leaves, key=lambda n: n["last_use"])
        del node["parent"]["children"][node["key"]]
        del self.nodes[node["block"]]
        return node["block"]

    @property
    def num_evictable(self):
        def walk(node):                        # -> (evictable nodes below, any referenced)
            count, pinned = 0, node["referenced"]
            for child in node["children"].values():
                c, p = walk(child)
                count, pinned = count + c, pinned or p
            return count + (not pinned and node is not self.root), pinned

        return walk(self.root)[0]


def blocks_to_load(num_tokens, device_blocks, stored, block_size, chunk_tokens):
    run = 0
    while run < len(stored) and stored[run]:
        run += 1
    usable = (num_tokens - 1) // block_size               # never the last token's block
    return device_blocks, max(device_blocks, min(usable, run * chunk_tokens // block_size))


def select_tokens(deviation, num, always):
    chosen = set(always.tolist())
    others = sorted((i for i in range(len(deviation)) if i not in chosen),
                    key=lambda i: (-float(deviation[i]), i))
    return torch.tensor(sorted(chosen | set(others[:num])), dtype=torch.long)


KEY = [
    (ch08.check_block_hashes, block_hashes),
    (ch08.check_block_hashes_in_engine, block_hashes),
    (ch08.check_radix_insert, radix_insert),
    (ch08.check_radix_cache, RadixCache),
    (ch08.check_radix_cache_in_engine, RadixCache),
    (ch08.check_blocks_to_load, blocks_to_load),
    (ch08.check_select_tokens, select_tokens),
]
