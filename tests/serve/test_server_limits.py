"""The server at its limits: a body of exactly ``max_body_bytes``, a client that reads one byte a
second, 200 clients leaving mid-stream at once.

The engine is small and cheap: SmolLM2's tokenizer on the "tiny" preset (random weights, a
512-token window), fp32, 8 seats and a queue behind them. The servers run uvicorn in a thread
of this process (``running`` of test_serve.py); the references are the engine's own state
(``has_unfinished``, ``stats().blocks_free``, ``num_steps``) and the Prometheus counters.
"""
from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

httpx = pytest.importorskip("httpx")

from test_serve import metric, running  # noqa: E402

from minillm.checkpoint.loader import random_model, smollm2_tokenizer  # noqa: E402
from minillm.config import get_preset  # noqa: E402
from minillm.engine import EngineConfig, LLMEngine  # noqa: E402
from minillm.serve import create_app  # noqa: E402

MODEL = "tiny"
SEATS = 8
BLOCKS = 288                 # 8 samples x a 512-token window (32 blocks each), and spare


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    model = random_model(get_preset("tiny"), seed=0).float().eval().requires_grad_(False)
    return LLMEngine(model, smollm2_tokenizer(), EngineConfig(num_kv_blocks=BLOCKS,
                                                              max_num_seqs=SEATS))


def idle(engine: LLMEngine, base: str, timeout: float = 30.0) -> None:
    """Until the engine holds no request and every KV block is free (fails after ``timeout``)."""
    deadline = time.time() + timeout
    while engine.has_unfinished() or engine.stats().blocks_free != BLOCKS \
            or metric(base, "minillm_server_queue_length"):
        assert time.time() < deadline, f"still busy: {engine.stats()}"
        time.sleep(0.05)


def padded(body: dict, size: int) -> bytes:
    """``body`` as JSON followed by spaces up to exactly ``size`` bytes (still valid JSON)."""
    raw = json.dumps(body).encode()
    assert len(raw) <= size
    return raw + b" " * (size - len(raw))


def test_a_body_of_exactly_max_body_bytes_is_read_one_more_is_413(engine):
    limit = 600
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    with running(create_app(engine, MODEL, max_body_bytes=limit)) as base:
        def post(content) -> httpx.Response:
            return httpx.post(f"{base}/v1/completions", content=content, timeout=30,
                              headers={"content-type": "application/json"})

        exact = post(padded(body, limit))
        assert exact.status_code == 200, exact.text
        assert exact.json()["usage"]["completion_tokens"] == 2
        over = post(padded(body, limit + 1))
        assert over.status_code == 413, over.text
        assert set(over.json()["error"]) == {"message", "type", "param", "code"}
        # without a Content-Length (chunked): the server counts what it reads
        chunked = post(iter([padded(body, limit + 1)[:300], padded(body, limit + 1)[300:]]))
        assert chunked.status_code == 413, chunked.text
        assert post(iter([padded(body, limit)])).status_code == 200
        idle(engine, base)


def test_a_client_reading_one_byte_a_second_does_not_hold_the_engine(engine):
    """Backpressure stops at the HTTP response, never at the engine (see api.py's docstring):
    while a client with a tiny receive window reads one byte a second, its request finishes
    generating into its job's queue (at most max_tokens outputs per sample), the engine keeps
    stepping and another request completes promptly. The slow response is still open when its
    engine request is done: the queue, not the engine, holds what the client has not read."""
    app = create_app(engine, MODEL)
    loop = app.state.server.loop
    with running(app) as base:
        host, port = base.removeprefix("http://").split(":")
        # 6 samples (2 seats left free) x 480 tokens x 21 logprobs: some 6 MB of events, more
        # than the kernel's socket buffers (tcp_wmem's 4 MiB at most) and uvicorn's 64 KiB hold
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                           "max_tokens": 480, "n": SEATS - 2, "logprobs": True, "top_logprobs": 20,
                           "ignore_eos": True, "stream": True}).encode()
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        slow.connect((host, int(port)))
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        try:
            got = b""
            while len(got) < len(b"HTTP/1.1 200"):      # the status line's start, then slowly
                got += slow.recv(1)
            steps = engine.num_steps
            start = time.time()
            other = httpx.post(f"{base}/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": "Hi", "max_tokens": 16, "ignore_eos": True})
            assert time.time() - start < 10, "the other request waited on the slow client"
            assert other.json()["usage"]["completion_tokens"] == 16
            deadline = time.time() + 60
            while engine.has_unfinished():       # the slow request generates to its end
                assert time.time() < deadline, "the engine stalled behind a slow client"
                got += slow.recv(1)
                time.sleep(1.0)
            assert engine.num_steps - steps >= 480
            assert engine.stats().blocks_free == BLOCKS
            assert loop.in_flight == 1, "the slow response should still be open"
            assert len(got) < 100 and got.startswith(b"HTTP/1.1 200")
        finally:
            slow.close()
        idle(engine, base)
        assert loop.in_flight == 0
        assert httpx.get(f"{base}/health").status_code == 200


def test_200_clients_leaving_mid_stream_at_once(engine):
    """200 streams (8 running, the rest queued) are all abandoned at the same moment: every
    engine request is aborted or finished, every KV block is free, the server stays healthy
    and answers the next request."""
    clients = 200
    with running(create_app(engine, MODEL, max_queue=256)) as base:
        before = {s: metric(base, "minillm_requests_total", f'{{status="{s}"}}')
                  for s in (200, 499)}

        async def crowd() -> int:
            leave = asyncio.Event()
            started = 0

            async def one(client: httpx.AsyncClient, i: int) -> None:
                nonlocal started
                body = {"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 300,
                        "ignore_eos": True, "stream": True}
                async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    started += 1
                    if started == clients:
                        leave.set()
                    await leave.wait()            # then close the stream mid-way

            limits = httpx.Limits(max_connections=clients + 10)
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                await asyncio.gather(*(one(client, i) for i in range(clients)))
            return started

        assert asyncio.run(crowd()) == clients
        idle(engine, base, timeout=60)
        assert httpx.get(f"{base}/health").json() == {"status": "ok"}
        deadline = time.time() + 10
        while True:             # each of the 200 was counted: finished (200) or left (499)
            after = {s: metric(base, "minillm_requests_total", f'{{status="{s}"}}') - before[s]
                     for s in (200, 499)}
            if sum(after.values()) == clients or time.time() > deadline:
                break
            time.sleep(0.05)
        assert sum(after.values()) == clients and after[499] > clients - SEATS * 2, after
        r = httpx.post(f"{base}/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "Hi", "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        idle(engine, base)
