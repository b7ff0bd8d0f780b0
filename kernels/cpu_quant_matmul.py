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
Rows of the output (weight rows) are shared by OpenMP threads; a tile of up to four activation
rows uses each unpacked weight block four times. Without AVX-VNNI, AVX2's ``vpmaddubsw`` +
``vpmaddwd`` compute the same dot products; on other CPUs plain loops do.

int4 weights are repacked once (:func:`pack_int4`): a block of 32 codes is 16 bytes, byte i
holding code i in its low nibble and code i + 16 in its high one (llama.cpp's Q4 order), so two
masks and a shift spread a block over one 256-bit register. Compiled by :mod:`.cpu_build`;
:func:`quantize_activations` and :func:`reference_matmul` are the plain-torch statement of what
the C++ computes (``tests/test_cpu_quant_matmul.py`` holds one to the other).
"""
from __future__ import annotations

import ctypes

import torch
from torch.profiler import record_function

from .cpu_build import SCALARS, Library

BLOCK = 32          # activation values sharing one scale; a multiple of it divides K
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}

SOURCE = SCALARS + r"""
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

static const int QK = 32;
static const int TILE = 4;                        // activation rows per pass over a weight row
static const int64_t PARALLEL_MACS = 1 << 16;     // below this one thread is faster

// x [m, k] (row stride ldx) -> qx [m, k] int8, d [m, k/32] (block scales), ds [m, k/32]
// (d * sum of the block's codes): q = round(x * (1 / d)) with d = max|x| / 127, as
// quantize_activations in Python computes it.
template <typename T>
static void quantize_rows(const T* x, int64_t ldx, int64_t m, int64_t k, int8_t* qx, float* d,
                          float* ds) {
    const int64_t nb = k / QK;
    for (int64_t r = 0; r < m; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            const T* xb = x + r * ldx + b * QK;
            float amax = 0.0f, v[QK];
            for (int i = 0; i < QK; ++i) { v[i] = widen(xb[i]); amax = std::fmax(amax, std::fabs(v[i])); }
            const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
            int sum = 0;
            int8_t* qb = qx + r * k + b * QK;
            for (int i = 0; i < QK; ++i) {
                float q = std::nearbyint(v[i] * id);
                q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
                qb[i] = (int8_t)q; sum += (int)q;
            }
            d[r * nb + b] = db; ds[r * nb + b] = db * (float)sum;
        }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define WIDE 1      // 512-bit registers: two blocks of 32 per instruction
#endif

#if defined(__AVX2__)
// eight int32 sums of four products each: u (unsigned bytes) . s (signed bytes)
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else   // pairs summed in int16 (at most 2 * 127 * 127 here: no saturation), then fours
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
// one block's 16 packed bytes -> its 32 codes in order
static inline __m256i codes32(const uint8_t* w) {
    const __m128i bytes = _mm_loadu_si128((const __m128i*)w), low = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low),
                            _mm_and_si128(bytes, low));
}
#endif

// int32 dot product of one block: codes (unsigned, 0..15, packed) or int8 weights . q
static inline int block_dot_int4(const uint8_t* w, const int8_t* q) {
#if defined(__AVX2__)
    const __m256i p = dot_u8s8(codes32(w), _mm256_loadu_si256((const __m256i*)q));
    return (int)hsum(_mm256_cvtepi32_ps(p));             // (|sum| < 2^24: exact in float)
#else
    int dot = 0;
    for (int i = 0; i < QK / 2; ++i) dot += (w[i] & 15) * q[i] + (w[i] >> 4) * q[i + QK / 2];
    return dot;
#endif
}
static inline int block_dot_int8(const int8_t* w, const int8_t* q) {
#if defined(__AVX2__)
    const __m256i wb = _mm256_loadu_si256((const __m256i*)w);
    const __m256i p = dot_u8s8(_mm256_sign_epi8(wb, wb),     // |w|, w's sign moved to q
                               _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)q), wb));
    return (int)hsum(_mm256_cvtepi32_ps(p));
#else
    int dot = 0;
    for (int i = 0; i < QK; ++i) dot += w[i] * q[i];
    return dot;
#endif
}

#if defined(WIDE)
// the 16-lane index that spreads lanes p and p + 1 of a vector over eight lanes each
static inline __m512i pair_index(int64_t p) {
    return _mm512_add_epi32(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                            _mm512_set1_epi32((int)p));
}
static inline __mmask16 first(int64_t n) { return (__mmask16)((1u << n) - 1u); }
#endif

// One weight row against R activation rows, out[r] = sum_b f_b(r) * dot_b(r) (+ the int4
// minimum term): INT4 selects packed codes with per-block scale sc and minimum mn [nb], else
// int8 weights (sc, mn unused: the channel scale is applied by the caller).
template <int R, bool INT4>
static inline void weight_row(const uint8_t* w, const float* sc, const float* mn,
                              const int8_t* qx, const float* d, const float* ds, int64_t k,
                              float* out) {
    const int64_t nb = k / QK, bytes = INT4 ? QK / 2 : QK;
    float tail[R] = {0};
    int64_t b0 = 0;
#if defined(WIDE)
    __m512 acc[R], macc[R];                                // dot and minimum terms
    for (int r = 0; r < R; ++r) acc[r] = macc[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
    for (; b0 + 2 <= nb; b0 += 16) {                       // chunks of 16 blocks, pairs inside
        const int64_t pairs = (nb - b0 < 16 ? nb - b0 : 16) / 2;
        const __mmask16 mask = first(2 * pairs);
        __m512 f[R];                                       // per-block factors of each row
        const __m512 s = INT4 ? _mm512_maskz_loadu_ps(mask, sc + b0) : _mm512_set1_ps(1.0f);
        for (int r = 0; r < R; ++r) {
            f[r] = _mm512_mul_ps(s, _mm512_maskz_loadu_ps(mask, d + r * nb + b0));
            if (INT4) macc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, mn + b0),
                                                _mm512_maskz_loadu_ps(mask, ds + r * nb + b0),
                                                macc[r]);
        }
        for (int64_t p = 0; p < 2 * pairs; p += 2) {
            const uint8_t* wp = w + (b0 + p) * bytes;
            __m512i u; __mmask64 neg = 0;
            if (INT4) {        // 128-bit lanes [block p low nibbles, high, block p+1 low, high]
                const __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)wp));
                const __m512i lanes = _mm512_shuffle_i64x2(both, both, 0x50);
                u = _mm512_and_si512(_mm512_mask_blend_epi64(0xCC, lanes,
                                                             _mm512_srli_epi16(lanes, 4)), low);
            } else {           // |w|, and w's sign moved onto q below
                const __m512i wv = _mm512_loadu_si512(wp);
                u = _mm512_abs_epi8(wv);
                neg = _mm512_movepi8_mask(wv);
            }
            const __m512i idx = pair_index(p);
            for (int r = 0; r < R; ++r) {
                __m512i a = _mm512_loadu_si512(qx + r * k + (b0 + p) * QK);
                if (!INT4) a = _mm512_mask_sub_epi8(a, neg, zero, a);
                const __m512i dot = _mm512_dpbusd_epi32(zero, u, a);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                         _mm512_permutexvar_ps(idx, f[r]), acc[r]);
            }
        }
        b0 += 2 * pairs - 16;                             // (the loop adds 16)
    }
    for (int r = 0; r < R; ++r) tail[r] += _mm512_reduce_add_ps(_mm512_add_ps(acc[r], macc[r]));
#endif
    for (int64_t b = b0; b < nb; ++b)                     // what is left: one block at a time
        for (int r = 0; r < R; ++r) {
            const int8_t* q = qx + r * k + b * QK;
            const int dot = INT4 ? block_dot_int4(w + b * bytes, q)
                                 : block_dot_int8((const int8_t*)(w + b * bytes), q);
            tail[r] += (INT4 ? sc[b] : 1.0f) * d[r * nb + b] * (float)dot;
            if (INT4) tail[r] += mn[b] * ds[r * nb + b];
        }
    for (int r = 0; r < R; ++r) out[r] = tail[r];
}

struct Quantized {                  // the activation rows, quantized once per call
    std::vector<int8_t> qx; std::vector<float> d, ds;
};

template <typename T>
static void prepare(Quantized& a, const T* x, int64_t ldx, int64_t m, int64_t k) {
    a.qx.resize(m * k); a.d.resize(m * (k / QK)); a.ds.resize(m * (k / QK));
    quantize_rows(x, ldx, m, k, a.qx.data(), a.d.data(), a.ds.data());
}

// y [m, n] (row stride ldy) = x [m, k] W^T, W [n, k]: int8 (w [n, k], scale [n]: W = scale * w)
// or int4 (w [n, k / 2] packed codes, scale and mn [n, k / 32]: W = code * scale + mn)
template <typename T, bool INT4>
static void quant_matmul(const T* x, int64_t ldx, const void* w, const float* scale,
                         const float* mn, T* y, int64_t ldy, int64_t m, int64_t n, int64_t k) {
    static thread_local Quantized a;
    prepare(a, x, ldx, m, k);
    const int64_t nb = k / QK, row_bytes = INT4 ? k / 2 : k;
    const int8_t* qx = a.qx.data();           // (a is this thread's: OpenMP's see theirs)
    const float *dx = a.d.data(), *dsx = a.ds.data();
    #pragma omp parallel for schedule(static) if (m * n * k >= PARALLEL_MACS)
    for (int64_t j = 0; j < n; ++j) {
        const uint8_t* wj = (const uint8_t*)w + j * row_bytes;
        const float *sj = INT4 ? scale + j * nb : nullptr, *mj = INT4 ? mn + j * nb : nullptr;
        float out[TILE];
        for (int64_t r0 = 0; r0 < m; r0 += TILE) {
            const int8_t* q = qx + r0 * k;
            const float *d = dx + r0 * nb, *ds = dsx + r0 * nb;
            const int64_t rows = m - r0 < TILE ? m - r0 : TILE;
            switch (rows) {
                case 4: weight_row<4, INT4>(wj, sj, mj, q, d, ds, k, out); break;
                case 3: weight_row<3, INT4>(wj, sj, mj, q, d, ds, k, out); break;
                case 2: weight_row<2, INT4>(wj, sj, mj, q, d, ds, k, out); break;
                default: weight_row<1, INT4>(wj, sj, mj, q, d, ds, k, out);
            }
            for (int64_t r = 0; r < rows; ++r)
                narrow(INT4 ? out[r] : out[r] * scale[j], y + (r0 + r) * ldy + j);
        }
    }
}

#define ENTRIES(NAME, T)                                                                      \
extern "C" void int8_matmul_##NAME(const void* x, int64_t ldx, const void* w,                \
                                   const float* scale, void* y, int64_t ldy, int64_t m,      \
                                   int64_t n, int64_t k) {                                   \
    quant_matmul<T, false>((const T*)x, ldx, w, scale, nullptr, (T*)y, ldy, m, n, k);        \
}                                                                                             \
extern "C" void int4_matmul_##NAME(const void* x, int64_t ldx, const void* w,                \
                                   const float* scale, const float* mn, void* y,             \
                                   int64_t ldy, int64_t m, int64_t n, int64_t k) {           \
    quant_matmul<T, true>((const T*)x, ldx, w, scale, mn, (T*)y, ldy, m, n, k);              \
}
ENTRIES(f32, float)
ENTRIES(bf16, uint16_t)
"""

_P, _I = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {"int8_matmul": [_P, _I, _P, _P, _P, _I, _I, _I, _I],
              "int4_matmul": [_P, _I, _P, _P, _P, _P, _I, _I, _I, _I]}
LIBRARY = Library("quant_matmul", SOURCE, {f"{op}_{dt}": args for op, args in SIGNATURES.items()
                                           for dt in DTYPES.values()})


def available() -> bool:
    """Can the kernels run here (a C++ compiler built them)?"""
    return LIBRARY.get() is not None


def unavailable_reason() -> str:
    """Why :func:`available` is False ('' when it is True)."""
    return LIBRARY.reason()


def _call(name: str, dtype: torch.dtype, *args) -> None:
    """Call the C++ function ``name`` for ``dtype`` (a row ``minillm::<name>`` of
    torch.profiler's table while it records)."""
    fn = getattr(LIBRARY.get(), f"{name}_{DTYPES[dtype]}")
    if torch.autograd.profiler._is_profiler_enabled:
        with record_function(f"minillm::{name}"):
            fn(*args)
    else:
        fn(*args)


# ---------------------------------------------------------------- weight layout (built once)

def pack_int4(codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, group_size: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """minillm's int4 weight (codes [N, K] in 0..15, scale and mn [N, K / group_size]) -> the
    kernel's operands: packed [N, K / 2] uint8 (per block of 32, byte i = code i | code
    (i + 16) << 4) and scale, mn float32 [N, K / 32] (each group's repeated per block)."""
    n, k = codes.shape
    _check_k(k)
    if group_size <= 0 or group_size % BLOCK or k % group_size \
            or tuple(scale.shape) != (n, k // group_size) or scale.shape != mn.shape:
        raise ValueError(f"group_size must be a multiple of {BLOCK} dividing in_features={k} "
                         f"and scale, mn [{n}, {k} / group_size]; got group_size={group_size}, "
                         f"scale {tuple(scale.shape)}, mn {tuple(mn.shape)}")
    c = codes.to(torch.uint8).reshape(n, k // BLOCK, 2, BLOCK // 2)
    packed = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    per_block = group_size // BLOCK
    return (packed, scale.float().repeat_interleave(per_block, 1).contiguous(),
            mn.float().repeat_interleave(per_block, 1).contiguous())


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The codes of :func:`pack_int4`'s packed tensor: [N, K / 2] uint8 -> [N, K] uint8."""
    n, half = packed.shape
    p = packed.reshape(n, half * 2 // BLOCK, 1, BLOCK // 2)
    return torch.cat([p & 0x0F, p >> 4], dim=2).reshape(n, half * 2)


# ---------------------------------------------------------------- the calls

def int8_matmul_into(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                     out: torch.Tensor) -> torch.Tensor:
    """out [M, N] = x [M, K] (W)^T, W = scale[:, None] * q; unchecked (see :func:`int8_matmul`)."""
    _call("int8_matmul", x.dtype, x.data_ptr(), x.stride(0), q.data_ptr(), scale.data_ptr(),
          out.data_ptr(), out.stride(0), x.shape[0], q.shape[0], x.shape[1])
    return out


def int4_matmul_into(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                     mn: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [M, N] = x [M, K] W^T, W = code * scale + mn per block of 32 (the operands of
    :func:`pack_int4`); unchecked (see :func:`int4_matmul`)."""
    _call("int4_matmul", x.dtype, x.data_ptr(), x.stride(0), packed.data_ptr(),
          scale.data_ptr(), mn.data_ptr(), out.data_ptr(), out.stride(0),
          x.shape[0], packed.shape[0], x.shape[1])
    return out


class BoundWeight:
    """One weight's kernel operands, int8 (q, scale) or int4 (packed, scale, mn), with their
    pointers taken once: ``w(x)`` = x [M, K] W^T -> [M, N] in x's dtype, for callers that
    run the same weight every step (the engine). Unchecked: x must be a CPU float32 or
    bfloat16 [M, K] tensor with contiguous rows; the operands as :func:`int8_matmul` or
    :func:`int4_matmul` take them (held here, so they outlive the caller's references)."""

    def __init__(self, *operands: torch.Tensor) -> None:
        self.operands, self.int4 = operands, len(operands) == 3
        self.name = "int4_matmul" if self.int4 else "int8_matmul"
        self.n, self.k = operands[0].shape[0], operands[0].shape[1] * (2 if self.int4 else 1)
        self.pointers = [t.data_ptr() for t in operands]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.n, dtype=x.dtype)
        _call(self.name, x.dtype, x.data_ptr(), x.stride(0), *self.pointers, out.data_ptr(),
              out.stride(0), x.shape[0], self.n, self.k)
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
    """x [M, K] (float32 or bfloat16, rows contiguous), q int8 [N, K], scale float32 [N]
    -> y [M, N] in x's dtype, y = x_q W^T with x quantized in blocks of 32."""
    n, k = q.shape
    _check_k(k)
    _check_x(x, k)
    _check_weight("q", q, (n, k), torch.int8)
    _check_weight("scale", scale, (n,), torch.float32)
    return int8_matmul_into(x, q, scale, torch.empty(x.shape[0], n, dtype=x.dtype))


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor
                ) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16, rows contiguous), packed uint8 [N, K / 2], scale and mn
    float32 [N, K / 32] (:func:`pack_int4`) -> y [M, N] in x's dtype."""
    n, k = packed.shape[0], packed.shape[1] * 2
    _check_k(k)
    _check_x(x, k)
    _check_weight("packed", packed, (n, k // 2), torch.uint8)
    for name, t in (("scale", scale), ("mn", mn)):
        _check_weight(name, t, (n, k // BLOCK), torch.float32)
    return int4_matmul_into(x, packed, scale, mn, torch.empty(x.shape[0], n, dtype=x.dtype))


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
