"""Checkers for the exercises of chapter 02 (inference and the KV cache).

Each ``check_*`` takes the student's function or class, compares it with the package on a few
cases, prints a one-line verdict and returns a :class:`~minillm.labs.common.Result` (``passed``
is None while the exercise still raises NotImplementedError).

Four are builds that then run inside the model: the student's decode step computes every
attention of a model while :func:`minillm.generate.generate` runs it
(:class:`FunctionDecodeCache`), their cache class is the cache ``generate`` fills, their KV
quantizer decides what a quantized cache stores while a model reads a text
(:class:`FunctionQuantCache`, which the chapter's bits sweep then uses), and their H2O
eviction step decides what an H2O cache keeps (:class:`FunctionH2OCache`, which the chapter's
perplexity table then uses).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..attention import AttentionFn, attention_with_lse, causal_mask
from ..attention.kv_quant import dequantize_int8, quantize_absmax
from ..cache import Cache, H2OCache, KVCache, QuantizedKVCache, SinkCache, SlidingWindowCache
from ..checkpoint.loader import random_model
from ..checkpoint.tokenizer import Tokenizer
from ..config import PRESETS, ModelConfig
from ..course.ch02_kv_memory import TABLE_MODELS, MLASpec, kv_cache_bytes
from ..evaluate import visible_keys
from ..model.transformer import Transformer
from .common import Result, check
from .in_engine import assert_same_tokens, demo_model, demo_prompts, full_precision, generate_greedy


def check_kv_bytes(fn: Callable[..., int]) -> Result:
    """``fn(cfg, tokens, batch, bytes_per_elem)`` -> KV cache bytes, for a GQA/MQA/MHA
    :class:`~minillm.config.ModelConfig` and for an MLA
    :class:`~minillm.course.ch02_kv_memory.MLASpec`.

    Compared with :func:`minillm.course.ch02_kv_memory.kv_cache_bytes` on the calculator's
    models and a few made-up shapes.
    """
    made_up = ((3, 1, 4, 8), (5, 2, 1, 32))
    models = list(TABLE_MODELS) + [
        PRESETS["tiny"].with_(name=f"made-up {nl}x{kv}x{g}x{hd}", n_layers=nl, n_kv_heads=kv,
                              n_heads=kv * g, head_dim=hd) for nl, kv, g, hd in made_up]
    models.append(MLASpec("made-up MLA", n_layers=4, kv_lora_rank=96, rope_dim=0, n_heads=8,
                          head_dim=16))
    workloads = ((1, 1, 2), (8192, 1, 2), (4096, 16, 1), (1000, 3, 4), (0, 2, 2))

    def attempt() -> None:
        for cfg in models:
            for tokens, batch, bpe in workloads:
                got = fn(cfg, tokens=tokens, batch=batch, bytes_per_elem=bpe)
                want = kv_cache_bytes(cfg, tokens, batch, bpe)
                assert got == want, (f"{cfg.name}, tokens={tokens}, batch={batch}, "
                                     f"bytes_per_elem={bpe}: got {got}, expected {want}")

    return check("kv_bytes", attempt)


def _score_entries_reference(n: int) -> tuple[int, int]:
    """Count, step by step, the unmasked q.k products of one head in one layer."""
    with_cache = without_cache = 0
    for length in range(1, n + 1):
        with_cache += length  # one new query against every key so far
        without_cache += sum(i + 1 for i in range(length))  # the whole causal triangle again
    return with_cache, without_cache


def check_score_entries(fn: Callable[[int], tuple[int, int]]) -> Result:
    """``fn(n)`` -> (with_cache, without_cache): q.k products (one head, one layer, causal
    entries only) to read a sequence of n tokens one token per forward pass."""

    def attempt() -> None:
        for n in (1, 2, 3, 10, 257, 4096):
            got = fn(n)
            want = _score_entries_reference(n) if n < 300 else (
                n * (n + 1) // 2, n * (n + 1) * (n + 2) // 6)
            assert tuple(got) == want, f"n={n}: got {tuple(got)}, expected {want}"

    return check("score_entries", attempt)


def check_cache_append(cls: type, model: Transformer | None = None,
                       prompts: list[list[int]] | None = None,
                       output_lens: list[int] | None = None,
                       tok: Tokenizer | None = None) -> Result:
    """``cls(cfg, batch_size, max_len, device, dtype)``: a :class:`~minillm.cache.Cache`
    subclass whose ``update(layer, k, v)`` stores the new K/V and returns everything so far.

    Three tests: ``update`` returns the same tensors as the package's :class:`KVCache` when
    chunks of random K/V of several lengths arrive; a small random model reading a sequence
    in chunks through the cache gives the logits it gives with no cache at all; and
    :func:`minillm.generate.generate` with the cache (``cache_factory``) continues each of
    ``prompts`` on ``model`` (default: the tiny preset, random weights, float64, and three
    seeded random prompts, whose prefills are longer than two doublings of a small buffer)
    with the greedy tokens it gives with a :class:`KVCache`.
    """
    cfg = PRESETS["tiny"].with_(vocab_size=512)
    chunks = (5, 1, 1, 7, 1, 3)
    total, batch = sum(chunks), 2

    def attempt() -> None:
        gen = torch.Generator().manual_seed(0)
        mine = cls(cfg, batch, total, "cpu", torch.float32)
        assert isinstance(mine, Cache), f"{cls.__name__} must subclass minillm.cache.Cache"
        ref = KVCache(cfg, batch, total, "cpu", torch.float32)
        for t in chunks:
            for layer in range(cfg.n_layers):
                k, v = (torch.randn(batch, cfg.n_kv_heads, t, cfg.head_dim, generator=gen)
                        for _ in range(2))
                got_k, got_v = mine.update(layer, k, v)
                want_k, want_v = ref.update(layer, k, v)
                assert tuple(got_k.shape) == tuple(want_k.shape), (
                    f"after {ref.seen} + {t} tokens, layer {layer}: update returned keys of "
                    f"shape {tuple(got_k.shape)}, expected {tuple(want_k.shape)}")
                assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), (
                    f"after {ref.seen} + {t} tokens, layer {layer}: the returned K/V differ from "
                    "the package's KVCache (order: oldest token first)")
            mine.advance(t)
            ref.advance(t)
            assert len(mine) == len(ref), f"len(cache) is {len(mine)}, expected {len(ref)}"

        net = random_model(cfg, seed=1)
        ids = torch.randint(0, cfg.vocab_size, (batch, total), generator=gen)
        with torch.inference_mode():
            want = net(ids)
            cache = cls(cfg, batch, total, "cpu", torch.float32)
            got = torch.cat([net(part, cache=cache) for part in ids.split(list(chunks), 1)], 1)
        err = (got - want).abs().max().item()
        assert err < 1e-4, (f"a model reading {total} tokens in chunks {chunks} through the cache "
                            f"differs from the uncached model by {err:.2e} (max |logit diff|)")
        _generate_through(lambda m, n: CheckedCache(cls(m.cfg, 1, n, m.device, m.dtype)),
                          f"{cls.__name__} as its cache", model, prompts, output_lens, tok)

    return check("cache_append", attempt)


def _kept_reference(n_seen: int, window: int, n_sink: int, chunk: int = 3) -> list[int]:
    """Positions the package's sliding-window / sink cache keeps after n_seen tokens."""
    cfg = PRESETS["tiny"].with_(n_layers=1)
    cache = SinkCache(cfg, window, n_sink) if n_sink else SlidingWindowCache(cfg, window)
    shape = (1, cfg.n_kv_heads, 0, cfg.head_dim)
    for start in range(0, n_seen, chunk):
        t = min(chunk, n_seen - start)
        k = torch.zeros(shape[:2] + (t,) + shape[3:])
        cache.update(0, k, k)
        cache.advance(t)
    return cache.kept_positions(0)[0, 0].tolist()


def check_sliding_window(fn: Callable[[int, int, int], list[int]]) -> Result:
    """``fn(n_seen, window, n_sink)`` -> sorted positions a bounded cache keeps after reading
    n_seen tokens: the last ``window - n_sink`` tokens plus the first ``n_sink`` (attention
    sinks; ``n_sink=0`` is a plain sliding window). Compared with the package's caches."""
    cases = [(n, w, s) for w, s in ((8, 0), (8, 4), (5, 1), (1, 0))
             for n in (1, 3, w - 1, w, w + 1, 2 * w + 3, 40) if n >= 1]

    def attempt() -> None:
        for n, w, s in cases:
            got = [int(p) for p in fn(n, w, s)]
            want = _kept_reference(n, w, s)
            assert got == want, f"n_seen={n}, window={w}, n_sink={s}: got {got}, expected {want}"

    return check("sliding_window", attempt)


def check_decode_attention(fn: Callable, model: Transformer | None = None,
                           prompts: list[list[int]] | None = None,
                           output_lens: list[int] | None = None,
                           tok: Tokenizer | None = None) -> Result:
    """``fn(q, k_new, v_new, k_cache, v_cache)`` -> (out, k_cache, v_cache): one decode step of
    one attention layer with a KV cache. q [B, H, 1, hd] is the new token's query, k_new/v_new
    [B, H_kv, 1, hd] its key and value, k_cache/v_cache [B, H_kv, L, hd] the L tokens before it
    (L may be 0). Append the new key/value after the cached ones, then attend the query over all
    L + 1 keys (scale 1/sqrt(hd); query head h reads KV head h // (H / H_kv)). out [B, H, 1, hd];
    the caches come back as [B, H_kv, L + 1, hd].

    Fed a sequence token by token from empty caches, the outputs must equal causal attention
    over the whole sequence at once (float64), and the caches must hold the keys in order.
    Then ``fn`` computes every attention of ``model`` (default: the tiny preset, random weights,
    float64) while :func:`minillm.generate.generate` continues each of ``prompts`` (default:
    three seeded random prompts), prompts included (:class:`FunctionDecodeCache`): the greedy
    tokens must be the ones the package's cache and attention give.
    """
    shapes = ((1, 1, 1, 5, 4), (2, 4, 2, 7, 8), (1, 6, 1, 4, 16), (1, 9, 3, 1, 8))

    def attempt() -> None:
        gen = torch.Generator().manual_seed(2)
        for b, h, h_kv, t, hd in shapes:
            q = torch.randn(b, h, t, hd, generator=gen, dtype=torch.float64)
            k, v = (torch.randn(b, h_kv, t, hd, generator=gen, dtype=torch.float64)
                    for _ in range(2))
            want, _ = attention_with_lse(q, k, v, causal_mask(t, t))
            k_cache, v_cache = k[:, :, :0], v[:, :, :0]
            case = f"B={b}, H={h}, H_kv={h_kv}, hd={hd}"
            for i in range(t):
                out, k_cache, v_cache = fn(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1],
                                           k_cache, v_cache)
                assert tuple(out.shape) == (b, h, 1, hd), (
                    f"{case}, step {i}: out has shape {tuple(out.shape)}, expected "
                    f"{(b, h, 1, hd)}")
                assert torch.equal(k_cache, k[:, :, :i + 1]) and torch.equal(
                    v_cache, v[:, :, :i + 1]), (
                    f"{case}, step {i}: the returned caches must be the old ones with the new "
                    "key/value appended at the end")
                err = (out - want[:, :, i:i + 1]).abs().max().item()
                assert err < 1e-10, (
                    f"{case}, step {i}: output differs from causal attention over the whole "
                    f"sequence by {err:.2e}")
        _generate_through(lambda m, n: FunctionDecodeCache(m.cfg, fn),
                          "decode_attention computing every attention", model, prompts,
                          output_lens, tok)

    return check("decode_attention", attempt)


def _h2o_case(gen: torch.Generator, b: int, h_kv: int, length: int, t: int):
    """Scores and positions [B, H_kv, L] as an H2O cache holds them after reading t new tokens:
    each head's older tokens are a sorted subset of the past, the t newest are in every head."""
    end = length + 3 * t + 5
    pos = torch.empty(b, h_kv, length, dtype=torch.long)
    for i in range(b):
        for j in range(h_kv):
            old = torch.randperm(end - t, generator=gen)[:length - t].sort().values
            pos[i, j] = torch.cat([old, torch.arange(end - t, end)])
    score = torch.rand(b, h_kv, length, generator=gen) * 5
    return score, pos, end


def check_h2o_keep(fn: Callable, model: Transformer | None = None,
                   ids: list[int] | None = None) -> Result:
    """``fn(score, pos, end, budget, n_recent)`` -> indices [B, H_kv, budget] (long) into the
    last axis of score/pos [B, H_kv, L] (L > budget): the tokens one H2O eviction step keeps,
    in position order. ``end`` is the position after the newest token. Keep the ``n_recent``
    most recent tokens (pos >= end - n_recent) and fill the rest of the budget with the other
    tokens of highest accumulated attention score, per head.

    Compared with the package's :class:`~minillm.cache.H2OCache` on random caches, then used
    inside an H2O cache (:class:`FunctionH2OCache`, budget 8, 3 recent) while ``model``
    (default: a small random one; a 16-bit model as a float32 copy, where ties between scores
    are rarer) reads the first 40 of ``ids`` (default: random tokens) in passes of 6, 1 and up
    to 5 tokens: every layer must keep the same tokens as the package's cache after every
    pass.
    """
    cases = ((1, 2, 10, 6, 3, 1), (2, 3, 12, 8, 0, 1), (1, 1, 9, 8, 8, 4), (1, 3, 20, 5, 2, 5),
             (2, 2, 7, 1, 1, 1))
    cfg = PRESETS["tiny"].with_(vocab_size=512)
    chunks = [6] + [1] * 20 + [3, 5, 1, 4, 1]
    if ids is not None and len(ids) < sum(chunks):
        raise ValueError(f"ids must hold at least {sum(chunks)} tokens, got {len(ids)}")

    def attempt() -> None:
        gen = torch.Generator().manual_seed(3)
        for b, h_kv, length, budget, n_recent, t in cases:
            score, pos, end = _h2o_case(gen, b, h_kv, length, t)
            got = fn(score.clone(), pos.clone(), end, budget, n_recent)
            want = H2OCache(cfg, budget, n_recent)._keep(score, pos, end)
            case = f"L={length}, budget={budget}, n_recent={n_recent}, {t} new token(s)"
            assert tuple(got.shape) == tuple(want.shape), (
                f"{case}: got indices of shape {tuple(got.shape)}, expected {tuple(want.shape)}")
            assert torch.equal(got.long(), want), (
                f"{case}: kept positions {pos.gather(2, got.long())[0, 0].tolist()} in head 0, "
                f"expected {pos.gather(2, want)[0, 0].tolist()}")

        net = random_model(cfg, seed=4) if model is None else full_precision(model)
        text = (torch.randint(0, cfg.vocab_size, (1, sum(chunks)), generator=gen) if ids is None
                else torch.tensor([ids[:sum(chunks)]]))
        mine = FunctionH2OCache(net.cfg, 8, 3, fn)
        ref = H2OCache(net.cfg, 8, 3)
        with torch.inference_mode():
            for part in text.to(net.device).split(chunks, dim=1):
                net(part, cache=mine)
                net(part, cache=ref)
                for layer in range(net.cfg.n_layers):
                    assert torch.equal(mine.kept_positions(layer), ref.kept_positions(layer)), (
                        f"a model reading {sum(chunks)} tokens: after {ref.seen} tokens, layer "
                        f"{layer} keeps {mine.kept_positions(layer)[0, 0].tolist()} (head 0), "
                        f"expected {ref.kept_positions(layer)[0, 0].tolist()}")
        print(f"your h2o_keep chose the tokens an H2O cache (budget 8, 3 recent) keeps in all "
              f"{net.cfg.n_layers} layers and {net.cfg.n_kv_heads} KV heads while the model read "
              f"{sum(chunks)} tokens in {len(chunks)} passes: the package's choice every time")

    return check("h2o_keep", attempt)


def check_quantize_kv(fn: Callable[[torch.Tensor, int], tuple], model: Transformer | None = None,
                      ids: list[int] | None = None) -> Result:
    """``fn(x, bits)`` -> (q, scale): x [..., D] float, q int8 [..., D] with values in
    [-qmax, qmax] (qmax = 2^(bits-1) - 1), scale float32 [...] = max|x| / qmax over each
    vector's D numbers, q = round(x / scale) (ties to even; a zero vector: scale 0, q 0).

    Compared with :func:`minillm.attention.kv_quant.quantize_absmax` at 8, 6, 4, 3 and 2 bits
    on vectors of very different sizes, then used inside a cache (:class:`FunctionQuantCache`,
    8 bits) while ``model`` (default: a small random one; a 16-bit model as a float32 copy)
    reads the first 48 of ``ids`` (default: random tokens): its logits must equal those
    through the package's int8 cache (:class:`~minillm.cache.QuantizedKVCache`, the format of
    ``kv_cache_dtype="int8"``).
    """
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 7, 64, generator=gen) * torch.logspace(-2, 2, 7)[:, None]
    x[0, 1, 2] = 0.0                                         # a zero vector
    x[1, 0, 3, 5] = 40.0                                      # an outlier in one channel
    n = 48
    if ids is not None and len(ids) < n:
        raise ValueError(f"ids must hold at least {n} tokens, got {len(ids)}")

    def attempt() -> None:
        for bits in (8, 6, 4, 3, 2):
            got = fn(x.clone(), bits)
            want_q, want_s = quantize_absmax(x, bits)
            assert isinstance(got, tuple) and len(got) == 2, "return (q, scale)"
            q, scale = got
            _assert_tensor(q, tuple(want_q.shape), torch.int8, f"bits={bits}: q")
            _assert_tensor(scale, tuple(want_s.shape), torch.float32, f"bits={bits}: scale")
            bad = [tuple(i) for i in (scale != want_s).nonzero().tolist()]
            assert not bad, (f"bits={bits}: scale at {list(bad[0])} is {scale[bad[0]]:.6g}, "
                             f"expected {want_s[bad[0]]:.6g}")
            bad = [tuple(i) for i in (q != want_q).nonzero().tolist()]
            assert not bad, (f"bits={bits}: q at {list(bad[0])} is {int(q[bad[0]])}, expected "
                             f"{int(want_q[bad[0]])} (x = {x[bad[0]]:.6g}, scale "
                             f"{want_s[bad[0][:-1]]:.6g})")
        net = random_model(PRESETS["tiny"].with_(vocab_size=512), seed=6) if model is None \
            else full_precision(model)
        text = (torch.randint(0, net.cfg.vocab_size, (1, n), generator=gen) if ids is None
                else torch.tensor([ids[:n]])).to(net.device)
        with torch.inference_mode():
            mine = net(text, cache=FunctionQuantCache(net.cfg, n, fn, 8, net.device, net.dtype))
            ref = net(text, cache=QuantizedKVCache(net.cfg, 1, n, net.device, net.dtype, "int8"))
        assert torch.equal(mine, ref), (
            f"a model reading {n} tokens through a cache of your 8-bit values: logits differ "
            f"from the package's int8 cache by {(mine - ref).abs().max().item():.3g}")
        print(f"your quantize_kv matched the package at 8, 6, 4, 3 and 2 bits, and a model "
              f"reading {n} tokens through a cache of your 8-bit values gave the logits of the "
              f"package's int8 cache (kv_cache_dtype='int8') exactly")

    return check("quantize_kv", attempt)


def check_visible_keys(fn: Callable[[int, int, int, int], torch.Tensor]) -> Result:
    """``fn(n, window, n_sink, chunk)`` -> [n, n] bool: True where query i sees key j while a
    window (``n_sink=0``) or sink cache of ``window`` tokens reads n tokens: the first
    ``window`` in one pass, then ``chunk`` per pass, evicting after each pass. Compared with
    :func:`minillm.evaluate.visible_keys`, which the chapter's perplexities use."""
    cases = [(n, w, s, c) for w, s in ((8, 0), (8, 4), (5, 1), (1, 0)) for c in (1, 3, 16)
             for n in (1, w, w + 1, 2 * w + 3, 30)]

    def attempt() -> None:
        for n, w, s, c in cases:
            got = torch.as_tensor(fn(n, w, s, c)).bool()
            want = visible_keys(n, w, s, c)
            case = f"n={n}, window={w}, n_sink={s}, chunk={c}"
            assert tuple(got.shape) == (n, n), (
                f"{case}: shape {tuple(got.shape)}, expected {(n, n)}")
            wrong = (got != want).any(dim=1).nonzero().flatten().tolist()
            i = wrong[0] if wrong else 0
            assert not wrong, (f"{case}: query {i} sees keys {got[i].nonzero().flatten().tolist()}"
                               f", expected {want[i].nonzero().flatten().tolist()}")

    return check("visible_keys", attempt)


# --- the student's code inside the model ----------------------------------------------------


def _assert_tensor(x, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> None:
    """AssertionError naming ``what`` unless x is a tensor of that shape and dtype."""
    assert isinstance(x, torch.Tensor) and tuple(x.shape) == shape and x.dtype == dtype, (
        f"{what} "
        + (f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__)
        + f", expected {shape} {dtype}")


class FunctionDecodeCache(Cache):
    """A KV cache for :func:`minillm.generate.generate` (``cache_factory``) whose attention is
    ``fn``, exercise 2's decode step ``fn(q, k_new, v_new, k_cache, v_cache)`` ->
    (out, k_cache, v_cache). A forward pass over T tokens, the prompt's prefill included,
    calls it T times in each layer, one token after the other, and keeps the caches it
    returns: what the model attends to is exactly what ``fn`` appended and computed."""

    def __init__(self, cfg: ModelConfig, fn: Callable[..., tuple]) -> None:
        self.fn, self.seen = fn, 0
        self.k: list[torch.Tensor | None] = [None] * cfg.n_layers
        self.v: list[torch.Tensor | None] = [None] * cfg.n_layers

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_fn: AttentionFn | None = None) -> torch.Tensor:
        """q [B, H, T, hd], k/v [B, H_kv, T, hd] -> [B, H, T, hd]; ``attn_fn`` (the layer's
        own attention) is not used."""
        k_cache = k[:, :, :0] if self.k[layer] is None else self.k[layer]
        v_cache = v[:, :, :0] if self.v[layer] is None else self.v[layer]
        outs = []
        for i in range(q.shape[2]):
            where = f"inside the model, layer {layer}, position {self.seen + i}: decode_attention"
            cached = (*k.shape[:2], k_cache.shape[2] + 1, k.shape[3])
            out, k_cache, v_cache = self.fn(q[:, :, i:i + 1], k[:, :, i:i + 1],
                                            v[:, :, i:i + 1], k_cache, v_cache)
            _assert_tensor(out, (*q.shape[:2], 1, q.shape[3]), q.dtype, f"{where} returned out")
            _assert_tensor(k_cache, cached, k.dtype, f"{where} returned k_cache")
            _assert_tensor(v_cache, cached, v.dtype, f"{where} returned v_cache")
            outs.append(out)
        self.k[layer], self.v[layer] = k_cache, v_cache
        return torch.cat(outs, dim=2)

    def __len__(self) -> int:
        return self.seen


class CheckedCache(Cache):
    """The student's cache as the model uses it, with every ``update`` checked: it must return
    keys and values [B, H_kv, seen + T, hd] in the new keys' dtype."""

    def __init__(self, cache: Cache) -> None:
        self.cache = cache

    @property
    def seen(self) -> int:
        return self.cache.seen

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        where = f"inside the model, after {self.seen} + {k.shape[2]} tokens, layer {layer}: update"
        try:
            got = self.cache.update(layer, k, v)
        except (AssertionError, NotImplementedError):
            raise
        except Exception as e:  # noqa: BLE001 - reported with where it happened
            raise AssertionError(f"{where} raised {type(e).__name__}: {e}") from e
        assert isinstance(got, tuple) and len(got) == 2, f"{where} must return (keys, values)"
        want = (*k.shape[:2], self.seen + k.shape[2], k.shape[3])
        _assert_tensor(got[0], want, k.dtype, f"{where} returned keys")
        _assert_tensor(got[1], want, v.dtype, f"{where} returned values")
        return got

    def advance(self, t: int) -> None:
        self.cache.advance(t)

    def __len__(self) -> int:
        return len(self.cache)


class FunctionQuantCache(KVCache):
    """A contiguous cache (batch 1) whose keys and values are stored as exercise 5's
    ``quantize_kv(x, bits)`` -> (q, scale) quantizes them, and read back as q * scale: what a
    model attends to through it is exactly what ``fn`` kept."""

    def __init__(self, cfg: ModelConfig, max_len: int, fn: Callable, bits: int = 8,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        super().__init__(cfg, 1, max_len, device, dtype)
        self.fn, self.bits = fn, bits

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        return super().update(layer, self._stored(k, "keys"), self._stored(v, "values"))

    def _stored(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """x [B, H_kv, T, hd] as the cache keeps it: fn's (q, scale) read back."""
        where = f"inside the model, after {self.seen} tokens: quantize_kv of the {what}"
        got = self.fn(x, self.bits)
        assert isinstance(got, tuple) and len(got) == 2, f"{where} must return (q, scale)"
        _assert_tensor(got[0], tuple(x.shape), torch.int8, f"{where} returned q")
        _assert_tensor(got[1], tuple(x.shape[:-1]), torch.float32, f"{where} returned scale")
        return dequantize_int8(got[0], got[1], x.dtype)


class FunctionH2OCache(H2OCache):
    """The package's :class:`~minillm.cache.H2OCache` (its scores, attention and storage) with
    every eviction step decided by ``fn``, exercise 7's ``h2o_keep(score, pos, end, budget,
    n_recent)`` -> indices [B, H_kv, budget] of the tokens that stay, in position order."""

    def __init__(self, cfg: ModelConfig, budget: int, n_recent: int, fn: Callable) -> None:
        super().__init__(cfg, budget, n_recent)
        self.fn = fn

    def _keep(self, score: torch.Tensor, pos: torch.Tensor, end: int) -> torch.Tensor:
        idx = self.fn(score, pos, end, self.budget, self.n_recent)
        shape = (*score.shape[:-1], self.budget)
        assert isinstance(idx, torch.Tensor) and tuple(idx.shape) == shape, (
            "inside the H2O cache, h2o_keep returned "
            + (f"shape {tuple(idx.shape)}" if isinstance(idx, torch.Tensor)
               else type(idx).__name__) + f" for {tuple(score.shape)} scores, expected {shape}")
        return idx.long()


def _generate_through(make_cache: Callable[[Transformer, int], Cache], what: str,
                      model: Transformer | None, prompts: list[list[int]] | None,
                      output_lens: list[int] | None, tok: Tokenizer | None) -> None:
    """AssertionError unless :func:`minillm.generate.generate` with the cache
    ``make_cache(model, max_len)`` continues every prompt with the greedy tokens it gives with
    its own :class:`KVCache`; prints both runs' seconds, and with ``tok`` the first prompt's
    continuation. Defaults: the demo model and three seeded random prompts; a 16-bit model is
    checked as a float32 copy (:func:`~minillm.labs.ch01.full_precision`)."""
    model = full_precision(model or demo_model())
    if prompts is None:
        prompts, output_lens = demo_prompts(3)
    if output_lens is None:
        raise ValueError("output_lens must be given with prompts: one length per prompt")
    ref = generate_greedy(model, prompts, output_lens)
    mine = generate_greedy(model, prompts, output_lens, lambda n: make_cache(model, n))
    assert_same_tokens(mine, ref)
    text = (f": {tok.decode(prompts[0])!r} -> {tok.decode(mine['tokens'][0])!r}"
            if tok is not None else "")
    print(f"generate with your {what} gave the package's {sum(map(len, mine['tokens']))} greedy "
          f"tokens in {mine['seconds']:.2f} s (the package's KVCache: {ref['seconds']:.2f} s)"
          f"{text}")
