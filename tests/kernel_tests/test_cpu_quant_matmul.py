"""The CPU integer matmuls (``minillm.kernels.cpu_quant_matmul``) against float64, in every
instruction-set path this machine can build (AVX-512 VNNI, AVX2, plain C++), and the quantized
linears and the engine's fast path that use them."""
from __future__ import annotations

import pytest
import torch
from minillm.kernels import cpu_build
from minillm.kernels import cpu_quant_matmul as qmm

from minillm.quant import Int4Linear, Int8Linear, quantize_model
from minillm.quant import linear as qlinear
from minillm.quant.formats import dequantize_int4, quantize_int4, quantize_int8
from minillm.quant.linear import VNNI_KERNEL_ROWS, QuantGroup
from minillm.quant.quantize import rtn_int4

pytestmark = pytest.mark.skipif(not qmm.available(), reason="the CPU kernels did not build")

# the same source built for narrower instruction sets (later -m flags override -march=native)
VARIANTS = {"native": qmm.LIBRARY,
            "avx2": cpu_build.Library("quant_matmul_avx2", qmm.SOURCE, qmm.LIBRARY.signatures,
                                      ("-mno-avx512f", "-mno-avxvnni"), qmm.SOURCE_FILE),
            "plain": cpu_build.Library("quant_matmul_plain", qmm.SOURCE, qmm.LIBRARY.signatures,
                                       ("-mno-avx2",), qmm.SOURCE_FILE)}


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=list(VARIANTS))
def variant(request, use_build):
    return use_build(qmm, request.param, VARIANTS[request.param])


def weights(kind: str, n: int, k: int, group_size: int = 32, seed: int = 1):
    """(kernel operands, dequantized float32 weight [n, k]) of a random int8 or int4 weight
    (int4: n rounded up to a multiple of the kernel's 16 rows; int4h: its scales and minima
    float16 numbers, which the kernel then reads as float16)."""
    w = randn(n, k, seed=seed) * 0.05
    if kind == "int8":
        q, scale = quantize_int8(w)
        return (qmm.pack_int8(q), scale), q.float() * scale[:, None]
    w = randn(-(-n // qmm.ROWS) * qmm.ROWS, k, seed=seed) * 0.05
    codes, scale, mn = (rtn_int4 if kind == "int4h" else quantize_int4)(w, group_size)
    return qmm.pack_int4(codes, scale, mn, group_size), dequantize_int4(codes, scale, mn,
                                                                         group_size)


def matmul(kind, x, operands):
    if kind != "int8":
        assert operands[1].dtype == (torch.float16 if kind == "int4h" else torch.float32)
    return (qmm.int8_matmul if kind == "int8" else qmm.int4_matmul)(x, *operands)


# rows cover every tile remainder; K one block, an odd count of blocks, chunks of 16 and a tail
@pytest.mark.parametrize("kind", ["int8", "int4", "int4h"])
@pytest.mark.parametrize("m,n,k", [(1, 40, 32), (2, 17, 96), (3, 64, 576), (4, 33, 1120),
                                   (5, 8, 512), (9, 24, 1536)])
def test_kernel_equals_float64_on_the_quantized_input(variant, kind, m, n, k):
    operands, w = weights(kind, n, k)
    x = randn(m, k, seed=2) * 3
    y = matmul(kind, x, operands)
    want = qmm.reference_matmul(x, w)
    assert y.shape == (m, w.shape[0]) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), want, rtol=0, atol=2e-6 * want.abs().max().item())


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_group_sizes_and_bfloat16(group_size):
    operands, w = weights("int4", 48, 256, group_size)
    x = randn(3, 256, seed=3).bfloat16()
    y = qmm.int4_matmul(x, *operands)
    want = qmm.reference_matmul(x, w)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), want, rtol=2 ** -8, atol=1e-6)


def test_activation_rounding_is_within_half_a_step_of_each_block_max():
    x = randn(4, 256, seed=4) * torch.linspace(0.01, 10, 256)
    codes, d = qmm.quantize_activations(x)
    assert codes.abs().max() <= 127 and torch.equal(codes, codes.round())
    err = (codes * d[..., None] - x.reshape(4, -1, 32)).abs()
    assert (err <= d[..., None] / 2 * (1 + 1e-6)).all()
    w = randn(24, 256, seed=5)        # so the kernel stays near the unquantized product
    rel = (qmm.reference_matmul(x, w) - x.double() @ w.double().t()).norm() \
        / (x.double() @ w.double().t()).norm()
    assert rel < 1e-2


def test_a_wrong_answer_is_caught():
    """Dropping int4's minimum term (a plausible bug) is far outside the tolerance."""
    codes, scale, mn = quantize_int4(randn(16, 64, seed=6) + 0.5, 32)
    packed, bs, bm = qmm.pack_int4(codes, scale, mn, 32)
    x = randn(2, 64, seed=7)
    good = qmm.int4_matmul(x, packed, bs, bm)
    bad = qmm.int4_matmul(x, packed, bs, torch.zeros_like(bm))
    want = qmm.reference_matmul(x, dequantize_int4(codes, scale, mn, 32))
    assert (good.double() - want).abs().max() < 1e-4 < (bad.double() - want).abs().max()


@pytest.mark.parametrize("k", [32, 64, 544, 1120])
def test_layout_round_trips(k):
    index = qmm.layout_index(k)
    assert torch.equal(index.sort().values, torch.arange(k))
    codes = torch.randint(0, 16, (32, k), generator=torch.Generator().manual_seed(k))
    packed, _, _ = qmm.pack_int4(codes, torch.ones(32, k // 32), torch.zeros(32, k // 32), 32)
    assert packed.shape == (32, k // 2) and torch.equal(qmm.unpack_int4(packed), codes.byte())


def test_int4_layout_puts_a_block_of_sixteen_rows_in_four_vectors():
    """Byte i of lane l of vector u: row l's element 4u + i (low nibble), 16 + 4u + i (high)."""
    codes = torch.arange(16 * 32).reshape(16, 32) % 16
    codes[5, 16 + 4 * 2 + 3] = 9
    packed, _, _ = qmm.pack_int4(codes, torch.ones(16, 1), torch.zeros(16, 1), 32)
    byte = packed.flatten()[64 * 2 + 4 * 5 + 3]
    assert byte & 15 == codes[5, 4 * 2 + 3] and byte >> 4 == 9


def test_layout_puts_four_bytes_of_each_block_in_a_lane():
    """Two blocks (one chunk of c = 2): vector t lane l = elements 4t..4t+3 of block l."""
    assert qmm.layout_index(64)[:16].tolist() == [0, 1, 2, 3, 32, 33, 34, 35,
                                                  4, 5, 6, 7, 36, 37, 38, 39]


@pytest.mark.parametrize("call,match", [
    (lambda: qmm.int8_matmul(torch.ones(1, 40), torch.ones(4, 40, dtype=torch.int8),
                             torch.ones(4)), "in_features must be a positive multiple of 32"),
    (lambda: qmm.pack_int8(torch.ones(4, 40, dtype=torch.int8)), "in_features must be"),
    (lambda: qmm.int8_matmul(torch.ones(1, 64), torch.ones(4, 32, dtype=torch.int8),
                             torch.ones(4)), "x must be"),
    (lambda: qmm.int8_matmul(torch.ones(1, 32, dtype=torch.float64),
                             torch.ones(4, 32, dtype=torch.int8), torch.ones(4)), "x must be"),
    (lambda: qmm.int8_matmul(torch.ones(1, 32), torch.ones(4, 32, dtype=torch.int8),
                             torch.ones(3)), "scale must be"),
    (lambda: qmm.int4_matmul(torch.ones(1, 64), torch.ones(4, 32, dtype=torch.uint8),
                             torch.ones(4, 1), torch.ones(4, 2)), "scale must be"),
    (lambda: qmm.pack_int4(torch.ones(16, 64), torch.ones(16, 2), torch.ones(16, 2), 48),
     "group_size must be"),
    (lambda: qmm.pack_int4(torch.ones(24, 64), torch.ones(24, 2), torch.ones(24, 2), 32),
     "out_features must be a multiple of 16"),
])
def test_bad_input_names_the_parameter(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------- the layers that call them

@pytest.fixture(autouse=True)
def kernel_rows(monkeypatch):
    """The layers call the kernels up to these rows on any CPU here (on one without VNNI the
    package leaves them to PyTorch's ops for speed, not for correctness)."""
    monkeypatch.setattr(qlinear, "KERNEL_ROWS", VNNI_KERNEL_ROWS)
    return VNNI_KERNEL_ROWS


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_linears_use_the_kernel_for_a_few_rows_and_torch_for_more(kind, kernel_rows):
    w = randn(96, 128, seed=8) * 0.05
    lin = Int8Linear(*quantize_int8(w)) if kind == "int8" else Int4Linear(*quantize_int4(w, 32),
                                                                          32)
    few, many = randn(kernel_rows[kind], 128, seed=9), randn(kernel_rows[kind] + 8, 128, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(lin(few).double(), qmm.reference_matmul(few, lin.dequantize()),
                                   rtol=0, atol=1e-5)
        exact = many.double() @ lin.dequantize().double().t()   # PyTorch's op: bf16 input
        assert ((lin(many).double() - exact).norm() / exact.norm()) < 1e-2
        group = QuantGroup([lin, lin])
        torch.testing.assert_close(group(few), torch.cat([lin(few)] * 2, 1))
        torch.testing.assert_close(group(many), torch.cat([lin(many)] * 2, 1))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_compiled_layer_runs_the_custom_op(kind, kernel_rows):
    """One row under torch.compile (fullgraph): the result is the kernel's (within 1e-5 of the
    float64 statement of it), which PyTorch's bf16 weight-only op would miss by ~1e-3."""
    w = randn(64, 96, seed=10) * 0.05
    lin = Int8Linear(*quantize_int8(w)) if kind == "int8" else Int4Linear(*quantize_int4(w, 32),
                                                                          32)
    x = randn(1, 96, seed=11)
    with torch.no_grad():
        got = torch.compile(lin, fullgraph=True)(x)
    want = qmm.reference_matmul(x, lin.dequantize())
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_engine_fast_path_runs_quantized_weights_as_eager_does(monkeypatch):
    """The tiny preset quantized to int8 (fp32): the fast path calls the integer kernels and
    generates the eager path's greedy tokens."""
    import minillm
    from minillm.engine import EngineConfig, LLMEngine, cpu_forward
    from minillm.sampling import SamplingParams

    model, tok = minillm.load_model("tiny", dtype=torch.float32)
    quantize_model(model, "int8")
    calls = []
    real = qmm.BoundWeight.__call__
    monkeypatch.setattr(qmm.BoundWeight, "__call__",
                        lambda self, x, out=None: calls.append(self.name) or real(self, x, out))

    def greedy(fuse: bool):
        engine = LLMEngine(model, tok, EngineConfig(attention_backend="cpu"))
        engine.runner.fuse_ops = fuse
        assert cpu_forward.supports(model)
        rid = engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=8, temperature=0.0,
                                                                ignore_eos=True))
        out = {}
        while engine.has_unfinished():
            out.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        return out[rid]

    eager = greedy(False)
    calls.clear()
    assert greedy(True) == eager and calls.count("int8_matmul") > 8


def test_layers_moved_to_another_dtype_keep_their_answer():
    """model.to(bfloat16) turns a layer's float scales to bfloat16: the kernel's operands are
    laid out afresh in float32 (the C++ reads float32)."""
    w = randn(64, 96, seed=12) * 0.05
    x = randn(2, 96, seed=13)
    for lin in (Int8Linear(*quantize_int8(w)), Int4Linear(*quantize_int4(w, 32), 32)):
        with torch.no_grad():
            before = lin(x)
            lin.to(torch.bfloat16)
            torch.testing.assert_close(lin(x), before, rtol=0, atol=1e-2 * before.abs().max())
