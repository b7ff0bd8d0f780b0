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


def select_tokens(deviation, num, always):
    chosen = set(always.tolist())
    others = sorted((i for i in range(len(deviation)) if i not in chosen),
                    key=lambda i: (-float(deviation[i]), i))
    return torch.tensor(sorted(chosen | set(others[:num])), dtype=torch.long)


KEY = [
    (ch08.check_block_hashes, block_hashes),
    (ch08.check_radix_insert, radix_insert),
    (ch08.check_select_tokens, select_tokens),
]
