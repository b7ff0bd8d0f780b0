"""MINILLM_CPU_ISA=avx2: the flags the package sees, the kernels' build, torch restarted capped.

The kernel check disassembles the library built under the variable: an AVX2-only CPU would
fault on any AVX-512 instruction, so not one zmm register may appear in it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from minillm.kernels import cpu_build

from minillm import device


@pytest.fixture
def avx2(monkeypatch):
    monkeypatch.setenv(device.CPU_ISA_ENV, "avx2")


def test_the_flags_are_capped_to_avx2(avx2, tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags : fpu avx2 fma avx512f avx512_bf16 avx512_vnni "
                    "avx_vnni amx_tile\n")
    monkeypatch.setattr(device, "CPUINFO", str(info))
    assert device.cpu_features() == {"avx2", "fma"}
    monkeypatch.delenv(device.CPU_ISA_ENV)
    assert {"avx512f", "avx512_bf16", "amx_tile"} <= device.cpu_features()


def test_an_unknown_isa_is_named(monkeypatch):
    monkeypatch.setenv(device.CPU_ISA_ENV, "avx3")
    with pytest.raises(ValueError, match="MINILLM_CPU_ISA must be one of"):
        device.cpu_features()


def test_torch_is_restarted_only_without_its_caps(avx2, monkeypatch):
    for name in device.EMULATED_TORCH_ENV["avx2"]:
        monkeypatch.delenv(name, raising=False)
    assert device.emulated_torch_env() == device.EMULATED_TORCH_ENV["avx2"]
    for name, value in device.EMULATED_TORCH_ENV["avx2"].items():
        monkeypatch.setenv(name, value)
    assert device.emulated_torch_env() == {}
    monkeypatch.delenv(device.CPU_ISA_ENV)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    assert device.emulated_torch_env() == {}


def test_kernels_are_built_without_avx512(avx2, tmp_path):
    if not shutil.which("objdump"):
        pytest.skip("needs objdump")
    assert cpu_build.isa_flags() == ("-mno-avx512f", "-mno-avxvnni")
    code = ("from minillm.kernels import cpu_paged_attention as k\n"
            "assert k.available(), k.unavailable_reason()\n"
            "print(k.LIBRARY.get()._name)")
    env = {**os.environ, "MINILLM_CACHE": str(tmp_path)}
    lib = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    listing = subprocess.run(["objdump", "-d", lib], capture_output=True, text=True,
                             check=True).stdout
    assert "vdpbf16ps" not in listing and "%zmm" not in listing


def test_the_caps_cap_torch():
    """The variables ``python -m minillm`` restarts with hold this torch's kernels at AVX2."""
    env = {**os.environ, **device.EMULATED_TORCH_ENV["avx2"]}
    out = subprocess.run([sys.executable, "-c", "import torch; "
                          "print(torch.backends.cpu.get_cpu_capability())"],
                         env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out[-1] in ("AVX2", "DEFAULT"), out
