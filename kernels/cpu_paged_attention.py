"""Attention over the paged KV cache on the CPU, reading the blocks where they lie (C++/OpenMP).

The engine's portable path (``minillm.attention.paged``, backend ``sdpa``) gathers every
sequence's blocks into a padded contiguous batch and calls SDPA with a mask: on the CPU, at 64
decoding sequences, the gather copies the whole cache once per layer and SDPA then reads the
copy again, which costs more than the attention itself. This kernel is the CPU twin of the
Triton paged kernels of chapter 05: it walks each sequence's block table and streams the keys
and values straight from ``k_cache, v_cache [num_blocks, block_size, Hkv, D]``, with the
online-softmax update per block, so each K/V byte is read once per step and nothing is copied.

Work item: one sequence, whose new tokens times its ``Hq`` query heads are its query rows (the
``Hq // Hkv`` heads of a KV head read the same keys, from L1). OpenMP threads share the items;
they are PyTorch's own OpenMP threads (this library links the same ``libgomp`` that torch has
loaded), so there is no second pool fighting torch's for the cores. While a block is worked on,
the next one is prefetched a slice of cache lines per query row: issued as one burst, the 192
prefetches of a bfloat16 block stalled the loads behind them (the A/B is in the git log).
The arithmetic is fp32 with an exp of its own (error ~1e-7 relative, float32's rounding). On
CPUs with AVX512-BF16 the bfloat16 kernel takes q . k from the cached bf16 values with
``vdpbf16ps`` (bf16 products are exact in fp32, the sums fp32) and sums 16 keys' partial dot
products with one transposing reduction; elsewhere bf16 is widened on load. Semantics are those
of ``paged_prefill_attention``: sequence i's new query r, with L = seq_lens[i] cached tokens of
which n are new, sees keys j <= L - n + r.

The C++ is compiled on first use by :mod:`.cpu_build` (``-O3 -march=native``, about a
second) into a cache folder keyed by the source, the flags and the CPU, and loaded with
ctypes (a direct call: a ``torch.library`` custom op would add about 0.3 ms of dispatch per
layer, 5% of a batch-64 step; the engine's step runs eagerly, so nothing needs to trace it).
:func:`available` says whether the build worked; the engine uses this kernel on the CPU only
when it did, else the SDPA path.
"""
from __future__ import annotations

import ctypes

import torch

from .cpu_build import SCALARS, Library, profiled_call

DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
MAX_HEAD_DIM = 256

SOURCE = SCALARS + r"""
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

// 8 floats as one value: AVX2 / AVX-512 registers (two SSE ones on older CPUs)
typedef float f8 __attribute__((vector_size(32)));
static inline f8 load8(const float* p) { f8 v; std::memcpy(&v, p, 32); return v; }
static inline void store8(float* p, f8 v) { std::memcpy(p, &v, 32); }

// q . k over D floats (D a multiple of 8 known when compiled; D == 0: d, any)
template <int64_t D>
static inline float dot(const float* __restrict q, const float* __restrict k, int64_t d) {
    if constexpr (D > 0) {
        f8 s = load8(q) * load8(k);
        for (int64_t e = 8; e < D; e += 8) s += load8(q + e) * load8(k + e);
        return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
    }
    float s = 0.0f;
    for (int64_t e = 0; e < d; ++e) s += q[e] * k[e];
    return s;
}

// out[j] = q . k[j * stride : + D] for 8 keys at once: eight running sums, then one
// transposing horizontal add (AVX2), instead of a horizontal add per key.
template <int64_t D>
static inline void dot8(const float* __restrict q, const float* __restrict k, int64_t stride,
                        float* __restrict out) {
#if defined(__AVX2__) && defined(__FMA__)
    if constexpr (D > 0) {
        __m256 s[8];
        const __m256 q0 = _mm256_loadu_ps(q);
        for (int j = 0; j < 8; ++j) s[j] = _mm256_mul_ps(q0, _mm256_loadu_ps(k + j * stride));
        for (int64_t e = 8; e < D; e += 8) {
            const __m256 qe = _mm256_loadu_ps(q + e);
            for (int j = 0; j < 8; ++j)
                s[j] = _mm256_fmadd_ps(qe, _mm256_loadu_ps(k + j * stride + e), s[j]);
        }
        const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
        const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
        _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20),
                                            _mm256_permute2f128_ps(a, b, 0x31)));
        return;
    }
#endif
    for (int j = 0; j < 8; ++j) out[j] = dot<D>(q, k + j * stride, D);
}

// The keys or values of one block as floats: bfloat16 widened into buf, float32 read in place.
static inline const float* as_float(const float* src, float*, int64_t) { return src; }
static inline const float* as_float(const uint16_t* src, float* buf, int64_t n) {
    for (int64_t i = 0; i < n; ++i) buf[i] = widen(src[i]);
    return buf;
}

// acc = alpha * acc + sum_o w[o] * v[o * stride : + d], with acc kept in registers (D > 0)
template <int64_t D>
static inline void accumulate(float* __restrict acc, float alpha, const float* __restrict w,
                              const float* __restrict v, int64_t stride, int64_t n, int64_t d) {
    if constexpr (D > 0) {
        f8 a[D / 8];
        for (int64_t e = 0; e < D / 8; ++e) a[e] = load8(acc + 8 * e) * alpha;
        for (int64_t o = 0; o < n; ++o)
            for (int64_t e = 0; e < D / 8; ++e) a[e] += w[o] * load8(v + o * stride + 8 * e);
        for (int64_t e = 0; e < D / 8; ++e) store8(acc + 8 * e, a[e]);
        return;
    }
    for (int64_t e = 0; e < d; ++e) acc[e] *= alpha;
    for (int64_t o = 0; o < n; ++o)
        for (int64_t e = 0; e < d; ++e) acc[e] += w[o] * v[o * stride + e];
}

// A work item: ``count`` new tokens of sequence ``s``, flat rows [q0, q0 + count) of q, whose
// first sees the ``ctx`` keys before it (and each later one a key more). A sequence's new
// tokens are cut into items of at most CHUNK, so that one long prompt still keeps every thread
// busy (each item walks the blocks its last token sees; they are in L2 by then).
constexpr int64_t CHUNK = 32;
struct Item { int64_t s, q0, count, ctx; };
static std::vector<Item> work_items(const int32_t* cu_q, const int32_t* seq_lens,
                                    const int32_t* seqs, int64_t n_seqs) {
    std::vector<Item> items;
    for (int64_t i = 0; i < n_seqs; ++i) {
        const int64_t s = seqs[i], nq = cu_q[s + 1] - cu_q[s], cached = seq_lens[s] - nq;
        for (int64_t t = 0; t < nq; t += CHUNK)
            items.push_back({s, cu_q[s] + t, nq - t < CHUNK ? nq - t : CHUNK, cached + t});
    }
    return items;
}

// The next block's keys and values are fetched while this one is worked on, a slice of its
// cache lines per query row: a whole block's prefetches in one burst (192 lines) stall the
// loads behind them, and the kernel ran at half the speed. ``next`` < 0: nothing to fetch.
struct NextBlock {
    const char *k = nullptr, *v = nullptr;
    int64_t lines = 0, per_row = 0;
    template <typename T>
    NextBlock(const T* kc, const T* vc, int64_t next, int64_t block_elems, int64_t rows) {
        if (next < 0) return;
        k = (const char*)(kc + next * block_elems);
        v = (const char*)(vc + next * block_elems);
        lines = block_elems * (int64_t)sizeof(T) / 64;
        per_row = (lines + rows - 1) / rows;
    }
    void fetch_slice(int64_t r) const {
        const int64_t last = (r + 1) * per_row < lines ? (r + 1) * per_row : lines;
        for (int64_t c = r * per_row; c < last; ++c) {
            __builtin_prefetch(k + 64 * c, 0, 2); __builtin_prefetch(v + 64 * c, 0, 2);
        }
    }
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define HAVE_AVX512_BF16 1
// Lane j of the result: the sum of v[j]'s 16 lanes. A transposing reduction (unpack, unpack,
// two rounds of 128-bit shuffles: 45 instructions) instead of sixteen horizontal sums.
static inline __m512 sum16(const __m512* v) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; ++i)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                    _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                                    _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xdd));
}

static inline __m512 widen16(const uint16_t* p) {  // 16 bfloat16 -> 16 float32
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// exp_neg on 16 lanes (the same steps as the scalar one above)
static inline __m512 exp_neg16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    const __m512 t = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), magic);
    const __m512 n = _mm512_sub_ps(t, magic);
    const __m512i ni = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(0x4B400000));
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                     _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    for (const float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f,
                          1.0f})
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(ni, 23)));
}

// The bfloat16 path on CPUs with AVX512-BF16: q . k straight from the cache's bfloat16 with
// vdpbf16ps (exact products, float32 sums; 16 keys at a time, reduced by sum16), the block's
// values widened once and accumulated in float32 registers. Same loop and semantics as attend.
template <int64_t D>
static void attend_bf16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                        const int32_t* tables, int64_t width, const int32_t* seq_lens,
                        const int32_t* cu_q, const int32_t* seqs, int64_t n_seqs, uint16_t* out,
                        int64_t hq, int64_t hkv, int64_t bs, float scale) {
    static_assert(D % 32 == 0, "a head is whole 32-lane bfloat16 registers");
    const int64_t g = hq / hkv, row = hkv * D;
    const std::vector<Item> items = work_items(cu_q, seq_lens, seqs, n_seqs);
    #pragma omp parallel for schedule(dynamic, 1)
    for (size_t item = 0; item < items.size(); ++item) {
        const auto [s, q0, nq, ctx] = items[item];
        const int64_t len = ctx + nq, rows = nq * hq;
        std::vector<float> acc(rows * D, 0.0f), m(rows, -INFINITY), l(rows, 0.0f),
            vbuf(bs * row);
        // Many rows per KV head (a prompt chunk): the block's keys are also laid out as
        // kt[kv head][16-key group][pair c][key], so that 16 lanes of vdpbf16ps with q's pair c
        // broadcast are 16 keys' partial dot products: no reduction per row. Decodes (a few
        // rows) do not repay the transpose.
        const int64_t groups = (bs + 15) / 16;
        const bool transposed = nq * g >= 16;
        std::vector<uint32_t> kt(transposed ? hkv * groups * (D / 2) * 16 : 0);
        for (int64_t p0 = 0; p0 < len; p0 += bs) {
            const int64_t n = len - p0 < bs ? len - p0 : bs;
            const uint16_t* kb = kc + tables[s * width + p0 / bs] * bs * row;
            const uint16_t* vb = vc + tables[s * width + p0 / bs] * bs * row;
            const NextBlock next(kc, vc, p0 + bs < len ? tables[s * width + p0 / bs + 1] : -1,
                                 bs * row, rows);
            for (int64_t i = 0; i < n * row; i += 16) _mm512_storeu_ps(&vbuf[i], widen16(vb + i));
            if (transposed)
                for (int64_t h = 0; h < hkv; ++h)
                    for (int64_t o = 0; o < groups * 16; ++o) {
                        uint32_t* dst = &kt[(h * groups + o / 16) * (D / 2) * 16 + o % 16];
                        const uint32_t* src = (const uint32_t*)(kb + o * row + h * D);
                        for (int64_t c = 0; c < D / 2; ++c) dst[16 * c] = o < n ? src[c] : 0u;
                    }
            for (int64_t r = 0; r < rows; ++r) {
                const int64_t seen = ctx + r / hq + 1 - p0;
                const int64_t cnt = seen < n ? seen : n, kvh = (r % hq) / g;
                next.fetch_slice(r);
                if (cnt <= 0) continue;
                __m512bh qv[D / 32];
                for (int64_t c = 0; c < D / 32; ++c)
                    qv[c] = (__m512bh)_mm512_loadu_si512(q + (q0 * hq + r) * D + 32 * c);
                __m512 a[D / 16];
                for (int64_t e = 0; e < D / 16; ++e) a[e] = _mm512_loadu_ps(&acc[r * D + 16 * e]);
                for (int64_t o0 = 0; o0 < cnt; o0 += 16) {    // 16 keys: one online-softmax step
                    const int64_t nk = cnt - o0 < 16 ? cnt - o0 : 16;
                    const __mmask16 valid = (__mmask16)((1u << nk) - 1u);
                    __m512 raw = _mm512_setzero_ps();
                    if (transposed) {
                        const uint32_t* kg = &kt[(kvh * groups + o0 / 16) * (D / 2) * 16];
                        const uint32_t* qp = (const uint32_t*)(q + (q0 * hq + r) * D);
                        __m512 a0 = raw, a1 = raw;       // two chains of dependent adds
                        for (int64_t c = 0; c < D / 2; c += 2) {
                            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(kg + 16 * c),
                                                  (__m512bh)_mm512_set1_epi32((int)qp[c]));
                            a1 = _mm512_dpbf16_ps(a1,
                                                  (__m512bh)_mm512_loadu_si512(kg + 16 * c + 16),
                                                  (__m512bh)_mm512_set1_epi32((int)qp[c + 1]));
                        }
                        raw = _mm512_add_ps(a0, a1);
                    } else {
                        __m512 dots[16];
                        for (int64_t j = 0; j < 16; ++j) {
                            dots[j] = _mm512_setzero_ps();
                            if (j >= nk) continue;
                            const uint16_t* kr = kb + (o0 + j) * row + kvh * D;
                            for (int64_t c = 0; c < D / 32; ++c)
                                dots[j] = _mm512_dpbf16_ps(
                                    dots[j], qv[c], (__m512bh)_mm512_loadu_si512(kr + 32 * c));
                        }
                        raw = sum16(dots);
                    }
                    const __m512 sc = _mm512_mask_blend_ps(
                        valid, _mm512_set1_ps(-INFINITY),
                        _mm512_mul_ps(raw, _mm512_set1_ps(scale)));
                    const float top = _mm512_reduce_max_ps(sc), best = top > m[r] ? top : m[r];
                    const float alpha = exp_neg16(_mm512_set1_ps(m[r] - best))[0];
                    const __m512 w = _mm512_maskz_mov_ps(
                        valid, exp_neg16(_mm512_sub_ps(sc, _mm512_set1_ps(best))));
                    l[r] = l[r] * alpha + _mm512_reduce_add_ps(w);
                    m[r] = best;
                    alignas(64) float wt[16];
                    _mm512_store_ps(wt, w);
                    const __m512 al = _mm512_set1_ps(alpha);
                    for (int64_t e = 0; e < D / 16; ++e) a[e] = _mm512_mul_ps(a[e], al);
                    const float* vr = &vbuf[(o0 * hkv + kvh) * D];
                    for (int64_t o = 0; o < nk; ++o) {
                        const __m512 wo = _mm512_set1_ps(wt[o]);
                        for (int64_t e = 0; e < D / 16; ++e)
                            a[e] = _mm512_fmadd_ps(wo, _mm512_loadu_ps(vr + o * row + 16 * e),
                                                   a[e]);
                    }
                }
                for (int64_t e = 0; e < D / 16; ++e) _mm512_storeu_ps(&acc[r * D + 16 * e], a[e]);
            }
        }
        for (int64_t r = 0; r < rows; ++r) {
            const float inv = 1.0f / l[r];
            uint16_t* dst = &out[(q0 * hq + r) * D];
            for (int64_t e = 0; e < D; ++e) narrow(acc[r * D + e] * inv, &dst[e]);
        }
    }
}
#endif

template <typename T, int64_t D>                 // D > 0: the head dim, known when compiled
static void attend(const T* q, const T* kc, const T* vc, const int32_t* tables, int64_t width,
                   const int32_t* seq_lens, const int32_t* cu_q, const int32_t* seqs,
                   int64_t n_seqs, T* out, int64_t hq, int64_t hkv, int64_t dim, int64_t bs,
                   float scale) {
    const int64_t d = D > 0 ? D : dim, g = hq / hkv, row = hkv * d;   // row: one cached token
    const std::vector<Item> items = work_items(cu_q, seq_lens, seqs, n_seqs);
    #pragma omp parallel for schedule(dynamic, 1)
    for (size_t item = 0; item < items.size(); ++item) {
        const auto [s, q0, nq, ctx] = items[item];
        const int64_t len = ctx + nq, rows = nq * hq;
        std::vector<float> qf(rows * d), acc(rows * d, 0.0f), m(rows, -INFINITY),
            l(rows, 0.0f), kbuf(bs * row), vbuf(bs * row), p(bs + 8);
        for (int64_t i = 0; i < rows * d; ++i) qf[i] = widen(q[q0 * hq * d + i]) * scale;
        for (int64_t p0 = 0; p0 < len; p0 += bs) {
            const int64_t n = len - p0 < bs ? len - p0 : bs;
            const T* kb = kc + tables[s * width + p0 / bs] * bs * row;
            const T* vb = vc + tables[s * width + p0 / bs] * bs * row;
            const NextBlock next(kc, vc, p0 + bs < len ? tables[s * width + p0 / bs + 1] : -1,
                                 bs * row, rows);
            const float* kf = as_float(kb, kbuf.data(), n * row);
            const float* vf = as_float(vb, vbuf.data(), n * row);
            for (int64_t r = 0; r < rows; ++r) {             // r = new token t, query head
                const int64_t seen = ctx + r / hq + 1 - p0;      // keys of this block it sees
                const int64_t cnt = seen < n ? seen : n, kvh = (r % hq) / g;
                next.fetch_slice(r);
                if (cnt <= 0) continue;
                const float* qr = &qf[r * d];
                float best = m[r];
                int64_t o = 0;
                if (D > 0)
                    for (; o + 8 <= cnt; o += 8) dot8<D>(qr, &kf[o * row + kvh * d], row, &p[o]);
                for (; o < cnt; ++o) p[o] = dot<D>(qr, &kf[o * row + kvh * d], d);
                for (o = 0; o < cnt; ++o) best = p[o] > best ? p[o] : best;
                const float alpha = exp_neg(m[r] - best);
                float sum = 0.0f;
                #pragma omp simd reduction(+:sum)
                for (int64_t o = 0; o < cnt; ++o) { p[o] = exp_neg(p[o] - best); sum += p[o]; }
                accumulate<D>(&acc[r * d], alpha, p.data(), vf + kvh * d, row, cnt, d);
                l[r] = l[r] * alpha + sum;
                m[r] = best;
            }
        }
        for (int64_t r = 0; r < rows; ++r) {
            const float inv = 1.0f / l[r];
            T* dst = &out[(q0 * hq + r) * d];
            for (int64_t e = 0; e < d; ++e) narrow(acc[r * d + e] * inv, &dst[e]);
        }
    }
}

#define ENTRY(NAME, T)                                                                      \
extern "C" void NAME(const void* q, const void* kc, const void* vc, const int32_t* tables,  \
                     int64_t width, const int32_t* seq_lens, const int32_t* cu_q,            \
                     const int32_t* seqs, int64_t n_seqs, void* out, int64_t hq, int64_t hkv, \
                     int64_t d, int64_t bs, float scale) {                                  \
    auto run = d == 64 ? attend<T, 64> : d == 128 ? attend<T, 128> : attend<T, 0>;         \
    run((const T*)q, (const T*)kc, (const T*)vc, tables, width, seq_lens, cu_q, seqs,       \
        n_seqs, (T*)out, hq, hkv, d, bs, scale);                                            \
}
ENTRY(paged_attention_f32, float)
#ifdef HAVE_AVX512_BF16
extern "C" void paged_attention_bf16(const void* q, const void* kc, const void* vc,
                                     const int32_t* tables, int64_t width, const int32_t* seq_lens,
                                     const int32_t* cu_q, const int32_t* seqs, int64_t n_seqs,
                                     void* out, int64_t hq, int64_t hkv, int64_t d, int64_t bs,
                                     float scale) {
    auto fast = d == 64 ? attend_bf16<64> : d == 128 ? attend_bf16<128> : nullptr;
    if (fast != nullptr)
        return fast((const uint16_t*)q, (const uint16_t*)kc, (const uint16_t*)vc, tables, width,
                    seq_lens, cu_q, seqs, n_seqs, (uint16_t*)out, hq, hkv, bs, scale);
    auto run = attend<uint16_t, 0>;
    run((const uint16_t*)q, (const uint16_t*)kc, (const uint16_t*)vc, tables, width, seq_lens,
        cu_q, seqs, n_seqs, (uint16_t*)out, hq, hkv, d, bs, scale);
}
#else
ENTRY(paged_attention_bf16, uint16_t)
#endif
"""

_ARGS = [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + \
    [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_float]
LIBRARY = Library("paged_attention", SOURCE,
                  {f"paged_attention_{dt}": _ARGS for dt in DTYPES.values()})


def available() -> bool:
    """Can the kernel run here (a C++ compiler built it)?"""
    return LIBRARY.get() is not None


def unavailable_reason() -> str:
    """Why :func:`available` is False ('' when it is True)."""
    return LIBRARY.reason()


def attend_in_place(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seqs: torch.Tensor, out: torch.Tensor,
                    scale: float | None = None) -> None:
    """The C++ call itself, unchecked (for the engine, which built every index it passes; use
    :func:`cpu_paged_attention` otherwise): writes sequences ``seqs``' rows of ``out``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    fn = getattr(LIBRARY.get(), f"paged_attention_{DTYPES[q.dtype]}")
    hq, d = q.shape[1:]
    args = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.shape[1], seq_lens.data_ptr(), cu_seqlens_q.data_ptr(),
            seqs.data_ptr(), seqs.shape[0], out.data_ptr(), hq, k_cache.shape[2], d,
            k_cache.shape[1], scale)
    profiled_call(fn, "cpu_paged_attention", *args)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
           seqs: torch.Tensor, out: torch.Tensor) -> None:
    """Raise ValueError naming the argument unless the call is one the kernel can do."""
    for name, t in [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)]:
        if t.device.type != "cpu" or t.dtype not in DTYPES or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CPU tensor of dtype float32 or "
                             f"bfloat16, got {t.dtype} on {t.device}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    for name, t in [("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("cu_seqlens_q", cu_seqlens_q), ("seqs", seqs)]:
        if t.device.type != "cpu" or t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32 CPU tensor, got {t.dtype}")
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q must be [N, Hq, D] and k_cache, v_cache [blocks, block_size, Hkv, D]"
                         f", got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    hq, d = q.shape[1:]
    if k_cache.shape[3] != d or d > MAX_HEAD_DIM or hq % k_cache.shape[2]:
        raise ValueError(f"head_dim must match (q {d}, cache {k_cache.shape[3]}, at most "
                         f"{MAX_HEAD_DIM}) and Hkv ({k_cache.shape[2]}) must divide Hq ({hq})")
    if out.shape != q.shape:
        raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")


def cpu_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, seqs: torch.Tensor | None = None,
                        out: torch.Tensor | None = None, scale: float | None = None,
                        check_values: bool = True) -> torch.Tensor:
    """Causal attention of packed new queries q [N, Hq, D] over the paged cache (the contract
    of ``paged_prefill_attention``: block_tables int32 [S, W], seq_lens int32 [S] cached tokens
    including the new ones, cu_seqlens_q int32 [S + 1]). ``seqs`` int32 [M]: the sequences to
    attend (default all); only their rows of ``out`` [N, Hq, D] are written (``out`` default: a
    new tensor, the other rows uninitialised). ``check_values`` also checks the tables' and
    lengths' values against the cache (a host pass; the engine, which built them, skips it)."""
    if not available():
        raise RuntimeError(f"the CPU paged-attention kernel is unavailable: "
                           f"{unavailable_reason()}")
    seqs = torch.arange(seq_lens.shape[0], dtype=torch.int32) if seqs is None else seqs
    out = torch.empty_like(q) if out is None else out
    _check(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, seqs, out)
    if check_values:
        _check_values(q, k_cache, block_tables, seq_lens, cu_seqlens_q, seqs)
    attend_in_place(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, seqs, out, scale)
    return out


def _check_values(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, seqs: torch.Tensor) -> None:
    """Every index the kernel will follow is in range (it reads raw memory)."""
    s = seq_lens.shape[0]
    if cu_seqlens_q.shape[0] != s + 1 or block_tables.shape[0] != s:
        raise ValueError(f"cu_seqlens_q must have S + 1 = {s + 1} entries and block_tables S "
                         f"rows, got {cu_seqlens_q.shape[0]} and {block_tables.shape[0]}")
    cu, lens = cu_seqlens_q.long(), seq_lens.long()
    n_new = cu[1:] - cu[:-1]
    if cu[0] != 0 or (n_new < 0).any() or cu[-1] > q.shape[0]:
        raise ValueError(f"cu_seqlens_q must rise from 0 to at most N = {q.shape[0]}")
    if ((lens < n_new) | (lens > block_tables.shape[1] * k_cache.shape[1])).any():
        raise ValueError("seq_lens must be at least each sequence's new tokens and fit its "
                         "block table")
    if seqs.numel() and (seqs.min() < 0 or seqs.max() >= s):
        raise ValueError(f"seqs must index the S = {s} sequences")
    used = torch.arange(block_tables.shape[1]) < (-(-lens // k_cache.shape[1]))[:, None]
    blocks = block_tables[used]
    if blocks.numel() and (blocks.min() < 0 or blocks.max() >= k_cache.shape[0]):
        raise ValueError(f"block_tables entries must be block ids in [0, {k_cache.shape[0]})")
