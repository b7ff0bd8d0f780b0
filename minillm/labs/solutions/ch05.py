"""Chapter 05's key: reference solutions, written from the rules the chapter teaches."""
from __future__ import annotations

import math

import torch

from minillm.device import setup_triton
from minillm.labs import ch05

setup_triton()  # interpreter mode on a CPU: before triton is imported and the kernel defined
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


def online_softmax(m, l, acc, s, v):
    m_new = torch.maximum(m, s.max(dim=1).values)
    ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # all -inf so far
    alpha = torch.exp(m - ref)
    p = torch.exp(s - ref[:, None])
    return m_new, l * alpha + p.sum(1), acc * alpha[:, None] + p @ v


def merge(outs, lses):
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = sum(torch.exp(part_lse - safe)[..., None] * o for o, part_lse in zip(outs, lses))
    return out, lse


def fused_bytes(n, d, heads=1, batch=1, dtype_bytes=2):
    return (4 * n * d + 2 * n * n) * heads * batch * dtype_bytes


def flash_tiles(q, k, v, block_m, block_n):
    t, n, d = q.shape[-2], k.shape[-2], q.shape[-1]
    out = torch.empty_like(q)
    for i in range(0, t, block_m):
        qi = q[..., i:i + block_m, :] / math.sqrt(d)
        pos = torch.arange(i, i + qi.shape[-2]) + (n - t)  # positions of the tile's queries
        m = torch.full(qi.shape[:-1], float("-inf"), dtype=q.dtype)
        den = torch.zeros(qi.shape[:-1], dtype=q.dtype)
        acc = torch.zeros_like(qi)
        for j in range(0, int(pos[-1]) + 1, block_n):  # key tiles up to the last query
            s = qi @ k[..., j:j + block_n, :].transpose(-1, -2)
            keys = torch.arange(j, j + s.shape[-1])
            s = s.masked_fill(keys[None, :] > pos[:, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))  # finite: key 0 is visible to every query
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])
            den = den * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ v[..., j:j + block_n, :]
            m = m_new
        out[..., i:i + block_m, :] = acc / den[..., None]
    return out


@triton.jit
def _paged_decode_kernel(Q, KC, VC, Table, Lens, Out, max_blocks, hq, group, scale,
                         BLOCK_SIZE: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    offs_d = tl.arange(0, D)
    slots = tl.arange(0, BLOCK_SIZE)
    q = tl.load(Q + (b * hq + h) * D + offs_d)
    n = tl.load(Lens + b)
    kvh = h // group
    m = tl.full([1], float("-inf"), tl.float32)
    den = tl.zeros([1], tl.float32)
    acc = tl.zeros([D], tl.float32)
    for i in range(0, tl.cdiv(n, BLOCK_SIZE)):
        blk = tl.load(Table + b * max_blocks + i).to(tl.int64)  # logical block i -> physical
        valid = i * BLOCK_SIZE + slots < n
        rows = ((blk * BLOCK_SIZE + slots) * HKV + kvh) * D
        k = tl.load(KC + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(VC + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        s = tl.where(valid, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        den = den * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m = m_new
    tl.store(Out + (b * hq + h) * D + offs_d, acc / den)


def paged_decode(q, k_cache, v_cache, block_table, seq_lens):
    b, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    out = torch.empty_like(q)
    _paged_decode_kernel[(b, hq)](q.contiguous(), k_cache.contiguous(), v_cache.contiguous(),
                                  block_table.contiguous(), seq_lens, out,
                                  block_table.shape[1], hq, hq // hkv, 1 / math.sqrt(d),
                                  BLOCK_SIZE=block_size, HKV=hkv, D=d)
    return out


def bpt_block(x, attn_fn, ffn, q_block):
    blocks = []
    for start in range(0, x.shape[1], q_block):  # in order: attention keeps earlier K/V
        h = x[:, start:start + q_block] + attn_fn(x, start, min(start + q_block, x.shape[1]))
        blocks.append(h + ffn(h))  # the FFN sees at most q_block rows
    return torch.cat(blocks, dim=1)


KEY = [
    (ch05.check_online_softmax, online_softmax),
    (ch05.check_merge, merge),
    (ch05.check_fused_softmax_bytes, fused_bytes),
    (ch05.check_flash_tiles, flash_tiles),
    (ch05.check_flash_tiles_in_model, flash_tiles),
    (ch05.check_paged_decode, paged_decode),
    (ch05.check_paged_decode_in_engine, paged_decode),
    (ch05.check_bpt_block, bpt_block),
]
