"""The OpenAI-compatible HTTP server: a FastAPI app around one :class:`~.loop.EngineLoop`.

    app = create_app(llm.engine, "smollm2-135m", api_key=None, max_queue=1024)
    uvicorn.run(app, host="127.0.0.1", port=8000)        # or: python -m minillm serve

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` sends
server-sent events, ``data: {chunk}`` lines and a final ``data: [DONE]``), ``GET /v1/models``,
``GET /tokenizer_info``, ``POST /tokenize``, ``POST /detokenize`` (vLLM's, :mod:`.tokenize`),
``GET /health`` (503 once the engine loop is gone), ``GET /metrics`` (Prometheus text).

``GET /openapi.json`` describes every route truthfully (:mod:`.schema`): request bodies, 200
bodies, the event stream, every error status.

Errors have OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad
parameter (named in ``param``) or a body that is not a JSON object (``code`` "invalid_json" or
"invalid_body"), 401 without the API key (when one is set; ``/v1`` and the tokenizer routes need
it), 404 for an unknown model or path, 405 (with ``Allow``) for a known path and another method,
413 for a body over ``max_body_bytes``, 503 when the server already holds ``max_num_seqs +
max_queue`` requests. A client that goes away (mid-stream or while waiting) has its request
aborted and its KV blocks freed. A client that reads slowly never holds the engine: backpressure
stops at the HTTP response. Its request goes on generating, each output waiting in its job's
queue (at most ``max_tokens`` per sample, so the buffer is bounded) until uvicorn can send it;
its KV blocks are freed when it finishes generating, not when the client has read it all. On
shutdown (uvicorn's SIGTERM handling: stop accepting, let in-flight responses finish within
``timeout_graceful_shutdown``) the lifespan hook aborts what is left and stops the loop.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import SamplingParams
from ..engine.constraints import constraint_compiler_for
from ..engine.engine import LLMEngine
from ..engine.outputs import RequestOutput
from .errors import APIError
from .loop import EngineLoop, EngineStopped, Job, QueueFull
from .metrics import CLIENT_CLOSED, CONTENT_TYPE, ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, error_location, param_of
from .responses import ChatRenderer, CompletionRenderer, Renderer
from .schema import (
    APIDoc,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    Health,
    Limits,
    ModelList,
    Operation,
)
from .tokenize import tokenizer_routes

MAX_BODY_BYTES = 16 << 20
DISCONNECT_POLL = 0.5     # seconds between checks that a waiting client is still there
Body = TypeVar("Body", bound=BaseModel)


class Server:
    """What the handlers share: the engine loop, the served name, the limits."""

    def __init__(self, engine: LLMEngine, model_name: str, api_key: str | None = None,
                 max_queue: int = 1024, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        if engine.tokenizer is None:
            raise ValueError("the server needs a model with a tokenizer")
        self.metrics = ServerMetrics()
        self.loop = EngineLoop(engine, self.metrics, max_queue)
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self.doc = APIDoc(Limits(model_name, engine.config.max_num_seqs,
                                 engine.model.cfg.vocab_size, api_key is not None))

    # ---- reading a request -----------------------------------------------------------------
    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")

    async def read_bytes(self, request: Request) -> bytes:
        """The raw body, read no further than ``max_body_bytes`` (413 past it, whether or not
        the client declared a Content-Length)."""
        limit = self.max_body_bytes
        too_big = APIError(413, f"request body over max_body_bytes={limit} bytes")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        raw = bytearray()
        async for piece in request.stream():
            raw += piece
            if len(raw) > limit:
                raise too_big
        return bytes(raw)

    async def read(self, request: Request, kind: type[Body]) -> Body:
        """The body as ``kind``, or the APIError that says what is wrong with it. JSON types
        are taken strictly, as the OpenAPI document states them ("5" is not an integer, 1 not a
        boolean)."""
        raw = await self.read_bytes(request)
        try:
            body = kind.model_validate_json(raw, strict=True)
        except ValidationError as e:
            first = e.errors()[0]
            if first["type"] == "json_invalid":
                what = "an empty body" if not raw.strip() else "malformed JSON"
                raise APIError(400, f"the request body must be a JSON object; got {what}: "
                                    f"{first['msg']}", code="invalid_json") from None
            param = error_location(first["loc"], kind)
            if param is None:          # the body as a whole: not an object
                raise APIError(400, f"the request body must be a JSON object: {first['msg']}",
                               code="invalid_body") from None
            raise APIError(400, f"{param}: {first['msg']}", param) from None
        model = body.model
        if model != self.model_name and (model is not None or kind.model_fields["model"]
                                          .is_required()):
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                                f"{self.model_name!r}", "model", "model_not_found")
        unsupported = getattr(body, "unsupported", None)
        if unsupported is not None and (name := unsupported()) is not None:
            raise APIError(400, f"{name} is not supported by this server", name)
        return body

    def invalid(self, e: ValueError, body: CompletionRequest | ChatCompletionRequest,
                prompt_name: str) -> APIError:
        """A 400 naming the parameter a ValueError is about (a long prompt: its own code; a
        grammar the engine refuses: the field the request gave it in)."""
        message = str(e)
        code = "context_length_exceeded" if "context window" in message else None
        param = param_of(message, list(type(body).model_fields), prompt_name)
        if param == "structured_outputs":
            param = body.grammar_field() or param
        return APIError(400, message, param, code)

    def params(self, body: CompletionRequest | ChatCompletionRequest,
               prompt_name: str) -> SamplingParams:
        limit = self.engine.config.max_num_seqs
        if not 1 <= body.n <= limit:
            raise APIError(400, f"n must be in [1, {limit}] (max_num_seqs), got {body.n}", "n")
        try:
            return body.params()
        except ValueError as e:
            raise self.invalid(e, body, prompt_name) from None

    # ---- answering -------------------------------------------------------------------------
    async def answer(self, request: Request, body: CompletionRequest | ChatCompletionRequest,
                     prompts: list[str | list[int]], renderer: Renderer,
                     prompt_name: str) -> Response:
        params = self.params(body, prompt_name)
        job = await self.submit(prompts, params, body, prompt_name)
        if body.stream:
            return StreamingResponse(self.stream(request, job, renderer),
                                     media_type="text/event-stream")
        try:
            async for i, out in watch(request, job):
                renderer.update(i, out)
        except EngineStopped as e:
            raise APIError(503, str(e)) from None
        finally:
            job.close()
        return JSONResponse(renderer.response())

    async def submit(self, prompts: list[str | list[int]], params: SamplingParams,
                     body: CompletionRequest | ChatCompletionRequest, prompt_name: str) -> Job:
        """Hand the prompts to the engine loop and wait for its verdict."""
        try:
            job = self.loop.submit(prompts, params)
        except (QueueFull, EngineStopped) as e:
            raise APIError(503, str(e), code="server_busy") from None
        try:
            await job.accepted
        except BaseException as e:
            job.close()
            if isinstance(e, ValueError):
                raise self.invalid(e, body, prompt_name) from None
            if isinstance(e, EngineStopped):
                raise APIError(503, str(e)) from None
            raise
        return job

    async def stream(self, request: Request, job: Job, renderer: Renderer
                     ) -> AsyncIterator[str]:
        """Server-sent events of one job; leaving early (a disconnect) aborts it. Should the
        engine stop first, the last event is an error body instead of ``[DONE]``."""
        stopped = False
        try:
            async for i, out in watch(request, job):
                for chunk in renderer.chunks(i, out):
                    yield sse(chunk)
            if job.finished:
                if renderer.include_usage:
                    yield sse(renderer.usage_chunk())
                yield "data: [DONE]\n\n"
        except EngineStopped as e:
            stopped = True
            yield sse(APIError(503, str(e)).response().body.decode())
        finally:
            if not (job.finished or stopped):
                request.state.client_gone = True
            job.close()


async def watch(request: Request, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The job's outputs until it finishes or the client goes away (then it just stops)."""
    while not job.finished:
        try:
            item = await asyncio.wait_for(job.next(), DISCONNECT_POLL)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                request.state.client_gone = True
                return
            continue
        yield item


def sse(chunk: dict[str, Any] | str) -> str:
    return f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk)}\n\n"


class RequestCounter:
    """ASGI middleware: count every ``/v1`` request by the status it got (499: client left)."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def send_and_note(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            gone = scope.get("state", {}).get("client_gone")
            self.metrics.count(CLIENT_CLOSED if gone else status["code"])


def create_app(engine: LLMEngine, model_name: str, *, api_key: str | None = None,
               max_queue: int = 1024, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app serving ``engine`` as ``model_name``; its lifespan starts and stops the
    engine loop (``app.state.server`` holds the :class:`Server`)."""
    server = Server(engine, model_name, api_key, max_queue, max_body_bytes)
    if engine.constraint_compiler is None and (compiler := constraint_compiler_for(engine)):
        engine.use_constraint_compiler(compiler)      # structured outputs (minillm.structured)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start()
        yield
        await asyncio.to_thread(server.loop.stop)

    app = FastAPI(title="minillm", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(RequestCounter, metrics=server.metrics)
    app.add_exception_handler(APIError, lambda request, e: e.response())
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, server_error)
    app.include_router(v1_routes(server))
    app.include_router(tokenizer_routes(server))
    app.openapi = lambda: server.doc.document(app)

    @app.get("/health", openapi_extra=server.doc.describe(Operation(
        "200 while the engine loop runs", Health, errors=(503,), auth=False)))
    async def health() -> Response:
        if not server.loop.alive:
            return APIError(503, f"the engine loop is not running: {server.loop.error!r}"
                            ).response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", openapi_extra=server.doc.describe(Operation(
        "Prometheus metrics (text exposition format)", text="text/plain", auth=False)))
    async def metrics() -> Response:
        return Response(server.metrics.render(server.loop.stats, server.loop.in_flight),
                        media_type=CONTENT_TYPE)

    return app


def http_error(request: Request, e: StarletteHTTPException) -> Response:
    """Starlette's own errors (404 unknown path, 405 with its ``Allow`` header) in OpenAI's
    body, their headers kept."""
    response = APIError(e.status_code, str(e.detail)).response()
    response.headers.update(e.headers or {})
    return response


def server_error(request: Request, e: Exception) -> Response:
    """A bug in the server: a 500 in OpenAI's body (the traceback goes to the log)."""
    return APIError(500, f"internal server error: {type(e).__name__}").response()


GENERATION_ERRORS = (400, 404, 413, 503)


def v1_routes(server: Server) -> APIRouter:
    """``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (behind the API key)."""
    router = APIRouter(prefix="/v1", dependencies=[Depends(server.check_key)])
    tok = server.engine.tokenizer

    @router.get("/models", openapi_extra=server.doc.describe(Operation("The served model",
                                                                       ModelList)))
    async def models() -> dict[str, Any]:
        card = {"id": server.model_name, "object": "model", "created": server.created,
                "owned_by": "minillm", "max_model_len": server.engine.model.cfg.max_seq_len}
        return {"object": "list", "data": [card]}

    @router.post("/completions", openapi_extra=server.doc.describe(Operation(
        "Complete a prompt (or a list of them)", CompletionResponse, CompletionRequest,
        CompletionChunk, errors=GENERATION_ERRORS)))
    async def completions(request: Request) -> Response:
        body = await server.read(request, CompletionRequest)
        try:
            prompts = body.prompts()
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from None
        renderer = CompletionRenderer(tok, server.model_name, prompts, body.n, body.logprobs,
                                      body.include_usage, echo=body.echo)
        return await server.answer(request, body, prompts, renderer, "prompt")

    @router.post("/chat/completions", openapi_extra=server.doc.describe(Operation(
        "Answer a conversation", ChatCompletionResponse, ChatCompletionRequest,
        ChatCompletionChunk, errors=GENERATION_ERRORS)))
    async def chat(request: Request) -> Response:
        body = await server.read(request, ChatCompletionRequest)
        try:
            prompts = [tok.apply_chat_template(body.conversation(), add_generation_prompt=True)]
        except ValueError as e:
            raise APIError(400, f"messages: {e}", "messages") from None
        top = (body.top_logprobs or 0) if body.logprobs else None
        renderer = ChatRenderer(tok, server.model_name, prompts, body.n, top,
                                body.include_usage)
        return await server.answer(request, body, prompts, renderer, "messages")

    return router


#: Seats in the server's running batch unless ``max_num_seqs`` is given: vLLM's OpenAI server
#: on a CPU defaults to 128 (``vllm/engine/arg_utils.py``, 0.32), twice the engine's offline 64.
#: Past a full batch requests wait for a seat, so under overload the smaller batch shows as a
#: long TTFT tail (``bench serve --rates 16``: TTFT p99 4.27 s with 64 seats, 1.54 s with 128;
#: serve_rate16.json and its version at commit 191dc0a).
SERVER_MAX_NUM_SEQS = 128


def serve(model: str = "smollm2-135m", host: str = "127.0.0.1", port: int = 8000, *,
          api_key: str | None = None, max_queue: int = 1024, shutdown_timeout: float = 30.0,
          device: str | None = None, dtype: str | None = None, log_level: str = "info",
          served_model_name: str | None = None, quantization: str | None = None,
          **engine_options) -> None:
    """Load ``model`` into a :class:`minillm.LLM` (its weights quantized by ``quantization``,
    e.g. "int4", when given) and serve it until SIGINT/SIGTERM; in-flight responses get
    ``shutdown_timeout`` seconds to finish, then they are aborted. ``engine_options`` go to the
    engine (``max_num_seqs``: :data:`SERVER_MAX_NUM_SEQS`)."""
    import uvicorn

    from ..engine.llm import LLM

    engine_options.setdefault("max_num_seqs", SERVER_MAX_NUM_SEQS)
    llm = LLM(model, device=device, dtype=dtype, quantization=quantization, **engine_options)
    warm = llm.engine.warmup()              # the first request would pay for it otherwise
    app = create_app(llm.engine, served_model_name or model, api_key=api_key,
                     max_queue=max_queue)
    weights = f", {quantization} weights" if quantization else ""
    print(f"minillm serve: {model} ({llm.dtype}{weights}, "
          f"{llm.engine.blocks.num_blocks} KV blocks, "
          f"warmed up in {warm:.1f} s) on http://{host}:{port}/v1", flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=shutdown_timeout)
