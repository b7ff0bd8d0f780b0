"""The OpenAI API's request bodies (pydantic) and how they become engine requests.

Only what the engine can honour is accepted: a known but unsupported parameter set to a
non-default value (``presence_penalty=0.5``, ``tools=[...]``) is a 400 naming it, not silently
ignored; unknown extra fields are ignored, as OpenAI's own server does with new client fields.
Bad values are checked by :class:`~minillm.config.SamplingParams` and the engine's ``validate``,
whose messages name the parameter; :func:`param_of` finds that name for the error body.

Structured outputs come three ways, at most one per request: OpenAI's ``response_format``
(``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"schema": ...}}``;
``"text"`` is no constraint), vLLM's ``structured_outputs`` (``{"json" | "regex" | "choice" |
"grammar" | "json_object": ...}``) and vLLM's older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``. Each becomes a
:class:`~minillm.config.StructuredOutputsParams`; the engine compiles it at intake.
"""
from __future__ import annotations

import re
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from ..config import SamplingParams, StructuredOutputsParams

DEFAULT_CHAT_MAX_TOKENS = 512     # the reply may end sooner (EOS) or at the context window
#: Parameters the engine does not implement -> the values that mean "off" (also None).
UNSUPPORTED: dict[str, tuple] = {
    "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},), "suffix": ("",),
    "best_of": (1,), "tools": ([],), "tool_choice": ("none", "auto"), "functions": ([],)}
#: vLLM's older request fields -> the StructuredOutputsParams field each stands for.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


class StreamOptions(BaseModel):
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` is implied: the
    output always follows the schema)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: type "text" (no constraint), "json_object" (any JSON
    object) or "json_schema" (``json_schema.schema``)."""

    type: str
    json_schema: JSONSchemaFormat | None = None

    def structured(self) -> StructuredOutputsParams | None:
        if self.type not in RESPONSE_FORMAT_TYPES:
            raise ValueError(f"response_format.type must be one of {list(RESPONSE_FORMAT_TYPES)}"
                             f", got {self.type!r}")
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        try:
            return StructuredOutputsParams(json=self.json_schema.schema_)
        except ValueError as e:
            raise ValueError(f"response_format.json_schema.schema: {e}") from None


class Common(BaseModel):
    """Fields both endpoints share (OpenAI's names and defaults)."""

    model_config = ConfigDict(extra="allow")

    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False           # vLLM's extension: generate max_tokens whatever comes
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None    # vLLM's extension (its field names)

    def unsupported(self) -> str | None:
        """The first unsupported parameter the client set to something other than a default."""
        extra = self.model_extra or {}
        return next((k for k, off in UNSUPPORTED.items()
                     if extra.get(k) is not None and extra[k] not in off), None)

    def sampling(self, max_tokens: int, logprobs: int | None,
                 prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's SamplingParams (ValueError naming a bad field)."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream=true")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, max_tokens=max_tokens, n=self.n,
            seed=self.seed, stop=stop, ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, structured_outputs=self.structured())

    def grammar_field(self) -> str | None:
        """The request field that carries its grammar (None: no grammar), for error bodies."""
        extra = self.model_extra or {}
        fields = [name for name in ("response_format", "structured_outputs")
                  if getattr(self, name) is not None] + [k for k in GUIDED if extra.get(k)]
        if fields == ["response_format"] and self.response_format.type == "text":
            return None
        return fields[0] if fields else None

    def structured(self) -> StructuredOutputsParams | None:
        """The request's grammar, from whichever of response_format, structured_outputs or
        the guided_* fields it set (ValueError naming the field if it set two, or a bad one)."""
        extra = self.model_extra or {}
        guided = {GUIDED[k]: extra[k] for k in GUIDED if extra.get(k) is not None}
        fmt = self.response_format.structured() if self.response_format is not None else None
        given = [name for name, v in (("response_format", fmt), ("structured_outputs",
                                      self.structured_outputs)) if v is not None]
        given += [k for k in GUIDED if extra.get(k) is not None]
        if len(given) > 1:
            raise ValueError(f"{given[0]} and {given[1]} cannot both be set: structured "
                             f"outputs take one grammar")
        if fmt is not None:
            return fmt
        fields = self.structured_outputs if self.structured_outputs is not None else guided
        if not fields:
            return None
        known = set(StructuredOutputsParams.__dataclass_fields__)
        unknown = sorted(k for k, v in fields.items() if k not in known and v is not None)
        if unknown:
            raise ValueError(f"structured_outputs.{unknown[0]} is not supported; give one of "
                             f"{sorted(known)}")
        return StructuredOutputsParams(**{k: v for k, v in fields.items() if k in known})

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(Common):
    """``POST /v1/completions``: one prompt (text or token ids) or a list of them."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        return list(p)

    def params(self) -> SamplingParams:
        return self.sampling(16 if self.max_tokens is None else self.max_tokens, self.logprobs,
                             self.logprobs if self.echo and self.logprobs is not None else None)


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(Common):
    """``POST /v1/chat/completions``: a conversation, rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def params(self) -> SamplingParams:
        limit = self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling(DEFAULT_CHAT_MAX_TOKENS if limit is None else limit, logprobs)


#: Engine and SamplingParams names -> the API's, for error bodies.
RENAMED = {"prompt_logprobs": "logprobs", "beam_width": "n"}


def param_of(message: str, names: list[str], prompt_name: str = "prompt") -> str | None:
    """The request parameter a ValueError message is about: the earliest of ``names`` (or an
    engine name in :data:`RENAMED`, or "prompt") it mentions as a word."""
    candidates = {n: n for n in names} | RENAMED | {"prompt": prompt_name}
    found = [(m.start(), candidates[name]) for name in candidates
             for m in [re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message)] if m]
    return min(found)[1] if found else None


def error_location(loc: tuple[Any, ...], kind: type[BaseModel]) -> str | None:
    """A pydantic error location as the dotted parameter name OpenAI reports
    (``messages.0.role``): field names and list indices, not the union member tried."""
    parts: list[str] = []
    for part in loc:
        if isinstance(part, int):
            parts.append(str(part))
            continue
        if kind is None or part not in kind.model_fields:
            if not parts:             # a field the body may not have: name it
                parts.append(str(part))
            break
        parts.append(part)
        kind = model_inside(kind.model_fields[part].annotation)
    return ".".join(parts) or None


def model_inside(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (``list[ChatMessage]`` -> ChatMessage), if one."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next(filter(None, map(model_inside, get_args(annotation))), None)
