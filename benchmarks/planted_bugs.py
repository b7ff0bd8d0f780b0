"""Plant known engine bugs one at a time and list the tests that catch each.

    python benchmarks/planted_bugs.py      # about 4 minutes on 2 cores

Each bug is written into the source, the engine tests run, and the file is restored (also when
the run fails or is interrupted). A suite that can see a wrong KV cache fails for every bug.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIFT = "(start > 0 and w.num_tokens > 1)"   # positions of a later chunk moved by one
BUGS = {  # name: (file, text, replacement)
    "attention output zeroed": (
        "minillm/attention/paged.py", "    return out\n\n\ndef _gather",
        "    return torch.zeros_like(out)\n\n\ndef _gather"),
    "first key dropped": (
        "minillm/attention/paged.py", "        seen[n:, 0] = True",
        "        seen[:n, 0] = False\n        seen[n:, 0] = True"),
    "stale block after recompute": (
        "minillm/engine/scheduler.py",
        "            self.blocks.free(s.seq_id)\n            s.num_computed = 0\n",
        "            self.blocks.free(s.seq_id)\n"),
    "off-by-one in a chunk's positions": (
        "minillm/engine/runner.py", "range(start, start + w.num_tokens)",
        f"range(start + {SHIFT}, start + w.num_tokens + {SHIFT})"),
}
TESTS = ["tests/test_engine.py", "tests/test_engine_core.py",
         "tests/test_paged_attention_backend.py"]


def failing_tests(path: Path, text: str, replacement: str) -> tuple[str, list[str]]:
    """(pytest's summary line, the failed tests) with ``text`` replaced in ``path``."""
    original = path.read_text()
    if original.count(text) != 1:
        raise RuntimeError(f"{path}: the text to replace is not there exactly once")
    path.write_text(original.replace(text, replacement))
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "-rf", "--no-header", *TESTS], cwd=ROOT, capture_output=True,
                             text=True, timeout=1500)
    finally:
        path.write_text(original)
    lines = run.stdout.strip().splitlines()
    failed = [line.split(" - ")[0].removeprefix("FAILED ") for line in lines
              if line.startswith("FAILED")]
    return (lines[-1] if lines else run.stderr[-300:]), failed


def main() -> None:
    for name, (file, text, replacement) in BUGS.items():
        summary, failed = failing_tests(ROOT / file, text, replacement)
        print(f"## {name}: {summary}")
        for test in failed:
            print("   ", test)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
