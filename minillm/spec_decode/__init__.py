"""Speculative decoding (chapter 06), built on the engine core's every-row logits, tree masks
and KV rollback (:mod:`minillm.engine.speculation` is what the engine asks of it; importing
this package registers :func:`build_speculator` there, for ``LLM(speculative_config=...)``).

- :mod:`.config`: ``speculative_config`` (method, num_speculative_tokens, tree budget, ...);
- :mod:`.verify`: the verification rules (greedy; lossless rejection sampling for a chain and
  for a tree);
- :mod:`.ngram`: prompt lookup, the zero-training drafter;
- :mod:`.drafters`: the trained drafters' modules (draft model, EAGLE, MTP, Medusa, and the
  block drafter of DFlash with DSpark's heads);
- :mod:`.trees`: Medusa's static sparse tree, EAGLE-2's dynamic tree, DDTree's best-first one;
- :mod:`.proposers`: the drafters at serving time, batched, with their own paged KV;
- :mod:`.blocks`: block drafting at serving time (dflash, ddtree, dspark; DSpark's shared
  verification budget and early exit);
- :mod:`.inputs`: what a drafter reads after a step (``SpecInput``);
- :mod:`.speculator`: a proposer plus the rules, with acceptance counters;
  ``build_speculator`` is what ``minillm.LLM(speculative_config=...)`` calls;
- :mod:`.weights`: the packaged drafter weights with their manifests;
- :mod:`.prompts`: the prompt bank (``prompt_bank.json``): training and held-out benchmark
  prompts;
- :mod:`.training`: self-distillation and the training scripts (``make drafters``); serving
  never imports it.
"""
from ..engine.speculation import register_speculator_builder
from .config import METHODS, SpeculativeConfig
from .ngram import prompt_lookup
from .speculator import DraftAndVerify, SpecStats, build_speculator
from .verify import greedy_accept, greedy_tree_accept, rejection_accept, residual, tree_accept

__all__ = ["METHODS", "DraftAndVerify", "SpecStats", "SpeculativeConfig", "build_speculator",
           "greedy_accept", "greedy_tree_accept", "prompt_lookup", "rejection_accept",
           "residual", "tree_accept"]

register_speculator_builder(build_speculator)
