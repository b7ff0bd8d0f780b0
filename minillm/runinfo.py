"""Where and when a measurement ran: the machine, the commit, the software; and a free port.

One home for what every benchmark, training script and test records or needs:
:func:`machine_info` (device, CPU model and flags, cores, threads, versions, date, commit) for
JSON reports, :func:`git_commit`, :func:`device_name`, and :func:`free_port` for servers and
``torch.distributed`` groups started on this machine.
"""
from __future__ import annotations

import datetime
import os
import platform
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch

from .device import cpu_features, emulated_isa

ROOT = Path(__file__).resolve().parents[1]


def available_cores() -> int:
    """CPU cores this process may run on (the container's share, not the host's)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_model() -> str:
    """The CPU model from /proc/cpuinfo (else what ``platform`` says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()


def git_commit(short: bool = False, dirty: Sequence[str] = ()) -> str | None:
    """``git rev-parse HEAD`` of the repository (abbreviated with ``short``), or None outside
    one; ``+dirty`` is appended when any of the paths ``dirty`` has uncommitted changes."""
    try:
        out = subprocess.run(["git", "rev-parse", *(["--short"] if short else []), "HEAD"],
                             cwd=ROOT, capture_output=True, text=True, timeout=10, check=True)
        commit = out.stdout.strip() or None
        if commit and dirty:
            status = subprocess.run(["git", "status", "--porcelain", "--", *dirty], cwd=ROOT,
                                    capture_output=True, text=True, timeout=10, check=True)
            commit += "+dirty" if status.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        return None
    return commit


def package_version(name: str) -> str | None:
    """Installed version of a distribution, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def machine_info(device: torch.device, threads: int) -> dict:
    """Where and when the numbers were measured (with the matmul-relevant CPU flags on a CPU)."""
    return {
        "device": device_name(device), "device_type": device.type,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": package_version("transformers"),
        "llama_cpp_python": package_version("llama_cpp_python"), "threads": threads,
        "cores": available_cores(),
        "cpu_flags": sorted(cpu_features()) if device.type == "cpu" else None,
        **({"emulated_isa": emulated_isa(), "emulated_isa_note": "an AVX2-only CPU's paths on "
            "this one: C++ kernels built without AVX-512 and VNNI, ATEN_CPU_CAPABILITY="
            f"{os.environ.get('ATEN_CPU_CAPABILITY')}, ONEDNN_MAX_CPU_ISA="
            f"{os.environ.get('ONEDNN_MAX_CPU_ISA')}"} if emulated_isa() else {})}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


__all__ = ["available_cores", "cpu_model", "device_name", "git_commit", "package_version",
           "machine_info", "free_port"]
