"""Our tokenizer's vocabulary as the bytes each token stands for: what a grammar engine needs.

A grammar is over text, a sampler over token ids: to know which tokens may come next, the
grammar engine must know the exact bytes of every token. Our tokenizer is GPT-2's byte-level
BPE (:mod:`minillm.checkpoint.tokenizer`): each of the 256 byte values is written as one
printable character (``bytes_to_unicode``: printable ASCII and Latin-1 stand for themselves,
the rest are shifted to U+0100 and up; a space is ``Ġ``), and a token's string is its bytes in
that alphabet. Decoding a single token's string gives raw bytes that may be part of a UTF-8
character (a token can end mid-character), which is why bytes, not ``str``, are the unit.
Control tokens (``<|im_start|>`` ...) stand for no text: they get ``b""``, which grammar
engines read as "never allowed" (EOS is allowed separately, where the grammar may end).
"""
from __future__ import annotations

from functools import lru_cache

from ..checkpoint.tokenizer import Tokenizer


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's printable character -> the byte it stands for (256 entries)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    shifted = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def special_token_ids(tokenizer: Tokenizer) -> set[int]:
    """Ids of the tokenizer's control tokens (added tokens marked special)."""
    return {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}


def token_bytes(tokenizer: Tokenizer, vocab_size: int | None = None) -> list[bytes]:
    """The bytes of every token id in [0, vocab_size) (default: the tokenizer's size):
    ``b""`` for control tokens and for ids past the tokenizer's vocabulary (a model whose
    logits are wider than its tokenizer). ValueError for a tokenizer that is not byte-level
    (a character outside GPT-2's byte alphabet)."""
    vocab_size = tokenizer.vocab_size if vocab_size is None else vocab_size
    decode = byte_decoder()
    specials = special_token_ids(tokenizer)
    out = []
    for i in range(vocab_size):
        text = tokenizer.id_to_token(i) if i < tokenizer.vocab_size else None
        if text is None or i in specials:
            out.append(b"")
            continue
        try:
            out.append(bytes(decode[c] for c in text))
        except KeyError as e:
            raise ValueError(f"structured_outputs need a byte-level BPE tokenizer (GPT-2's): "
                             f"token {i} ({text!r}) has the character {e.args[0]!r} outside "
                             f"its byte alphabet") from None
    return out
