"""minillm: a small, complete LLM inference and serving stack, built up chapter by chapter.

Layers (a test enforces the rule): the core (``config``, ``device``, ``sampling``,
``generate``, ``evaluate``, ``model``, ``checkpoint``, ``attention``, ``cache``, ``engine``)
never imports chapter material or tools; one chapter's technique each (``spec_decode``,
``parallel``, ``disagg``, ``quant``, ``train``, ``serve``, ``runtime``, ``structured``) builds on
the core (importing ``minillm`` imports ``quant``, ``spec_decode`` and ``structured``, which
register themselves with ``load_model`` and ``LLM``); chapter material and tools (``course``,
``viz``, ``bench``, ``labs``, ``cli``) sit on top.
``minillm.kernels`` is the repository's ``kernels/`` folder.
"""
import importlib.util as _util
import sys as _sys
from pathlib import Path as _Path

from . import quant, spec_decode, structured  # noqa: F401  (they register themselves with the core)
from .checkpoint.loader import load_model
from .checkpoint.tokenizer import Tokenizer
from .config import PRESETS, ModelConfig, SamplingParams
from .engine import LLM
from .model.transformer import Transformer


def _kernels_from_checkout() -> None:
    """Run from a source checkout without ``pip install``: make ``minillm.kernels`` the
    checkout's ``kernels/`` folder, as an install does (pyproject's package-dir). Executes only
    ``kernels/__init__.py``, which imports nothing."""
    folder = _Path(__file__).resolve().parent.parent / "kernels"
    if _util.find_spec(__name__ + ".kernels") is not None or not (folder / "__init__.py").is_file():
        return
    spec = _util.spec_from_file_location(__name__ + ".kernels", folder / "__init__.py",
                                         submodule_search_locations=[str(folder)])
    module = _util.module_from_spec(spec)
    _sys.modules[spec.name] = module
    spec.loader.exec_module(module)


_kernels_from_checkout()

__all__ = ["LLM", "PRESETS", "ModelConfig", "SamplingParams", "Tokenizer", "Transformer",
           "load_model"]
__version__ = "0.1.0"
