"""``quantize_model``: swap every linear of a Transformer for a quantized one (vLLM-style names).

    model = quantize_model(model, "int4", group_size=32)          # or load_model(quantization=)

Methods (:data:`METHODS`):

======== ====================================================== ============================
name     what the weight becomes                                 kernel
======== ====================================================== ============================
int8     int8 per output channel (round-to-nearest)              packed int8 (CPU op)
int4     int4 groups, round-to-nearest min/max                   packed int4 (CPU op / Triton)
gptq     int4 groups, GPTQ on calibration text                   packed int4
awq      int4 groups of W*s, activation-aware s on calibration   packed int4 (+ x * 1/s)
hqq      int4 groups, HQQ zero points (no calibration)           packed int4
q8_0     GGUF Q8_0 blocks, encoded and decoded by our code        decoded to float
q4_1     GGUF Q4_1 blocks                                        packed int4 (group 32)
q4_k     GGUF Q4_K super-blocks (rows not a multiple of 256       packed int4 (group 32)
         fall back to Q4_1, as llama.cpp falls back to Q5_0)
======== ====================================================== ============================

The output head (tied to the embedding in SmolLM2) is int8 per channel for every method
(``quantize_head=True``); llama.cpp likewise keeps the output matrix at 6-8 bits. The
embedding table stays float: a lookup reads one row per token.

GPTQ and AWQ quantize layer by layer: the calibration text runs through the model, whose
earlier layers are already quantized, up to layer i; the inputs of layer i's linears are
recorded (H = X^T X for GPTQ, X itself for AWQ) and its seven linears are quantized.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from . import ggml_blocks
from .formats import check_group_size, int4_params, quantize_int4_with
from .linear import DequantizedLinear, Int4Linear, Int8Linear
from .methods import awq_quantize, gptq_quantize, hqq_quantize

METHODS = ("int8", "int4", "gptq", "awq", "hqq", "q8_0", "q4_1", "q4_k")
INT4_METHODS = ("int4", "gptq", "awq", "hqq")
CALIBRATION_METHODS = ("gptq", "awq")
DEFAULT_GROUP_SIZE = 32
#: calibration text starts this many tokens into the prose of :func:`minillm.evaluate.sample_text`,
#: past any held-out text the benchmarks score, so the two never overlap
CALIBRATION_OFFSET = 8192
LINEARS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "ffn.w_gate", "ffn.w_up", "ffn.w_down")


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {list(METHODS)}, got {method!r}")
    return method


def calibration_ids(tok, n_tokens: int = 256, offset: int = CALIBRATION_OFFSET) -> list[int]:
    """``n_tokens`` of reference-manual prose that the held-out perplexity text never uses."""
    from ..evaluate import sample_ids

    return sample_ids(offset + n_tokens, tok)[offset:]


class _Stop(Exception):
    pass


@torch.no_grad()
def layer_inputs(model: nn.Module, layer: int, ids: torch.Tensor,
                 names: Sequence[str] = LINEARS) -> dict[str, torch.Tensor]:
    """Run ``ids`` [B, T] through the model up to block ``layer`` and return the input of each
    of its linears as [B*T, in_features] float32 (the forward stops after that block)."""
    block = model.layers[layer]
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for name in names:
        def hook(_m, args, _out, name=name):
            seen[name] = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        hooks.append(block.get_submodule(name).register_forward_hook(hook))

    def stop(*_):
        raise _Stop
    hooks.append(block.register_forward_hook(stop))
    try:
        model(ids.to(model.device))
    except _Stop:
        pass
    finally:
        for h in hooks:
            h.remove()
    return seen


def rtn_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest int4 (:func:`~.formats.quantize_int4`) with each group's scale and
    minimum rounded to float16 numbers first, as GGUF's Q4_1 stores them: the CPU kernel then
    reads them in half the bytes (a quarter of the int4 weight's), and the codes are rounded
    against the values kept. Weights beyond float16's range keep float32 parameters."""
    scale, mn = int4_params(w, group_size)
    half = scale.half().float().clamp(min=2.0 ** -24), mn.half().float()
    if all(torch.isfinite(t).all() for t in half):
        scale, mn = half
    return quantize_int4_with(w, scale, mn, group_size), scale, mn


def quantize_linear(linear: nn.Module, method: str, group_size: int = DEFAULT_GROUP_SIZE,
                    x: torch.Tensor | None = None, name: str = "layer") -> nn.Module:
    """One nn.Linear -> its quantized replacement. ``x`` [T, K]: calibration inputs (GPTQ, AWQ)."""
    check_method(method)
    w = linear.weight.detach().float()
    dev = linear.weight.device
    if method == "int8":
        return Int8Linear.from_linear(linear).to(dev)
    if method in INT4_METHODS:
        check_group_size(w.shape[1], group_size, name)
        if method in CALIBRATION_METHODS and x is None:
            raise ValueError(f"{method} needs calibration inputs x for {name}")
        if method == "int4":
            return Int4Linear(*rtn_int4(w, group_size), group_size).to(dev)
        if method == "hqq":
            return Int4Linear(*hqq_quantize(w, group_size), group_size).to(dev)
        if method == "gptq":
            return Int4Linear(*gptq_quantize(w, x.t() @ x, group_size), group_size).to(dev)
        q, sc, mn, in_scale, _alpha = awq_quantize(w, x, group_size)
        return Int4Linear(q, sc, mn, group_size, in_scale).to(dev)
    fmt = method
    if fmt == "q4_k" and w.shape[1] % ggml_blocks.QK_K:
        fmt = "q4_1"  # llama.cpp's rule: k-quants need rows of whole 256-weight super-blocks
    raw = ggml_blocks.encode(w.cpu(), fmt)
    if fmt == "q8_0":
        return DequantizedLinear(ggml_blocks.decode(raw, fmt, tuple(w.shape)).to(
            device=dev, dtype=linear.weight.dtype), "q8_0")
    q, sc, mn = ggml_blocks.int4_groups(raw, fmt, tuple(w.shape))
    return Int4Linear(q, sc, mn, ggml_blocks.QK).to(dev)


@torch.no_grad()
def quantize_model(model: nn.Module, method: str, group_size: int = DEFAULT_GROUP_SIZE,
                   calib_ids: Sequence[int] | torch.Tensor | None = None, tokenizer=None,
                   quantize_head: bool = True, calib_seq_len: int = 128,
                   progress: Callable[[str], None] | None = None) -> nn.Module:
    """Quantize every block linear of ``model`` in place with ``method``; return the model.

    GPTQ and AWQ read ``calib_ids`` (default: :func:`calibration_ids` of ``tokenizer``, or
    seeded random ids when there is none), cut into rows of ``calib_seq_len`` tokens.
    """
    check_method(method)
    if method in INT4_METHODS:
        cfg = model.cfg
        for k in sorted({cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.ffn_dim}):
            check_group_size(k, group_size, f"a linear with in_features={k}")
    ids = None
    if method in CALIBRATION_METHODS:
        if calib_ids is None:
            if tokenizer is not None:
                calib_ids = calibration_ids(tokenizer)
            else:
                gen = torch.Generator().manual_seed(0)
                calib_ids = torch.randint(0, model.cfg.vocab_size, (256,), generator=gen)
        flat = torch.as_tensor(calib_ids, dtype=torch.long).flatten()
        rows = max(1, flat.numel() // calib_seq_len)
        ids = flat[: rows * calib_seq_len].reshape(rows, -1)
    for i, block in enumerate(model.layers):
        xs = layer_inputs(model, i, ids) if ids is not None else {}
        for name in LINEARS:
            new = quantize_linear(block.get_submodule(name), method, group_size, xs.get(name),
                                  name=f"layers.{i}.{name}")
            block.set_submodule(name, new)
        if progress:
            progress(f"{method}: layer {i + 1}/{len(model.layers)}")
    if quantize_head and isinstance(model.lm_head, nn.Linear):
        model.lm_head = Int8Linear.from_linear(model.lm_head).to(model.lm_head.weight.device)
    model.quantization = method
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights the decode step reads: every linear (blocks and head), packed
    (int4: as the CPU's integer kernel reads it, :meth:`~.linear.Int4Linear.kernel_bytes`)."""
    total = 0
    for m in model.modules():
        if isinstance(m, Int4Linear):
            total += m.kernel_bytes()
        elif isinstance(m, Int8Linear):
            total += sum(b.numel() * b.element_size() for n, b in m.named_buffers()
                         if n != "scale_op")
        elif isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    return total
