"""Chapter 05 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import math

import torch
from lab_checks import checker_tests

from minillm.labs import ch05
from minillm.labs.solutions.ch05 import (
    bpt_block,
    flash_tiles,
    fused_bytes,
    merge,
    online_softmax,
    paged_decode,
)

# --- wrong solutions -----------------------------------------------------------------------


def online_softmax_no_rescale(m, l, acc, s, v):
    m_new = torch.maximum(m, s.max(dim=1).values)
    ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m - ref)
    p = torch.exp(s - ref[:, None])
    return m_new, l * alpha + p.sum(1), acc + p @ v  # forgot to rescale the old output


def online_softmax_nan_on_empty_rows(m, l, acc, s, v):
    m_new = torch.maximum(m, s.max(dim=1).values)  # -inf - (-inf) = NaN for empty rows
    alpha = torch.exp(m - m_new)
    p = torch.exp(s - m_new[:, None])
    return m_new, l * alpha + p.sum(1), acc * alpha[:, None] + p @ v


def online_softmax_no_max(m, l, acc, s, v):
    p = torch.exp(s)  # overflows for large scores
    return m, l + p.sum(1), acc + p @ v


def merge_plain_average(outs, lses):
    return sum(outs) / len(outs), torch.logsumexp(torch.stack(lses), dim=0)


def merge_nan_when_empty(outs, lses):
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    out = sum(torch.exp(part_lse - lse)[..., None] * o for o, part_lse in zip(outs, lses))
    return out, lse


def merge_first_two_only(outs, lses):
    return merge(outs[:2], lses[:2])


def naive_bytes(n, d, heads=1, batch=1, dtype_bytes=2):
    return (4 * n * d + 4 * n * n) * heads * batch * dtype_bytes  # S still counted


def fused_bytes_no_v(n, d, heads=1, batch=1, dtype_bytes=2):
    return (3 * n * d + 2 * n * n) * heads * batch * dtype_bytes


def flash_tiles_start_aligned(q, k, v, block_m, block_n):
    # causal mask from the first key (query i sees keys <= i), wrong when T < L
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    hidden = torch.arange(k.shape[-2])[None, :] > torch.arange(q.shape[-2])[:, None]
    return torch.softmax(s.masked_fill(hidden, float("-inf")), -1) @ v


def flash_tiles_untiled(q, k, v, block_m, block_n):
    # right numbers, but the whole [T, L] score matrix exists at once
    t, n = q.shape[-2], k.shape[-2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    hidden = torch.arange(n)[None, :] > torch.arange(t)[:, None] + (n - t)
    return torch.softmax(s.masked_fill(hidden, float("-inf")), -1) @ v


def flash_tiles_no_rescale(q, k, v, block_m, block_n):
    t, n, d = q.shape[-2], k.shape[-2], q.shape[-1]
    out = torch.empty_like(q)
    for i in range(0, t, block_m):
        qi = q[..., i:i + block_m, :] / math.sqrt(d)
        pos = torch.arange(i, i + qi.shape[-2]) + (n - t)
        m = torch.full(qi.shape[:-1], float("-inf"), dtype=q.dtype)
        den = torch.zeros(qi.shape[:-1], dtype=q.dtype)
        acc = torch.zeros_like(qi)
        for j in range(0, int(pos[-1]) + 1, block_n):
            s = qi @ k[..., j:j + block_n, :].transpose(-1, -2)
            s = s.masked_fill(torch.arange(j, j + s.shape[-1])[None, :] > pos[:, None],
                              float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            den = den * torch.exp(m - m_new) + p.sum(-1)
            acc = acc + p @ v[..., j:j + block_n, :]  # forgot alpha on the old output
            m = m_new
        out[..., i:i + block_m, :] = acc / den[..., None]
    return out


def _paged_torch(q, k_cache, v_cache, block_table, seq_lens, physical, n_read):
    out = torch.empty_like(q)
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // hkv
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        blocks = [physical(b, i) for i in range(-(-n // bs))]
        k = k_cache[blocks].reshape(-1, hkv, q.shape[2])[:n_read(n, bs)]
        v = v_cache[blocks].reshape(-1, hkv, q.shape[2])[:n_read(n, bs)]
        k, v = (x.transpose(0, 1).repeat_interleave(group, 0) for x in (k, v))
        s = (k @ q[b][:, :, None])[..., 0] / math.sqrt(q.shape[2])
        out[b] = (torch.softmax(s, -1)[:, None, :] @ v)[:, 0]
    return out


def paged_decode_ignores_table(q, k_cache, v_cache, block_table, seq_lens):
    # reads logical block i from physical block i, as if the cache were contiguous
    return _paged_torch(q, k_cache, v_cache, block_table, seq_lens,
                        lambda b, i: (b * block_table.shape[1] + i) % k_cache.shape[0],
                        lambda n, bs: n)


def paged_decode_no_mask(q, k_cache, v_cache, block_table, seq_lens):
    # attends over every slot of the last block, past the sequence's end
    return _paged_torch(q, k_cache, v_cache, block_table, seq_lens,
                        lambda b, i: int(block_table[b, i]), lambda n, bs: -(-n // bs) * bs)


def paged_decode_without_new_token(q, k_cache, v_cache, block_table, seq_lens):
    # attends over the tokens cached before this step, as if the new token's K/V were not
    # written yet (the engine writes it before attention)
    return _paged_torch(q, k_cache, v_cache, block_table, seq_lens,
                        lambda b, i: int(block_table[b, i]), lambda n, bs: max(n - 1, 1))


def bpt_whole_layer(x, attn_fn, ffn, q_block):
    h = x + attn_fn(x, 0, x.shape[1])  # right numbers, but the FFN sees all T rows at once
    return h + ffn(h)


def bpt_no_residual(x, attn_fn, ffn, q_block):
    out = torch.empty_like(x)
    for start in range(0, x.shape[1], q_block):
        stop = min(start + q_block, x.shape[1])
        h = x[:, start:stop] + attn_fn(x, start, stop)
        out[:, start:stop] = ffn(h)  # dropped the residual around the FFN
    return out


CHECKS = [
    (ch05.check_online_softmax, online_softmax, online_softmax_no_rescale),
    (ch05.check_online_softmax, online_softmax, online_softmax_nan_on_empty_rows),
    (ch05.check_online_softmax, online_softmax, online_softmax_no_max),
    (ch05.check_merge, merge, merge_plain_average),
    (ch05.check_merge, merge, merge_nan_when_empty),
    (ch05.check_merge, merge, merge_first_two_only),
    (ch05.check_fused_softmax_bytes, fused_bytes, naive_bytes),
    (ch05.check_fused_softmax_bytes, fused_bytes, fused_bytes_no_v),
    (ch05.check_flash_tiles, flash_tiles, flash_tiles_start_aligned),
    (ch05.check_flash_tiles, flash_tiles, flash_tiles_untiled),
    (ch05.check_flash_tiles, flash_tiles, flash_tiles_no_rescale),
    (ch05.check_flash_tiles_in_model, flash_tiles, flash_tiles_start_aligned),
    (ch05.check_flash_tiles_in_model, flash_tiles, flash_tiles_no_rescale),
    (ch05.check_paged_decode, paged_decode, paged_decode_ignores_table),
    (ch05.check_paged_decode, paged_decode, paged_decode_no_mask),
    (ch05.check_paged_decode_in_engine, paged_decode, paged_decode_ignores_table),
    (ch05.check_paged_decode_in_engine, paged_decode, paged_decode_without_new_token),
    (ch05.check_bpt_block, bpt_block, bpt_whole_layer),
    (ch05.check_bpt_block, bpt_block, bpt_no_residual),
]
IDS = ["online_no_rescale", "online_nan", "online_no_max", "merge_average", "merge_nan",
       "merge_two", "bytes_naive", "bytes_no_v", "flash_start_aligned", "flash_untiled",
       "flash_no_rescale", "in_model_start_aligned", "in_model_no_rescale",
       "paged_ignores_table", "paged_no_mask", "in_engine_ignores_table",
       "in_engine_without_new_token", "bpt_whole_layer", "bpt_no_residual"]


test_reference_passes, test_wrong_fails, test_stub_is_not_attempted = \
    checker_tests(CHECKS, IDS)
