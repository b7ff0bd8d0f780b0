"""The xgrammar compiler and matcher as the engine's Constraint, checked against references
computed here from the vocabulary's bytes (which tokens can start a choice), Python's ``re``
and plain bit arithmetic; and the errors a bad grammar gets (ValueError naming
structured_outputs and the field)."""
from __future__ import annotations

import re

import pytest
import torch

from minillm.config import SamplingParams, StructuredOutputsParams
from minillm.engine.constraints import Constraint
from minillm.structured import XGrammarCompiler, token_bytes
from minillm.structured.xgrammar_backend import choice_grammar, unpack_bitmask

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.slow
CHOICES = ["yes", "no", "maybe so"]


@pytest.fixture(scope="module")
def compiler(real):
    model, tok = real
    return XGrammarCompiler(tok, model.cfg.vocab_size)


@pytest.fixture(scope="module")
def vocab(real):
    return token_bytes(real[1])


def test_unpack_bitmask_reads_bit_j_of_word_i_as_token_32i_plus_j():
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-2**31, 2**31 - 1, (5,), dtype=torch.int32, generator=gen)
    got = unpack_bitmask(words, 150)
    want = [bool((int(words[t // 32]) >> (t % 32)) & 1) for t in range(150)]
    assert got.tolist() == want and got.dtype == torch.bool


def test_the_first_tokens_of_a_choice_are_the_prefixes_of_its_strings(compiler, vocab, real):
    c = compiler.compile(StructuredOutputsParams(choice=CHOICES))
    assert isinstance(c, Constraint)
    mask = c.allowed(len(vocab))
    want = {i for i, b in enumerate(vocab) if b and any(s.encode().startswith(b) for s in CHOICES)}
    assert set(mask.nonzero().view(-1).tolist()) == want
    assert not mask[real[1].eos_token_id]              # nothing written yet: no end


def test_a_choice_ends_only_with_eos_after_a_whole_string(compiler, real):
    tok = real[1]
    c = compiler.compile(StructuredOutputsParams(choice=CHOICES))
    for t in tok.encode("maybe"):
        c.accept(t)
    assert not c.allowed(tok.vocab_size)[tok.eos_token_id]
    for t in tok.encode(" so"):
        c.accept(t)
    mask = c.allowed(tok.vocab_size)
    assert mask.nonzero().view(-1).tolist() == [tok.eos_token_id]
    assert not c.is_terminated()
    c.accept(tok.eos_token_id)
    assert c.is_terminated()


def test_accept_refuses_a_disallowed_token_and_keeps_its_state(compiler, real):
    tok = real[1]
    c = compiler.compile(StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]+"))
    before = c.allowed(tok.vocab_size)
    letter = tok.encode("x")[0]
    assert not before[letter]
    with pytest.raises(ValueError, match="not allowed"):
        c.accept(letter)
    assert torch.equal(c.allowed(tok.vocab_size), before)


@pytest.mark.parametrize("text", ["123-abc", "999-z", "12-ab", "123-", "1234-ab", "abc-123"])
def test_a_regex_accepts_exactly_the_texts_re_fullmatches(compiler, real, text):
    tok = real[1]
    pattern = r"[0-9]{3}-[a-z]+"
    c = compiler.compile(StructuredOutputsParams(regex=pattern))
    accepted = True
    for t in tok.encode(text):
        if not c.allowed(tok.vocab_size)[t]:
            accepted = False
            break
        c.accept(t)
    ends = accepted and bool(c.allowed(tok.vocab_size)[tok.eos_token_id])
    assert ends == bool(re.fullmatch(pattern, text))


def test_fork_gives_an_independent_state(compiler, real):
    tok = real[1]
    a = compiler.compile(StructuredOutputsParams(choice=CHOICES))
    b = a.fork()
    for t in tok.encode("yes"):
        a.accept(t)
    assert a.allowed(tok.vocab_size).nonzero().view(-1).tolist() == [tok.eos_token_id]
    assert torch.equal(b.allowed(tok.vocab_size),
                       compiler.compile(StructuredOutputsParams(choice=CHOICES))
                       .allowed(tok.vocab_size))


def test_choice_strings_are_escaped():
    assert choice_grammar(('say "hi"', "a\\b")) == r'root ::= "say \"hi\"" | "a\\b"'


def test_a_choice_with_quotes_and_unicode_compiles_to_exactly_itself(compiler, real):
    tok = real[1]
    choice = 'she said "Zoë"'
    c = compiler.compile(StructuredOutputsParams(choice=[choice]))
    for t in tok.encode(choice):
        c.accept(t)
    assert c.allowed(tok.vocab_size).nonzero().view(-1).tolist() == [tok.eos_token_id]


@pytest.mark.parametrize("spec, field, words", [
    (dict(json={"type": "strin"}), "json", "Unsupported type"),
    (dict(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "json", "nope"),
    (dict(regex="[a-"), "regex", "Unclosed"),
    (dict(regex="(?<=a)b"), "regex", "Lookbehind"),
    (dict(grammar="root ::= foo"), "grammar", "not defined"),
    (dict(regex=r"[^\s\S]"), "regex", "allows no output"),
    (dict(json={"enum": [{1, 2}]}), "json", "not JSON serializable"),
])
def test_a_bad_grammar_is_a_value_error_naming_the_field(compiler, spec, field, words):
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{field} .*{words}"):
        compiler.compile(StructuredOutputsParams(**spec))


def test_json_object_is_any_object(compiler, real):
    tok = real[1]
    c = compiler.compile(StructuredOutputsParams(json_object=True))
    mask = c.allowed(tok.vocab_size)
    assert mask[tok.encode("{")[0]] and not mask[tok.encode("[")[0]]
    for t in tok.encode('{"any": [1, {"x": null}]}'):
        c.accept(t)
    assert c.allowed(tok.vocab_size)[tok.eos_token_id]


@pytest.mark.parametrize("fields, words", [
    ({}, "exactly one"),
    (dict(regex="a", choice=["a"]), "exactly one"),
    (dict(choice=[]), "choice must"),
    (dict(choice="ab"), "choice must"),
    (dict(choice=["a", ""]), "choice must"),
    (dict(json="{not json"), "json must be a JSON schema"),
    (dict(json=[1, 2]), "json must be a JSON schema"),
    (dict(regex=""), "regex must be a non-empty"),
    (dict(json_object="yes"), "json_object must be a bool"),
])
def test_structured_outputs_params_check_their_shape(fields, words):
    with pytest.raises(ValueError, match=rf"structured_outputs.*{words}"):
        StructuredOutputsParams(**fields)


def test_sampling_params_take_a_dict_and_refuse_beam_search():
    p = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert p.structured_outputs == StructuredOutputsParams(choice=("a", "b"))
    with pytest.raises(ValueError, match="structured_outputs cannot be combined with beam"):
        SamplingParams(beam_width=2, structured_outputs={"regex": "a"})
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputs"):
        SamplingParams(structured_outputs="json")
