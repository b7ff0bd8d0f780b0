"""Packed linears for fast CPU inference (the engine applies them on the CPU in float32, and
in bfloat16 where oneDNN has bf16 kernels): each weight laid out once for the matmul that
serves it (:class:`CpuWeight`), oneDNN's, or at a decode step's few bfloat16 rows the C++
matrix-vector kernel (:mod:`minillm.kernels.cpu_bf16_gemv`)."""
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


#: up to this many rows a bfloat16 matmul takes the C++ matrix-vector kernel, oneDNN's above:
#: on SmolLM2's layer shapes, weights out of cache, 2 threads of an AVX-512 BF16 EPYC, it is
#: faster than oneDNN's packed matmul at every row count from 1 to 128, most at the few rows of
#: a decode or verify step, which cost about one row's time up to 12 rows
#: (``python benchmarks/cpu_gemv_bench.py``, ``benchmarks/results/cpu_gemv.json``); on the
#: output head (49152 x 576) x1.5 at one row, level from 16 rows on. So the engine's decode step
#: of up to 128 sequences, or verify step of up to 128 rows, is all C++ (and can be replayed).
GEMV_ROWS = 128


class CpuWeight:
    """One weight W [N, K] (several linears' stacked by output rows) and the CPU's matmuls
    over it: ``w(x, out=None)`` = x [..., K] W^T -> [..., N] in W's dtype (written into
    ``out`` [M, N] when given), outside autograd. Up to :data:`GEMV_ROWS` rows of bfloat16
    the C++ matrix-vector kernel computes it where it runs and takes W, on its own copy of W
    laid out for it; otherwise oneDNN's packed matmul, on W reordered into its blocked layout.
    Each copy is made on its first use."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach()
        self._onednn: torch.Tensor | None = None
        self._gemv = None                  # the kernel's Bf16Weight, False where it does not apply

    def gemv(self):
        """The kernel's copy of W, or None where the kernel does not run or take W."""
        if self._gemv is None:
            from ..kernels import cpu_bf16_gemv

            w = self.weight
            self._gemv = cpu_bf16_gemv.Bf16Weight(w) if w.dtype == torch.bfloat16 \
                and cpu_bf16_gemv.fits(w) and cpu_bf16_gemv.available() else False
        return self._gemv or None

    def one_call(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether x [rows, K] of ``dtype`` is one C++ call (what a recorded step replays)."""
        return dtype == torch.bfloat16 and rows <= GEMV_ROWS and self.gemv() is not None

    def onednn(self) -> torch.Tensor:
        """W in oneDNN's blocked layout (:func:`pack_weight`)."""
        if self._onednn is None:
            self._onednn = pack_weight(self.weight)
        return self._onednn

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if 0 < rows <= GEMV_ROWS and x.dtype == torch.bfloat16 and x.stride(-1) == 1 \
                and (x.dim() == 2 or x.is_contiguous()) and (gemv := self.gemv()) is not None:
            if x.dim() == 2:
                return gemv(x, out)
            y = gemv(x.view(rows, x.shape[-1]), out)
            return y.view(*x.shape[:-1], y.shape[-1])
        y = packed_matmul(x, self.onednn())
        return y if out is None else out.copy_(y)

    def __getstate__(self) -> dict:
        # the packed tensors are opaque (no storage) or pointers: copies lay W out again
        return {**self.__dict__, "_onednn": None, "_gemv": None}


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose inference forward runs on copies of the weight laid out once for
    the CPU's matmuls (:class:`CpuWeight`: oneDNN's blocked layout, and the C++ matrix-vector
    kernel's at a few bfloat16 rows; see :func:`can_pack_linears`). The weight Parameter
    is the original one (state_dict keys and weight tying are unchanged); the copies are
    redone if the weight is modified in place, and skipped when autograd needs the weight
    (training falls back to ``F.linear``). On a small AVX2 CPU (fp32) the gain is largest for
    the wide output head at tens of rows, an engine decode step; on an AVX-512-BF16 CPU bf16
    gains most at a few rows (``tests/model/test_packed_linear.py`` checks equality,
    ``python -m minillm bench throughput`` measures the speed)."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self._packed: tuple[tuple[int, int], CpuWeight] | None = None

    def cpu_weight(self) -> CpuWeight:
        key = (self.weight.data_ptr(), self.weight._version)
        if self._packed is None or self._packed[0] != key:
            self._packed = key, CpuWeight(self.weight)
        return self._packed[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)) \
                or not can_pack_linears(self.weight.device, self.weight.dtype) \
                or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)  # training, or moved off where it packs
        y = self.cpu_weight()(x)
        return y if self.bias is None else y.add_(self.bias)

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
        self._packed: tuple[tuple, CpuWeight] | None = None

    def cpu_weight(self, linears: list[nn.Linear]) -> CpuWeight:
        key = tuple((lin.weight.data_ptr(), lin.weight._version) for lin in linears)
        if self._packed is None or self._packed[0] != key:
            self._packed = key, CpuWeight(torch.cat([lin.weight.detach() for lin in linears]))
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
        y = self.cpu_weight(linears)(x)
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
