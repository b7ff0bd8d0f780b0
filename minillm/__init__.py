"""minillm: a small, complete LLM inference and serving stack, built up chapter by chapter."""
from .checkpoint.loader import load_model
from .checkpoint.tokenizer import Tokenizer
from .config import PRESETS, ModelConfig, SamplingParams
from .engine import LLM
from .model.transformer import Transformer

__all__ = ["LLM", "PRESETS", "ModelConfig", "SamplingParams", "Tokenizer", "Transformer",
           "load_model"]
__version__ = "0.1.0"
