"""io_model: HBM byte counts against hand-computed cases and the real tensors; BPT == the layer."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from minillm.attention import reference_attention
from minillm.course import ch05_io_model as io_model
from minillm.model import rope_cos_sin

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "kernels_gpu.json"


# ----------------------------------------------------------------------------- naive
def test_naive_bytes_small_case_by_hand():
    # N=3, d=2, fp16: Q,K,V,O are 6 numbers each, S and P 9 each, S and P go out and back.
    assert io_model.naive_attention_bytes(3, 2, dtype_bytes=2) == (4 * 6 + 4 * 9) * 2 == 120
    io = io_model.naive_attention_io(3, 2, heads=2, batch=5, dtype_bytes=4)
    assert io["write S"] == io["read P"] == 5 * 2 * 9 * 4
    assert io["read Q"] == io["write O"] == 5 * 2 * 6 * 4
    assert len(io) == 8


def test_naive_bytes_equal_the_bytes_of_the_actual_tensors():
    """The S and P an unfused computation really holds, counted out and back, plus Q,K,V,O."""
    b, h, n, d = 2, 3, 11, 8
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float16) for _ in range(3))
    s = q @ k.transpose(-1, -2)
    p = s.float().softmax(-1).half()
    o = p @ v
    tensor_bytes = sum(t.numel() * t.element_size() for t in (q, k, v, o)) + 2 * (
        s.numel() * s.element_size() + p.numel() * p.element_size())
    assert io_model.naive_attention_bytes(n, d, heads=h, batch=b, dtype_bytes=2) == tensor_bytes


def test_naive_bytes_grow_as_n_squared():
    d = 64
    ratios = [io_model.naive_attention_bytes(2 * n, d) / io_model.naive_attention_bytes(n, d)
              for n in (1024, 8192, 65536)]
    assert all(3.5 < r <= 4 for r in ratios)
    assert ratios == sorted(ratios)  # tends to 4 as the N^2 terms dominate


# ----------------------------------------------------------------------------- flash
def test_flash_block_rows():
    assert io_model.flash_block_rows(d=2, sram_bytes=32, dtype_bytes=2) == 2  # 16 numbers / 8
    assert io_model.flash_block_rows(d=128, sram_bytes=100 * 1024, dtype_bytes=2) == 100
    with pytest.raises(ValueError, match="sram_bytes"):
        io_model.flash_block_rows(d=128, sram_bytes=512, dtype_bytes=2)


def test_flash_bytes_small_case_by_hand():
    # N=4, d=2, M = 16 numbers -> tiles of 2 rows, 2 tiles: Q and O once (8 numbers each),
    # K and V once per tile (2 x 8 numbers each); fp16.
    assert io_model.flash_attention_bytes(4, 2, dtype_bytes=2, sram_bytes=32) == (
        8 + 8 + 2 * 8 + 2 * 8) * 2 == 96
    # causal: tile 0 sees 2 keys, tile 1 sees 4 -> 6 rows of K and of V (12 numbers each)
    assert io_model.flash_attention_bytes(4, 2, dtype_bytes=2, sram_bytes=32, causal=True) == (
        8 + 8 + 12 + 12) * 2
    # ragged: N=5 with 2-row tiles -> 3 tiles
    io = io_model.flash_attention_io(5, 2, dtype_bytes=1, block_rows=2)
    assert io == {"read Q": 10, "read K": 30, "read V": 30, "write O": 10}
    with pytest.raises(ValueError, match="exactly one"):
        io_model.flash_attention_bytes(4, 2)


def test_flash_bytes_follow_theorem_2():
    """K/V traffic is exactly 8 N^2 d^2 / M numbers when N is a multiple of the tile."""
    d, bpe, m_bytes = 64, 2, 64 * 1024
    m = m_bytes // bpe
    rows = io_model.flash_block_rows(d, m_bytes, bpe)
    assert rows == m // (4 * d) == 128
    for n in (1024, 4096, 16384):
        total = io_model.flash_attention_bytes(n, d, dtype_bytes=bpe, sram_bytes=m_bytes)
        assert total == (2 * n * d + 8 * n * n * d * d // m) * bpe
    # doubling N: K/V part x4; doubling M: K/V part halves
    kv = [io_model.flash_attention_bytes(n, d, dtype_bytes=bpe, sram_bytes=m_bytes)
          - 2 * n * d * bpe for n in (4096, 8192)]
    assert kv[1] == 4 * kv[0]
    big_m = io_model.flash_attention_bytes(8192, d, dtype_bytes=bpe, sram_bytes=2 * m_bytes)
    assert big_m - 2 * 8192 * d * bpe == kv[1] // 2


def test_flash_moves_fewer_bytes_than_naive_and_the_gap_grows():
    d, m_bytes = 128, 192 * 1024
    gaps = [io_model.naive_attention_bytes(n, d) / io_model.flash_attention_bytes(
        n, d, sram_bytes=m_bytes) for n in (512, 2048, 8192)]
    assert 1 < gaps[0] < gaps[1] <= gaps[2]


# ----------------------------------------------------------------------------- decode
def test_paged_decode_bytes_by_hand():
    # context 10, d 4, 2 query heads on 1 kv head, fp16: K,V 40 numbers each, q and out 8 each
    assert io_model.paged_decode_bytes(10, 4, 2, 1) == (40 + 40 + 8 + 8) * 2
    io = io_model.paged_decode_io(10, 4, 2, 1, batch=3, block_size=4, num_splits=5)
    assert io["read block table"] == 3 * 3 * 4
    assert io["write partials"] == io["read partials"] == 3 * 2 * 5 * (4 + 1) * 4
    assert "write partials" not in io_model.paged_decode_io(10, 4, 2, 1)


def test_paged_decode_bytes_match_the_benchmark_records():
    """The GPU benchmark counted its bytes independently; the model must agree."""
    res = json.loads(RESULTS.read_text())
    cfg = res["paged_decode_config"]
    for row in res["paged_decode"]:
        assert io_model.paged_decode_bytes(row["context"], cfg["head_dim"], cfg["hq"],
                                           cfg["hkv"], batch=row["batch"],
                                           dtype_bytes=2) == row["bytes"]


def test_flops():
    assert io_model.attention_flops(3, 2) == 4 * 9 * 2
    assert io_model.attention_flops(4, 2, heads=3, batch=2, causal=True) == 4 * 16 * 2 * 6 // 2
    assert io_model.decode_flops(10, 4, 2, batch=3) == 4 * 10 * 4 * 2 * 3
    with pytest.raises(ValueError, match="n must be a positive int"):
        io_model.attention_flops(0, 2)


# ----------------------------------------------------------------------------- BPT
@pytest.fixture(scope="module")
def tiny_block(tiny):
    model, _ = tiny  # minillm.load_model("tiny", dtype="float32"), shared: only read here
    cfg = model.cfg
    t = 45
    cos, sin = rope_cos_sin(torch.arange(t), cfg.head_dim, cfg.rope_theta, torch.float32)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, t, cfg.d_model, generator=g)
    return model.layers[0], x, cos[None, None], sin[None, None]


@pytest.mark.parametrize("q_block", [1, 7, 16, 45, 100])
@torch.inference_mode()
def test_bpt_equals_the_unblocked_layer(tiny_block, q_block):
    layer, x, cos, sin = tiny_block
    want = layer(x, cos, sin)
    got = io_model.bpt_block(x, *io_model.layer_sublayers(layer, cos, sin), q_block)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bpt_with_explicit_parts_equals_plain_maths():
    """A layer written out by hand (reference attention, a ReLU MLP) against bpt_block."""
    g = torch.Generator().manual_seed(1)
    b, t, dm, h = 1, 13, 8, 2
    x = torch.randn(b, t, dm, generator=g, dtype=torch.float64)
    w1 = torch.randn(dm, 32, generator=g, dtype=torch.float64)
    w2 = torch.randn(32, dm, generator=g, dtype=torch.float64)

    def heads(z):
        return z.view(b, -1, h, dm // h).transpose(1, 2)

    def attn_fn(z, start, stop):
        o = reference_attention(heads(z[:, start:stop]), heads(z[:, :stop]), heads(z[:, :stop]))
        return o.transpose(1, 2).reshape(b, stop - start, dm)

    def ffn(z):
        return (z @ w1).relu() @ w2

    hid = x + attn_fn(x, 0, t)
    want = hid + ffn(hid)
    torch.testing.assert_close(io_model.bpt_block(x, attn_fn, ffn, 4), want)


@torch.inference_mode()
def test_bpt_blocks_must_come_in_order(tiny_block):
    layer, x, cos, sin = tiny_block
    attn_fn, _ = io_model.layer_sublayers(layer, cos, sin)
    with pytest.raises(ValueError, match="in order"):
        attn_fn(x, 5, 10)


@torch.inference_mode()
def test_bpt_largest_intermediate_is_one_block_of_ffn(tiny_block, monkeypatch):
    """Measured: the plain layer creates [B, T, ffn_dim] tensors; BPT at most [B, q, ffn_dim]
    (or the [B, T, D] residual stream itself, which any layer holds). Gate and up as separate
    matmuls (an engine that served the shared model may have grouped them into one
    [B, T, 2 ffn_dim] output: minillm.model.packed.PackedGroup)."""
    layer, x, cos, sin = tiny_block
    monkeypatch.setattr(layer.ffn, "input_group", None)
    monkeypatch.setattr(layer.attn, "input_group", None)
    b, t, dm = x.shape
    ffn_dim = layer.ffn.w_gate.out_features
    plain = io_model.largest_intermediate_bytes(lambda: layer(x, cos, sin))
    assert plain == b * t * ffn_dim * 4
    parts = io_model.layer_sublayers(layer, cos, sin)
    blocked = io_model.largest_intermediate_bytes(lambda: io_model.bpt_block(x, *parts, 4))
    assert blocked == max(b * 4 * ffn_dim, b * t * dm) * 4 < plain


def test_layer_peak_bytes_by_hand():
    p = io_model.layer_peak_bytes(t=100, d_model=8, ffn_dim=32, n_heads=2, dtype_bytes=2)
    assert p["peak"] == (2 * 100 * 8 + 3 * 100 * 32) * 2
    p = io_model.layer_peak_bytes(t=100, d_model=8, ffn_dim=32, n_heads=2, q_block=10,
                                  dtype_bytes=2, scores=True)
    assert p["attention scores"] == 2 * 10 * 100 * 2
    assert p["peak"] == (2 * 100 * 8 + max(3 * 10 * 32, 2 * 10 * 100)) * 2
    # BPT's peak grows linearly in T, the plain layer's with unfused attention quadratically
    plain = [io_model.layer_peak_bytes(t, 64, 256, 4, scores=True)["peak"] for t in (512, 1024)]
    bpt = [io_model.layer_peak_bytes(t, 64, 256, 4, q_block=64, scores=True)["peak"]
           for t in (512, 1024)]
    assert math.isclose(bpt[1] / bpt[0], 2, rel_tol=0.01) and plain[1] / plain[0] > 3
