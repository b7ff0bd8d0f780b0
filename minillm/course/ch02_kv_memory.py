"""KV cache memory calculator (chapter 02).

Every token of every sequence keeps, in every layer, a key and a value per KV head:

    KV bytes = 2 x layers x kv_heads x head_dim x tokens x batch x bytes_per_elem

DeepSeek-V2's MLA instead keeps one latent of kv_lora_rank numbers plus a shared RoPE key of
rope_dim numbers per token and layer (DeepSeek-V2 paper, section 2.1 and Table 1).

The bytes per number depend on how the cache stores them (:func:`kv_format_table`): the
model's float32 or bfloat16, or int8 plus one float32 scale per token and KV head
(``EngineConfig(kv_cache_dtype=...)``, :mod:`minillm.attention.kv_quant`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.kv_quant import kv_bytes_per_token
from ..config import PRESETS, ModelConfig
from .ch01_variants import kv_cache_bytes_per_token


@dataclass(frozen=True)
class MLASpec:
    """The KV-relevant shape of a model with multi-head latent attention."""

    name: str
    n_layers: int
    kv_lora_rank: int
    rope_dim: int
    n_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for field in ("n_layers", "kv_lora_rank", "n_heads", "head_dim"):
            if getattr(self, field) < 1:
                raise ValueError(f"MLASpec.{field} must be >= 1, got {getattr(self, field)}")
        if self.rope_dim < 0:
            raise ValueError(f"MLASpec.rope_dim must be >= 0, got {self.rope_dim}")

    def kv_bytes_per_token(self, bytes_per_elem: int = 2) -> int:
        """layers x (kv_lora_rank + rope_dim) x bytes: the MLA cache cost of one token."""
        return self.n_layers * kv_cache_bytes_per_token(
            "mla", d_latent=self.kv_lora_rank, d_rope=self.rope_dim, bytes_per_elem=bytes_per_elem)


# DeepSeek-V2 (236B total, 21B active): 60 layers, 128 heads of 128 dims, d_c = 512, d_h^R = 64.
DEEPSEEK_V2 = MLASpec("deepseek-v2", n_layers=60, kv_lora_rank=512, rope_dim=64,
                      n_heads=128, head_dim=128)

TABLE_MODELS: tuple[ModelConfig | MLASpec, ...] = (
    PRESETS["smollm2-135m"], PRESETS["llama-3-8b"], PRESETS["llama-3-70b"], DEEPSEEK_V2)


def kv_cache_bytes(cfg: ModelConfig | MLASpec, tokens: int, batch: int = 1,
                   bytes_per_elem: int = 2) -> int:
    """KV cache bytes for ``batch`` sequences of ``tokens`` tokens each, all layers."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return cfg.kv_bytes_per_token(bytes_per_elem) * tokens * batch


def mha_bytes_per_token(cfg: ModelConfig | MLASpec, bytes_per_elem: int = 2) -> int:
    """What one token would cost with plain MHA (one KV head per query head), all layers."""
    return 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * bytes_per_elem


def attention_label(cfg: ModelConfig | MLASpec) -> str:
    """"MHA", "MQA", "GQA 32q/8kv" or "MLA 512+64"."""
    if isinstance(cfg, MLASpec):
        return f"MLA {cfg.kv_lora_rank}+{cfg.rope_dim}"
    if cfg.n_kv_heads == cfg.n_heads:
        return "MHA"
    return "MQA" if cfg.n_kv_heads == 1 else f"GQA {cfg.n_heads}q/{cfg.n_kv_heads}kv"


def kv_memory_table(context_len: int, batch: int = 1, bytes_per_elem: int = 2,
                    models: tuple[ModelConfig | MLASpec, ...] = TABLE_MODELS) -> list[dict]:
    """One row per model: its attention, bytes per token, and the cache for this workload.

    Keys: model, attention, n_layers, bytes_per_token, mha_bytes_per_token (same heads, no
    sharing), kv_bytes (context_len x batch tokens) and kv_gib.
    """
    rows = []
    for cfg in models:
        total = kv_cache_bytes(cfg, context_len, batch, bytes_per_elem)
        rows.append({
            "model": cfg.name,
            "attention": attention_label(cfg),
            "n_layers": cfg.n_layers,
            "bytes_per_token": cfg.kv_bytes_per_token(bytes_per_elem),
            "mha_bytes_per_token": mha_bytes_per_token(cfg, bytes_per_elem),
            "kv_bytes": total,
            "kv_gib": total / 2**30,
        })
    return rows


KV_FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


def kv_format_table(context_len: int, batch: int = 1,
                    models: tuple[ModelConfig, ...] = (PRESETS["smollm2-135m"],
                                                       PRESETS["llama-3-70b"])) -> list[dict]:
    """One row per model and storage format of :data:`KV_FORMATS`: bytes per token (int8 with
    its scales) and the cache of ``batch`` sequences of ``context_len`` tokens.

    Keys: model, kv_cache_dtype, bytes_per_token, vs_float32 (that over float32's), kv_gib."""
    rows = []
    for cfg in models:
        full = kv_bytes_per_token(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, torch.float32)
        for name, dtype in KV_FORMATS.items():
            per = kv_bytes_per_token(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, dtype)
            rows.append({"model": cfg.name, "kv_cache_dtype": name, "bytes_per_token": per,
                         "vs_float32": per / full,
                         "kv_gib": per * context_len * batch / 2**30})
    return rows
