"""Weight-only integer formats: int8 per output channel and int4 in groups along the input.

A linear layer's weight W is [N, K] (out_features, in_features); y = x W^T.

* **int8 per channel** (symmetric): row n has one scale s_n = max|W_n| / 127 and
  q = round(W / s_n) in [-127, 127]; W ~ s_n * q.
* **int4 group-wise** (asymmetric, "scale and zero"): each run of ``group_size`` weights along
  K has a scale s and a minimum m; q = round((W - m) / s) in [0, 15] with s = (max - m) / 15;
  W ~ q * s + m. Sixteen levels spread over the group's own range, so a group of small weights
  is not crushed by one large weight elsewhere in the row.

GPTQ, AWQ and HQQ (see their modules) choose the same (q, scale, min) triple differently; the
fast linears in :mod:`minillm.quant.linear` run any of them.
"""
from __future__ import annotations

import torch

INT4_GROUP_SIZES = (32, 64, 128)


def check_weight(w: torch.Tensor, name: str = "weight") -> None:
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"{name} must be a 2-D tensor [out_features, in_features], got {shape}")
    if not torch.isfinite(w).all():
        raise ValueError(f"{name} holds NaN or inf values and cannot be quantized")


def check_group_size(in_features: int, group_size: int, layer: str = "layer") -> None:
    """The group size must be one of INT4_GROUP_SIZES and divide the layer's in_features."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
    if in_features % group_size:
        ok = [g for g in INT4_GROUP_SIZES if in_features % g == 0]
        raise ValueError(f"group_size={group_size} does not divide {layer}'s in_features="
                         f"{in_features}; group sizes that do: {ok}")


# ----------------------------------------------------------------------------- int8

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (q int8 [N, K], scale float32 [N]); W ~ scale[:, None] * q."""
    check_weight(w)
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q int8 [N, K], scale [N]) -> float32 [N, K]."""
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"q must be a 2-D int8 tensor, got {q.dtype} {tuple(q.shape)}")
    if scale.shape != (q.shape[0],) or not torch.isfinite(scale).all():
        raise ValueError(f"scale must be finite with shape ({q.shape[0]},), got "
                         f"{tuple(scale.shape)}" + ("" if torch.isfinite(scale).all()
                                                    else " holding NaN/inf (corrupt tensor)"))
    return q.float() * scale.float()[:, None]


# ----------------------------------------------------------------------------- int4

def int4_params(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest (scale, min) of each group: the group's own min and (max - min) / 15."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    mn, mx = g.amin(-1), g.amax(-1)
    scale = ((mx - mn) / 15).clamp(min=1e-12)
    return scale, mn


def quantize_int4_with(w: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor,
                       group_size: int) -> torch.Tensor:
    """The int4 codes of W for given per-group (scale, min): round((W - min) / scale) in [0, 15]."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    q = torch.round((g - mn[..., None]) / scale[..., None]).clamp(0, 15)
    return q.to(torch.uint8).reshape(n, k)


def quantize_int4(w: torch.Tensor, group_size: int = 32
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] -> (q uint8 [N, K] in 0..15, scale [N, K/g], min [N, K/g]); W ~ q*scale + min."""
    check_weight(w)
    check_group_size(w.shape[1], group_size)
    scale, mn = int4_params(w, group_size)
    return quantize_int4_with(w, scale, mn, group_size), scale, mn


def check_int4(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, group_size: int) -> None:
    """Shapes, code range and finiteness of an int4 tensor: a corrupt one is a ValueError."""
    if q.dim() != 2:
        raise ValueError(f"q must be 2-D [N, K], got shape {tuple(q.shape)}")
    check_group_size(q.shape[1], group_size)
    want = (q.shape[0], q.shape[1] // group_size)
    for name, t in (("scale", scale), ("min", mn)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must have shape {want} for q {tuple(q.shape)} and "
                             f"group_size={group_size}, got {tuple(t.shape)}")
        if not torch.isfinite(t).all():
            raise ValueError(f"corrupt int4 tensor: {name} holds NaN or inf")
    if q.numel() and int(q.max()) > 15:
        raise ValueError(f"corrupt int4 tensor: codes must be in [0, 15], got max {int(q.max())}")


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """(q [N, K], scale [N, K/g], min [N, K/g]) -> float32 [N, K]."""
    check_int4(q, scale, mn, group_size)
    n, k = q.shape
    g = q.float().reshape(n, k // group_size, group_size)
    return (g * scale.float()[..., None] + mn.float()[..., None]).reshape(n, k)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> [N, K/2] uint8: byte j holds code 2j (low nibble), 2j+1 (high)."""
    if q.shape[-1] % 2:
        raise ValueError(f"in_features must be even to pack two codes a byte, got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)
