"""Speculative decoding (chapter 06), built on the engine core's every-row logits, tree masks
and KV rollback. So far: the verification rules (:mod:`.verify`: greedy, lossless rejection
sampling for a chain and for a tree of independently drawn children) and the zero-training
drafter (:mod:`.ngram`: prompt lookup). The engine integration and the trained drafters are
still to come (issue 13)."""
from .ngram import prompt_lookup
from .verify import greedy_accept, rejection_accept, residual, tree_accept

__all__ = ["greedy_accept", "prompt_lookup", "rejection_accept", "residual", "tree_accept"]
