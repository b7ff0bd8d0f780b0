"""Our GGUF dequantisation against the `gguf` package, bit for bit, and the loaders."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from minillm.checkpoint.gguf import dequantize, unpermute_qk


@pytest.fixture(scope="module")
def reader(gguf_path):
    return GGUFReader(str(gguf_path))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "F32"])
def test_dequantize_bit_exact(reader, qtype):
    tensors = [t for t in reader.tensors if t.tensor_type.name == qtype][:6]
    assert tensors, f"the model file has no {qtype} tensor"
    for t in tensors:
        shape = tuple(int(s) for s in reversed(t.shape))
        ours = dequantize(t.data, qtype, shape).numpy()
        ref = gguf_dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        assert ours.dtype == ref.dtype and ours.shape == ref.shape
        assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32)), t.name


def test_q4_1_nibble_order():
    """A hand-built block: d=2, m=-1, weight j = j mod 16 in low nibbles, 15 - j in high ones."""
    d, m = np.float16(2.0), np.float16(-1.0)
    lo = np.arange(16, dtype=np.uint8)
    hi = 15 - lo
    block = np.concatenate([np.frombuffer(d.tobytes() + m.tobytes(), np.uint8), lo | (hi << 4)])
    w = dequantize(block, "Q4_1", (32,))
    expected = torch.tensor(list(range(16)) + list(range(15, -1, -1)), dtype=torch.float32) * 2 - 1
    assert torch.equal(w, expected)


def test_unpermute_inverts_llama_cpp_permutation():
    """llama.cpp's converter interleaves rotary halves; unpermute must undo it exactly."""
    n_heads, hd, d = 3, 8, 5
    w = torch.randn(n_heads * hd, d)
    permuted = w.reshape(n_heads, 2, hd // 2, d).transpose(1, 2).reshape(w.shape)
    assert torch.equal(unpermute_qk(permuted, n_heads), w)
    assert not torch.equal(permuted, w)


def test_unsupported_type_is_a_clear_error():
    with pytest.raises(NotImplementedError, match="Q2_K"):
        dequantize(np.zeros(84, np.uint8), "Q2_K", (256,))


def test_hf_checkpoint_folder_matches_transformers(tmp_path):
    """A tiny random Llama saved by transformers loads into minillm with equal logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import minillm

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                      max_position_embeddings=128, tie_word_embeddings=False)
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    model, tok = minillm.load_model(str(tmp_path), device="cpu", dtype="float32")
    assert tok is None and model.cfg.n_kv_heads == 2 and not model.cfg.tie_embeddings
    ids = torch.randint(0, 300, (2, 17))
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(model(ids), ref, atol=1e-4, rtol=1e-4)


def test_unknown_model_name_lists_presets():
    import minillm

    with pytest.raises(ValueError, match="presets.*smollm2-135m"):
        minillm.load_model("gpt-17")
