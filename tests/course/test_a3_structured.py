"""Chapter A3's automata by hand: each equals Python's ``re`` on the language it stands for, and
the token mask and matcher built on them keep the engine's Constraint contract."""
from __future__ import annotations

import random
import re

import pytest
import torch

from minillm.checkpoint.loader import smollm2_tokenizer
from minillm.config import StructuredOutputsParams
from minillm.course.a3_structured import (
    DIGITS,
    DfaCompiler,
    DfaConstraint,
    choice_dfa,
    forced_steps,
    sequence_dfa,
    token_texts,
    walk_mask,
)

DATE_REGEX = "[0-9]{4}-[0-9]{2}-[0-9]{2}"
DATE = sequence_dfa([(DIGITS, 4), ("-", 1), (DIGITS, 2), ("-", 1), (DIGITS, 2)])
SHAPE = "dddd-dd-dd"          # the class of each position of a date


def is_date_prefix(text: str) -> bool:
    """Independent of the automaton: every character fits its position of a date."""
    return len(text) <= len(SHAPE) and all(
        (c in "0123456789") if s == "d" else c == s for c, s in zip(text, SHAPE))


def test_the_sequence_automaton_accepts_what_re_accepts():
    rng = random.Random(0)
    samples = ["2024-12-06", "2024-12-6", "2024-12-061", "", "20x4-12-06"]
    samples += ["".join(rng.choice("0123456789-x") for _ in range(rng.randint(0, 12)))
                for _ in range(3000)]
    samples += ["".join(rng.choice("0123456789") if s == "d" else s for s in SHAPE)
                for _ in range(200)]
    for text in samples:
        end = DATE.walk(0, text)
        assert (end in DATE.accepting) == bool(re.fullmatch(DATE_REGEX, text)), text
        assert (end is not None) == is_date_prefix(text), text


def test_the_choice_trie_accepts_exactly_its_words():
    words = ["yes", "no", "maybe", "yesterday"]
    dfa = choice_dfa(words)
    for text in words + ["ye", "", "nope", "may", "yess", "yesterda", "n"]:
        end = dfa.walk(0, text)
        assert (end in dfa.accepting) == (text in words), text
        assert (end is not None) == any(w.startswith(text) for w in words), text


def test_walk_mask_on_the_real_vocabulary_equals_the_prefix_rule():
    tok = smollm2_tokenizer()
    texts = token_texts(tok)
    assert len(texts) == tok.vocab_size and texts[tok.eos_token_id] == ""
    for state, read in ((0, ""), (4, "2024"), (6, "2024-1"), (10, "2024-12-06")):
        mask = walk_mask(DATE, state, texts, tok.eos_token_id)
        want = [bool(t) and is_date_prefix(read + t) for t in texts]
        want[tok.eos_token_id] = state in DATE.accepting
        assert mask.tolist() == want, state
    assert walk_mask(DATE, 0, texts, tok.eos_token_id).sum() == 10     # the ten digits


def test_the_matcher_keeps_the_constraint_contract():
    texts = ["1", "12", "-", "2024-", "", "x", "<eos>"]
    eos = texts.index("<eos>")
    calls = []

    def counted(dfa, state, ts, eos_id):
        calls.append(state)
        return walk_mask(dfa, state, ts, eos_id)

    matcher = DfaConstraint(DATE, texts, eos, counted)
    assert matcher.allowed(8).tolist() == [True, True, False, True, False, False, False, False]
    matcher.accept(texts.index("12"))
    twin = matcher.fork()
    with pytest.raises(ValueError):
        matcher.accept(texts.index("x"))
    assert matcher.state == 2                       # a refused token leaves the state as it was
    for t in ("12", "-", "1", "1", "-", "1", "1"):        # 2024-12-06 in shape
        matcher.accept(texts.index(t))
    assert matcher.allowed(7)[eos] and not matcher.is_terminated()
    matcher.accept(eos)
    assert matcher.is_terminated() and twin.state == 2 and not twin.is_terminated()
    twin.allowed(7)
    assert calls.count(2) == 1                      # the index is shared with the fork


def test_the_compiler_knows_its_regexes_and_choices_only():
    texts, eos = ["y", "es", "no", "<eos>"], 3
    compiler = DfaCompiler({DATE_REGEX: DATE}, texts, eos, walk_mask)
    matcher = compiler.compile(StructuredOutputsParams(choice=("yes", "no")))
    assert forced_steps(lambda: compiler.compile(StructuredOutputsParams(choice=("yes", "no"))),
                        [0, 1, 3], 4) == [2, 1, 1]          # y|no, then "es", then EOS
    assert isinstance(matcher.allowed(4), torch.Tensor)
    assert compiler.compile(StructuredOutputsParams(regex=DATE_REGEX)).dfa is DATE
    with pytest.raises(ValueError, match="structured_outputs"):
        compiler.compile(StructuredOutputsParams(regex="[a-z]+"))
