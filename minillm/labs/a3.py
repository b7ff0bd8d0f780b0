"""Checkers for the exercises of appendix C (inference runtimes).

- :func:`check_matmul_launches`: matmuls one decode step of a dense decoder launches, counted
  from its layers (separate or fused Q/K/V and gate/up projections, the LM head).
- :func:`check_padding_waste`: the fraction of computed rows that are padding when batches of
  the given sizes run in the smallest captured graph that holds them (sizes in any order),
  compared with :func:`minillm.runtime.padding_waste`.
- :func:`check_static_decode_step` (a build): one decode step over preallocated K/V buffers,
  run as a greedy loop on the model (on CUDA also captured in a CUDA graph and replayed); its
  tokens compared with :func:`minillm.generate.generate`'s, its buffers checked to keep their
  addresses and shapes and to hold each position's keys and values.
- :func:`check_parse_sse`: an OpenAI chat-completion stream (raw ``data:`` lines) folded into
  the final text and usage; cases include lines captured from ``python -m minillm serve``.
- :func:`check_parse_sse_on_server` (a build): the same parser reads the streams of our server
  (``minillm serve``'s app, started on the model), compared with what the ``openai`` client
  gets for the same requests; then the corner cases of :func:`check_parse_sse`.
- :func:`check_slo_attainment`: the share of one run's requests meeting both SLOs and those
  requests per second, compared with :func:`minillm.serving_metrics.slo_attainment`.
- :func:`check_poisson_arrivals`: seeded Poisson arrival times, checked by their statistics
  (mean gap 1/rate, exponential spread, first arrival at 0, seeded).
- :func:`check_token_mask_in_engine` (a build): the tokens an automaton allows next, first on
  small vocabularies, then as the engine's structured-outputs constraint: its date and choice
  outputs compared token for token with xgrammar's, each checked against its pattern.
"""
from __future__ import annotations

import json
import math
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from ..cache import KVCache
from ..checkpoint.loader import smollm2_tokenizer
from ..checkpoint.tokenizer import Tokenizer
from ..course.a3_structured import (
    DIGITS,
    Dfa,
    DfaCompiler,
    MaskFn,
    choice_dfa,
    sequence_dfa,
    token_texts,
    walk_mask,
)
from ..engine import EngineConfig, LLMEngine
from ..model.transformer import Transformer
from ..runtime import padding_waste
from ..serving_metrics import SLO, slo_attainment
from .common import Result, check
from .in_engine import assert_same_tokens, demo_model, generate_greedy

# --- matmul launches per decode step --------------------------------------------------------


def _matmul_launches(num_layers: int, fused_qkv: bool, fused_gate_up: bool) -> int:
    """The checker's reference: per layer the attention projections (Q, K, V, O, or QKV and
    O when fused) and the MLP's (gate, up, down, or gate_up and down), plus the LM head."""
    return num_layers * ((2 if fused_qkv else 4) + (2 if fused_gate_up else 3)) + 1


def check_matmul_launches(fn: Callable) -> Result:
    """``fn(num_layers, fused_qkv, fused_gate_up)`` -> matmul launches of one batch-1 decode
    step of a dense Llama-style decoder (embedding lookup and attention itself not counted)."""
    cases = [(n, q, g) for n in (1, 2, 30, 32) for q in (False, True) for g in (False, True)]

    def attempt() -> None:
        for n, q, g in cases:
            want, got = _matmul_launches(n, q, g), fn(n, q, g)
            assert got == want, (f"num_layers={n}, fused_qkv={q}, fused_gate_up={g}: expected "
                                 f"{want} matmuls, got {got}")

    return check("matmul_launches", attempt)


# --- CUDA graphs: padding to a captured size ------------------------------------------------


def check_padding_waste(fn: Callable) -> Result:
    """``fn(batch_sizes, sizes)`` -> the fraction of the rows the graphs compute that are
    padding (thrown away), over all the decode steps whose batch sizes are given; each batch
    runs in the smallest captured size (``sizes``, in any order) that holds it."""
    rng = random.Random(11)
    cases = [([1, 3, 5], [1, 2, 4, 8]), ([8, 8], [1, 2, 4, 8]), ([1], [1]), ([5, 6, 7], [8]),
             ([9, 17, 33], [1, 2, 4, 8, 16, 24, 32, 40]), ([3, 5], [8, 4, 2, 1])]
    for i in range(40):
        sizes = rng.sample(range(1, 49), rng.randint(1, 6))       # half of them unsorted
        sizes = sorted(sizes) if i % 2 else sizes
        cases.append(([rng.randint(1, max(sizes)) for _ in range(rng.randint(1, 12))], sizes))

    def attempt() -> None:
        for batches, sizes in cases:
            want, got = padding_waste(batches, sizes), fn(list(batches), list(sizes))
            assert isinstance(got, (int, float)) and math.isclose(got, want, abs_tol=1e-9), (
                f"batch_sizes={batches}, sizes={sizes}: expected {want:.4f}, got {got}")

    return check("padding_waste", attempt)


# --- a decode step over a static KV cache ---------------------------------------------------

#: ``fn(model, tokens, position, k_cache, v_cache)`` -> logits [B, vocab]: tokens [B] (long),
#: position a 0-d long tensor, k_cache / v_cache one [B, H_kv, max_len, hd] buffer per layer
StaticStep = Callable[[Transformer, torch.Tensor, torch.Tensor, list, list], torch.Tensor]


def static_inputs(model: Transformer, rows: int, max_len: int
                  ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The inputs of a decode step, allocated once on the model's device: tokens [rows] and a
    0-d position (long, zeros), and per layer a K and a V buffer [rows, H_kv, max_len, hd] of
    zeros in the model's dtype."""
    cfg, dev = model.cfg, model.device
    shape = (rows, cfg.n_kv_heads, max_len, cfg.head_dim)
    k, v = ([torch.zeros(shape, device=dev, dtype=model.dtype) for _ in range(cfg.n_layers)]
            for _ in range(2))
    return (torch.zeros(rows, dtype=torch.long, device=dev),
            torch.zeros((), dtype=torch.long, device=dev), k, v)


def greedy_static(step: Callable[[], torch.Tensor], tokens: torch.Tensor,
                  position: torch.Tensor, prompts: Sequence[Sequence[int]], new_tokens: int,
                  after_step: Callable[[int, torch.Tensor], None] | None = None
                  ) -> list[list[int]]:
    """Greedy decoding one token per row per step, all of it through ``step()`` (one decode
    step on the static inputs ``tokens`` [rows] and ``position`` [], written here in place
    before each call; it returns the logits [rows, vocab]): the prompts (all of one length)
    are fed a token at a time, then each row's argmax. ``after_step(t, logits)`` is called
    after step t. Returns the ``new_tokens`` new tokens of each row."""
    n = len(prompts[0])
    out: list[list[int]] = [[] for _ in prompts]
    col = [p[0] for p in prompts]
    for t in range(n + new_tokens - 1):
        tokens.copy_(torch.tensor(col))
        position.fill_(t)
        logits = step()
        if after_step is not None:
            after_step(t, logits)
        if t + 1 < n:
            col = [p[t + 1] for p in prompts]
        else:
            col = logits.argmax(-1).tolist()
            for row, token in zip(out, col):
                row.append(token)
    return out


def _buffers_kept(k_cache: list, v_cache: list, rows: int, vocab: int
                  ) -> Callable[[int, torch.Tensor], None]:
    """An ``after_step`` for :func:`greedy_static`: AssertionError once a buffer is no longer
    the tensor it was (another object, another address, another shape) or the logits are not
    [rows, vocab]."""
    kept = {name: [(b, b.data_ptr(), tuple(b.shape)) for b in bufs]
            for name, bufs in (("K", k_cache), ("V", v_cache))}

    def after_step(t: int, logits: torch.Tensor) -> None:
        for name, bufs in (("K", k_cache), ("V", v_cache)):
            assert len(bufs) == len(kept[name]), (
                f"step {t}: the {name} list has {len(bufs)} buffers, it had {len(kept[name])}")
            for layer, (buf, (orig, ptr, shape)) in enumerate(zip(bufs, kept[name])):
                assert buf is orig and buf.data_ptr() == ptr and tuple(buf.shape) == shape, (
                    f"step {t} (position {t}): layer {layer}'s {name} buffer was replaced (now "
                    f"shape {tuple(buf.shape)} at "
                    f"{'another' if buf.data_ptr() != ptr else 'the same'} address; it was "
                    f"{shape}): a captured graph keeps reading and writing "
                    f"the buffers it was recorded with, so the step must write into them in "
                    f"place")
        assert isinstance(logits, torch.Tensor) and tuple(logits.shape) == (rows, vocab), (
            f"step {t}: the logits must be [{rows}, {vocab}], got "
            f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits)}")

    return after_step


def _assert_slots(model: Transformer, fed: list[list[int]], k_cache: list, v_cache: list
                  ) -> None:
    """Each buffer's slots 0..L-1 hold the keys/values of the L tokens fed (as a prefill of
    them into a :class:`~minillm.cache.KVCache` computes them) and every later slot is zero."""
    ids = torch.tensor(fed, device=model.device)
    length = ids.shape[1]
    ref = KVCache(model.cfg, len(fed), length, model.device, model.dtype)
    model(ids, cache=ref)
    tol = {torch.float64: 1e-8, torch.float32: 1e-3}.get(model.dtype, 3e-2)
    for layer in range(model.cfg.n_layers):
        for name, buf, want in (("K", k_cache[layer], ref.k[layer]),
                                ("V", v_cache[layer], ref.v[layer])):
            err = (buf[:, :, :length] - want).abs().amax(dim=(0, 1, 3))       # per slot
            bad = (err > tol * (1 + want.abs().amax())).nonzero()
            assert not len(bad), (
                f"layer {layer}: slot {int(bad[0])} of the {name} buffer does not hold the "
                f"{name} of the token at position {int(bad[0])}")
            late = buf[:, :, length:].abs().amax(dim=(0, 1, 3)).nonzero()
            assert not len(late), (
                f"layer {layer}: the {name} buffer has values in slot {length + int(late[0])}, "
                f"past position {length - 1}, the last one fed")


def _replay_in_graph(fn: StaticStep, model: Transformer, prompts: list[list[int]],
                     new_tokens: int, max_len: int) -> tuple[list[list[int]], float]:
    """``fn`` captured as one CUDA graph on fresh static inputs (after a warm-up on a side
    stream, as :meth:`minillm.runtime.StaticDecoder._capture` does), then replayed for every
    step of :func:`greedy_static`: (new tokens per row, seconds of the replayed loop)."""
    tokens, position, k, v = static_inputs(model, len(prompts), max_len)
    tokens.copy_(torch.tensor([p[0] for p in prompts]))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(model, tokens, position, k, v)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            logits = fn(model, tokens, position, k, v)
    except Exception as e:  # noqa: BLE001 - why it cannot be captured is the verdict
        raise AssertionError(f"your step could not be captured in a CUDA graph ({type(e).__name__}"
                             f": {e}); a step that reads the position on the host or "
                             f"allocates a shape that depends on it cannot be") from None

    def replay() -> torch.Tensor:
        graph.replay()
        return logits

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = greedy_static(replay, tokens, position, prompts, new_tokens)
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def _equal_prompts(rows: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return torch.randint(5, 2000, (rows, length), generator=g).tolist()


def check_static_decode_step(fn: StaticStep, model: Transformer | None = None,
                             prompts: list[list[int]] | None = None, new_tokens: int = 10,
                             max_len: int | None = None) -> Result:
    """``fn(model, tokens, position, k_cache, v_cache)`` -> logits [B, vocab]: one decode step
    of ``model`` for B rows, one token each (``tokens`` [B], long) at the same ``position`` (a
    0-d long tensor), over the caller's buffers ``k_cache[i]``, ``v_cache[i]`` [B, H_kv,
    max_len, hd] of layer i, whose slot ``position`` it fills in place.

    Runs a greedy loop of it (:func:`greedy_static`: the ``prompts``, all of one length,
    default three seeded ones of 8 tokens, then ``new_tokens`` argmax tokens) on ``model``
    (default: the tiny preset, random weights, float64) with ``max_len`` slots (default 8 more
    than needed, so that the unwritten slots must be masked). Passes when every buffer is the
    same tensor at the same address and shape after every step, the tokens equal
    :func:`minillm.generate.generate`'s (prefill, then a growing KV cache) and the buffers
    hold the keys and values of the tokens fed, zeros after them. On CUDA the step is then
    captured in a ``torch.cuda.CUDAGraph`` and replayed for every step (the same tokens);
    on the CPU that part is skipped with a note. Prints the loops' seconds."""
    model = model or demo_model()
    prompts = [list(p) for p in prompts] if prompts is not None else _equal_prompts(3, 8)
    if not prompts or len({len(p) for p in prompts}) != 1:
        raise ValueError(f"prompts must be one or more of the same length (one position per "
                         f"step), got lengths {[len(p) for p in prompts]}")
    needed = len(prompts[0]) + new_tokens - 1
    max_len = max_len or needed + 8
    if not needed <= max_len <= model.cfg.max_seq_len:
        raise ValueError(f"max_len must be in [{needed}, {model.cfg.max_seq_len}], got {max_len}")
    rows, vocab = len(prompts), model.cfg.vocab_size

    def attempt() -> None:
        with torch.inference_mode():
            tokens, position, k, v = static_inputs(model, rows, max_len)
            t0 = time.perf_counter()
            mine = greedy_static(lambda: fn(model, tokens, position, k, v), tokens, position,
                                 prompts, new_tokens, _buffers_kept(k, v, rows, vocab))
            seconds = time.perf_counter() - t0
        ref = generate_greedy(model, prompts, [new_tokens] * rows)
        assert_same_tokens({"tokens": mine}, ref)
        with torch.inference_mode():
            _assert_slots(model, [p + o[:-1] for p, o in zip(prompts, mine)], k, v)
        print(f"your static step: {rows} rows x {needed} steps over {max_len} slots in "
              f"{seconds:.2f} s, the same tokens as minillm.generate ({ref['seconds']:.2f} s, "
              f"prefill + growing cache, one row at a time)")
        if model.device.type != "cuda":
            print("CUDA-graph capture and replay of your step: skipped (needs a CUDA device; "
                  f"the model is on {model.device})")
            return
        with torch.inference_mode():
            replayed, graph_s = _replay_in_graph(fn, model, prompts, new_tokens, max_len)
        assert_same_tokens({"tokens": replayed}, ref)
        print(f"your step captured in a CUDA graph and replayed: the same tokens, {graph_s:.2f} s "
              f"for the loop")

    return check("static_decode_step", attempt)


# --- a streamed chat completion -------------------------------------------------------------

#: ``data:`` lines of one streamed chat completion captured from ``python -m minillm serve``
#: (stream_options include_usage; the server's role chunk, content chunks, the finish chunk,
#: the usage-only chunk and [DONE], blank separator lines kept) for "Say hi.", max_tokens=6.
CAPTURED_CHAT_STREAM: tuple[str, ...] = (
    ('data: {"id": "chatcmpl-b5f12ed7f7a842da9ef39a137ca6d1d4", "object": "chat.comple'
     'tion.chunk", "created": 1796166145, "model": "smollm2-135m", "choices": [{"index'
     '": 0, "delta": {"role": "assistant", "content": "Hello"}, "logprobs": null, "fin'
     'ish_reason": null}], "usage": null}'),
    '',
    ('data: {"id": "chatcmpl-b5f12ed7f7a842da9ef39a137ca6d1d4", "object": "chat.comple'
     'tion.chunk", "created": 1796166145, "model": "smollm2-135m", "choices": [{"index'
     '": 0, "delta": {"content": " there"}, "logprobs": null, "finish_reason": null}],'
     ' "usage": null}'),
    '',
    ('data: {"id": "chatcmpl-b5f12ed7f7a842da9ef39a137ca6d1d4", "object": "chat.comple'
     'tion.chunk", "created": 1796166145, "model": "smollm2-135m", "choices": [{"index'
     '": 0, "delta": {"content": "!"}, "logprobs": null, "finish_reason": null}], "usa'
     'ge": null}'),
    '',
    ('data: {"id": "chatcmpl-b5f12ed7f7a842da9ef39a137ca6d1d4", "object": "chat.comple'
     'tion.chunk", "created": 1796166145, "model": "smollm2-135m", "choices": [{"index'
     '": 0, "delta": {"content": " I"}, "logprobs": null, "finish_reason": null}], "us'
     'age": null}'),
    '',
    ('data: {"id": "chatcmpl-b5f12ed7f7a842da9ef39a137ca6d1d4", "object": "chat.comple'
     'tion.chunk", "created": 1796166145, "model": "smollm2-135m", "choices": [{"index'
     '": 0, "delta": {"content": "\'m"}, "logprobs": null, "finish_reason": null}], "us'
     'age": null}'),
    '',
    ('data: {"id": "chatcmpl-b5f12ed7f7a842da9ef39a137ca6d1d4", "object": "chat.comple'
     'tion.chunk", "created": 1796166145, "model": "smollm2-135m", "choices": [{"index'
     '": 0, "delta": {"content": " here"}, "logprobs": null, "finish_reason": "length"'
     '}], "usage": null}'),
    '',
    ('data: {"id": "chatcmpl-b5f12ed7f7a842da9ef39a137ca6d1d4", "object": "chat.comple'
     'tion.chunk", "created": 1796166145, "model": "smollm2-135m", "choices": [], "usa'
     'ge": {"prompt_tokens": 33, "completion_tokens": 6, "total_tokens": 39}}'),
    '',
    'data: [DONE]',
    '',
)


def _chunk(content=None, role=None, finish=None, usage=None, choices=True, index=0,
           null_usage=False) -> str:
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    body = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0,
            "model": "m", "choices": ([{"index": index, "delta": delta, "finish_reason": finish}]
                                      if choices else [])}
    if usage is not None or null_usage:
        body["usage"] = usage
    return "data: " + json.dumps(body)


def _parse_sse(lines: Sequence[str]) -> tuple[str, dict | None]:
    """The checker's reference: the concatenated ``delta.content`` of choice 0 and the last
    ``usage`` seen; blank lines, comments, other fields and what follows ``[DONE]`` ignored."""
    text, usage = [], None
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        if not data:
            continue
        event = json.loads(data)
        for choice in event.get("choices") or []:
            if choice.get("index", 0) == 0:
                text.append((choice.get("delta") or {}).get("content") or "")
        if event.get("usage"):
            usage = event["usage"]
    return "".join(text), usage


def _sse_cases():
    u = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    cases = [
        [_chunk(role="assistant", content=""), _chunk("Hel"), _chunk("lo"),
         _chunk("", finish="stop"), "data: [DONE]"],
        [_chunk(role="assistant"), "", _chunk("a"), ": ping", _chunk(" b"), "",
         _chunk(finish="length"), _chunk(choices=False, usage=u), "data: [DONE]"],
        [_chunk("x"), "data: [DONE]", _chunk("after done")],
        [_chunk("data: [DONE] is text"), _chunk("!"), "data:[DONE]"],
        ["data: [DONE]"],
        [_chunk("é✓"), _chunk(" \n"), _chunk(choices=False, usage=u)],
        # n = 2: choice 1's text is not choice 0's
        [_chunk("A", role="assistant"), _chunk("x", index=1), _chunk("B"), _chunk("y", index=1),
         _chunk(finish="stop"), _chunk(finish="stop", index=1), "data: [DONE]"],
        # a chunk after the usage chunk with "usage": null keeps the usage
        [_chunk("hi"), _chunk(choices=False, usage=u), _chunk(finish="stop", null_usage=True),
         "data: [DONE]"],
    ]
    if CAPTURED_CHAT_STREAM:
        cases.insert(0, list(CAPTURED_CHAT_STREAM))
    return cases


def check_parse_sse(fn: Callable) -> Result:
    """``fn(lines)`` -> ``(text, usage)``: the assistant's text (every ``delta.content`` of
    choice 0, in order) and the ``usage`` dict of the stream (None if it has none), from the
    raw lines of a ``/v1/chat/completions`` stream. Lines not starting with ``data:`` are
    ignored; ``data: [DONE]`` ends the stream."""
    return check("parse_sse", lambda: _assert_sse_cases(fn))


def _assert_sse_cases(fn: Callable) -> None:
    for lines in _sse_cases():
        want, got = _parse_sse(lines), fn(list(lines))
        assert tuple(got) == want, (f"lines={[ln[:90] for ln in lines]}: expected "
                                    f"{want}, got {tuple(got)}")


# --- the parser on the live server ----------------------------------------------------------


@contextmanager
def serving(model: Transformer, tokenizer: Tokenizer) -> Iterator[str]:
    """Serve ``model`` with ``minillm serve``'s app (:func:`minillm.serve.create_app` over an
    :class:`~minillm.engine.LLMEngine`, served as ``model.cfg.name``) under uvicorn in a thread
    of this process, on a port of 127.0.0.1 the system picks (so never one already taken);
    yields the base URL, and stops the server (and its engine loop) on leaving. The model's
    linears are left as they are (``pack_linears=False``)."""
    import uvicorn

    from ..serve import create_app

    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64, pack_linears=False))
    server = uvicorn.Server(uvicorn.Config(create_app(engine, model.cfg.name), host="127.0.0.1",
                                           port=0, log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, name="minillm-labs-serve", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        if thread.is_alive():
            raise RuntimeError("the server did not stop within 30 s")


#: The two chat requests of :func:`check_parse_sse_on_server`: one greedy choice with usage,
#: and two choices sampled with a seed (so the same request gives the same texts again).
SERVER_REQUESTS = {
    "include_usage": {"messages": [{"role": "user", "content": "Say hi."}],
                      "temperature": 0.0, "stream_options": {"include_usage": True}},
    "n=2": {"messages": [{"role": "user", "content": "Invent a name for a cat."}], "n": 2,
            "temperature": 1.0, "seed": 7},
}


def _raw_stream(base: str, body: dict) -> list[str]:
    """The raw lines of one streamed ``/v1/chat/completions`` (blank separators kept)."""
    import httpx

    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as r:
        lines = list(r.iter_lines())
        assert r.status_code == 200, f"the server answered {r.status_code}: {lines[:3]}"
    return lines


def _brief(line: str) -> str:
    """A stream line without its envelope (id, object, created, model): its choices and
    usage."""
    if not line.startswith("data: {"):
        return line
    event = json.loads(line[len("data:"):])
    return "data: " + json.dumps({k: event[k] for k in ("choices", "usage") if k in event})


def _openai_answer(client, body: dict) -> tuple[str, dict | None]:
    """What the ``openai`` client gets for ``body``: choice 0's text, and the usage the
    stream carries (None without ``include_usage``); streamed when usage is asked for, else
    one whole response."""
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    if "stream_options" not in body:
        done = client.chat.completions.create(**body)
        return next(c.message.content for c in done.choices if c.index == 0), None
    text, usage = "", None
    for chunk in client.chat.completions.create(**body, stream=True):
        text += "".join(c.delta.content or "" for c in chunk.choices if c.index == 0)
        if chunk.usage is not None:
            usage = {k: getattr(chunk.usage, k) for k in counts}
    return text, usage


def check_parse_sse_on_server(fn: Callable, model: Transformer | None = None,
                              tokenizer: Tokenizer | None = None, max_tokens: int = 8) -> Result:
    """The parser of :func:`check_parse_sse` reads our server's streams: the server
    (:func:`serving`) runs ``model`` (default: the tiny preset, random weights, float64) with
    ``tokenizer`` (default: SmolLM2's), and each request of :data:`SERVER_REQUESTS` (at most
    ``max_tokens`` tokens) is streamed raw to ``fn`` and sent again through the ``openai``
    client. Passes when ``fn`` gives the client's text of choice 0 and usage for both, and then
    the corner cases of :func:`check_parse_sse`; the server is stopped either way."""
    model = model or demo_model()
    tokenizer = tokenizer or smollm2_tokenizer()

    def attempt() -> None:
        import openai

        fn(["data: [DONE]"])                   # a stub raises NotImplementedError here
        with serving(model, tokenizer) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0,
                                   timeout=120)
            for name, request in SERVER_REQUESTS.items():
                body = {**request, "model": model.cfg.name, "max_tokens": max_tokens}
                lines = _raw_stream(base, body)
                want, got = _openai_answer(client, body), fn(list(lines))
                events = [_brief(ln) for ln in lines if ln]
                assert tuple(got) == want, (
                    f"the {name} stream of {base}/v1/chat/completions ({len(events)} events, "
                    f"the last three {events[-3:]}): the openai client gets {want}, your "
                    f"parser {tuple(got)}")
                print(f"live {name} stream, {sum(map(bool, lines))} events: choice 0 "
                      f"{want[0]!r}, usage {want[1]}; your parser agrees")
        _assert_sse_cases(fn)

    return check("parse_sse_on_server", attempt)


# --- SLO attainment -------------------------------------------------------------


def check_slo_attainment(fn: Callable) -> Result:
    """``fn(ttft, tpot, slo, duration_s)`` -> ``(attainment, slo_met_per_s)``: the fraction of
    requests whose TTFT <= ``slo.ttft_s`` and TPOT <= ``slo.tpot_s`` (a
    :class:`~minillm.serving_metrics.SLO`), and how many such requests per second of the
    run. Compared with :func:`minillm.serving_metrics.slo_attainment` on seeded runs and on
    requests exactly at the limits."""
    rng = random.Random(7)
    slo = SLO(2.0, 0.2)
    cases = [([2.0, 1.0, 3.0], [0.2, 0.25, 0.1], slo, 10.0),
             ([0.5, 2.5], [0.1, 0.1], slo, 4.0), ([1.0], [0.0], slo, 1.0)]
    for _ in range(40):
        n = rng.randint(1, 30)
        s = SLO(rng.choice([0.5, 1.0, 2.0]), rng.choice([0.05, 0.1, 0.2]))
        cases.append(([rng.uniform(0, 3 * s.ttft_s) for _ in range(n)],
                      [rng.uniform(0, 2 * s.tpot_s) for _ in range(n)], s,
                      rng.uniform(5, 60)))

    def attempt() -> None:
        for ttft, tpot, s, dur in cases:
            want = slo_attainment(zip(ttft, tpot), s, len(ttft), dur)
            got = fn(list(ttft), list(tpot), s, dur)
            what = (f"ttft={[round(x, 3) for x in ttft[:6]]}..., "
                    f"tpot={[round(x, 3) for x in tpot[:6]]}..., {s}, duration_s={dur:.2f}")
            assert len(got) == 2 and all(math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-12)
                                         for g, w in zip(got, want)), (
                f"{what}: expected (attainment, slo_met_per_s) = {want}, got {tuple(got)}")

    return check("slo_attainment", attempt)


# --- Poisson arrivals -----------------------------------------------------------------------


def check_poisson_arrivals(fn: Callable) -> Result:
    """``fn(num_requests, rate, seed)`` -> arrival times (s) of a Poisson process of ``rate``
    requests/s: the first at 0, then exponential gaps of mean 1/``rate``; the same seed gives
    the same times. Checked by statistics over many arrivals: the mean gap, the coefficient of
    variation (1 for exponential gaps) and the fraction of gaps below the median ln 2 / rate."""
    def attempt() -> None:
        for rate in (0.5, 4.0):
            times = list(fn(20000, rate, 1))
            assert len(times) == 20000, f"rate={rate}: expected 20000 times, got {len(times)}"
            assert times[0] == 0, f"rate={rate}: the first request arrives at 0, got {times[0]}"
            gaps = [b - a for a, b in zip(times, times[1:])]
            assert min(gaps) >= 0, f"rate={rate}: arrival times must not decrease"
            mean = statistics.fmean(gaps)
            assert abs(mean * rate - 1) < 0.04, (
                f"rate={rate}: the mean gap should be 1/rate = {1 / rate:.3f} s, got "
                f"{mean:.3f} s")
            cv = statistics.pstdev(gaps) / mean
            assert abs(cv - 1) < 0.05, (
                f"rate={rate}: exponential gaps have std/mean = 1, got {cv:.3f} (uniform gaps "
                f"give about 0.58, constant gaps 0)")
            below = sum(g < math.log(2) / rate for g in gaps) / len(gaps)
            assert abs(below - 0.5) < 0.02, (
                f"rate={rate}: half the gaps should be below ln2/rate, got {below:.3f}")
        a, b, c = fn(50, 2.0, 5), fn(50, 2.0, 5), fn(50, 2.0, 6)
        assert list(a) == list(b), "the same seed must give the same arrival times"
        assert list(a) != list(c), "different seeds should give different arrival times"

    return check("poisson_arrivals", attempt)




# --- a token mask from an automaton, in the engine ------------------------------------------

#: The regex of the in-engine check and its automaton, built by hand (a date, ISO 8601).
DATE_REGEX = "[0-9]{4}-[0-9]{2}-[0-9]{2}"
DATE_PARTS = [(DIGITS, 4), ("-", 1), (DIGITS, 2), ("-", 1), (DIGITS, 2)]
CHOICES = ("yes", "no", "maybe")


def _mask_cases() -> Iterator[tuple[Dfa, int, list[str], int]]:
    """Small vocabularies where a plausible shortcut gives another mask: a token checked by its
    first character only, one that runs past the end of the pattern, an empty token, EOS
    before the pattern is complete or after it."""
    texts = ["1", "12", "1-", "-", "-0", "a", "", "2024-", "12345", "<eos>", "0-1", "9"]
    eos = texts.index("<eos>")
    date = sequence_dfa(DATE_PARTS)
    for state in (0, 2, 3, 4, 5, 7, 8, 9, 10):
        yield date, state, texts, eos
    words = ["y", "ye", "yes", "yess", "n", "no", "m", "maybe", "<eos>", "", "es", "nope"]
    choice = choice_dfa(CHOICES)
    for text in ("", "y", "ye", "yes", "no", "may"):
        yield choice, choice.walk(0, text), words, words.index("<eos>")


def check_token_mask_in_engine(fn: MaskFn, model: Transformer | None = None,
                               tokenizer: Tokenizer | None = None,
                               max_tokens: int = 14) -> Result:
    """``fn(dfa, state, texts, eos_id)`` -> [len(texts)] bool: the tokens allowed next in
    ``state`` of ``dfa`` (:class:`~minillm.course.a3_structured.Dfa`), first on small
    vocabularies against :func:`~minillm.course.a3_structured.walk_mask`, then as the
    engine's constraint: ``model`` (default: the tiny preset, random weights) and
    ``tokenizer`` (default: SmolLM2's) answer date-regex and choice requests
    (greedy, and n = 2 sampled with a seed) through :class:`DfaCompiler` over ``fn``, and
    through xgrammar's compiler of the same regex and choices. Passes when every mask is
    right, the two engines give the same tokens, every output matches its pattern and ends by
    the grammar (finish_reason "stop"), and every KV block is free afterwards."""
    def attempt() -> None:
        for dfa, state, texts, eos in _mask_cases():
            got, want = fn(dfa, state, list(texts), eos), walk_mask(dfa, state, texts, eos)
            assert isinstance(got, torch.Tensor) and got.dtype == torch.bool and \
                got.shape == want.shape, f"expected a bool tensor of shape {tuple(want.shape)}"
            bad = (got != want).nonzero().flatten().tolist()
            assert not bad, (f"state {state}: token {texts[bad[0]]!r} should be "
                             f"{'allowed' if want[bad[0]] else 'refused'}")
        _assert_masks_in_engine(fn, model or demo_model(), tokenizer or smollm2_tokenizer(),
                                max_tokens)

    return check("token_mask", attempt)


def _assert_masks_in_engine(fn: MaskFn, model: Transformer, tokenizer: Tokenizer,
                            max_tokens: int) -> None:
    import re

    from ..config import SamplingParams, StructuredOutputsParams
    from ..structured import XGrammarCompiler

    texts = token_texts(tokenizer)
    regex = StructuredOutputsParams(regex=DATE_REGEX)
    choice = StructuredOutputsParams(choice=CHOICES)
    requests = [(tokenizer.encode(p), SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                     structured_outputs=s))
                for p, s in (("Today's date is", regex), ("The meeting was on", regex),
                             ("Is the sky blue? Answer:", choice))]
    requests.append((tokenizer.encode("Pick a date:"), SamplingParams(
        temperature=1.0, seed=5, n=2, max_tokens=max_tokens, structured_outputs=regex)))
    outputs = {}
    for name in ("yours", "xgrammar"):
        engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64, pack_linears=False))
        free = engine.stats().blocks_free
        engine.use_constraint_compiler(
            DfaCompiler({DATE_REGEX: sequence_dfa(DATE_PARTS)}, texts,
                        tokenizer.eos_token_id, fn) if name == "yours" else
            XGrammarCompiler.for_engine(engine))
        ids = [engine.add_request(p, params) for p, params in requests]
        done = {}
        while engine.has_unfinished():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        outputs[name] = [done[i].outputs for i in ids]
        assert engine.stats().blocks_free == free, f"{name}: KV blocks still held at the end"
    for (prompt, params), mine, ref in zip(requests, outputs["yours"], outputs["xgrammar"]):
        spec = params.structured_outputs
        for m, r in zip(mine, ref):
            assert m.token_ids == r.token_ids, (
                f"{spec.kind} request {tokenizer.decode(prompt)!r}: your mask gave "
                f"{tokenizer.decode(m.token_ids)!r}, xgrammar's {tokenizer.decode(r.token_ids)!r}")
            text = tokenizer.decode([t for t in m.token_ids if t != tokenizer.eos_token_id])
            ok = re.fullmatch(DATE_REGEX, text) if spec.regex else text in CHOICES
            assert ok and m.finish_reason == "stop", (
                f"{spec.kind} request {tokenizer.decode(prompt)!r}: output {text!r} "
                f"(finish_reason {m.finish_reason}) does not complete its pattern")


__all__ = ["CAPTURED_CHAT_STREAM", "CHOICES", "DATE_REGEX", "SERVER_REQUESTS",
           "check_matmul_launches", "check_padding_waste", "check_parse_sse",
           "check_parse_sse_on_server", "check_poisson_arrivals", "check_slo_attainment",
           "check_static_decode_step", "check_token_mask_in_engine", "greedy_static", "serving",
           "static_inputs"]
