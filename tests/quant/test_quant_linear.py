"""Quantized linears, the Triton dequantize-matmul kernel (interpreter), GPTQ/AWQ/HQQ and
quantize_model, each against an independent float64 computation or round-to-nearest."""
from minillm.device import setup_triton

setup_triton()  # before any kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402
from minillm.kernels.dequant_matmul import (  # noqa: E402
    dequant_matmul,
    dequant_matmul_reference,
)

import minillm  # noqa: E402
from minillm.bench.quant import parse_spec  # noqa: E402
from minillm.quant import (  # noqa: E402
    METHODS,
    Int4Linear,
    Int8Linear,
    awq_quantize,
    dequantize_int4,
    gptq_quantize,
    hqq_quantize,
    pack_int4,
    quantize_int4,
    quantize_model,
)


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ----------------------------------------------------------------------------- linears

@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_linear_cpu_op_matches_float64(group_size):
    w, x = randn(48, 256, scale=0.05), randn(2, 3, 256, seed=1)
    q, scale, mn = quantize_int4(w, group_size)
    lin = Int4Linear(q, scale, mn, group_size)
    ref = x.double() @ dequantize_int4(q, scale, mn, group_size).double().t()
    y = lin(x)
    assert y.shape == (2, 3, 48) and y.dtype == x.dtype
    assert rel_err(y, ref) < 1e-2  # the op computes in bf16


def test_int8_linear_matches_float64():
    w, x = randn(40, 96, scale=0.05), randn(5, 96, seed=1)
    lin = Int8Linear.from_linear(_linear(w))
    ref = x.double() @ lin.dequantize().double().t()
    assert rel_err(lin(x), ref) < 1e-2
    assert rel_err(lin.dequantize(), w) < 1e-2


def _linear(w):
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    return lin


def test_int4_linear_in_scale_is_folded_back():
    w, x = randn(16, 64, scale=0.05), randn(4, 64, seed=2)
    s = randn(64, seed=3).abs() + 0.5
    q, scale, mn = quantize_int4(w / s, 32)
    lin = Int4Linear(q, scale, mn, 32, in_scale=s)
    ref = x.double() @ w.double().t()  # the original weight, not the layer's own dequantize()
    err = rel_err(lin(x), ref)
    dropped = Int4Linear(q, scale, mn, 32)  # in_scale forgotten: off by the scale itself
    assert err < 0.2 and rel_err(dropped(x), ref) > 3 * err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k,g", [(1, 37, 96, 32), (5, 16, 64, 64), (17, 33, 256, 128)])
def test_dequant_matmul_kernel(dtype, m, n, k, g):
    w, x = randn(n, k, scale=0.05), randn(m, k, seed=1).to(dtype)
    q, scale, mn = quantize_int4(w, g)
    packed = pack_int4(q)
    y = dequant_matmul(x, packed, scale, mn, g)
    ref64 = x.double() @ dequantize_int4(q, scale, mn, g).double().t()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), ref64, atol=tol, rtol=tol)
    torch.testing.assert_close(dequant_matmul_reference(x, packed, scale, mn, g).double(), ref64,
                               atol=tol, rtol=tol)


def test_dequant_matmul_bad_inputs():
    x = randn(2, 64)
    q, scale, mn = quantize_int4(randn(8, 64), 32)
    packed = pack_int4(q)
    with pytest.raises(ValueError, match="packed must have shape"):
        dequant_matmul(randn(2, 32), packed, scale, mn, 32)
    with pytest.raises(ValueError, match="group_size must"):
        dequant_matmul(x, packed, scale, mn, 48)
    with pytest.raises(ValueError, match="scale must have shape"):
        dequant_matmul(x, packed, scale[:, :1].contiguous(), mn, 32)


# ----------------------------------------------------------------------------- methods

def output_err(w, x, q, scale, mn, g, in_scale=None):
    deq = dequantize_int4(q, scale, mn, g).double()
    if in_scale is not None:
        deq = deq * in_scale.double()[None, :]
    return (x.double() @ (deq - w.double()).t()).pow(2).mean().item()


def correlated_inputs(t, k, seed=4):
    base = randn(t, k // 8, seed=seed)
    x = base.repeat_interleave(8, 1) + 0.1 * randn(t, k, seed=seed + 1)
    x[:, 3] *= 20  # an outlier channel, as LLM activations have
    return x


def test_gptq_with_identity_hessian_is_round_to_nearest():
    w = randn(24, 128, scale=0.05)
    q, scale, mn = gptq_quantize(w, torch.eye(128), 32, damp=0.0)
    q0, s0, m0 = quantize_int4(w, 32)
    assert torch.equal(q, q0) and torch.allclose(scale, s0) and torch.allclose(mn, m0)


def test_gptq_lowers_output_error_on_correlated_inputs():
    w, x = randn(32, 128, scale=0.05), correlated_inputs(256, 128)
    rtn = output_err(w, x, *quantize_int4(w, 32), 32)
    gptq = output_err(w, x, *gptq_quantize(w, x.t() @ x, 32), 32)
    assert gptq < 0.7 * rtn


def test_awq_never_worse_than_round_to_nearest_and_helps_outlier_channels():
    w, x = randn(32, 128, scale=0.05), correlated_inputs(256, 128)
    q, scale, mn, in_scale, alpha = awq_quantize(w, x, 32)
    rtn = output_err(w, x, *quantize_int4(w, 32), 32)
    assert 0 < alpha <= 1
    assert output_err(w, x, q, scale, mn, 32, in_scale) < rtn


def test_hqq_lowers_the_lp_weight_error():
    w = randn(64, 256, scale=0.05)
    w[::7, ::13] *= 8  # heavy tails
    q0, s0, m0 = quantize_int4(w, 64)
    q, scale, mn = hqq_quantize(w, 64)
    assert torch.equal(scale, s0) and q.max() <= 15

    def lp(deq):
        return (deq - w).abs().pow(0.7).mean().item()
    assert lp(dequantize_int4(q, scale, mn, 64)) < lp(dequantize_int4(q0, s0, m0, 64))


# ----------------------------------------------------------------------------- whole model

@pytest.fixture(scope="module")
def tiny_fp():
    from minillm.checkpoint import random_model
    from minillm.config import PRESETS

    return random_model(PRESETS["tiny"].with_(vocab_size=512)).eval().requires_grad_(False)


@pytest.mark.parametrize("method", METHODS)
def test_quantize_model_tiny(tiny_fp, method):
    import copy

    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = tiny_fp(ids)
    calib = torch.randint(0, 512, (128,), generator=torch.Generator().manual_seed(1))
    qm = quantize_model(copy.deepcopy(tiny_fp), method, group_size=32, calib_ids=calib,
                        calib_seq_len=32)
    assert isinstance(qm.lm_head, Int8Linear)
    assert qm.quantization == method
    bound = {"int8": 0.03, "q8_0": 0.03}.get(method, 0.2)
    assert rel_err(qm(ids), ref) < bound


@pytest.mark.parametrize("call,match", [
    (lambda m: quantize_model(m, "int3"), r"quantization must be one of \['int8'"),
    (lambda m: quantize_model(m, "int4", group_size=128), "group_size=128 does not divide"),
    (lambda m: quantize_model(m, "gptq", group_size=48), r"group_size must be one of"),
    (lambda m: minillm.load_model("no-such", quantization="fp4"), "quantization must be None"),
    (lambda m: parse_spec("int8:32"), "a group size applies to"),
])
def test_bad_input(tiny_fp, call, match):
    with pytest.raises(ValueError, match=match):
        call(tiny_fp)


@pytest.mark.slow
def test_real_model_perplexity_int8_int4(real):
    """int8 and int4 (group 32) stay within 3 % of the float model's perplexity."""
    import copy

    from minillm.evaluate import perplexity, sample_ids

    model, tok = real
    ids = sample_ids(192, tok)
    base = perplexity(model, ids, prefill=len(ids))
    for method in ("int8", "int4"):
        qm = quantize_model(copy.deepcopy(model), method)
        assert perplexity(qm, ids, prefill=len(ids)) < 1.03 * base, method


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_linear_backward_through_the_dequantized_weight(kind):
    """QLoRA needs gradients through a frozen quantized layer: dL/dx = g W (float64 check)."""
    w = randn(24, 64, scale=0.05)
    lin = Int8Linear.from_linear(_linear(w)) if kind == "int8" else Int4Linear(
        *quantize_int4(w, 32), 32)
    x = randn(3, 64, seed=1).requires_grad_(True)
    g = randn(3, 24, seed=2)
    lin(x).backward(g)
    torch.testing.assert_close(x.grad.double(), g.double() @ lin.dequantize().double(),
                               atol=1e-5, rtol=1e-5)
