"""The package's layers as a table of allowed package-to-package imports, and ``minillm.kernels``
from a plain checkout.

The core never imports a technique, the techniques never import chapter material or tools, and
no package import cycle exists, lazy imports (inside a function) included. The check reads every
import statement, at module level or inside a function, absolute or relative, and fails naming
the file, the line and the edge that is not in :data:`ALLOWED`, or the packages of a cycle. It
plants a bad edge and a cycle in a copy of the package and must find both.
"""
from __future__ import annotations

import ast
import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minillm"

# The layers, bottom up (a unit is a package or a top-level module of minillm; two subpackages
# are units of their own: training code that serving never imports, and the labs' solutions;
# so are the labs' grader and its command line, which read the solutions the checkers never do).
CORE = ("config", "device", "runinfo", "sampling", "kernels", "attention", "model", "cache",
        "checkpoint", "evaluate", "generate", "engine")
TECHNIQUES = ("spec_decode", "spec_decode.training", "parallel", "disagg", "quant", "train",
              "serve", "runtime", "structured")
TOOLING = ("workloads", "serving_metrics", "driver")
MATERIAL = ("course", "viz", "bench", "labs", "labs.solutions", "labs.grade", "labs.__main__",
            "cli", "__main__", "minillm")

# What each unit may import (besides itself). Anything else is a layering error.
ALLOWED: dict[str, set[str]] = {
    "config": set(),
    "device": set(),
    "runinfo": {"device"},
    "sampling": {"config"},
    "kernels": {"device"},
    "attention": {"device", "kernels"},
    "model": {"attention", "config", "kernels"},
    "cache": {"attention", "config", "device", "model"},
    "checkpoint": {"config", "device", "model"},
    "evaluate": {"cache", "config", "model"},
    "generate": {"cache", "config", "model", "sampling"},
    "engine": {"attention", "cache", "checkpoint", "config", "device", "kernels", "model",
               "sampling"},
    # techniques: the core only (training also reads its package's weights module)
    "spec_decode": {"attention", "cache", "config", "engine", "model"},
    "spec_decode.training": {"checkpoint", "config", "device", "engine", "model", "runinfo",
                             "spec_decode"},
    "parallel": {"attention", "checkpoint", "config", "device", "kernels", "model", "runinfo"},
    "disagg": {"cache", "checkpoint", "config", "device", "engine", "runinfo"},
    "quant": {"checkpoint", "device", "evaluate", "kernels"},
    "train": {"config", "generate", "quant"},
    "serve": {"checkpoint", "config", "device", "engine"},
    "runtime": {"cache", "config", "device", "engine", "model", "sampling"},
    "structured": {"checkpoint", "config", "engine"},
    # shared tooling: workloads, serving metrics, the driver
    "workloads": {"evaluate"},
    "serving_metrics": set(),
    "driver": {"config", "engine", "serving_metrics", "workloads"},
    # chapter material and tools
    "course": {"attention", "cache", "config", "device", "driver", "engine", "model",
               "serving_metrics", "spec_decode", "structured", "workloads"},
    "viz": {"cache", "config", "course", "device", "parallel", "sampling", "spec_decode"},
    "bench": {"cache", "checkpoint", "config", "device", "disagg", "driver", "engine",
              "evaluate", "generate", "model", "quant", "runinfo", "runtime",
              "serving_metrics", "spec_decode", "viz", "workloads"},
    "labs": {"attention", "cache", "checkpoint", "config", "course", "device", "engine", "serve",
             "evaluate", "generate", "model", "parallel", "quant", "runtime", "sampling",
             "serving_metrics", "spec_decode", "spec_decode.training", "structured", "train"},
    "labs.solutions": {"cache", "checkpoint", "course", "device", "labs"},
    "labs.grade": {"labs", "labs.solutions"},
    "labs.__main__": {"labs.grade"},
    "cli": {"bench", "checkpoint", "config", "generate", "serve"},
    "__main__": {"cli", "device"},
    # the top: the public API, and the techniques that register themselves with the core
    "minillm": {"checkpoint", "config", "engine", "model", "quant", "spec_decode", "structured"},
}


def module_name(path: Path) -> str:
    """minillm/engine/engine.py -> minillm.engine.engine (a package's __init__ -> the package)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in the file; ``from . import x`` gives both
    the package and package.x (x may be a submodule)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def unit_of(module: str) -> str | None:
    """The layering unit of a module of minillm (None outside it): minillm.engine.runner ->
    engine; minillm.spec_decode.training.train -> spec_decode.training; minillm -> minillm."""
    parts = module.split(".")
    if parts[0] != "minillm":
        return None
    if len(parts) == 1:
        return "minillm"
    two = ".".join(parts[1:3])
    return two if two in ALLOWED else parts[1]


def import_edges(root: Path = PACKAGE) -> dict[tuple[str, str], list[str]]:
    """(importer unit, imported unit) -> where: "file:line" of each import statement."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        here = unit_of(module_name(path))
        for line, module in imported_modules(path):
            there = unit_of(module)
            if there is not None and there != here:
                edges[here, there].append(f"{path.relative_to(ROOT)}:{line}")
    return edges


def layer_violations(root: Path = PACKAGE) -> list[str]:
    """Every import whose edge the table does not allow."""
    return [f"{where[0]}: {a} imports {b} (not in ALLOWED[{a!r}])"
            for (a, b), where in import_edges(root).items() if b not in ALLOWED.get(a, set())]


def import_cycles(root: Path = PACKAGE) -> list[list[str]]:
    """The package cycles of the import graph: its strongly connected components of two or
    more units (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in import_edges(root):
        graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(list(graph)):
        if v not in index:
            visit(v)
    return cycles


def test_the_table_names_every_unit_in_its_layer():
    layered = CORE + TECHNIQUES + TOOLING + MATERIAL
    assert sorted(layered) == sorted(ALLOWED)
    rank = {u: i for i, layer in enumerate((CORE, TECHNIQUES, TOOLING, MATERIAL)) for u in layer}
    upward = [(a, b) for a, allowed in ALLOWED.items() for b in allowed
              if rank[b] > rank[a] and a != "minillm"]
    assert upward == [], "the table itself allows an import from a lower layer upwards"


def test_every_unit_exists():
    units = {unit_of(module_name(p)) for p in PACKAGE.rglob("*.py")} | {"kernels"}
    assert set(ALLOWED) <= units, sorted(set(ALLOWED) - units)
    assert units <= set(ALLOWED), f"add {sorted(units - set(ALLOWED))} to the table"


def test_every_import_is_allowed():
    assert layer_violations() == []


def test_no_import_cycles():
    assert import_cycles() == []


def _copy_with(tmp_path: Path, plants: dict[str, str], monkeypatch) -> Path:
    """A copy of the package with ``plants[file]`` appended to each file."""
    copy = tmp_path / "minillm"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "weights"))
    for where, code in plants.items():
        target = copy / where
        target.write_text(target.read_text() + "\n" + code)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    return copy


@pytest.mark.parametrize("planted", [
    "from ..viz import save\n",                          # relative, module level
    "def f():\n    from minillm.viz import widgets\n",  # absolute, inside a function
    "from .. import labs\n",                             # a package imported as a name
])
@pytest.mark.parametrize("where", ["engine/runner.py", "disagg/worker.py"])
def test_layer_check_sees_a_planted_import(planted, where, tmp_path, monkeypatch):
    """Plant a bad import in a copy of a core module and of a technique's: the check must
    name it."""
    bad = layer_violations(_copy_with(tmp_path, {where: planted}, monkeypatch))
    assert len(bad) >= 1 and all(where in b for b in bad)


def test_cycle_check_sees_a_planted_cycle(tmp_path, monkeypatch):
    """Serving importing the drafters' training code lazily (training imports serving): the
    edge is not allowed and it closes a cycle."""
    plant = "def f():\n    from .training import train\n"
    copy = _copy_with(tmp_path, {"spec_decode/speculator.py": plant}, monkeypatch)
    assert import_cycles(copy) == [["spec_decode", "spec_decode.training"]]
    assert any("spec_decode imports spec_decode.training" in b for b in layer_violations(copy))


def _import_kernels_from_root(pythonpath: str | None = None) -> subprocess.CompletedProcess:
    """``import kernels`` run the way ``python -c``/``python -m`` run from the repository root:
    the root is first on sys.path, so our ``kernels/`` folder is what the import finds first."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    code = ("import kernels, minillm.kernels; print(kernels.__file__); "
            "print(getattr(kernels, 'MARK', ''))")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_top_level_kernels_hands_over_to_the_pypi_package(tmp_path):
    """A stand-in for the PyPI ``kernels`` behind the root on sys.path wins the top-level name."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("MARK = 'pypi'\n")
    proc = _import_kernels_from_root(str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(tmp_path / "kernels" / "__init__.py"), "pypi"]


@pytest.mark.slow
def test_transformers_imports_from_the_repository_root():
    """transformers >= 5.25 depends on the PyPI ``kernels`` and imports it with its models."""
    code = "from transformers import LlamaForCausalLM; import kernels; print(kernels.__file__)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return  # no PyPI package: ours stays, and transformers finds no version to use
    assert Path(proc.stdout.split()[-1]).parent != ROOT / "kernels"


def _run_from_plain_checkout(tmp_path: Path, code: str) -> subprocess.CompletedProcess:
    """Run ``code`` against a copy of minillm/ and kernels/ with no install in sight: ``-S``
    skips site-packages' .pth files (the editable install's finder); the dependencies are put
    on the path by hand."""
    for folder in ("minillm", "kernels"):
        shutil.copytree(ROOT / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    site = sysconfig.get_paths()["purelib"]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{site}"}
    return subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_kernels_import_from_a_plain_checkout(tmp_path):
    code = ("import minillm, minillm.device; minillm.device.setup_triton(); "
            "import minillm.kernels.flash_attention as fa; print(fa.__file__)")
    proc = _run_from_plain_checkout(tmp_path, code)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == tmp_path / "kernels" / "flash_attention.py"


def test_pyproject_lists_every_subpackage():
    """A folder missing from pyproject's ``packages`` works in an editable install and is
    silently left out of a wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {module_name(p) for p in PACKAGE.rglob("__init__.py")} | {"minillm.kernels"}
    assert found - listed == set(), f"add {sorted(found - listed)} to pyproject's packages"
