"""minillm -> HF transformers conversion: same weights must give the same logits.

Models are built with ``random_model`` directly, so no GGUF file or tokenizer is needed.
"""
import pytest
import torch

from minillm.checkpoint import random_model
from minillm.config import PRESETS

pytest.importorskip("transformers")
from minillm.checkpoint.hf_interop import to_hf_model, to_hf_state_dict  # noqa: E402


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tiny_preset_logits_match_hf(attn):
    model = random_model(PRESETS["tiny"]).eval()
    hf = to_hf_model(model, attn_implementation=attn)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 23), generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-4, rtol=0)


def test_qk_norm_config_becomes_qwen3():
    cfg = PRESETS["qwen3-0.6b"].with_(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2,
                                      head_dim=16, ffn_dim=96, vocab_size=300, max_seq_len=64,
                                      bos_token_id=0, eos_token_id=1)
    model = random_model(cfg).eval()
    hf = to_hf_model(model)
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    ids = torch.randint(0, cfg.vocab_size, (1, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-4, rtol=0)


def test_state_dict_names_and_tied_head():
    model = random_model(PRESETS["tiny"]).eval()
    state = to_hf_state_dict(model)
    assert "model.layers.1.mlp.down_proj.weight" in state
    hf = to_hf_model(model)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    assert hf.config.tie_word_embeddings
