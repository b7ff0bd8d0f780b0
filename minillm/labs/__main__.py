"""``python -m minillm.labs grade|key ...``: the teacher's tools (see :mod:`minillm.labs.grade`).

- ``grade SUBMISSION.ipynb [...] [--out DIR] [--timeout SECONDS] [--fast/--no-fast]``: run each
  notebook, grade its exercises, write ``grades.csv`` and ``grades.json`` to ``--out`` and print
  a table of students by exercises.
- ``key NOTEBOOK.ipynb OUT.ipynb``: write a copy of a chapter's notebook with every exercise's
  stub replaced by an import of its reference solution.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .grade import grade, splice_key, table, write_reports


def parser() -> argparse.ArgumentParser:
    """The ``grade`` and ``key`` subcommands and their arguments."""
    p = argparse.ArgumentParser(prog="python -m minillm.labs", description="Grade students' "
                                "notebooks, or write a chapter notebook's key.")
    commands = p.add_subparsers(dest="command", required=True)
    g = commands.add_parser("grade", help="grade students' notebooks")
    g.add_argument("notebooks", metavar="NOTEBOOK", type=Path, nargs="+",
                   help="students' notebooks (.ipynb)")
    g.add_argument("--out", metavar="DIR", type=Path, default=Path("."),
                   help="folder for grades.csv and grades.json (default: the current one)")
    g.add_argument("--timeout", metavar="SECONDS", type=float, default=900,
                   help="seconds each notebook may run, in all (default: %(default)g)")
    g.add_argument("--fast", action=argparse.BooleanOptionalAction, default=True,
                   help="run the notebooks with MINILLM_FAST=1 (default: on)")
    k = commands.add_parser("key", help="write a notebook with the reference solutions spliced in")
    k.add_argument("notebook", metavar="NOTEBOOK", type=Path, help="a chapter's notebook")
    k.add_argument("out", metavar="OUT", type=Path, help="where to write the key notebook")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; a missing file or a notebook without exercises is an argparse error
    (exit code 2) naming the argument."""
    p = parser()
    args = p.parse_args(argv)
    if args.command == "key":
        if not args.notebook.is_file():
            p.error(f"argument NOTEBOOK: no such file: {args.notebook}")
        print(f"wrote {splice_key(args.notebook, args.out)}")
        return 0
    try:
        rows = grade(args.notebooks, args.timeout, args.fast)
    except (FileNotFoundError, ValueError) as e:
        p.error(f"argument NOTEBOOK: {e}")
    print(table(rows))
    csv_path, json_path = write_reports(rows, args.out)
    print(f"wrote {csv_path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
