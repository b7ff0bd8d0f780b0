"""Incremental detokenization for streaming: the new token ids of a step in, only the new text out.

Re-decoding the whole output every step costs O(length) per step, and taking the new text by
string length breaks characters that byte-level BPE splits over tokens ("日" is three UTF-8
bytes and may sit in two or three tokens; a half-decoded character shows as U+FFFD). As in
vLLM, the detokenizer keeps only a short window of recent ids with a read offset into it:

    window[:read]   context: already emitted, decoded again so the tokenizer sees the new
                    tokens' left neighbour (SentencePiece-style leading spaces need it)
    window[read:]   not emitted yet

For each new token, ``text = decode(window)``. While ``text`` ends in U+FFFD its last character
is incomplete and nothing is emitted; otherwise the new text is
``text[len(decode(window[:read])):]`` and the window slides to ``window[read:]`` with
``read = len(window)``. The window holds a few tokens, whatever the output's length.

Stop strings are searched in the decoded text that is not emitted yet. Text that could still be
the start of a stop string (a suffix that is a prefix of one, shorter than the longest) is held
back, so the emitted text never contains a stop string even when it spans tokens or steps.

Contract, checked by the tests: ``"".join(pushes) + finish() == text ==
cut(decode(all_ids).removesuffix("\\ufffd"))`` where ``cut`` keeps the text before the first stop
string (the one that ends first; of two ending at the same place, the longer) and the removed
U+FFFD is an incomplete character at the end of a finished output.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..checkpoint.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"  # what a lossy UTF-8 decode shows for an incomplete character
# A UTF-8 character has at most 4 bytes, so real text stays incomplete for a token or three.
# Past this many unemitted tokens the output is not valid UTF-8 (a random model's, say): the
# window is emitted as decoded, U+FFFD included, which keeps the cost per step bounded.
MAX_PENDING = 16


class IncrementalDetokenizer:
    """Turns one sequence's output ids into text, step by step.

    ``push(ids)`` takes the ids a step produced (any number, also none) and returns the text
    that became safe to show; ``finish()`` returns the rest when the sequence ends. ``text`` is
    everything emitted so far. ``stopped`` turns True when a stop string appears: the emitted
    text ends just before it and further pushes are ignored (the caller finishes the sequence
    with reason "stop"). Each token costs at most two decodes of at most ``2 * MAX_PENDING``
    ids. The output starts fresh: prompt ids are not part of the window.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] | str = (),
                 skip_special_tokens: bool = True) -> None:
        stops = (stop,) if isinstance(stop, str) else tuple(stop)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        self.tokenizer = tokenizer
        self.stop = stops
        self.skip_special_tokens = skip_special_tokens
        self.stopped = False
        self.finished = False
        self._window: list[int] = []
        self._read = 0                   # window[:read]: context, its text already handed on
        self._held = ""                  # decoded text that may start a stop string
        self._max_held = max(map(len, stops), default=1) - 1
        self._pieces: list[str] = []     # the emitted text, joined lazily by `text`

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def push(self, token_ids: Sequence[int]) -> str:
        """The ids of one step -> the new text to emit (may be ""); "" once stopped."""
        if self.finished:
            raise RuntimeError("push() after finish()")
        if self.stopped:
            return ""
        return self._emit("".join(self._step(int(t)) for t in token_ids), final=False)

    def finish(self) -> str:
        """The sequence ended: flush the held-back text, dropping an incomplete last character."""
        if self.finished:
            return ""
        self.finished = True
        if self.stopped:
            return ""
        tail = ""
        if self._read < len(self._window):   # the text of these ids ends in U+FFFD
            done = len(self._decode(self._window[:self._read]))
            tail = self._decode(self._window)[done:].removesuffix(REPLACEMENT)
        return self._emit(tail, final=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _step(self, token: int) -> str:
        """Append one id; return the text it completes (prefix/read offsets, as in vLLM)."""
        self._window.append(token)
        text = self._decode(self._window)
        if text.endswith(REPLACEMENT) and len(self._window) - self._read < MAX_PENDING:
            return ""
        done = len(self._decode(self._window[:self._read]))
        self._window = self._window[self._read:]
        self._read = len(self._window)
        return text[done:]

    def _emit(self, new: str, final: bool) -> str:
        """Cut ``held + new`` at the first stop string, or emit all but a possible stop start."""
        buf = self._held + new
        cut = self._first_stop(buf)
        if cut is not None:
            self.stopped = True
            out, self._held = buf[:cut], ""
        else:
            keep = 0 if final else self._stop_prefix_len(buf)
            out, self._held = buf[:len(buf) - keep], buf[len(buf) - keep:]
        if out:
            self._pieces.append(out)
        return out

    def _first_stop(self, buf: str) -> int | None:
        """Start of the stop string that ends first in ``buf`` (the longer one on a tie)."""
        best: tuple[int, int] | None = None
        for s in self.stop:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best):
                best = (i + len(s), i)
        return None if best is None else best[1]

    def _stop_prefix_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        for k in range(min(len(buf), self._max_held), 0, -1):
            if any(s.startswith(buf[-k:]) for s in self.stop):
                return k
        return 0
