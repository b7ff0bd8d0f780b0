"""Sharding on torch.distributed (chapters 03 and 09): TP, PP, EP, ring attention, Ulysses.

- :mod:`.launch`: ``run(fn, world_size, *args)`` starts the ranks (gloo on CPU, NCCL on GPUs).
- :mod:`.comm`: collectives that log how many bytes each rank sent.
- :mod:`.tensor`, :mod:`.pipeline`, :mod:`.expert`: the model split by matrices, by layers and by
  experts (plus the hybrid of TP attention and EP experts).
- :mod:`.sequence`: one sequence split over the ranks (ring, striped, Ulysses, USP, pass-Q).
- :mod:`.api`: one call per technique, arguments checked before any process starts.
- :mod:`.workers`: what each rank runs.
"""
from .api import (
    ep_logits,
    hybrid_logits,
    moe_stall,
    pass_q_attention,
    pp_logits,
    sequence_attention,
    tp_logits,
)
from .launch import run

__all__ = ["ep_logits", "hybrid_logits", "moe_stall", "pass_q_attention", "pp_logits", "run",
           "sequence_attention", "tp_logits"]
