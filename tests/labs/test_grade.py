"""The grader: notebooks made of chapter 07's own import and exercise cells, with the key spliced
in, a wrong answer planted, the checkers faked, a cell that raises, a loop that never ends and a
kernel that dies, graded in real kernels; the reports, the command line, and the key of every
chapter."""
from __future__ import annotations

import csv
import functools
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import nbformat
import pytest

from minillm.labs import grade
from minillm.labs.__main__ import main
from minillm.labs.solutions import CHAPTERS

ROOT = Path(__file__).resolve().parents[2]
CH07 = ROOT / "chapters" / "07_pd_disaggregation.ipynb"
KEY_IMPORT = "from minillm.labs.solutions.ch07 import goodput"
TIMEOUT = 30   # seconds: the looping notebook's, and ample for the others' few seconds

WRONG_GOODPUT = '''def goodput(curve, ttft_slo, tpot_slo, attainment):
    """The highest rate that passes, even above one that fails."""
    ok = [r for r, q in curve
          if sum(a <= ttft_slo and b <= tpot_slo for a, b in q) / len(q) >= attainment]
    return max(ok, default=0.0)'''

FAKE_CHECKERS = '''ch07.check_schedule_step = lambda f: ch07.Result("schedule_step", True, "ok")
ch07.check_goodput = lambda f: print("[PASS] goodput: correct")'''


def chapter_notebook(path: Path) -> Path:
    """Chapter 07's import cell and two of its exercise cells (untouched stubs: the chunked
    step and goodput, which need no model), written to ``path``."""
    source = nbformat.read(CH07, as_version=4)
    cells = [source.cells[1]] + [c for c in source.cells if c.cell_type == "code" and any(
        f"def {name}(" in c.source and f"ch07.check_{name}({name})" in c.source
        for name in ("schedule_step", "goodput"))]
    assert "from minillm.labs import ch07" in cells[0].source and len(cells) == 3
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(c.source) for c in cells]), path)
    return path


def edited(path: Path, out: Path, edit) -> Path:
    """A copy of the notebook at ``path`` whose list of cell sources went through ``edit``."""
    nb = nbformat.read(path, as_version=4)
    sources = edit([c.source for c in nb.cells])
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(s) for s in sources]), out)
    return out


def replace(old: str, new: str):
    """An edit replacing ``old`` by ``new`` in the one cell that holds it."""
    def edit(sources: list[str]) -> list[str]:
        assert sum(old in s for s in sources) == 1, old
        return [s.replace(old, new) for s in sources]
    return edit


@pytest.fixture(scope="module")
def notebooks(tmp_path_factory) -> dict[str, Path]:
    """Student name -> notebook: the stubs, the key, and the key's variations."""
    tmp = tmp_path_factory.mktemp("submissions")
    stub = chapter_notebook(tmp / "stub.ipynb")
    solved = grade.splice_key(stub, tmp / "solved.ipynb")
    return {
        "stub": stub,
        "solved": solved,
        # a chapter's own file name: the student is the folder
        "alice": edited(solved, tmp / "alice" / "07_pd_disaggregation.ipynb",
                        replace(KEY_IMPORT, WRONG_GOODPUT)),
        "cheat": edited(stub, tmp / "cheat.ipynb", lambda s: s[:1] + [FAKE_CHECKERS] + replace(
            "def goodput(curve, ttft_slo, tpot_slo, attainment):\n    raise NotImplementedError",
            WRONG_GOODPUT)(s[1:])),
        # the schedule_step cell raises before its definition; a magic line in goodput's
        "raises": edited(solved, tmp / "raises.ipynb", lambda s: [
            s[0], "raise RuntimeError('a bug before the definition')\n" + s[1],
            "%precision 3\n" + s[2]]),
        "loops": edited(solved, tmp / "loops.ipynb",
                        lambda s: s + ["import time\nwhile True:\n    time.sleep(0.5)"]),
        "dies": edited(solved, tmp / "dies.ipynb", lambda s: s + ["import os\nos._exit(1)"]),
    }


@pytest.fixture(scope="module")
def graded(notebooks) -> dict[str, dict[str, grade.Row]]:
    """Student -> exercise -> row, all but the stubs graded in one call."""
    names = ["solved", "alice", "cheat", "loops", "dies", "raises"]
    rows = grade.grade([notebooks[n] for n in names], timeout=TIMEOUT)
    by_student: dict[str, dict[str, grade.Row]] = {}
    for row in rows:
        by_student.setdefault(row.student, {})[row.exercise] = row
    return by_student


NEVER_CALLED = "the notebook never calls this checker"


def statuses(rows: dict[str, grade.Row]) -> dict[str, str]:
    """Exercise -> status of the exercises the notebook calls (the test notebooks hold two of
    chapter 07's; the chapter's other checkers grade TODO, never called)."""
    assert all(r.status == "TODO" for r in rows.values() if r.message == NEVER_CALLED)
    return {exercise: row.status for exercise, row in rows.items() if row.message != NEVER_CALLED}


def test_find_exercises_reads_the_calls_of_the_chapter_it_imports(notebooks):
    exercises = grade.find_exercises(nbformat.read(notebooks["stub"], as_version=4))
    assert [(e.chapter, e.checker, e.alias, e.call) for e in exercises if e.call] == [
        ("ch07", "check_schedule_step", "ch07", "ch07.check_schedule_step(schedule_step)"),
        ("ch07", "check_goodput", "ch07", "ch07.check_goodput(goodput)")]


def test_splice_key_replaces_the_stubs_by_the_solutions(notebooks):
    sources = [c.source for c in nbformat.read(notebooks["solved"], as_version=4).cells]
    assert "from minillm.labs.solutions.ch07 import schedule_step" in sources[1]
    assert KEY_IMPORT in sources[2] and "NotImplementedError" not in "".join(sources)
    assert sources[2].endswith("ch07.check_goodput(goodput);")


def test_the_key_passes_everything(graded):
    assert statuses(graded["solved"]) == {"schedule_step": "PASS", "goodput": "PASS"}


def test_a_wrong_answer_fails_that_exercise_only(graded):
    assert statuses(graded["alice"]) == {"schedule_step": "PASS", "goodput": "FAIL"}
    assert graded["alice"]["goodput"].message != "correct"


def test_fake_checkers_and_printed_verdicts_are_not_trusted(graded):
    assert statuses(graded["cheat"]) == {"schedule_step": "TODO", "goodput": "FAIL"}


def test_a_cell_that_raises_fails_its_exercise_and_the_rest_is_graded(graded):
    assert statuses(graded["raises"]) == {"schedule_step": "FAIL", "goodput": "PASS"}
    assert graded["raises"]["schedule_step"].message.startswith("NameError")


def test_a_notebook_past_its_time_limit_is_an_error_for_each_exercise(graded):
    assert statuses(graded["loops"]) == {"schedule_step": "ERROR", "goodput": "ERROR"}
    row = graded["loops"]["goodput"]
    assert "time limit" in row.message and TIMEOUT <= row.seconds < TIMEOUT + 60


def test_a_notebook_whose_kernel_dies_is_an_error_for_each_exercise(graded):
    assert statuses(graded["dies"]) == {"schedule_step": "ERROR", "goodput": "ERROR"}
    assert "DeadKernelError" in graded["dies"]["goodput"].message


def test_reports_hold_every_row(graded, tmp_path):
    rows = [row for by_exercise in graded.values() for row in by_exercise.values()]
    csv_path, json_path = grade.write_reports(rows, tmp_path / "out")
    with open(csv_path, newline="") as f:
        assert [dict(r) | {"seconds": float(r["seconds"])} for r in csv.DictReader(f)] == [
            asdict(r) for r in rows]
    assert json.loads(json_path.read_text()) == [asdict(r) for r in rows]
    lines = [line.split() for line in grade.table(rows).splitlines()]
    header = lines[0]
    assert header[0] == "student" and header[-1] == "PASS"
    assert len(header) == len(graded["solved"]) + 2
    solved = dict(zip(header, next(line for line in lines if line[0] == "solved")))
    assert solved["ch07.schedule_step"] == solved["ch07.goodput"] == "PASS"
    assert solved["PASS"] == f"2/{len(graded['solved'])}"


def test_the_command_line_grades_untouched_stubs_as_todo(notebooks, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "minillm.labs", "grade", str(notebooks["stub"]),
                           "--out", str(tmp_path), "--timeout", str(TIMEOUT)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    stub_line = next(line.split() for line in proc.stdout.splitlines()
                     if line.startswith("stub"))
    assert set(stub_line[1:-1]) == {"TODO"} and stub_line[-1].startswith("0/")
    rows = json.loads((tmp_path / "grades.json").read_text())
    assert {r["status"] for r in rows} == {"TODO"}
    assert [r["exercise"] for r in rows if r["message"] != NEVER_CALLED] == ["schedule_step",
                                                                             "goodput"]


@pytest.mark.parametrize("make", [lambda tmp: tmp / "missing.ipynb",
                                  lambda tmp: edited(CH07, tmp / "plain.ipynb",
                                                     lambda s: ["x = 1"])])
def test_the_command_line_names_a_missing_or_exercise_free_notebook(make, tmp_path, capsys):
    path = make(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["grade", str(path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument NOTEBOOK" in err and path.name in err


@functools.cache
def chapter_notebooks() -> dict[str, Path]:
    """chapter -> its committed notebook, found by the chapter it imports."""
    found = {}
    for path in sorted((ROOT / "chapters").glob("*.ipynb")):
        found.update({c: path for c in grade.chapter_aliases(nbformat.read(path, as_version=4))
                      .values()})
    return found


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_chapter_notebook_splices_into_a_key_without_stubs(chapter, tmp_path):
    """Each committed notebook's key imports the chapter's solutions and keeps no stub that a
    checker is given (tests/labs/test_solutions.py checks that it calls every checker)."""
    path = chapter_notebooks()[chapter]
    spliced = nbformat.read(grade.splice_key(path, tmp_path / path.name), as_version=4)
    assert f"from minillm.labs.solutions.{chapter} import " in "\n".join(
        c.source for c in spliced.cells)
    aliases = grade.chapter_aliases(spliced)
    for _, _, tree in grade.code_cells(spliced):
        given = grade.key_imports(tree, aliases)
        assert not [s.name for s in tree.body if getattr(s, "name", None) in given
                    and grade.raises_not_implemented(s)]


def test_a_renamed_stub_imports_the_solution_under_its_own_name(tmp_path):
    stub = tmp_path / "renamed.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in [
        "%load_ext autoreload\nfrom minillm.labs import ch07 as lab",
        "@staticmethod\ndef my_goodput(*args):\n    raise NotImplementedError\n\n\n"
        "lab.check_goodput(my_goodput);"]]), stub)
    spliced = nbformat.read(grade.splice_key(stub, tmp_path / "key.ipynb"), as_version=4)
    assert spliced.cells[1].source == ("from minillm.labs.solutions.ch07 import goodput as "
                                       "my_goodput\n\n\nlab.check_goodput(my_goodput);")


def test_the_student_is_the_file_or_the_folder_of_a_chapter_file():
    assert grade.student_of(Path("in/bob.ipynb")) == "bob"
    assert grade.student_of(Path("in/alice/07_pd_disaggregation.ipynb")) == "alice"
    assert grade.student_of(Path("in/carol/A3_runtimes.ipynb")) == "carol"
