"""Chapter 01's key: reference solutions, written from the rules the chapter teaches."""
from __future__ import annotations

import functools
import math

import regex
import torch

from minillm.course.ch01_variants import MultiHeadAttention
from minillm.labs import ch01

GPT2_SPLIT = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


@functools.lru_cache(maxsize=1)
def gguf_vocab_and_ranks() -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    """The real model's vocabulary {symbol: id} and merge ranks {(left, right): rank}."""
    from minillm.checkpoint import find_smollm2_gguf
    from minillm.checkpoint.gguf_file import read_gguf

    meta = read_gguf(find_smollm2_gguf()).metadata
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(meta["tokenizer.ggml.merges"])}
    return vocab, ranks


def byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes stay, the other 68
    take the characters from U+0100 on, in byte order."""
    keep = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    table, moved = [], 256
    for b in range(256):
        table.append(chr(b) if b in keep else chr(moved))
        moved += b not in keep
    return table


def bpe_encode(text):
    vocab, ranks = gguf_vocab_and_ranks()
    chars = byte_chars()
    ids = []
    for piece in GPT2_SPLIT.findall(text):
        symbols = [chars[b] for b in piece.encode("utf-8")]
        while len(symbols) > 1:
            pairs = [ranks.get(pair, math.inf) for pair in zip(symbols, symbols[1:])]
            best = min(range(len(pairs)), key=pairs.__getitem__)
            if pairs[best] == math.inf:
                break
            symbols[best:best + 2] = [symbols[best] + symbols[best + 1]]
        ids += [vocab[s] for s in symbols]
    return ids


def rmsnorm(x, weight, eps):
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rmsnorm_float64(x, weight, eps):  # statistics in float64: also right
    x64 = x.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.double() * normed).to(x.dtype)


def rope(x, positions, theta):
    """RoPE with complex numbers: the pair (x_i, x_{i+d/2}) is the number x_i + j x_{i+d/2}."""
    d = x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions.double()[:, None] * freq
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2:].double()) * torch.polar(
        torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


def causal_attention(q, k, v):
    """GQA without copying K/V: fold each group of query heads into one axis."""
    b, h, t, d = q.shape
    h_kv, l = k.shape[1], k.shape[2]
    qg = q.reshape(b, h_kv, h // h_kv * t, d)
    scores = qg @ k.transpose(-1, -2) / math.sqrt(d)  # [B, H_kv, group*T, L]
    i = torch.arange(t).repeat(h // h_kv)[:, None]
    j = torch.arange(l)[None, :]
    scores = scores.masked_fill(j > i + (l - t), float("-inf"))
    return (scores.softmax(-1) @ v).reshape(b, h, t, d)


def top_p(logits, p):
    probs, order = logits.softmax(-1).sort(dim=-1, descending=True)
    drop_sorted = probs.cumsum(-1) - probs >= p  # mass of the strictly more likely tokens
    if p >= 1:
        drop_sorted[:] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def top_p_shifted(logits, p):
    """Another correct way: drop tokens whose cumulative mass exceeds p, shifted by one so the
    token that crosses p stays."""
    if p >= 1:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop_sorted = sorted_logits.softmax(-1).cumsum(-1) > p
    drop_sorted = torch.cat([torch.zeros_like(drop_sorted[..., :1]), drop_sorted[..., :-1]], -1)
    return logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


def rope_real(x, positions, theta):
    """The same RoPE with cos/sin on real tensors."""
    d = x.shape[-1]
    angle = positions.float()[:, None] * theta ** (-torch.arange(0, d, 2).float() / d)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()], -1)


def causal_attention_repeat(q, k, v):
    """The same attention, copying each KV head for its group of query heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    t, l = q.shape[2], k.shape[2]
    future = torch.ones(t, l, dtype=torch.bool).triu(l - t + 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


def pool_heads(w, n_kv_heads, head_dim):
    """[H_kv * head_dim, D] -> [n_kv_heads * head_dim, D]: each group of adjacent heads averaged."""
    return w.reshape(n_kv_heads, -1, head_dim, w.shape[-1]).mean(1).reshape(-1, w.shape[-1])


@torch.no_grad()
def mha_to_gqa(mha, n_kv_heads):
    out = MultiHeadAttention(mha.d_model, mha.n_heads, n_kv_heads, mha.head_dim)
    out.load_state_dict({"w_q.weight": mha.w_q.weight, "w_o.weight": mha.w_o.weight,
                         "w_k.weight": pool_heads(mha.w_k.weight, n_kv_heads, mha.head_dim),
                         "w_v.weight": pool_heads(mha.w_v.weight, n_kv_heads, mha.head_dim)})
    return out.to(mha.w_q.weight.dtype)


def silu(g):
    return g * torch.sigmoid(g)


def moe(x, layer):
    """Route with the router's softmax, renormalise over the top k, loop over tokens' slots."""
    probs = (x @ layer.router.weight.T).softmax(-1)  # [N, E]
    top, experts = probs.topk(layer.top_k, dim=-1)  # [N, k]
    weights = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for slot in range(layer.top_k):
        for e in experts[:, slot].unique().tolist():
            rows = experts[:, slot] == e
            ffn = layer.experts[e]
            h = x[rows]
            y = (silu(h @ ffn.w_gate.weight.T) * (h @ ffn.w_up.weight.T)) @ ffn.w_down.weight.T
            out[rows] += weights[rows, slot, None] * y
    f = torch.bincount(experts.flatten(), minlength=layer.n_experts).to(x.dtype) / experts.numel()
    return out, layer.n_experts * (f * probs.mean(0)).sum()


KEY = [  # in notebook order
    (ch01.check_bpe_encode, bpe_encode),
    (ch01.check_top_p, top_p),
    (ch01.check_rmsnorm, rmsnorm),
    (ch01.check_rope, rope),
    (ch01.check_causal_attention, causal_attention),
    (ch01.check_mha_to_gqa, mha_to_gqa),
    (ch01.check_moe, moe),
]
