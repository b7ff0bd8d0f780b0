"""Prompt lookup (n-gram) drafting: no model, no training (Saxena 2023; vLLM's ``ngram``).

The last n tokens of a sequence (prompt + output so far) are looked up earlier in the same
sequence; the tokens that followed the most recent earlier occurrence are the draft. Outputs that
copy from their input (summaries, edits, extraction, code) repeat long runs, which is where
this drafter shines; elsewhere it usually finds nothing and costs nothing.
"""
from __future__ import annotations

from collections.abc import Sequence


def prompt_lookup(tokens: Sequence[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to ``k`` drafted tokens for ``tokens``: the continuation of the most recent earlier
    occurrence of its last n tokens, trying n = max_n down to min_n; [] when none occurs."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    tokens = list(tokens)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):   # most recent first, not the tail
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []
