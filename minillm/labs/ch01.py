"""Checkers for the exercises of chapter 01 (transformers).

Each ``check_*`` takes the student's function, compares it with the package's implementation on
real text or seeded random inputs of several shapes, prints a one-line verdict and returns a
:class:`~minillm.labs.common.Result` (``passed`` is None while the function still raises
NotImplementedError). In notebook order: bpe_encode, top_p, rmsnorm, rope, causal_attention,
mha_to_gqa, moe.

Two of them are builds that then run inside the model: after its own cases, ``check_rmsnorm``
computes every RMSNorm of a model with the student's function and ``check_causal_attention``
makes the student's function every layer's attention, and the model must then generate the
greedy tokens of the unmodified model (:func:`assert_runs_in_model`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import nn

from ..attention import reference_attention
from ..checkpoint.loader import smollm2_tokenizer
from ..checkpoint.tokenizer import Tokenizer
from ..course.ch01_variants import MultiHeadAttention, mha_to_gqa
from ..model.layers import RMSNorm, apply_rope, rope_cos_sin
from ..model.moe import MoEFeedForward
from ..model.transformer import Transformer
from ..sampling import apply_top_p
from .common import Result, check
from .in_engine import (
    assert_runs_in_model,
    attention_set,
    demo_model,
    demo_prompts,
    full_precision,
)

# Real text for the tokenizer: several merges in one word, contractions, digits, code, accents,
# CJK, an emoji, runs of spaces, tabs and newlines, and the empty string.
BPE_TEXTS = (
    " unbelievably",
    "Tokenizers don't see words: they see 1,234 bytes!",
    "The yeast feeds on the sugars in the flour and releases carbon dioxide, which gets "
    "trapped in a web of gluten and makes the dough rise.",
    "def area(r):\n    return 3.14159 * r ** 2\n",
    "Crème brûlée in 東京 🤖, naïve café.",
    "  two  spaces,\ttabs and\n\nnewlines  ",
    "HELLO World's 2024 reports: we'll see, they've said.",
    "",
)


def _compare(got, want: torch.Tensor, case: str, atol: float, rtol: float) -> None:
    """Assert the student's tensor has the reference's shape, dtype and values."""
    assert isinstance(got, torch.Tensor), f"{case}: expected a tensor, got {type(got).__name__}"
    assert got.shape == want.shape, (f"{case}: shape {tuple(got.shape)}, "
                                     f"expected {tuple(want.shape)}")
    assert got.dtype == want.dtype, f"{case}: dtype {got.dtype}, expected {want.dtype}"
    assert not torch.isnan(got).any(), f"{case}: the result contains NaN"
    err = (got.double() - want.double()).abs()
    bad = err > atol + rtol * want.double().abs()
    assert not bad.any(), (f"{case}: {int(bad.sum())} of {want.numel()} values differ, "
                           f"largest difference {err.max().item():.3g}")


def _seeded(seed: int, module: type[torch.nn.Module], args: tuple, x_shape: tuple,
            dtype: torch.dtype) -> tuple[torch.nn.Module, torch.Tensor]:
    """(module(*args) in eval mode, an input x of x_shape), both in dtype and drawn from
    torch.manual_seed(seed), leaving the caller's random state as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return module(*args).to(dtype).eval(), torch.randn(x_shape, dtype=dtype)


def check_bpe_encode(fn: Callable[[str], list[int]], tok: Tokenizer | None = None) -> Result:
    """``fn(text)`` -> list of token ids: byte-level BPE with the GGUF file's vocabulary and merges.

    Split the text with the GPT-2 pre-tokenisation regex, write each piece's UTF-8 bytes as
    GPT-2's printable characters, merge adjacent symbols lowest merge rank first until no listed
    pair is left, and look the symbols up in the vocabulary. No control tokens. Compared with
    the package's tokenizer (``tok.encode``; by default the real model's, read from the GGUF
    file) on real text (:data:`BPE_TEXTS`).
    """
    tok = tok or smollm2_tokenizer()

    def attempt() -> None:
        for text in BPE_TEXTS:
            want = tok.encode(text)
            got = fn(text)
            assert isinstance(got, (list, tuple)), (
                f"{text!r}: expected a list of ints, got {type(got).__name__}")
            got = [int(i) for i in got]
            if got != want:
                first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                             min(len(got), len(want)))
                show = [tok.id_to_token(i) for i in want[first:first + 3]]
                yours = [tok.id_to_token(i) if 0 <= i < tok.vocab_size else i
                         for i in got[first:first + 3]]
                raise AssertionError(
                    f"{text!r}: {len(got)} tokens, expected {len(want)}; first difference at "
                    f"token {first}: you gave {yours}, expected {show}")

    return check("bpe_encode", attempt)


def check_rmsnorm(fn: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
                  model: Transformer | None = None, prompts: list[list[int]] | None = None,
                  output_lens: list[int] | None = None, tok: Tokenizer | None = None) -> Result:
    """``fn(x, weight, eps)`` -> RMSNorm of x [..., D] over the last axis, times weight [D].

    Statistics in float32, result in x's dtype (as :class:`minillm.model.RMSNorm`). Inputs:
    float32, float64, float16 and bfloat16; tiny inputs where eps matters, and an all-zero row
    that must come out as zeros, not NaN. Then ``fn`` computes every RMSNorm of ``model``
    (default: the tiny preset, random weights, float64; :func:`rmsnorm_replaced`), which must
    generate the unmodified model's greedy tokens after each of ``prompts`` (default: three
    seeded random prompts) and give its logits (:func:`assert_runs_in_model`): a function that
    normalises its input in place fails here, since that input is the residual stream.
    """
    gen = torch.Generator().manual_seed(1)
    cases = [((4, 16), torch.float32, 1e-5, 1.0), ((2, 7, 64), torch.float32, 1e-6, 1e-3),
             ((3, 5, 32), torch.float64, 1e-5, 1.0), ((2, 3, 48), torch.float16, 1e-5, 1.0),
             ((1, 4, 576), torch.bfloat16, 1e-5, 1.0), ((6, 8), torch.float32, 1e-2, 0.05)]
    # float64: statistics in float32 (the package) or in float64 are both right
    tol = {torch.float32: 1e-5, torch.float64: 1e-6, torch.float16: 2e-3,
           torch.bfloat16: 2e-2}

    def attempt() -> None:
        for shape, dtype, eps, scale in cases:
            x = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
            x.view(-1, shape[-1])[0] = 0.0  # a zero row: only eps keeps it finite
            x = x.to(dtype)
            weight = 1 + 0.5 * torch.randn(shape[-1], generator=gen, dtype=torch.float64)
            weight = weight.to(dtype)
            ref = RMSNorm(shape[-1], eps).to(dtype)
            with torch.no_grad():
                ref.weight.copy_(weight)
                want = ref(x)
            got = fn(x.clone(), weight.clone(), eps)
            case = f"x {tuple(shape)} {str(dtype).replace('torch.', '')}, eps={eps:g}"
            _compare(got, want, case, atol=tol[dtype], rtol=tol[dtype])
        _in_model(lambda m: rmsnorm_replaced(m, fn), "RMSNorm", model, prompts, output_lens, tok)

    return check("rmsnorm", attempt)


def check_rope(fn: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]) -> Result:
    """``fn(x, positions, theta)`` -> x [B, H, T, head_dim] with RoPE applied.

    positions [T] (int64) are the tokens' positions; the pairs rotated together are
    (i, i + head_dim/2), by the angle position * theta^(-2i/head_dim), as
    :func:`minillm.model.apply_rope` does (the Llama / Hugging Face layout).
    """
    gen = torch.Generator().manual_seed(2)
    cases = [((1, 1, 5, 8), 0, 10000.0), ((2, 3, 7, 16), 0, 100000.0),
             ((1, 2, 4, 64), 37, 100000.0), ((2, 2, 6, 32), 200, 500000.0)]

    def attempt() -> None:
        for shape, start, theta in cases:
            x = torch.randn(shape, generator=gen)
            t, hd = shape[2], shape[3]
            if start:  # sorted positions with gaps, as in a packed batch
                positions = start + torch.randperm(3 * t, generator=gen)[:t].sort().values
            else:
                positions = torch.arange(t)
            want = apply_rope(x, *rope_cos_sin(positions, hd, theta, x.dtype))
            got = fn(x.clone(), positions.clone(), theta)
            _compare(got, want, f"x {tuple(shape)}, positions {positions.tolist()}, "
                                f"theta={theta:g}", atol=1e-4, rtol=1e-4)

    return check("rope", attempt)


def check_causal_attention(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                                        torch.Tensor],
                           model: Transformer | None = None,
                           prompts: list[list[int]] | None = None,
                           output_lens: list[int] | None = None,
                           tok: Tokenizer | None = None) -> Result:
    """``fn(q, k, v)`` -> causal attention output [B, H, T, d].

    q [B, H, T, d]; k, v [B, H_kv, L, d] with L >= T and H a multiple of H_kv. The T queries are
    the last T of the L positions (the first L - T are in a KV cache), so query i sees keys
    0 .. L - T + i. Query head h reads KV head h // (H / H_kv). Compared with
    :func:`minillm.attention.reference_attention`. Then ``fn`` is every layer's attention in
    ``model`` (default: the tiny preset, random weights, float64; :func:`attention_replaced`),
    which must generate the unmodified model's greedy tokens after each of ``prompts``
    (default: three seeded random prompts) through its KV cache, and give its logits without
    a cache (:func:`assert_runs_in_model`); the result must be in the model's dtype.
    """
    gen = torch.Generator().manual_seed(3)
    # (B, H, H_kv, T, L, d)
    cases = [(1, 1, 1, 5, 5, 8), (2, 4, 4, 6, 6, 16), (1, 6, 2, 7, 7, 8),
             (1, 6, 2, 3, 10, 8), (2, 4, 1, 1, 9, 16), (1, 8, 4, 4, 4, 32)]

    def attempt() -> None:
        for b, h, h_kv, t, l, d in cases:
            q = torch.randn(b, h, t, d, generator=gen)
            k = torch.randn(b, h_kv, l, d, generator=gen)
            v = torch.randn(b, h_kv, l, d, generator=gen)
            want = reference_attention(q, k, v)
            got = fn(q.clone(), k.clone(), v.clone())
            _compare(got, want, f"q {tuple(q.shape)}, k/v {tuple(k.shape)}",
                     atol=1e-5, rtol=1e-4)
        _in_model(lambda m: attention_replaced(m, fn), "attention", model, prompts, output_lens,
                  tok)

    return check("causal_attention", attempt)


def check_top_p(fn: Callable[[torch.Tensor, float], torch.Tensor]) -> Result:
    """``fn(logits, p)`` -> logits [B, V] with every token outside the nucleus set to -inf.

    The nucleus is the smallest set of most likely tokens whose probability reaches p: a token
    is dropped when the tokens strictly more likely than it already hold mass >= p, so the most
    likely token is always kept and p = 1 keeps everything. Kept logits are unchanged. Compared
    with :func:`minillm.sampling.apply_top_p`.
    """
    gen = torch.Generator().manual_seed(4)
    cases = [(1, 10, 1.0), (4, 100, 1.0), (3, 1000, 3.0), (2, 50, 6.0), (5, 49152, 2.0)]
    ps = (1e-3, 0.3, 0.5, 0.9, 0.99, 1.0)

    def attempt() -> None:
        for b, vocab, scale in cases:
            logits = torch.randn(b, vocab, generator=gen) * scale
            # float64 mass of the tokens more likely than each token: where it is within 1e-5
            # of p, float32 rounding may keep or drop that token, so either answer is right
            probs64, order = logits.double().softmax(-1).sort(dim=-1, descending=True)
            before = probs64.cumsum(-1) - probs64
            for p in ps:
                want_kept = torch.isfinite(apply_top_p(logits, p))
                near = ((before - p).abs() < 1e-5) & (p < 1)
                either = torch.zeros_like(near).scatter(-1, order, near)
                got = fn(logits.clone(), p)
                case = f"logits {tuple(logits.shape)} (scale {scale:g}), p={p:g}"
                assert isinstance(got, torch.Tensor) and got.shape == logits.shape, (
                    f"{case}: expected a tensor of shape {tuple(logits.shape)}")
                kept = torch.isfinite(got)
                for row in range(b):
                    wrong = (kept[row] != want_kept[row]) & ~either[row]
                    assert not wrong.any(), (
                        f"{case}, row {row}: you kept {int(kept[row].sum())} tokens, expected "
                        f"{int(want_kept[row].sum())}"
                        + ("" if kept[row, logits[row].argmax()] else
                           " (the most likely token must always stay)"))
                assert torch.equal(got[kept], logits[kept]), (
                    f"{case}: the kept logits must keep their values")
                assert (got[~kept] == float("-inf")).all(), (
                    f"{case}: dropped tokens must be -inf")

    return check("top_p", attempt)


def check_mha_to_gqa(fn: Callable[[MultiHeadAttention, int], MultiHeadAttention]) -> Result:
    """``fn(mha, n_kv_heads)`` -> a new :class:`~minillm.course.ch01_variants.MultiHeadAttention`
    with ``n_kv_heads`` KV heads, each the mean of a group of ``mha``'s KV heads.

    Adjacent heads form a group (KV heads g*G .. g*G + G - 1 with G = mha.n_kv_heads /
    n_kv_heads become head g), so query head h keeps reading the pool that holds its old KV
    head. W_Q and W_O are copied; ``mha`` itself must stay unchanged. Compared with
    :func:`minillm.course.ch01_variants.mha_to_gqa` on weights and outputs, from MHA and from
    modules that are already grouped, in float32 and float64.
    """
    # (d_model, n_heads, old n_kv_heads, new n_kv_heads, head_dim, dtype)
    cases = [(32, 4, 4, 2, 8, torch.float32), (48, 6, 6, 1, 8, torch.float32),
             (24, 4, 4, 4, 6, torch.float32), (40, 8, 4, 2, 5, torch.float64),
             (36, 9, 9, 3, 4, torch.float64)]

    def attempt() -> None:
        for d_model, h, h_kv, n_kv, hd, dtype in cases:
            case = f"{h} query heads, {h_kv} -> {n_kv} KV heads, {str(dtype)[6:]}"
            mha, x = _seeded(d_model + h + h_kv + n_kv, MultiHeadAttention,
                             (d_model, h, h_kv, hd), (2, 7, d_model), dtype)
            before = {n: p.clone() for n, p in mha.state_dict().items()}
            want = mha_to_gqa(mha, n_kv)
            got = fn(mha, n_kv)
            assert isinstance(got, MultiHeadAttention), (
                f"{case}: expected a MultiHeadAttention, got {type(got).__name__}")
            assert got.n_kv_heads == n_kv and got.n_heads == h, (
                f"{case}: the result has {got.n_heads} query and {got.n_kv_heads} KV heads")
            assert all(torch.equal(p, before[n]) for n, p in mha.state_dict().items()), (
                f"{case}: the original module's weights changed; build a new one")
            for name in ("w_q", "w_k", "w_v", "w_o"):
                _compare(getattr(got, name).weight.detach(), getattr(want, name).weight,
                         f"{case}, {name}", atol=1e-6, rtol=1e-6)
            with torch.no_grad():
                _compare(got(x), want(x), f"{case}, output", atol=1e-5, rtol=1e-5)

    return check("mha_to_gqa", attempt)


def check_moe(fn: Callable[[torch.Tensor, MoEFeedForward], tuple[torch.Tensor, torch.Tensor]]
              ) -> Result:
    """``fn(x, moe)`` -> (out [N, D], aux_loss scalar): the top-k mixture of experts on x [N, D].

    Router softmax over the E experts, each token's top-k experts, their weights renormalised
    over those k, out = sum of weight x expert(x) (each ``moe.experts[e]`` is a SwiGLU module),
    and the Switch load-balancing loss E x sum_e f_e P_e (f_e: fraction of the N x k slots given
    to expert e, P_e: mean router probability). Eval mode, no noise. Compared with
    :class:`minillm.model.MoEFeedForward` (its output and ``aux_loss``), incl. experts that get
    no token, k = 1 and k = E.
    """
    # (d_model, expert ffn_dim, n_experts, top_k, tokens, dtype)
    cases = [(16, 24, 4, 1, 10, torch.float32), (32, 48, 8, 2, 64, torch.float32),
             (24, 16, 6, 3, 5, torch.float32), (16, 8, 8, 2, 3, torch.float32),
             (12, 20, 5, 5, 9, torch.float64)]

    def attempt() -> None:
        for d, f, e, k, n, dtype in cases:
            case = f"{e} experts, top-{k}, {n} tokens, {str(dtype)[6:]}"
            moe, x = _seeded(7 * e + k + n, MoEFeedForward, (d, f, e, k), (n, d), dtype)
            with torch.no_grad():  # router logits of std ~ 1 x sqrt(d): uneven routing
                moe.router.weight.mul_((3 * d) ** 0.5)
            with torch.no_grad():
                want = moe(x)
                want_aux = moe.aux_loss.clone()
                got = fn(x.clone(), moe)
            assert isinstance(got, tuple) and len(got) == 2, (
                f"{case}: expected a tuple (out, aux_loss)")
            out, aux = got
            _compare(out.detach(), want, f"{case}, out", atol=1e-5, rtol=1e-4)
            aux = torch.as_tensor(aux).detach()
            assert aux.numel() == 1, (
                f"{case}: aux_loss must be a scalar, got shape {tuple(aux.shape)}")
            assert abs(aux.double().item() - want_aux.double().item()) < 1e-5, (
                f"{case}: aux_loss {aux.item():.6f}, expected {want_aux.item():.6f}")

    return check("moe", attempt)


# --- the student's code inside the model ----------------------------------------------------


def _assert_like(out, x: torch.Tensor, what: str, name: str) -> None:
    """AssertionError unless the student's ``out`` is a tensor of ``x``'s shape and dtype (the
    model runs on it next)."""
    assert isinstance(out, torch.Tensor) and out.shape == x.shape and out.dtype == x.dtype, (
        f"inside the model your {what} returned "
        + (f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor)
           else type(out).__name__)
        + f" for {name} {tuple(x.shape)} {x.dtype}; it must match {name}'s shape and dtype")


class FunctionRMSNorm(nn.Module):
    """One RMSNorm of the model computed by ``fn(x, weight, eps)`` (exercise 3's contract) with
    that module's weight and eps. ``fn`` gets a copy of the weight, so it cannot change the
    model's."""

    def __init__(self, norm: RMSNorm, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.weight, self.eps, self.fn = norm.weight, norm.eps, fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fn(x, self.weight.detach().clone(), self.eps)
        _assert_like(out, x, "RMSNorm", "x")
        return out


@contextmanager
def rmsnorm_replaced(model: Transformer, fn: Callable[..., torch.Tensor]) -> Iterator[int]:
    """Inside the ``with`` block every RMSNorm module of ``model`` (two per layer, the final
    norm, and the QK-norms of models that have them) is a :class:`FunctionRMSNorm` of ``fn``;
    they are put back on exit. Yields how many were replaced."""
    found = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if type(child) is RMSNorm]
    for parent, name, child in found:
        setattr(parent, name, FunctionRMSNorm(child, fn))
    try:
        yield len(found)
    finally:
        for parent, name, child in found:
            setattr(parent, name, child)


@contextmanager
def attention_replaced(model: Transformer, fn: Callable[..., torch.Tensor]) -> Iterator[int]:
    """Inside the ``with`` block ``fn`` (exercise 5's contract, that of
    :data:`minillm.attention.AttentionFn`: q [B, H, T, d], k/v [B, H_kv, L, d] -> [B, H, T, d])
    is every layer's attention function (``layer.attn.backend``, the seam
    ``Transformer.set_attention_backend`` uses): a pass without a cache calls it with T = L,
    :func:`minillm.generate.generate` with the whole prompt over an empty cache and then with
    T = 1 over the cached keys at every decode step. The layers' own functions are put back on
    exit. Yields the number of layers."""
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = fn(q, k, v)
        _assert_like(out, q, "attention", "q")
        return out

    with attention_set(model, attention) as num_layers:
        yield num_layers


def _in_model(replace: Callable[[Transformer], AbstractContextManager[int]], what: str,
              model: Transformer | None, prompts: list[list[int]] | None,
              output_lens: list[int] | None, tok: Tokenizer | None) -> None:
    """:func:`assert_runs_in_model` with the checkers' defaults: the demo model and three
    seeded random prompts; a 16-bit model is checked as a float32 copy (:func:`full_precision`)."""
    model = full_precision(model or demo_model())
    if prompts is None:
        prompts, output_lens = demo_prompts(3)
    if output_lens is None:
        raise ValueError("output_lens must be given with prompts: one length per prompt")
    assert_runs_in_model(model, prompts, output_lens, lambda: replace(model), what, tok)


__all__ = ["BPE_TEXTS", "FunctionRMSNorm", "attention_replaced", "check_bpe_encode",
           "check_causal_attention", "check_mha_to_gqa", "check_moe", "check_rmsnorm",
           "check_rope", "check_top_p", "rmsnorm_replaced"]
