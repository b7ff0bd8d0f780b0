"""Integer matmuls for a decode step's few rows: int8 and int4 weights times int8 activations (CPU).

At batch 1 a linear layer reads each weight once and does one multiply-add with it, so its time
is the bytes it moves, plus whatever the kernel spends per weight on turning it back into a
number. PyTorch's weight-only ops widen every weight to float (for int4: unpack, convert, scale,
add) before a float FMA; llama.cpp instead quantizes the activation row too, in blocks of 32
(Q8_0: one float scale each), and multiplies integers: one ``vpdpbusd`` (AVX-512 VNNI or
AVX-VNNI) multiplies 32 byte pairs and adds them in fours into eight int32 sums. Here is the same
arithmetic for minillm's formats (:mod:`minillm.quant.formats`):

    x (one row, K)    -> blocks of 32: d_b = max|x_b| / 127, q_b = round(x_b / d_b) in [-127, 127]
    int8 weight row n: y = s_n * sum_b d_b * (q_b . w_nb)                 (s_n: per channel)
    int4 weight row n: y = sum_b d_b * (s_ng * (q_b . c_nb) + m_ng * sum(q_b))   (codes c 0..15,
                                                                           group g of block b)

The integer dot products are exact; the rounding of x to 8 bits per block is the only
approximation beyond the weights' own (relative error about 1/254 of a block's largest value).

The weights are laid out once (:func:`pack_int8`, :func:`pack_int4`) so that the integer
multiply-adds leave finished dot products in the lanes of a register, with no horizontal sums
and no shuffles. int8: a 512-bit register holds one piece of sixteen blocks of a row side by
side, 4 bytes of each block in its own 32-bit lane, and the activations are written in the same
layout as they are quantized; eight multiply-adds leave sixteen blocks' dot products in sixteen
lanes, one multiply by the blocks' scales finishes them. int4: a register holds 4 bytes of the
same block of sixteen weight rows, one row a lane, and meets 4 activation bytes broadcast to
every lane; each byte holds two codes (low nibble, high nibble), so a mask and a shift unpack
128 codes, eight multiply-adds leave the sixteen rows' dot products for the block, and the
lanes are the outputs: every register full whatever K is (K = 576 has 18 blocks, which the
int8 layout splits 16 + 2). Rows of the output (weight rows, or groups of 16) are shared by
OpenMP threads; a tile of up to four activation rows uses each unpacked weight vector four
times, and while an int4 group computes it prefetches the next group's codes into L2 (the
memory then streams without waiting for the arithmetic). With AVX2 only, 256-bit registers
do half a chunk (eight rows) at a time, and without AVX-VNNI ``vpmaddubsw`` + ``vpmaddwd``
compute the same dot products; on other CPUs plain loops do.
The C++ is ``cpu_quant_matmul.cpp`` beside this file, compiled by :mod:`.cpu_build` after its
shared ``SCALARS``; :func:`quantize_activations` and :func:`reference_matmul` are the
plain-torch statement of what the C++ computes
(``tests/kernel_tests/test_cpu_quant_matmul.py`` holds one to the other, in every
instruction-set path this machine can build).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .cpu_build import SCALARS, Library, profiled_call

BLOCK = 32          # activation values sharing one scale; a multiple of it divides K
CHUNK = 16          # int8: blocks whose dot products one 512-bit register holds side by side
ROWS = 16           # int4: weight rows whose dot products one 512-bit register holds
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}

SOURCE_FILE = Path(__file__).with_name("cpu_quant_matmul.cpp")   # the C++, after SCALARS
SOURCE = SCALARS + SOURCE_FILE.read_text()

_P, _I = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {"int8_matmul": [_P, _I, _P, _P, _P, _I, _I, _I, _I],
              "int4_matmul": [_P, _I, _P, _P, _P, _P, _I, _I, _I, _I],
              "int4h_matmul": [_P, _I, _P, _P, _P, _P, _I, _I, _I, _I]}   # float16 scales
LIBRARY = Library("quant_matmul", SOURCE, {f"{op}_{dt}": args for op, args in SIGNATURES.items()
                                           for dt in DTYPES.values()}, source_file=SOURCE_FILE)


def available() -> bool:
    """Can the kernels run here (a C++ compiler built them)?"""
    return LIBRARY.get() is not None


def unavailable_reason() -> str:
    """Why :func:`available` is False ('' when it is True)."""
    return LIBRARY.reason()


# ---------------------------------------------------------------- weight layout (built once)

def layout_index(k: int) -> torch.Tensor:
    """[K] int64: position p of a row in the kernels' layout holds the row's element
    ``layout_index(k)[p]`` (blocks of 32 in chunks of 16 blocks; in a chunk of c blocks,
    vector t = 0..7 lane l holds elements 4t..4t+3 of block l)."""
    nb, parts = k // BLOCK, []
    for b0 in range(0, nb, CHUNK):
        c = min(CHUNK, nb - b0)
        t, lane, j = torch.arange(8)[:, None, None], torch.arange(c)[None, :, None], \
            torch.arange(4)
        parts.append(((b0 + lane) * BLOCK + 4 * t + j).reshape(-1))
    return torch.cat(parts)


def _chunks(k: int) -> list[int]:
    """Blocks per chunk along a row of K."""
    nb = k // BLOCK
    return [min(CHUNK, nb - b0) for b0 in range(0, nb, CHUNK)]


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 weight [N, K] (K a multiple of 32) -> the kernel's operand: its rows in the
    layout (:func:`layout_index`)."""
    _check_k(q.shape[1])
    return q[:, layout_index(q.shape[1])].contiguous()


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, group_size: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """minillm's int4 weight (codes [N, K] in 0..15, N a multiple of :data:`ROWS`, scale and
    mn [N, K / group_size]) -> the kernel's operands, rows in groups of 16: packed [N, K / 2]
    uint8, whose bytes are, group after group, block b's four vectors u of 16 lanes (one a
    row) of 4 bytes, byte i of lane l holding row l's element 4u + i of the block in its low
    nibble and element 16 + 4u + i in its high one; scale and mn [N, K / 32], in the order
    [N / 16, K / 32, 16] (each group's value repeated per block): float16 where every scale
    and minimum is exactly a float16 number (as GGUF's Q4_1 and minillm's round-to-nearest
    int4 keep them), else float32."""
    n, k = codes.shape
    _check_k(k)
    if n % ROWS:
        raise ValueError(f"out_features must be a multiple of {ROWS} for the int4 kernel, "
                         f"got {n}")
    if group_size <= 0 or group_size % BLOCK or k % group_size \
            or tuple(scale.shape) != (n, k // group_size) or scale.shape != mn.shape:
        raise ValueError(f"group_size must be a multiple of {BLOCK} dividing in_features={k} "
                         f"and scale, mn [{n}, {k} / group_size]; got group_size={group_size}, "
                         f"scale {tuple(scale.shape)}, mn {tuple(mn.shape)}")
    nb = k // BLOCK
    c = codes.to(torch.uint8).reshape(n // ROWS, ROWS, nb, 2, 4, 4)  # [G, l, b, high, u, i]
    packed = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)   # [G, b, u, l, i]

    exact = all(torch.equal(t.float().half().float(), t.float()) for t in (scale, mn))

    def per_block(t: torch.Tensor) -> torch.Tensor:
        t = t.to(torch.float16 if exact else torch.float32).repeat_interleave(
            group_size // BLOCK, 1)                                        # [N, nb]
        return t.reshape(n // ROWS, ROWS, nb).transpose(1, 2).reshape(n, nb).contiguous()
    return packed.reshape(n, k // 2).contiguous(), per_block(scale), per_block(mn)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The codes of :func:`pack_int4`'s packed tensor: [N, K / 2] uint8 -> [N, K] uint8."""
    n, k = packed.shape[0], packed.shape[1] * 2
    p = packed.reshape(n // ROWS, k // BLOCK, 4, ROWS, 4).permute(0, 3, 1, 2, 4)  # [G,l,b,u,i]
    return torch.stack([p & 0x0F, p >> 4], 3).reshape(n, k)


# ---------------------------------------------------------------- the calls

class BoundWeight:
    """One weight's kernel operands, int8 (q, scale) or int4 (packed, scale, mn), with their
    pointers and C++ functions looked up once: ``w(x)`` = x [M, K] W^T -> [M, N] in x's dtype,
    for callers that run the same weight every step (the layers, the engine). Unchecked: x
    must be a CPU float32 or bfloat16 [M, K] tensor with contiguous rows; the operands as
    :func:`int8_matmul` or :func:`int4_matmul` take them (held here, so they live as long as
    this does)."""

    def __init__(self, *operands: torch.Tensor) -> None:
        self.operands, int4 = operands, len(operands) == 3
        self.name = "int4_matmul" if int4 else "int8_matmul"
        self.n, self.k = operands[0].shape[0], operands[0].shape[1] * (2 if int4 else 1)
        self.pointers = [t.data_ptr() for t in operands]
        if (lib := LIBRARY.get()) is None:
            raise RuntimeError(f"the CPU quantized matmul is unavailable: {unavailable_reason()}")
        half = int4 and operands[1].dtype == torch.float16
        self.functions = {dt: getattr(lib, f"{'int4h_matmul' if half else self.name}_{sfx}")
                          for dt, sfx in DTYPES.items()}

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] -> y [M, N], written into ``out`` when given (x's dtype, rows contiguous)."""
        out = torch.empty(x.shape[0], self.n, dtype=x.dtype) if out is None else out
        args = (x.data_ptr(), x.stride(0), *self.pointers, out.data_ptr(), out.stride(0),
                x.shape[0], self.n, self.k)
        profiled_call(self.functions[x.dtype], self.name, *args)
        return out


def _check_x(x: torch.Tensor, k: int) -> None:
    if not available():
        raise RuntimeError(f"the CPU quantized matmul is unavailable: {unavailable_reason()}")
    if x.device.type != "cpu" or x.dtype not in DTYPES or x.dim() != 2 or x.shape[1] != k \
            or (x.shape[0] > 0 and x.stride(1) != 1):
        raise ValueError(f"x must be a CPU [rows, {k}] float32 or bfloat16 tensor with "
                         f"contiguous rows, got {tuple(x.shape)} {x.dtype} on {x.device}")


def _check_weight(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if t.device.type != "cpu" or t.dtype != dtype or tuple(t.shape) != shape \
            or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor of shape {shape}, "
                         f"got {t.dtype} {tuple(t.shape)} on {t.device}")


def _check_k(k: int) -> None:
    if k % BLOCK or k == 0:
        raise ValueError(f"in_features must be a positive multiple of {BLOCK}, got {k}")


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16, rows contiguous), q int8 [N, K] in the layout
    (:func:`pack_int8`), scale float32 [N] -> y [M, N] in x's dtype, y = x_q W^T with x
    quantized in blocks of 32."""
    n, k = q.shape
    _check_k(k)
    _check_x(x, k)
    _check_weight("q", q, (n, k), torch.int8)
    _check_weight("scale", scale, (n,), torch.float32)
    return BoundWeight(q, scale)(x)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor
                ) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16, rows contiguous), packed uint8 [N, K / 2], scale and mn
    float32 or both float16 [N, K / 32] (:func:`pack_int4`) -> y [M, N] in x's dtype."""
    n, k = packed.shape[0], packed.shape[1] * 2
    _check_k(k)
    _check_x(x, k)
    _check_weight("packed", packed, (n, k // 2), torch.uint8)
    for name, t in (("scale", scale), ("mn", mn)):
        _check_weight(name, t, (n, k // BLOCK), scale.dtype if scale.dtype in (
            torch.float16, torch.float32) else torch.float32)
    if n % ROWS:
        raise ValueError(f"packed must have a multiple of {ROWS} rows, got {n}")
    return BoundWeight(packed, scale, mn)(x)


# ---------------------------------------------------------------- plain-torch statement

def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes [M, K / 32, 32] float32 integers in [-127, 127], d [M, K / 32]):
    the C++ kernels' rounding of their input, x ~ codes * d."""
    xb = x.float().reshape(x.shape[0], -1, BLOCK)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(xb * inv[..., None]).clamp(-127, 127), d


def reference_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the kernels compute, in float64: the quantized x times ``weight`` [N, K] (the
    dequantized int8 or int4 weight). x [M, K] -> [M, N] float64."""
    codes, d = quantize_activations(x)
    xq = (codes.double() * d.double()[..., None]).reshape(x.shape)
    return xq @ weight.double().t()
