"""Structured outputs through the engine (fp32 SmolLM2): every output of several JSON schemas
validates with ``jsonschema`` (greedy, and sampled with n = 2), a choice is one of the choices,
a regex output ``re.fullmatch``-es; a free request batched with constrained ones gets the tokens
it gets alone; preemption by recompute, chunked prefill and prefix caching keep the grammar;
a student's hand-written matcher works through the same seam; bad requests are refused at
intake and leak no KV block."""
from __future__ import annotations

import json
import re

import pytest
import torch

from minillm.config import SamplingParams, StructuredOutputsParams
from minillm.engine import EngineConfig, LLMEngine
from minillm.engine.output_processor import OutputProcessor
from minillm.engine.sampler import sample_rows
from minillm.engine.speculation import speculator_for
from minillm.structured import XGrammarCompiler

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytestmark = pytest.mark.slow

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
     "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "score": {"type": "number", "minimum": 0, "maximum": 10}},
     "required": ["ok", "score"]},
    {"type": "object", "properties": {"tags": {"type": "array", "maxItems": 2,
                                               "items": {"type": "string", "maxLength": 8}}},
     "required": ["tags"]},
    {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
]
QUESTION = "Describe a cat in JSON."
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe so"]
NEW = 48


@pytest.fixture(scope="module")
def compiler(real):
    model, tok = real
    return XGrammarCompiler(tok, model.cfg.vocab_size)


def make(real, compiler, **options) -> tuple[LLMEngine, OutputProcessor]:
    model, tok = real
    engine = LLMEngine(model, tok, EngineConfig(**options))
    if compiler is not None:
        engine.use_constraint_compiler(compiler)
    return engine, OutputProcessor(engine)


@pytest.fixture(scope="module")
def llm(real, compiler):
    return make(real, compiler, max_num_seqs=32)


@pytest.fixture(scope="module")
def prompts(real):
    tok = real[1]
    return [tok.apply_chat_template([{"role": "user", "content": QUESTION}]), "Data:"]


def so(**fields) -> StructuredOutputsParams:
    return StructuredOutputsParams(**fields)


def texts(outs) -> list[str]:
    return [c.text for o in outs for c in o.outputs]


def test_every_output_of_every_schema_validates(llm, prompts):
    _, proc = llm
    jobs, params = [], []
    for schema in SCHEMAS:
        for p in prompts:
            jobs += [p, p]
            params += [SamplingParams(temperature=0.0, max_tokens=NEW,
                                      structured_outputs=so(json=schema)),
                       SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=NEW,
                                      structured_outputs=so(json=json.dumps(schema)))]
    outs = proc.generate(jobs, params)
    checked = 0
    for out, sp in zip(outs, params):
        assert len(out.outputs) == sp.n
        schema = sp.structured_outputs.json
        schema = json.loads(schema) if isinstance(schema, str) else schema
        for c in out.outputs:
            assert c.finish_reason == "stop", (c.text, c.finish_reason)
            jsonschema.validate(json.loads(c.text), schema)
            checked += 1
    assert checked == len(SCHEMAS) * len(prompts) * 3


def test_without_the_mask_the_same_requests_do_not_validate(llm, prompts):
    """The check above can fail: unconstrained, the model writes prose, not the schema."""
    _, proc = llm
    outs = proc.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))

    def valid(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[0])
            return True
        except (ValueError, jsonschema.ValidationError):
            return False

    assert not any(valid(t) for t in texts(outs))


def test_choice_and_regex(llm, prompts):
    _, proc = llm
    params = [SamplingParams(temperature=t, n=2, seed=1, max_tokens=16,
                             structured_outputs=so(choice=CHOICES)) for t in (0.0, 1.0)]
    for out in proc.generate(prompts * 2, params * 2):
        assert all(c.text in CHOICES and c.finish_reason == "stop" for c in out.outputs)
    params = [SamplingParams(temperature=t, n=2, seed=2, max_tokens=16,
                             structured_outputs=so(regex=REGEX)) for t in (0.0, 1.0)]
    for out in proc.generate(prompts * 2, params * 2):
        for c in out.outputs:
            assert re.fullmatch(REGEX, c.text) and c.finish_reason == "stop", c.text


def test_a_grammar_and_json_object(llm, prompts):
    _, proc = llm
    grammar = 'root ::= "The answer is " digit digit? "."\ndigit ::= [0-9]'
    outs = proc.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16,
                                                 structured_outputs=so(grammar=grammar)))
    assert all(re.fullmatch(r"The answer is [0-9]{1,2}\.", t) for t in texts(outs))
    outs = proc.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW,
                                                 structured_outputs=so(json_object=True)))
    for o in outs:
        if o.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
        else:                  # json_object bounds nothing: the text may be cut at max_tokens
            assert o.text.startswith("{")


def test_a_free_request_batched_with_constrained_ones_gets_its_own_tokens(llm, prompts):
    engine, proc = llm
    free = SamplingParams(temperature=0.0, max_tokens=12)
    alone = proc.generate(prompts[0], free)[0]
    steps = []
    engine.step_hooks.append(lambda e, rec: steps.append(len(rec.request_ids)))
    try:
        mixed = proc.generate(prompts * 2, [free, SamplingParams(
            temperature=0.0, max_tokens=NEW, structured_outputs=so(json=SCHEMAS[0]))] * 2)
    finally:
        engine.step_hooks.pop()
    assert max(steps) == 4                 # constrained and free rows shared steps
    assert mixed[0].token_ids == alone.token_ids
    assert mixed[2].token_ids == alone.token_ids
    jsonschema.validate(json.loads(mixed[1].text), SCHEMAS[0])


@pytest.mark.parametrize("options", [
    dict(num_kv_blocks=6, block_size=16, max_num_seqs=4, preemption="recompute"),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4,
         enable_prefix_caching=True),
], ids=["preempted-recompute", "chunked-prefix-cached"])
def test_the_grammar_survives_preemption_chunking_and_prefix_hits(real, compiler, llm, prompts,
                                                                  options):
    _, reference = llm
    params = [SamplingParams(temperature=0.0, max_tokens=NEW, structured_outputs=so(json=s))
              for s in SCHEMAS[:4]]
    jobs = [prompts[0]] * 4
    want = texts(reference.generate(jobs, params))
    engine, proc = make(real, compiler, **options)
    free = engine.blocks.num_free
    got = texts(proc.generate(jobs, params))
    assert got == want
    if "preemption" in options:
        assert any(r.preempted for r in engine.trace), "the test did not preempt"
    if options.get("enable_prefix_caching"):
        got = texts(proc.generate(jobs, params))      # now the prompt's blocks are cached
        assert got == want
    assert engine.blocks.num_free == free


class DigitsThenEnd:
    """A student's matcher, by hand: exactly ``count`` tokens that are single digits, then EOS."""

    def __init__(self, digits: list[int], eos: int, count: int, seen: int = 0) -> None:
        self.digits, self.eos, self.count, self.seen = digits, eos, count, seen
        self.ended = False

    def allowed(self, vocab_size: int) -> torch.Tensor:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.digits if self.seen < self.count else [self.eos]] = True
        return mask

    def accept(self, token_id: int) -> None:
        if token_id not in (self.digits if self.seen < self.count else [self.eos]):
            raise ValueError(f"token {token_id} not allowed")
        self.seen += 1
        self.ended = token_id == self.eos

    def is_terminated(self) -> bool:
        return self.ended

    def fork(self) -> DigitsThenEnd:
        return DigitsThenEnd(self.digits, self.eos, self.count, self.seen)


class DigitsCompiler:
    def __init__(self, tok) -> None:
        self.digits = [tok.encode(str(d))[0] for d in range(10)]
        self.eos = tok.eos_token_id

    def compile(self, spec: StructuredOutputsParams) -> DigitsThenEnd:
        if spec.regex is None or not re.fullmatch(r"\[0-9\]\{\d+\}", spec.regex):
            raise ValueError("structured_outputs.regex: this compiler knows only [0-9]{n}")
        return DigitsThenEnd(self.digits, self.eos, int(spec.regex[6:-1]))


def test_a_hand_written_matcher_through_the_same_seam(real, prompts):
    engine, proc = make(real, DigitsCompiler(real[1]), max_num_seqs=8)
    outs = proc.generate(prompts, SamplingParams(temperature=1.0, n=2, seed=0, max_tokens=10,
                                                 structured_outputs=so(regex="[0-9]{4}")))
    for c in (c for o in outs for c in o.outputs):
        assert re.fullmatch(r"[0-9]{4}", c.text) and c.finish_reason == "stop", c.text
        assert len(c.token_ids) == 5                      # four digits and EOS
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        proc.generate(prompts[0], SamplingParams(structured_outputs=so(regex="[a-z]+")))


def test_a_sampler_that_ignores_the_mask_fails_only_its_request(real, compiler, prompts):
    def unmasked(logits, batch):
        batch.allowed = None
        return sample_rows(logits, batch)

    engine, proc = make(real, compiler, sampler=unmasked)
    free = engine.blocks.num_free
    outs = proc.generate(prompts[:1] * 2, [
        SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=so(choice=CHOICES)),
        SamplingParams(temperature=0.0, max_tokens=8)])
    assert outs[0].outputs[0].finish_reason == "error"
    assert "structured_outputs grammar does not allow" in outs[0].error
    assert outs[1].outputs[0].finish_reason == "length"
    assert engine.blocks.num_free == free


def test_bad_requests_are_refused_at_intake_and_leak_nothing(real, compiler, llm, prompts):
    engine, proc = llm
    free = engine.blocks.num_free
    bad = [so(json={"type": "strin"}), so(regex="[a-"), so(grammar="root ::= foo")]
    for spec in bad:
        with pytest.raises(ValueError, match=r"structured_outputs\.(json|regex|grammar)"):
            proc.generate(prompts, SamplingParams(structured_outputs=spec))
    assert engine.blocks.num_free == free and not engine.has_unfinished()

    bare, bare_proc = make(real, None)
    with pytest.raises(ValueError, match="structured_outputs need a constraint compiler"):
        bare_proc.generate(prompts[0], SamplingParams(structured_outputs=so(choice=CHOICES)))

    spec_engine, spec_proc = make(real, compiler, max_num_seqs=4)
    spec_engine.use_speculator(speculator_for({"method": "ngram", "num_speculative_tokens": 2},
                                              spec_engine))
    with pytest.raises(ValueError, match="structured_outputs cannot be combined with "
                                         "speculative decoding"):
        spec_proc.generate(prompts[0], SamplingParams(structured_outputs=so(choice=CHOICES)))
    assert spec_engine.blocks.num_free == spec_engine.blocks.num_blocks


def test_ignore_eos_still_ends_where_the_grammar_ends(llm, prompts):
    _, proc = llm
    out = proc.generate(prompts[0], SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, structured_outputs=so(choice=CHOICES)))
    assert out[0].text in CHOICES and out[0].outputs[0].finish_reason == "stop"
