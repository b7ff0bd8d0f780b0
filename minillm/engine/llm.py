"""``minillm.LLM``: the offline API of vLLM over our engine.

    llm = minillm.LLM("smollm2-135m", block_size=16, max_num_seqs=64)
    outs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))
    outs[0].text, outs[0].token_ids, outs[0].metrics.ttft

The LLM owns the loop: ``generate`` and ``stream`` step the engine through an
:class:`~minillm.engine.output_processor.OutputProcessor`, which hands each output to the request
it belongs to, so several streams can be consumed at once. ``add_request`` / ``step`` /
``abort`` / ``stats`` pass through to the engine for servers that run their own loop.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ..checkpoint.loader import load_model
from ..config import SamplingParams
from ..device import resolve_device, serving_dtype
from .config import EngineConfig
from .constraints import constraint_compiler_for
from .engine import LLMEngine
from .output_processor import OutputProcessor, Prompt
from .outputs import EngineStats, RequestOutput
from .speculation import speculator_for

Messages = list[dict]


class LLM:
    """Load a model (any name ``minillm.load_model`` takes) and serve it with the engine;
    ``engine_options`` are :class:`EngineConfig` fields (block_size, num_kv_blocks, max_num_seqs,
    max_num_batched_tokens, enable_chunked_prefill, batching, policy, admission, preemption,
    ...). ``speculative_config`` (chapter 06): {"method": "draft_model" | "ngram" | "medusa" |
    "eagle" | "mtp", "num_speculative_tokens": k, ...}, see
    :class:`minillm.spec_decode.SpeculativeConfig`. With no ``dtype`` on a CPU the faster of float32
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
        if speculative_config is not None:   # the builder minillm.spec_decode registers
            self.engine.use_speculator(speculator_for(speculative_config, self.engine))
        compiler = constraint_compiler_for(self.engine)   # minillm.structured's, if imported
        if compiler is not None:                          # (structured_outputs)
            self.engine.use_constraint_compiler(compiler)
        self.output_processor = OutputProcessor(self.engine)   # inboxes, generate, stream

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
        return self.output_processor.generate(prompts, params, priorities=priorities,
                                              use_tqdm=use_tqdm)

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
        return self.output_processor.stream(prompt, params)

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

