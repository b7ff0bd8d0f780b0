"""Inference runtimes (appendix A3): a decode step seen as kernels (``profile``) and built once
for static shapes, then compiled with ``torch.compile`` or captured as CUDA graphs
(``decoder``). The OpenAI-compatible server is ``minillm.serve``."""
from ..engine.graphs import capture_sizes
from .decoder import StaticDecoder, pad_to_captured, padding_waste
from .profile import DecodeProfile, categorize, profile_decode, profile_engine_steps

__all__ = ["DecodeProfile", "StaticDecoder", "capture_sizes", "categorize", "pad_to_captured",
           "padding_waste", "profile_decode", "profile_engine_steps"]
