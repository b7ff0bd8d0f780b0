"""Mixture of experts (chapter 01): a top-k router over SwiGLU experts.

Each token is sent to the k experts its router scores highest; their outputs are mixed with the
router's softmax weights renormalised over those k. Training adds two things: optional noise on
the router logits (noisy top-k gating, Shazeer et al. 2017) and the Switch Transformer auxiliary
loss (Fedus et al. 2021) that pushes the router to spread tokens evenly.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .layers import SwiGLU


def load_balancing_loss(probs: Tensor, experts: Tensor) -> Tensor:
    """Switch Transformer auxiliary loss: n_experts x sum_i f_i x P_i.

    probs [N, E]: the router's softmax for N tokens; experts [N, k]: the chosen expert ids.
    f_i is the fraction of the N x k assignments that went to expert i (Switch has k = 1), P_i the
    mean router probability of expert i. It is 1 when the router is uniform and grows as tokens
    concentrate; the gradient flows through P only (f comes from an argmax).
    """
    n_experts = probs.shape[-1]
    f = torch.bincount(experts.flatten(), minlength=n_experts).to(probs.dtype) / experts.numel()
    return n_experts * (f * probs.mean(dim=0)).sum()


class MoEFeedForward(nn.Module):
    """Top-k mixture of SwiGLU experts: [..., d_model] -> [..., d_model].

    After each forward, ``aux_loss`` (scalar tensor, differentiable) holds the load-balancing loss
    and ``expert_load`` (LongTensor [n_experts], on the CPU) the number of token slots each expert
    received; it sums to tokens x top_k. Noise (std ``noise_std``) is added to the router logits
    only in training mode; Shazeer et al. learn a per-expert noise scale, here it is fixed.
    """

    def __init__(self, d_model: int, ffn_dim: int, n_experts: int, top_k: int,
                 noise_std: float = 0.0) -> None:
        super().__init__()
        if n_experts < 1:
            raise ValueError(f"n_experts must be >= 1, got {n_experts}")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={n_experts}], got {top_k}")
        if not noise_std >= 0:
            raise ValueError(f"noise_std must be >= 0, got {noise_std}")
        self.n_experts, self.top_k, self.noise_std = n_experts, top_k, noise_std
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(d_model, ffn_dim) for _ in range(n_experts))
        self.aux_loss: Tensor = torch.zeros(())
        self.expert_load: Tensor = torch.zeros(n_experts, dtype=torch.long)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Pick experts for x [N, D].

        Returns weights [N, k] (softmax renormalised over the chosen k, so each row sums to 1),
        experts [N, k] (ids, highest score first) and probs [N, E] (the full router softmax).
        """
        logits = self.router(x)
        if self.training and self.noise_std > 0:
            logits = logits + torch.randn_like(logits) * self.noise_std
        probs = logits.softmax(dim=-1)
        top_probs, experts = probs.topk(self.top_k, dim=-1)
        return top_probs / top_probs.sum(dim=-1, keepdim=True), experts, probs

    def forward(self, x: Tensor) -> Tensor:
        """x [..., D] -> [..., D]. Token slots are sorted by expert so each expert runs once on
        the rows it was given, then its weighted output is added back at those rows."""
        flat = x.reshape(-1, x.shape[-1])
        weights, experts, probs = self.route(flat)
        self.aux_loss = load_balancing_loss(probs, experts)
        slots = experts.flatten()                      # [N * k], slot j belongs to token j // k
        order = slots.argsort(stable=True)
        counts = torch.bincount(slots, minlength=self.n_experts)
        self.expert_load = counts.detach().cpu()
        tokens, slot_weights = order // self.top_k, weights.flatten()[order]
        out = torch.zeros_like(flat)
        start = 0
        for expert, count in zip(self.experts, self.expert_load.tolist()):
            if count:
                rows = tokens[start:start + count]
                gated = expert(flat[rows]) * slot_weights[start:start + count, None]
                out.index_add_(0, rows, gated.to(out.dtype))
            start += count
        return out.view(x.shape)
