"""Where tensors live: device choice, default dtypes, synchronisation, Triton's interpreter.

Triton runs on CPU tensors only through its interpreter, and the switch (``TRITON_INTERPRET=1``)
is read when a kernel module is imported, so :func:`setup_triton` must run before that.
"""
from __future__ import annotations

import os

import torch


def default_device() -> torch.device:
    """CUDA when a GPU is present, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    return default_device() if device is None else torch.device(device)


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """fp32 on the CPU (exact and fast enough), bf16 on a GPU, unless asked otherwise."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}") from None


def sync(device: torch.device | str | None = None) -> None:
    """Wait for queued GPU work (a no-op on the CPU): call before reading a timer."""
    if torch.device(device or default_device()).type == "cuda":
        torch.cuda.synchronize()


def setup_triton() -> bool:
    """Switch Triton to its CPU interpreter when there is no GPU. Returns True if interpreting."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return os.environ.get("TRITON_INTERPRET") == "1"


def fast_mode() -> bool:
    """True when ``MINILLM_FAST=1`` (set by CI): notebooks shrink their sizes."""
    return os.environ.get("MINILLM_FAST", "0") not in ("", "0")
