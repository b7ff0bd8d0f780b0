"""Checkers for the exercises of chapter 05 (I/O-aware kernels).

Each ``check_*`` takes the student's function, compares it with a float64 computation or with
:mod:`minillm.course.ch05_io_model` on a few cases (edge cases included), prints a one-line
verdict and returns a :class:`~minillm.labs.common.Result` (``passed`` is None while the
exercise still raises NotImplementedError). :func:`check_paged_decode` runs the student's Triton
launcher, so Triton must already be in interpreter mode on a CPU
(:func:`minillm.device.setup_triton` before the kernel is defined); this module imports no
Triton itself.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..course import ch05_io_model as io_model
from ..device import default_device
from .common import Result, check


def _softmax_attention(s: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(s) v and logsumexp(s) in float64; rows with no finite score give 0 and -inf."""
    s, v = s.double(), v.double()
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(s - safe[..., None]) @ v, lse


def check_online_softmax(fn: Callable) -> Result:
    """``fn(m, l, acc, s, v)`` -> (m, l, acc): fold one tile of scores into the running state.

    m [R] running max, l [R] running sum of exp(score - m), acc [R, D] running sum of
    exp(score - m) * v (not yet divided by l); s [R, N] the tile's scores (natural units, -inf
    where masked), v [N, D]. Start: m = -inf, l = 0, acc = 0; after the last tile,
    out = acc / l. The checker streams tiles of random scores (some large enough that exp
    overflows without the max, some tiles masked for some rows, one row masked in the first
    tiles) and compares acc / l with softmax(scores) @ v in float64.
    """
    gen = torch.Generator().manual_seed(5)

    def run(s: torch.Tensor, v: torch.Tensor, tile: int) -> torch.Tensor:
        rows, d = s.shape[0], v.shape[1]
        m = torch.full((rows,), float("-inf"))
        l = torch.zeros(rows)
        acc = torch.zeros(rows, d)
        for start in range(0, s.shape[1], tile):
            m, l, acc = fn(m, l, acc, s[:, start:start + tile], v[start:start + tile])
            assert not torch.isnan(acc).any() and not torch.isnan(l).any(), (
                f"NaN in the state after the tile starting at key {start} (a row whose "
                "scores so far are all -inf must keep m = -inf, l = 0, acc = 0)")
        return acc / l[:, None]

    def attempt() -> None:
        for rows, n, d, tile, scale in ((1, 8, 4, 8, 1.0), (3, 20, 5, 4, 3.0),
                                        (4, 37, 8, 16, 150.0), (2, 9, 3, 1, 1.0)):
            s = torch.randn(rows, n, generator=gen) * scale
            v = torch.randn(n, d, generator=gen)
            got = run(s, v, tile)
            want, _ = _softmax_attention(s, v)
            err = (got.double() - want).abs().max().item()
            assert err < 1e-4, (f"{rows} rows, {n} keys in tiles of {tile}, scores up to "
                                f"{s.abs().max():.0f}: acc / l differs from softmax(s) @ v by "
                                f"{err:.2e}")
        s = torch.randn(3, 24, generator=gen)
        s[0, 14:] = float("-inf")  # a ragged end: later tiles fully masked for row 0
        s[1, :10] = float("-inf")  # row 1 sees nothing in the first tiles
        s[2, ::2] = float("-inf")
        v = torch.randn(24, 6, generator=gen)
        got = run(s, v, 5)
        want, _ = _softmax_attention(s, v)
        err = (got.double() - want).abs().max().item()
        assert err < 1e-5, f"with masked (-inf) scores: off by {err:.2e}"

    return check("online_softmax", attempt)


def check_merge(fn: Callable) -> Result:
    """``fn(outs, lses)`` -> (out, lse): combine attention computed over disjoint key sets.

    outs: list of [..., D] tensors, lses: list of [...] natural-log log-sum-exps of each part's
    scores (-inf for a part with no keys). Returns attention over the union of the keys and its
    log-sum-exp. Checked against attention over the concatenated keys (float64), for 2 to 5
    parts, with huge score offsets and with empty parts.
    """
    gen = torch.Generator().manual_seed(6)

    def attempt() -> None:
        cases = ((2, [7, 9], 1.0), (3, [1, 16, 5], 4.0), (5, [3, 3, 3, 3, 3], 80.0),
                 (3, [6, 0, 4], 1.0))
        for rows, sizes, scale in cases:
            s = torch.randn(rows, sum(sizes), generator=gen, dtype=torch.float64) * scale
            v = torch.randn(sum(sizes), 4, generator=gen, dtype=torch.float64)
            outs, lses = [], []
            for part_s, part_v in zip(s.split(sizes, dim=1), v.split(sizes)):
                o, lse = _softmax_attention(part_s, part_v)
                outs.append(o)
                lses.append(lse)
            out, lse = fn(outs, lses)
            want_out, want_lse = _softmax_attention(s, v)
            where = f"{len(sizes)} parts of {sizes} keys, score scale {scale}"
            assert tuple(out.shape) == tuple(want_out.shape), (
                f"{where}: out has shape {tuple(out.shape)}, expected {tuple(want_out.shape)}")
            err = (out - want_out).abs().max().item()
            assert err < 1e-9, (f"{where}: merged out differs from attention over all keys "
                                f"by {err:.2e}")
            err = (lse - want_lse).abs().max().item()
            assert err < 1e-9, (f"{where}: merged lse differs from logsumexp over all keys "
                                f"by {err:.2e}")
        empty = [torch.zeros(2, 4, dtype=torch.float64)] * 2
        out, lse = fn(empty, [torch.full((2,), float("-inf"), dtype=torch.float64)] * 2)
        assert torch.all(out == 0) and torch.all(lse == float("-inf")), (
            "two parts with no keys must merge to out 0, lse -inf (and no NaN)")

    return check("merge", attempt)


def check_fused_softmax_bytes(fn: Callable[..., int]) -> Result:
    """``fn(n, d, heads=1, batch=1, dtype_bytes=2)`` -> HBM bytes of attention done in two
    kernels: kernel 1 computes S = Q K^T *and* its softmax on chip, writing only P; kernel 2
    reads P and V and writes O. Compared with the naive count of
    :mod:`minillm.course.ch05_io_model` minus
    the traffic of S."""
    cases = ((3, 2, 1, 1, 2), (1024, 64, 1, 1, 2), (4096, 128, 32, 4, 2), (17, 16, 3, 2, 4))

    def attempt() -> None:
        for n, d, h, b, bpe in cases:
            got = fn(n, d, heads=h, batch=b, dtype_bytes=bpe)
            io = io_model.naive_attention_io(n, d, h, b, bpe)
            want = sum(io.values()) - io["write S"] - io["read S"]
            assert got == want, (f"n={n}, d={d}, heads={h}, batch={b}, dtype_bytes={bpe}: got "
                                 f"{got}, expected {want}")

    return check("fused_softmax_bytes", attempt)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 causal attention, q [H, T, d], k/v [H, L, d] -> [H, T, d]; the T queries are the
    last T of the L positions (query i sees keys j <= L - T + i)."""
    t, n = q.shape[-2], k.shape[-2]
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    hidden = torch.arange(n)[None, :] > torch.arange(t)[:, None] + (n - t)
    return torch.softmax(s.masked_fill(hidden, float("-inf")), dim=-1) @ v.double()


def check_flash_tiles(fn: Callable) -> Result:
    """``fn(q, k, v, block_m, block_n)`` -> out: causal attention computed tile by tile.

    q [H, T, d], k and v [H, L, d] (T <= L; the queries are the last T positions, so query i
    sees keys j <= L - T + i), scale 1/sqrt(d). Queries go in tiles of ``block_m`` rows, keys
    in tiles of ``block_n``; sizes need not be multiples of the tiles. Compared with float64
    attention on several shapes; on one long case the checker also watches every tensor the
    function creates: none may be as large as the [T, L] score matrix of a head.
    """
    from ..course.ch05_io_model import largest_intermediate_bytes

    gen = torch.Generator().manual_seed(7)

    def attempt() -> None:
        for h, t, n, d, bm, bn in ((1, 8, 8, 4, 4, 4), (2, 7, 7, 8, 4, 4), (2, 5, 13, 8, 2, 3),
                                   (3, 1, 9, 4, 4, 4), (1, 16, 16, 8, 16, 16),
                                   (2, 10, 21, 4, 3, 8)):
            q, k, v = (torch.randn(h, x, d, generator=gen, dtype=torch.float64)
                       for x in (t, n, n))
            got = fn(q, k, v, bm, bn)
            want = _causal_attention(q, k, v)
            where = f"H={h}, T={t}, L={n}, d={d}, block_m={bm}, block_n={bn}"
            assert tuple(got.shape) == tuple(want.shape), (
                f"{where}: out has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
            err = (got.double() - want).abs().max().item()
            assert err < 1e-9, f"{where}: differs from causal attention by {err:.2e}"
        t, d, bm, bn = 96, 4, 16, 16
        q, k, v = (torch.randn(1, t, d, generator=gen, dtype=torch.float64) for _ in range(3))
        largest = largest_intermediate_bytes(lambda: fn(q, k, v, bm, bn))
        scores = t * t * 8
        assert largest < scores, (
            f"T=L={t}, tiles {bm}x{bn}: a {largest:,}-byte tensor was created, as large as the "
            f"{t}x{t} score matrix ({scores:,} bytes): compute the scores one tile at a time")

    return check("flash_tiles", attempt)


def _paged_case(lens: list[int], block_size: int, hq: int, hkv: int, d: int,
                gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(q, k_cache, v_cache, block_table, seq_lens, k, v): sequences of ``lens`` tokens with
    their K/V [Hkv, n, d] (the lists k, v) scattered over shuffled blocks of a pool whose unused
    slots hold large noise, so reading past a sequence's end or through the wrong block shows."""
    need = [-(-n // block_size) for n in lens]
    n_blocks = sum(need) + 2
    k_cache = torch.randn(n_blocks, block_size, hkv, d, generator=gen) * 30
    v_cache = torch.randn(n_blocks, block_size, hkv, d, generator=gen) * 30
    perm = torch.randperm(n_blocks, generator=gen)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    ks, vs, used = [], [], 0
    for b, (n, nb) in enumerate(zip(lens, need)):
        table[b, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
        k, v = torch.randn(hkv, n, d, generator=gen), torch.randn(hkv, n, d, generator=gen)
        for pos in range(n):
            blk, slot = int(table[b, pos // block_size]), pos % block_size
            k_cache[blk, slot], v_cache[blk, slot] = k[:, pos], v[:, pos]
        ks.append(k)
        vs.append(v)
    q = torch.randn(len(lens), hq, d, generator=gen)
    return q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), ks, vs


def check_paged_decode(fn: Callable) -> Result:
    """``fn(q, k_cache, v_cache, block_table, seq_lens)`` -> out [B, Hq, D] float32: one decode
    step of attention over a paged KV cache, computed by the student's Triton kernel.

    q [B, Hq, D] fp32 (one new query per sequence); k_cache, v_cache [num_blocks, block_size,
    Hkv, D] fp32; block_table int32 [B, max_blocks] (logical block i of sequence b is physical
    block ``block_table[b, i]``; entries past the last block are never read); seq_lens int32
    [B]. Query head h uses KV head h // (Hq // Hkv); scale 1/sqrt(D); no causal mask (the query
    is the last position). Compared with float64 attention over each sequence's contiguous K/V
    for lengths that are and are not multiples of the block size.
    """
    gen = torch.Generator().manual_seed(8)

    def attempt() -> None:
        for lens, bs, hq, hkv, d in (([5], 4, 1, 1, 16), ([16, 3, 9], 4, 4, 2, 16),
                                     ([1, 33], 16, 2, 1, 32), ([8, 8], 8, 2, 2, 16)):
            q, kc, vc, table, seq_lens, ks, vs = _paged_case(lens, bs, hq, hkv, d, gen)
            dev = default_device()  # the GPU when there is one, else the interpreter's CPU
            got = fn(*(t.to(dev) for t in (q, kc, vc, table, seq_lens))).cpu()
            where = f"seq_lens {lens}, block_size {bs}, Hq={hq}, Hkv={hkv}, D={d}"
            assert tuple(got.shape) == tuple(q.shape), (
                f"{where}: out has shape {tuple(got.shape)}, expected {tuple(q.shape)}")
            group = hq // hkv
            for b, (k, v) in enumerate(zip(ks, vs)):
                kq = k.double().repeat_interleave(group, 0)  # [Hq, n, d]
                vq = v.double().repeat_interleave(group, 0)
                s = (kq @ q[b].double()[:, :, None])[..., 0] / math.sqrt(d)  # [Hq, n]
                want = (torch.softmax(s, -1)[:, None, :] @ vq)[:, 0]
                err = (got[b].double() - want).abs().max().item()
                assert err < 1e-4, (
                    f"{where}: sequence {b} ({lens[b]} tokens) differs from attention over its "
                    f"K/V by {err:.2e}")

    return check("paged_decode", attempt)


def check_bpt_block(fn: Callable) -> Result:
    """``fn(x, attn_fn, ffn, q_block)`` -> out [B, T, D]: one pre-norm layer done block by block
    (the Blockwise Parallel Transformer). ``attn_fn(x, start, stop)`` -> [B, stop - start, D]
    is the attention sublayer for query rows start:stop (keys 0:stop); ``ffn(h)`` the FFN
    sublayer for rows h [B, n, D]; the layer is out = h + ffn(h) with h = x + attention.
    Compared with :func:`minillm.course.ch05_io_model.bpt_block`, with T a multiple of
    ``q_block`` and not; the FFN must never see more than ``q_block`` rows, and blocks must
    come in order.
    """
    from ..course.ch05_io_model import bpt_block

    gen = torch.Generator().manual_seed(9)

    def sublayers(w: torch.Tensor, calls: list) -> tuple[Callable, Callable]:
        def attn_fn(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
            calls.append(("attn", start, stop))
            return torch.cumsum(x[:, :stop], dim=1)[:, start:stop] / torch.arange(
                start + 1, stop + 1, dtype=x.dtype)[None, :, None]  # mean of keys 0..i

        def ffn(h: torch.Tensor) -> torch.Tensor:
            calls.append(("ffn", h.shape[1]))
            return torch.tanh(h @ w)

        return attn_fn, ffn

    def attempt() -> None:
        for b, t, d, q_block in ((1, 8, 4, 4), (2, 13, 6, 4), (1, 5, 3, 8), (2, 9, 4, 1)):
            x = torch.randn(b, t, d, generator=gen, dtype=torch.float64)
            w = torch.randn(d, d, generator=gen, dtype=torch.float64)
            calls: list = []
            got = fn(x, *sublayers(w, calls), q_block)
            want = bpt_block(x, *sublayers(w, []), q_block)
            where = f"B={b}, T={t}, D={d}, q_block={q_block}"
            assert tuple(got.shape) == tuple(want.shape), (
                f"{where}: out has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
            err = (got - want).abs().max().item()
            assert err < 1e-12, f"{where}: differs from the layer by {err:.2e}"
            rows = max((c[1] for c in calls if c[0] == "ffn"), default=0)
            assert rows <= q_block, (
                f"{where}: the FFN ran on {rows} rows at once; BPT runs it on at most q_block "
                f"= {q_block} rows, one block at a time")
            starts = [c[1] for c in calls if c[0] == "attn"]
            assert starts == sorted(starts), f"{where}: blocks must come in order, got {starts}"

    return check("bpt_block", attempt)
