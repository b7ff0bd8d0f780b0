"""The tokenizer routes of vLLM's server, which lm-evaluation-harness's remote tokenizer
(``--model local-completions --model_args tokenizer_backend=remote,...``) calls so that it
needs no tokenizer of its own:

    GET  /tokenizer_info  -> {"tokenizer_class", "bos_token", "eos_token", "pad_token",
                              "chat_template", "model_max_length", "vocab_size"}
    POST /tokenize        {"prompt": text} or {"messages": [...], "add_generation_prompt": true}
                          -> {"tokens": [ids], "count": n, "max_model_len": L,
                              "token_strs": [pieces] (with "return_token_strs": true) or null}
    POST /detokenize      {"tokens": [ids]} -> {"prompt": text}

SmolLM2's tokenizer adds no special tokens (no BOS), so ``add_special_tokens`` changes nothing
here; it is accepted because clients send it. Like ``/v1``, the routes need the API key when
the server has one. A bad body is a 400 naming the parameter (OpenAI's error body).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict

from .errors import APIError
from .protocol import ChatMessage
from .schema import DetokenizeResponse, Operation, TokenizeResponse, TokenizerInfo

if TYPE_CHECKING:
    from .api import Server


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: exactly one of ``prompt`` and ``messages``."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids to text."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def tokenizer_routes(server: Server) -> APIRouter:
    """``/tokenizer_info``, ``/tokenize`` and ``/detokenize`` for ``server``'s tokenizer."""
    router = APIRouter(dependencies=[Depends(server.check_key)])
    tok = server.engine.tokenizer
    window = server.engine.model.cfg.max_seq_len

    @router.get("/tokenizer_info", openapi_extra=server.doc.describe(Operation(
        "The tokenizer (vLLM's route)", TokenizerInfo)))
    async def tokenizer_info() -> dict[str, Any]:
        bos = tok.bos_token_id
        return {"tokenizer_class": "minillm.Tokenizer",
                "bos_token": tok.id_to_token(bos) if bos is not None else None,
                "eos_token": tok.id_to_token(tok.eos_token_id), "pad_token": None,
                "chat_template": tok.chat_template, "model_max_length": window,
                "vocab_size": tok.vocab_size}

    @router.post("/tokenize", openapi_extra=server.doc.describe(Operation(
        "Text or a conversation -> token ids", TokenizeResponse, TokenizeRequest,
        errors=(400, 404, 413))))
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await server.read(request, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of prompt and messages", "prompt")
        if body.prompt is not None:
            ids = tok.encode(body.prompt)
        else:
            ids = tok.apply_chat_template([{"role": m.role, "content": m.text()}
                                           for m in body.messages],
                                          body.add_generation_prompt, tokenize=True)
        strs = [tok.id_to_token(i) for i in ids] if body.return_token_strs else None
        return {"tokens": ids, "count": len(ids), "max_model_len": window, "token_strs": strs}

    @router.post("/detokenize", openapi_extra=server.doc.describe(Operation(
        "Token ids -> text", DetokenizeResponse, DetokenizeRequest,
        errors=(400, 404, 413))))
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await server.read(request, DetokenizeRequest)
        try:
            return {"prompt": tok.decode(body.tokens)}
        except ValueError as e:
            raise APIError(400, f"tokens: {e}", "tokens") from None

    return router
