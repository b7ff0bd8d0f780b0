"""Suffix decoding: model-free drafting from what was already said (Oliaro et al., 2024,
"SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications"; vLLM's ``suffix``).

Two tries of token substrings, each no longer than ``max_depth``, with a count on every node
(how often that substring occurred):

- one per request, over its prompt and its output so far (what prompt lookup searches, but with
  counts, so the most frequent continuation wins and several continuations make a tree);
- one global, over the outputs of recent finished requests (agents, templates and repeated
  questions make later answers repeat earlier ones), capped at ``max_cached_tokens``.

Each step, the longest suffix of the sequence found in a trie (the *match*, of length m) is
continued best-first: a candidate's score is the product of its nodes' empirical probabilities
(a child's count over the counts of it and its siblings); the draft is the tree of the
best-scoring nodes, at most ``min(k, max_spec_factor * m)`` of them, none below
``min_token_prob``. A match is at most ``max_depth - k`` tokens, so that k more fit below it.
The trie whose draft scores higher (expected accepted tokens, the sum of its nodes' scores)
proposes.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Sequence

from ..engine.sequence import Draft
from .inputs import SpecInput


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Every substring of the added texts of length <= ``max_depth``, with its count.

    ``extend(key, tokens)`` appends to text ``key`` (O(max_depth) per token);
    ``remove(key)`` takes a whole text out again; ``match(context)`` and ``speculate`` read."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node()
        self.texts: dict[object, list[int]] = {}
        self.num_tokens = 0
        self._open: dict[object, list[_Node]] = {}   # nodes of the text's suffixes, by length

    def extend(self, key: object, tokens: Sequence[int]) -> None:
        text, open_ = self.texts.setdefault(key, []), self._open.setdefault(key, [])
        for t in tokens:
            # every suffix of the text that can still grow gains a child t, and t starts one
            grown = []
            for node in [self.root] + open_[:self.max_depth - 1]:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node()
                child.count += 1
                grown.append(child)
            open_[:] = grown
            text.append(t)
        self.num_tokens += len(tokens)

    def remove(self, key: object) -> None:
        """Take text ``key`` out: every substring it added loses one count; empty nodes go."""
        text = self.texts.pop(key, [])
        self._open.pop(key, None)
        self.num_tokens -= len(text)
        for start in range(len(text)):
            node, path = self.root, []
            for t in text[start:start + self.max_depth]:
                path.append((node, t))
                node = node.children[t]
                node.count -= 1
            for parent, t in reversed(path):
                if parent.children[t].count == 0:
                    del parent.children[t]

    def match(self, context: Sequence[int], max_len: int | None = None
              ) -> tuple[_Node | None, int]:
        """The node of the longest suffix of ``context`` (at most ``max_len`` tokens) that
        occurs in the trie followed by something, and its length; (None, 0) if none does. A
        match of m tokens can be continued by at most max_depth - m."""
        best: tuple[_Node | None, int] = (None, 0)
        longest = self.max_depth - 1 if max_len is None else min(max_len, self.max_depth - 1)
        for n in range(1, min(longest, len(context)) + 1):
            node = self.root
            for t in context[len(context) - n:]:
                node = node.children.get(t)
                if node is None:
                    return best
            if node.children:
                best = (node, n)
        return best

    @staticmethod
    def speculate(node: _Node, max_nodes: int, min_prob: float) -> tuple[Draft | None, float]:
        """The best-first tree of at most ``max_nodes`` continuations of ``node`` (each
        node's score, the product of empirical probabilities from ``node`` down, at least
        ``min_prob``) and its total score."""
        heap: list[tuple[float, int, int, _Node, int]] = []  # (-score, order, token, node, parent)
        order = itertools.count()                             # ties: the first pushed first

        def push(parent: _Node, index: int, score: float) -> None:
            seen = sum(c.count for c in parent.children.values())   # continuations seen
            for t, child in parent.children.items():
                s = score * child.count / seen
                if s >= min_prob:
                    heapq.heappush(heap, (-s, next(order), t, child, index))

        tokens: list[int] = []
        parents: list[int] = []
        score = 0.0
        push(node, 0, 1.0)
        while heap and len(tokens) < max_nodes:
            neg, _, t, child, parent = heapq.heappop(heap)
            tokens.append(t)
            parents.append(parent)
            score -= neg
            push(child, len(tokens), -neg)
        return (Draft(tokens, parents) if tokens else None), score


class SuffixProposer:
    """Suffix decoding at serving time: a trie per sequence (prompt + output, kept up to date
    from the committed tokens) and a global trie over the outputs of finished sequences,
    holding at most ``max_cached_tokens`` tokens (oldest outputs leave first)."""

    hidden_layers: tuple[int, ...] = ()
    catches_up = True             # its trie takes whatever tokens it has not seen yet

    def __init__(self, k: int, max_depth: int = 24, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1, max_cached_tokens: int = 1 << 16) -> None:
        self.k, self.max_nodes = k, k
        self.max_spec_factor, self.min_token_prob = max_spec_factor, min_token_prob
        self.max_depth, self.max_cached_tokens = max_depth, max_cached_tokens
        self.local: dict[int, SuffixTrie] = {}
        self.prompt_len: dict[int, int] = {}
        self.history = SuffixTrie(max_depth)
        self._history_keys: deque[int] = deque()           # global trie's texts, oldest first
        self._next_key = 0

    def propose(self, inputs: list[SpecInput], hidden: dict) -> list[Draft | None]:
        return [self.draft(inp.seq.seq_id, inp.seq.token_ids, inp.seq.prompt_len,
                           inp.max_depth) for inp in inputs]

    def draft(self, seq_id: int, tokens: Sequence[int], num_prompt: int, room: int
              ) -> Draft | None:
        """The next draft of sequence ``seq_id`` whose committed tokens are ``tokens`` (the
        first ``num_prompt`` its prompt); at most ``room`` deep (and ``k`` nodes)."""
        trie = self.local.get(seq_id)
        if trie is None:
            trie = self.local[seq_id] = SuffixTrie(self.max_depth)
            self.prompt_len[seq_id] = num_prompt
        trie.extend(seq_id, tokens[len(trie.texts.get(seq_id, ())):])
        if room < 1:
            return None
        best: tuple[Draft | None, float] = (None, 0.0)
        for source in (trie, self.history):
            node, m = source.match(tokens, max(1, self.max_depth - self.k))  # room for k more
            budget = min(self.k, int(self.max_spec_factor * m))
            if node is None or budget < 1:
                continue
            found = source.speculate(node, budget, self.min_token_prob)
            if found[0] is not None and found[1] > best[1]:
                best = found
        return best[0].pruned(room) if best[0] is not None else None

    def fork(self, parent_id: int, child_id: int) -> None: ...

    def clear_history(self) -> None:
        """Forget the outputs of finished sequences (the global trie), as a new engine has
        none: a benchmark that runs the same prompts again would otherwise draft their
        earlier outputs."""
        self.history = SuffixTrie(self.max_depth)
        self._history_keys.clear()

    def release(self, seq_id: int) -> None:
        """A finished (or aborted) sequence's output joins the global trie; the oldest
        outputs leave while it holds more than ``max_cached_tokens``."""
        trie = self.local.pop(seq_id, None)
        num_prompt = self.prompt_len.pop(seq_id, 0)
        if trie is None:
            return
        output = trie.texts[seq_id][num_prompt:]
        if not output or not self.max_cached_tokens:
            return
        key, self._next_key = self._next_key, self._next_key + 1
        self.history.extend(key, output[-self.max_cached_tokens:])
        self._history_keys.append(key)
        while self.history.num_tokens > self.max_cached_tokens:
            self.history.remove(self._history_keys.popleft())
