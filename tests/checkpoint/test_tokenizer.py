"""Our tokenizer (built from the GGUF vocab and merges) against HF's tokenizer for the same file."""
from __future__ import annotations

import pytest

TEXTS = [
    "Hello, world!",
    "def f(x):\n    return x ** 2  # square\n\n\tprint(f(3))",
    "Ünïcödé: café, naïve, Straße, 東京, Москва, مرحبا",
    "emoji 🤖🚀 and flags 🇫🇷, zero-width\u200bjoiner",
    "   leading and trailing spaces   \n\n\n   many\t\ttabs",
    "numbers 3.14159 1,234,567 0x1F 2024-11-30",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "it's they're we'll I'd you've DON'T",
    "",
]


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_hf(real, hf_tokenizer, text):
    _, tok = real
    ours = tok.encode(text)
    assert ours == hf_tokenizer.encode(text, add_special_tokens=False)
    assert tok.decode(ours) == text


@pytest.mark.slow
def test_special_tokens_are_single_ids(real):
    _, tok = real
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert tok.eos_token_id == 2


@pytest.mark.slow
def test_chat_template_matches_hf(real, hf_tokenizer):
    _, tok = real
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]
    ours = tok.apply_chat_template(msgs, add_generation_prompt=True)
    ref = hf_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert ours == ref and ours.endswith("<|im_start|>assistant\n")
    # without a system message the template inserts SmolLM's default one
    assert "SmolLM" in tok.apply_chat_template(msgs[1:2])


@pytest.mark.slow
def test_decode_rejects_unknown_ids(real):
    _, tok = real
    with pytest.raises(ValueError, match="token ids"):
        tok.decode([5, 10**6])
