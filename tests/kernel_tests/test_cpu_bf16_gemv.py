"""The CPU bfloat16 matrix-vector kernel (``minillm.kernels.cpu_bf16_gemv``) against float64, in
its AVX-512 BF16 path where this machine builds it and in its plain loops everywhere, and the
engine's fast path that uses it."""
from __future__ import annotations

import pytest
import torch
from minillm.kernels import cpu_bf16_gemv as gemv
from minillm.kernels import cpu_build

pytestmark = pytest.mark.skipif(gemv.LIBRARY.get() is None, reason="the CPU kernels did not build")

VARIANTS = {"native": gemv.LIBRARY,
            "plain": cpu_build.Library("bf16_gemv_plain", gemv.SOURCE, gemv.LIBRARY.signatures,
                                       ("-mno-avx512bf16",), gemv.SOURCE_FILE)}


@pytest.fixture(params=list(VARIANTS))
def variant(request, use_build):
    return use_build(gemv, request.param, VARIANTS[request.param])


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# rows cover every tile size (1-12 rows: four chains at 1-2 rows, two at 3-4, one above),
# steps cut into equal tiles (17 rows: 9 + 8; 25: 9 + 8 + 8) and odd last groups (n 48, 16);
# K one pass of the chains, SmolLM2's, and a long one
@pytest.mark.parametrize("m,n,k", [(1, 16, 8), (2, 48, 576), (3, 32, 1536), (4, 64, 96),
                                   (5, 16, 200), (6, 32, 576), (7, 16, 8), (8, 48, 1536),
                                   (9, 960, 576), (10, 48, 96), (11, 16, 576), (12, 32, 1536),
                                   (17, 64, 576), (23, 64, 576), (25, 48, 200)])
def test_kernel_equals_float64_up_to_its_bfloat16_output(variant, m, n, k):
    w, x = randn(n, k, seed=1).bfloat16(), (randn(m, k, seed=2) * 3).bfloat16()
    y = gemv.Bf16Weight(w)(x)
    want = gemv.reference(x, w)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    # float32 sums of exact bfloat16 products, then one rounding to bfloat16
    torch.testing.assert_close(y.double(), want, rtol=2 ** -8, atol=1e-4 * want.abs().max())


def test_a_wrong_layout_is_caught():
    """Reading pair c of the wrong rows (a plausible bug: a transpose forgotten) is far off."""
    w, x = randn(32, 64, seed=3).bfloat16(), randn(1, 64, seed=4).bfloat16()
    good = gemv.Bf16Weight(w)
    bad = gemv.Bf16Weight(w)
    bad.packed.copy_(w.view(torch.int32).reshape(bad.packed.shape))
    want = gemv.reference(x, w)
    assert (good(x).double() - want).abs().max() < 0.05 < (bad(x).double() - want).abs().max()


def test_no_rows_give_an_empty_output(variant):
    """Zero activation rows: nothing to do (the tiles' arithmetic must not divide by zero)."""
    y = gemv.Bf16Weight(randn(32, 64, seed=7).bfloat16())(torch.empty(0, 64, dtype=torch.bfloat16))
    assert y.shape == (0, 32)


def test_out_is_written_in_place():
    w, x = randn(16, 64, seed=5).bfloat16(), randn(2, 64, seed=6).bfloat16()
    out = torch.empty(2, 16, dtype=torch.bfloat16)
    assert gemv.Bf16Weight(w)(x, out) is out


@pytest.mark.parametrize("weight", [torch.ones(24, 64, dtype=torch.bfloat16),
                                    torch.ones(16, 60, dtype=torch.bfloat16),
                                    torch.ones(16, 64)])
def test_bad_weights_name_the_rule(weight):
    assert not gemv.fits(weight)
    with pytest.raises(ValueError, match="multiple of 16"):
        gemv.pack(weight)
