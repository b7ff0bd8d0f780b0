"""The tests mirror the package: a folder of tests per package (tests/engine/ for
minillm/engine/, ...), and every module is imported by some test, or named below with the
reason it is tested through something else.

A module counts as imported when a test file imports it, or imports from its package a name
that the module defines (``from minillm.cache import BoundedCache`` covers
``minillm.cache.bounded``).
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

from test_layout import PACKAGE, module_name

TESTS = Path(__file__).resolve().parent

# Folders of tests that are not named after a package (kernels/: never a top-level name).
FOLDERS = {"kernel_tests": "kernels"}

# module -> where and how it is tested, for the modules no test imports directly.
TESTED_ELSEWHERE = {
    "minillm.bench.common": "every bench test runs through it (tables, reports, timers)",
    "minillm.bench.decode": "bench decode: tests/test_cli.py runs it end to end",
    "minillm.checkpoint.safetensors": "load_model of an HF folder: tests/checkpoint/"
                                      "test_hf_interop.py",
    "minillm.checkpoint.tokenizer": "the conftest's tokenizer fixture: tests/checkpoint/"
                                    "test_tokenizer.py",
    "minillm.course.placement.search": "goodput and the placement search through "
                                       "minillm.course.placement: tests/course/test_placement.py",
    "minillm.course.placement.simulator": "the simulator through minillm.course.placement: "
                                          "tests/course/test_placement.py",
    "minillm.disagg.worker": "the worker processes DisaggLLM starts: tests/disagg/",
    "minillm.engine.handoff": "DisaggLLM's adoption of prefilled KV: tests/disagg/",
    "minillm.engine.intake": "LLMEngine.add_request's checks: tests/engine/test_engine.py",
    "minillm.engine.policies": "n > 1 and beam search through the engine: tests/engine/",
    "minillm.engine.update": "the update half of every engine step: tests/engine/",
    "minillm.labs.common": "every checker test: tests/labs/",
    "minillm.model.transformer": "the model every test loads (conftest fixtures)",
    "minillm.parallel.api": "the parallel runs of tests/parallel/ (via minillm.parallel)",
    "minillm.parallel.expert": "expert parallelism in tests/parallel/test_parallel_model.py",
    "minillm.parallel.workers": "the processes of tests/parallel/",
    "minillm.serve.errors": "every error body in tests/serve/test_serve.py (over HTTP)",
    "minillm.serve.metrics": "GET /metrics in tests/serve/test_serve.py",
    "minillm.serve.protocol": "the request bodies in tests/serve/test_serve.py",
    "minillm.serve.responses": "the response bodies in tests/serve/test_serve.py",
    "minillm.serve.tokenize": "the tokenizer routes in tests/serve/test_serve.py and "
                              "test_lm_eval.py (over HTTP)",
    "minillm.spec_decode.inputs": "what every proposer reads: tests/spec_decode/",
    "minillm.train": "the package of tests/train/test_train.py's modules",
    "minillm.viz.a1": "appendix A1's plots, run by its notebook (nbmake)",
    "minillm.viz.a2": "appendix A2's plots, run by its notebook (nbmake)",
    "minillm.viz.ch02": "chapter 02's plots, run by its notebook (nbmake)",
    "minillm.viz.ch03": "chapter 03's plots, run by its notebook (nbmake)",
    "minillm.viz.ch05": "chapter 05's plots, run by its notebook (nbmake)",
    "minillm.viz.ch09": "chapter 09's plots, run by its notebook (nbmake)",
}


def imported_by_tests() -> set[str]:
    """Every minillm module a test file imports, directly or through a name its package
    re-exports."""
    found = set()
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minillm"):
                found.add(node.module)
                package = importlib.import_module(node.module)
                for alias in node.names:
                    found.add(_defining_module(package, alias.name))
    return found


def _defining_module(package, name: str) -> str:
    """The module that ``from package import name`` reaches: a submodule, or the module that
    defines the object."""
    obj = getattr(package, name, None)
    if obj is None or isinstance(obj, type(package)):
        return f"{package.__name__}.{name}"
    return getattr(obj, "__module__", "") or ""


def test_every_module_is_imported_by_a_test_or_says_where_it_is_tested():
    modules = {module_name(p) for p in PACKAGE.rglob("*.py") if p.name != "__main__.py"}
    untested = modules - imported_by_tests() - set(TESTED_ELSEWHERE)
    assert untested == set(), f"write a test, or add each to TESTED_ELSEWHERE: {untested}"


def test_the_list_of_modules_tested_elsewhere_stays_true():
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    assert set(TESTED_ELSEWHERE) <= modules, set(TESTED_ELSEWHERE) - modules
    now_imported = set(TESTED_ELSEWHERE) & imported_by_tests()
    assert now_imported == set(), f"imported by a test now: drop from the list {now_imported}"


def test_test_folders_are_packages_of_minillm():
    folders = {p.parent.name for p in TESTS.rglob("test_*.py") if p.parent != TESTS}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    stray = {f for f in folders if FOLDERS.get(f, f) not in packages | {"kernels"}}
    assert stray == set(), f"test folders without a package: {stray}"
    names = [p.name for p in TESTS.rglob("test_*.py")]
    assert len(names) == len(set(names)), "two test files share a name (pytest's imports)"
