"""Training prompts for the drafters at scale, from real text that ships with Python.

A drafter trained on a few templated prompts memorises their replies; one trained on the target's
answers to tens of thousands of varied prompts learns how the target writes. The sources here
are read offline from every Python install, and none of them is the prompt bank
(``prompt_bank.json``), whose held-out items are the benchmark's prompts
(:func:`minillm.spec_decode.prompts.benchmark_prompts`):

- **passages**: the docstrings of the standard library's modules, classes and functions, read
  from its source files with :mod:`ast` (nothing is imported), cut to 30-150 words at sentence
  ends; the ``grounded`` prompts ask to summarise, explain, rewrite or question them;
- **code**: the standard library's short functions (5-25 lines), to explain, document or change;
- **topics**: English words of the target's own vocabulary (whole-word tokens of 6+ letters),
  for ``chat`` questions and ``free`` writing; and a share of ``self`` prompts, where the target
  is first asked to write a question about a topic and then answers its own question
  (:func:`minillm.spec_decode.training.distill.make_corpus_dataset` runs both steps).

:func:`corpus_prompts` returns (kind, message) pairs, deterministic for a seed.
"""
from __future__ import annotations

import ast
import random
import re
import sysconfig
from functools import lru_cache
from pathlib import Path

from ..prompts import all_benchmark_prompts

KIND_SHARES = {"grounded": 0.35, "code": 0.1, "chat": 0.25, "self": 0.15, "free": 0.15}

PASSAGE_TASKS = [
    "Summarise this text in one sentence:\n\n{p}",
    "Summarise the following in two or three sentences.\n\n{p}",
    "Explain this to a beginner in plain words:\n\n{p}",
    "What is the main point of this text?\n\n{p}",
    "List the key points of the following text as bullets.\n\n{p}",
    "Rewrite this text so that it is shorter and clearer:\n\n{p}",
    "Read the text and write two questions it answers, with their answers.\n\n{p}",
    "Which names, functions or terms does this text mention? Explain each briefly.\n\n{p}",
    "{p}\n\nWhat does this describe, and when would someone use it?",
    "Here is some documentation:\n\n{p}\n\nGive a short example of how it is used.",
]
CODE_TASKS = [
    "Explain what this Python function does, step by step.\n\n```python\n{c}\n```",
    "Write a docstring for this function.\n\n```python\n{c}\n```",
    "Add type hints to this function and explain them.\n\n```python\n{c}\n```",
    "What could go wrong in this code? Suggest one improvement.\n\n```python\n{c}\n```",
    "```python\n{c}\n```\n\nDescribe the inputs and the output of this function.",
    "Rename the variables of this function to clearer names.\n\n```python\n{c}\n```",
]
CHAT_TASKS = [
    "What is {t}?", "Explain the word \"{t}\" with an example.", "Tell me about {t}.",
    "Can you describe {t} briefly?", "How is \"{t}\" used in everyday language?",
    "Give me three facts related to {t}.", "What does {t} mean, and where does the word come "
    "from?", "Why might someone be interested in {t}?", "Explain {t} to a ten-year-old.",
    "What are some synonyms of \"{t}\"? Use each in a sentence.",
]
FREE_TASKS = [
    "Write a short story that involves {t}.", "Write a poem about {t}.",
    "Write a short letter to a friend that mentions {t}.", "Describe a place where {t} matters.",
    "Write a dialogue between two people about {t}.", "Write a product description for "
    "something called \"{t}\".", "Write a diary entry about a day full of {t}.",
    "Write a short speech about {t}.",
]
SELF_ASK = ("Write one question that a curious student might ask about \"{t}\". Reply with the "
            "question only.")
MIN_WORDS, MAX_WORDS = 30, 150


def stdlib_files() -> list[Path]:
    """The standard library's Python files (no tests, no site-packages), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "pydoc_data",
            "encodings", "ensurepip")
    return sorted(p for p in root.rglob("*.py") if not set(p.relative_to(root).parts) & set(skip))


def _sentences_cut(text: str) -> str | None:
    """The text's first paragraphs up to MAX_WORDS words, cut at a sentence end; None when
    shorter than MIN_WORDS."""
    text = re.sub(r"[ \t]+", " ", text.strip())
    words, out = 0, []
    for para in text.split("\n\n"):
        n = len(para.split())
        if words + n > MAX_WORDS:
            sentences = re.split(r"(?<=[.!?])\s+", para)
            for s in sentences:
                if words + len(s.split()) > MAX_WORDS:
                    break
                out.append(s)
                words += len(s.split())
            break
        out.append(para)
        words += n
    cut = "\n\n".join(out).strip()
    return cut if words >= MIN_WORDS else None


@lru_cache(maxsize=1)
def stdlib_texts() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(passages, code): the standard library's docstrings (cut as above) and its functions of
    5-25 lines, each once, in file order."""
    passages: dict[str, None] = {}
    code: dict[str, None] = {}
    for path in stdlib_files():
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                     ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            cut = _sentences_cut(doc) if doc else None
            if cut and "\n>>>" not in cut:
                passages[cut] = None
            if isinstance(node, ast.FunctionDef) and 5 <= node.end_lineno - node.lineno < 25:
                segment = ast.get_source_segment(source, node)
                if segment and len(segment) < 1200:
                    code[_dedent(segment, node.col_offset)] = None
    return tuple(passages), tuple(code)


def _dedent(code: str, indent: int) -> str:
    """A source segment (its first line already unindented) with ``indent`` columns taken
    off the others."""
    lines = code.splitlines()
    return "\n".join([lines[0]] + [x[indent:] for x in lines[1:]])


def vocabulary_words(tokenizer) -> tuple[str, ...]:
    """Whole English words of 6+ lowercase letters that the tokenizer has as one token after a
    space (its own vocabulary: what the target knows), sorted; none that occurs in a
    benchmark prompt."""
    held_out = {w.lower() for m in all_benchmark_prompts() for w in re.findall(r"[A-Za-z]+", m)}
    words = set()
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.id_to_token(i) or ""
        word = piece[1:] if piece.startswith("\u0120") else None      # byte-level space
        if word and len(word) >= 6 and word.isascii() and word.isalpha() and word.islower() \
                and word not in held_out:
            words.add(word)
    return tuple(sorted(words))


def corpus_prompts(n: int, tokenizer, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` (kind, message) pairs in KIND_SHARES, shuffled, deterministic for a seed. Kinds:
    grounded (passages), code, chat and free (topics), and self, whose message asks the
    target to write the question it will then answer."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = random.Random(seed)
    passages, code = stdlib_texts()
    words = vocabulary_words(tokenizer)
    pools = {"grounded": (PASSAGE_TASKS, passages, "p"), "code": (CODE_TASKS, code, "c"),
             "chat": (CHAT_TASKS, words, "t"), "free": (FREE_TASKS, words, "t"),
             "self": ([SELF_ASK], words, "t")}
    out: list[tuple[str, str]] = []
    for kind, share in KIND_SHARES.items():
        tasks, items, key = pools[kind]
        if not items:
            raise RuntimeError(f"no {kind} material found (standard library at "
                               f"{sysconfig.get_paths()['stdlib']})")
        count = round(n * share) if kind != "free" else n - len(out)
        picked = rng.sample(items, count) if count <= len(items) else \
            [rng.choice(items) for _ in range(count)]
        out += [(kind, rng.choice(tasks).format(**{key: item})) for item in picked]
    rng.shuffle(out)
    return out[:n]
