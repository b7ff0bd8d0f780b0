"""The package's layering rule, and ``minillm.kernels`` from a plain checkout.

Core modules and the techniques built on them (parallelism, quantization, speculative decoding,
disaggregation, the server, the runtimes) never import chapter material or tools (training is
chapter material): they must work (and be read) without them. The check reads every import
statement, at module level or inside a function, absolute or relative, and fails naming the
file, the line and the module it reaches.
"""
from __future__ import annotations

import ast
import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minillm"
CORE = ("model", "checkpoint", "attention", "cache", "engine", "sampling", "generate", "config",
        "device", "evaluate", "runinfo")
TECHNIQUES = ("parallel", "quant", "spec", "disagg", "serve", "runtime")
CHAPTER_MATERIAL = ("course", "viz", "bench", "labs", "train", "cli")


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


def core_files(root: Path = PACKAGE, names: tuple[str, ...] = CORE) -> list[Path]:
    files = []
    for name in names:
        files += sorted((root / name).rglob("*.py")) if (root / name).is_dir() \
            else [root / f"{name}.py"]
    return files


def layer_violations(root: Path = PACKAGE) -> list[str]:
    forbidden = tuple(f"minillm.{m}" for m in CHAPTER_MATERIAL)
    bad = []
    for path in core_files(root, CORE + TECHNIQUES):
        for line, module in imported_modules(path):
            if module.startswith(forbidden) and module.split(".")[1] in CHAPTER_MATERIAL:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return bad


def test_every_layered_module_exists():
    files = core_files(PACKAGE, CORE + TECHNIQUES)
    assert all(p.is_file() for p in files), [p for p in files if not p.is_file()]


def test_core_never_imports_chapter_material_or_tools():
    assert layer_violations() == []


@pytest.mark.parametrize("planted", [
    "from ..viz import save\n",                          # relative, module level
    "def f():\n    from minillm.viz import widgets\n",  # absolute, inside a function
    "from .. import labs\n",                             # a package imported as a name
])
@pytest.mark.parametrize("where", ["engine/runner.py", "disagg/worker.py"])
def test_layer_check_sees_a_planted_import(planted, where, tmp_path, monkeypatch):
    """Plant a bad import in a copy of a core module and of a technique's: the check must
    name it."""
    copy = tmp_path / "minillm"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / where
    target.write_text(target.read_text() + "\n" + planted)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    bad = layer_violations(copy)
    assert len(bad) >= 1 and all(where in b for b in bad)


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
