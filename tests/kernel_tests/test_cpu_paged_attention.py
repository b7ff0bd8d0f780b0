"""The CPU paged-attention kernel (C++ via ctypes) against the float64 gather-then-attend
reference of ``minillm.kernels.paged_attention``; its input checks; the engine's fallback when
no compiler builds it."""
from __future__ import annotations

import pytest
import torch

from minillm.attention.kv_quant import Int8Blocks, dequantize_int8, quantize_int8
from minillm.device import setup_triton

setup_triton()
from minillm.kernels import cpu_paged_attention as kernel  # noqa: E402
from minillm.kernels.paged_attention import paged_prefill_reference  # noqa: E402

pytestmark = pytest.mark.skipif(not kernel.available(),
                                reason=f"CPU kernel not built: {kernel.unavailable_reason()}")


def make_case(hq=9, hkv=3, d=64, bs=16, ctx=(37, 0, 16, 100, 5, 250), new=(1, 1, 3, 7, 5, 64),
              dtype=torch.float32, seed=0):
    """Shuffled physical blocks; sequence i has ctx[i] cached and new[i] new tokens."""
    g = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in zip(ctx, new)]
    width = max(-(-n // bs) for n in lens)
    num_blocks = sum(-(-n // bs) for n in lens) + 7
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        k = -(-n // bs)
        tables[i, :k] = perm[used:used + k]
        used += k
    kc, vc = (torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype) for _ in range(2))
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=g).to(dtype)
    return q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32), cu


def reference(q, kc, vc, tables, lens, cu):
    return paged_prefill_reference(q.double(), kc.double(), vc.double(), tables, cu, lens)[0]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (4, 4, 128, 8), (6, 2, 40, 5),
                                          (2, 1, 16, 32), (8, 2, 64, 48), (9, 3, 64, 5)])
def test_matches_float64_reference(hq, hkv, d, bs, dtype, tol):
    """Head dims 64 and 128 (compiled for) and others (the generic loop), GQA and MHA, block
    sizes that do and do not divide the lengths (and, 48, blocks that the AVX512-BF16 path
    walks in three steps of 16 keys; 5, blocks of an odd number of keys, whose last key that
    path pairs with zeros); decodes and causal chunks over a prefix."""
    case = make_case(hq, hkv, d, bs, dtype=dtype, seed=d + bs)
    out = kernel.cpu_paged_attention(*case)
    assert out.dtype == dtype and out.shape == case[0].shape
    err = (out.double() - reference(*case)).abs().max().item()
    assert err < tol * (1 if dtype == torch.float32 else 4), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slots_past_a_sequence_are_never_read(dtype):
    """NaN in every cache slot that holds no token of a sequence (past its length, unused
    blocks): the output equals the clean cache's bit for bit. The bfloat16 path adds values two
    keys at a time, so an odd length's last key meets the slot after it (with weight zero, and
    zero times NaN is NaN)."""
    q, kc, vc, tables, lens, cu = make_case(dtype=dtype, seed=3)
    bs = kc.shape[1]
    want = kernel.cpu_paged_attention(q, kc, vc, tables, lens, cu)
    holds_token = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for i, n in enumerate(lens.tolist()):
        for p in range(n):
            holds_token[tables[i, p // bs], p % bs] = True
    assert (~holds_token).any() and any(n % 2 for n in lens.tolist())
    kc, vc = kc.clone(), vc.clone()
    kc[~holds_token] = float("nan")
    vc[~holds_token] = float("nan")
    assert torch.equal(kernel.cpu_paged_attention(q, kc, vc, tables, lens, cu), want)


def narrow(cache: torch.Tensor, fmt: torch.dtype):
    """(the cache stored as ``fmt``, what it reads back as in float64)."""
    if fmt == torch.int8:
        data, scale = quantize_int8(cache)
        return Int8Blocks(data, scale), dequantize_int8(data, scale, torch.float64)
    return cache.to(fmt), cache.to(fmt).double()


@pytest.mark.parametrize("dtype,fmt,tol", [(torch.float32, torch.bfloat16, 2e-6),
                                           (torch.float32, torch.int8, 2e-6),
                                           (torch.bfloat16, torch.int8, 1.6e-2)])
@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (6, 2, 40, 5)])
def test_a_narrow_cache_reads_back_as_stored(hq, hkv, d, bs, dtype, fmt, tol):
    """A bfloat16 cache below float32 queries, an int8 one (with per-token, per-head scales)
    below either: the kernel's output is float64 attention over the cache as stored, read
    back (bfloat16 widened, int8 times its scale), to the queries' own rounding."""
    q, kc, vc, tables, lens, cu = make_case(hq, hkv, d, bs, seed=d + bs)
    (k_store, k_read), (v_store, v_read) = narrow(kc, fmt), narrow(vc, fmt)
    q = q.to(dtype)
    out = kernel.cpu_paged_attention(q, k_store, v_store, tables, lens, cu)
    ref = paged_prefill_reference(q.double(), k_read, v_read, tables, cu, lens)[0]
    assert out.dtype == dtype
    err = (out.double() - ref).abs().max().item()
    assert err < tol * (1 if dtype == torch.float32 else 4), err
    if dtype == torch.float32:       # float32 queries see the storage's rounding
        exact = paged_prefill_reference(q.double(), kc.double(), vc.double(), tables, cu,
                                        lens)[0]
        assert (out.double() - exact).abs().max().item() > 100 * tol


def test_only_the_chosen_sequences_rows_are_written():
    q, kc, vc, tables, lens, cu = make_case()
    out = torch.full_like(q, 7.0)
    seqs = torch.tensor([3, 1], dtype=torch.int32)
    kernel.cpu_paged_attention(q, kc, vc, tables, lens, cu, seqs, out=out)
    ref = reference(q, kc, vc, tables, lens, cu)
    for i in range(len(lens)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        if i in (1, 3):
            torch.testing.assert_close(out[rows].double(), ref[rows], rtol=2e-6, atol=2e-6)
        else:
            assert (out[rows] == 7.0).all()


def on_one_thread_and_two(case: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's outputs for ``case`` on one thread and on two."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.cpu_paged_attention(*case)
        torch.set_num_threads(2)
        two = kernel.cpu_paged_attention(*case)
    finally:
        torch.set_num_threads(threads)
    return one, two


def test_one_thread_and_two_give_the_same_result():
    one, two = on_one_thread_and_two(make_case(seed=3))
    assert torch.equal(one, two)


BAD = {
    "q": lambda c: (c[0].half(), *c[1:]),
    "k_cache": lambda c: (c[0], c[1].transpose(1, 2), *c[2:]),
    "block_tables": lambda c: (*c[:3], c[3].long(), *c[4:]),
    "block_tables ": lambda c: (*c[:3], c[3] + 1000, *c[4:]),
    "seq_lens": lambda c: (*c[:4], c[4] + 10_000, c[5]),
    "cu_seqlens_q": lambda c: (*c[:5], c[5][:-1]),
    "head_dim": lambda c: (c[0][..., :32].contiguous(), *c[1:]),
    "k_cache and v_cache": lambda c: (c[0], c[1].half(), c[2].half(), *c[3:]),
    "scales": lambda c: (c[0], c[1].to(torch.int8), c[2].to(torch.int8), *c[3:]),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_names_the_parameter(name):
    with pytest.raises(ValueError, match=name.strip()):
        kernel.cpu_paged_attention(*BAD[name](make_case()))


def test_without_a_compiler_the_engine_falls_back_to_sdpa(no_compiler):
    from minillm.attention.paged import default_paged_backend

    no_compiler(kernel.LIBRARY)
    assert not kernel.available()
    assert "no-such-compiler" in kernel.unavailable_reason()
    assert default_paged_backend(torch.device("cpu"), torch.float32) == "sdpa"
    with pytest.raises(RuntimeError, match="unavailable"):
        kernel.cpu_paged_attention(*make_case())
    assert default_paged_backend(torch.device("cpu"), torch.float16) == "sdpa"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("new", [(7,), (2,), (40,), (5, 3)])
def test_fewer_sequences_than_threads_split_their_rows_alike(new, dtype, tol):
    """A verify step's rows at batch 1 are cut between the threads: still the float64
    reference, and bit for bit what one thread computes."""
    case = make_case(ctx=(37, 100)[:len(new)], new=new, dtype=dtype, seed=len(new))
    one, two = on_one_thread_and_two(case)
    err = (two.double() - reference(*case)).abs().max().item()
    assert err < tol * (1 if dtype == torch.float32 else 4), err
    assert torch.equal(one, two)
