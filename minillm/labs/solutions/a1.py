"""Appendix A1's key: reference solutions, written from the rules the chapter teaches."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minillm.labs import a1


class LoRA(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        like = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features, **like)
                                   / base.in_features ** 0.5)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, **like))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * (x @ self.lora_a.t()) @ self.lora_b.t()

    def merged_weight(self) -> torch.Tensor:
        return self.base.weight + self.scale * self.lora_b @ self.lora_a


def int4_fit(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., G] groups -> (codes, scale, min) by round-to-nearest between the group's min/max."""
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    return torch.round((x - lo) / scale).clamp(0, 15), scale, lo


class Int4Groups:
    def __init__(self, w: torch.Tensor, group_size: int) -> None:
        self.shape, self.group_size = w.shape, group_size
        codes, scale, lo = int4_fit(w.float().reshape(w.shape[0], -1, group_size))
        q = codes.to(torch.uint8).reshape(w.shape)
        self.packed = q[:, 0::2] | (q[:, 1::2] << 4)
        self.scale, self.min = scale[..., 0], lo[..., 0]

    def dequantize(self) -> torch.Tensor:
        q = torch.stack([self.packed & 15, self.packed >> 4], -1).reshape(self.shape).float()
        g = q.reshape(self.shape[0], -1, self.group_size)
        return (g * self.scale[..., None] + self.min[..., None]).reshape(self.shape)


def bradley_terry(r_chosen, r_rejected):
    return -F.logsigmoid(r_chosen - r_rejected).mean()


def dpo(pi_c, pi_r, ref_c, ref_r, beta):
    return -F.logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))).mean()


def rtn_int4(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """W -> its int4 round-to-nearest reconstruction, groups along the rows."""
    codes, scale, lo = int4_fit(w.reshape(w.shape[0], -1, group_size))
    return (codes * scale + lo).reshape(w.shape)


def awq_search(w, x, group_size, n_grid):
    mean_abs = x.abs().mean(0).clamp(min=1e-6)
    best = None
    for j in range(n_grid):
        alpha = j / max(n_grid - 1, 1)
        s = mean_abs ** alpha
        s = s / (s.max() * s.min()).sqrt()
        err = ((x / s) @ rtn_int4(w * s, group_size).t() - x @ w.t()).pow(2).mean().item()
        if best is None or err < best[0]:
            best = (err, alpha, s)
    return best[1], best[2]


def gptq(w, hessian, group_size):
    n, k = w.shape
    W = w.clone().double()
    H = hessian.double() + 0.01 * hessian.diag().mean().double() * torch.eye(k, dtype=torch.double)
    U = torch.linalg.cholesky(torch.linalg.inv(H), upper=True)
    q = torch.zeros(n, k, dtype=torch.uint8)
    scale = torch.zeros(n, k // group_size, dtype=torch.double)
    mn = torch.zeros_like(scale)
    for i in range(k):
        g = i // group_size
        if i % group_size == 0:
            lo, hi = W[:, i:i + group_size].amin(1), W[:, i:i + group_size].amax(1)
            scale[:, g], mn[:, g] = ((hi - lo) / 15).clamp(min=1e-12), lo
        c = torch.round((W[:, i] - mn[:, g]) / scale[:, g]).clamp(0, 15)
        q[:, i] = c.to(torch.uint8)
        err = (W[:, i] - (c * scale[:, g] + mn[:, g])) / U[i, i]
        W[:, i:] -= err[:, None] * U[i, i:][None, :]
    return q, scale.float(), mn.float()


KEY = [
    (a1.check_lora_layer, LoRA),
    (a1.check_lora_finetune, LoRA),
    (a1.check_int4_groups, Int4Groups),
    (a1.check_int4_serving, Int4Groups),
    (a1.check_bradley_terry, bradley_terry),
    (a1.check_dpo_loss, dpo),
    (a1.check_awq_search, awq_search),
    (a1.check_gptq, gptq),
]
