"""Attention variants against PyTorch SDPA in float64 and against each other."""
import pytest
import torch
import torch.nn.functional as F

from minillm.course.ch01_variants import (
    MultiHeadAttention,
    MultiHeadLatentAttention,
    kv_cache_bytes_per_token,
    mha_to_gqa,
)

B, T, D = 2, 7, 48


def sdpa_reference(x, w_q, w_k, w_v, w_o, n_heads, n_kv_heads):
    """Causal attention from raw weight matrices: SDPA on KV heads repeated to n_heads."""
    def split(y, h):
        return y.view(B, T, h, -1).transpose(1, 2)
    q = split(x @ w_q.T, n_heads)
    k = split(x @ w_k.T, n_kv_heads).repeat_interleave(n_heads // n_kv_heads, dim=1)
    v = split(x @ w_v.T, n_kv_heads).repeat_interleave(n_heads // n_kv_heads, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(B, T, -1) @ w_o.T


def weights(m):
    return m.w_q.weight, m.w_k.weight, m.w_v.weight, m.w_o.weight


@pytest.mark.parametrize("n_heads,n_kv_heads,kind", [(4, 4, "mha"), (4, 2, "gqa"),
                                                      (6, 3, "gqa"), (4, 1, "mqa")])
def test_mha_gqa_mqa_match_sdpa(n_heads, n_kv_heads, kind):
    torch.manual_seed(0)
    attn = MultiHeadAttention(D, n_heads, n_kv_heads, head_dim=8).double()
    x = torch.randn(B, T, D, dtype=torch.float64)
    assert attn.kind == kind
    ref = sdpa_reference(x, *weights(attn), n_heads, n_kv_heads)
    torch.testing.assert_close(attn(x), ref, rtol=1e-10, atol=1e-10)


def test_attention_is_causal():
    torch.manual_seed(0)
    attn = MultiHeadAttention(D, 4, 2)
    x = torch.randn(B, T, D)
    y = x.clone()
    y[:, 4:] = torch.randn(B, T - 4, D)
    torch.testing.assert_close(attn(x)[:, :4], attn(y)[:, :4])
    assert not torch.allclose(attn(x)[:, 4:], attn(y)[:, 4:])


def test_bad_head_counts_are_rejected():
    with pytest.raises(ValueError, match="n_kv_heads"):
        MultiHeadAttention(D, 6, 4)
    with pytest.raises(ValueError, match="n_kv_heads"):
        mha_to_gqa(MultiHeadAttention(D, 6, 6), 4)


def test_mha_to_gqa_with_all_heads_is_identity():
    torch.manual_seed(0)
    mha = MultiHeadAttention(D, 6)
    same = mha_to_gqa(mha, 6)
    for a, b in zip(weights(mha), weights(same)):
        assert torch.equal(a, b)
    x = torch.randn(B, T, D)
    torch.testing.assert_close(same(x), mha(x), rtol=0, atol=0)


@pytest.mark.parametrize("n_kv_heads", [1, 2, 3])
def test_mha_to_gqa_mean_pools_kv_heads(n_kv_heads):
    torch.manual_seed(0)
    n_heads, head_dim = 6, 8
    mha = MultiHeadAttention(D, n_heads, head_dim=head_dim).double()
    gqa = mha_to_gqa(mha, n_kv_heads)
    group = n_heads // n_kv_heads

    def pooled(w):  # head-by-head loop, independent of the package's reshape
        rows = [sum(w[(g * group + i) * head_dim:(g * group + i + 1) * head_dim]
                    for i in range(group)) / group for g in range(n_kv_heads)]
        return torch.cat(rows)

    w_q, w_k, w_v, w_o = weights(mha)
    x = torch.randn(B, T, D, dtype=torch.float64)
    ref = sdpa_reference(x, w_q, pooled(w_k), pooled(w_v), w_o, n_heads, n_kv_heads)
    assert gqa.n_kv_heads == n_kv_heads
    torch.testing.assert_close(gqa(x), ref, rtol=1e-10, atol=1e-10)


def test_kv_cache_tensors_match_kv_bytes():
    torch.manual_seed(0)
    x = torch.randn(B, T, D, dtype=torch.float16)
    mla = MultiHeadLatentAttention(D, 4, 8, d_latent=12, d_rope=4).half()
    for m in (MultiHeadAttention(D, 4).half(), MultiHeadAttention(D, 4, 1).half(), mla):
        with torch.no_grad():
            cached = m.kv_cache_tensors(x)
        n_bytes = sum(t.numel() * t.element_size() for t in cached)
        assert n_bytes == m.kv_bytes_per_token(bytes_per_elem=2) * B * T


def test_kv_bytes_per_token_by_hand():
    assert kv_cache_bytes_per_token("mha", n_kv_heads=32, head_dim=128) == 2 * 32 * 128 * 2
    assert kv_cache_bytes_per_token("gqa", n_kv_heads=8, head_dim=128) == 4096
    assert kv_cache_bytes_per_token("mqa", head_dim=128, bytes_per_elem=4) == 1024
    assert kv_cache_bytes_per_token("mla", d_latent=512, d_rope=64) == 1152
    with pytest.raises(ValueError, match="kind"):
        kv_cache_bytes_per_token("sparse", head_dim=64)


def rope_complex(x, theta=10000.0):
    """RoPE as a complex rotation of the pairs (x_i, x_{i + d/2}) by position x angle_i."""
    d = x.shape[-1]
    angles = torch.arange(x.shape[-2], dtype=torch.float64)[:, None] * theta ** (
        -torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = torch.complex(*x.chunk(2, dim=-1)) * torch.polar(torch.ones_like(angles), angles)
    return torch.cat([z.real, z.imag], dim=-1)


@pytest.mark.parametrize("d_q_latent,d_rope", [(None, 0), (16, 0), (16, 4)])
def test_mla_naive_matches_sdpa(d_q_latent, d_rope):
    torch.manual_seed(0)
    h, hd, lat = 4, 8, 12
    mla = MultiHeadLatentAttention(D, h, hd, lat, d_q_latent, d_rope).double()
    x = torch.randn(B, T, D, dtype=torch.float64)
    c_q = x if d_q_latent is None else x @ mla.w_dq.weight.T
    c_kv = x @ mla.w_dkv.weight.T

    def split(y):
        return y.view(B, T, h, -1).transpose(1, 2)
    q, k, v = split(c_q @ mla.w_uq.weight.T), split(c_kv @ mla.w_uk.weight.T), split(
        c_kv @ mla.w_uv.weight.T)
    if d_rope:
        q_r = rope_complex(split(c_q @ mla.w_qr.weight.T))
        k_r = rope_complex(x @ mla.w_kr.weight.T)[:, None].expand(B, h, T, d_rope)
        q, k = torch.cat([q, q_r], dim=-1), torch.cat([k, k_r], dim=-1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = out.transpose(1, 2).reshape(B, T, -1) @ mla.w_o.weight.T
    tol = 1e-6 if d_rope else 1e-10   # the package computes RoPE angles in fp32
    torch.testing.assert_close(mla(x), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("d_q_latent,d_rope", [(None, 0), (24, 0), (24, 8)])
def test_mla_absorbed_matches_naive(d_q_latent, d_rope):
    torch.manual_seed(0)
    mla = MultiHeadLatentAttention(64, 8, 16, d_latent=32, d_q_latent=d_q_latent, d_rope=d_rope)
    x = torch.randn(3, 11, 64)
    with torch.no_grad():
        naive, absorbed = mla(x), mla.forward_absorbed(x)
    assert naive.abs().max() > 1e-2
    torch.testing.assert_close(absorbed, naive, rtol=1e-5, atol=1e-5)


def test_mla_cache_is_smaller_than_mha():
    # DeepSeek-V2's per-layer ratios scaled down 8x: d_c = 4 d_h, d_rope = d_h / 2.
    mla = MultiHeadLatentAttention(256, 16, 16, d_latent=64, d_q_latent=192, d_rope=8)
    mha = MultiHeadAttention(256, 16, 16, 16)
    gqa2, gqa4 = MultiHeadAttention(256, 16, 2, 16), MultiHeadAttention(256, 16, 4, 16)
    assert mla.kv_bytes_per_token() == (64 + 8) * 2
    # The paper (Table 1): MLA's cache equals GQA with 2.25 KV heads.
    assert mla.kv_bytes_per_token() == 2 * 2.25 * 16 * 2
    assert gqa2.kv_bytes_per_token() < mla.kv_bytes_per_token() < gqa4.kv_bytes_per_token()
    assert mla.kv_bytes_per_token() * 7 < mha.kv_bytes_per_token()   # 2 x 16 / 4.5 = 7.1
