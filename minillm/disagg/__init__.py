"""Prefill/decode disaggregation (chapter 07): a prefill worker and decode workers in separate
processes over ``torch.distributed``, pull-based paged-KV transfer (layer by layer while the
prefill runs), and a router with fault handling. The DistServe-style placement simulator that
chapter 07 teaches with is :mod:`minillm.course.placement`."""
from .api import DisaggLLM

__all__ = ["DisaggLLM"]
