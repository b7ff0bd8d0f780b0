"""``minillm.LLM``: the offline API of vLLM over our engine.

    llm = minillm.LLM("smollm2-135m", block_size=16, max_num_seqs=64)
    outs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))
    outs[0].text, outs[0].token_ids, outs[0].metrics.ttft

``add_request`` / ``step`` / ``abort`` / ``stats`` pass through to the engine for servers.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from tqdm.auto import tqdm

from ..checkpoint.loader import load_model
from ..config import SamplingParams
from .engine import EngineConfig, LLMEngine
from .outputs import EngineStats, RequestOutput

Prompt = str | list[int]
Messages = list[dict]


class LLM:
    """Load a model (any name ``minillm.load_model`` takes) and serve it with the engine;
    ``engine_options`` are :class:`EngineConfig` fields (block_size, num_kv_blocks, max_num_seqs,
    max_num_batched_tokens, batching, policy, admission, preemption, ...)."""

    def __init__(self, model: str = "smollm2-135m", *, device=None, dtype=None, seed: int = 0,
                 random_weights: bool = False, quantization: str | None = None,
                 **engine_options) -> None:
        extra = {"quantization": quantization} if quantization else {}
        self.model, self.tokenizer = load_model(model, device=device, dtype=dtype, seed=seed,
                                                random_weights=random_weights, **extra)
        self.engine = LLMEngine(self.model, self.tokenizer, EngineConfig(**engine_options))

    # ---- offline -------------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None,
                 *, use_tqdm: bool = True, priorities: Sequence[int] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. A bad prompt raises before
        anything is queued."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        priorities = list(priorities) if priorities is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"priorities must have one entry per prompt ({len(prompts)}), "
                             f"got {len(priorities)}")
        for p in prompts:  # check all first, so that a bad prompt leaves nothing queued
            self.engine.validate(p, params or SamplingParams())
        ids = [self.engine.add_request(p, params, priority=pr)
               for p, pr in zip(prompts, priorities)]
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="requests", disable=not use_tqdm) as bar:
            try:
                while len(done) < len(ids):
                    for out in self.engine.step():
                        if out.finished and out.request_id in ids:
                            done[out.request_id] = out
                            bar.update(1)
            except BaseException:
                for i in ids:
                    if i not in done and i in self.engine.requests:
                        self.engine.abort(i)
                raise
        return [done[i] for i in ids]

    def chat(self, messages: Messages | Sequence[Messages], params: SamplingParams | None = None,
             **kwargs) -> list[RequestOutput]:
        """Apply the chat template to one conversation (or a list of them) and generate."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (and so no chat template)")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(m, add_generation_prompt=True)
                   for m in convs]
        return self.generate(prompts, params, **kwargs)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the new text of one request as its tokens arrive (other queued requests
        advance too)."""
        rid = self.engine.add_request(prompt, params)
        shown = 0
        try:
            while True:
                outs = [o for o in self.engine.step() if o.request_id == rid]
                if outs:
                    text = outs[0].text
                    if len(text) > shown:
                        yield text[shown:]
                        shown = len(text)
                    if outs[0].finished:
                        return
        finally:
            if rid in self.engine.requests:
                self.engine.abort(rid)

    # ---- online (servers) ----------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> str:
        return self.engine.add_request(prompt, params, request_id, priority, arrival_time)

    def step(self) -> list[RequestOutput]:
        return self.engine.step()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def stats(self) -> EngineStats:
        return self.engine.stats()
