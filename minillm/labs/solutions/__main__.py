"""``python -m minillm.labs.solutions [chapter ...]``: every checker against its reference."""
import sys

from . import CHAPTERS, run

results = run(sys.argv[1:] or CHAPTERS)
failed = [r for r in results if r.passed is not True]
print(f"{len(results) - len(failed)} of {len(results)} reference solutions pass")
sys.exit(1 if failed else 0)
