"""``python -m minillm ...``: see :mod:`minillm.cli`."""
import sys

from .cli import main

sys.exit(main())
