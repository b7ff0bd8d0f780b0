"""Checkpoints (core): GGUF reading with our own dequantisation, local HF safetensors folders, the
tokenizer from the GGUF vocabulary, HF transformers interop, and :func:`load_model`, the one entry
point that turns a name or path into (model, tokenizer)."""
from .gguf import find_smollm2_gguf, load_gguf
from .loader import REAL_MODEL, load_model, random_model
from .tokenizer import Tokenizer

__all__ = ["REAL_MODEL", "Tokenizer", "find_smollm2_gguf", "load_gguf", "load_model",
           "random_model"]
