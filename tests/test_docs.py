"""The documentation: docs/results.md and the README's headline table are exactly what
``benchmarks/make_results.py`` generates from the committed JSON in benchmarks/results/; the
README stays a short front door; every relative link in README.md and docs/*.md resolves; no
page carries stale wording (issue numbers, "target met" or "previous run" stories).

Each check is a function of a folder that returns its problems, so that the tests below also
run it on an edited copy in a temporary folder and see it fail. Nothing here writes to the
repository; after a benchmark writes new JSON, ``make results`` brings the pages up to date.
"""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_README_LINES = 250
BANNED = ("issue #", "target met", "targets met", "previous run")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def load_generator():
    """benchmarks/make_results.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("make_results",
                                                  ROOT / "benchmarks" / "make_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = load_generator()


def doc_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


# ----------------------------------------------------------------------------- the checks

def stale_pages(root: Path) -> list[str]:
    """Where docs/results.md or the README's headline block differ from what the generator
    makes of ``root``'s benchmarks/results/*.json."""
    results = gen.load_results(root / "benchmarks" / "results")
    problems = []
    page = root / "docs" / "results.md"
    if not page.is_file() or page.read_text() != gen.render_results(results):
        problems.append("docs/results.md is not what benchmarks/make_results.py generates from "
                        "benchmarks/results/*.json: run `make results`")
    try:
        block = gen.readme_block((root / "README.md").read_text())
    except ValueError as e:
        return problems + [str(e)]
    if block != gen.render_headline(results):
        problems.append("README.md's headline table is not what benchmarks/make_results.py "
                        "generates: run `make results`")
    return problems


def readme_too_long(root: Path) -> list[str]:
    n = len((root / "README.md").read_text().splitlines())
    return [f"README.md has {n} lines, more than {MAX_README_LINES}: move the detail into "
            "docs/"] if n > MAX_README_LINES else []


def relative_links(text: str) -> list[str]:
    """Link and image targets outside fenced code blocks, without #anchors; web links, mail
    links and links within the page left out."""
    targets = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def broken_links(root: Path) -> list[str]:
    problems = []
    for page in doc_files(root):
        for target in relative_links(page.read_text()):
            if not (page.parent / target).exists():
                problems.append(f"{page.relative_to(root)}: {target} does not exist")
    return problems


def banned_wording(root: Path) -> list[str]:
    problems = []
    for page in doc_files(root):
        text = page.read_text().lower()
        problems += [f"{page.relative_to(root)} says {phrase!r}" for phrase in BANNED
                     if phrase in text]
    return problems


# ----------------------------------------------------------------------------- the repository

def test_results_page_and_readme_block_are_generated_from_the_json():
    assert stale_pages(ROOT) == []


def test_readme_is_a_front_door():
    assert readme_too_long(ROOT) == []


def test_every_relative_link_resolves():
    assert sum(len(relative_links(p.read_text())) for p in doc_files(ROOT)) > 50  # not vacuous
    assert broken_links(ROOT) == []


def test_no_page_carries_stale_wording():
    assert banned_wording(ROOT) == []


def test_the_generator_needs_neither_torch_nor_minillm():
    """It runs in `make results` and in this test without the package's dependencies."""
    source = (ROOT / "benchmarks" / "make_results.py").read_text()
    assert not re.search(r"^\s*(import|from)\s+(torch|minillm)\b", source, re.M)


def test_the_headline_table_has_at_most_eight_rows():
    block = gen.readme_block((ROOT / "README.md").read_text())
    rows = [line for line in block.splitlines() if line.startswith("| ")]
    assert 2 <= len(rows) <= 2 + 8          # header, rule, at most eight results


def test_the_serving_row_counts_slo_requests_unless_neither_server_meets_any():
    """At a rate that saturates both servers no request meets the SLOs: the row then compares
    throughput and says so, instead of "0.00 vs 0.00"."""
    results = gen.load_results(ROOT / "benchmarks" / "results")
    runs = results["serve_rate16"]["servers"]

    def serving_row():
        return next(r for r in gen.headline_rows(results) if r[-1] == "serve_rate16")
    for server in ("minillm", "vllm"):
        runs[server]["runs"][-1]["slo_met_per_s"] = 0.0
    assert "saturates both" in serving_row()[0] and "SLOs per s" not in serving_row()[0]
    runs["minillm"]["runs"][-1]["slo_met_per_s"] = 1.5
    assert "SLOs per s" in serving_row()[0] and serving_row()[1].startswith("1.50")


# ----------------------------------------------------------------------------- each check fails

@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """The pages and the JSON they are made from, in a temporary folder."""
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copytree(ROOT / "benchmarks" / "results", tmp_path / "benchmarks" / "results")
    return tmp_path


def test_a_changed_measurement_makes_both_pages_stale(copy):
    assert stale_pages(copy) == []
    path = copy / "benchmarks" / "results" / "decode.json"
    data = json.loads(path.read_text())
    data["results"][0]["decode_tok_s"] *= 2           # a rerun that moved a headline number
    path.write_text(json.dumps(data))
    problems = stale_pages(copy)
    assert len(problems) == 2 and "docs/results.md" in problems[0] and "README" in problems[1]


def test_a_hand_edited_page_is_stale(copy):
    page = copy / "docs" / "results.md"
    text = page.read_text()
    digit = re.search(r"\| (\d)", text)
    page.write_text(text[:digit.start(1)] + str((int(digit[1]) + 1) % 10) +
                    text[digit.end(1):])
    assert stale_pages(copy) == ["docs/results.md is not what benchmarks/make_results.py "
                                 "generates from benchmarks/results/*.json: run `make results`"]


def test_a_hand_edited_or_missing_readme_block_is_caught(copy):
    readme = copy / "README.md"
    text = readme.read_text()
    edited = text.replace(gen.END, "| a row typed by hand |\n" + gen.END)
    readme.write_text(edited)
    assert len(stale_pages(copy)) == 1
    readme.write_text(text.replace(gen.BEGIN, ""))
    assert "markers" in stale_pages(copy)[0]


def test_a_long_readme_is_caught(copy):
    readme = copy / "README.md"
    readme.write_text("line\n" * MAX_README_LINES)
    assert readme_too_long(copy) == []
    readme.write_text("line\n" * (MAX_README_LINES + 1))
    assert len(readme_too_long(copy)) == 1


def test_a_broken_link_is_caught_and_anchors_and_web_links_are_not(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "[up](../README.md#top) [web](https://example.com/x) [here](#section) "
        "![figure](../missing.png) [gone](b.md#part)\n"
        "```python\nx = y[0](1)  [not](a-link.md)\n```\n")
    (tmp_path / "README.md").write_text("[docs](docs/a.md#intro) [nothing](docs/nothing.md)\n")
    assert broken_links(tmp_path) == ["README.md: docs/nothing.md does not exist",
                                      "docs/a.md: ../missing.png does not exist",
                                      "docs/a.md: b.md does not exist"]


def test_stale_wording_is_caught_in_any_case(copy):
    assert banned_wording(copy) == []
    (copy / "docs" / "extra.md").write_text("Fixed in Issue #12; the target met its aim.\n")
    (copy / "README.md").write_text("As the Previous Run showed, both targets met.\n")
    assert sorted(banned_wording(copy)) == [
        "README.md says 'previous run'", "README.md says 'targets met'",
        "docs/extra.md says 'issue #'", "docs/extra.md says 'target met'"]
