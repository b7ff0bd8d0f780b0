"""Eager alternatives to the engine's CPU decode attention, timed interleaved (best of 40 rounds).

    python benchmarks/cpu_decode_attention_ab.py [threads]

One padded group as minillm.attention.paged builds it (16 sequences of about 512 tokens, bf16
paged K/V gathered by index_select, 9 query heads over 3 KV heads, one query each): the current
SDPA call against fp32, bf16 and mixed (fp32 scores, bf16 PV) bmm + softmax. Prints each one's
largest error against float64 and its best time in ms.
"""
from __future__ import annotations

import math
import sys
import time

import torch
import torch.nn.functional as F

B, HQ, HKV, D, BS, L = 16, 9, 3, 64, 16, 512
G = HQ // HKV
DT = torch.bfloat16


def case():
    torch.manual_seed(0)
    nb = 64 * L // BS
    kc, vc = (torch.randn(nb, BS, HKV, D, dtype=DT) for _ in range(2))
    blocks = torch.randperm(nb)[: B * L // BS]
    q = torch.randn(B, HKV, G, D, dtype=DT)
    lens = torch.randint(L - 16, L + 1, (B,))
    mask = (torch.arange(L)[None] < lens[:, None])[:, None, None, :].expand(B, 1, G, L)
    bias = torch.zeros(B, 1, G, L).masked_fill(~mask, float("-inf"))
    return kc, vc, blocks, q, mask.contiguous(), bias


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    kc, vc, blocks, q, mask, bias = case()
    scale = 1 / math.sqrt(D)

    def gather(c):                                   # [B, Hkv, L, D], strided
        return c.index_select(0, blocks).view(B, L, HKV, D).transpose(1, 2)

    def as_f32(x):
        return x.to(torch.float32, memory_format=torch.contiguous_format)

    def current():
        return F.scaled_dot_product_attention(q, gather(kc), gather(vc), attn_mask=mask)

    def f32():
        s = torch.matmul(q.float(), as_f32(gather(kc)).transpose(-1, -2)).mul_(scale).add_(bias)
        return torch.matmul(torch.softmax(s, -1), as_f32(gather(vc))).to(DT)

    def bf16():
        s = torch.matmul(q, gather(kc).contiguous().transpose(-1, -2)).float()
        s = s.mul_(scale).add_(bias)
        return torch.matmul(torch.softmax(s, -1).to(DT), gather(vc).contiguous())

    def mixed():
        s = torch.matmul(q.float(), as_f32(gather(kc)).transpose(-1, -2)).mul_(scale).add_(bias)
        return torch.matmul(torch.softmax(s, -1).to(DT), gather(vc).contiguous())

    fns = {"current": current, "f32": f32, "bf16": bf16, "mixed": mixed}
    with torch.inference_mode():
        ref = F.scaled_dot_product_attention(q.double(), gather(kc).double(),
                                             gather(vc).double(), attn_mask=mask)
        for name, fn in fns.items():
            print(f"{name}: max error vs float64 {(fn().double() - ref).abs().max().item():.2e}")
        best = dict.fromkeys(fns, math.inf)
        for _ in range(40):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
    print("best ms:", {n: round(v * 1e3, 3) for n, v in best.items()})


if __name__ == "__main__":
    main()
