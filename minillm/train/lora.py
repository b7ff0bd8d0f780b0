"""LoRA (Hu et al., 2021) and QLoRA (Dettmers et al., 2023) on minillm's linears.

A frozen weight W [N, K] gets a trainable low-rank update: y = x W^T + (alpha / r) x A^T B^T
with A [r, K] (small random) and B [N, r] (zeros, so training starts at the original model).
Only r (N + K) numbers per layer train instead of N K. ``merge`` folds (alpha / r) B A into W
(no extra cost at inference) and ``unmerge`` takes it out again.

QLoRA: the frozen base is a 4-bit :class:`~minillm.quant.linear.Int4Linear`; gradients flow
through its dequantized weight to the adapters. (The paper's NF4 data type and paged optimisers
are not reproduced; the base here is minillm's int4 group-wise format.)
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..quant.linear import Int4Linear, Int8Linear

TARGETS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "ffn.w_gate", "ffn.w_up", "ffn.w_down")


class LoRALinear(nn.Module):
    """A frozen linear (float, int8 or int4) plus a trainable rank-``rank`` update."""

    def __init__(self, base: nn.Module, rank: int = 8, alpha: float = 16.0,
                 seed: int = 0) -> None:
        super().__init__()
        n, k = base.out_features, base.in_features
        if not isinstance(rank, int) or not 1 <= rank <= min(n, k):
            raise ValueError(f"rank must be an integer in [1, min(out_features, in_features)] "
                             f"= [1, {min(n, k)}] for this {n}x{k} layer, got {rank!r}")
        if alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {alpha}")
        self.base = base.requires_grad_(False)
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.in_features, self.out_features = k, n
        dev = [*base.parameters(), *base.buffers()][0].device
        gen = torch.Generator().manual_seed(seed)
        bound = 1 / math.sqrt(k)  # nn.Linear's (kaiming-uniform, a=sqrt(5)) range for A
        self.lora_a = nn.Parameter((torch.rand(rank, k, generator=gen) * 2 - 1).mul(bound)
                                   .to(dev))
        self.lora_b = nn.Parameter(torch.zeros(n, rank, device=dev))
        self.merged = False
        self.enabled = True

    def delta(self) -> torch.Tensor:
        """(alpha / r) B A: the update to W, [N, K]."""
        return self.scaling * (self.lora_b @ self.lora_a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # a quantized base is differentiable in x when x needs a gradient
        if self.merged or not self.enabled:
            return y
        a, b = self.lora_a.to(x.dtype), self.lora_b.to(x.dtype)
        return y + self.scaling * F.linear(F.linear(x, a), b)

    @torch.no_grad()
    def merge(self) -> None:
        """W <- W + (alpha / r) B A (float bases only)."""
        if not isinstance(self.base, nn.Linear):
            raise ValueError("merge needs a float nn.Linear base; a quantized base would have "
                             "to be re-quantized (dequantize it first)")
        if not self.merged:
            self.base.weight += self.delta().to(self.base.weight.dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            self.base.weight -= self.delta().to(self.base.weight.dtype)
            self.merged = False

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, merged={self.merged}"



def add_lora(model: nn.Module, rank: int = 8, alpha: float = 16.0,
             targets: Sequence[str] = TARGETS, layers: Sequence[int] | None = None,
             seed: int = 0) -> list[LoRALinear]:
    """Freeze ``model`` and wrap ``targets`` of ``layers`` (default: all) in LoRALinear."""
    n_layers = len(model.layers)
    layers = range(n_layers) if layers is None else list(layers)
    bad = [i for i in layers if not -n_layers <= i < n_layers]
    if bad:
        raise ValueError(f"layers must be in [0, {n_layers}), got {bad}")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ValueError(f"targets must be among {list(TARGETS)}, got {unknown}")
    model.requires_grad_(False)
    added = []
    for i in layers:
        for j, name in enumerate(targets):
            block = model.layers[i]
            lora = LoRALinear(block.get_submodule(name), rank, alpha, seed=seed + 100 * i + j)
            block.set_submodule(name, lora)
            added.append(lora)
    return added


def lora_modules(model: nn.Module) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in lora_modules(model) for p in (m.lora_a, m.lora_b)]


def trainable_fraction(model: nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters and quantized weights), tied weights counted once."""
    seen, total, train = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        train += p.numel() if p.requires_grad else 0
    for m in model.modules():
        if isinstance(m, Int4Linear):
            total += m.in_features * m.out_features
        elif isinstance(m, Int8Linear):
            total += m.q.numel()
    return train, total


def merge_lora(model: nn.Module) -> None:
    for m in lora_modules(model):
        m.merge()


def unmerge_lora(model: nn.Module) -> None:
    for m in lora_modules(model):
        m.unmerge()


@contextlib.contextmanager
def lora_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """The model without its adapters (the frozen reference policy of DPO and RLHF)."""
    mods = lora_modules(model)
    before = [m.enabled for m in mods]
    for m in mods:
        m.enabled = False
    try:
        yield model
    finally:
        for m, e in zip(mods, before):
            m.enabled = e


def fold_lora(model: nn.Module) -> nn.Module:
    """Merge every adapter into its float base and put the plain nn.Linear back (in place):
    the result is an ordinary model, ready for a new round of adapters."""
    for name, m in list(model.named_modules()):
        if isinstance(m, LoRALinear):
            m.merge()
            model.set_submodule(name, m.base)
    return model
