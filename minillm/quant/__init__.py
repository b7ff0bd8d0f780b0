"""Weight quantization (appendix A1): int8, int4, GPTQ, AWQ, HQQ and GGUF block formats.

``quantize_model(model, method)`` swaps a Transformer's linears for packed quantized ones
(:data:`METHODS` lists the names; ``minillm.load_model(..., quantization=...)`` calls it:
importing this package registers it with the loader).
Formats live in :mod:`.formats` (int8 / int4) and :mod:`.ggml_blocks` (Q8_0, Q4_1, Q4_K),
the methods that choose int4 codes in :mod:`.methods` (GPTQ, AWQ, HQQ), the fast layers in
:mod:`.linear`. The benchmark is :mod:`minillm.bench.quant`, the figures :mod:`minillm.viz.a1`.
"""
from ..checkpoint.loader import register_quantizer
from .formats import (
    INT4_GROUP_SIZES,
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from .linear import DequantizedLinear, Int4Linear, Int8Linear
from .methods import awq_quantize, gptq_quantize, hqq_quantize
from .quantize import (
    DEFAULT_GROUP_SIZE,
    METHODS,
    calibration_ids,
    quantize_linear,
    quantize_model,
    weight_bytes,
)

__all__ = [
    "DEFAULT_GROUP_SIZE", "INT4_GROUP_SIZES", "METHODS", "DequantizedLinear", "Int4Linear",
    "Int8Linear", "awq_quantize", "calibration_ids", "dequantize_int4", "dequantize_int8",
    "gptq_quantize", "hqq_quantize", "pack_int4", "quantize_int4", "quantize_int8",
    "quantize_linear", "quantize_model", "unpack_int4", "weight_bytes",
]

register_quantizer(METHODS, quantize_model)
