"""The engine's paged attention against dense masked attention in float64
(:func:`minillm.attention.attention_with_lse` over each sequence's keys gathered by hand), on
shuffled physical blocks: decodes, verifications of 2-64 new tokens over a cached prefix, tree
masks, prompts with and without a cached prefix, a long chunk over a prefix, in one step."""
from __future__ import annotations

import pytest
import torch

from minillm.attention import attention_with_lse
from minillm.attention.paged import (
    QUERY_GROUP,
    batch_order,
    build_metadata,
    cpu_paged_attention,
    default_paged_backend,
    sdpa_paged_attention,
    triton_paged_attention,
    write_kv,
)


def random_tree(n: int, g: torch.Generator) -> torch.Tensor:
    """[n, n] bool: node i sees itself and its ancestors (node 0 is the root; each node's
    parent is an earlier node)."""
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    return mask


def random_mask(n: int, tree: bool | int, g: torch.Generator) -> torch.Tensor | None:
    """None (causal), a tree over the n new tokens (True), or a mask of width ``tree`` > n: a
    tree over the new tokens after random visibility of the ``tree - n`` cached keys before
    them (a drafter's tree level over its cached earlier levels)."""
    if tree is True or tree is False:
        return random_tree(n, g) if tree else None
    cached = torch.rand(n, tree - n, generator=g) < 0.5
    return torch.cat([cached, random_tree(n, g)], dim=1)


def dense_reference(q, k_cache, v_cache, tables, ctx_lens, q_lens, masks, block_size):
    """Each sequence alone: its keys read from its blocks, the mask written out, float64."""
    outs, row = [], 0
    for table, ctx, n, m in zip(tables, ctx_lens, q_lens, masks):
        slots = [table[p // block_size] * block_size + p % block_size for p in range(ctx + n)]
        keys = k_cache.flatten(0, 1)[slots].transpose(0, 1)[None]        # [1, Hkv, L, D]
        vals = v_cache.flatten(0, 1)[slots].transpose(0, 1)[None]
        new = torch.tril(torch.ones(n, n, dtype=torch.bool)) if m is None else m
        mask = torch.cat([torch.ones(n, ctx + n - new.shape[1], dtype=torch.bool), new], dim=1)
        out, _ = attention_with_lse(q[row:row + n].transpose(0, 1)[None], keys, vals, mask)
        outs.append(out[0].transpose(0, 1))
        row += n
    return torch.cat(outs)


def make_step(hq, hkv, d, block_size, shapes, seed, dtype=torch.float64, direct=False):
    """shapes: (cached tokens, new tokens, tree mask: False, True or its width) per sequence
    -> the step's tensors."""
    g = torch.Generator().manual_seed(seed)
    ctx_lens = [c for c, _, _ in shapes]
    q_lens = [n for _, n, _ in shapes]
    masks = [random_mask(n, tree, g) for _, n, tree in shapes]
    order = batch_order(ctx_lens, q_lens, [m is not None for m in masks])
    ctx_lens, q_lens, masks = ([x[i] for i in order] for x in (ctx_lens, q_lens, masks))
    num_blocks = 1024
    perm = torch.randperm(num_blocks, generator=g).tolist()   # shuffled physical blocks
    tables, used = [], 0
    for c, n in zip(ctx_lens, q_lens):
        k = -(-(c + n) // block_size)
        tables.append(perm[used:used + k])
        used += k
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g, dtype=dtype)
    meta = build_metadata(tables, ctx_lens, q_lens, block_size, torch.device("cpu"), masks,
                          q_per_kv=hq // hkv, direct=direct)
    total = sum(q_lens)
    q, k, v = (torch.randn(total, h, d, generator=g, dtype=dtype) for h in (hq, hkv, hkv))
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    ref = dense_reference(q.double(), k_cache.double(), v_cache.double(), tables, ctx_lens,
                          q_lens, masks, block_size).to(dtype)
    return (q, k, v, k_cache, v_cache, meta), ref


def mixed_shapes(block_size: int, seed: int) -> list[tuple[int, int, bool]]:
    g = torch.Generator().manual_seed(seed)
    decodes = [(int(n), 1, False) for n in torch.randint(1, 60, (QUERY_GROUP + 3,), generator=g)]
    verify = [(int(c), int(n), False) for c, n in zip(torch.randint(1, 80, (5,), generator=g),
                                                      [2, 5, 17, 64, 3])]
    trees = [(37, 7, True), (0, 6, True), (block_size, 12, True), (30, 5, 12), (9, 4, 13),
             (80, 6, 70)]                  # wider than 64 keys: not as kernel bits
    prompts = [(0, 23, False), (0, 1, False), (17, 9, False), (40, 100, False)]
    return decodes + verify + trees + prompts


@pytest.mark.parametrize("hq,hkv,d,block_size", [(9, 3, 64, 16), (8, 8, 32, 4), (8, 1, 16, 7)])
def test_sdpa_paged_attention_matches_dense_masked_attention(hq, hkv, d, block_size):
    args, ref = make_step(hq, hkv, d, block_size, mixed_shapes(block_size, hq), seed=block_size)
    torch.testing.assert_close(sdpa_paged_attention(*args), ref, rtol=1e-10, atol=1e-10)


needs_kernel = pytest.mark.skipif(default_paged_backend(torch.device("cpu"), torch.float32)
                                  != "cpu", reason="no C++ compiler built the CPU kernel")


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("hq,hkv,d,block_size", [(9, 3, 64, 16), (8, 8, 32, 4), (8, 1, 16, 7)])
def test_cpu_paged_attention_matches_dense_masked_attention(hq, hkv, d, block_size, dtype, tol):
    """The C++ kernel takes every sequence (meta.direct: decodes, verifications, prompts,
    chunks over a prefix, trees with their masks as bits) but one whose mask spans more than
    64 keys, which sdpa takes, in one mixed step; the result is float64 attention's."""
    shapes = mixed_shapes(block_size, hq)
    args, ref = make_step(hq, hkv, d, block_size, shapes, seed=block_size, dtype=dtype,
                          direct=True)
    meta = args[-1]
    assert meta.direct.numel() == len(shapes) - 1 and len(meta.groups) == 1
    assert not meta.singles and meta.row_bits is not None
    out = cpu_paged_attention(*args)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref.double(), rtol=tol, atol=tol)


def test_verifications_of_several_tokens_batch_together():
    """Sequences with a few new tokens each over a cached prefix share padded groups (one SDPA
    call per QUERY_GROUP sequences), not one call per sequence."""
    shapes = [(30 + i, 2 + i % 5, False) for i in range(20)]
    (*_, meta), _ = make_step(4, 2, 16, 8, shapes, seed=0)
    assert len(meta.groups) == 2 and not meta.singles


def test_bad_mask_shape_names_the_parameter():
    for ctx, shape in ((0, (2, 2)), (0, (3, 4)), (2, (3, 6)), (5, (3, 2))):
        with pytest.raises(ValueError, match=r"masks\[0\] must be \[q_len, w\]"):
            build_metadata([[0]], [ctx], [3], 16, torch.device("cpu"),
                           [torch.ones(*shape).bool()])


def test_triton_backend_matches_without_masks_and_falls_back_with_them():
    """The Triton kernels (interpreted on CPU, fp32) on a mixed step without tree masks, and
    the sdpa fallback on a step with them."""
    shapes = [(13, 1, False), (40, 1, False), (20, 3, False), (0, 9, False)]
    args, ref = make_step(4, 2, 16, 16, shapes, seed=1, dtype=torch.float32)
    torch.testing.assert_close(triton_paged_attention(*args), ref, rtol=2e-4, atol=2e-4)
    args, ref = make_step(4, 2, 16, 16, shapes + [(5, 4, True)], seed=2, dtype=torch.float32)
    torch.testing.assert_close(triton_paged_attention(*args), ref, rtol=2e-4, atol=2e-4)


def test_slot_mapping_follows_block_tables():
    meta = build_metadata([[7, 2], [5]], [17, 0], [1, 3], 16, torch.device("cpu"))
    # position 17 of the first sequence: logical block 1 -> physical 2, offset 1
    assert meta.slot_mapping.tolist() == [2 * 16 + 1, 5 * 16, 5 * 16 + 1, 5 * 16 + 2]
    assert meta.seq_lens.tolist() == [18, 3] and meta.cu_seqlens_q.tolist() == [0, 1, 4]


def test_named_backends_declare_what_they_read():
    """Each name is a PagedAttentionBackend: the function it names, and its declarations (only
    the C++ kernel reads ``meta.direct`` and lets the C++ forward stand in for it)."""
    from minillm.attention.paged import PAGED_BACKENDS, check_paged_backend, get_paged_backend

    fns = {"sdpa": sdpa_paged_attention, "triton": triton_paged_attention,
           "cpu": cpu_paged_attention}
    for name, backend in PAGED_BACKENDS.items():
        assert check_paged_backend(backend) is backend is get_paged_backend(name)
        assert backend.name == name and backend.fn is fns[name]
        assert backend.reads_direct == backend.cpu_fast_path == (name == "cpu")
    args, ref = make_step(4, 2, 16, 16, [(13, 1, False), (0, 9, False)], seed=3)
    torch.testing.assert_close(get_paged_backend("sdpa")(*args), ref)


def test_only_masks_within_the_causal_rule_go_to_the_kernel():
    """A tree's mask (each node sees earlier nodes only) is read as bits by the kernel; a
    bidirectional block (rows see later keys) or one wider than 64 keys is left to a group."""
    tree = random_tree(4, torch.Generator().manual_seed(0))
    both = torch.ones(4, 4, dtype=torch.bool)
    meta = build_metadata([[0, 1], [2, 3], [4, 5, 6, 7, 8]], [3, 3, 70], [4, 4, 4], 16,
                          torch.device("cpu"), [tree, both, torch.ones(4, 65).bool().tril(61)],
                          direct=True)
    assert meta.direct.tolist() == [0] and [(g.first, g.last) for g in meta.groups] == [(1, 3)]
    assert meta.row_bits[:4].tolist() == [sum(1 << j for j in range(4) if tree[t, j])
                                          for t in range(4)]
    assert meta.mask_from.tolist()[0] == 3 and meta.row_bits[4:].tolist() == [-1] * 8
