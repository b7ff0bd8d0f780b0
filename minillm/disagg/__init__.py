"""Prefill/decode disaggregation (chapter 07): a prefill worker and decode workers in separate
processes over ``torch.distributed``, pull-based paged-KV transfer (layer by layer while the
prefill runs), a router with fault handling, and a DistServe-style placement simulator."""
from .api import DisaggLLM

__all__ = ["DisaggLLM"]
