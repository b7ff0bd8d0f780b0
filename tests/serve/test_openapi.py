"""The server's ``/openapi.json`` is true: schemathesis fuzzes every operation against it.

A real server (uvicorn on 127.0.0.1, an API key set) serves a small engine: SmolLM2's tokenizer
on the "tiny" preset with random weights and a 64-token context window, so that any request the
fuzzer makes (``max_tokens`` up to 10**9 included: generation stops at the window) costs a few
milliseconds. schemathesis (the reference: an independent OpenAPI fuzzer) runs its examples,
coverage and fuzzing phases, positive and negative bodies, with every one of its checks on,
plus ours: every 4xx body is OpenAI's error body and names the parameter at fault. Afterwards
the server is healthy and every KV block is free again.

CI draws a fixed number of examples per operation with a fixed seed; ``MINILLM_HYPOTHESIS=soak``
draws ``MINILLM_SOAK_FACTOR`` times more with random seeds.
"""
from __future__ import annotations

import json
import os
import time
from collections import Counter

import pytest

schemathesis = pytest.importorskip("schemathesis")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from properties import examples  # noqa: E402
from schemathesis.core.failures import FailureGroup  # noqa: E402
from schemathesis.pytest.lazy import get_all_tests  # noqa: E402
from test_serve import metric, running  # noqa: E402

from minillm.checkpoint.loader import random_model, smollm2_tokenizer  # noqa: E402
from minillm.config import get_preset  # noqa: E402
from minillm.engine import EngineConfig, LLMEngine  # noqa: E402
from minillm.serve import create_app, schema  # noqa: E402

MODEL = "tiny-64"
KEY = "sesame"
WINDOW = 64                  # tokens of context: the longest any request can run
BLOCKS = 16                  # a full window for each of max_num_seqs=4 samples: never short
BODY_CODES = ("invalid_json", "invalid_body")    # a 400 about the whole body: no param
SOAK = os.environ.get("MINILLM_HYPOTHESIS") == "soak"


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    model = random_model(get_preset("tiny").with_(max_seq_len=WINDOW), seed=0)
    model = model.float().eval().requires_grad_(False)
    return LLMEngine(model, smollm2_tokenizer(), EngineConfig(num_kv_blocks=BLOCKS,
                                                              max_num_seqs=4))


@pytest.fixture(scope="module")
def base(engine):
    with running(create_app(engine, MODEL, api_key=KEY, max_queue=8,
                            max_body_bytes=1 << 16)) as url:
        yield url


@pytest.fixture(scope="module")
def api(base):
    config = schemathesis.Config.from_dict({
        **({} if SOAK else {"seed": 20240607}),      # soak: a random seed, printed on failure
        "headers": {"Authorization": f"Bearer {KEY}"},
        "generation": {"mode": "all", "max-examples": examples(20), "deterministic": not SOAK},
        "checks": {
            "enabled": True,
            # A schema-valid body may still be refused with a 400 naming the parameter, for
            # what JSON Schema cannot state: a prompt's token count against the context
            # window, top_logprobs without logprobs, stream_options without stream, tokenize's
            # "exactly one of prompt and messages". Our check below holds those 400s to
            # OpenAI's shape with `param` set; anything else (404, 413, 5xx) still fails.
            "positive_data_acceptance": {"expected-statuses": ["2xx", "400"]},
        },
    })
    return schemathesis.openapi.from_url(f"{base}/openapi.json", config=config)


def openai_error_body(ctx, response, case) -> bool | None:
    """Every 4xx answers OpenAI's ``{"error": {message, type, param, code}}``; a 400 about the
    body's content (not its JSON syntax) names the parameter."""
    if not 400 <= response.status_code < 500:
        return None
    error = json.loads(response.content)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["message"] and error["type"], error
    if response.status_code == 400 and error["code"] not in BODY_CODES:
        assert error["param"], f"a 400 that names no parameter: {error}"
    if response.status_code == 404 and case.method.upper() == "POST":
        assert error["param"] == "model", error
    return True


def test_every_operation_conforms(api, base):
    """schemathesis's examples, coverage and fuzzing phases for every operation, each a
    hypothesis test built the way its pytest plugin builds them (``get_all_tests``; the plugin's
    lazy-fixture entry point itself breaks on pytest 9's nodes). Every failure is reported, not
    only the first."""
    seen: dict[str, Counter] = {}

    def check(case) -> None:
        response = case.call_and_validate(base_url=base, additional_checks=[openai_error_body])
        seen.setdefault(case.operation.label, Counter())[
            (case.method.upper(), response.status_code)] += 1

    failures, ran = [], []
    for result in get_all_tests(schema=api, test_func=check, settings=None, given_kwargs=None):
        operation, test = result.ok()       # Err: the document itself is invalid
        ran.append(operation.label)
        try:
            test()
        except (AssertionError, FailureGroup) as e:
            failures.append(f"{operation.label}: {e}")
    assert len(ran) == 8, ran
    assert not failures, "\n\n".join(failures)
    for label, answers in seen.items():    # the fuzzer reached past the front door
        statuses = {status for _, status in answers}
        assert {200, 405} <= statuses, (label, answers)
        if label.startswith("POST"):
            assert {400, 401, 404} <= statuses, (label, answers)


def test_the_server_is_healthy_and_every_block_free_after_fuzzing(base, engine):
    """Runs after the fuzzing above (same module, same server)."""
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    r = httpx.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    wait_free(base)
    assert engine.stats().blocks_free == BLOCKS


def wait_free(base: str, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while metric(base, "minillm_kv_blocks_used") or metric(base, "minillm_num_requests_running"):
        assert time.time() < deadline, "KV blocks still in use"
        time.sleep(0.05)


def test_streamed_events_match_the_chunk_schemas(base):
    """``text/event-stream`` is documented as ``data:`` lines of the ``*Chunk`` components;
    each line of a real stream validates against them (jsonschema as the reference)."""
    doc = httpx.get(f"{base}/openapi.json").json()
    assert {schema.CompletionChunk.__name__, schema.ChatCompletionChunk.__name__} <= \
        set(doc["components"]["schemas"])
    auth = {"Authorization": f"Bearer {KEY}"}
    for path, body, chunk in [
            ("/v1/completions", {"prompt": "Hi", "logprobs": 2, "n": 2}, "CompletionChunk"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                      "logprobs": True, "top_logprobs": 2}, "ChatCompletionChunk")]:
        schema_ = {"$ref": f"#/components/schemas/{chunk}", **doc}
        body = {"model": MODEL, "max_tokens": 4, "stream": True,
                "stream_options": {"include_usage": True}, **body}
        with httpx.stream("POST", f"{base}{path}", json=body, headers=auth, timeout=30) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]" and len(lines) > 2
        for line in lines[:-1]:
            jsonschema.validate(json.loads(line), schema_)
        with pytest.raises(jsonschema.ValidationError):      # the schema can fail
            jsonschema.validate({**json.loads(lines[0]), "extra": 1}, schema_)
