"""The CPU fused small ops (C++ via ctypes) against the eager code they replace and float64;
their input checks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from minillm.kernels import cpu_fused_ops as ops

from minillm.attention.kv_quant import Int8Blocks, store
from minillm.model.layers import RMSNorm, apply_rope, rope_cos_sin

pytestmark = pytest.mark.skipif(not ops.available(),
                                reason=f"CPU fused ops not built: {ops.unavailable_reason()}")
DTYPES = [torch.float32, torch.bfloat16]
ULP = {torch.float32: 2 ** -23, torch.bfloat16: 2 ** -7}   # relative spacing of the dtype


def close_to_eager(ours: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor) -> None:
    """Within four ulps of the eager result (the order of a sum, an exp's last bits, then a
    rounding), and at most twice as far from the float64 result as the eager one at worst."""
    ulp = ULP[ours.dtype] * eager.double().abs().clamp_min(1e-3)
    assert ((ours.double() - eager.double()).abs() <= 4 * ulp).all()
    ours_err, eager_err = ((t.double() - exact).abs() / ulp for t in (ours, eager))
    assert ours_err.max() <= 2 * eager_err.max() + 1e-9


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 80])          # 80 x 576: the threaded path
def test_add_rms_norm_matches_the_eager_residual_add_and_norm(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    delta = torch.randn(rows, 576, generator=g).to(dtype)
    norm = RMSNorm(576).to(dtype)
    norm.weight.data = (torch.rand(576, generator=g) + 0.5).to(dtype)
    with torch.inference_mode():
        eager = norm(x + delta)
        added = x.clone()
        ours = ops.add_rms_norm(added, norm.weight, norm.eps, delta)
        s = (x + delta).double()
        exact = norm.weight.double() * s * (s.pow(2).mean(-1, keepdim=True) + norm.eps).rsqrt()
        plain, plain_eager = ops.add_rms_norm(x.clone(), norm.weight, norm.eps), norm(x)
    assert torch.equal(added, x + delta)                    # the residual add, in place
    close_to_eager(ours, eager, exact)
    x64 = x.double()
    close_to_eager(plain, plain_eager, norm.weight.double() * x64
                   * (x64.pow(2).mean(-1, keepdim=True) + norm.eps).rsqrt())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_rotates_q_and_stores_rotated_k_and_v_at_the_slots(dtype):
    g = torch.Generator().manual_seed(0)
    n, hq, hkv, d = 21, 9, 3, 64
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)   # one row stride, as packed
    cos, sin = rope_cos_sin(torch.randint(0, 4000, (n,), generator=g), d, 1e4, dtype)
    k_cache = torch.zeros(4, 16, hkv, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(64, generator=g)[:n]
    q_rot = ops.rope_store(q, k, v, cos, sin, k_cache, v_cache, slots)

    def eager(x, h):   # the model's own rope, over [1, H, n, d]
        return apply_rope(x.reshape(n, h, d).transpose(0, 1)[None], cos[None, None],
                          sin[None, None])[0].transpose(0, 1)

    assert torch.equal(q_rot, eager(q, hq))                  # same roundings, no FMA
    assert torch.equal(k_cache.view(-1, hkv, d)[slots], eager(k, hkv))
    assert torch.equal(v_cache.view(-1, hkv, d)[slots], v.reshape(n, hkv, d))
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache.view(-1, hkv, d)[untouched].any()


@pytest.mark.parametrize("dtype,fmt", list(ops.KV_FORMATS))
def test_rope_store_into_a_narrower_cache_equals_the_eager_store(dtype, fmt):
    """A bfloat16 cache below float32, an int8 one (with scales) below either: the stored
    values and scales are exactly those of the eager rope then ``kv_quant.store``."""
    g = torch.Generator().manual_seed(1)
    n, hq, hkv, d = 21, 9, 3, 64
    qkv = (torch.randn(n, (hq + 2 * hkv) * d, generator=g) * 3).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    cos, sin = rope_cos_sin(torch.randint(0, 4000, (n,), generator=g), d, 1e4, dtype)
    slots = torch.randperm(64, generator=g)[:n]
    k_rot = apply_rope(k.reshape(n, hkv, d).transpose(0, 1)[None], cos[None, None],
                       sin[None, None])[0].transpose(0, 1)

    def empty_cache():
        data = torch.zeros(4, 16, hkv, d, dtype=fmt)
        return Int8Blocks(data, torch.zeros(4, 16, hkv)) if fmt == torch.int8 else data

    got, want = [empty_cache(), empty_cache()], [empty_cache(), empty_cache()]
    ops.rope_store_into(q, k, v, cos, sin, *got, slots, torch.empty(n, hq, d, dtype=dtype))
    store(want[0], k_rot, slots)
    store(want[1], v.reshape(n, hkv, d), slots)
    for a, b in zip(got, want):
        if fmt == torch.int8:
            assert torch.equal(a.data, b.data) and torch.equal(a.scale, b.scale)
        else:
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 30])             # 30 x 1536: the threaded path
def test_silu_mul_matches_the_eager_gate(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536, generator=g) * 4).to(dtype)
    gate, up = gate_up.split([1536, 1536], dim=-1)
    with torch.inference_mode():
        eager = F.silu(gate.clone()) * up
    exact = F.silu(gate.double()) * up.double()
    close_to_eager(ops.silu_mul(gate, up), eager, exact)


def good_rope_args():
    qkv = torch.randn(3, 15 * 8)
    q, k, v = qkv.split([72, 24, 24], dim=-1)
    cos, sin = rope_cos_sin(torch.arange(3), 8, 1e4, torch.float32)
    return [q, k, v, cos, sin, torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 3, 8),
            torch.tensor([0, 5, 7])]


def with_arg(i, value):
    args = good_rope_args()
    args[i] = value(args) if callable(value) else value
    return args


BAD_ROPE = {
    "q": with_arg(0, torch.randn(3, 70)),
    "k": with_arg(1, torch.randn(3, 24)),                    # its own row stride
    "cos": with_arg(3, torch.randn(3, 6)),
    "k_cache": with_arg(5, torch.zeros(2, 4, 3, 8, dtype=torch.bfloat16)),
    "slot_mapping": with_arg(7, torch.tensor([0, 5, 8])),    # past the 8 slots
    "dtype": [a.half() if a.is_floating_point() else a for a in good_rope_args()],
}


@pytest.mark.parametrize("name", list(BAD_ROPE))
def test_bad_input_names_the_parameter(name):
    ops.rope_store(*good_rope_args())                        # the good call works
    with pytest.raises(ValueError, match=name):
        ops.rope_store(*BAD_ROPE[name])
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="residual"):
        ops.add_rms_norm(x, torch.ones(8), 1e-5, torch.randn(3, 8))
    with pytest.raises(ValueError, match="up"):
        ops.silu_mul(x, torch.randn(2, 7))
