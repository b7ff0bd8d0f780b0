"""Triton kernels (minillm.kernels) against float64 torch references, in the interpreter on CPU.

The interpreter is slow, so shapes are tiny but chosen to hit the edges: odd lengths, lengths
that are not multiples of the tiles (the interpreter uses 32x16 attention tiles and 16-token
decode tiles), shuffled physical KV blocks with NaN in every slot that must not be read, GQA
ratios 1, 3 and 8, head_dim 64 and 128. fp32 and fp16 only: the interpreter has no bf16.
"""
from minillm.device import setup_triton

setup_triton()  # before any kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402
from minillm.kernels.flash_attention import (  # noqa: E402
    attention_reference,
    attention_varlen_reference,
    flash_attention,
    flash_attention_varlen,
)
from minillm.kernels.matmul import matmul  # noqa: E402
from minillm.kernels.merge_attention import (  # noqa: E402
    merge_attention_states,
    merge_attention_states_reference,
)
from minillm.kernels.paged_attention import (  # noqa: E402
    choose_num_splits,
    paged_decode_attention,
    paged_decode_reference,
    paged_prefill_attention,
    paged_prefill_reference,
)
from minillm.kernels.rmsnorm import rmsnorm  # noqa: E402
from minillm.kernels.rope import apply_rope  # noqa: E402
from minillm.kernels.softmax import softmax  # noqa: E402
from minillm.kernels.vector_add import vector_add  # noqa: E402

from minillm.attention import reference_attention  # noqa: E402
from minillm.model import RMSNorm, rope_cos_sin  # noqa: E402
from minillm.model import apply_rope as layers_apply_rope  # noqa: E402

if torch.cuda.is_available():  # these tests are about the interpreter; GPU runs use benchmarks/
    pytest.skip("kernel tests run in the Triton interpreter (CPU only)", allow_module_level=True)

TOL = {torch.float32: 2e-5, torch.float16: 1.5e-2}


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def f64(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.double() for t in tensors]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), atol=TOL[dtype],
                               rtol=TOL[dtype])


# ----------------------------------------------------------------------------- teaching kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_vector_add(dtype):
    x, y = randn(1000, dtype=dtype), randn(1000, dtype=dtype, seed=1)
    assert torch.equal(vector_add(x, y, block=256), x + y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(7, 33), (3, 130)])
def test_softmax(shape, dtype):
    x = randn(*shape, dtype=dtype) * 4
    assert_close(softmax(x), torch.softmax(x.double(), dim=-1), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rmsnorm_matches_layer(dtype):
    norm = RMSNorm(48).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(48, seed=3))
    x = randn(2, 5, 48, dtype=dtype)
    assert_close(rmsnorm(x, norm.weight.detach(), norm.eps), norm(x.double()).detach(), dtype)


@pytest.mark.parametrize("batched", [False, True])
def test_rope_matches_layer(batched):
    x = randn(2, 3, 13, 64)
    positions = torch.arange(13) + 5
    if batched:
        positions = torch.stack([positions, positions + 7])
    cos, sin = rope_cos_sin(positions, 64, 10000.0, torch.float64)
    c4, s4 = (cos[None, None], sin[None, None]) if not batched else (cos[:, None], sin[:, None])
    expected = layers_apply_rope(x.double(), c4, s4)
    assert_close(apply_rope(x, cos.float(), sin.float()), expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matmul_odd_shapes(dtype):
    a, b = randn(37, 45, dtype=dtype), randn(45, 29, dtype=dtype, seed=1)
    assert_close(matmul(a, b), a.double() @ b.double(), dtype)
    assert_close(matmul(a, b[:, :20].t().contiguous().t()), a.double() @ b[:, :20].double(),
                 dtype)  # a column-major b


# ----------------------------------------------------------------------------- flash attention
# (batch, Hq, Hkv, T, S, D, causal, dtype): GQA ratios 1/3/8, odd and ragged lengths, S > T.
FLASH_CASES = [
    (2, 2, 2, 37, 37, 64, True, torch.float32),
    (1, 3, 1, 37, 37, 64, False, torch.float32),
    (1, 8, 1, 5, 70, 64, True, torch.float32),
    (1, 8, 1, 33, 50, 128, False, torch.float32),
    (1, 3, 1, 1, 45, 128, True, torch.float32),
    (1, 2, 2, 64, 64, 128, True, torch.float32),
    (1, 6, 2, 50, 67, 64, True, torch.float16),
    (1, 2, 1, 19, 19, 128, False, torch.float16),
]


def _flash_id(c) -> str:
    return "b{}-hq{}-hkv{}-t{}-s{}-d{}-{}-{}".format(*c[:6], "causal" if c[6] else "full",
                                                    str(c[7])[6:])


@pytest.mark.parametrize("case", FLASH_CASES, ids=_flash_id)
def test_flash_attention(case):
    b, hq, hkv, t, s, d, causal, dtype = case
    q = randn(b, hq, t, d, dtype=dtype)
    k, v = randn(b, hkv, s, d, dtype=dtype, seed=1), randn(b, hkv, s, d, dtype=dtype, seed=2)
    out, lse = flash_attention(q, k, v, causal=causal)
    ref_out, ref_lse = attention_reference(*f64(q, k, v), causal=causal)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (b, hq, t)
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, dtype)


def test_flash_attention_matches_minillm_reference_and_strides():
    """Independent reference (minillm.attention) and a q/k/v that are [B, T, H, D] transposed."""
    qt, kt, vt = randn(2, 21, 6, 64), randn(2, 40, 2, 64, seed=1), randn(2, 40, 2, 64, seed=2)
    q, k, v = qt.transpose(1, 2), kt.transpose(1, 2), vt.transpose(1, 2)  # not contiguous
    out, _ = flash_attention(q, k, v, causal=True)
    assert_close(out, reference_attention(*f64(q, k, v)), torch.float32)


def test_flash_attention_scale():
    q, k, v = randn(1, 2, 9, 64), randn(1, 2, 9, 64, seed=1), randn(1, 2, 9, 64, seed=2)
    out, lse = flash_attention(q, k, v, causal=False, scale=0.3)
    ref_out, ref_lse = attention_reference(*f64(q, k, v), causal=False, scale=0.3)
    assert_close(out, ref_out, torch.float32)
    assert_close(lse, ref_lse, torch.float32)


@pytest.mark.parametrize("causal,dtype,d", [(True, torch.float32, 64), (False, torch.float16, 128)])
def test_flash_attention_varlen(causal, dtype, d):
    lens_q, lens_k = [5, 0, 37, 1], [9, 3, 40, 33]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = randn(sum(lens_q), 6, d, dtype=dtype)
    k, v = randn(sum(lens_k), 2, d, dtype=dtype, seed=1), randn(sum(lens_k), 2, d, dtype=dtype,
                                                               seed=2)
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, causal=causal)
    ref_out, ref_lse = attention_varlen_reference(*f64(q, k, v), cu_q, cu_k, causal=causal)
    assert lse.shape == (sum(lens_q), 6)
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, dtype)


# ----------------------------------------------------------------------------- paged attention
def make_paged(lens: list[int], block_size: int, hkv: int, d: int, dtype: torch.dtype,
               seed: int = 0):
    """Caches with shuffled physical blocks and two spare blocks; every slot that holds no
    token is NaN (so a kernel that reads one fails) and unused table entries point far away."""
    n_blocks = [-(-n // block_size) for n in lens]
    total = sum(n_blocks) + 2
    k_cache = torch.full((total, block_size, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    width = max(max(n_blocks), 1) + 1
    tables = torch.full((len(lens), width), 10**6, dtype=torch.int32)
    used = 0
    for i, (n, nb) in enumerate(zip(lens, n_blocks)):
        ids = perm[used:used + nb]
        used += nb
        tables[i, :nb] = ids.to(torch.int32)
        for pos in range(n):
            blk, slot = ids[pos // block_size], pos % block_size
            k_cache[blk, slot] = randn(hkv, d, dtype=dtype, seed=1000 * seed + 2 * pos + i)
            v_cache[blk, slot] = randn(hkv, d, dtype=dtype, seed=1000 * seed + 2 * pos + i + 1)
    return k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


# (lens, block_size, Hq, Hkv, D, dtype)
DECODE_CASES = [
    ([37, 1, 70], 16, 4, 4, 64, torch.float32),
    ([45, 32], 16, 6, 2, 128, torch.float32),
    ([61], 8, 8, 1, 64, torch.float32),
    ([17, 0, 50], 16, 3, 1, 64, torch.float16),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: "lens{}-bs{}-hq{}-hkv{}-d{}-{}".format(
    "_".join(map(str, c[0])), *c[1:5], str(c[5])[6:]))
def test_paged_decode(case):
    lens, block_size, hq, hkv, d, dtype = case
    k_cache, v_cache, tables, seq_lens = make_paged(lens, block_size, hkv, d, dtype)
    q = randn(len(lens), hq, d, dtype=dtype, seed=7)
    ref_out, ref_lse = paged_decode_reference(*f64(q, k_cache, v_cache), tables, seq_lens)
    for splits in (1, 3):
        out, lse = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens,
                                          num_splits=splits)
        empty = seq_lens == 0
        assert torch.all(out[empty] == 0) and torch.all(lse[empty] == float("-inf"))
        assert_close(out[~empty], ref_out[~empty], dtype)
        assert_close(lse[~empty], ref_lse[~empty], dtype)


def test_paged_decode_independent_of_split_count():
    k_cache, v_cache, tables, seq_lens = make_paged([70, 23], 16, 2, 64, torch.float32)
    q = randn(2, 6, 64, seed=3)
    base_out, base_lse = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens,
                                                num_splits=1)
    for splits in (2, 4, 7, None):  # 7 leaves some splits empty for the short sequence
        out, lse = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens,
                                          num_splits=splits)
        torch.testing.assert_close(out, base_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, base_lse, atol=1e-5, rtol=1e-5)


def test_choose_num_splits():
    assert choose_num_splits(batch=64, num_kv_heads=8, max_context=16384) == 1
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context=64) == 1
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context=16384) > 8
    assert (choose_num_splits(batch=1, num_kv_heads=8, max_context=1024)
            <= choose_num_splits(batch=1, num_kv_heads=8, max_context=4096))


# (lens, new tokens, block_size, Hq, Hkv, D, dtype): chunks after a prefix, a whole prompt,
# a single decode-like token.
PREFILL_CASES = [
    ([40, 33, 9], [7, 33, 1], 16, 3, 1, 64, torch.float32),
    ([70], [37], 16, 8, 1, 128, torch.float32),
    ([25, 50], [25, 19], 8, 4, 4, 64, torch.float16),
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: "lens{}-new{}-hq{}-hkv{}-d{}".format(
    "_".join(map(str, c[0])), "_".join(map(str, c[1])), *c[3:6]))
def test_paged_prefill(case):
    lens, new, block_size, hq, hkv, d, dtype = case
    k_cache, v_cache, tables, seq_lens = make_paged(lens, block_size, hkv, d, dtype, seed=1)
    cu_q = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    q = randn(sum(new), hq, d, dtype=dtype, seed=5)
    out, lse = paged_prefill_attention(q, k_cache, v_cache, tables, cu_q, seq_lens)
    ref_out, ref_lse = paged_prefill_reference(*f64(q, k_cache, v_cache), tables, cu_q, seq_lens)
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, dtype)


def test_paged_prefill_of_one_token_equals_decode():
    k_cache, v_cache, tables, seq_lens = make_paged([29, 48], 16, 2, 64, torch.float32)
    q = randn(2, 4, 64, seed=9)
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32)
    pre_out, pre_lse = paged_prefill_attention(q, k_cache, v_cache, tables, cu_q, seq_lens)
    dec_out, dec_lse = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens)
    torch.testing.assert_close(pre_out, dec_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pre_lse, dec_lse, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- merge
def test_merge_equals_attention_over_concatenation():
    """Shared prefix (keys 0..29) + suffix (keys 30..52), merged == attention over all 53."""
    q, k, v = randn(2, 4, 9, 64), randn(2, 2, 53, 64, seed=1), randn(2, 2, 53, 64, seed=2)
    out_a, lse_a = flash_attention(q, k[:, :, :30], v[:, :, :30], causal=False)
    out_b, lse_b = flash_attention(q, k[:, :, 30:], v[:, :, 30:], causal=True)
    out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = attention_reference(*f64(q, k, v), causal=True)
    assert_close(out, ref_out, torch.float32)
    assert_close(lse, ref_lse, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_kernel_matches_reference_with_empty_states(dtype):
    out_a, out_b = randn(3, 5, 128, dtype=dtype), randn(3, 5, 128, dtype=dtype, seed=1)
    lse_a, lse_b = randn(3, 5, seed=2) * 3, randn(3, 5, seed=3) * 3
    lse_a[0, 0] = float("-inf")  # a has no keys: the result is b
    lse_a[1, 1] = lse_b[1, 1] = float("-inf")  # neither has keys: 0 and -inf
    out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = merge_attention_states_reference(*f64(out_a, lse_a, out_b, lse_b))
    assert_close(out, ref_out, dtype)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert_close(lse[~torch.isinf(lse)], ref_lse[~torch.isinf(ref_lse)], torch.float32)
    assert torch.equal(out[0, 0], out_b[0, 0]) and torch.all(out[1, 1] == 0)


# ----------------------------------------------------------------------------- bad inputs
def _qkv(hq=4, hkv=2, t=8, s=8, d=64, dtype=torch.float32):
    return randn(1, hq, t, d, dtype=dtype), randn(1, hkv, s, d, dtype=dtype), randn(
        1, hkv, s, d, dtype=dtype)


def _paged(**over):
    k_cache, v_cache, tables, seq_lens = make_paged([20, 5], 16, 2, 64, torch.float32)
    k_cache, v_cache = k_cache.nan_to_num(), v_cache.nan_to_num()
    args = dict(q=randn(2, 4, 64), k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                seq_lens=seq_lens)
    args.update(over)
    return args


def _prefill(**over):
    args = _paged(q=randn(6, 4, 64), cu_seqlens_q=torch.tensor([0, 4, 6], dtype=torch.int32))
    args.update(over)
    return args


q0, k0, v0 = _qkv()
CU = torch.tensor([0, 8], dtype=torch.int32)
BAD_INPUTS = {
    "flash-k-dtype": (lambda: flash_attention(q0, k0.half(), v0), r"^k must have dtype"),
    "flash-q-rank": (lambda: flash_attention(q0[0], k0, v0), r"^q must have 4 dimensions"),
    "flash-kv-shape": (lambda: flash_attention(q0, k0, v0[:, :, :5]), r"k and v must have"),
    "flash-heads": (lambda: flash_attention(*_qkv(hq=3, hkv=2)), r"query heads \(3\)"),
    "flash-head-dim": (lambda: flash_attention(*_qkv(d=48)), r"head_dim must be a power"),
    "flash-q-d-mismatch": (lambda: flash_attention(q0[..., :32], k0, v0), r"same head_dim"),
    "flash-noncontig": (lambda: flash_attention(q0.transpose(2, 3), k0, v0), r"^q must"),
    "flash-causal-s<t": (lambda: flash_attention(*_qkv(t=9, s=4)), r"causal"),
    "flash-scale": (lambda: flash_attention(q0, k0, v0, scale=-1.0), r"^scale"),
    "flash-batch": (lambda: flash_attention(q0, k0.expand(2, -1, -1, -1),
                                            v0.expand(2, -1, -1, -1)), r"batch size"),
    "varlen-cu-dtype": (lambda: flash_attention_varlen(q0[0].transpose(0, 1), k0[0].transpose(
        0, 1), v0[0].transpose(0, 1), CU.long(), CU), r"^cu_seqlens_q must have dtype"),
    "varlen-cu-total": (lambda: flash_attention_varlen(q0[0].transpose(0, 1), k0[0].transpose(
        0, 1), v0[0].transpose(0, 1), CU, CU - torch.tensor([0, 1], dtype=torch.int32)),
        r"^cu_seqlens_k must start at 0 and end"),
    "varlen-cu-count": (lambda: flash_attention_varlen(q0[0].transpose(0, 1), k0[0].transpose(
        0, 1), v0[0].transpose(0, 1), CU, torch.tensor([0, 4, 8], dtype=torch.int32)),
        r"^cu_seqlens_k must have 2 entries"),
    "decode-table-dtype": (lambda: paged_decode_attention(
        **_paged(block_tables=_paged()["block_tables"].long())), r"^block_tables must have dtype"),
    "decode-seq-lens-count": (lambda: paged_decode_attention(
        **_paged(seq_lens=torch.tensor([3], dtype=torch.int32))), r"^seq_lens must have one"),
    "decode-cache-shape": (lambda: paged_decode_attention(
        **_paged(v_cache=_paged()["v_cache"][:, :8])), r"k_cache and v_cache must have"),
    "decode-cache-dtype": (lambda: paged_decode_attention(
        **_paged(k_cache=_paged()["k_cache"].half())), r"^k_cache must have dtype"),
    "decode-heads": (lambda: paged_decode_attention(**_paged(q=randn(2, 3, 64))),
                     r"query heads \(3\)"),
    "decode-seq-too-long": (lambda: paged_decode_attention(
        **_paged(seq_lens=torch.tensor([20, 99], dtype=torch.int32))), r"^seq_lens must be in"),
    "decode-block-id": (lambda: paged_decode_attention(
        **_paged(block_tables=torch.full((2, 3), 50, dtype=torch.int32))),
        r"^block_tables entries"),
    "decode-splits": (lambda: paged_decode_attention(**_paged(), num_splits=0), r"^num_splits"),
    "decode-q-noncontig": (lambda: paged_decode_attention(
        **_paged(q=randn(2, 64, 4).transpose(1, 2))), r"^q must be contiguous"),
    "prefill-new>cached": (lambda: paged_prefill_attention(
        **_prefill(seq_lens=torch.tensor([20, 1], dtype=torch.int32))), r"^seq_lens must include"),
    "prefill-cu-total": (lambda: paged_prefill_attention(
        **_prefill(cu_seqlens_q=torch.tensor([0, 4, 5], dtype=torch.int32))), r"^cu_seqlens_q"),
    "merge-lse-shape": (lambda: merge_attention_states(randn(3, 8), randn(4), randn(3, 8),
                                                       randn(3)), r"^lse_a must have shape"),
    "merge-lse-dtype": (lambda: merge_attention_states(randn(3, 8), randn(3), randn(3, 8),
                                                       randn(3).half()), r"^lse_b must have dtype"),
    "merge-noncontig": (lambda: merge_attention_states(randn(8, 3).t(), randn(3), randn(3, 8),
                                                       randn(3)), r"^out_a must be contiguous"),
    "vector-add-shape": (lambda: vector_add(randn(5), randn(6)), r"x.shape and y.shape"),
    "softmax-rank": (lambda: softmax(randn(2, 3, 4)), r"^x must have 2 dimensions"),
    "rmsnorm-weight": (lambda: rmsnorm(randn(2, 8), randn(7)), r"^weight must have shape"),
    "rope-cos-shape": (lambda: apply_rope(randn(1, 2, 5, 8), randn(4, 8), randn(4, 8)),
                       r"^cos must have shape"),
    "matmul-k": (lambda: matmul(randn(3, 4), randn(5, 2)), r"disagree on K"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises_named_value_error(name):
    call, message = BAD_INPUTS[name]
    with pytest.raises(ValueError, match=message):
        call()
