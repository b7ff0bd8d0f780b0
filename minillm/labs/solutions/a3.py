"""Appendix A3's key: reference solutions, written from the rules the chapter teaches."""
from __future__ import annotations

import json
import random

import torch
import torch.nn.functional as F

from minillm.cache import Cache
from minillm.labs import a3


def matmul_launches(num_layers, fused_qkv, fused_gate_up):
    attention = 2 if fused_qkv else 4            # q, k, v, o  or  qkv, o
    mlp = 2 if fused_gate_up else 3              # gate, up, down  or  gate_up, down
    return num_layers * (attention + mlp) + 1    # + the LM head


def pad_to_captured(n, sizes):
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    for s in sorted(sizes):
        if s >= n:
            return s
    raise ValueError(f"no captured size holds {n}")


def padding_waste(batch_sizes, sizes):
    run = sum(pad_to_captured(b, sizes) for b in batch_sizes)
    return (run - sum(batch_sizes)) / run


class StaticCache(Cache):
    """The model's cache seam over the caller's buffers: each layer's new K/V go into slot
    ``position`` in place, and attention reads every slot with the later ones masked."""

    def __init__(self, k_cache, v_cache, position):
        self.k, self.v, self.position = k_cache, v_cache, position

    def attend(self, layer, q, k, v, attn_fn=None):
        at = self.position.reshape(1)                  # a tensor: nothing read on the host
        self.k[layer].index_copy_(2, at, k)
        self.v[layer].index_copy_(2, at, v)
        slots = torch.arange(self.k[layer].shape[2], device=q.device)
        visible = (slots <= self.position)[None, None, None]   # [1, 1, 1, max_len], every step
        group = q.shape[1] // k.shape[1]               # query head h reads KV head h // group
        keys = self.k[layer].repeat_interleave(group, dim=1)
        values = self.v[layer].repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)


def static_decode_step(model, tokens, position, k_cache, v_cache):
    cache = StaticCache(k_cache, v_cache, position)
    logits = model(tokens[:, None], cache=cache, positions=position.reshape(1), last_only=True)
    return logits[:, -1]


def parse_sse(lines):
    text, usage = "", None
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            break
        if data:
            event = json.loads(data)
            for c in event["choices"]:
                if c["index"] == 0:
                    text += c["delta"].get("content") or ""
            usage = event.get("usage") or usage
    return text, usage


def slo_attainment(ttft, tpot, slo, duration_s):
    met = sum(a <= slo.ttft_s and b <= slo.tpot_s for a, b in zip(ttft, tpot))
    return met / len(ttft), met / duration_s


def poisson_arrivals(num_requests, rate, seed):
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(num_requests):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def token_mask(dfa, state, texts, eos_id):
    allowed = torch.zeros(len(texts), dtype=torch.bool)
    for t, text in enumerate(texts):
        if not text:                        # a control token stands for no text
            continue
        s = state
        for char in text:                   # the whole token must walk, not its first char
            s = dfa.step(s, char)
            if s is None:
                break
        else:
            allowed[t] = True
    allowed[eos_id] = state in dfa.accepting   # end only where the pattern may end
    return allowed


KEY = [
    (a3.check_matmul_launches, matmul_launches),
    (a3.check_padding_waste, padding_waste),
    (a3.check_static_decode_step, static_decode_step),
    (a3.check_parse_sse, parse_sse),
    (a3.check_parse_sse_on_server, parse_sse),
    (a3.check_slo_attainment, slo_attainment),
    (a3.check_poisson_arrivals, poisson_arrivals),
    (a3.check_token_mask_in_engine, token_mask),
]
