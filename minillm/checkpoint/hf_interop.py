"""Converting a minillm model into the equivalent Hugging Face transformers model.

minillm and HF Llama/Qwen3 share one weight layout: the same matrices, the same shapes, and
the same rotary convention (``rotate_half`` over the two halves of each head; our GGUF loader
already un-permutes llama.cpp's interleaved Q/K rows). So the conversion is only a renaming,
the inverse of :func:`minillm.checkpoint.gguf.hf_name_map`, plus a config translation.

Uses: parity tests (same weights, same input -> same logits), and benchmarks that compare
minillm with HF on a preset whose weights are random (``LlamaForCausalLM(config)`` with our
weights copied in), for example ``llama-3.2-1b`` on a GPU.

    hf = to_hf_model(model)           # same device and dtype as ``model``
    torch.testing.assert_close(hf(ids).logits, model(ids))
"""
from __future__ import annotations

import inspect

import torch

from ..config import ModelConfig
from ..model.transformer import Transformer
from .safetensors import hf_name_map


def hf_config(cfg: ModelConfig, dtype: torch.dtype | None = None):
    """minillm ModelConfig -> ``LlamaConfig`` (or ``Qwen3Config`` when ``cfg.qk_norm``)."""
    from transformers import LlamaConfig, Qwen3Config

    cls = Qwen3Config if cfg.qk_norm else LlamaConfig
    kwargs = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings, bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id, attention_bias=False)
    if "rope_parameters" in inspect.signature(cls.__init__).parameters:  # transformers >= 5
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    else:
        kwargs["rope_theta"] = cfg.rope_theta
    if dtype is not None:
        kwargs["torch_dtype" if _old_transformers() else "dtype"] = dtype
    return cls(**kwargs)


def _old_transformers() -> bool:
    import transformers

    return int(transformers.__version__.split(".")[0]) < 5


def to_hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """minillm parameters under HF names (tensors are shared, not copied)."""
    ours = model.state_dict()
    to_hf = {mine: theirs for theirs, mine in hf_name_map(model.cfg).items()}
    return {to_hf[name]: t for name, t in ours.items()}


def to_hf_model(model: Transformer, attn_implementation: str = "sdpa"):
    """A transformers ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` with ``model``'s weights.

    The HF model lives on the same device, in the same dtype, and is in eval mode.
    ``attn_implementation``: "sdpa" (fast) or "eager" (the plain maths).
    """
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

    cfg = model.cfg
    config = hf_config(cfg, model.dtype)
    config._attn_implementation = attn_implementation
    cls = Qwen3ForCausalLM if cfg.qk_norm else LlamaForCausalLM
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(model.dtype)
    try:
        with torch.device(model.device):
            hf = cls(config)
    finally:
        torch.set_default_dtype(old_dtype)
    state = to_hf_state_dict(model)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"HF conversion mismatch: missing {missing}, unexpected {unexpected}")
    if cfg.tie_embeddings:
        hf.tie_weights()
    return hf.eval().requires_grad_(False)
