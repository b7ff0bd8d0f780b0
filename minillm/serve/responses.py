"""Engine outputs -> the OpenAI API's response bodies and stream chunks.

A :class:`Renderer` follows one HTTP request: it is fed every (prompt index, RequestOutput)
the engine loop hands over and writes either the stream chunks for it (``chunks``) or, at the
end, the whole response (``response``). Choice ``index`` is ``prompt index * n + sample``, as
in OpenAI's API for a list of prompts. ``usage`` counts every prompt token once and every
generated token of every choice (EOS included when it ended the choice).
"""
from __future__ import annotations

import time
import uuid
from typing import Any

from ..checkpoint.tokenizer import Tokenizer
from ..engine.outputs import CompletionOutput, RequestOutput

Entry = dict[int, float] | None      # the engine's logprobs of one token: {chosen, *top}


def top_entries(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The ``k`` likeliest tokens of an engine entry (the chosen one is listed there first and
    also counts among the top ones when it is one of them)."""
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


class Renderer:
    """What both endpoints share: ids, the latest output of every prompt, usage, stream state."""

    object_name = "text_completion"
    chunk_name = "text_completion"

    def __init__(self, tok: Tokenizer, model: str, prompts: list[str | list[int]], n: int,
                 top_k: int | None, include_usage: bool = False, prefix: str = "cmpl") -> None:
        self.tok, self.model, self.prompts, self.n = tok, model, prompts, n
        self.top_k = top_k                      # None: no logprobs
        self.include_usage = include_usage
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.latest: dict[int, RequestOutput] = {}
        self.sent: dict[int, int] = {}          # choice index -> tokens whose logprobs went out

    def token_text(self, token: int) -> str:
        return self.tok.decode([token])

    def update(self, i: int, out: RequestOutput) -> None:
        self.latest[i] = out

    def usage(self) -> dict[str, int]:
        prompt = sum(len(o.prompt_token_ids) for o in self.latest.values())
        done = sum(len(c.token_ids) for o in self.latest.values() for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": done,
                "total_tokens": prompt + done}

    def envelope(self, name: str, choices: list[dict], usage: bool) -> dict[str, Any]:
        body = {"id": self.id, "object": name, "created": self.created, "model": self.model,
                "choices": choices}
        if usage:
            body["usage"] = self.usage()
        elif self.include_usage:
            body["usage"] = None
        return body

    # ---- whole responses and streams -------------------------------------------------------
    def response(self) -> dict[str, Any]:
        choices = [self.choice(i * self.n + j, i, c)
                   for i, out in sorted(self.latest.items()) for j, c in enumerate(out.outputs)]
        return self.envelope(self.object_name, choices, usage=True)

    def chunks(self, i: int, out: RequestOutput) -> list[dict[str, Any]]:
        """The stream chunks for one engine output (one per choice that has something new)."""
        self.update(i, out)
        found = []
        for j, c in enumerate(out.outputs):
            index = i * self.n + j
            first = index not in self.sent
            new = self.new_tokens(index, c)
            if first or c.text_delta or new or c.finish_reason:
                found.append(self.envelope(self.chunk_name,
                                           [self.chunk_choice(index, i, c, first, new)], False))
        return found

    def usage_chunk(self) -> dict[str, Any]:
        return self.envelope(self.chunk_name, [], usage=True)

    def new_tokens(self, index: int, c: CompletionOutput) -> tuple[list[int], list[Entry]]:
        """Token ids and logprob entries not yet streamed for choice ``index``."""
        start = self.sent.get(index, 0)
        self.sent[index] = len(c.token_ids)
        entries = c.logprobs[start:] if c.logprobs is not None else []
        return c.token_ids[start:], entries

    # ---- per endpoint ----------------------------------------------------------------------
    def choice(self, index: int, i: int, c: CompletionOutput) -> dict[str, Any]:
        raise NotImplementedError

    def chunk_choice(self, index: int, i: int, c: CompletionOutput, first: bool,
                     new: tuple[list[int], list[Entry]]) -> dict[str, Any]:
        raise NotImplementedError


class CompletionRenderer(Renderer):
    """``/v1/completions``: text choices, legacy logprobs (tokens, token_logprobs,
    top_logprobs, text_offset); ``echo`` puts the prompt (and its logprobs) in front."""

    def __init__(self, *args, echo: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.echo = echo
        self.offsets: dict[int, int] = {}       # choice index -> characters streamed

    def prompt_text(self, i: int) -> str:
        p = self.prompts[i]
        return p if isinstance(p, str) else self.tok.decode(p)

    def choice(self, index: int, i: int, c: CompletionOutput) -> dict[str, Any]:
        out = self.latest[i]
        head = self.prompt_text(i) if self.echo else ""
        logprobs = None
        if self.top_k is not None:
            ids, entries = list(c.token_ids), list(c.logprobs or [])
            if self.echo:
                ids, entries = out.prompt_token_ids + ids, list(out.prompt_logprobs or []) + entries
            logprobs = self.logprobs(ids, entries, 0)
        return {"index": index, "text": head + c.text, "logprobs": logprobs,
                "finish_reason": c.finish_reason}

    def chunk_choice(self, index: int, i: int, c: CompletionOutput, first: bool,
                     new: tuple[list[int], list[Entry]]) -> dict[str, Any]:
        ids, entries = new
        text = c.text_delta
        if first and self.echo:
            text = self.prompt_text(i) + text
            out = self.latest[i]
            ids, entries = out.prompt_token_ids + ids, list(out.prompt_logprobs or []) + entries
        logprobs = None
        if self.top_k is not None:
            logprobs = self.logprobs(ids, entries, self.offsets.get(index, 0))
            self.offsets[index] = self.offsets.get(index, 0) + sum(map(len, logprobs["tokens"]))
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": c.finish_reason}

    def logprobs(self, ids: list[int], entries: list[Entry], offset: int) -> dict[str, list]:
        """The legacy format; a token without an entry (the prompt's first) gets None."""
        tokens, chosen, tops, offsets = [], [], [], []
        for t, e in zip(ids, entries):
            s = self.token_text(t)
            offsets.append(offset)
            offset += len(s)
            tokens.append(s)
            chosen.append(None if e is None else e[t])
            tops.append(None if e is None else
                        {self.token_text(a): lp for a, lp in top_entries(e, self.top_k)})
        return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops,
                "text_offset": offsets}


class ChatRenderer(Renderer):
    """``/v1/chat/completions``: assistant messages, streamed as deltas (the first carries the
    role); logprobs in the chat format ({"content": [{token, logprob, bytes, top_logprobs}]})."""

    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, prefix="chatcmpl", **kwargs)

    def choice(self, index: int, i: int, c: CompletionOutput) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": c.text},
                "logprobs": self.logprobs(c.token_ids, c.logprobs or []),
                "finish_reason": c.finish_reason}

    def chunk_choice(self, index: int, i: int, c: CompletionOutput, first: bool,
                     new: tuple[list[int], list[Entry]]) -> dict[str, Any]:
        delta = {"role": "assistant", "content": c.text_delta} if first else \
            {"content": c.text_delta}
        return {"index": index, "delta": delta, "logprobs": self.logprobs(*new),
                "finish_reason": c.finish_reason}

    def logprobs(self, ids: list[int], entries: list[Entry]) -> dict[str, list] | None:
        if self.top_k is None:
            return None
        return {"content": [self.token_logprob(t, e[t]) | {
            "top_logprobs": [self.token_logprob(a, lp) for a, lp in top_entries(e, self.top_k)]}
            for t, e in zip(ids, entries)]}

    def token_logprob(self, token: int, logprob: float) -> dict[str, Any]:
        s = self.token_text(token)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode())}
