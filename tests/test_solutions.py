"""The teacher's key (minillm.labs.solutions): every checker of every chapter has a reference
solution there, and every reference passes its checker (what `make solutions` runs)."""
from __future__ import annotations

import importlib
import inspect

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


def test_unknown_chapter_is_named():
    with pytest.raises(ValueError, match="chapter must be one of"):
        solutions.key("ch99")
