"""IncrementalDetokenizer against the reference: one full decode of all ids, cut at the first stop.

The reference, ``reference()`` below, decodes all ids at once (no windows, no offsets) and looks
for stop strings one end position at a time; the detokenizer decodes a short window per token
and searches only the text it has not emitted. Texts come from the real SmolLM2 tokenizer, which
splits CJK characters and emoji over several byte-level tokens.
"""
from __future__ import annotations

import random

import pytest

from minillm.engine.detokenizer import MAX_PENDING, IncrementalDetokenizer

FFFD = "\ufffd"

TEXTS = [
    "Café 😀 日本語",
    "Ünïcödé: café, naïve, Straße, Ελληνικά, Москва, مرحبا",
    "emoji 🤖🚀 flags 🇫🇷🇯🇵 family 👨‍👩‍👧 thumbs 👍🏽!",
    "日本語の文章を書くのは難しいです。中华人民共和国的首都是北京。한국어는 아름답습니다.",
    "   leading\n\n\n\t\ttabs   and  runs      of spaces   \n",
    "<|im_start|>assistant\nSure! 👍 done.<|im_end|>\n<|im_start|>user\n",
]
SPLIT_TEXTS = [TEXTS[0], TEXTS[2], TEXTS[3]]  # characters split over tokens
PROSE = "Hello, world! The quick brown fox jumps over the lazy dog. I said aaab, not aab."


@pytest.fixture(scope="module")
def tok():
    from minillm.checkpoint.loader import smollm2_tokenizer

    return smollm2_tokenizer()


def reference(tok, ids, stop=(), skip_special_tokens=True) -> tuple[str, bool]:
    """(text, stopped): decode everything, drop an incomplete last character, cut at the stop
    that ends first (the longest of those ending there)."""
    text = tok.decode(ids, skip_special_tokens=skip_special_tokens).removesuffix(FFFD)
    for end in range(1, len(text) + 1):
        for s in sorted(stop, key=len, reverse=True):
            if text[:end].endswith(s):
                return text[:end - len(s)], True
    return text, False


def chunked(ids, seed):
    """ids cut into seeded random chunks of 0..6 ids (empty pushes included)."""
    rng, out, i = random.Random(seed), [], 0
    while i < len(ids):
        n = rng.randint(0, 6)
        out.append(ids[i:i + n])
        i += n
    return out


def stream(tok, chunks, **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, **kwargs)
    pieces = [d.push(c) for c in chunks]
    pieces.append(d.finish())
    return pieces, d


def check(tok, ids, stop=(), skip_special_tokens=True, valid=True):
    """One id per push, all ids in one push and three random chunkings give the reference."""
    want, want_stopped = reference(tok, ids, stop, skip_special_tokens)
    for chunks in [[[i] for i in ids], [ids]] + [chunked(ids, seed) for seed in range(3)]:
        pieces, d = stream(tok, chunks, stop=stop, skip_special_tokens=skip_special_tokens)
        assert "".join(pieces) == d.text == want
        assert d.stopped == want_stopped
        if valid:
            assert not any(FFFD in p for p in pieces), pieces
    return want


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call gets."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=False) -> str:
        self.lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_texts_split_characters_over_tokens(tok):
    """The texts exercise the bug: the old engine's length delta streams U+FFFD for them."""
    for text in SPLIT_TEXTS:
        ids = tok.encode(text)
        assert any(tok.decode(ids[:k]).endswith(FFFD) for k in range(len(ids)))
        old, pieces = "", []
        for k in range(1, len(ids) + 1):
            new = tok.decode(ids[:k], skip_special_tokens=True)
            pieces.append(new[len(old):])
            old = new
        assert any(FFFD in p for p in pieces)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode(tok, text, skip):
    assert check(tok, tok.encode(text), skip_special_tokens=skip) == tok.decode(
        tok.encode(text), skip_special_tokens=skip)


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode(TEXTS[5])
    kept, skipped = check(tok, ids, skip_special_tokens=False), check(tok, ids)
    assert kept == TEXTS[5]
    assert "<|im_end|>" not in skipped and "Sure! 👍 done." in skipped


def test_prose_stops_spanning_tokens(tok):
    """Stops that start and end inside tokens, over two and over three tokens."""
    ids = tok.encode(PROSE)
    ends = [len(tok.decode(ids[:k])) for k in range(1, len(ids) + 1)]  # token boundaries
    b = ends[len(ends) // 2]
    two = PROSE[b - 2:b + 2]
    three = PROSE[ends[3] - 1:ends[5] + 1]
    for stop in (two, three):
        assert not any(tok.decode([i]).find(stop) >= 0 for i in ids)  # spans tokens
        text = check(tok, ids, stop=[stop])
        assert stop not in text and text == PROSE[:PROSE.index(stop)]


@pytest.mark.parametrize(("stop", "want"), [
    (["Hello"], ""),                                    # at the very start
    (["xyzzy"], PROSE),                                 # never occurs
    ([" PROSE that is much longer than the text itself"], PROSE),
    (["lazy", "quick", "fox"], "Hello, world! The "),  # several: the first wins
    (["brown f", "brown fox"], "Hello, world! The quick "),  # a prefix of another
    (["dog", "lazy dog"], "Hello, world! The quick brown fox jumps over the "),  # same end
    (["The quick", "he"], "Hello, world! T"),          # "he" ends first, though later
    (["aab"], "Hello, world! The quick brown fox jumps over the lazy dog. I said a"),
    (["dog!"], PROSE),                                  # "dog" is held back, then released
])
def test_stop_strings(tok, stop, want):
    assert check(tok, tok.encode(PROSE), stop=stop) == want


@pytest.mark.parametrize(("text", "stop", "skip", "want"), [
    (TEXTS[0], ["😀 日"], True, "Café "),
    (TEXTS[0], ["本"], True, "Café 😀 日"),
    (TEXTS[3], ["。"], True, "日本語の文章を書くのは難しいです"),
    (TEXTS[5], ["<|im_end|>"], False, "<|im_start|>assistant\nSure! 👍 done."),
    (TEXTS[5], ["<|im_end|>"], True, "assistant\nSure! 👍 done.\nuser\n"),  # skipped: no stop
])
def test_stop_strings_multibyte_and_special(tok, text, stop, skip, want):
    assert check(tok, tok.encode(text), stop=stop, skip_special_tokens=skip) == want


def test_stopped_ignores_later_pushes(tok):
    ids = tok.encode(PROSE)
    d = IncrementalDetokenizer(tok, stop=["brown"])
    out = "".join(d.push([i]) for i in ids[:8])
    assert d.stopped and out == d.text == "Hello, world! The quick "
    assert d.push(ids[8:]) == "" and d.finish() == "" and d.text == out
    with pytest.raises(RuntimeError):
        d.push(ids[:1])


def test_truncated_mid_character_drops_it(tok):
    """Every truncation of the split texts, with and without stops; some end mid-character,
    and then the text before that character comes out of finish() (stops still apply)."""
    flushed = stopped_in_finish = 0
    for text in SPLIT_TEXTS + [TEXTS[1]]:
        ids = tok.encode(text)
        cut = [k for k in range(len(ids)) if tok.decode(ids[:k]).endswith(FFFD)]
        assert cut
        for k in range(len(ids) + 1):
            full = reference(tok, ids[:k])[0]
            for stop in [(), ("本",), ("😀 日", "家"), (full[-1:] or "x",), (full[-2:] or "x",)]:
                d = IncrementalDetokenizer(tok, stop=stop)
                out = "".join(d.push([i]) for i in ids[:k])
                before, last = d.stopped, d.finish()
                assert out + last == d.text == reference(tok, ids[:k], stop)[0]
                assert FFFD not in d.text
                flushed += last != ""
                stopped_in_finish += d.stopped and not before
        if cut:  # e.g. "日" of "日本" is three bytes over two tokens
            d = IncrementalDetokenizer(tok)
            assert FFFD not in d.push(ids[:cut[0]]) + d.finish()
            assert len(d.text) < len(tok.decode(ids[:cut[0]]))
    assert flushed and stopped_in_finish  # both paths of finish() ran


def test_cost_per_token_is_bounded(tok):
    """Token 10,000 of a long output decodes a few ids, not the whole output."""
    ids = tok.encode(" ".join(TEXTS[:4]) * 200)[:10_000]
    assert len(ids) == 10_000
    counter = CountingTokenizer(tok)
    d = IncrementalDetokenizer(counter, stop=["<never>", "ok!"])
    out = "".join(d.push([i]) for i in ids[:-1])
    assert max(counter.lengths) <= 2 * MAX_PENDING and len(counter.lengths) <= 2 * len(ids)
    counter.lengths.clear()
    out += d.push(ids[-1:]) + d.finish()
    assert 1 <= len(counter.lengths) <= 4 and max(counter.lengths) <= 2 * MAX_PENDING
    assert out == d.text == reference(tok, ids, ["<never>", "ok!"])[0]


def test_invalid_utf8_stays_bounded(tok):
    """A stream of lone UTF-8 continuation bytes never completes; it is emitted as U+FFFD
    after MAX_PENDING tokens instead of growing the window."""
    b = tok.encode("B")
    lone = next(i for i in range(tok.vocab_size)
                if tok.decode([i] * 3) == FFFD * 3 and tok.decode([i, i] + b) == FFFD * 2 + "B")
    ids = [lone] * 100 + tok.encode(" ok")
    counter = CountingTokenizer(tok)
    d = IncrementalDetokenizer(counter)
    first = d.push(ids[:MAX_PENDING])
    out = first + d.push(ids[MAX_PENDING:]) + d.finish()
    assert first == FFFD * MAX_PENDING and max(counter.lengths) <= 2 * MAX_PENDING
    assert out == reference(tok, ids)[0] == FFFD * 100 + " ok"


def test_bad_stop_is_rejected(tok):
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(tok, stop=["ok", ""])
    assert IncrementalDetokenizer(tok, stop="ok").stop == ("ok",)
