"""Chapter 06's key: reference solutions, written from the rules the chapter teaches."""
from __future__ import annotations

import torch

from minillm.labs import ch06


def greedy_accept(draft, target_argmax):
    a = 0
    while a < len(draft) and draft[a] == target_argmax[a]:
        a += 1
    return a, target_argmax[a]


def rejection_step(draft_token, q, p, u, generator):
    if u * q[draft_token] < p[draft_token]:          # u < p/q, no division by zero
        return True, draft_token
    residual = (p - q).clamp_min(0)
    return False, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))


def prompt_lookup(tokens, k, max_n):
    for n in range(min(max_n, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


def tree_mask(parents):
    n = len(parents) + 1
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents, start=1):
        mask[i] |= mask[p]
    return mask


def ttt_mask(step, t):
    q = torch.arange(t)[:, None]
    s = torch.arange(t)[None]
    blocks = [s <= q - (step - 1)]                  # step 1: the committed context
    for i in range(2, step + 1):                    # step i: the chain's own row, one per step
        blocks.append(s == q - (step - i))
    return torch.cat(blocks, 1)


KEY = [
    (ch06.check_greedy_accept, greedy_accept),
    (ch06.check_rejection_step, rejection_step),
    (ch06.check_rejection_in_engine, rejection_step),
    (ch06.check_prompt_lookup, prompt_lookup),
    (ch06.check_prompt_lookup_in_engine, prompt_lookup),
    (ch06.check_tree_mask, tree_mask),
    (ch06.check_tree_mask_in_engine, tree_mask),
    (ch06.check_ttt_mask, ttt_mask),
]
