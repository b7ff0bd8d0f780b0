"""Appendix A1 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import torch
from lab_checks import checker_tests

from minillm.labs import a1
from minillm.labs.solutions.a1 import (
    dpo,
    int4_roundtrip,
    int8_roundtrip,
    lora_merge,
)


def int8_per_tensor(w):
    scale = w.abs().max() / 127
    return torch.round(w / scale) * scale




def int4_symmetric(w, g):
    x = w.reshape(w.shape[0], -1, g)
    scale = x.abs().amax(-1, keepdim=True) / 7
    return (torch.round(x / scale).clamp(-8, 7) * scale).reshape(w.shape)




def lora_merge_no_scaling(w, a, b, alpha):
    return w + b @ a




def dpo_no_reference(pi_c, pi_r, ref_c, ref_r, beta):
    return -torch.nn.functional.logsigmoid(beta * (pi_c - pi_r)).mean()


CHECKS = [
    (a1.check_int8_roundtrip, int8_roundtrip, int8_per_tensor),
    (a1.check_int4_roundtrip, int4_roundtrip, int4_symmetric),
    (a1.check_lora_merge, lora_merge, lora_merge_no_scaling),
    (a1.check_dpo_loss, dpo, dpo_no_reference),
]
IDS = ["int8", "int4", "lora_merge", "dpo"]


test_reference_passes, test_wrong_fails, test_stub_is_not_attempted = \
    checker_tests(CHECKS, IDS)
