"""The package's constraint compiler: xgrammar.

Why xgrammar (of the CPU libraries on PyPI: xgrammar, llguidance, outlines-core): it is what
vLLM and SGLang use by default, so what a reader learns here carries over. It compiles a JSON
schema, a regex or an EBNF grammar into a pushdown automaton over bytes, precomputes for each
automaton state which tokens of the vocabulary are certainly allowed or rejected (most of the
vocabulary; only the few context-dependent tokens are checked at run time), and fills a token
bitmask, one bit per token, in microseconds. Its tokenizer description is built here from our
own vocabulary (:mod:`.vocab`: the bytes of each token, EOS as the stop token), not from a
Hugging Face tokenizer.

The matcher (:class:`XGrammarConstraint`) implements the engine's
:class:`~minillm.engine.constraints.Constraint`; the bitmask is unpacked to the [V] bool mask
the contract asks for. JSON is written in one line (``json.dumps``'s separators ", " and ": "
and no other whitespace): a small model allowed any whitespace between tokens tends to fill
``max_tokens`` with newlines (``any_whitespace=True`` restores vLLM's default).

xgrammar is imported on first use (it imports transformers: seconds), so an ``LLM`` that never
sees structured outputs never pays for it.
"""
from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint.tokenizer import Tokenizer
from ..config import StructuredOutputsParams
from .vocab import token_bytes

if TYPE_CHECKING:
    from ..engine.engine import LLMEngine

_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")     # "[07:25:26] /project/cpp/x.cc:94: "


def _xgrammar() -> Any:
    import xgrammar
    return xgrammar


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[W] int32 bitmask (bit j of word i: token 32 i + j) -> [vocab_size] bool."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (words[:, None] >> shifts) & 1                    # [W, 32]: arithmetic shift, & 1
    return bits.bool().view(-1)[:vocab_size]


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose only outputs are the ``choices`` (string literals escaped as JSON
    strings, which xgrammar's EBNF reads)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class XGrammarConstraint:
    """One sequence's xgrammar matcher, as the engine's Constraint (see its docstrings)."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size
        self._bitmask = _xgrammar().allocate_token_bitmask(1, vocab_size)   # [1, W] int32

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] bool on the CPU (the matcher's next-token bitmask, unpacked)."""
        if vocab_size != self.vocab_size:
            raise ValueError(f"this matcher was compiled for a vocabulary of {self.vocab_size} "
                             f"tokens, asked for {vocab_size}")
        self.matcher.fill_next_token_bitmask(self._bitmask)
        return unpack_bitmask(self._bitmask[0], vocab_size)

    def accept(self, token_id: int) -> None:
        if not self.matcher.accept_token(int(token_id)):
            raise ValueError(f"token {token_id} is not allowed here by the structured_outputs "
                             f"grammar")

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fork(self) -> XGrammarConstraint:
        return XGrammarConstraint(self.matcher.fork(), self.vocab_size)


class XGrammarCompiler:
    """Compiles :class:`~minillm.config.StructuredOutputsParams` into matchers over
    ``tokenizer``'s vocabulary (``vocab_size``: the model's logits width, at least the
    tokenizer's). Compiled grammars are cached by xgrammar (by schema, regex or grammar text),
    so a request's second compile (intake checks, then ``add_request`` builds) is a lookup."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, *,
                 any_whitespace: bool = False) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.any_whitespace = any_whitespace
        self._compiler: Any = None

    @classmethod
    def for_engine(cls, engine: LLMEngine) -> XGrammarCompiler:
        return cls(engine.tokenizer, engine.model.cfg.vocab_size)

    def tokenizer_info(self) -> Any:
        """xgrammar's description of our vocabulary: each token's bytes (RAW: no further
        decoding), the logits' width, EOS as the stop token."""
        xgr = _xgrammar()
        return xgr.TokenizerInfo(token_bytes(self.tokenizer, self.vocab_size),
                                 xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                 stop_token_ids=[self.tokenizer.eos_token_id])

    @property
    def grammar_compiler(self) -> Any:
        """xgrammar's GrammarCompiler (built on first use: about 0.2 s for 49k tokens)."""
        if self._compiler is None:
            self._compiler = _xgrammar().GrammarCompiler(self.tokenizer_info(), max_threads=1)
        return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> XGrammarConstraint:
        """A fresh matcher for ``spec``; ValueError naming ``structured_outputs.<kind>`` for a
        grammar xgrammar refuses or one that allows no output at all."""
        if not isinstance(spec, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(spec).__name__}")
        kind = spec.kind
        try:
            compiled = self._compile(spec)
        except (RuntimeError, TypeError, ValueError) as e:     # xgrammar's errors: RuntimeError
            message = _LOCATION.sub("", str(e).strip())
            raise ValueError(f"structured_outputs.{kind} was refused by the grammar compiler: "
                             f"{message}") from None
        constraint = XGrammarConstraint(_xgrammar().GrammarMatcher(compiled), self.vocab_size)
        if not constraint.allowed(self.vocab_size).any():
            raise ValueError(f"structured_outputs.{kind} allows no output at all")
        return constraint

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        c = self.grammar_compiler
        if spec.json is not None:
            return c.compile_json_schema(spec.schema_text(), any_whitespace=self.any_whitespace)
        if spec.json_object:               # OpenAI's json_object: any JSON object
            return c.compile_json_schema('{"type": "object"}', strict_mode=False,
                                         any_whitespace=self.any_whitespace)
        if spec.regex is not None:
            return c.compile_regex(spec.regex)
        if spec.choice is not None:
            return c.compile_grammar(choice_grammar(spec.choice))
        return c.compile_grammar(spec.grammar)
