"""The bytes of each token (what xgrammar is told about our vocabulary) against two references:
the tokenizer itself (the bytes of a text's tokens, joined, are the text's UTF-8) and xgrammar's
own decoding of the same vocabulary handed over as a Hugging Face fast tokenizer (its byte-level
detection and GPT-2 byte table, not ours)."""
from __future__ import annotations

import pytest

from minillm.structured.vocab import byte_decoder, special_token_ids, token_bytes

pytestmark = pytest.mark.slow
TEXTS = ["Hello, world!", "  two spaces\tand a tab\n", '{"name": "Zoë", "age": 7}',
         "日本語のテキスト 🙂 emoji", "ünïcödé ∑ ≤ ∞", "<not a control token>"]


@pytest.fixture(scope="module")
def vocab(real):
    _, tok = real
    return token_bytes(tok)


def test_the_byte_alphabet_is_a_bijection():
    decode = byte_decoder()
    assert sorted(decode.values()) == list(range(256))
    assert decode["Ġ"] == ord(" ") and decode["Ċ"] == ord("\n") and decode["a"] == ord("a")


@pytest.mark.parametrize("text", TEXTS)
def test_the_tokens_bytes_spell_the_text(real, vocab, text):
    _, tok = real
    ids = tok.encode(text)
    assert b"".join(vocab[i] for i in ids) == text.encode()


def test_control_tokens_have_no_bytes_and_eos_is_one(real, vocab):
    _, tok = real
    specials = special_token_ids(tok)
    assert tok.eos_token_id in specials and len(specials) >= 3
    assert all(vocab[i] == b"" for i in specials)
    assert all(vocab[i] for i in range(len(vocab)) if i not in specials)


def test_a_wider_model_vocabulary_is_padded(real):
    _, tok = real
    wide = token_bytes(tok, tok.vocab_size + 5)
    assert wide[-5:] == [b""] * 5 and len(wide) == tok.vocab_size + 5


def test_matches_xgrammar_reading_of_a_hugging_face_tokenizer(real, vocab):
    xgr = pytest.importorskip("xgrammar")
    transformers = pytest.importorskip("transformers")
    _, tok = real
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(vocab),
                                              stop_token_ids=[tok.eos_token_id])
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL
    theirs = info.decoded_vocab
    specials = special_token_ids(tok)
    differ = [i for i in range(len(vocab)) if i not in specials and vocab[i] != theirs[i]]
    assert differ == [], [(i, vocab[i], theirs[i]) for i in differ[:5]]


def test_a_tokenizer_that_is_not_byte_level_is_refused():
    class SentencePieceLike:
        vocab_size = 2
        backend = type("B", (), {"get_added_tokens_decoder": lambda self: {}})()

        def id_to_token(self, i):
            return ["▁hello", "world"][i]

    with pytest.raises(ValueError, match="structured_outputs need a byte-level"):
        token_bytes(SentencePieceLike())
