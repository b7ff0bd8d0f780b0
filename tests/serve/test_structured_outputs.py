"""Structured outputs over HTTP, driven by the official ``openai`` client: OpenAI's
``response_format`` (json_schema, json_object), vLLM's ``structured_outputs`` body field and its
older ``guided_*`` aliases. References: ``jsonschema`` for JSON, ``re.fullmatch`` for regexes,
the choice list; streamed deltas, joined, must validate too. Bad grammars are 400s naming the
parameter, and no KV block is left behind; a speculative server refuses them clearly."""
from __future__ import annotations

import json
import re
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from test_serve import MODEL, post, running  # noqa: E402

from minillm.engine import EngineConfig, LLMEngine  # noqa: E402
from minillm.engine.speculation import speculator_for  # noqa: E402
from minillm.serve import create_app  # noqa: E402

pytestmark = pytest.mark.slow
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
         "required": ["color"]}
ASK = [{"role": "user", "content": "Describe a person in JSON."}]
CHOICES = ["yes", "no", "maybe so"]
REGEX = r"[0-9]{3}-[a-z]{2,4}"
NEW = 40


@pytest.fixture(scope="module")
def engine(real):
    model, tok = real
    return LLMEngine(model, tok, EngineConfig(num_kv_blocks=32, max_num_seqs=8))


@pytest.fixture(scope="module")
def base(engine):
    with running(create_app(engine, MODEL)) as url:      # create_app installs the compiler
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                   "strict": True}}


def wait_free(engine: LLMEngine, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while engine.blocks.num_free != engine.blocks.num_blocks:
        assert time.time() < deadline, "KV blocks still in use"
        time.sleep(0.05)


def test_create_app_installs_the_compiler(engine, base):
    assert engine.constraint_compiler is not None


@pytest.mark.parametrize("schema", [PERSON, COLOR], ids=["person", "color"])
def test_response_format_json_schema_validates(client, schema):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=NEW, n=2,
                                       temperature=1.0, seed=5,
                                       response_format=json_schema(schema))
    assert len(r.choices) == 2
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), schema)


def test_response_format_json_object_and_text(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=NEW,
                                       temperature=0, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8,
                                           temperature=0, response_format={"type": "text"})
    free = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8,
                                          temperature=0)
    assert plain.choices[0].message.content == free.choices[0].message.content


def test_the_stream_joined_validates(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=NEW,
                                            temperature=0, stream=True,
                                            response_format=json_schema(PERSON))
    parts, reasons = [], []
    for chunk in stream:
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert len([p for p in parts if p]) > 1 and "stop" in reasons
    jsonschema.validate(json.loads("".join(parts)), PERSON)


def test_structured_outputs_body_field(client):
    r = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=8,
                                  n=2, temperature=1.0, seed=1,
                                  extra_body={"structured_outputs": {"choice": CHOICES}})
    assert all(c.text in CHOICES for c in r.choices), [c.text for c in r.choices]
    r = client.completions.create(model=MODEL, prompt="A code:", max_tokens=12, temperature=0,
                                  extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, r.choices[0].text), r.choices[0].text
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=NEW,
                                       temperature=0,
                                       extra_body={"structured_outputs": {"json": COLOR}})
    jsonschema.validate(json.loads(r.choices[0].message.content), COLOR)
    stream = client.completions.create(model=MODEL, prompt="A code:", max_tokens=12,
                                       temperature=1.0, seed=3, stream=True,
                                       extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, "".join(c.choices[0].text for c in stream))


def test_the_guided_aliases(client):
    r = client.completions.create(model=MODEL, prompt="Pick one:", max_tokens=8, temperature=0,
                                  extra_body={"guided_choice": CHOICES})
    assert r.choices[0].text in CHOICES
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=NEW,
                                       temperature=0, extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = client.completions.create(model=MODEL, prompt="A code:", max_tokens=12, temperature=0,
                                  extra_body={"guided_regex": REGEX})
    assert re.fullmatch(REGEX, r.choices[0].text)


BAD = [  # (path, extra body, param)
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": "json"}, "response_format"),
    ("/v1/chat/completions", {"response_format": json_schema({"type": "strin"})},
     "response_format"),
    ("/v1/completions", {"guided_regex": "[a-"}, "guided_regex"),
    ("/v1/completions", {"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= foo"}},
     "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"choice": []}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"xml": "<a/>"}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ("/v1/completions", {"response_format": {"type": "json_object"},
                         "structured_outputs": {"regex": "a"}}, "response_format"),
]


@pytest.mark.parametrize("path, extra, param", BAD)
def test_bad_grammars_are_400s_naming_the_parameter(base, engine, path, extra, param):
    body = {"model": MODEL, "max_tokens": 4, **extra}
    body.update({"messages": ASK} if "chat" in path else {"prompt": "Hi"})
    reply = post(base, path, body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()
    wait_free(engine)
    ok = post(base, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200                             # the engine keeps serving
    wait_free(engine)


def test_a_speculative_server_refuses_structured_outputs(real):
    model, tok = real
    engine = LLMEngine(model, tok, EngineConfig(num_kv_blocks=16, max_num_seqs=4))
    engine.use_speculator(speculator_for({"method": "ngram", "num_speculative_tokens": 2},
                                         engine))
    with running(create_app(engine, MODEL)) as url:
        reply = post(url, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4,
                                              "structured_outputs": {"choice": CHOICES}})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "structured_outputs"
        assert "speculative decoding" in error["message"]
        assert post(url, "/v1/completions", {"model": MODEL, "prompt": "Hi",
                                             "max_tokens": 2}).status_code == 200
        wait_free(engine)
