"""Intake: whether a request is acceptable to an engine, decided before anything is queued."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..cache.block_manager import blocks_for
from ..config import SamplingParams

if TYPE_CHECKING:
    from .engine import LLMEngine


def validate_request(engine: LLMEngine, prompt: str | list[int], params: SamplingParams
                     ) -> tuple[list[int], str | None]:
    """Prompt token ids (and text) if the request is acceptable to ``engine``, else ValueError
    naming the parameter. A request that could not run even alone in the pool is refused now
    rather than stuck later."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    text = prompt if isinstance(prompt, str) else None
    if text is not None:
        if engine.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt token ids")
        ids = engine.tokenizer.encode(text)
    else:
        ids = [int(i) for i in prompt]
    engine.model.cfg.check_prompt(ids)
    if engine.speculator is not None and params.use_beam_search:
        raise ValueError("beam search (beam_width > 1) cannot be combined with "
                         "speculative decoding: drafts are verified per sequence")
    if params.structured_outputs is not None:
        check_structured_outputs(engine, params)
    if params.stop and engine.tokenizer is None:
        raise ValueError("stop strings need a tokenizer; this model has none")
    width = max(params.n, params.beam_width)
    if width > engine.config.max_num_seqs:
        raise ValueError(f"n and beam_width must be at most max_num_seqs "
                         f"({engine.config.max_num_seqs}): a request's samples or beams run "
                         f"together; got {width}")
    longest = min(len(ids) + params.max_tokens, engine.model.cfg.max_seq_len)
    shared = len(ids) // engine.blocks.block_size      # full prompt blocks, shared by forks
    need = shared + width * (blocks_for(longest, engine.blocks.block_size) - shared)
    if need > engine.blocks.num_blocks:
        raise ValueError(f"request needs up to {need} KV blocks ({width} x {longest} tokens) "
                         f"but the pool has {engine.blocks.num_blocks}: lower max_tokens, n or "
                         f"beam_width, or raise num_kv_blocks")
    if not engine.config.enable_chunked_prefill:
        # a recomputed request is prefilled again whole, outputs included
        whole = width * longest if engine.config.preemption == "recompute" else len(ids)
        if whole > engine.config.max_num_batched_tokens:
            raise ValueError(f"without chunked prefill a request must fit one step: up to "
                             f"{whole} tokens, max_num_batched_tokens="
                             f"{engine.config.max_num_batched_tokens}; raise it or set "
                             f"enable_chunked_prefill=True")
    return ids, text


def check_structured_outputs(engine: LLMEngine, params: SamplingParams) -> None:
    """ValueError naming ``structured_outputs`` if ``engine`` cannot honour them for this
    request: no compiler installed, a speculator (drafts are verified without the grammar's
    mask), or a grammar the compiler refuses (it compiles it now, before any KV is allocated,
    and caches it for ``add_request``)."""
    if engine.constraint_compiler is None:
        raise ValueError("structured_outputs need a constraint compiler: this engine has none "
                         "(minillm.LLM and the server install minillm.structured's; or call "
                         "engine.use_constraint_compiler)")
    if engine.speculator is not None:
        raise ValueError("structured_outputs cannot be combined with speculative decoding: "
                         "drafts are verified without the grammar's mask")
    engine.constraint_compiler.compile(params.structured_outputs)
