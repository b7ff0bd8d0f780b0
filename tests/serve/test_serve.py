"""The OpenAI-compatible server, driven by the official ``openai`` client and by raw HTTP.

The servers run uvicorn in a thread of this process on 127.0.0.1 at a free port (one on a
subprocess, for SIGTERM). The reference is ``minillm.LLM`` itself: the same engine's offline
``generate``/``chat``, run before the server takes it over, and the uncached model forward for
logprobs. Sizes are small (max_tokens <= 32, 200 concurrent requests) so the file runs in about a
minute on 2 cores.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

import minillm  # noqa: E402
from minillm.engine import EngineConfig, LLMEngine  # noqa: E402
from minillm.runinfo import free_port  # noqa: E402
from minillm.serve import EngineLoop, EngineStopped, create_app  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"
PROMPTS = ["The capital of France is", "Hello, my name is", "1, 2, 3, 4,",
           "The best way to learn is"]
CHAT = [{"role": "user", "content": "Name a color."}]
NEW = 8                      # tokens per reference completion
KEY = "sesame"


@contextmanager
def running(app):
    """Serve ``app`` with uvicorn in a thread; yields its base URL; stops it after."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def llm():
    """The engine the main server serves: a KV pool (24 blocks of 16) smaller than the batch
    (32 sequences), so a crowd of requests queues for blocks."""
    return minillm.LLM(MODEL, dtype=torch.float32, num_kv_blocks=24, max_num_seqs=32)


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy outputs of the offline API for PROMPTS and CHAT (logprobs of the top token)."""
    params = minillm.SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=1)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    chat = llm.chat(CHAT, params, use_tqdm=False)[0]
    return {"text": {p: o.text for p, o in zip(PROMPTS, outs)},
            "ids": {p: o.token_ids for p, o in zip(PROMPTS, outs)}, "chat": chat}


@pytest.fixture(scope="module")
def base(llm, reference):
    with running(create_app(llm.engine, MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def strict(llm):
    """A second engine on the same weights: one sequence at a time, one waiting, an API key,
    bodies up to 1 MiB."""
    engine = LLMEngine(llm.model, llm.tokenizer, EngineConfig(num_kv_blocks=16, max_num_seqs=1))
    with running(create_app(engine, MODEL, api_key=KEY, max_queue=1,
                            max_body_bytes=1 << 20)) as url:
        yield url


def metric(base: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{base}/metrics").text
    m = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_idle(base: str, timeout: float = 20.0) -> None:
    """Until the engine holds no request and no KV block (fails after ``timeout`` s)."""
    deadline = time.time() + timeout
    while metric(base, "minillm_kv_blocks_used") or metric(base, "minillm_num_requests_running"):
        assert time.time() < deadline, "KV blocks still in use"
        time.sleep(0.05)


def post(base: str, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{base}{path}", content=content, timeout=60,
                      headers={"content-type": "application/json", **kw.pop("headers", {})},
                      **kw)


# ---------------------------------------------------------------------------- happy paths

def test_models_health_metrics(base, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    text = httpx.get(f"{base}/metrics").text
    for name in ("minillm_num_requests_waiting", "minillm_num_requests_running",
                 "minillm_kv_blocks_used", "minillm_kv_blocks_free",
                 "minillm_time_to_first_token_seconds_bucket",
                 "minillm_time_per_output_token_seconds_bucket"):
        assert name in text
    assert metric(base, "minillm_kv_blocks_free") == 24


def test_greedy_completions_equal_the_offline_engine(client, llm, reference):
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=NEW, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == \
        [reference["text"][p] for p in PROMPTS]
    assert r.usage.prompt_tokens == sum(len(llm.tokenizer.encode(p)) for p in PROMPTS)
    assert r.usage.completion_tokens == sum(len(reference["ids"][p]) for p in PROMPTS)
    ids = llm.tokenizer.encode(PROMPTS[0])
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=NEW, temperature=0)
    assert by_ids.choices[0].text == reference["text"][PROMPTS[0]]


def test_streamed_completion_joins_to_the_same_text(client, reference):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=NEW,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference["text"][PROMPTS[0]]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == NEW


def test_chat_streamed_and_not(client, reference):
    want = reference["chat"]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=NEW,
                                       temperature=0)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=NEW,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text(client, reference, stream):
    full = reference["text"][PROMPTS[0]]          # " Paris.\n\nThe answer is:"
    stop = full.split()[1][:3]                   # a stop string inside the reference
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=NEW,
                                  temperature=0, stop=[stop], stream=stream)
    choices = [c.choices[0] for c in r] if stream else r.choices
    assert "".join(c.text for c in choices) == full[:full.index(stop)]
    assert choices[-1].finish_reason == "stop"


def test_n_samples_and_seeds(client):
    one = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=1)

    def sample(seed: int):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, n=3,
                                      temperature=1.0, seed=seed, logprobs=2)
        assert sorted(c.index for c in r.choices) == [0, 1, 2]
        assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
        assert r.usage.prompt_tokens == one.usage.prompt_tokens     # the prompt once, not n x
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    first = sample(7)
    assert sample(7) == first
    assert len(set(first + sample(8))) > 1
    joined = [""] * 3          # streamed: every chunk's index names the same sample throughout
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, n=3,
                                           temperature=1.0, seed=7, logprobs=2, stream=True):
        for c in chunk.choices:
            joined[c.index] += c.text
    assert joined == first


def test_logprobs_match_the_uncached_model(client, llm, reference):
    """The greedy token is the top one and its logprob is the plain forward's log-softmax."""
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=NEW,
                                  temperature=0, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == r.usage.completion_tokens == NEW
    prompt = llm.tokenizer.encode(PROMPTS[0])
    ids = reference["ids"][PROMPTS[0]]
    with torch.no_grad():
        logits = llm.model(torch.tensor([prompt + ids[:-1]]))[0, len(prompt) - 1:]
    want = torch.log_softmax(logits.double(), -1)[torch.arange(len(ids)), ids]
    assert lp.token_logprobs == pytest.approx(want.tolist(), abs=2e-3)
    assert all(list(top.values()) == [t] for top, t in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == c.logprob
               for c in content)


def test_tokenizer_routes_agree_with_the_tokenizer(base, llm):
    """vLLM's /tokenizer_info, /tokenize and /detokenize (what lm-eval's remote tokenizer
    calls) give the engine's tokenizer's answers; bad bodies are 400s naming the parameter."""
    tok = llm.tokenizer
    info = httpx.get(f"{base}/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == tok.id_to_token(tok.eos_token_id)
    assert info["chat_template"] == tok.chat_template
    assert info["model_max_length"] == llm.model.cfg.max_seq_len
    r = post(base, "/tokenize", {"prompt": PROMPTS[0], "add_special_tokens": False}).json()
    assert r["tokens"] == tok.encode(PROMPTS[0]) and r["count"] == len(r["tokens"])
    chat = post(base, "/tokenize", {"model": MODEL, "messages": CHAT}).json()
    assert chat["tokens"] == tok.apply_chat_template(CHAT, add_generation_prompt=True,
                                                     tokenize=True)
    back = post(base, "/detokenize", {"tokens": r["tokens"]}).json()
    assert back == {"prompt": PROMPTS[0]}
    for path, body, param in [("/detokenize", {"tokens": [tok.vocab_size]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens"),
                              ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
                              ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "a", "colour": 1}, "colour")]:
        reply = post(base, path, body)
        assert reply.status_code == 400, (path, body, reply.text)
        assert reply.json()["error"]["param"] == param, reply.json()
    wrong = post(base, "/tokenize", {"model": "other", "prompt": "a"})
    assert wrong.status_code == 404


def test_echo_returns_the_prompt_and_its_logprobs(client, llm):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0,
                                  echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text.startswith(PROMPTS[0]) and len(c.text) > len(PROMPTS[0])
    assert len(c.logprobs.tokens) == len(llm.tokenizer.encode(PROMPTS[0])) + 2
    assert c.logprobs.token_logprobs[0] is None and None not in c.logprobs.token_logprobs[1:]


# ---------------------------------------------------------------------------- bad input

TOO_LONG = [1] * 9000   # over the 8192-token context window
BAD = [  # (path, body, status, param)
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 1000}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**7]}, 400, "prompt"),
    ("/v1/completions", {"prompt": TOO_LONG}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[5, 6], TOO_LONG]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["fine", [5, 6]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "nope"}, 404, "model"),
]


def test_bad_requests_get_openai_errors_naming_the_parameter(base, client):
    for path, body, status, param in BAD:
        r = post(base, path, {"model": MODEL, **body})
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and error["message"] and error["type"], (body, error)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", temperature=-2)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)
    assert post(base, "/v1/completions", b'{"model": "x", "prompt": ').json()["error"]["code"] \
        == "invalid_json"
    assert post(base, "/v1/completions", b"[1, 2]").status_code == 400
    assert httpx.get(f"{base}/v1/nothing").json()["error"]["type"]
    assert httpx.get(f"{base}/health").status_code == 200
    wait_idle(base)


# ---------------------------------------------------------------------------- load

def test_client_disconnect_mid_stream_frees_its_blocks(base, llm):
    """A client leaves a stream that asked for 340 tokens after a few: its engine request is
    aborted (it runs only a few steps past the disconnect, far from finishing on its own) and
    its blocks are freed."""
    before = metric(base, "minillm_requests_total", '{status="499"}')
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 340, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
        assert len(got) >= 3
        assert metric(base, "minillm_kv_blocks_used") > 0
        steps = llm.engine.num_steps
    wait_idle(base, timeout=60.0)
    assert llm.engine.num_steps - steps < 100, "the request ran on after its client left"
    assert metric(base, "minillm_kv_blocks_free") == 24
    deadline = time.time() + 10
    while metric(base, "minillm_requests_total", '{status="499"}') == before:
        assert time.time() < deadline, "the disconnect was not counted"
        time.sleep(0.05)


def test_200_concurrent_requests_all_answered(base, client, reference):
    """More requests than KV blocks (24) and than the batch (32): they queue, none fails."""
    def ask(i: int) -> tuple[str, str]:
        p = PROMPTS[i % len(PROMPTS)]
        if i % 8 == 7:
            chunks = client.completions.create(model=MODEL, prompt=p, max_tokens=NEW,
                                               temperature=0, stream=True)
            return p, "".join(c.choices[0].text for c in chunks)
        return p, client.completions.create(model=MODEL, prompt=p, max_tokens=NEW,
                                            temperature=0).choices[0].text

    with ThreadPoolExecutor(200) as pool:
        answers = list(pool.map(ask, range(200)))
    assert [text for _, text in answers] == [reference["text"][p] for p, _ in answers]
    wait_idle(base)


def test_queue_overflow_gets_503_then_the_server_still_serves(strict):
    auth = {"authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 16, "ignore_eos": True}
    with ThreadPoolExecutor(10) as pool:
        replies = list(pool.map(lambda _: post(strict, "/v1/completions", body, headers=auth),
                                range(10)))
    codes = sorted(r.status_code for r in replies)
    assert set(codes) == {200, 503}, codes
    busy = next(r for r in replies if r.status_code == 503).json()["error"]
    assert busy["code"] == "server_busy"
    assert httpx.get(f"{strict}/health").status_code == 200
    assert post(strict, "/v1/completions", body, headers=auth).status_code == 200
    assert post(strict, "/v1/completions", b"x" * (2 << 20), headers=auth).status_code == 413
    assert metric(strict, "minillm_requests_total", '{status="503"}') == codes.count(503)
    wait_idle(strict)


def test_api_key_is_required_when_set(strict):
    good = openai.OpenAI(base_url=f"{strict}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in good.models.list().data] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{strict}/v1", api_key="wrong", max_retries=0).completions.create(
            model=MODEL, prompt="x", max_tokens=1)
    r = post(strict, "/v1/completions", {"model": MODEL, "prompt": "x"})     # no key at all
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{strict}/health").status_code == 200


def test_stopping_the_loop_aborts_in_flight_requests(llm):
    """Shutdown's last step: what is still running is aborted, its blocks freed, its job told."""
    engine = LLMEngine(llm.model, llm.tokenizer, EngineConfig(num_kv_blocks=16, max_num_seqs=2))
    loop = EngineLoop(engine)
    params = minillm.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def go() -> None:
        loop.start()
        job = loop.submit([PROMPTS[0]], params)
        await job.accepted
        await job.next()
        await asyncio.to_thread(loop.stop)
        with pytest.raises(EngineStopped):
            while True:
                await job.next()
        with pytest.raises(EngineStopped):
            loop.submit([PROMPTS[0]], params)

    asyncio.run(go())
    assert not engine.has_unfinished() and engine.stats().blocks_used == 0


# ---------------------------------------------------------------------------- the command

def test_cli_serve_finishes_in_flight_streams_on_sigterm():
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--model", MODEL,
                             "--port", str(port), "--dtype", "float32", "--num-kv-blocks",
                             "16", "--max-num-seqs", "4", "--log-level", "warning"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 90
        while True:
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read().decode()
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 24, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        assert first and rest[-1] == "data: [DONE]"
        pieces = [json.loads(x[5:])["choices"][0] for x in [first] + rest[:-1]]
        assert pieces[-1]["finish_reason"] == "length"
        assert proc.wait(30) in (0, -signal.SIGTERM)    # uvicorn re-raises the signal
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_gives_the_engine_vllms_cpu_server_batch(monkeypatch):
    # `minillm serve` seats 128 requests unless told otherwise (vLLM's CPU server default);
    # an explicit max_num_seqs wins. The engine is replaced by one that records its options.
    import minillm.engine.llm as llm_module
    from minillm.serve import api

    class Loaded(Exception):
        pass

    seen: dict = {}

    def record(model, **options):
        seen.update(options)
        raise Loaded

    monkeypatch.setattr(llm_module, "LLM", record)
    for given, want in (({}, 128), ({"max_num_seqs": 4}, 4)):
        with pytest.raises(Loaded):
            api.serve(MODEL, **given)
        assert seen["max_num_seqs"] == want
