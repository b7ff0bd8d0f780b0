"""oneDNN-packed linears for fast CPU inference (the engine applies them on the CPU in float32,
and in bfloat16 where oneDNN has bf16 kernels)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A [N, K] weight reordered into oneDNN's blocked layout (an opaque tensor) for
    :func:`packed_matmul`; where :func:`can_pack_linears` holds."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_matmul(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] for W packed by :func:`pack_weight`; x in W's
    dtype, outside autograd."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose inference forward runs oneDNN on a copy of the weight reordered
    once into oneDNN's blocked layout (CPU; see :func:`can_pack_linears`). The weight Parameter
    is the original one (state_dict keys and weight tying are unchanged); the packed copy is
    redone if the weight is modified in place, and skipped when autograd needs the weight
    (training falls back to ``F.linear``). On a small AVX2 CPU (fp32) the gain is largest for
    the wide output head at tens of rows, an engine decode step; on an AVX-512-BF16 CPU bf16
    gains most at a few rows (``tests/model/test_packed_linear.py`` checks equality,
    ``python -m minillm bench throughput`` measures the speed)."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self._packed: tuple[tuple[int, int], torch.Tensor] | None = None

    def packed_weight(self) -> torch.Tensor:
        key = (self.weight.data_ptr(), self.weight._version)
        if self._packed is None or self._packed[0] != key:
            self._packed = key, pack_weight(self.weight)
        return self._packed[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)) \
                or not can_pack_linears(self.weight.device, self.weight.dtype):
            return F.linear(x, self.weight, self.bias)  # training, or moved off where it packs
        return packed_matmul(x, self.packed_weight(), self.bias)

    def __getstate__(self) -> dict:
        # the packed tensor is opaque (no storage): copies and pickles repack on first use
        return {**self.__dict__, "_packed": None}


class PackedGroup:
    """Linears that read the same input (attention's q, k, v; the FFN's gate and up) run as
    one oneDNN matmul over their weights concatenated by output rows, packed once: fewer, wider
    matmuls, which at the few rows of a decode step stream the weights faster (one call instead
    of three; ``tests/model/test_packed_linear.py`` checks equality). Not a module: it names the
    linears of ``owner`` and looks them up at each call, so the weights stay their own
    Parameters (state_dict unchanged) and a linear swapped later (sharded, quantized) is used
    as it is now. The concatenated copy is redone when a weight changes; a call that autograd
    must see, in a dtype or device that does not pack, or over anything but bias-free plain
    linears runs them one by one.
    Calling it returns the outputs in order, views of one [..., sum of out_features] result."""

    def __init__(self, owner: nn.Module, *names: str) -> None:
        self.owner, self.names = owner, names
        self._packed: tuple[tuple, torch.Tensor] | None = None

    def packed_weight(self, linears: list[nn.Linear]) -> torch.Tensor:
        key = tuple((lin.weight.data_ptr(), lin.weight._version) for lin in linears)
        if self._packed is None or self._packed[0] != key:
            weight = torch.cat([lin.weight.detach() for lin in linears])
            self._packed = key, pack_weight(weight)
        return self._packed[1]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        linears = [getattr(self.owner, n) for n in self.names]
        if any(type(lin) not in (nn.Linear, PackedLinear) or lin.bias is not None
               or lin.weight.is_inference() for lin in linears):   # (no version counter)
            return tuple(lin(x) for lin in linears)
        w = linears[0].weight
        if any(lin.weight.dtype != w.dtype for lin in linears) \
                or (torch.is_grad_enabled() and (x.requires_grad or any(
                    lin.weight.requires_grad for lin in linears))) \
                or not can_pack_linears(w.device, w.dtype) or x.dtype != w.dtype:
            return tuple(lin(x) for lin in linears)
        y = packed_matmul(x, self.packed_weight(linears))
        return y.split([lin.out_features for lin in linears], dim=-1)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_packed": None}


def can_pack_linears(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :class:`PackedLinear` applies: on a CPU whose PyTorch has oneDNN, float32, or
    bfloat16 where oneDNN has bf16 kernels for this CPU (AVX-512 and up)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available() \
            or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16
                                      and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linears(model: nn.Module) -> int:
    """Replace every plain ``nn.Linear`` of ``model`` by a :class:`PackedLinear` sharing its
    parameters (in place), and give each attention its q/k/v and each SwiGLU its gate/up as
    one :class:`PackedGroup` (used while they are bias-free plain linears); returns how many
    linears were replaced."""
    from .layers import Attention, SwiGLU

    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    for m in model.modules():
        if type(m) is Attention:
            m.input_group = PackedGroup(m, "wq", "wk", "wv")
        elif type(m) is SwiGLU:
            m.input_group = PackedGroup(m, "w_gate", "w_up")
    return len(swaps)
