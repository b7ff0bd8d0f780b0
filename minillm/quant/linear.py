"""Quantized linear layers that are really faster: the weight stays packed in memory.

Batch-1 decode reads every weight once per token and does two flops with it, so its speed is
set by bytes moved, not by arithmetic. An int8 weight moves half the bytes of bf16, an int4
weight a quarter (plus its group scales). The layers here keep the weight packed and call a
kernel that dequantizes on the fly:

* CPU, up to :data:`KERNEL_ROWS` rows (int8: a decode step's few rows; int4: 128): minillm's
  integer kernels (:mod:`minillm.kernels.cpu_quant_matmul`), which quantize the activations to
  int8 in blocks of 32 as llama.cpp does and multiply integers (AVX-VNNI where the CPU has it,
  AVX2's two-step multiply-add elsewhere). Under
  ``torch.compile`` they are the custom ops ``minillm::int8_matmul`` / ``minillm::int4_matmul``.
* CPU, more rows (a prefill), or where the kernels did not build: PyTorch's packed
  weight-only ops, ``aten._weight_int8pack_mm`` (int8 per channel) and
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

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..device import cpu_features
from .formats import check_int4, dequantize_int4, dequantize_int8, pack_int4, quantize_int8

if TYPE_CHECKING:
    from ..kernels.cpu_quant_matmul import BoundWeight

OP_DTYPE = torch.bfloat16  # what the CPU packed ops compute in
#: up to this many rows the integer kernels run a layer, PyTorch's weight-only ops above,
#: measured per instruction set (``python benchmarks/quant_matmul_bench.py`` ->
#: benchmarks/results/quant_matmul.json, and ``--isa avx2``, an AVX2-only CPU's paths on an
#: AVX-512 one -> quant_matmul_avx2.json; SmolLM2's shapes, 2 threads: PyTorch's time over
#: ours). AVX-512 VNNI: int8 x1.0-1.3 at 1 row, the output head x2.3, at 4 rows the layers
#: x0.8-1.0 and the head x1.8; int4 x1.4-2.5 at 1 to 32 rows, x1.6-3.3 at 64 and 128. AVX2:
#: int8 x1.0-1.2 at 1 row but the head x0.85 (a wash over a step; one row keeps the step all
#: C++, which a recorded step needs), behind from 2 rows; int4 x1.4-3.0 at 1 to 32 rows.
VNNI_KERNEL_ROWS = {"int8": 4, "int4": 128}
AVX2_KERNEL_ROWS = {"int8": 1, "int4": 128}
KERNEL_ROWS = VNNI_KERNEL_ROWS if cpu_features() & {"avx512_vnni", "avx_vnni"} \
    else AVX2_KERNEL_ROWS if "avx2" in cpu_features() else dict.fromkeys(VNNI_KERNEL_ROWS, 0)


_KERNELS = None


def _qmm():
    """minillm.kernels.cpu_quant_matmul, imported on first use (importing minillm imports no
    kernel module)."""
    global _KERNELS
    if _KERNELS is None:
        from ..kernels import cpu_quant_matmul

        _KERNELS = cpu_quant_matmul
    return _KERNELS


def _use_int_kernel(h: torch.Tensor, kind: str) -> bool:
    """A CPU input h [M, K] of at most ``KERNEL_ROWS[kind]`` float32/bfloat16 rows, K a
    multiple of the kernels' block of 32, and kernels that built here."""
    return h.device.type == "cpu" and h.shape[0] <= KERNEL_ROWS[kind] \
        and h.shape[-1] % 32 == 0 and h.dtype in _qmm().DTYPES \
        and _qmm().available()


def _int8_kernel(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (rows contiguous) @ (scale[:, None] * q)^T -> [M, N] in x's dtype (q in the
    kernel's layout: ``cpu_quant_matmul.pack_int8``)."""
    return _qmm().BoundWeight(q, scale)(x)


def _int4_kernel(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                 mn: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T for the int4 operands of ``cpu_quant_matmul.pack_int4`` -> [M, N]."""
    return _qmm().BoundWeight(packed, scale, mn)(x)


# the kernels as custom ops: opaque nodes of a torch.compile graph
int8_matmul_op = torch.library.custom_op("minillm::int8_matmul", _int8_kernel, mutates_args=())
int4_matmul_op = torch.library.custom_op("minillm::int4_matmul", _int4_kernel, mutates_args=())
int8_matmul_op.register_fake(lambda x, q, scale: x.new_empty(x.shape[0], q.shape[0]))
int4_matmul_op.register_fake(lambda x, packed, scale, mn: x.new_empty(x.shape[0],
                                                                        packed.shape[0]))


def _kernel_shape(layer: nn.Module) -> bool:
    """Whether the integer kernels take the layer's weight: in_features a multiple of 32, and
    for int4 out_features a multiple of the kernel's 16 rows."""
    return layer.in_features % 32 == 0 \
        and (isinstance(layer, Int8Linear) or layer.out_features % 16 == 0)


def _prepare_kernel(layer: Int8Linear | Int4Linear) -> None:
    """Lay a new CPU layer's weight out for the integer kernels now (a second copy of its
    bytes), so a torch.compile trace finds it ready; elsewhere it waits for a first call."""
    if layer.scale.device.type == "cpu" and _kernel_shape(layer) and _qmm().available():
        layer.kernel_operands()


def _use_kernel(layer: Int8Linear | Int4Linear, h: torch.Tensor) -> bool:
    """Whether h goes to the integer kernels: a few CPU rows (:func:`_use_int_kernel`), and
    while torch.compile traces, a layout already made (building one is not traceable)."""
    kind = "int8" if isinstance(layer, Int8Linear) else "int4"
    return _use_int_kernel(h, kind) and _kernel_shape(layer) \
        and not (torch.compiler.is_compiling() and layer._bound is None)


def _kernel_forward(layer: Int8Linear | Int4Linear, h: torch.Tensor) -> torch.Tensor:
    """h [M, K] @ layer's W^T by the integer kernels: the custom op while torch.compile
    traces, else the layer's BoundWeight (eager calls skip the dispatcher, ~10 us)."""
    h = h if h.stride(-1) == 1 else h.contiguous()
    if layer._bound is None:
        layer.kernel_operands()
    if torch.compiler.is_compiling():
        return (int8_matmul_op if len(layer._bound.operands) == 2 else int4_matmul_op)(
            h, *layer._bound.operands)
    return layer._bound(h)


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
        self._kernel_ops: tuple[torch.Tensor, torch.Tensor] | None = None
        self._bound: BoundWeight | None = None
        _prepare_kernel(self)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls(*quantize_int8(linear.weight.detach()))

    def dequantize(self) -> torch.Tensor:
        return dequantize_int8(self.q, self.scale)

    def kernel_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """minillm's integer kernel's (q in its layout, float32 scale), built once."""
        if self._kernel_ops is None:
            self._kernel_ops = (_qmm().pack_int8(self.q),
                              self.scale.float().contiguous())
            self._bound = _qmm().BoundWeight(*self._kernel_ops)
        return self._kernel_ops

    def _apply(self, fn, recurse=True):  # .to() / .cpu() / .cuda(): rebuild the layout
        self._kernel_ops = self._bound = None
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], self.out_features)
        if _needs_grad(x):
            return F.linear(x, self.dequantize().to(x.dtype))
        h = _flat(x)
        if _use_kernel(self, h):
            y = _kernel_forward(self, h)
        elif h.device.type == "cpu" and has_cpu_int8_op():
            y = torch.ops.aten._weight_int8pack_mm(h.to(OP_DTYPE), self.q, self.scale_op)
        else:
            y = F.linear(h, self.q.to(h.dtype)) * self.scale.to(h.dtype)
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
        self._kernel_ops: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._bound: BoundWeight | None = None
        _prepare_kernel(self)

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

    def kernel_bytes(self) -> int:
        """Bytes the CPU integer kernel reads for this weight: the packed codes, and a scale
        and a minimum per block of 32, float16 where they are exactly float16 numbers (as
        ``cpu_quant_matmul.pack_int4`` lays them out), else float32."""
        half = all(torch.equal(t.half().float(), t) for t in (self.scale, self.mn))
        blocks = self.out_features * (self.in_features // 32)
        return self.packed.numel() + 2 * blocks * (2 if half else 4)

    def kernel_operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """minillm's integer kernel's (packed, scale, mn) per block of 32, built once."""
        if self._kernel_ops is None:
            self._kernel_ops = _qmm().pack_int4(self.codes(), self.scale, self.mn,
                                                self.group_size)
            self._bound = _qmm().BoundWeight(*self._kernel_ops)
        return self._kernel_ops

    def _apply(self, fn, recurse=True):  # .to() / .cpu() / .cuda(): rebuild the op's packing
        self._cpu_packed = self._kernel_ops = self._bound = None
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], self.out_features)
        if _needs_grad(x):
            return F.linear(x, self.dequantize().to(x.dtype))
        h = _flat(x)
        if self.in_scale is not None:
            h = h * self.in_scale.to(h.dtype)
        if _use_kernel(self, h):
            y = _kernel_forward(self, h)
        elif h.device.type == "cpu" and has_cpu_int4_op():
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


class QuantGroup:
    """Quantized linears that read the same input (attention's q, k, v; the FFN's gate and up),
    or a single one, as one call: x [M, K] -> [M, sum of out_features], their outputs side by
    side (what the engine's CPU fast path, :mod:`minillm.engine.cpu_forward`, calls). Up to
    :data:`KERNEL_ROWS` rows it is one integer-kernel call over the linears' operands
    concatenated by output rows (a copy, built once: the weights' int8 or int4 bytes twice in
    memory); more rows run each linear's own forward. All int8, or all int4 without AWQ's
    in_scale (:meth:`supports`)."""

    def __init__(self, linears: list[nn.Module]) -> None:
        if not self.supports(linears):
            raise ValueError("linears must be all Int8Linear or all Int4Linear without "
                             "in_scale, with in_features a multiple of 32 (int4: out_features "
                             "a multiple of 16)")
        self.linears = linears
        self.kind = "int8" if isinstance(linears[0], Int8Linear) else "int4"
        ops = [lin.kernel_operands() for lin in linears]
        self.weight = _qmm().BoundWeight(
            *(ops[0] if len(ops) == 1 else (torch.cat(p) for p in zip(*ops))))

    @staticmethod
    def supports(linears: list[nn.Module]) -> bool:
        kinds = {type(lin) for lin in linears}
        return len(kinds) == 1 and kinds <= {Int8Linear, Int4Linear} \
            and len({lin.in_features for lin in linears}) == 1 \
            and all(_kernel_shape(lin) for lin in linears) \
            and all(getattr(lin, "in_scale", None) is None for lin in linears) \
            and all(lin.q.device.type == "cpu" if isinstance(lin, Int8Linear)
                    else lin.packed.device.type == "cpu" for lin in linears)

    def one_call(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether x [rows, K] of ``dtype`` (rows contiguous) is one integer-kernel call, all
        C++ (what a recorded decode step replays: :mod:`minillm.engine.cpu_replay`)."""
        return _use_int_kernel(torch.empty(rows, self.weight.k, dtype=dtype), self.kind)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N], written into ``out`` [M, N] when given."""
        if _use_int_kernel(x, self.kind) and x.stride(-1) == 1:
            return self.weight(x, out)
        ys = [lin(x) for lin in self.linears]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        return y if out is None else out.copy_(y)


# The engine's CPU fast path runs a group of these linears as one QuantGroup call (it finds the
# group through this attribute: the core never imports minillm.quant).
Int8Linear.fused_group = Int4Linear.fused_group = QuantGroup
