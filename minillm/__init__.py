"""minillm: a small, complete LLM inference and serving stack, built up chapter by chapter."""
from .config import PRESETS, ModelConfig, SamplingParams
from .engine import LLM
from .loader import load_model
from .model import Transformer
from .tokenizer import Tokenizer

__all__ = ["LLM", "PRESETS", "ModelConfig", "SamplingParams", "Tokenizer", "Transformer",
           "load_model"]
__version__ = "0.1.0"
