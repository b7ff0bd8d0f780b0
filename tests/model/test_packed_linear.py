"""PackedLinear (oneDNN-packed fp32 and bf16 weights) against F.linear in float64 and the
unpacked model."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import minillm
from minillm.model.packed import PackedGroup, PackedLinear, can_pack_linears, pack_linears

pytestmark = pytest.mark.skipif(not can_pack_linears(torch.device("cpu"), torch.float32),
                                reason="this PyTorch has no oneDNN linear")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 96), (64, 96), (2, 7, 96)])
def test_packed_linear_equals_float64_linear(shape, bias):
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=bias)
    x = torch.randn(shape)
    want = F.linear(x.double(), lin.weight.double(), None if lin.bias is None
                    else lin.bias.double())
    with torch.inference_mode():
        got = PackedLinear(lin)(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_repacks_after_in_place_update_and_trains_through_f_linear():
    lin = PackedLinear(nn.Linear(16, 8, bias=False))
    x = torch.randn(3, 16)
    with torch.no_grad():
        before = lin(x)
        lin.weight.mul_(2)
        torch.testing.assert_close(lin(x), 2 * before)
    lin(x).sum().backward()  # grad enabled: the F.linear path, so gradients flow
    torch.testing.assert_close(lin.weight.grad, x.sum(0).expand(8, 16))


BF16 = pytest.mark.skipif(not can_pack_linears(torch.device("cpu"), torch.bfloat16),
                          reason="oneDNN has no bf16 kernels for this CPU")


@BF16
@pytest.mark.parametrize("shape", [(1, 96), (64, 96), (2, 7, 96)])
def test_packed_bf16_linear_equals_float64_of_the_bf16_operands(shape):
    """bf16 packed: the float64 product of the same bf16 numbers, to bf16's output rounding."""
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=True).to(torch.bfloat16)
    x = torch.randn(shape).bfloat16()
    want = F.linear(x.double(), lin.weight.double(), lin.bias.double())
    with torch.inference_mode():
        packed = PackedLinear(lin)
        got = packed(x)
    assert got.dtype == torch.bfloat16 and packed._packed is not None   # it took the oneDNN path
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=2e-2)


def test_repacks_or_falls_back_after_a_dtype_change():
    """Moved to bf16 it repacks where bf16 packs (else F.linear); moved to fp16 it never packs."""
    lin = PackedLinear(nn.Linear(16, 8, bias=False))
    x = torch.randn(3, 16)
    with torch.inference_mode():
        lin(x)  # packs the fp32 weight
        for dtype in (torch.bfloat16, torch.float16):
            lin.to(dtype)
            got = lin(x.to(dtype))
            assert got.dtype == dtype
            torch.testing.assert_close(got, F.linear(x.to(dtype), lin.weight))
    assert not can_pack_linears(torch.device("cpu"), torch.float16)


def test_pack_linears_keeps_parameters_tying_and_logits():
    model, _ = minillm.load_model("tiny", device="cpu", dtype="float32")
    plain = copy.deepcopy(model)
    keys = list(model.state_dict())
    n = pack_linears(model)
    assert n == 7 * model.cfg.n_layers + 1
    assert list(model.state_dict()) == keys
    assert isinstance(model.lm_head, PackedLinear)
    assert model.lm_head.weight is model.embed.weight  # tying survives
    ids = torch.randint(0, model.cfg.vocab_size, (2, 9))
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), plain(ids), rtol=1e-4, atol=1e-4)
        model(ids)  # packs
    clone = copy.deepcopy(model)  # the opaque packed tensors are not copied, but repacked
    with torch.inference_mode():
        torch.testing.assert_close(clone(ids), plain(ids), rtol=1e-4, atol=1e-4)
    assert pack_linears(model) == 0  # idempotent


def test_packed_group_equals_its_linears_in_float64_and_repacks():
    """q, k, v (or gate, up) as one matmul: each output equals its own linear in float64; an
    in-place change of one weight repacks; autograd runs them one by one."""
    torch.manual_seed(1)
    owner = nn.Module()
    lins = [nn.Linear(96, n, bias=False) for n in (96, 32, 32)]
    for name, lin in zip("qkv", lins):
        setattr(owner, name, lin)
    group = PackedGroup(owner, "q", "k", "v")
    x = torch.randn(5, 96)
    with torch.inference_mode():
        outs = group(x)
        for lin, out in zip(lins, outs):
            torch.testing.assert_close(out.double(), F.linear(x.double(), lin.weight.double()),
                                       rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        lins[1].weight.mul_(-1)
        torch.testing.assert_close(group(x)[1], -outs[1])
    sum(o.sum() for o in group(x)).backward()
    assert all(lin.weight.grad is not None for lin in lins)
    owner.k = nn.Linear(96, 32, bias=True)        # swapped later, with a bias: used as it is
    with torch.inference_mode():
        torch.testing.assert_close(group(x)[1], owner.k(x))


def test_pack_linears_groups_attention_and_ffn_inputs():
    model, _ = minillm.load_model("tiny", device="cpu", dtype="float32")
    plain = copy.deepcopy(model)
    pack_linears(model)
    block = model.layers[0]
    assert isinstance(block.attn.input_group, PackedGroup)
    assert block.attn.input_group.names == ("wq", "wk", "wv")
    assert isinstance(block.ffn.input_group, PackedGroup)
    ids = torch.randint(0, model.cfg.vocab_size, (3, 11))
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), plain(ids), rtol=1e-4, atol=1e-4)


@BF16
def test_packed_bf16_model_keeps_its_logits():
    """The tiny model in bf16, packed (singles and groups), against the same model unpacked:
    both round to bf16 after each matmul, so they agree to bf16's rounding of the logits."""
    model, _ = minillm.load_model("tiny", device="cpu", dtype="bfloat16")
    plain = copy.deepcopy(model)
    pack_linears(model)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 9))
    with torch.inference_mode():
        got, want = model(ids).float(), plain(ids).float()
    assert model.layers[0].attn.input_group._packed is not None      # the group packed in bf16
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)


@BF16
@pytest.mark.parametrize("shape", [(1, 96), (7, 96), (2, 3, 96), (200, 96)])
def test_cpu_weight_takes_the_matrix_vector_kernel_at_few_bf16_rows(shape):
    """Up to GEMV_ROWS rows (where the kernel runs) the C++ kernel, above them oneDNN: both the
    float64 product of the same bf16 numbers to bf16's rounding; a bias is added after."""
    from minillm.kernels import cpu_bf16_gemv

    from minillm.model.packed import GEMV_ROWS

    torch.manual_seed(2)
    lin = nn.Linear(96, 64, bias=True).to(torch.bfloat16)
    x = torch.randn(shape).bfloat16()
    want = F.linear(x.double(), lin.weight.double(), lin.bias.double())
    with torch.inference_mode():
        packed = PackedLinear(lin)
        got = packed(x)
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=2e-2)
    weight = packed.cpu_weight()
    rows = x.numel() // 96
    kernel = cpu_bf16_gemv.available()
    assert weight.one_call(rows, torch.bfloat16) == (kernel and rows <= GEMV_ROWS)
    assert (weight._onednn is None) == (kernel and rows <= GEMV_ROWS)   # oneDNN's copy unused
    assert not weight.one_call(rows, torch.float32)
