"""Compile a C++ source with the machine's compiler and load it with ctypes (the CPU kernels).

The library is built on first use (``-O3 -march=native -fopenmp``, about a second) into a cache
folder (``$MINILLM_CACHE`` or ``~/.cache/minillm``) under a name keyed by the source, the
compiler, the flags and the CPU, so a changed source, compiler or machine builds afresh and a
second process loads the first one's file. OpenMP is the ``libgomp`` torch has loaded, so the
kernels' threads are PyTorch's own. ``SCALARS`` is the C++ the kernels share: bfloat16 <-> float32
and an exp of their own that vectorises. Each kernel's own C++ is a ``.cpp`` file beside its
module (``cpu_fused_ops.cpp`` beside ``cpu_fused_ops.py``, ...), whose source is ``SCALARS`` +
the file's text; a library that names its file (``source_file``) is compiled with a ``#line``
marker where that text begins, so the compiler's messages give the file's own path and lines.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import record_function

SCALARS = r"""
#include <cmath>
#include <cstdint>
#include <cstring>

static inline float widen(float x) { return x; }
static inline float widen(uint16_t x) {            // bfloat16 -> float32: the high half
    uint32_t u = (uint32_t)x << 16; float f; std::memcpy(&f, &u, 4); return f;
}
static inline void narrow(float x, float* y) { *y = x; }
static inline void narrow(float x, uint16_t* y) {  // float32 -> bfloat16, round to nearest even
    uint32_t u; std::memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) { *y = 0x7fc0; return; }   // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u); *y = (uint16_t)(u >> 16);
}

// exp(x) for x <= 0: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor series to r^7
// (error below 2e-8), 2^n put into the exponent bits. n is rounded by adding 1.5 * 2^23 (whose
// low mantissa bits then hold it), so the function is plain arithmetic and loops vectorise.
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float magic = 12582912.0f;
    const float t = x * 1.44269504088896341f + magic, n = t - magic;
    int32_t bits;
    std::memcpy(&bits, &t, 4);
    const int32_t ni = bits - 0x4B400000;
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f; p = p * r + 1.0f / 120.0f; p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f; p = p * r + 0.5f; p = p * r + 1.0f; p = p * r + 1.0f;
    std::memcpy(&bits, &p, 4);
    bits += ni * (1 << 23);
    std::memcpy(&p, &bits, 4);
    return p;
}
"""

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
# Under MINILLM_CPU_ISA=avx2 (minillm.device.emulated_isa) the kernels are built as for an
# AVX2-only CPU: -march=native less every AVX-512 and VNNI extension.
ISA_FLAGS = {"avx2": ("-mno-avx512f", "-mno-avxvnni")}


def isa_flags() -> tuple[str, ...]:
    from minillm.device import emulated_isa

    isa = emulated_isa()
    return ISA_FLAGS[isa] if isa else ()


def cache_dir() -> Path:
    root = os.environ.get("MINILLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "minillm")
    return Path(root) / "cpu_kernels"


def cpu_signature() -> str:
    """What -march=native compiles for: the CPU model and flags (Linux), else the platform."""
    try:
        info = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
        return "\n".join(ln for ln in info.splitlines() if ln.startswith(("model name", "flags")))
    except OSError:
        return platform.processor() + platform.machine()


def _marked(source: str, source_file: str | Path | None) -> str:
    """``source`` as compiled: where the text of ``source_file`` begins (``source`` ends with
    it), a ``#line 1 "<file>"`` marker, so that a diagnostic's file:line is the .cpp file's
    own. ``source`` unchanged when there is no file or it no longer holds that text."""
    if source_file is None:
        return source
    path = Path(source_file).resolve()
    try:
        text = path.read_text()
    except OSError:
        return source
    if not text or not source.endswith(text):
        return source
    prelude = source[:len(source) - len(text)]
    if prelude and not prelude.endswith("\n"):
        prelude += "\n"
    quoted = str(path).replace("\\", "\\\\").replace('"', '\\"')
    return f'{prelude}#line 1 "{quoted}"\n{text}'


def build(name: str, source: str, extra_flags: tuple[str, ...] = (),
          source_file: str | Path | None = None) -> tuple[ctypes.CDLL | None, str]:
    """Compile ``source`` (once per source, compiler, flags and CPU) and load it: (library, '')
    or (None, why not: no compiler, or its error message). ``source_file``: the .cpp file whose
    text ends ``source``; the compiler's messages then name it and its lines (the cache key is
    the source alone)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None or shutil.which(compiler) is None:
        return None, f"no C++ compiler: {compiler or 'g++ or $CXX'} not found"
    flags = [*FLAGS, *isa_flags(), *extra_flags]
    key = hashlib.sha256("\0".join([source, compiler, *flags, cpu_signature()]).encode())
    path = cache_dir() / f"{name}_{key.hexdigest()[:16]}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            src, lib = Path(tmp) / f"{name}.cpp", Path(tmp) / "lib.so"
            src.write_text(_marked(source, source_file))
            done = subprocess.run([compiler, *flags, str(src), "-o", str(lib)],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                return None, f"{compiler} failed: {done.stderr.strip()[-500:]}"
            os.replace(lib, path)             # atomic: concurrent builders agree
    return ctypes.CDLL(str(path)), ""


class Library:
    """A C++ source built and loaded on first use. ``signatures``: exported function ->
    ctypes argument types (each returns void). ``source_file``: the .cpp file that ``source``
    ends with (see :func:`build`). :meth:`get` gives the library or None; :meth:`reason` says
    why it is None ('' when it is not)."""

    def __init__(self, name: str, source: str, signatures: dict[str, list],
                 extra_flags: tuple[str, ...] = (),
                 source_file: str | Path | None = None) -> None:
        self.name, self.source, self.signatures = name, source, signatures
        self.extra_flags, self.source_file = extra_flags, source_file
        self.clear()

    def clear(self) -> None:
        """Forget the loaded library (a test that changes the compiler rebuilds it)."""
        self._loaded: tuple[ctypes.CDLL | None, str] | None = None

    def get(self) -> ctypes.CDLL | None:
        if self._loaded is None:
            lib, why = build(self.name, self.source, self.extra_flags, self.source_file)
            for fn_name, argtypes in self.signatures.items() if lib is not None else ():
                fn = getattr(lib, fn_name)
                fn.restype, fn.argtypes = None, argtypes
            self._loaded = lib, why
        return self._loaded[0]

    def reason(self) -> str:
        self.get()
        return self._loaded[1]


Call = tuple[Callable[..., None], str, tuple]     # a function, its name, its arguments
_recording: list[Call] | None = None


def profiled_call(fn, name: str, *args) -> None:
    """``fn(*args)`` (a C++ function, or a Python one a recorded step must replay too, such as
    ``cpu_forward._add_into``), shown as a row ``minillm::<name>`` of torch.profiler's table
    while the profiler records (the annotation costs ~30 us a call, so only then), and
    appended to the list of :func:`recording_calls` while one is open."""
    if _recording is not None:
        _recording.append((fn, name, args))
    if torch.autograd.profiler._is_profiler_enabled:
        with record_function(f"minillm::{name}"):
            fn(*args)
    else:
        fn(*args)


@contextmanager
def recording_calls() -> Iterator[list[Call]]:
    """Within it, every C++ call made through :func:`profiled_call` runs and is also appended,
    as (function, name, arguments), to the list it yields: a recording that
    :func:`replay_calls` runs again, the same functions with the same pointers and sizes (the
    caller keeps every tensor those pointers name alive and at its place). One at a time."""
    global _recording
    if _recording is not None:
        raise RuntimeError("recording_calls: a recording is already open")
    _recording = calls = []
    try:
        yield calls
    finally:
        _recording = None


def replay_calls(calls: list[Call]) -> None:
    """Run a recording of :func:`recording_calls` again, call by call (a profiler sees each)."""
    if torch.autograd.profiler._is_profiler_enabled or _recording is not None:
        for fn, name, args in calls:
            profiled_call(fn, name, *args)
    else:
        for fn, _, args in calls:
            fn(*args)
