"""What the server sends, as pydantic models, and its OpenAPI document (``GET /openapi.json``).

The handlers read their bodies themselves (:meth:`~.api.Server.read`), so FastAPI cannot see
them; every route instead declares an :class:`Operation` (request model, response models,
the error statuses it can answer) and :class:`APIDoc` writes the document from them at the first
``/openapi.json``:

- request bodies are the models of :mod:`.protocol` and :mod:`.tokenize`, generated from
  pydantic (a field added there is described at once; their ``$defs`` become components),
  then narrowed by what this server refuses whatever else the body says (:class:`Limits`:
  the served ``model`` name, ``n`` up to ``max_num_seqs``, token ids inside the vocabulary,
  ``temperature``, ``top_p``, ``max_tokens``, ``logprobs`` ranges); what JSON Schema cannot say
  (a prompt's token count against the context window, ``top_logprobs`` without ``logprobs``)
  is a 400 naming the parameter;
- 200 bodies are the models below, exactly as :mod:`.responses` writes them (extra keys are
  forbidden, so a drift between the two fails the schema tests); ``stream: true`` answers
  ``text/event-stream``, whose ``data:`` lines hold the ``*Chunk`` models and end with
  ``data: [DONE]``; ``/metrics`` is Prometheus text;
- every error is :class:`ErrorBody` (OpenAI's ``{"error": {message, type, param, code}}``).
  A 405 (a known path, another method) carries ``Allow`` and the same body; it belongs to the
  path, not to an operation, so the operations do not list it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from ..config import MAX_LOGPROBS

REF = "#/components/schemas/{model}"
OPERATION = "x-minillm-operation"    # the key of a route's Operation in its openapi_extra
ERROR_MEANINGS = {
    400: "A malformed body, or a parameter the server refuses (named in error.param)",
    401: "Missing or wrong API key (the server was started with one)",
    404: "The model named is not the one this server serves (error.param is 'model')",
    413: "The request body is over the server's max_body_bytes",
    503: "The server holds as many requests as it may, or its engine loop has stopped",
}


class Closed(BaseModel):
    """A response object: exactly these keys."""

    model_config = ConfigDict(extra="forbid")


# ---- errors ---------------------------------------------------------------------------------
class ErrorDetail(Closed):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(Closed):
    """OpenAI's error body; ``param`` names the request parameter at fault, when one is."""

    error: ErrorDetail


# ---- completions ----------------------------------------------------------------------------
FinishReason = Literal["stop", "length", "abort", "error"] | None


class Usage(Closed):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(Closed):
    """The legacy format; a token without a logprob (an echoed prompt's first) has None."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Closed):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class CompletionResponse(Closed):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(Closed):
    """One ``data:`` event of a streamed completion; ``usage`` only with include_usage (null
    until the last event, whose ``choices`` is empty)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---- chat -----------------------------------------------------------------------------------
class TopLogprob(Closed):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Closed):
    content: list[TokenLogprob]


class AssistantMessage(Closed):
    role: Literal["assistant"]
    content: str


class ChatChoice(Closed):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletionResponse(Closed):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(Closed):
    """The first delta of a choice carries the role."""

    role: Literal["assistant"] | None = None
    content: str


class ChatChunkChoice(Closed):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletionChunk(Closed):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ---- the other routes -----------------------------------------------------------------------
class ModelCard(Closed):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(Closed):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(Closed):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None


class DetokenizeResponse(Closed):
    prompt: str


class TokenizerInfo(Closed):
    tokenizer_class: str
    bos_token: str | None
    eos_token: str
    pad_token: str | None
    chat_template: str | None
    model_max_length: int
    vocab_size: int


class Health(Closed):
    status: Literal["ok"]


# ---- operations and the document ------------------------------------------------------------
@dataclass(frozen=True)
class Operation:
    """One route as the document describes it. ``chunk``: the model of a ``stream: true``
    event (then 200 may be ``text/event-stream``); ``text``: a plain-text 200 (its media type)
    instead of ``response``; ``errors``: the statuses besides 200, 401 added by
    :func:`render` when ``auth`` and the server has an API key."""

    summary: str
    response: type[BaseModel] | None = None
    request: type[BaseModel] | None = None
    chunk: type[BaseModel] | None = None
    text: str | None = None
    errors: tuple[int, ...] = ()
    auth: bool = True


@dataclass(frozen=True)
class Limits:
    """What the server refuses whatever the rest of the body says, as JSON Schema keywords
    for the request models' fields (:meth:`keywords`, applied by :func:`narrow`)."""

    model_name: str
    max_num_seqs: int
    vocab_size: int
    api_key: bool = False

    def keywords(self, model: type[BaseModel]) -> dict[str, dict[str, Any]]:
        """Field name -> keywords for its value, its union's branches and its arrays' items,
        for the request ``model`` (a generation request's or a tokenizer route's)."""
        token_id = {"minimum": 0, "maximum": self.vocab_size - 1}
        common = {"model": {"enum": [self.model_name]}, "tokens": token_id}
        if "max_tokens" not in model.model_fields:     # /tokenize and /detokenize
            return common
        return common | {
                "n": {"minimum": 1, "maximum": self.max_num_seqs},
                "temperature": {"minimum": 0},
                "top_p": {"exclusiveMinimum": 0, "maximum": 1},
                "logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
                "top_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
                "stop": {"minLength": 1},
                "prompt": {"minLength": 1, "minItems": 1, **token_id}}


#: The keywords each JSON type takes (a keyword given for another type is skipped).
TAKES = {"integer": {"minimum", "maximum", "exclusiveMinimum", "enum"},
         "number": {"minimum", "maximum", "exclusiveMinimum"},
         "string": {"minLength", "enum"}, "array": {"minItems"}}


def narrow(schema: dict[str, Any], keywords: dict[str, Any]) -> None:
    """Add ``keywords`` to a property schema in place: to each branch of an ``anyOf`` and to
    arrays' ``items`` (recursively), each keyword only where the type takes it (:data:`TAKES`;
    never to ``null``, a boolean or an object)."""
    for branch in schema.get("anyOf", []):
        narrow(branch, keywords)
    kind = schema.get("type")
    schema.update({k: v for k, v in keywords.items() if k in TAKES.get(kind, ())})
    if kind == "array":
        narrow(schema["items"], keywords)


def error_responses(statuses: tuple[int, ...]) -> dict[str, Any]:
    body = {"application/json": {"schema": {"$ref": REF.format(model="ErrorBody")}}}
    return {str(s): {"description": ERROR_MEANINGS[s], "content": body} for s in statuses}


def event_schema(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a ``stream: true`` answer (OpenAPI 3.1: the ``schema`` of an
    event stream describes each event): ``data`` is a ``chunk`` as JSON, or the final
    ``[DONE]``, or an :class:`ErrorBody` when the engine stopped mid-stream."""
    def json_of(model: type[BaseModel]) -> dict[str, Any]:
        return {"type": "string", "contentMediaType": "application/json",
                "contentSchema": {"$ref": ref(model)}}

    return {"type": "object", "required": ["data"],
            "description": f"with stream=true: events 'data: ' + a {chunk.__name__} as JSON, "
                           f"the last 'data: [DONE]'",
            "properties": {"data": {"anyOf": [json_of(chunk), {"const": "[DONE]"},
                                              json_of(ErrorBody)]}}}


def render(op: Operation, limits: Limits) -> dict[str, Any]:
    """The OpenAPI operation object of ``op``."""
    if op.text is not None:
        ok = {"description": "OK", "content": {op.text: {"schema": {"type": "string"}}}}
    else:
        ok = {"description": "OK",
              "content": {"application/json": {"schema": {"$ref": ref(op.response)}}}}
    if op.chunk is not None:
        ok["content"]["text/event-stream"] = {"schema": event_schema(op.chunk)}
    errors = op.errors + ((401,) if op.auth and limits.api_key else ())
    out: dict[str, Any] = {"summary": op.summary,
                           "responses": {"200": ok, **error_responses(tuple(sorted(errors)))}}
    if op.request is not None:
        out["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": {"$ref": ref(op.request)}}}}
    if op.auth and limits.api_key:
        out["security"] = [{"bearer": []}]
    return out


def ref(model: type[BaseModel] | None) -> str:
    assert model is not None
    return REF.format(model=model.__name__)


class APIDoc:
    """The OpenAPI document of one server: routes hand their :class:`Operation` to
    :meth:`describe` as they are declared (``openapi_extra=doc.describe(op)``);
    :meth:`document` then writes ``/openapi.json`` from FastAPI's list of paths."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.operations: list[Operation] = []

    def describe(self, op: Operation) -> dict[str, Any]:
        """``openapi_extra`` for the route declaring ``op``."""
        self.operations.append(op)
        return {OPERATION: render(op, self.limits)}

    def document(self, app: FastAPI) -> dict[str, Any]:
        """The OpenAPI 3.1 document of ``app`` (cached on it): each operation FastAPI lists
        replaced by its described one; routes described by nobody are left out."""
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                          description=f"minillm's OpenAI-compatible server for "
                                      f"{self.limits.model_name!r}")
        for path, item in list(doc["paths"].items()):
            for method, operation in list(item.items()):
                if OPERATION in operation:
                    item[method] = operation[OPERATION]
                else:
                    del item[method]
            if not item:
                del doc["paths"][path]
        doc["components"] = {"schemas": self.component_schemas()}
        if self.limits.api_key:
            doc["components"]["securitySchemes"] = {"bearer": {"type": "http",
                                                               "scheme": "bearer"}}
        app.openapi_schema = doc
        return doc

    def component_schemas(self) -> dict[str, Any]:
        """Every model the operations name, nested models hoisted; request models narrowed
        (:meth:`Limits.keywords`)."""
        ops = self.operations
        requests = {op.request for op in ops if op.request is not None}
        responses = {m for op in ops for m in (op.response, op.chunk) if m is not None}
        by_name = lambda m: m.__name__  # noqa: E731
        models = [(m, "validation") for m in sorted(requests, key=by_name)] + \
            [(m, "serialization") for m in sorted(responses | {ErrorBody}, key=by_name)]
        _, defs = models_json_schema(models, ref_template=REF)
        schemas = defs["$defs"]
        for model in requests:
            keywords = self.limits.keywords(model)
            for name, prop in schemas[model.__name__]["properties"].items():
                narrow(prop, keywords.get(name, {}))
        return schemas
