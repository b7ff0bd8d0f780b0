"""Grade students' notebooks with the chapters' own checkers (``python -m minillm.labs grade``).

How a notebook is graded:

1. Its exercises are found by reading it, not by running it: every ``<alias>.check_<name>(...)``
   call in a code cell whose ``<alias>`` is bound by ``from minillm.labs import <chapter>`` (or
   ``... import <chapter> as <alias>``). The notebook's chapters are the ones it imports this
   way, whatever the file is called; each checker of those chapters (their ``KEY`` in
   :mod:`minillm.labs.solutions`) is one exercise, TODO when the notebook never calls it.
2. The notebook runs top to bottom in a fresh ``python3`` kernel (``nbclient``, errors allowed,
   ``MINILLM_FAST=1`` unless asked otherwise, the notebook's folder as working directory). Once
   the kernel is up, its cells, the grading cell included, have ``timeout`` seconds in all:
   before each cell, nbclient's per-cell timeout is set to what is left.
3. One more cell then runs in that kernel: :func:`print_verdicts` (its source, sent from here)
   reloads ``minillm.labs.common`` and the chapter modules and evaluates each recorded call
   with its alias bound to the reloaded module, then prints the verdicts as one JSON line
   behind a marker drawn at random for this run. Only that line counts.

Trust model: the checkers run inside the student's kernel, after a fresh reload. This defeats
a printed "[PASS]", a redefined or reassigned checker (``ch07.check_x = lambda f: ...``) and a
student's own verdict lines; it does not defeat a student who deliberately monkeypatches the
package's internals (the reference implementations the checkers compare with, ``importlib``)
or reads the marker out of the grading cell. A teacher who needs that runs the checkers in a
separate process.

A notebook that runs past its time limit, whose kernel dies or that cannot be run is reported:
each of its exercises gets status ERROR with the reason, and the other notebooks are graded.
"""
from __future__ import annotations

import ast
import csv
import importlib
import inspect
import json
import math
import os
import re
import secrets
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from .kernel_wakeup import install as install_kernel_wakeup
from .solutions import CHAPTERS, key

MESSAGE_CHARS = 300
STATUS = {True: "PASS", False: "FAIL", None: "TODO"}
# A chapter's own file name (07_pd_disaggregation, 06b_block_drafting, A3_runtimes).
CHAPTER_FILE = re.compile(r"(\d\d[a-z]?|A\d)_")


@dataclass(frozen=True)
class Exercise:
    """One checker of a notebook's chapter and the notebook's call of it (None: never called)."""

    chapter: str
    checker: str            # "check_goodput"
    alias: str              # the name the notebook imports the chapter's checkers as
    call: str | None        # source text of the call, e.g. "ch07.check_goodput(goodput)"


@dataclass(frozen=True)
class Row:
    """One line of the grades: a student's result on one exercise."""

    student: str
    notebook: str
    chapter: str
    exercise: str           # checker name without "check_"
    status: str             # PASS, FAIL, TODO or ERROR
    message: str
    seconds: float          # wall time of the whole notebook


# --- reading a notebook ----------------------------------------------------------------------


def parse_cell(source: str) -> ast.Module | None:
    """A code cell's syntax tree; if it does not parse as Python, the tree of the cell with its
    ``%magic`` and ``!shell`` lines blanked out (line numbers still match ``source``); None
    when that does not parse either."""
    blanked = "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                        for line in source.split("\n"))
    for code in (source, blanked):
        try:
            return ast.parse(code)
        except SyntaxError:
            pass
    return None


def code_cells(nb: nbformat.NotebookNode) -> list[tuple[int, str, ast.Module]]:
    """(index, source, tree) of every code cell that parses."""
    cells = []
    for index, cell in enumerate(nb.cells):
        tree = parse_cell(cell.source) if cell.cell_type == "code" else None
        if tree is not None:
            cells.append((index, cell.source, tree))
    return cells


def chapter_aliases(nb: nbformat.NotebookNode) -> dict[str, str]:
    """alias -> chapter for each ``from minillm.labs import <chapter> [as <alias>]``."""
    aliases = {}
    for _, _, tree in code_cells(nb):
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "minillm.labs":
                aliases.update({a.asname or a.name: a.name for a in node.names
                                if a.name in CHAPTERS})
    return aliases


def checker_calls(tree: ast.Module, aliases: dict[str, str]) -> list[ast.Call]:
    """The ``<alias>.check_<name>(...)`` calls of a cell, for the aliases of chapter modules."""
    return [node for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id in aliases
            and node.func.attr.startswith("check_")]


def find_exercises(nb: nbformat.NotebookNode) -> list[Exercise]:
    """The exercises of a notebook: each checker of each chapter it imports, in the chapter's
    KEY order, with the notebook's first call of it; then any other ``check_*`` it calls."""
    aliases = chapter_aliases(nb)
    calls: dict[tuple[str, str], Exercise] = {}
    for _, source, tree in code_cells(nb):
        for call in checker_calls(tree, aliases):
            alias, checker = call.func.value.id, call.func.attr
            calls.setdefault((aliases[alias], checker), Exercise(
                aliases[alias], checker, alias, ast.get_source_segment(source, call)))
    exercises = []
    for chapter in dict.fromkeys(aliases.values()):
        alias = next(a for a, c in aliases.items() if c == chapter)
        for checker, _ in key(chapter):
            exercises.append(calls.pop((chapter, checker.__name__),
                                       Exercise(chapter, checker.__name__, alias, None)))
    return exercises + list(calls.values())


def student_of(path: Path) -> str:
    """The student a notebook belongs to: its file stem (``submissions/bob.ipynb`` -> bob), or
    its folder's name when the stem starts like a chapter's own file name (``07_...``,
    ``06b_...``, ``A3_...``: ``submissions/alice/07_pd_disaggregation.ipynb`` -> alice)."""
    path = Path(path)
    return path.parent.resolve().name if CHAPTER_FILE.match(path.stem) else path.stem


# --- running a notebook ----------------------------------------------------------------------


def print_verdicts(calls: list[tuple[str, str, str]], marker: str, namespace: dict) -> None:
    """Run in the student's kernel: reload ``minillm.labs.common`` and each chapter module,
    evaluate each (chapter, alias, call source) in ``namespace`` with ``alias`` bound to the
    reloaded module, and print ``marker`` + a JSON list of [status, message], one per call.

    A call that raises (a NameError because the definition's cell failed, say) is a FAIL with
    the exception's text. Its source is sent to the kernel on its own (:func:`grading_cell`):
    it uses no global names but ``importlib``, ``json``, ``sys`` and ``STATUS``."""
    importlib.reload(importlib.import_module("minillm.labs.common"))
    modules = {chapter: importlib.reload(importlib.import_module(f"minillm.labs.{chapter}"))
               for chapter in dict.fromkeys(chapter for chapter, _, _ in calls)}
    verdicts = []
    for chapter, alias, call in calls:
        try:
            result = eval(call, {**namespace, alias: modules[chapter]})  # noqa: S307
            verdicts.append([STATUS[result.passed], result.message])
        except Exception as e:  # noqa: BLE001 - a student's crash is a verdict, not an error
            verdicts.append(["FAIL", f"{type(e).__name__}: {e}"])
    sys.stdout.write(f"\n{marker}{json.dumps(verdicts)}\n")


def grading_cell(calls: list[tuple[str, str, str]], marker: str) -> nbformat.NotebookNode:
    """The cell appended to a notebook to grade it: it runs the source of
    :func:`print_verdicts` in a scope of its own, so the kernel imports nothing of this module
    and the student's names are left alone."""
    code = (f"import importlib, json, sys\nSTATUS = {STATUS!r}\n"
            f"{inspect.getsource(print_verdicts)}\nprint_verdicts(calls, marker, namespace)\n")
    return nbformat.v4.new_code_cell(
        f"exec({code!r}, {{'calls': {calls!r}, 'marker': {marker!r}, 'namespace': globals()}})")


def verdicts_of(cell: nbformat.NotebookNode, marker: str) -> list[list[str]]:
    """The verdicts the grading cell printed; RuntimeError (with the cell's error) if none."""
    text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
    lines = [line for line in text.splitlines() if line.startswith(marker)]
    if lines:
        return json.loads(lines[-1][len(marker):])
    errors = [f"{o.ename}: {o.evalue}" for o in cell.outputs if o.output_type == "error"]
    raise RuntimeError("the grading cell printed no verdicts" + "".join(f" ({e})" for e in errors))


def kernel_env(fast: bool) -> dict[str, str]:
    """The kernel's environment: this one, with ``MINILLM_FAST=1`` when ``fast`` (else unset)."""
    env = {k: v for k, v in os.environ.items() if k != "MINILLM_FAST"}
    return (env | {"MINILLM_FAST": "1"}) if fast else env


def run_notebook(path: Path, calls: list[tuple[str, str, str]], timeout: float,
                 fast: bool) -> list[list[str]]:
    """Run the notebook in a fresh kernel, then the grading cell; its [status, message] per
    call. Raises TimeoutError (nbclient's CellTimeoutError is one) when the cells take more
    than ``timeout`` seconds in all, DeadKernelError when the kernel dies, RuntimeError when
    the grading cell prints nothing."""
    install_kernel_wakeup()
    nb = nbformat.read(path, as_version=4)
    marker = f"MINILLM-GRADE-{secrets.token_hex(8)}:"
    nb.cells.append(grading_cell(calls, marker))
    client = NotebookClient(nb, kernel_name="python3", allow_errors=True,
                            shutdown_kernel="immediate",
                            resources={"metadata": {"path": str(Path(path).parent)}})
    with client.setup_kernel(env=kernel_env(fast)):
        deadline = time.monotonic() + timeout
        for index, cell in enumerate(nb.cells):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no time left for cell {index}")
            client.timeout = math.ceil(left)
            client.execute_cell(cell, index)
    return verdicts_of(nb.cells[-1], marker)


def grade_notebook(path: Path, timeout: float = 900, fast: bool = True) -> list[Row]:
    """The rows of one notebook: a verdict per exercise, or ERROR on every exercise (with the
    reason) when the notebook could not be run to the end within ``timeout`` seconds."""
    path = Path(path)
    exercises = find_exercises(nbformat.read(path, as_version=4))
    called = [e for e in exercises if e.call is not None]
    start = time.monotonic()
    try:
        verdicts = run_notebook(path, [(e.chapter, e.alias, e.call) for e in called],
                                timeout, fast)
        results = dict(zip(called, verdicts, strict=True))
    except TimeoutError:
        results = {e: ["ERROR", f"ran past the time limit of {timeout:g} s"] for e in called}
    except Exception as error:  # noqa: BLE001 - one notebook's failure must not stop the others
        results = {e: ["ERROR", f"{type(error).__name__}: {error}"] for e in called}
    seconds = round(time.monotonic() - start, 1)
    not_called = ["TODO", "the notebook never calls this checker"]
    return [Row(student_of(path), str(path), e.chapter, e.checker.removeprefix("check_"),
                status, message[:MESSAGE_CHARS], seconds)
            for e in exercises for status, message in [results.get(e, not_called)]]


def grade(paths: list[Path], timeout: float = 900, fast: bool = True) -> list[Row]:
    """The rows of every notebook, graded one after the other. Raises FileNotFoundError or
    ValueError, naming the file, before running anything when a notebook is missing or has no
    exercises."""
    for path in paths:
        if not Path(path).is_file():
            raise FileNotFoundError(f"no such notebook: {path}")
        if not find_exercises(nbformat.read(path, as_version=4)):
            raise ValueError(f"{path} has no exercises: it imports no checkers "
                             "(from minillm.labs import <chapter>)")
    return [row for path in paths for row in grade_notebook(Path(path), timeout, fast)]


# --- reports ---------------------------------------------------------------------------------


def write_reports(rows: list[Row], out: Path) -> tuple[Path, Path]:
    """Write ``grades.csv`` and ``grades.json`` (a list of rows) to folder ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "grades.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(Row.__dataclass_fields__))
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)
    (out / "grades.json").write_text(json.dumps([asdict(row) for row in rows], indent=1) + "\n")
    return out / "grades.csv", out / "grades.json"


def table(rows: list[Row]) -> str:
    """Students as rows, ``chapter.exercise`` as columns, a status in each cell ("-": the
    student has no notebook of that chapter), and each student's PASS count."""
    columns = list(dict.fromkeys(f"{r.chapter}.{r.exercise}" for r in rows))
    status: dict[str, dict[str, str]] = {}
    for r in rows:
        status.setdefault(r.student, {})[f"{r.chapter}.{r.exercise}"] = r.status
    header = ["student", *columns, "PASS"]
    lines = [[student, *(got.get(c, "-") for c in columns),
              f"{list(got.values()).count('PASS')}/{len(got)}"]
             for student, got in status.items()]
    widths = [max(len(line[i]) for line in [header, *lines]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip()
                     for line in [header, *lines])


# --- the teacher's key -----------------------------------------------------------------------


def raises_not_implemented(node: ast.AST) -> bool:
    """True when ``node`` contains ``raise NotImplementedError`` (with or without a call)."""
    return any(isinstance(n, ast.Raise) and n.exc is not None
               and ast.unparse(n.exc).split("(")[0] == "NotImplementedError"
               for n in ast.walk(node))


def key_imports(tree: ast.Module, aliases: dict[str, str]) -> dict[str, str]:
    """stub name -> the import of its reference solution, for each name a cell passes first to
    a checker of a KEY (``from minillm.labs.solutions.ch07 import goodput [as my_goodput]``)."""
    imports = {}
    for call in checker_calls(tree, aliases):
        chapter = aliases[call.func.value.id]
        solution = {c.__name__: s.__name__ for c, s in key(chapter)}.get(call.func.attr)
        if solution and call.args and isinstance(call.args[0], ast.Name):
            name = call.args[0].id
            imports[name] = f"from minillm.labs.solutions.{chapter} import {solution}" + (
                f" as {name}" if name != solution else "")
    return imports


def splice_key(notebook_path: Path, out_path: Path) -> Path:
    """Write a copy of a notebook where each exercise's stub (a top-level def or class of an
    exercise cell that raises NotImplementedError and is passed to a checker) is replaced by
    an import of the reference solution; the rest of the cell is kept. Returns ``out_path``."""
    nb = nbformat.read(notebook_path, as_version=4)
    aliases = chapter_aliases(nb)
    for index, source, tree in code_cells(nb):
        imports = key_imports(tree, aliases)
        stubs = [s for s in tree.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                        ast.ClassDef))
                 and s.name in imports and raises_not_implemented(s)]
        lines = source.split("\n")
        for stub in reversed(stubs):
            first = min([stub.lineno] + [d.lineno for d in stub.decorator_list])
            lines[first - 1:stub.end_lineno] = [imports[stub.name]]
        nb.cells[index].source = "\n".join(lines)
    nbformat.write(nb, out_path)
    return Path(out_path)
