"""The KV storage formats' arithmetic against float64 (absmax int8), and the option's names."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from properties import examples

from minillm.attention.kv_quant import (
    dequantize_int8,
    quantize_absmax,
    quantize_int8,
    resolve_kv_dtype,
)


def test_int8_round_trip_against_float64():
    """absmax int8: |x - dequant(quant(x))| <= scale / 2 elementwise, scale = max|x| / 127."""
    x = torch.randn(5, 3, 64, dtype=torch.float64) * torch.logspace(-3, 2, 5)[:, None, None]
    data, scale = quantize_int8(x.float())
    back = dequantize_int8(data, scale, torch.float64)
    expected = x.abs().amax(-1) / 127
    torch.testing.assert_close(scale.double(), expected, rtol=1e-6, atol=0)
    assert ((back - x).abs() <= expected[..., None] / 2 * (1 + 1e-5)).all()
    assert data.abs().amax(-1).eq(127).all()
    zero_data, zero_scale = quantize_int8(torch.zeros(2, 64))
    assert not zero_data.any() and not zero_scale.any()


def test_kv_cache_dtype_names():
    assert resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype(None, torch.float32) == torch.float32
    assert resolve_kv_dtype("int8", torch.float32) == torch.int8
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        resolve_kv_dtype("fp8", torch.float32)


@settings(max_examples=examples(100))
@given(bits=st.integers(2, 8), rows=st.integers(1, 5), d=st.sampled_from([8, 32, 64]),
       log_size=st.floats(-6, 6), seed=st.integers(0, 2**31 - 1))
def test_absmax_bounds_and_idempotence(bits, rows, d, log_size, seed):
    """For any size of numbers and any width: codes within [-qmax, qmax] with qmax reached in
    every non-zero vector, error at most half a scale, and quantizing what was read back
    gives the same codes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=g) * 10.0 ** log_size
    q, scale = quantize_absmax(x, bits)
    qmax = 2 ** (bits - 1) - 1
    assert q.abs().amax(-1).eq(qmax).all()
    back = dequantize_int8(q, scale, torch.float64)
    assert ((back - x.double()).abs() <= scale.double()[:, None] / 2 * (1 + 1e-5)).all()
    again, _ = quantize_absmax(back.float(), bits)
    assert torch.equal(again, q)
