"""``python -m minillm ...``: see :mod:`minillm.cli`."""
import os
import sys

from .cli import main
from .device import emulated_torch_env

missing = emulated_torch_env()          # MINILLM_CPU_ISA: start again with torch's kernels capped
if missing:
    os.execve(sys.executable, [sys.executable, "-m", "minillm", *sys.argv[1:]],
              {**os.environ, **missing})
sys.exit(main())
