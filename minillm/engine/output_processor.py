"""The front end's loop over an engine: per-request inboxes, ``generate`` and ``stream``.

An engine's ``step()`` hands each output out once, to whoever called it. A front end that
serves several consumers at once (two streams read in turn, a stream next to a ``generate``)
must therefore keep what one step produced for the requests not being read right now. The
:class:`OutputProcessor` does that with one inbox per watched request:

    proc = OutputProcessor(engine)                  # engine: anything shaped like EngineLike
    outs = proc.generate(["Hi", "Bye"], params)     # every prompt to completion, prompt order
    for piece in proc.stream("Tell me a story"):    # one request's new text; others advance too
        print(piece, end="")

An inbox holds the latest output of its request not yet taken; a later output is merged into it
(the newer output, with the text deltas of both joined), so a request nobody reads holds one
output, not one per step. A request watched with a ``sink`` gets each output pushed to it as
the step delivers it instead (a server that forwards outputs to its clients). ``minillm.LLM``,
``minillm.disagg.DisaggLLM`` and the server's engine loop (``minillm.serve.loop``) all take
their outputs through it; with ``timeout_s`` (DisaggLLM's) a wait in which no watched request
hears anything for that long raises TimeoutError naming them.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Protocol

from tqdm.auto import tqdm

from ..config import SamplingParams
from .outputs import RequestOutput

Prompt = str | list[int]


class EngineLike(Protocol):
    """What :class:`OutputProcessor` drives (``LLMEngine``, ``DisaggLLM``, a test's fake).

    - ``validate(prompt, params)`` -> (prompt token ids, prompt text or None) if the request is
      acceptable, else ValueError; changes nothing.
    - ``add_request(prompt, params, request_id=None)`` -> the new request's id; bad input raises
      ValueError and leaves the engine as it was. An engine that orders requests by priority
      also takes ``priority=`` (passed only when the caller gives priorities).
    - ``step()`` advances every unfinished request and returns one output for each request that
      changed, each output handed out once: ``outputs[i].text_delta`` is the text new since that
      request's previous output, and a request's last output has ``finished`` set. An aborted
      request produces no further output.
    - ``abort(request_id)`` stops an unfinished request now; a finished or unknown id is a no-op.
      Returns whether it stopped one.
    - ``has_unfinished()``: whether any request is still running or queued.
    """

    def validate(self, prompt: Prompt, params: SamplingParams
                 ) -> tuple[list[int], str | None]: ...

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str: ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> bool: ...

    def has_unfinished(self) -> bool: ...


class OutputProcessor:
    """Inboxes and loops over ``engine``. ``timeout_s`` (None: wait as long as it takes): a
    wait for an output in which no watched request gets one for that long raises TimeoutError
    naming the watched requests; ``explain(request_ids)`` adds the engine's own account of them
    to the message (worker state, say). Not thread-safe: one thread drives the engine."""

    def __init__(self, engine: EngineLike, *, timeout_s: float | None = None,
                 explain: Callable[[list[str]], str] | None = None) -> None:
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
        self.engine = engine
        self.timeout_s = timeout_s
        self.explain = explain
        self._inbox: dict[str, RequestOutput | None] = {}   # latest output not yet taken
        self._heard: dict[str, float] = {}     # monotonic time of the last output (or watch)
        self._sinks: dict[str, Callable[[RequestOutput], None]] = {}   # pushed, not kept

    # ---- the loops -----------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams | None] | None = None, *,
                 priorities: Sequence[int] | None = None, use_tqdm: bool = False
                 ) -> list[RequestOutput]:
        """Run every prompt (text or token ids; one prompt or a list) to completion; the final
        outputs in prompt order. ``params``: one SamplingParams for all (None: the defaults) or
        one per prompt. ``priorities``: one per prompt, passed to ``add_request``. Every prompt
        is validated before any is queued, so a bad one raises and leaves nothing queued."""
        prompts = as_prompt_list(prompts)
        per_prompt = one_per_prompt(params, len(prompts))
        if priorities is not None and len(priorities) != len(prompts):
            raise ValueError(f"priorities must have one entry per prompt ({len(prompts)}), "
                             f"got {len(priorities)}")
        for p, sp in zip(prompts, per_prompt):
            self.engine.validate(p, sp)
        ids = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, per_prompt)):
                extra = {} if priorities is None else {"priority": priorities[i]}
                ids.append(self.watch(self.engine.add_request(p, sp, **extra)))
        except BaseException:
            self.forget(ids)
            raise
        return self.collect(ids, use_tqdm=use_tqdm)

    def collect(self, request_ids: Sequence[str], *, use_tqdm: bool = False
                ) -> list[RequestOutput]:
        """Step until every request of ``request_ids`` (already added to the engine) has
        finished; their final outputs in that order. A request not watched yet is watched from
        now on (its final output still holds all its tokens). On return, or on an error, the
        requests are forgotten and any still running aborted."""
        ids = [self.watch(rid) if rid not in self._inbox else rid for rid in request_ids]
        done: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(ids), desc="requests", disable=not use_tqdm) as bar:
                for rid in ids:
                    while rid not in done:
                        out = self.next_output(rid)
                        if out.finished:
                            done[rid] = out
                            bar.update(1)
        finally:
            self.forget(ids)
        return [done[rid] for rid in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the new text of one request as its tokens arrive (empty deltas skipped). The
        request is added on the first ``next()``. Other requests advance too, and several
        streams may be consumed at once, in any interleaving. Closing the stream before its
        end (or dropping it) aborts the request."""
        rid = self.watch(self.engine.add_request(prompt, params))
        try:
            while True:
                out = self.next_output(rid)
                if out.outputs[0].text_delta:
                    yield out.outputs[0].text_delta
                if out.finished:
                    return
        finally:
            self.forget([rid])

    # ---- inboxes -------------------------------------------------------------------------------
    def watch(self, request_id: str,
              sink: Callable[[RequestOutput], None] | None = None) -> str:
        """Keep the outputs of ``request_id`` from now on (an empty inbox); returns the id.
        With ``sink``, each output is handed to ``sink(output)`` as :meth:`deliver` files it
        instead, and the request is forgotten after its last (finished) output."""
        self._inbox[request_id] = None
        self._heard[request_id] = time.monotonic()
        if sink is not None:
            self._sinks[request_id] = sink
        return request_id

    def forget(self, request_ids: Sequence[str]) -> None:
        """Stop keeping outputs for ``request_ids``, aborting any still running."""
        for rid in request_ids:
            self._inbox.pop(rid, None)
            self._heard.pop(rid, None)
            self._sinks.pop(rid, None)
            self.engine.abort(rid)

    @property
    def watched(self) -> list[str]:
        """The ids of the requests whose outputs are kept, in the order they were watched."""
        return list(self._inbox)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """File the outputs of one ``engine.step()`` into the inboxes of watched requests
        (merged with what is already there); outputs of other requests are dropped. For code
        that steps the engine itself while streams are open."""
        now = time.monotonic()
        for out in outputs:
            rid = out.request_id
            if rid in self._sinks:
                sink = self._sinks[rid]
                if out.finished:
                    self.forget([rid])
                sink(out)
            elif rid in self._inbox:
                self._inbox[rid] = merge_outputs(self._inbox[rid], out)
                self._heard[rid] = now

    def next_output(self, request_id: str) -> RequestOutput:
        """The next output of watched request ``request_id`` (its inbox, emptied), stepping the
        engine until there is one. Raises RuntimeError if the engine has nothing left to run
        and the inbox is empty, TimeoutError past ``timeout_s`` without progress."""
        if request_id not in self._inbox or request_id in self._sinks:
            raise ValueError(f"request {request_id!r} is not watched with an inbox: add it "
                             f"with watch() (no sink)")
        while self._inbox[request_id] is None:
            if not self.engine.has_unfinished():
                raise RuntimeError(f"request {request_id!r} is not in the engine")
            self.deliver(self.engine.step())
            self._check_progress()
        out, self._inbox[request_id] = self._inbox[request_id], None
        return out

    def _check_progress(self) -> None:
        """TimeoutError when no watched request has heard anything for ``timeout_s``."""
        if self.timeout_s is None or not self._heard:
            return
        now = time.monotonic()
        if now - max(self._heard.values()) <= self.timeout_s:
            return
        stuck = [rid for rid, out in self._inbox.items() if out is None or not out.finished]
        waits = ", ".join(f"{rid!r} ({now - self._heard[rid]:.1f} s since its last output)"
                          for rid in stuck)
        extra = f"; {self.explain(stuck)}" if self.explain is not None else ""
        raise TimeoutError(f"no request made progress in {self.timeout_s} s; waiting: "
                           f"{waits}{extra}")


def merge_outputs(old: RequestOutput | None, new: RequestOutput) -> RequestOutput:
    """``new`` with the text deltas of ``old`` (an output not yet taken) in front of its own,
    completion by completion (matched on ``index``); ``new`` itself is left unchanged."""
    if old is None:
        return new
    before = {c.index: c.text_delta for c in old.outputs}
    joined = [replace(c, text_delta=before.get(c.index, "") + c.text_delta) for c in new.outputs]
    return replace(new, outputs=joined)


def as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text, or token ids) or a list of them, as a list of prompts."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def one_per_prompt(params: SamplingParams | Sequence[SamplingParams | None] | None,
                   n: int) -> list[SamplingParams]:
    """``params`` as a list with one SamplingParams per prompt (None: the defaults)."""
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"params must be one SamplingParams or one per prompt ({n}), "
                         f"got {len(params)}")
    return [sp or SamplingParams() for sp in params]
