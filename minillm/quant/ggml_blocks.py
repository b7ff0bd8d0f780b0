"""GGUF block formats encoded by our code: Q8_0, Q4_1 (our model's own formats) and Q4_K.

Decoding Q8_0 and Q4_1 lives in :mod:`minillm.checkpoint.gguf` (that is how the model file is read);
this module adds the encoders and the k-quant. Layouts (ggml's ``ggml-common.h``):

* **Q8_0**, 32 weights, 34 bytes: fp16 d, 32 x int8 q; w = d * q, d = max|w| / 127.
* **Q4_1**, 32 weights, 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m,
  m = min(w), d = (max - min) / 15. Byte j holds weight j (low nibble) and j + 16 (high).
* **Q4_K**, 256 weights ("super-block"), 144 bytes: fp16 d, fp16 dmin, 12 bytes holding eight
  6-bit scales and eight 6-bit mins, 128 bytes of nibbles. Sub-block i (32 weights) has
  w = d * sc_i * q - dmin * m_i: two levels of scales, the small ones stored in 6 bits. It
  costs 4.5 bits a weight against Q4_1's 5.

Q8_0 and Q4_1 are bit-exact with ggml's reference quantizer (checked against the ``gguf``
package). Our Q4_K encoder is a plain one (round-to-nearest scales, no search); its bytes are
decoded by the ``gguf`` package to the same floats as by :func:`dequantize_q4_k`.
"""
from __future__ import annotations

import numpy as np
import torch

from ..checkpoint.gguf import dequantize_q4_1, dequantize_q8_0

QK = 32
QK_K = 256
#: format -> (weights per block, bytes per block)
BLOCKS = {"q8_0": (32, 34), "q4_1": (32, 20), "q4_k": (256, 144)}


def _blocks(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """[N, K] float -> [N * K / block, block] float32; rows must be whole blocks."""
    if fmt not in BLOCKS:
        raise ValueError(f"format must be one of {sorted(BLOCKS)}, got {fmt!r}")
    per, _ = BLOCKS[fmt]
    if w.dim() != 2 or w.shape[1] % per:
        raise ValueError(f"{fmt} needs rows of a multiple of {per} weights, got shape "
                         f"{tuple(w.shape)}")
    if not torch.isfinite(w).all():
        raise ValueError("weight holds NaN or inf values and cannot be quantized")
    return w.detach().float().cpu().reshape(-1, per)


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (halves away from zero), as ggml and the gguf package use."""
    a = x.abs()
    f = torch.floor(a)
    return torch.sign(x) * (f + torch.floor(2 * (a - f)))


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """[n] float -> [n, 2] uint8 (little-endian fp16)."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(-1, 2)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def quantize_q8_0(w: torch.Tensor) -> np.ndarray:
    """[N, K] -> raw Q8_0 bytes [N * K / 32, 34] (uint8)."""
    b = _blocks(w, "q8_0")
    d = b.abs().amax(1) / 127
    q = _roundf(b * _inverse(d)[:, None]).to(torch.int8)
    return torch.cat([_fp16_bytes(d), q.view(torch.uint8)], 1).numpy()


def quantize_q4_1(w: torch.Tensor) -> np.ndarray:
    """[N, K] -> raw Q4_1 bytes [N * K / 32, 20]."""
    b = _blocks(w, "q4_1")
    mx, mn = b.amax(1), b.amin(1)
    d = (mx - mn) / 15
    q = torch.trunc((b - mn[:, None]) * _inverse(d)[:, None] + 0.5).clamp(0, 15).to(torch.uint8)
    nib = q[:, :16] | (q[:, 16:] << 4)
    return torch.cat([_fp16_bytes(d), _fp16_bytes(mn), nib], 1).numpy()


def _fp16_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 >= x (so that a 6-bit multiple of it still covers x)."""
    h = x.to(torch.float16)
    up = torch.nextafter(h.float(), torch.tensor(float("inf"))).to(torch.float16)
    return torch.where(h.float() < x, up, h).float()


def quantize_q4_k(w: torch.Tensor) -> np.ndarray:
    """[N, K] (K a multiple of 256) -> raw Q4_K bytes [N * K / 256, 144].

    Sub-block i gets min_i = min(0, min w) and scale_i = (max w - min_i) / 15; the
    super-block stores d = max scale_i / 63 and dmin = max(-min_i) / 63 in fp16 and each
    sub-block's sc_i = ceil(scale_i / d), m_i = ceil(-min_i / dmin) in 6 bits (rounded up, so
    the 16 levels still span the sub-block).
    """
    b = _blocks(w, "q4_k").reshape(-1, 8, 32)
    mn = b.amin(-1).clamp(max=0)
    scale = (b.amax(-1) - mn) / 15
    d = _fp16_at_least(scale.amax(1) / 63)
    dmin = _fp16_at_least((-mn).amax(1) / 63)
    sc = torch.ceil(scale * _inverse(d)[:, None]).clamp(0, 63)
    m = torch.ceil(-mn * _inverse(dmin)[:, None]).clamp(0, 63)
    step, offset = d[:, None] * sc, dmin[:, None] * m
    q = torch.round((b + offset[..., None]) * _inverse(step)[..., None]).clamp(0, 15)
    q = q.to(torch.uint8)
    sc, m = sc.to(torch.uint8), m.to(torch.uint8)
    scales = torch.cat([sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
                        m[:, :4] | ((m[:, 4:] >> 4) << 6),
                        (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], 1)
    nib = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # chunk c: sub-blocks 2c, 2c+1
    return torch.cat([_fp16_bytes(d), _fp16_bytes(dmin), scales, nib], 1).numpy()


def q4_k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 packed bytes [n, 12] -> 6-bit (sc, m) [n, 8] each."""
    s = scales.to(torch.int32)
    lo_sc, lo_m, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo_sc & 0x3F, (hi & 0x0F) | ((lo_sc >> 2) & 0x30)], 1)
    m = torch.cat([lo_m & 0x3F, (hi >> 4) | ((lo_m >> 2) & 0x30)], 1)
    return sc, m


def q4_k_parts(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[n, 144] Q4_K bytes -> (q [n*8, 32] codes, step [n*8], offset [n*8]):
    w = q * step - offset for each 32-weight sub-block."""
    b = torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.uint8))
    d = b[:, 0:2].contiguous().view(torch.float16).float()
    dmin = b[:, 2:4].contiguous().view(torch.float16).float()
    sc, m = q4_k_scales_mins(b[:, 4:16])
    nib = b[:, 16:].reshape(-1, 4, 32)
    q = torch.stack([nib & 0x0F, nib >> 4], 2).reshape(-1, 32)
    return q, (d * sc).reshape(-1), (dmin * m).reshape(-1)


def dequantize_q4_k(blocks: np.ndarray) -> torch.Tensor:
    """[n_blocks, 144] uint8 -> [n_blocks, 256] float32."""
    q, step, offset = q4_k_parts(blocks)
    return (q.float() * step[:, None] - offset[:, None]).reshape(-1, QK_K)


_DECODERS = {"q8_0": dequantize_q8_0, "q4_1": dequantize_q4_1, "q4_k": dequantize_q4_k}
_SCALE_BYTES = {"q8_0": (0, 2), "q4_1": (0, 4), "q4_k": (0, 4)}  # fp16 fields of each block

ENCODERS = {"q8_0": quantize_q8_0, "q4_1": quantize_q4_1, "q4_k": quantize_q4_k}


def encode(w: torch.Tensor, fmt: str) -> np.ndarray:
    """[N, K] float -> raw blocks of ``fmt`` ("q8_0", "q4_1" or "q4_k")."""
    _blocks(w, fmt)  # checks the name and the shape first
    return ENCODERS[fmt](w)


def check_blocks(raw: np.ndarray, fmt: str, shape: tuple[int, int] | None = None) -> np.ndarray:
    """Raw bytes -> [n_blocks, bytes_per_block]; a wrong size or a NaN/inf scale is a
    ValueError that says which block is corrupt."""
    if fmt not in BLOCKS:
        raise ValueError(f"format must be one of {sorted(BLOCKS)}, got {fmt!r}")
    per, nbytes = BLOCKS[fmt]
    raw = np.asarray(raw, dtype=np.uint8)
    if raw.size % nbytes:
        raise ValueError(f"corrupt {fmt} tensor: {raw.size} bytes is not a whole number of "
                         f"{nbytes}-byte blocks")
    blocks = raw.reshape(-1, nbytes)
    if shape is not None and blocks.shape[0] * per != shape[0] * shape[1]:
        raise ValueError(f"corrupt {fmt} tensor: {blocks.shape[0]} blocks hold "
                         f"{blocks.shape[0] * per} weights, shape {tuple(shape)} needs "
                         f"{shape[0] * shape[1]}")
    lo, hi = _SCALE_BYTES[fmt]
    scales = np.ascontiguousarray(blocks[:, lo:hi]).view(np.float16)
    bad = np.flatnonzero(~np.isfinite(scales).all(axis=1))
    if bad.size:
        raise ValueError(f"corrupt {fmt} tensor: block {int(bad[0])} has a NaN or inf scale "
                         f"({bad.size} bad blocks)")
    return blocks


def decode(raw: np.ndarray, fmt: str, shape: tuple[int, int]) -> torch.Tensor:
    """Raw blocks of ``fmt`` -> float32 tensor of ``shape``."""
    return _DECODERS[fmt](check_blocks(raw, fmt, shape)).reshape(shape)


def int4_groups(raw: np.ndarray, fmt: str, shape: tuple[int, int]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 or Q4_K blocks as the int4 group-wise triple (q, scale, min) with group 32, so
    the fast int4 linear runs them: Q4_1 (q, d, m); Q4_K (q, d*sc_i, -dmin*m_i)."""
    blocks = check_blocks(raw, fmt, shape)
    n, k = shape
    if fmt == "q4_1":
        b = torch.from_numpy(np.ascontiguousarray(blocks))
        d = b[:, 0:2].contiguous().view(torch.float16).float().reshape(n, k // QK)
        m = b[:, 2:4].contiguous().view(torch.float16).float().reshape(n, k // QK)
        q = torch.cat([b[:, 4:] & 0x0F, b[:, 4:] >> 4], 1).reshape(n, k)
        return q, d, m
    if fmt == "q4_k":
        q, step, offset = q4_k_parts(blocks)
        return q.reshape(n, k), step.reshape(n, k // QK), -offset.reshape(n, k // QK)
    raise ValueError(f"int4 groups exist for q4_1 and q4_k only, got {fmt!r}")


def bits_per_weight(fmt: str) -> float:
    per, nbytes = BLOCKS[fmt]
    return nbytes * 8 / per
