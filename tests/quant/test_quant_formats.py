"""Quantization formats against independent references: the gguf package, float64 maths.

Round-trip error bounds are checked per format; corrupt tensors and bad group sizes raise
ValueErrors that name the parameter.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from minillm.quant import ggml_blocks
from minillm.quant.formats import (
    INT4_GROUP_SIZES,
    check_group_size,
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)

GGML = {"q8_0": GGMLQuantizationType.Q8_0, "q4_1": GGMLQuantizationType.Q4_1,
        "q4_k": GGMLQuantizationType.Q4_K}


def weight(n=24, k=512, seed=0, outliers=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g, dtype=torch.float64) * 0.05
    if outliers:
        w[3, 7] = 1.5  # one large weight, as real layers have
        w[5, :64] = 0.0  # an all-zero group
        w[6, 32:64] = 0.02  # a constant group
    return w.float()


# ----------------------------------------------------------------------------- int8 / int4

def test_int8_round_trip_within_half_a_step():
    w = weight()
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (w.shape[0],)
    err = (dequantize_int8(q, scale).double() - w.double()).abs()
    assert (err <= scale.double()[:, None] / 2 * (1 + 1e-5)).all()
    # float64 reference: each row's largest weight is exactly +-127 steps
    assert torch.equal(q.abs().amax(1), torch.full((w.shape[0],), 127, dtype=torch.int8))


@pytest.mark.parametrize("group_size", INT4_GROUP_SIZES)
def test_int4_round_trip_within_half_a_step(group_size):
    w = weight()
    q, scale, mn = quantize_int4(w, group_size)
    assert q.max() <= 15 and scale.shape == (w.shape[0], w.shape[1] // group_size)
    deq = dequantize_int4(q, scale, mn, group_size).double()
    step = scale.double().repeat_interleave(group_size, 1)
    assert ((deq - w.double()).abs() <= step / 2 * (1 + 1e-4) + 1e-7).all()
    # independent float64 computation of the same codes
    g = w.double().reshape(w.shape[0], -1, group_size)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    ref = torch.round((g - lo) / ((hi - lo) / 15).clamp(min=1e-12)).clamp(0, 15)
    assert (ref.reshape_as(q) != q.double()).float().mean() < 1e-3  # ties may round apart


def test_int4_error_grows_with_group_size():
    w = weight(outliers=False)
    errs = [(dequantize_int4(*quantize_int4(w, g), g) - w).pow(2).mean().item()
            for g in INT4_GROUP_SIZES]
    assert errs[0] < errs[1] < errs[2]


def test_pack_unpack_int4():
    q = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (5, 32) and torch.equal(unpack_int4(packed), q)
    assert torch.equal(packed[:, 0] & 0x0F, q[:, 0]) and torch.equal(packed[:, 0] >> 4, q[:, 1])


@pytest.mark.parametrize("k,group_size,ok", [(576, 32, True), (576, 64, True), (576, 128, False),
                                             (1536, 128, True), (96, 48, False)])
def test_group_size_must_divide_the_layer(k, group_size, ok):
    if ok:
        check_group_size(k, group_size)
    else:
        with pytest.raises(ValueError, match="group_size"):
            check_group_size(k, group_size)


def test_corrupt_int_tensors_raise():
    w = weight(k=128)
    q, scale, mn = quantize_int4(w, 32)
    bad = scale.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="corrupt int4 tensor: scale"):
        dequantize_int4(q, bad, mn, 32)
    with pytest.raises(ValueError, match=r"codes must be in \[0, 15\]"):
        dequantize_int4(q + 1, scale, mn, 32)
    with pytest.raises(ValueError, match="min must have shape"):
        dequantize_int4(q, scale, mn[:, :2], 32)
    q8, s8 = quantize_int8(w)
    with pytest.raises(ValueError, match="scale must be finite"):
        dequantize_int8(q8, s8 * float("inf"))
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_int8(w * float("nan"))


# ----------------------------------------------------------------------------- GGUF blocks

@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_encoder_is_bit_exact_with_gguf(fmt):
    w = weight()
    ours = ggml_blocks.encode(w, fmt)
    ref = quants.quantize(w.numpy(), GGML[fmt])
    assert np.array_equal(ours.reshape(ref.shape), ref)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "q4_k"])
def test_decoder_agrees_with_gguf(fmt):
    w = weight()
    raw = ggml_blocks.encode(w, fmt)
    ref = quants.dequantize(raw.reshape(w.shape[0], -1), GGML[fmt])
    assert np.array_equal(ggml_blocks.decode(raw, fmt, tuple(w.shape)).numpy(), ref)


def test_q4_k_layout_against_gguf_scale_unpacking():
    raw = ggml_blocks.encode(weight(), "q4_k")
    sc_ref, m_ref = quants.Q4_K.get_scale_min(raw[:, 4:16].copy())
    sc, m = ggml_blocks.q4_k_scales_mins(torch.from_numpy(raw[:, 4:16].copy()))
    assert np.array_equal(sc.numpy(), sc_ref) and np.array_equal(m.numpy(), m_ref)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "q4_k"])
def test_round_trip_error_bounds(fmt):
    w = weight()
    raw = ggml_blocks.encode(w, fmt)
    deq = ggml_blocks.decode(raw, fmt, tuple(w.shape)).double()
    err = (deq - w.double()).abs()
    blocks = w.double().reshape(-1, 32)
    if fmt == "q8_0":  # half a step of d = max|w| / 127, plus d's fp16 rounding
        d = blocks.abs().amax(1) / 127
        bound = d / 2 + blocks.abs().amax(1) * 2 ** -11
    elif fmt == "q4_1":  # half a step of (max - min) / 15, plus fp16 rounding of d and m
        rng = blocks.amax(1) - blocks.amin(1)
        bound = rng / 30 + (rng + blocks.abs().amax(1)) * 2 ** -10
    else:  # half a step of the 6-bit sub-block scale, plus up to one dmin of lost offset
        q, step, offset = ggml_blocks.q4_k_parts(raw)
        dmin = torch.from_numpy(raw[:, 2:4].copy()).contiguous().view(torch.float16).double()
        bound = step.double() / 2 + dmin.repeat_interleave(8) + 1e-6
    assert (err.reshape(-1, 32) <= bound[:, None] + 1e-7).all()
    assert err.mean() < {"q8_0": 3e-4, "q4_1": 4.5e-3, "q4_k": 4.5e-3}[fmt]


def test_q4_1_matches_int4_group_32_on_the_same_grid():
    """Q4_1 is int4 group 32 with fp16 parameters: decoded through the int4 triple it agrees."""
    w = weight()
    raw = ggml_blocks.encode(w, "q4_1")
    q, scale, mn = ggml_blocks.int4_groups(raw, "q4_1", tuple(w.shape))
    assert torch.equal(dequantize_int4(q, scale, mn, 32), ggml_blocks.decode(raw, "q4_1",
                                                                               tuple(w.shape)))


@pytest.mark.slow
def test_the_models_own_q4_1_tensor_round_trips(gguf_path):
    """Our encoder re-encodes a real Q4_1 tensor of the model file to the same values."""
    from gguf import GGUFReader

    from minillm.checkpoint.gguf import dequantize

    t = next(t for t in GGUFReader(str(gguf_path)).tensors if t.tensor_type.name == "Q4_1")
    shape = tuple(int(s) for s in reversed(t.shape))
    w = dequantize(t.data, "Q4_1", shape)
    again = ggml_blocks.decode(ggml_blocks.encode(w, "q4_1"), "q4_1", shape)
    assert (again - w).abs().max() <= w.abs().max() * 2 ** -9


@pytest.mark.parametrize("case,match", [
    ("truncated", "not a whole number of 34-byte blocks"),
    ("wrong_shape", "blocks hold"),
    ("nan_scale", "block 1 has a NaN or inf scale"),
    ("bad_format", "format must be one of"),
    ("bad_row", "needs rows of a multiple of 256"),
])
def test_corrupt_blocks_raise(case, match):
    w = weight(n=2, k=64, outliers=False)
    raw = ggml_blocks.encode(w, "q8_0")
    with pytest.raises(ValueError, match=match):
        if case == "truncated":
            ggml_blocks.decode(raw.reshape(-1)[:-3], "q8_0", (2, 64))
        elif case == "wrong_shape":
            ggml_blocks.decode(raw, "q8_0", (2, 96))
        elif case == "nan_scale":
            bad = raw.copy()
            bad[1, 0:2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
            ggml_blocks.decode(bad, "q8_0", (2, 64))
        elif case == "bad_format":
            ggml_blocks.encode(w, "q3_x")
        else:
            ggml_blocks.encode(w, "q4_k")
