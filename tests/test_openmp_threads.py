"""release_openmp_threads: the calling thread's OpenMP workers really go away, and parallel
operators started afterwards (on this thread or another) still compute the right thing."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, threading, time, torch
    from minillm.device import release_openmp_threads
    torch.set_num_threads(2)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    ref = (a.double() @ b.double()).float()
    def tasks():
        return len(os.listdir("/proc/self/task"))
    a @ b                                   # starts this thread's OpenMP team
    before = tasks()
    released = release_openmp_threads()
    deadline = time.monotonic() + 5.0       # the worker is told to exit, and exits soon after
    while tasks() >= before and time.monotonic() < deadline:
        time.sleep(0.01)
    after = tasks()
    ok = torch.allclose(a @ b, ref, atol=1e-3)     # a new team, same result
    out = {}
    t = threading.Thread(target=lambda: out.update(ok=torch.allclose(a @ b, ref, atol=1e-3)))
    t.start(); t.join()
    print(released, before, after, ok, out["ok"])
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or (os.cpu_count() or 1) < 2,
                    reason="needs Linux (/proc) and two cores")
def test_release_frees_the_callers_workers_and_compute_stays_right():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    released, before, after, ok_here, ok_thread = out
    assert released == "True"
    assert int(after) == int(before) - 1          # the one worker of a 2-thread team is gone
    assert ok_here == "True" and ok_thread == "True"
