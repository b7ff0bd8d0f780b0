"""Structured outputs (constrained decoding): the output follows a JSON schema, a regex, a
choice list or an EBNF grammar, as vLLM's ``structured_outputs`` and OpenAI's
``response_format``.

The engine sees only its Protocols (:mod:`minillm.engine.constraints`): a per-sequence matcher
(allowed tokens, accept a token, terminated, fork) and a compiler that makes one from a
request's :class:`~minillm.config.StructuredOutputsParams`. This package supplies them with
xgrammar (:mod:`.xgrammar_backend`) over our tokenizer's vocabulary (:mod:`.vocab`) and
registers its compiler, which ``minillm.LLM`` and the server install::

    llm = minillm.LLM("smollm2-135m")
    so = minillm.config.StructuredOutputsParams(json={"type": "object", ...})
    llm.generate(prompt, minillm.SamplingParams(structured_outputs=so))
"""
from __future__ import annotations

from ..config import StructuredOutputsParams
from ..engine.constraints import register_constraint_compiler_builder
from .vocab import token_bytes
from .xgrammar_backend import XGrammarCompiler, XGrammarConstraint

register_constraint_compiler_builder(XGrammarCompiler.for_engine)

__all__ = ["StructuredOutputsParams", "XGrammarCompiler", "XGrammarConstraint", "token_bytes"]
