"""fastest_cpu_dtype: the environment override, the flag rule, the measured probe and its cache."""
from __future__ import annotations

import pytest
import torch

from minillm import device


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """No override from the caller's shell, and no decision cached from another test."""
    monkeypatch.delenv(device.CPU_DTYPE_ENV, raising=False)
    device._choose_cpu_dtype.cache_clear()
    yield
    device._choose_cpu_dtype.cache_clear()


def fake_timings(monkeypatch, fp32_s: float, bf16_s: float) -> list:
    """Replace the probe's timer with fixed seconds per dtype; returns the list of calls."""
    calls = []

    def timer(dtype, **kwargs):
        calls.append(dtype)
        return {torch.float32: fp32_s, torch.bfloat16: bf16_s}[dtype]

    monkeypatch.setattr(device, "_time_linear", timer)
    return calls


@pytest.mark.parametrize("value, dtype", [("float32", torch.float32),
                                          ("bfloat16", torch.bfloat16)])
def test_override_wins_over_probe(monkeypatch, value, dtype):
    calls = fake_timings(monkeypatch, fp32_s=1.0, bf16_s=1.0)
    monkeypatch.setenv("MINILLM_CPU_DTYPE", value)
    for probe in (True, False):
        got, reason = device.fastest_cpu_dtype(probe=probe)
        assert got == dtype and "MINILLM_CPU_DTYPE" in reason
    assert calls == []


@pytest.mark.parametrize("value", ["bf16", "float16", "FLOAT32", "fast"])
def test_bad_override_names_variable_and_choices(monkeypatch, value):
    monkeypatch.setenv("MINILLM_CPU_DTYPE", value)
    with pytest.raises(ValueError, match="MINILLM_CPU_DTYPE") as err:
        device.fastest_cpu_dtype()
    assert "float32" in str(err.value) and "bfloat16" in str(err.value)


def test_flag_rule_avx2_only_is_float32(monkeypatch):
    monkeypatch.setattr(device, "cpu_features", lambda: {"avx2"})
    dtype, reason = device.fastest_cpu_dtype(probe=False)
    assert dtype == torch.float32 and "avx2" in reason


@pytest.mark.parametrize("flags", [{"avx2", "avx512f", "avx512_bf16"},
                                   {"avx2", "avx512f", "amx_tile", "amx_bf16"}])
def test_flag_rule_native_bf16_is_bfloat16(monkeypatch, flags):
    monkeypatch.setattr(device, "cpu_features", lambda: flags)
    dtype, reason = device.fastest_cpu_dtype(probe=False)
    assert dtype == torch.bfloat16 and "bf16" in reason


def test_flag_rule_without_flags_is_float32(monkeypatch):
    monkeypatch.setattr(device, "cpu_features", set)
    assert device.fastest_cpu_dtype(probe=False)[0] == torch.float32


@pytest.mark.parametrize("fp32_s, bf16_s, want", [
    (8e-3, 1e-3, torch.bfloat16),      # AMX-like: bf16 much faster
    (1e-3, 8e-3, torch.float32),       # AVX2-like: bf16 much slower
    (1.1e-3, 1e-3, torch.float32),     # 1.1x is not clearly faster
])
def test_probe_picks_the_faster_dtype(monkeypatch, fp32_s, bf16_s, want):
    fake_timings(monkeypatch, fp32_s, bf16_s)
    monkeypatch.setattr(device, "cpu_features", lambda: {"avx2"})   # flags must not decide
    dtype, reason = device.fastest_cpu_dtype()
    assert dtype == want
    assert "probe" in reason and f"{fp32_s * 1e3:.3f} ms" in reason
    assert ("bf16 faster" in reason) == (want == torch.bfloat16)


def test_probe_runs_once_per_process(monkeypatch):
    calls = fake_timings(monkeypatch, fp32_s=2e-3, bf16_s=1e-3)
    first = device.fastest_cpu_dtype()
    assert device.fastest_cpu_dtype() == first and device.fastest_cpu_dtype(probe=True) == first
    assert sorted(calls, key=str) == [torch.bfloat16, torch.float32]


def test_cpu_features_reads_cpuinfo(monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 amx_tile\n")
    monkeypatch.setattr(device, "CPUINFO", str(info))
    assert device.cpu_features() == {"avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"}


def test_machine_info_records_the_cpu_flags(monkeypatch, tmp_path):
    from minillm.runinfo import machine_info

    info = tmp_path / "cpuinfo"
    info.write_text("flags\t\t: fpu avx2 avx512_bf16 sse2\n")
    monkeypatch.setattr(device, "CPUINFO", str(info))
    assert machine_info(torch.device("cpu"), 1)["cpu_flags"] == ["avx2", "avx512_bf16"]
    assert machine_info(torch.device("meta"), 1)["cpu_flags"] is None


def test_cpu_features_unreadable_is_empty(monkeypatch, tmp_path):
    monkeypatch.setattr(device, "CPUINFO", str(tmp_path / "missing"))
    assert device.cpu_features() == set()


def test_time_linear_measures_and_restores_threads():
    threads = torch.get_num_threads()
    seconds = device._time_linear(torch.bfloat16, m=4, k=32, n=32, repeats=2)
    assert 0 < seconds < 1 and torch.get_num_threads() == threads
