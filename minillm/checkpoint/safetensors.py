"""Local Hugging Face checkpoints: config.json + *.safetensors -> minillm config and state dict."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import ModelConfig


def hf_name_map(cfg: ModelConfig) -> dict[str, str]:
    """HF Llama/Qwen3 parameter name -> minillm parameter name."""
    m = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
         "lm_head.weight": "lm_head.weight"}
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn.wq",
             "self_attn.k_proj": "attn.wk", "self_attn.v_proj": "attn.wv",
             "self_attn.o_proj": "attn.wo", "self_attn.q_norm": "attn.q_norm",
             "self_attn.k_norm": "attn.k_norm", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn.w_gate", "mlp.up_proj": "ffn.w_up",
             "mlp.down_proj": "ffn.w_down"}
    for i in range(cfg.n_layers):
        for src, dst in parts.items():
            m[f"model.layers.{i}.{src}.weight"] = f"layers.{i}.{dst}.weight"
    return m


def config_from_hf(folder: Path) -> ModelConfig:
    c = json.loads((folder / "config.json").read_text())
    n_heads = c["num_attention_heads"]
    return ModelConfig(
        name=folder.name, vocab_size=c["vocab_size"], d_model=c["hidden_size"],
        n_layers=c["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=c.get("num_key_value_heads", n_heads),
        head_dim=c.get("head_dim") or c["hidden_size"] // n_heads,
        ffn_dim=c["intermediate_size"],
        rope_theta=float(c.get("rope_theta")
                         or (c.get("rope_parameters") or {}).get("rope_theta", 1e4)),
        norm_eps=c.get("rms_norm_eps", 1e-6), max_seq_len=c.get("max_position_embeddings", 2048),
        tie_embeddings=c.get("tie_word_embeddings", False),
        qk_norm=c.get("model_type") == "qwen3",
        bos_token_id=c.get("bos_token_id") or 1, eos_token_id=_first(c.get("eos_token_id"), 2))


def _first(x, default: int) -> int:
    if isinstance(x, list):
        return x[0] if x else default
    return default if x is None else x


def load_hf_checkpoint(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A local HF folder (config.json + *.safetensors) -> (config, float32 state dict)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = config_from_hf(folder)
    names = hf_name_map(cfg)
    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            if k in names:
                state[names[k]] = v.float()
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["embed.weight"]
    return cfg, state
