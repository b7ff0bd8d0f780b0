"""Small helpers shared by the kernel wrappers: input checks, launch choices, autotune switch.

Every wrapper checks its inputs here *before* launching, so a bad call fails with a ValueError
that names the argument instead of a Triton compile error or a silent out-of-bounds read.
"""
from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence

import torch
import triton

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_tensor(name: str, t: object, *, ndim: int | None = None,
                 dtypes: Sequence[torch.dtype] | None = None,
                 contiguous: bool = False, last_dim_contiguous: bool = False) -> torch.Tensor:
    """Raise ValueError naming ``name`` unless ``t`` is a tensor of the given rank/dtype/layout."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({allowed}), got {t.dtype}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension "
                         f"(stride(-1) == 1), got strides {t.stride()}")
    return t


def check_same(names: str, values: Sequence[object]) -> None:
    """Raise ValueError unless all ``values`` are equal (``names`` says what they are)."""
    if any(v != values[0] for v in values[1:]):
        raise ValueError(f"{names} must match, got {list(values)}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def check_head_dim(name: str, d: int, max_dim: int = 256) -> None:
    """The kernels tile the head dimension whole: a power of two in [16, max_dim]."""
    if d < 16 or d > max_dim or d & (d - 1):
        raise ValueError(f"{name} head_dim must be a power of two in [16, {max_dim}], got {d}")


def check_heads(num_q_heads: int, num_kv_heads: int) -> int:
    """Return the GQA group size Hq // Hkv, or raise if Hkv does not divide Hq."""
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"number of query heads ({num_q_heads}) must be a multiple of the "
                         f"number of kv heads ({num_kv_heads})")
    return num_q_heads // num_kv_heads


def check_device_ready(t: torch.Tensor) -> None:
    """CPU tensors run only in Triton's interpreter, which must be switched on before import."""
    if t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("Triton kernels on CPU tensors need the interpreter: call "
                           "minillm.device.setup_triton() before importing minillm.kernels")


def use_autotune(t: torch.Tensor) -> bool:
    """Autotune only on a real GPU; the interpreter runs one fixed small config."""
    return t.device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products (not TF32); fp16/bf16 use the tensor cores as is."""
    return "ieee" if dtype == torch.float32 else "tf32"


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def autotuned(kernel: Callable, configs: Callable[[], list], key: list[str]) -> Callable:
    """Wrap a ``@triton.jit`` kernel in ``triton.autotune`` lazily, on first use, once.

    ``configs`` is a function so that nothing is built at import time.
    """
    @functools.cache
    def build():
        return triton.autotune(configs=configs(), key=key)(kernel)

    return build


def num_sms(device: torch.device) -> int:
    """Multiprocessor count of the GPU (132 on an H100/H200); a fixed guess elsewhere."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def softmax_scale(scale: float | None, head_dim: int) -> float:
    """The attention scale: 1/sqrt(head_dim) by default, else a positive finite number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (
            math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return float(scale)
