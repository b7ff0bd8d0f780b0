"""Chapter 01 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import math

import pytest
import torch

from minillm.labs import ch01
from minillm.labs.solutions.ch01 import (
    causal_attention,
    causal_attention_repeat,
    rmsnorm,
    rmsnorm_float64,
    rope,
    rope_real,
    top_p,
    top_p_shifted,
)

# --- reference solutions -------------------------------------------------------------------


















# --- wrong solutions -------------------------------------------------------------------------


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


def rope_interleaved(x, positions, theta):  # rotates (2i, 2i+1) pairs, llama.cpp's layout
    d = x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2).float() / d)
    angle = positions.float()[:, None] * freq
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack([x1 * angle.cos() - x2 * angle.sin(),
                       x1 * angle.sin() + x2 * angle.cos()], dim=-1)
    return out.flatten(-2)


def rope_wrong_sign(x, positions, theta):  # rotates the other way
    return rope(x, -positions, theta)


def rope_ignores_positions(x, positions, theta):  # assumes positions 0..T-1
    return rope(x, torch.arange(x.shape[-2]), theta)


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
    return causal_attention(q * math.sqrt(q.shape[-1]), k, v)


def attention_wrong_grouping(q, k, v):  # query head h reads KV head h % H_kv
    group = q.shape[1] // k.shape[1]
    return causal_attention(q, k, v) if group == 1 else causal_attention(
        q, k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1))


def top_p_drops_top_token(logits, p):
    probs, order = logits.softmax(-1).sort(dim=-1, descending=True)
    drop_sorted = probs.cumsum(-1) > p  # the token that crosses p is dropped: may be the top one
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def top_p_unsorted(logits, p):  # cumulates in vocabulary order instead of probability order
    probs = logits.softmax(-1)
    return logits.masked_fill(probs.cumsum(-1) - probs >= p, float("-inf"))


def top_p_renormalised(logits, p):  # returns log-probabilities, not the logits
    return top_p(logits, p).log_softmax(-1)


def stub(*args):
    raise NotImplementedError


CHECKERS = {
    "rmsnorm": (ch01.check_rmsnorm, [rmsnorm, rmsnorm_float64],
                [rmsnorm_no_eps, rmsnorm_mean_not_square, rmsnorm_std, rmsnorm_fp32_out]),
    "rope": (ch01.check_rope, [rope, rope_real],
             [rope_interleaved, rope_wrong_sign, rope_ignores_positions]),
    "causal_attention": (ch01.check_causal_attention, [causal_attention, causal_attention_repeat],
                         [attention_no_mask, attention_top_left_mask, attention_no_scale,
                          attention_wrong_grouping]),
    "top_p": (ch01.check_top_p, [top_p, top_p_shifted],
              [top_p_drops_top_token, top_p_unsorted, top_p_renormalised]),
}


@pytest.mark.parametrize("name, solution", [(n, s) for n, (_, ss, _) in CHECKERS.items()
                                            for s in ss],
                         ids=lambda x: getattr(x, "__name__", x))
def test_reference_solution_passes(name, solution):
    result = CHECKERS[name][0](solution)
    assert result.passed is True, result.message


@pytest.mark.parametrize("name, wrong", [(n, w) for n, (_, _, ws) in CHECKERS.items()
                                         for w in ws],
                         ids=lambda x: getattr(x, "__name__", x))
def test_wrong_solution_fails(name, wrong):
    checker = CHECKERS[name][0]
    result = checker(wrong)
    assert result.passed is False
    assert result.message


@pytest.mark.parametrize("name", CHECKERS)
def test_stub_is_not_attempted(name):
    result = CHECKERS[name][0](stub)
    assert result.passed is None
    assert not result  # a Result is falsy unless passed


def test_crash_is_reported_not_raised():
    def broken(*args):
        return args[0].reshape(-1, 7, 3)  # a shape error inside the student's code

    result = ch01.check_causal_attention(broken)
    assert result.passed is False and "RuntimeError" in result.message
