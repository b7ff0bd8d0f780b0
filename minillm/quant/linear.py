"""Quantized linear layers that are really faster: the weight stays packed in memory.

Batch-1 decode reads every weight once per token and does two flops with it, so its speed is
set by bytes moved, not by arithmetic. An int8 weight moves half the bytes of bf16, an int4
weight a quarter (plus its group scales). The layers here keep the weight packed and call a
kernel that dequantizes on the fly:

* CPU: PyTorch's packed weight-only ops, ``aten._weight_int8pack_mm`` (int8 per channel) and
  ``aten._weight_int4pack_mm_for_cpu`` (int4 groups, weight repacked by
  ``aten._convert_weight_to_int4pack_for_cpu``). They take bf16 activations (their fp32 path is
  a slow fallback), so activations are cast to bf16 around the op.
* CUDA: the Triton kernel ``minillm.kernels.dequant_matmul`` for int4; int8 multiplies by the
  int8 weight cast to the activation dtype and scales the output.
* Elsewhere (or if an op is missing): dequantize and ``F.linear`` (correct, not fast).

``torch.ops.aten._weight_int4pack_mm_for_cpu`` computes W = (code - 8) * scale + zero, so our
(scale, min) becomes zero = min + 8 * scale.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .formats import check_int4, dequantize_int4, dequantize_int8, pack_int4, quantize_int8

OP_DTYPE = torch.bfloat16  # what the CPU packed ops compute in


def has_cpu_int8_op() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def has_cpu_int4_op() -> bool:
    return (hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
            and hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"))


def _needs_grad(x: torch.Tensor) -> bool:
    """Training through a frozen quantized layer (QLoRA): the packed ops have no backward, so
    the gradient goes through the dequantized weight instead."""
    return torch.is_grad_enabled() and x.requires_grad


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class Int8Linear(nn.Module):
    """y = x W^T with W = scale[:, None] * q, q int8 [N, K] (per output channel)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        dequantize_int8(q[:1], scale[:1])  # checks dtypes and finiteness
        if scale.shape != (q.shape[0],):
            raise ValueError(f"scale must have shape ({q.shape[0]},), got {tuple(scale.shape)}")
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.register_buffer("q", q.contiguous())
        self.register_buffer("scale", scale.float())
        self.register_buffer("scale_op", scale.to(OP_DTYPE))

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls(*quantize_int8(linear.weight.detach()))

    def dequantize(self) -> torch.Tensor:
        return dequantize_int8(self.q, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], self.out_features)
        if _needs_grad(x):
            return F.linear(x, self.dequantize().to(x.dtype))
        if x.device.type == "cpu" and has_cpu_int8_op():
            y = torch.ops.aten._weight_int8pack_mm(_flat(x).to(OP_DTYPE), self.q, self.scale_op)
        else:
            y = F.linear(_flat(x), self.q.to(x.dtype)) * self.scale.to(x.dtype)
        return y.to(x.dtype).reshape(shape)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int4Linear(nn.Module):
    """y = (x * in_scale) W^T with W = code * scale + min in groups of ``group_size`` along K.

    ``in_scale`` (optional, [K]) is AWQ's per-input-channel factor: the stored W is the
    original times 1 / in_scale column-wise, so multiplying x by in_scale restores it.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, group_size: int,
                 in_scale: torch.Tensor | None = None) -> None:
        super().__init__()
        check_int4(q, scale, mn, group_size)
        self.out_features, self.in_features = q.shape
        self.group_size = group_size
        self.register_buffer("packed", pack_int4(q).contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("mn", mn.float().contiguous())
        self.register_buffer("in_scale", None if in_scale is None else in_scale.float())
        self._cpu_packed: tuple[torch.Tensor, torch.Tensor] | None = None

    def codes(self) -> torch.Tensor:
        return torch.stack([self.packed & 0x0F, self.packed >> 4], -1).reshape(
            self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The effective float32 weight [N, K] (in_scale folded back in)."""
        w = dequantize_int4(self.codes(), self.scale, self.mn, self.group_size)
        return w if self.in_scale is None else w * self.in_scale[None, :]

    def _cpu_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The op's own packing and [K/G, N, 2] (scale, zero) table, built once."""
        if self._cpu_packed is None:
            codes = self.codes().to(torch.int32).contiguous()
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            zero = self.mn + 8 * self.scale
            sz = torch.stack([self.scale.t(), zero.t()], -1).to(OP_DTYPE).contiguous()
            self._cpu_packed = (packed, sz)
        return self._cpu_packed

    def _apply(self, fn, recurse=True):  # .to() / .cpu() / .cuda(): rebuild the op's packing
        self._cpu_packed = None
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], self.out_features)
        if _needs_grad(x):
            return F.linear(x, self.dequantize().to(x.dtype))
        h = _flat(x)
        if self.in_scale is not None:
            h = h * self.in_scale.to(h.dtype)
        if h.device.type == "cpu" and has_cpu_int4_op():
            packed, sz = self._cpu_operands()
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(h.to(OP_DTYPE).contiguous(), packed,
                                                           self.group_size, sz)
        elif h.device.type == "cuda":
            from ..device import setup_triton

            setup_triton()
            from ..kernels.dequant_matmul import dequant_matmul

            y = dequant_matmul(h.contiguous(), self.packed, self.scale, self.mn, self.group_size)
        else:
            w = dequantize_int4(self.codes(), self.scale, self.mn, self.group_size)
            y = F.linear(h, w.to(h.dtype))
        return y.to(x.dtype).reshape(shape)

    def extra_repr(self) -> str:
        awq = ", in_scale" if self.in_scale is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int4 group_size={self.group_size}{awq}")


class DequantizedLinear(nn.Linear):
    """A format with no fast kernel here (Q8_0's 32-weight blocks): its decoded weight in a
    plain linear, so perplexity is the format's and speed is the float model's."""

    def __init__(self, weight: torch.Tensor, fmt: str) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias=False,
                         device=weight.device, dtype=weight.dtype)
        self.fmt = fmt
        with torch.no_grad():
            self.weight.copy_(weight)
        self.weight.requires_grad_(False)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float()

    def extra_repr(self) -> str:
        return super().extra_repr() + f", decoded from {self.fmt}"
