"""Appendix A1 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from lab_checks import checker_tests

from minillm.labs import a1
from minillm.labs.solutions import a1 as key

# --- wrong solutions -----------------------------------------------------------------------


class LoRANoRankScaling(key.LoRA):
    """Scales the update by alpha instead of alpha / r."""

    def __init__(self, base, rank, alpha):
        super().__init__(base, rank, alpha)
        self.scale = alpha


class LoRARandomB(key.LoRA):
    """B initialised at random: the fresh layer no longer equals its base."""

    def __init__(self, base, rank, alpha):
        super().__init__(base, rank, alpha)
        torch.nn.init.normal_(self.lora_b, std=0.02)


class LoRABaseTrains(key.LoRA):
    """Forgets to freeze the base: full fine-tuning in disguise."""

    def __init__(self, base, rank, alpha):
        super().__init__(base, rank, alpha)
        self.base.requires_grad_(True)


def int8_per_tensor(w):
    scale = w.abs().max() / 127
    return torch.round(w / scale) * scale


class Int4HighNibbleFirst(key.Int4Groups):
    """Packs the even column in the high nibble (and unpacks consistently)."""

    def __init__(self, w, group_size):
        super().__init__(w, group_size)
        self.packed = (self.packed >> 4) | (self.packed << 4)

    def dequantize(self):
        self.packed = (self.packed >> 4) | (self.packed << 4)
        try:
            return super().dequantize()
        finally:
            self.packed = (self.packed >> 4) | (self.packed << 4)


class Int4Symmetric(key.Int4Groups):
    """Symmetric groups (scale = max|w| / 7, no min): wastes levels on a skewed group."""

    def __init__(self, w, group_size):
        x = w.float().reshape(w.shape[0], -1, group_size)
        scale = (x.abs().amax(-1, keepdim=True) / 7).clamp(min=1e-12)
        codes = (torch.round(x / scale).clamp(-8, 7) + 8).to(torch.uint8).reshape(w.shape)
        self.shape, self.group_size = w.shape, group_size
        self.packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
        self.scale, self.min = scale[..., 0], -8 * scale[..., 0]


def bradley_terry_naive(r_chosen, r_rejected):  # log(sigmoid) overflows at large margins
    return -torch.log(torch.sigmoid(r_chosen - r_rejected)).mean()


def dpo_no_reference(pi_c, pi_r, ref_c, ref_r, beta):
    return -F.logsigmoid(beta * (pi_c - pi_r)).mean()


def dpo_naive_log(pi_c, pi_r, ref_c, ref_r, beta):
    return -torch.log(torch.sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))).mean()


def awq_unnormalised(w, x, group_size, n_grid):
    """Right alpha, but s = mean|x|^alpha left unnormalised."""
    alpha, _ = key.awq_search(w, x, group_size, n_grid)
    return alpha, x.abs().mean(0).clamp(min=1e-6) ** alpha


def awq_fixed_alpha(w, x, group_size, n_grid):
    """No search: always alpha = 0.5."""
    s = x.abs().mean(0).clamp(min=1e-6) ** 0.5
    return 0.5, s / (s.max() * s.min()).sqrt()


def gptq_no_feedback(w, hessian, group_size):
    """Round-to-nearest: never pushes a column's error onto the columns to its right."""
    g = key.Int4Groups(w, group_size)
    return torch.stack([g.packed & 15, g.packed >> 4], -1).reshape(w.shape), g.scale, g.min


CHECKS = [
    (a1.check_lora_layer, key.LoRA, LoRANoRankScaling),
    (a1.check_lora_layer, key.LoRA, LoRARandomB),
    (a1.check_lora_layer, key.LoRA, LoRABaseTrains),
    (a1.check_int8_roundtrip, key.int8_roundtrip, int8_per_tensor),
    (a1.check_int4_groups, key.Int4Groups, Int4HighNibbleFirst),
    (a1.check_int4_groups, key.Int4Groups, Int4Symmetric),
    (a1.check_bradley_terry, key.bradley_terry, bradley_terry_naive),
    (a1.check_dpo_loss, key.dpo, dpo_no_reference),
    (a1.check_dpo_loss, key.dpo, dpo_naive_log),
    (a1.check_awq_search, key.awq_search, awq_unnormalised),
    (a1.check_awq_search, key.awq_search, awq_fixed_alpha),
    (a1.check_gptq, key.gptq, gptq_no_feedback),
]
IDS = ["lora_alpha_not_over_r", "lora_random_b", "lora_base_trains", "int8_per_tensor",
       "int4_nibble_order", "int4_symmetric", "bradley_terry_overflow", "dpo_no_reference",
       "dpo_overflow", "awq_unnormalised", "awq_no_search", "gptq_no_feedback"]


test_reference_passes, test_wrong_fails, test_stub_is_not_attempted = \
    checker_tests(CHECKS, IDS)
