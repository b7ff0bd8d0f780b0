"""Checkers for the exercises of chapter 05 (I/O-aware kernels).

Each ``check_*`` takes the student's function, compares it with a float64 computation or with
:mod:`minillm.course.ch05_io_model` on a few cases (edge cases included), prints a one-line
verdict and returns a :class:`~minillm.labs.common.Result` (``passed`` is None while the
exercise still raises NotImplementedError). :func:`check_paged_decode` runs the student's Triton
launcher, so Triton must already be in interpreter mode on a CPU
(:func:`minillm.device.setup_triton` before the kernel is defined); this module imports no
Triton itself.

Two builds then run inside the model and the engine: :func:`check_flash_tiles_in_model` makes
the student's tile loop every layer's attention (:class:`TiledAttention`, the model's
``Attention.backend`` seam), :func:`check_paged_decode_in_engine` makes their Triton decode
kernel the engine's attention for every decode step (:class:`DecodeKernelAttention`, the
``EngineConfig(attention_backend=...)`` seam).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from ..attention import reference_attention
from ..attention.paged import PagedMetadata, sdpa_paged_attention
from ..cache import KVCache
from ..course import ch05_io_model as io_model
from ..device import default_device
from ..engine import EngineConfig, LLMEngine
from ..model.transformer import Transformer
from .common import Result, check
from .in_engine import assert_same_tokens, attention_set, demo_model, demo_prompts, serve_greedy


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


# --- the student's code inside the model and the engine --------------------------------------


class TiledAttention:
    """The model's attention backend (``Attention.backend``: q [B, H, T, D], k, v [B, Hkv, L, D],
    the T queries the last T of the L positions -> [B, H, T, D]) computed by ``fn``, a function
    with exercise 3's contract (``fn(q, k, v, block_m, block_n)`` on one sequence's [H, T, d]
    and [H, L, d]). The adapter repeats each KV head for its query heads, hands ``fn`` each
    sequence in float64 on the CPU (where the exercise was checked) and returns the result in
    q's dtype and device. Every call is compared with float64 attention on the same inputs
    (:func:`~minillm.attention.reference_attention`): ``calls`` lists (T, L, largest
    difference); a wrong shape or a difference over ``tol`` raises AssertionError from inside
    the forward pass. ``fn`` None: the adapter returns that float64 attention itself (the
    reference run, with the same casts as the student's)."""

    def __init__(self, fn: Callable[..., torch.Tensor] | None, block_m: int, block_n: int,
                 tol: float = 1e-9) -> None:
        self.fn, self.block_m, self.block_n, self.tol = fn, block_m, block_n, tol
        self.calls: list[tuple[int, int, float]] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        q64 = q.detach().double().cpu()
        k64, v64 = (x.detach().double().cpu().repeat_interleave(group, 1) for x in (k, v))
        want = reference_attention(q64, k64, v64)
        if self.fn is None:
            return want.to(q.device, q.dtype)
        outs = [self.fn(q64[b], k64[b], v64[b], self.block_m, self.block_n)
                for b in range(q.shape[0])]
        t, n = q.shape[2], k.shape[2]
        where = f"a call with T={t} queries over L={n} keys ({q.shape[1]} heads)"
        for out in outs:
            assert tuple(out.shape) == tuple(want.shape[1:]), (
                f"{where}: out has shape {tuple(out.shape)}, expected {tuple(want.shape[1:])}")
        out = torch.stack(outs)
        err = (out.double() - want).abs().max().item()
        self.calls.append((t, n, err))
        hint = " (the queries are the last T of L positions: query i sees keys j <= L - T + i)"
        assert err < self.tol, (f"{where}: differs from causal attention by {err:.2e}"
                                + (hint if t < n else ""))
        return out.to(q.device, q.dtype)


def _greedy(model: Transformer, backend: Callable, prompt: list[int], n_new: int) -> dict:
    """``n_new`` greedy tokens after ``prompt`` with a contiguous KV cache (a prefill of the
    whole prompt, T = L, then one query per step over every cached key), every layer's
    attention computed by ``backend`` (restored afterwards): the tokens, the logits of each
    step [n_new, vocab] and the seconds."""
    cache = KVCache(model.cfg, 1, len(prompt) + n_new, model.device, model.dtype)
    x, tokens, logits = torch.tensor([prompt], device=model.device), [], []
    with attention_set(model, backend), torch.inference_mode():
        t0 = time.perf_counter()
        for _ in range(n_new):
            logits.append(model(x, cache=cache, last_only=True)[0, -1].float().cpu())
            tokens.append(int(logits[-1].argmax()))
            x = torch.tensor([[tokens[-1]]], device=model.device)
    return {"tokens": tokens, "logits": torch.stack(logits), "seconds": time.perf_counter() - t0}


def check_flash_tiles_in_model(fn: Callable[..., torch.Tensor], model: Transformer | None = None,
                               prompt: list[int] | None = None, max_tokens: int = 5,
                               block_m: int = 16, block_n: int = 16) -> Result:
    """Exercise 3's tile loop is every layer's attention (:class:`TiledAttention`) while the
    model generates ``max_tokens`` greedy tokens after ``prompt`` with a KV cache: a prefill
    (T = L queries), then one query over L keys per step, on ``model`` (default: the tiny
    preset, random weights, float64). Passes when every call equals float64 attention on its
    inputs and the tokens are those of the model whose attention is the package's float64
    attention in the same place (``TiledAttention(None)``: the same casts, so a bfloat16 model
    on a GPU gives the same tokens too), with the logits of every step close to its; prints
    both runs' seconds."""
    model = model or demo_model()
    if prompt is None:
        gen = torch.Generator().manual_seed(5)
        prompt = torch.randint(5, model.cfg.vocab_size, (40,), generator=gen).tolist()

    def attempt() -> None:
        q = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        fn(q, q, q, block_m, block_n)   # a stub raises NotImplementedError here
        tiles = TiledAttention(fn, block_m, block_n)
        ref = _greedy(model, TiledAttention(None, block_m, block_n), prompt, max_tokens)
        mine = _greedy(model, tiles, prompt, max_tokens)
        assert mine["tokens"] == ref["tokens"], (
            f"greedy tokens {mine['tokens']}, the model on float64 attention gives "
            f"{ref['tokens']}")
        diff = (mine["logits"] - ref["logits"]).abs().max().item()
        tol = 1e-3 if model.dtype in (torch.float32, torch.float64) else 0.25
        assert diff < tol, f"the logits differ from the model's on float64 attention by {diff:.2e}"
        worst = max(err for _, _, err in tiles.calls)
        print(f"your tiles were the attention of {len(tiles.calls)} layer calls (prompt of "
              f"{len(prompt)} tokens, then {max_tokens - 1} decode steps; largest difference "
              f"from float64 attention {worst:.1e}): the same {max_tokens} greedy tokens as the "
              f"package's attention, logits at most {diff:.1e} apart; {mine['seconds']:.2f} s, "
              f"the package's {ref['seconds']:.2f} s")

    return check("flash_tiles_in_model", attempt)


class DecodeKernelAttention:
    """The engine's paged attention backend with every decode step computed by ``fn``, a
    function with exercise 4's contract (``fn(q, k_cache, v_cache, block_table, seq_lens)`` ->
    [B, Hq, D], float32). A step in which every sequence brings one new token (and none a tree
    mask) hands ``fn`` the whole batch: q [S, Hq, D], this layer's pool [num_blocks,
    block_size, Hkv, D] (the new tokens' K/V already written), ``meta.block_tables`` [S,
    max_blocks] and ``meta.seq_lens`` [S] (int32), in float32 on the device Triton runs on;
    the result comes back in q's dtype. Any other step (prompts, chunks, verification) goes to
    the package's sdpa backend. Each decode call is compared with sdpa on the same float32
    inputs (``decode_calls``, ``worst``); a wrong shape or a difference over ``tol`` raises
    AssertionError from inside the step. ``fn`` None: decode steps return that float32 sdpa
    result itself (the reference run, with the same casts as the student's)."""

    name, reads_direct, cpu_fast_path = "exercise", False, False

    def __init__(self, fn: Callable[..., torch.Tensor] | None, tol: float = 1e-4) -> None:
        self.fn, self.tol = fn, tol
        self.decode_calls, self.worst = 0, 0.0

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: PagedMetadata) -> torch.Tensor:
        if meta.has_masks or meta.max_q_len > 1:
            return sdpa_paged_attention(q, k, v, k_cache, v_cache, meta)
        q32, k32, v32, kc32, vc32 = (x.float() for x in (q, k, v, k_cache, v_cache))
        want = sdpa_paged_attention(q32, k32, v32, kc32, vc32, meta)
        if self.fn is None:
            return want.to(q.dtype)
        dev = default_device()
        out = self.fn(q32.to(dev), kc32.to(dev), vc32.to(dev), meta.block_tables.to(dev),
                      meta.seq_lens.to(dev))
        lens = meta.seq_lens.tolist()
        where = f"decode step over sequences of {lens} tokens (block_size {meta.block_size})"
        assert tuple(out.shape) == tuple(q.shape), (
            f"{where}: out has shape {tuple(out.shape)}, expected {tuple(q.shape)}")
        err = (out.float().to(want.device) - want).abs().max().item()
        self.decode_calls += 1
        self.worst = max(self.worst, err)
        assert err < self.tol, (f"{where}: differs from the package's attention over the same "
                                f"cache by {err:.2e}")
        return out.to(q.device, q.dtype)


def check_paged_decode_in_engine(fn: Callable[..., torch.Tensor],
                                 model: Transformer | None = None,
                                 prompts: list[list[int]] | None = None,
                                 output_lens: list[int] | None = None,
                                 block_size: int = 16, num_kv_blocks: int = 64) -> Result:
    """Exercise 4's Triton ``paged_decode`` is the engine's attention for every decode step
    (:class:`DecodeKernelAttention`; prompts go through the package's sdpa backend, as the
    kernel is decode-only): every prompt at once, greedy, on ``model`` (default: the tiny
    preset, random weights, float64; two short requests, since the interpreter is slow).
    Passes when every decode call equals the package's attention on the same cache, every
    request gets the tokens of the engine whose decode steps are the package's attention in
    float32 (``DecodeKernelAttention(None)``: the same casts), and every block is free at the
    end; prints both runs' seconds."""
    model = model or demo_model()
    if prompts is None:
        prompts, output_lens = demo_prompts(2)
        output_lens = [min(n, 3) for n in output_lens]
    opts = dict(num_kv_blocks=num_kv_blocks, block_size=block_size)

    def attempt() -> None:
        probe = _paged_case([1], block_size, 1, 1, 16, torch.Generator().manual_seed(0))
        fn(*(t.to(default_device()) for t in probe[:5]))  # a stub raises NotImplementedError
        kernel = DecodeKernelAttention(fn)
        ref = serve_greedy(LLMEngine(model, None, EngineConfig(
            attention_backend=DecodeKernelAttention(None), **opts)), prompts, output_lens)
        mine = serve_greedy(LLMEngine(model, None, EngineConfig(attention_backend=kernel,
                                                                **opts)), prompts, output_lens)
        assert kernel.decode_calls > 0, "no step was a decode step: give the requests more tokens"
        assert_same_tokens(mine, ref)
        print(f"your kernel computed {kernel.decode_calls} decode calls ({model.cfg.n_layers} "
              f"layers per step, largest difference from sdpa {kernel.worst:.1e}); "
              f"{sum(map(len, mine['tokens']))} tokens equal to the engine's with the package's "
              f"attention, every block freed; {mine['seconds']:.2f} s, with the package's "
              f"{ref['seconds']:.2f} s")

    return check("paged_decode_in_engine", attempt)
