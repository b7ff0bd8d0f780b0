"""Chapter 01 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import math

import pytest
import torch
from lab_checks import checker_tests

from minillm.labs import ch01
from minillm.labs.solutions import ch01 as key

# --- wrong solutions -------------------------------------------------------------------------


def bpe_longest_match(text):  # WordPiece-style: the longest vocabulary entry first, no ranks
    vocab, _ = key.gguf_vocab_and_ranks()
    chars = key.byte_chars()
    ids = []
    for piece in key.GPT2_SPLIT.findall(text):
        s = "".join(chars[b] for b in piece.encode("utf-8"))
        while s:
            n = max(n for n in range(1, len(s) + 1) if s[:n] in vocab)
            ids.append(vocab[s[:n]])
            s = s[n:]
    return ids


def bpe_left_to_right(text):  # merges the leftmost listed pair first instead of the best rank
    vocab, ranks = key.gguf_vocab_and_ranks()
    chars = key.byte_chars()
    ids = []
    for piece in key.GPT2_SPLIT.findall(text):
        symbols = [chars[b] for b in piece.encode("utf-8")]
        while True:
            i = next((i for i, pair in enumerate(zip(symbols, symbols[1:])) if pair in ranks), None)
            if i is None:
                break
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        ids += [vocab[s] for s in symbols]
    return ids


def rmsnorm_no_eps(x, weight, eps):
    x32 = x.float()
    return weight * (x32 / x32.pow(2).mean(-1, keepdim=True).sqrt()).to(x.dtype)


def rmsnorm_mean_not_square(x, weight, eps):
    x32 = x.float()
    return weight * (x32 / (x32.mean(-1, keepdim=True).abs() + eps).sqrt()).to(x.dtype)


def rmsnorm_std(x, weight, eps):  # LayerNorm's statistics: subtracts the mean
    x32 = x.float()
    x32 = x32 - x32.mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rmsnorm_fp32_out(x, weight, eps):  # forgets to return x's dtype
    x32 = x.float()
    return weight.float() * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def rmsnorm_in_place(x, weight, eps):  # saves a copy by scaling its input: the residual stream
    scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.mul_(scale.to(x.dtype))


def rope_interleaved(x, positions, theta):  # rotates (2i, 2i+1) pairs, llama.cpp's layout
    d = x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2).float() / d)
    angle = positions.float()[:, None] * freq
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack([x1 * angle.cos() - x2 * angle.sin(),
                       x1 * angle.sin() + x2 * angle.cos()], dim=-1)
    return out.flatten(-2)


def rope_wrong_sign(x, positions, theta):  # rotates the other way
    return key.rope(x, -positions, theta)


def rope_ignores_positions(x, positions, theta):  # assumes positions 0..T-1
    return key.rope(x, torch.arange(x.shape[-2]), theta)


def attention_no_mask(q, k, v):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1) @ v


def attention_top_left_mask(q, k, v):  # mask anchored at key 0: wrong once a cache exists
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    t, l = q.shape[2], k.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(t, l, dtype=torch.bool).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(-1) @ v


def attention_no_scale(q, k, v):
    return key.causal_attention(q * math.sqrt(q.shape[-1]), k, v)


def attention_wrong_grouping(q, k, v):  # query head h reads KV head h % H_kv
    group = q.shape[1] // k.shape[1]
    return key.causal_attention(q, k, v) if group == 1 else key.causal_attention(
        q, k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1))


def attention_in_float32(q, k, v):  # softmax in float32 for stability, never cast back
    return key.causal_attention(q.float(), k.float(), v.float())


def top_p_drops_top_token(logits, p):
    probs, order = logits.softmax(-1).sort(dim=-1, descending=True)
    drop_sorted = probs.cumsum(-1) > p  # the token that crosses p is dropped: may be the top one
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def top_p_unsorted(logits, p):  # cumulates in vocabulary order instead of probability order
    probs = logits.softmax(-1)
    return logits.masked_fill(probs.cumsum(-1) - probs >= p, float("-inf"))


def top_p_renormalised(logits, p):  # returns log-probabilities, not the logits
    return key.top_p(logits, p).log_softmax(-1)


def _pool(mha, n_kv_heads, pool):
    """key.mha_to_gqa with pool(heads [H_kv, d, D], group) -> [n_kv_heads, d, D] instead."""
    out = key.mha_to_gqa(mha, n_kv_heads)
    group = mha.n_kv_heads // n_kv_heads
    with torch.no_grad():
        for new, old in ((out.w_k, mha.w_k), (out.w_v, mha.w_v)):
            heads = old.weight.view(mha.n_kv_heads, mha.head_dim, mha.d_model)
            new.weight.copy_(pool(heads, group).reshape(-1, mha.d_model))
    return out


def gqa_strided_groups(mha, n_kv_heads):  # pools heads g, g + n_kv, ... instead of neighbours
    return _pool(mha, n_kv_heads, lambda w, g: w.view(g, -1, *w.shape[1:]).mean(0))


def gqa_first_of_group(mha, n_kv_heads):  # keeps each group's first head instead of the mean
    return _pool(mha, n_kv_heads, lambda w, g: w[::g])


def moe_not_renormalised(x, layer):  # weights are the raw top-k router probabilities
    out, aux = key.moe(x, layer)
    probs = (x @ layer.router.weight.T).softmax(-1)
    top = probs.topk(layer.top_k, dim=-1).values
    return out * top.sum(-1, keepdim=True), aux  # = sum of p_e x expert_e(x)


def moe_aux_first_choice(x, layer):  # f counts only each token's first expert
    out, _ = key.moe(x, layer)
    probs = (x @ layer.router.weight.T).softmax(-1)
    first = probs.argmax(-1)
    f = torch.bincount(first, minlength=layer.n_experts).to(x.dtype) / len(first)
    return out, layer.n_experts * (f * probs.mean(0)).sum()


CHECKS = [
    (ch01.check_bpe_encode, key.bpe_encode, bpe_longest_match),
    (ch01.check_bpe_encode, key.bpe_encode, bpe_left_to_right),
    (ch01.check_rmsnorm, key.rmsnorm, rmsnorm_no_eps),
    (ch01.check_rmsnorm, key.rmsnorm, rmsnorm_mean_not_square),
    (ch01.check_rmsnorm, key.rmsnorm, rmsnorm_std),
    (ch01.check_rmsnorm, key.rmsnorm, rmsnorm_fp32_out),
    (ch01.check_rmsnorm, key.rmsnorm, rmsnorm_in_place),  # right values; fails in the model
    (ch01.check_rope, key.rope, rope_interleaved),
    (ch01.check_rope, key.rope, rope_wrong_sign),
    (ch01.check_rope, key.rope, rope_ignores_positions),
    (ch01.check_causal_attention, key.causal_attention, attention_no_mask),
    (ch01.check_causal_attention, key.causal_attention, attention_top_left_mask),
    (ch01.check_causal_attention, key.causal_attention, attention_no_scale),
    (ch01.check_causal_attention, key.causal_attention, attention_wrong_grouping),
    (ch01.check_causal_attention, key.causal_attention, attention_in_float32),  # in the model
    (ch01.check_top_p, key.top_p, top_p_drops_top_token),
    (ch01.check_top_p, key.top_p, top_p_unsorted),
    (ch01.check_top_p, key.top_p, top_p_renormalised),
    (ch01.check_mha_to_gqa, key.mha_to_gqa, gqa_strided_groups),
    (ch01.check_mha_to_gqa, key.mha_to_gqa, gqa_first_of_group),
    (ch01.check_moe, key.moe, moe_not_renormalised),
    (ch01.check_moe, key.moe, moe_aux_first_choice),
]
IDS = [f"{checker.__name__[6:]}-{wrong.__name__}" for checker, _, wrong in CHECKS]

test_reference_passes, test_wrong_fails, test_stub_is_not_attempted = \
    checker_tests(CHECKS, IDS)


@pytest.mark.parametrize("checker, other", [
    (ch01.check_rmsnorm, key.rmsnorm_float64),  # statistics in float64 are right too
    (ch01.check_rope, key.rope_real),
    (ch01.check_causal_attention, key.causal_attention_repeat),
    (ch01.check_top_p, key.top_p_shifted),
], ids=lambda x: getattr(x, "__name__", x))
def test_other_correct_solution_passes(checker, other):
    result = checker(other)
    assert result.passed is True, result.message


def test_crash_is_reported_not_raised():
    def broken(*args):
        return args[0].reshape(-1, 7, 3)  # a shape error inside the student's code

    result = ch01.check_causal_attention(broken)
    assert result.passed is False and "RuntimeError" in result.message


def test_sampling_filter_plot_counts_the_kept_tokens():
    from minillm.viz.ch01 import plot_sampling_filter

    logits = torch.arange(50, dtype=torch.float32).flip(0)      # token 0 most likely
    fig = plot_sampling_filter(logits, [f"t{i}" for i in range(8)], temperature=1.0, top_k=3)
    assert "3 of 50 tokens" in fig.axes[0].get_title()


@pytest.mark.parametrize("wrong, says", [(rmsnorm_in_place, "request"),
                                         (attention_in_float32, "float32")],
                         ids=["rmsnorm_in_place", "attention_in_float32"])
def test_right_values_wrong_in_the_model(wrong, says):
    """These pass every case on their own; only the model running on them shows the mistake."""
    checker = ch01.check_rmsnorm if wrong is rmsnorm_in_place else ch01.check_causal_attention
    result = checker(wrong)
    assert result.passed is False and says in result.message, result.message


def test_the_model_gets_its_own_parts_back():
    from minillm.labs.in_engine import demo_model
    from minillm.model import RMSNorm

    model = demo_model()
    backends = [layer.attn.backend for layer in model.layers]

    def crash(*args):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError), ch01.rmsnorm_replaced(model, crash) as n:
        assert n == 2 * model.cfg.n_layers + 1
        model(torch.tensor([[1, 2, 3]]))
    with pytest.raises(RuntimeError), ch01.attention_replaced(model, crash) as n:
        assert n == model.cfg.n_layers
        model(torch.tensor([[1, 2, 3]]))
    norms = [m for m in model.modules() if isinstance(m, (RMSNorm, ch01.FunctionRMSNorm))]
    assert len(norms) == 2 * model.cfg.n_layers + 1 and all(type(m) is RMSNorm for m in norms)
    assert [layer.attn.backend for layer in model.layers] == backends


class DigitsTokenizer:
    def decode(self, ids):
        return " ".join(map(str, ids))


def test_in_model_run_prints_the_text_and_both_times(capsys):
    result = ch01.check_causal_attention(key.causal_attention, prompts=[[1, 2, 3]],
                                         output_lens=[4], tok=DigitsTokenizer())
    assert result.passed is True, result.message
    out = capsys.readouterr().out
    assert "in 2 places generated the package's 4 greedy tokens" in out
    assert "'1 2 3' -> '" in out


def test_a_16_bit_model_is_checked_as_a_float32_copy():
    from minillm.labs.in_engine import demo_model

    model = demo_model()
    assert ch01.full_precision(model) is model
    half = demo_model().to(torch.bfloat16)
    copy = ch01.full_precision(half)
    assert copy.dtype == torch.float32 and half.dtype == torch.bfloat16
    assert copy.lm_head.weight is copy.embed.weight  # still tied
    assert ch01.check_rmsnorm(key.rmsnorm, half, [[1, 2, 3]], [3]).passed is True
