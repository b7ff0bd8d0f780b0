"""``minillm.LLM``: the offline API of vLLM over our engine.

    llm = minillm.LLM("smollm2-135m", block_size=16, max_num_seqs=64)
    outs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))
    outs[0].text, outs[0].token_ids, outs[0].metrics.ttft

The LLM owns the loop: ``generate`` and ``stream`` step the engine and hand each output to the
request it belongs to, so several streams can be consumed at once. ``add_request`` / ``step`` /
``abort`` / ``stats`` pass through to the engine for servers that run their own loop.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from tqdm.auto import tqdm

from ..checkpoint.loader import load_model
from ..config import SamplingParams
from ..device import resolve_device, serving_dtype
from .engine import EngineConfig, LLMEngine
from .outputs import EngineStats, RequestOutput

Prompt = str | list[int]
Messages = list[dict]


class LLM:
    """Load a model (any name ``minillm.load_model`` takes) and serve it with the engine;
    ``engine_options`` are :class:`EngineConfig` fields (block_size, num_kv_blocks, max_num_seqs,
    max_num_batched_tokens, enable_chunked_prefill, batching, policy, admission, preemption,
    ...). ``speculative_config`` (chapter 06): {"method": "draft_model" | "ngram" | "medusa" |
    "eagle" | "mtp", "num_speculative_tokens": k, ...}, see
    :class:`minillm.spec.SpeculativeConfig`. With no ``dtype`` on a CPU the faster of float32
    and bfloat16 for this machine is picked (:func:`minillm.device.serving_dtype`);
    ``dtype_reason`` says why."""

    def __init__(self, model: str = "smollm2-135m", *, device=None, dtype=None, seed: int = 0,
                 random_weights: bool = False, quantization: str | None = None,
                 speculative_config: dict | None = None, **engine_options) -> None:
        extra = {"quantization": quantization} if quantization else {}
        dtype, self.dtype_reason = serving_dtype(dtype, resolve_device(device))
        self.model, self.tokenizer = load_model(model, device=device, dtype=dtype, seed=seed,
                                                random_weights=random_weights, **extra)
        self.engine = LLMEngine(self.model, self.tokenizer, EngineConfig(**engine_options))
        if speculative_config is not None:
            from ..spec.speculator import build_speculator  # technique on top of the core
            self.engine.use_speculator(build_speculator(speculative_config, self.engine))
        self._inbox: dict[str, RequestOutput | None] = {}   # latest output not yet taken

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    # ---- offline -------------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, priorities: Sequence[int] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt (text or token ids) to completion; outputs in prompt order.
        ``params``: one SamplingParams for all, or one per prompt. A bad prompt or parameter
        raises before anything is queued."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        per_prompt = _one_per_prompt(params, len(prompts))
        priorities = list(priorities) if priorities is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"priorities must have one entry per prompt ({len(prompts)}), "
                             f"got {len(priorities)}")
        for p, sp in zip(prompts, per_prompt):  # all first: a bad one leaves nothing queued
            self.engine.validate(p, sp)
        ids = [self._watch(self.engine.add_request(p, sp, priority=pr))
               for p, sp, pr in zip(prompts, per_prompt, priorities)]
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="requests", disable=not use_tqdm) as bar:
            try:
                for rid in ids:
                    while rid not in done:
                        out = self._next(rid)
                        if out.finished:
                            done[rid] = out
                            bar.update(1)
            finally:
                self._forget(ids)
        return [done[i] for i in ids]

    def chat(self, messages: Messages | Sequence[Messages],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             **kwargs) -> list[RequestOutput]:
        """Apply the chat template to one conversation (or a list of them) and generate."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (and so no chat template)")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(m, add_generation_prompt=True)
                   for m in convs]
        return self.generate(prompts, params, **kwargs)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the new text of one request as its tokens arrive (other requests advance too;
        several streams may be consumed at once). Closing the stream early aborts it."""
        rid = self._watch(self.engine.add_request(prompt, params))
        try:
            while True:
                out = self._next(rid)
                if out.outputs[0].text_delta:
                    yield out.outputs[0].text_delta
                if out.finished:
                    return
        finally:
            self._forget([rid])

    def _watch(self, rid: str) -> str:
        self._inbox[rid] = None
        return rid

    def _forget(self, ids: list[str]) -> None:
        """Stop collecting outputs for ``ids``, aborting any still running."""
        for rid in ids:
            self._inbox.pop(rid, None)
            self.engine.abort(rid)

    def _next(self, rid: str) -> RequestOutput:
        """The next output of request ``rid``, stepping the engine until there is one. The
        other watched requests' outputs wait in their inboxes, merged into one (the latest,
        with the text deltas joined), so a waiting request holds one output, not one per step."""
        while self._inbox[rid] is None:
            if not self.engine.has_unfinished():
                raise RuntimeError(f"request {rid!r} is not in the engine")
            for out in self.engine.step():
                if out.request_id in self._inbox:
                    self._inbox[out.request_id] = _merge(self._inbox[out.request_id], out)
        out, self._inbox[rid] = self._inbox[rid], None
        return out

    # ---- online (servers) ----------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> str:
        return self.engine.add_request(prompt, params, request_id, priority, arrival_time)

    def step(self) -> list[RequestOutput]:
        return self.engine.step()

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def stats(self) -> EngineStats:
        return self.engine.stats()


def _merge(old: RequestOutput | None, new: RequestOutput) -> RequestOutput:
    """``new`` with the text deltas of ``old`` (not yet taken) in front of its own."""
    if old is not None:
        for a, b in zip(old.outputs, new.outputs):
            b.text_delta = a.text_delta + b.text_delta
    return new


def _one_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None,
                    n: int) -> list[SamplingParams]:
    """``params`` as a list with one SamplingParams per prompt."""
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"params must be one SamplingParams or one per prompt ({n}), "
                         f"got {len(params)}")
    return params
