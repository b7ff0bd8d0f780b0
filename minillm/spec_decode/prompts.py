"""Prompt set for speculative decoding: drafter training data and held-out benchmark prompts.

The target model (SmolLM2-135M-Instruct) answers :func:`training_prompts` to make
self-distillation data for the trained drafters, and :func:`benchmark_prompts` are the prompts
every drafter is measured on. Three kinds, because acceptance rates differ a lot between them:

* ``"chat"``: ordinary user questions (explain X, how do I Y, A versus B), templates x topics;
* ``"grounded"``: tasks whose answer copies from the input (summarise, rewrite, extract, answer
  from a passage; edit a Python snippet), over short invented passages and code written here;
* ``"free"``: free writing (stories, poems, letters, product descriptions), templates x subjects.

The banks (templates, topics, subjects, passages, code snippets) are data:
``prompt_bank.json`` beside this file.

Held-out rule: every bank (topics, subjects, passages, snippets) is split once, by position:
every 5th item (index 4, 9, 14, ...) is reserved for the benchmark and never appears in a
training prompt, and benchmark prompts are built only from those reserved items. Templates and
instructions are shared; the content they are filled with is not. Everything is pure Python and
deterministic: the same ``seed`` gives the same training prompts, and the benchmark is fixed.
"""
from __future__ import annotations

import json
import random
from collections.abc import Sequence
from functools import cache
from pathlib import Path

KINDS = ("chat", "grounded", "free")
BANK_FILE = Path(__file__).with_name("prompt_bank.json")


@cache
def _bank() -> dict:
    """The prompt bank, read once."""
    return json.loads(BANK_FILE.read_text())


# --------------------------------------------------------------------------------------------
# building the pools
# --------------------------------------------------------------------------------------------


def _split(bank: Sequence, held_out: bool) -> list:
    """The held-out part of ``bank`` (every 5th item) if ``held_out``, else the rest."""
    every = _bank()["hold_out_every"]
    return [x for i, x in enumerate(bank) if (i % every == every - 1) == held_out]


def _templated_groups(kind: dict, held_out: bool) -> list[list[str]]:
    """One group of messages per topic: every template with every modifier."""
    return [[tpl.format(t=topic) + mod for tpl in fam["templates"] for mod in kind["modifiers"]]
            for fam in kind["families"] for topic in _split(fam["topics"], held_out)]


def _passage_messages(passage: str, question: str) -> list[str]:
    """Every passage task, with the instruction both before and after the passage."""
    bank = _bank()["grounded"]
    tasks = bank["passage_tasks"] + [t.format(q=question) for t in bank["question_tasks"]]
    return [m for task in tasks for m in (f"{task}\n\n{passage}", f"{passage}\n\n{task}")]


def _code_messages(tags: str, code: str) -> list[str]:
    """Every code task that fits the snippet's tags, instruction before and after the code."""
    block = f"```python\n{code.strip(chr(10))}\n```"
    tasks = [t["task"] for t in _bank()["grounded"]["code_tasks"]
             if not t["needs"] or t["needs"] in tags.split()]
    return [m for task in tasks for m in (f"{task}\n\n{block}", f"{block}\n\n{task}")]


def _groups(kind: str, held_out: bool) -> list[list[str]]:
    """Messages of one kind grouped by the bank item (topic, passage, snippet) they use."""
    _check_kind(kind)
    bank = _bank()[kind]
    if kind != "grounded":
        return _templated_groups(bank, held_out)
    return ([_passage_messages(p["passage"], p["question"])
             for p in _split(bank["passages"], held_out)]
            + [_code_messages(s["tags"], s["code"]) for s in _split(bank["snippets"], held_out)])


@cache
def _training_pool(kind: str) -> tuple[str, ...]:
    """All distinct training messages of one kind, in a fixed order."""
    return tuple(dict.fromkeys(m for group in _groups(kind, False) for m in group))


@cache
def _benchmark_pool(kind: str) -> tuple[str, ...]:
    """All held-out messages of one kind, interleaved so that the first ones use different
    bank items: round r takes the r-th message of every (fixed-shuffled) group."""
    rng = random.Random(_bank()["benchmark_seed"] + KINDS.index(kind))
    groups = _groups(kind, True)
    for group in groups:
        rng.shuffle(group)
    rng.shuffle(groups)
    rounds = max(len(g) for g in groups)
    ordered = [g[r] for r in range(rounds) for g in groups if r < len(g)]
    return tuple(dict.fromkeys(ordered))


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def training_prompts(n: int = 3000, seed: int = 0) -> list[tuple[str, str]]:
    """(kind, user message) pairs, n of them, kinds in roughly equal thirds, deterministic for a
    seed, no duplicates. Built only from the training part of every bank."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    for i, kind in enumerate(KINDS):
        k = n // len(KINDS) + (i < n % len(KINDS))
        pool = _training_pool(kind)
        if k > len(pool):
            raise ValueError(f"n={n} needs {k} {kind!r} prompts but only {len(pool)} exist")
        out += [(kind, m) for m in rng.sample(pool, k)]
    rng.shuffle(out)
    return out


def benchmark_prompts(kind: str, n: int = 8) -> list[str]:
    """n held-out user messages of one kind (ValueError naming `kind` and the allowed values for
    an unknown kind; ValueError for n < 1 or n larger than available). Always the same list."""
    _check_kind(kind)
    pool = _benchmark_pool(kind)
    if not 1 <= n <= len(pool):
        raise ValueError(f"n must be between 1 and {len(pool)} for kind {kind!r}, got {n}")
    return list(pool[:n])


def num_training_prompts() -> dict[str, int]:
    """How many distinct training messages each kind can give."""
    return {kind: len(_training_pool(kind)) for kind in KINDS}


def all_benchmark_prompts() -> list[str]:
    """Every held-out user message of every kind (what training data must not contain)."""
    return [m for kind in KINDS for m in _benchmark_pool(kind)]
