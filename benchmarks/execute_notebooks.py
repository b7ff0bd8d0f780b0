"""Execute chapters in place (what `make notebooks` runs) and record how long each took.

    python benchmarks/execute_notebooks.py [chapters/01_transformers.ipynb ...] [--fast]

Each notebook runs top to bottom in its own kernel, its outputs are written back (unless
``--fast``: MINILLM_FAST=1 runs are for timing only and leave the file alone), and one row per
notebook goes to ``benchmarks/results/notebooks.json`` (merged with the rows already there): wall
seconds, the load average before and after, the output size, the CPU, the date and the commit.
A chapter should take at most 5 minutes at full size and 90 s under MINILLM_FAST=1 on 2 cores; a
load average above 1.5 means the machine was not quiet and the timings (and the notebook's
own measurements) should be taken again.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from minillm.labs.kernel_wakeup import install as install_kernel_wakeup
from minillm.runinfo import cpu_model

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "notebooks.json"
LIMITS_S = {"full": 300, "fast": 90}


def settle(below: float = 1.0, most_s: float = 120.0) -> None:
    """Wait (at most ``most_s``) for the 1-minute load average to fall below ``below``: the
    previous notebook's own run keeps it high for a minute after it ends."""
    start = time.perf_counter()
    while os.getloadavg()[0] >= below and time.perf_counter() - start < most_s:
        time.sleep(5)


def execute(path: Path, fast: bool, timeout_s: int) -> dict:
    """Run one notebook (in its folder, so relative paths work) once the load has settled;
    -> its row."""
    settle()
    if fast:
        os.environ["MINILLM_FAST"] = "1"       # the kernel inherits this process's environment
    else:
        os.environ.pop("MINILLM_FAST", None)
    install_kernel_wakeup()
    nb = nbformat.read(path, as_version=4)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    seconds = time.perf_counter() - start
    if not fast:
        nbformat.write(nb, path)
    mode = "fast" if fast else "full"
    return {"notebook": path.name, "mode": mode, "seconds": round(seconds, 1),
            "limit_s": LIMITS_S[mode], "within_limit": seconds <= LIMITS_S[mode],
            "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
            "size_kb": round(path.stat().st_size / 1024) if not fast else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--fast", action="store_true", help="MINILLM_FAST=1, outputs not saved")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per cell")
    args = parser.parse_args()
    paths = args.notebooks or sorted((ROOT / "chapters").glob("*.ipynb"))
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"runs": []}
    runs = {(r["notebook"], r["mode"]): r for r in old["runs"]}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    for path in paths:
        row = execute(path.resolve(), args.fast, args.timeout)
        row.update(date=datetime.date.today().isoformat(), git_commit=commit,
                   cpu=cpu_model(), cores=os.cpu_count())
        runs[(row["notebook"], row["mode"])] = row
        print(f"{row['notebook']:<32} {row['mode']:<4} {row['seconds']:7.1f} s "
              f"(limit {row['limit_s']} s), load {row['load_before']:.2f} -> "
              f"{row['load_after']:.2f}", flush=True)
        RESULTS.write_text(json.dumps({"benchmark": "notebooks",
                                       "runs": sorted(runs.values(), key=lambda r: (
                                           r["notebook"], r["mode"]))}, indent=1) + "\n")


if __name__ == "__main__":
    main()
