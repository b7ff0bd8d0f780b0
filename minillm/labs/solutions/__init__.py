"""The teacher's key: a reference solution for every exercise of every chapter.

One module per chapter (``minillm.labs.solutions.ch01`` ...), next to its checkers in
``minillm.labs.ch01``. Each defines the solutions as plain functions, written from the rules the
chapter teaches (not copied from the package), and ``KEY``: a list of (checker, solution) pairs
covering every ``check_*`` of the chapter.

Run every checker against its reference with ``make solutions`` (``python -m
minillm.labs.solutions [chapter ...]``); the test suite does the same in CI.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable

from ..common import Result

CHAPTERS = ("ch01", "ch02", "ch03", "ch04", "ch05", "ch06", "ch06b", "ch07", "ch08", "ch09",
            "a1", "a2", "a3")


def key(chapter: str) -> list[tuple[Callable[[Callable], Result], Callable]]:
    """The (checker, reference solution) pairs of one chapter, e.g. ``key("ch09")``."""
    if chapter not in CHAPTERS:
        raise ValueError(f"chapter must be one of {', '.join(CHAPTERS)}; got {chapter!r}")
    return importlib.import_module(f"{__name__}.{chapter}").KEY


def run(chapters: Iterable[str] = CHAPTERS) -> list[Result]:
    """Run each chapter's checkers on the reference solutions; every Result should pass."""
    results = []
    for chapter in chapters:
        print(f"--- {chapter}")
        results += [checker(solution) for checker, solution in key(chapter)]
    return results
