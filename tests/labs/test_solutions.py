"""The teacher's key (minillm.labs.solutions): every checker of every chapter has a reference
solution there, and every reference passes its checker (what `make solutions` runs)."""
from __future__ import annotations

import importlib
import inspect
import json
import re
from pathlib import Path

import pytest

from minillm.labs import solutions


def checkers(chapter: str) -> set[str]:
    module = importlib.import_module(f"minillm.labs.{chapter}")
    return {name for name, f in inspect.getmembers(module, inspect.isfunction)
            if name.startswith("check_") and f.__module__ == module.__name__}


@pytest.mark.parametrize("chapter", solutions.CHAPTERS)
def test_every_checker_has_a_reference(chapter):
    keyed = {checker.__name__ for checker, _ in solutions.key(chapter)}
    missing = checkers(chapter) - keyed
    assert not missing, f"{chapter}: no reference solution in the key for {sorted(missing)}"


@pytest.mark.parametrize("chapter", solutions.CHAPTERS)
def test_every_reference_passes(chapter):
    for result in solutions.run([chapter]):
        assert result.passed is True, repr(result)


NOTEBOOKS = {("" if path.name[0] == "A" else "ch") + path.name.split("_")[0].lower(): path
             for path in (Path(__file__).resolve().parents[2] / "chapters").glob("*.ipynb")}
LABS = ("ch01", "ch02", "ch03", "ch04", "ch05", "ch06", "ch06b", "ch07", "ch08", "ch09", "a1",
        "a2", "a3")


@pytest.mark.parametrize("chapter", solutions.CHAPTERS)
def test_the_notebook_calls_every_checker(chapter):
    """Every checker is an exercise of its chapter (none orphaned), and a lab chapter has 5-8."""
    cells = json.loads(NOTEBOOKS[chapter].read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    called = set(re.findall(r"\b(check_\w+)\(", code)) & checkers(chapter)
    assert called == checkers(chapter), f"{chapter}: never called: {checkers(chapter) - called}"
    if chapter in LABS:
        assert 5 <= len(called) <= 8, f"{chapter} has {len(called)} exercises, not 5 to 8"


def test_unknown_chapter_is_named():
    with pytest.raises(ValueError, match="chapter must be one of"):
        solutions.key("ch99")
