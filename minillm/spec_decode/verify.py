"""Verification rules of speculative decoding: which drafted tokens the target keeps.

A drafter proposes tokens d_1..d_k after a context; the target scores the context plus the draft
in one forward pass, which gives k + 1 next-token distributions: row 0 predicts the token after
the context, row i the token after d_i. A rule keeps a prefix d_1..d_a and then emits one token
of its own (a correction, or the *bonus* token after a fully accepted draft), so every round
yields a + 1 tokens.

- :func:`greedy_accept`: at temperature 0, keep d_i while it equals the target's argmax.
- :func:`rejection_accept`: sampling, lossless (Leviathan et al. 2023, Chen et al. 2023): keep
  d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw from the
  residual max(0, p_i - q_i), renormalised; after k acceptances draw the bonus token from p_k.
  The emitted tokens are distributed exactly as the target's own samples, whatever q is.
- :func:`tree_accept`: the same over a tree of drafts whose children at a node were drawn
  independently from the drafter's distribution there (SpecInfer's multi-draft rule): try the
  children in order, each against the residual left by the ones rejected before it. With
  ``q=None`` the children are deterministic picks (top-k of a drafter, Medusa's and EAGLE-2's
  trees): each is a proposal with certainty, accepted with the current residual's probability
  of it, and a rejected child's token is struck from the residual (sampling without
  replacement), which is again lossless.
- :func:`greedy_tree_accept`: temperature 0 over a tree: follow the child whose token is the
  target's argmax.

Distributions are rows of probabilities (after temperature and filters), on any device; the
rules read them on the host (a few rows of one sequence).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def greedy_accept(draft: Sequence[int], target_argmax: Sequence[int]) -> tuple[int, int]:
    """draft d_1..d_k, the target's argmax at its k + 1 rows -> (a, token): the longest prefix
    of the draft the target agrees with, and the target's own choice after it."""
    if len(target_argmax) != len(draft) + 1:
        raise ValueError(f"target_argmax must have len(draft) + 1 = {len(draft) + 1} entries, "
                         f"got {len(target_argmax)}")
    a = 0
    while a < len(draft) and draft[a] == target_argmax[a]:
        a += 1
    return a, int(target_argmax[a])


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) renormalised: what is left of p once q's proposals are accounted for
    (p itself where nothing is left, which happens only when p == q)."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs.float(), 1, generator=generator))


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator))


def rejection_accept(draft: Sequence[int], q: torch.Tensor, p: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[int, int]:
    """Lossless speculative sampling of one chain. q [k, V]: the drafter's distributions the
    draft was sampled from; p [k + 1, V]: the target's. Returns (accepted count a, next token)."""
    k = len(draft)
    if q.shape[0] != k or p.shape[0] != k + 1 or q.shape[1:] != p.shape[1:]:
        raise ValueError(f"q must be [k, V] and p [k + 1, V] with k = len(draft) = {k}, got "
                         f"q {tuple(q.shape)}, p {tuple(p.shape)}")
    p, q = p.cpu().double(), q.cpu().double()
    for i, d in enumerate(draft):
        if _uniform(generator) * q[i, d] < p[i, d]:      # u < p/q, without dividing by 0
            continue
        return i, _draw(residual(p[i], q[i]), generator)
    return k, _draw(p[k], generator)


def tree_accept(children: dict[int, list[int]], tokens: Sequence[int], q: torch.Tensor | None,
                p: torch.Tensor, generator: torch.Generator | None = None
                ) -> tuple[list[int], int]:
    """Lossless verification of a draft tree. Node 0 is the root (the last context token);
    ``children[n]``: the nodes under node n, drawn independently from q[n] [V] (q None: picked
    deterministically, distinct tokens); ``tokens[n]``: node n's token; p[n] [V]: the target's
    distribution after node n (all nodes in one forward pass with the tree mask). Returns (the
    accepted path of nodes below the root, the next token after it)."""
    node, path = 0, []
    p = p.cpu().double()
    q = q.cpu().double() if q is not None else None
    while True:
        target = p[node]
        for child in children.get(node, []):
            t = tokens[child]
            proposal = q[node] if q is not None else _one_hot(t, target)
            if _uniform(generator) * proposal[t] < target[t]:
                path.append(child)
                break
            target = residual(target, proposal)
        else:
            return path, _draw(target, generator)
        node = path[-1]


def _one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like)
    out[token] = 1.0
    return out


def greedy_tree_accept(children: dict[int, list[int]], tokens: Sequence[int],
                       target_argmax: Sequence[int]) -> tuple[list[int], int]:
    """Temperature 0 over a tree (nodes as in :func:`tree_accept`; target_argmax[n]: the
    target's choice after node n): the path that follows the target's argmax, and the argmax
    after its last node."""
    node, path = 0, []
    while True:
        nxt = [c for c in children.get(node, []) if tokens[c] == target_argmax[node]]
        if not nxt:
            return path, int(target_argmax[node])
        node = nxt[0]
        path.append(node)
