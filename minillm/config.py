"""Frozen configuration dataclasses: the model's shape and the sampling parameters.

Every invariant is checked in ``__post_init__`` so a bad value fails where it is written,
with a message that names the parameter and the allowed range.
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (RMSNorm, RoPE, GQA attention, SwiGLU).

    ``n_kv_heads == n_heads`` is multi-head attention, ``1`` is multi-query, anything between
    that divides ``n_heads`` is grouped-query attention.
    """

    name: str = "custom"
    vocab_size: int = 49152
    d_model: int = 576
    n_layers: int = 30
    n_heads: int = 9
    n_kv_heads: int = 3
    head_dim: int = 64
    ffn_dim: int = 1536
    rope_theta: float = 100000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 8192
    tie_embeddings: bool = True
    qk_norm: bool = False  # Qwen3 normalises q and k per head before RoPE
    bos_token_id: int = 1
    eos_token_id: int = 2
    n_experts: int = 0  # > 0: each FFN is a mixture of n_experts SwiGLU experts of ffn_dim
    top_k: int = 2  # experts per token when n_experts > 0

    def __post_init__(self) -> None:
        for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                      "head_dim", "ffn_dim", "max_seq_len"):
            if getattr(self, field) < 1:
                raise ValueError(f"ModelConfig.{field} must be >= 1, got {getattr(self, field)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of "
                             f"n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError("ModelConfig.rope_theta and norm_eps must be > 0")
        if self.n_experts < 0:
            raise ValueError(f"ModelConfig.n_experts must be >= 0 (0 = dense FFN), got "
                             f"{self.n_experts}")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"ModelConfig.top_k must be in [1, n_experts={self.n_experts}], "
                             f"got {self.top_k}")

    @property
    def group_size(self) -> int:
        """Query heads that share one KV head."""
        return self.n_heads // self.n_kv_heads

    def kv_bytes_per_token(self, bytes_per_elem: int = 2) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes: the KV cache cost of one token."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * bytes_per_elem

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        attn = self.d_model * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        ffn = 3 * self.d_model * self.ffn_dim
        if self.n_experts:  # every expert is a SwiGLU, plus the router
            ffn = self.n_experts * ffn + self.d_model * self.n_experts
        norms = 2 * self.d_model + (2 * self.head_dim if self.qk_norm else 0)
        emb = self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)
        return self.n_layers * (attn + ffn + norms) + emb + self.d_model

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """ValueError for an empty prompt, an id outside the vocabulary, or a prompt that leaves
        no room in the context window (max_seq_len) for one generated token."""
        if len(prompt_ids) == 0:
            raise ValueError("prompt must contain at least one token")
        if len(prompt_ids) >= self.max_seq_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the context window "
                             f"(max_seq_len) allows at most {self.max_seq_len - 1} so one can "
                             f"be generated")
        bad = [i for i in prompt_ids if not 0 <= int(i) < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")

    def with_(self, **changes) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


PRESETS: dict[str, ModelConfig] = {
    # The real model of the course; load_model() fills its weights from the GGUF file.
    "smollm2-135m": ModelConfig(name="smollm2-135m"),
    # Small random model for fast tests.
    "tiny": ModelConfig(name="tiny", vocab_size=49152, d_model=64, n_layers=2, n_heads=4,
                        n_kv_heads=2, head_dim=16, ffn_dim=128, max_seq_len=512),
    # A small mixture-of-experts model (SmolLM2's vocabulary, GQA, 8 SwiGLU experts per layer,
    # top-2 routing): expert parallelism in chapter 03, random weights.
    "moe-tiny": ModelConfig(name="moe-tiny", d_model=256, n_layers=4, n_heads=8, n_kv_heads=2,
                            head_dim=32, ffn_dim=384, max_seq_len=2048, n_experts=8, top_k=2),
    # Real shapes, random weights: calculators and GPU benchmarks.
    "qwen3-0.6b": ModelConfig(name="qwen3-0.6b", vocab_size=151936, d_model=1024, n_layers=28,
                              n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=3072,
                              rope_theta=1e6, norm_eps=1e-6, max_seq_len=40960, qk_norm=True,
                              bos_token_id=151643, eos_token_id=151645),
    "llama-3.2-1b": ModelConfig(name="llama-3.2-1b", vocab_size=128256, d_model=2048,
                                n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
                                ffn_dim=8192, rope_theta=5e5, max_seq_len=131072,
                                bos_token_id=128000, eos_token_id=128009),
    "llama-3-8b": ModelConfig(name="llama-3-8b", vocab_size=128256, d_model=4096, n_layers=32,
                              n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336,
                              rope_theta=5e5, max_seq_len=8192, tie_embeddings=False,
                              bos_token_id=128000, eos_token_id=128009),
    "llama-3-70b": ModelConfig(name="llama-3-70b", vocab_size=128256, d_model=8192,
                               n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
                               ffn_dim=28672, rope_theta=5e5, max_seq_len=8192,
                               tie_embeddings=False, bos_token_id=128000, eos_token_id=128009),
}


def get_preset(name: str) -> ModelConfig:
    """The preset called ``name``; the error lists every preset."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model name {name!r}: expected a .gguf file, an HF checkpoint "
                         f"folder, or one of the presets {sorted(PRESETS)}") from None


MAX_LOGPROBS = 20  # vLLM's default cap on logprobs / prompt_logprobs


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A grammar the output must follow (vLLM's ``structured_outputs``; its names): exactly one
    of ``json`` (a JSON schema: a dict or its JSON text), ``regex`` (the whole output matches
    it), ``choice`` (the output is one of these strings), ``grammar`` (an EBNF grammar whose
    start rule is ``root``, the GBNF dialect of llama.cpp and xgrammar) or ``json_object``
    (True: any JSON object). The engine turns it into a per-sequence matcher through the
    constraint compiler it was given (:mod:`minillm.engine.constraints`); what each kind
    accepts beyond these shape checks is the compiler's to say, at intake."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, regex, choice, "
                             f"grammar, json_object; got {given or 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = _json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or "
                                     f"its JSON text), got text that is not JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"structured_outputs.json must be a JSON schema object, got "
                                 f"{type(schema).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got "
                                 f"{value!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) and c
                                                       for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a list of non-empty "
                                 f"strings, got {self.choice!r}")
            if not self.choice:
                raise ValueError("structured_outputs.choice must hold at least one string")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object not in (True, False):
            raise ValueError(f"structured_outputs.json_object must be a bool, got "
                             f"{self.json_object!r}")

    @property
    def kind(self) -> str:
        """Which one is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    def schema_text(self) -> str:
        """The JSON schema as JSON text (keys in the given order: a schema's property order is
        the order the output writes them); only for kind "json"."""
        return self.json if isinstance(self.json, str) else _json.dumps(self.json)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token (vLLM's names).

    temperature 0 is greedy; top_k 0 (or -1) and top_p 1 switch those filters off. ``n`` asks
    for n independent samples of one prompt (they share the prompt's KV blocks); ``beam_width``
    > 1 switches to beam search (deterministic, ignores temperature/top_p/top_k) and returns the
    ``n`` best beams, so n <= beam_width. ``length_penalty`` divides a finished beam's summed
    log-probability by length ** length_penalty when beams are ranked (HF's convention).
    ``logprobs``: return each output token's log-probability and the top ``logprobs``
    alternatives; ``prompt_logprobs``: the same for every prompt token (the OpenAI API's
    ``logprobs`` and ``echo``); at most :data:`MAX_LOGPROBS` each.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    beam_width: int = 1
    length_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:    # torch's seed range
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.beam_width > 1 and self.n > self.beam_width:
            raise ValueError(f"n must be <= beam_width={self.beam_width} with beam search, "
                             f"got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be None or in [0, {MAX_LOGPROBS}], got {value}")
        if self.beam_width > 1 and (self.logprobs is not None or self.prompt_logprobs is not None):
            raise ValueError("logprobs and prompt_logprobs cannot be combined with beam search "
                             f"(beam_width={self.beam_width})")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {list(self.stop)!r}")
        so = self.structured_outputs
        if isinstance(so, dict):
            so = StructuredOutputsParams(**so)
            object.__setattr__(self, "structured_outputs", so)
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams (or a dict "
                             f"of its fields), got {type(so).__name__}")
        if so is not None and self.use_beam_search:
            raise ValueError(f"structured_outputs cannot be combined with beam search "
                             f"(beam_width={self.beam_width})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 1
