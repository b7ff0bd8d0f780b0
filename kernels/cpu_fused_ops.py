"""The small operations of a decoder layer, each fused into one C++ pass (CPU, float32/bfloat16).

Between its four matmuls and its attention, an eager Llama layer runs some thirty small PyTorch
operations: RMSNorm is eight (cast, square, mean, add, rsqrt, multiply, cast, scale), RoPE five
per tensor, the residual adds, the cache write, SiLU and the gate product. At a decode step's
few rows each costs its dispatch (a few microseconds) more than its arithmetic, so at batch 1
they add up to a fifth of the step. Here each group is one call, as vLLM's CPU backend and
llama.cpp fuse them:

- :func:`add_rms_norm`: ``x += residual`` (optional), then ``RMSNorm(x) * weight``;
- :func:`rope_store`: rotate q into a new tensor and k into the paged KV cache, copy v there;
- :func:`silu_mul`: ``silu(gate) * up``.

Each rounds where the eager code does (every bfloat16 result of an eager op is rounded to
bfloat16 here too; float32 products are not contracted into FMAs), so the results equal the
eager ones up to the order of a sum or the last bits of an exp: a few ulps at most
(``tests/kernel_tests/test_cpu_fused_ops.py`` compares them with the eager code and float64).
Rows are shared by OpenMP threads once there are enough of them. The C++ is
``cpu_fused_ops.cpp`` beside this file, compiled by :mod:`.cpu_build` after its shared
``SCALARS``, called through ctypes: ``*_into`` unchecked, for the engine
(:mod:`minillm.engine.cpu_forward`), which built every tensor it passes; the others check
their arguments first.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .cpu_build import SCALARS, Library, profiled_call

DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}

SOURCE_FILE = Path(__file__).with_name("cpu_fused_ops.cpp")   # the C++, after SCALARS
SOURCE = SCALARS + SOURCE_FILE.read_text()

# (the model's dtype, a narrower KV cache's) -> the suffix of rope_store_kv (see rope_store_into)
KV_FORMATS = {(torch.float32, torch.bfloat16): "f32_kvbf16",
              (torch.float32, torch.int8): "f32_kvi8", (torch.bfloat16, torch.int8): "bf16_kvi8"}

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {"add_rms_norm": [_P, _I, _P, _I, _P, _P, _I, _I, _F],
              "rope_store": [_P] * 3 + [_I] + [_P] * 6 + [_I] * 4,
              "silu_mul": [_P, _P, _I, _P, _I, _I]}
_KV_ARGS = [_P] * 3 + [_I] + [_P] * 8 + [_I] * 4
# float32 products kept apart from the sums (no FMA contraction), as eager PyTorch computes them
LIBRARY = Library("fused_ops", SOURCE, {f"{op}_{dt}": args for op, args in SIGNATURES.items()
                                        for dt in DTYPES.values()} |
                  {f"rope_store_kv_{fmt}": _KV_ARGS for fmt in KV_FORMATS.values()},
                  ("-ffp-contract=off",), source_file=SOURCE_FILE)


def available() -> bool:
    """Can the ops run here (a C++ compiler built them)?"""
    return LIBRARY.get() is not None


def unavailable_reason() -> str:
    """Why :func:`available` is False ('' when it is True)."""
    return LIBRARY.reason()


def _call(name: str, dtype: torch.dtype, *args) -> None:
    """Call the C++ function ``name`` for ``dtype`` (a torch.profiler row while it records)."""
    profiled_call(getattr(LIBRARY.get(), f"{name}_{DTYPES[dtype]}"), name, *args)


# The unchecked calls (for the engine, which built every tensor it passes: rows contiguous,
# one dtype, slots in range; use the checked functions below otherwise).

def add_rms_norm_into(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float, out: torch.Tensor) -> torch.Tensor:
    """x += residual (when given), then out = weight * RMSNorm(x); x, residual, out [n, d]."""
    _call("add_rms_norm", x.dtype, x.data_ptr(), x.stride(0),
          None if residual is None else residual.data_ptr(),
          0 if residual is None else residual.stride(0), weight.data_ptr(), out.data_ptr(),
          x.shape[0], x.shape[1], eps)
    return out


def rope_store_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, q_out: torch.Tensor) -> torch.Tensor:
    """q_out [n, Hq, D] = rope(q); rope(k), v stored at ``slot_mapping`` of the caches: in
    q's dtype, or narrower (bfloat16 below float32; an ``Int8Blocks`` of int8 data and scales,
    quantized as ``minillm.attention.kv_quant.quantize_int8`` does)."""
    hkv, d = k_cache.shape[2:]
    head = (q.shape[0], q.shape[1] // d, hkv, d)
    if k_cache.dtype == q.dtype:
        _call("rope_store", q.dtype, q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0),
              cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(), k_cache.data_ptr(),
              v_cache.data_ptr(), slot_mapping.data_ptr(), *head)
        return q_out
    if d > 256:
        raise ValueError(f"a narrower KV cache needs head_dim <= 256, got {d}")
    scales = [getattr(c, "scale", None) for c in (k_cache, v_cache)]
    data = [c.data if s is not None else c for c, s in zip((k_cache, v_cache), scales)]
    fn = getattr(LIBRARY.get(), f"rope_store_kv_{KV_FORMATS[q.dtype, k_cache.dtype]}")
    profiled_call(fn, "rope_store", q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0),
                  cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(), data[0].data_ptr(),
                  data[1].data_ptr(), *[None if x is None else x.data_ptr() for x in scales],
                  slot_mapping.data_ptr(), *head)
    return q_out


def silu_mul_into(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [n, F] = silu(gate) * up (gate and up sharing one row stride)."""
    _call("silu_mul", gate.dtype, gate.data_ptr(), up.data_ptr(), gate.stride(0),
          out.data_ptr(), gate.shape[0], gate.shape[1])
    return out


def _rows(name: str, t: torch.Tensor, width: int, dtype: torch.dtype) -> int:
    """Check that ``t`` is a CPU [rows, width] matrix of ``dtype`` whose rows are contiguous;
    return its row stride."""
    if t.device.type != "cpu" or t.dtype != dtype or t.dim() != 2 or t.shape[1] != width \
            or (t.shape[0] > 0 and width > 1 and t.stride(1) != 1):
        raise ValueError(f"{name} must be a CPU [rows, {width}] tensor of dtype {dtype} with "
                         f"contiguous rows, got {tuple(t.shape)} {t.dtype} on {t.device}")
    return t.stride(0)


def _ready(dtype: torch.dtype) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
    if not available():
        raise RuntimeError(f"the CPU fused ops are unavailable: {unavailable_reason()}")


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, d] (rows contiguous): with ``residual`` [n, d], first ``x += residual`` in place;
    returns weight [d] * RMSNorm(x) as a new [n, d] tensor (minillm's RMSNorm rounding)."""
    _ready(x.dtype)
    n, d = x.shape if x.dim() == 2 else (-1, -1)
    _rows("x", x, d, x.dtype)
    _rows("weight", weight[None], d, x.dtype)
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    if residual is not None:
        _rows("residual", residual, d, x.dtype)
    if residual is not None and residual.shape[0] != n:
        raise ValueError(f"residual must have x's {n} rows, got {residual.shape[0]}")
    return add_rms_norm_into(x, residual, weight, eps, torch.empty(n, d, dtype=x.dtype))


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slot_mapping: torch.Tensor) -> torch.Tensor:
    """q [n, Hq * D], k, v [n, Hkv * D] sharing one row stride (views of a fused qkv output or
    contiguous); cos, sin [n, D] (:func:`minillm.model.layers.rope_cos_sin` in q's dtype).
    Writes rope(k) and v at ``slot_mapping`` (int64 [n]) of k_cache, v_cache
    [blocks, block_size, Hkv, D]; returns rope(q) [n, Hq, D]."""
    _ready(q.dtype)
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or not k_cache.is_contiguous() \
            or not v_cache.is_contiguous() or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"k_cache, v_cache must be contiguous [blocks, block_size, Hkv, D] of "
                         f"dtype {q.dtype}, got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    hkv, d = k_cache.shape[2:]
    n = q.shape[0] if q.dim() == 2 else -1
    hq = q.shape[1] // d if q.dim() == 2 else 0
    if d % 2 or hq * d != (q.shape[1] if q.dim() == 2 else -1):
        raise ValueError(f"q must be [n, Hq * {d}] for an even head_dim, got {tuple(q.shape)}")
    ld = _rows("q", q, hq * d, q.dtype)
    for name, t in (("k", k), ("v", v)):
        if _rows(name, t, hkv * d, q.dtype) != ld or t.shape[0] != n:
            raise ValueError(f"{name} must have q's rows and row stride, got {tuple(t.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not t.is_contiguous() or _rows(name, t, d, q.dtype) != d or t.shape[0] != n:
            raise ValueError(f"{name} must be contiguous [{n}, {d}], got {tuple(t.shape)}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (n,) \
            or not slot_mapping.is_contiguous():
        raise ValueError(f"slot_mapping must be a contiguous int64 [{n}] tensor")
    slots = k_cache.shape[0] * k_cache.shape[1]
    if n and not 0 <= int(slot_mapping.min()) <= int(slot_mapping.max()) < slots:
        raise ValueError(f"slot_mapping must index the cache's {slots} slots")
    return rope_store_into(q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
                           torch.empty(n, hq, d, dtype=q.dtype))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [n, F] sharing one row stride (views of a fused gate/up output, or contiguous)
    -> silu(gate) * up [n, F], a new tensor."""
    _ready(gate.dtype)
    f = gate.shape[-1]
    ld = _rows("gate", gate, f, gate.dtype)
    if _rows("up", up, f, gate.dtype) != ld or up.shape[0] != gate.shape[0]:
        raise ValueError(f"up must have gate's shape and row stride, got {tuple(up.shape)}")
    return silu_mul_into(gate, up, torch.empty(gate.shape[0], f, dtype=gate.dtype))
