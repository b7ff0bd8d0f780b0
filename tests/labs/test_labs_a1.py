"""Appendix A1 checkers: reference solutions pass, wrong ones fail, untouched stubs are "TODO"."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from lab_checks import checker_tests

from minillm.labs import a1
from minillm.labs.in_engine import demo_model
from minillm.labs.solutions import a1 as key
from minillm.train.lora import fold_lora, lora_disabled
from minillm.train.sft import optimizer, sft_loss

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


class LoRABaseNoGrad(key.LoRA):
    """"Freezes" the base by running it under no_grad: right in isolation (the outputs, what
    trains), but in a model no gradient flows back through the base to the layers before, so
    their adapters learn from the LoRA path alone."""

    def forward(self, x):
        with torch.no_grad():
            y = self.base(x)
        return y + self.scale * (x @ self.lora_a.t()) @ self.lora_b.t()


class LoRAFloat32(key.LoRA):
    """A and B always float32 (torch.randn's default), whatever the base's dtype."""

    def __init__(self, base, rank, alpha):
        super().__init__(base, rank, alpha)
        self.lora_a = torch.nn.Parameter(self.lora_a.detach().float())
        self.lora_b = torch.nn.Parameter(self.lora_b.detach().float())


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


class Int4CachesFloat(key.Int4Groups):
    """Right codes, scales and mins, but keeps the dequantized float weight to serve it faster:
    the memory int4 was for is gone (only the served model shows it)."""

    def __init__(self, w, group_size):
        super().__init__(w, group_size)
        self.weight = super().dequantize()

    def dequantize(self):
        return self.weight


class Int4IntegerZero(key.Int4Groups):
    """GPTQ checkpoints' zero point: an integer code z = round(-min / scale), w ~ (q - z) scale.
    The grid moves by up to half a step in every group, and the greedy tokens change."""

    def __init__(self, w, group_size):
        super().__init__(w, group_size)
        self.zero = torch.round(-self.min / self.scale).clamp(0, 15)
        x = w.float().reshape(w.shape[0], -1, group_size)
        q = (torch.round(x / self.scale[..., None]) + self.zero[..., None]).clamp(0, 15)
        q = q.to(torch.uint8).reshape(w.shape)
        self.packed = q[:, 0::2] | (q[:, 1::2] << 4)
        self.min = -self.zero * self.scale


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
    (a1.check_lora_finetune, key.LoRA, LoRABaseNoGrad),
    (a1.check_lora_finetune, key.LoRA, LoRARandomB),
    (a1.check_lora_finetune, key.LoRA, LoRANoRankScaling),
    (a1.check_lora_finetune, key.LoRA, LoRABaseTrains),
    (a1.check_lora_finetune, key.LoRA, LoRAFloat32),
    (a1.check_int4_groups, key.Int4Groups, Int4HighNibbleFirst),
    (a1.check_int4_groups, key.Int4Groups, Int4Symmetric),
    (a1.check_int4_serving, key.Int4Groups, Int4CachesFloat),
    (a1.check_int4_serving, key.Int4Groups, Int4IntegerZero),
    (a1.check_bradley_terry, key.bradley_terry, bradley_terry_naive),
    (a1.check_dpo_loss, key.dpo, dpo_no_reference),
    (a1.check_dpo_loss, key.dpo, dpo_naive_log),
    (a1.check_awq_search, key.awq_search, awq_unnormalised),
    (a1.check_awq_search, key.awq_search, awq_fixed_alpha),
    (a1.check_gptq, key.gptq, gptq_no_feedback),
]
IDS = ["lora_alpha_not_over_r", "lora_random_b", "lora_base_trains",
       "lora_finetune_base_no_grad", "lora_finetune_random_b", "lora_finetune_alpha_not_over_r",
       "lora_finetune_base_trains", "lora_finetune_float32_adapters", "int4_nibble_order",
       "int4_symmetric", "int4_serving_float_copy", "int4_serving_integer_zero",
       "bradley_terry_overflow", "dpo_no_reference", "dpo_overflow", "awq_unnormalised",
       "awq_no_search", "gptq_no_feedback"]


def test_the_in_model_mistakes_pass_in_isolation():
    """The base under no_grad and the cached float weight are right on isolated tensors: only
    the model (the gradient through the frozen base, the bytes a served model holds) shows
    them."""
    assert a1.check_lora_layer(LoRABaseNoGrad).passed is True
    assert a1.check_int4_groups(Int4CachesFloat).passed is True


test_reference_passes, test_wrong_fails, test_stub_is_not_attempted = \
    checker_tests(CHECKS, IDS)


def test_student_layers_work_with_the_package_tools():
    """The notebook's fine-tune on the student's layers: the package's optimizer finds their
    adapters, lora_disabled gives the base model back, fold_lora merges through
    merged_weight()."""
    model = demo_model()
    ids, labels = a1.demo_sft_batches(model, steps=1)[0]
    with torch.no_grad():
        base = model(ids)
    a1.add_lora_layers(model, key.LoRA, 4, 8.0, layers=[1])
    loss = sft_loss(model, ids, labels)
    opt = optimizer(model, 1e-2)
    loss.backward()
    opt.step()
    with torch.no_grad():
        tuned = model(ids)
        with lora_disabled(model):
            torch.testing.assert_close(model(ids), base)
        assert not torch.allclose(tuned, base)
        torch.testing.assert_close(fold_lora(model)(ids), tuned)
