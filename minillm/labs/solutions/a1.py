"""Appendix A1's key: reference solutions, written from the rules the chapter teaches."""
from __future__ import annotations

import torch

from minillm.labs import a1


def int8_roundtrip(w):
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
    return torch.round(w / scale).clamp(-127, 127) * scale


def int4_roundtrip(w, g):
    x = w.reshape(w.shape[0], -1, g)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    return (torch.round((x - lo) / scale).clamp(0, 15) * scale + lo).reshape(w.shape)


def lora_merge(w, a, b, alpha):
    return w + alpha / a.shape[0] * b @ a


def dpo(pi_c, pi_r, ref_c, ref_r, beta):
    return -torch.nn.functional.logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))).mean()


KEY = [
    (a1.check_int8_roundtrip, int8_roundtrip),
    (a1.check_int4_roundtrip, int4_roundtrip),
    (a1.check_lora_merge, lora_merge),
    (a1.check_dpo_loss, dpo),
]
