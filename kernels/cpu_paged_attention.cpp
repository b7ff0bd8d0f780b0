
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <type_traits>

// 8 floats as one value: AVX2 / AVX-512 registers (two SSE ones on older CPUs)
typedef float f8 __attribute__((vector_size(32)));
static inline f8 load8(const float* p) { f8 v; std::memcpy(&v, p, 32); return v; }
static inline void store8(float* p, f8 v) { std::memcpy(p, &v, 32); }
// 8 int8 cache values widened to floats (their scale is applied by the caller)
static inline f8 load8(const int8_t* p) {
    f8 v;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
    std::memcpy(&v, &w, 32);
#else
    for (int i = 0; i < 8; ++i) v[i] = (float)p[i];
#endif
    return v;
}
#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 load8ps(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8ps(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
#endif

// q . k over D keys' elements (float32, or int8 widened; D a multiple of 8 known when
// compiled; D == 0: d, any)
template <int64_t D, typename K>
static inline float dot(const float* __restrict q, const K* __restrict k, int64_t d) {
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
template <int64_t D, typename K>
static inline void dot8(const float* __restrict q, const K* __restrict k, int64_t stride,
                        float* __restrict out) {
#if defined(__AVX2__) && defined(__FMA__)
    if constexpr (D > 0) {
        __m256 s[8];
        const __m256 q0 = _mm256_loadu_ps(q);
        for (int j = 0; j < 8; ++j) s[j] = _mm256_mul_ps(q0, load8ps(k + j * stride));
        for (int64_t e = 8; e < D; e += 8) {
            const __m256 qe = _mm256_loadu_ps(q + e);
            for (int j = 0; j < 8; ++j)
                s[j] = _mm256_fmadd_ps(qe, load8ps(k + j * stride + e), s[j]);
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

// The keys or values of a block ([n, hkv, d]) as the loops read them: float32 and int8 in
// place (int8's scales are applied to the scores and the weights), bfloat16 widened into buf.
static inline const float* readable(const float* src, float*, int64_t) { return src; }
static inline const int8_t* readable(const int8_t* src, float*, int64_t) { return src; }
static inline const float* readable(const uint16_t* src, float* buf, int64_t n) {
    for (int64_t i = 0; i < n; ++i) buf[i] = widen(src[i]);
    return buf;
}

// acc = alpha * acc + sum_o w[o] * v[o * stride : + d], with acc kept in registers (D > 0)
template <int64_t D, typename V>
static inline void accumulate(float* __restrict acc, float alpha, const float* __restrict w,
                              const V* __restrict v, int64_t stride, int64_t n, int64_t d) {
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
// busy (each item walks the blocks its last token sees; they are in L2 by then), and, when
// there are fewer sequences than threads, into as many items as a sequence's share of the
// threads: a verify step's few rows at batch 1 then run on every core.
constexpr int64_t CHUNK = 32;
struct Item { int64_t s, q0, count, ctx; };
static std::vector<Item> work_items(const int32_t* cu_q, const int32_t* seq_lens,
                                    const int32_t* seqs, int64_t n_seqs) {
#ifdef _OPENMP
    const int64_t threads = omp_get_max_threads();
#else
    const int64_t threads = 1;
#endif
    const int64_t share = n_seqs > 0 && n_seqs < threads ? threads / n_seqs : 1;
    std::vector<Item> items;
    for (int64_t i = 0; i < n_seqs; ++i) {
        const int64_t s = seqs[i], nq = cu_q[s + 1] - cu_q[s], cached = seq_lens[s] - nq;
        const int64_t even = (nq + share - 1) / share, chunk = even < CHUNK ? even : CHUNK;
        for (int64_t t = 0; t < nq; t += chunk)
            items.push_back({s, cu_q[s] + t, nq - t < chunk ? nq - t : chunk, cached + t});
    }
    return items;
}

// A tree row's key j places after its mask's first key (j < 0: before the mask, seen; bit j
// of the row's bits: seen). Masks span at most 64 keys.
static inline bool hidden(int64_t bits, int64_t j) { return j >= 0 && !((bits >> j) & 1); }

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
// Sixteen 16-lane sums as one register (lane j: the sum of v[j]'s lanes) by a transposing
// reduction (unpack, unpack, two rounds of 128-bit shuffles: 45 instructions) instead of
// sixteen horizontal sums. Its first step, pair_sum(v[2i], v[2i + 1]), is taken as the pairs
// come; sum_pairs does the rest from the eight pair sums.
static inline __m512 pair_sum(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}

static inline __m512 sum_pairs(const __m512* t) {
    __m512 u[4];
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

// A block's values as key pairs: vp[pair][e] = v[2 pair][e] | v[2 pair + 1][e] << 16 over a
// cached token's ``row`` elements, so that one vdpbf16ps against the broadcast weight pair
// (w[2 pair], w[2 pair + 1]) adds two keys' values into 16 output lanes. A last odd key is
// paired with zeros (its partner's weight is zero, and a zero keeps NaN out of the sum).
static void pair_values(const uint16_t* vb, int64_t n, int64_t row, uint32_t* vp) {
    alignas(64) int16_t lo_idx[32], hi_idx[32];      // word k of the pairs: a[k/2] or b[k/2]
    for (int k = 0; k < 32; ++k) {
        lo_idx[k] = (int16_t)((k % 2 ? 32 : 0) + k / 2);
        hi_idx[k] = (int16_t)((k % 2 ? 32 : 0) + 16 + k / 2);
    }
    const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
    for (int64_t o = 0; o < n; o += 2)
        for (int64_t i = 0; i < row; i += 32) {
            const __m512i a = _mm512_loadu_si512(vb + o * row + i);
            const __m512i b = o + 1 < n ? _mm512_loadu_si512(vb + (o + 1) * row + i)
                                        : _mm512_setzero_si512();
            _mm512_storeu_si512(vp + o / 2 * row + i, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(vp + o / 2 * row + i + 16, _mm512_permutex2var_epi16(a, hi, b));
        }
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

// G query rows of one new token and one KV head (they read the same keys and values): the
// arguments of attend_rows. ``keys``: the block's keys of that head, [key][row] bfloat16, or
// (transposed) its kt groups; ``vals``: the block's value pairs of that head; ``first``: the
// block's first key's place after the tree mask's first key.
struct RowGroup {
    const uint16_t* q; const void* keys; const uint32_t* vals;
    int64_t row, cnt, bits, first; float scale; float *m, *l, *acc;
};

// Scores of 16 keys for G rows, the keys as rows of the cache: each key's registers loaded
// once for the G rows, the products reduced by pair_sum as they come and sum_pairs after.
template <int G, int64_t D>
static inline void key_scores(const __m512bh (&qv)[G][D / 32], const uint16_t* kr, int64_t row,
                              int64_t nk, __m512 (&raw)[G]) {
    __m512 t[G][8];
    for (int64_t j = 0; j < 16; j += 2) {
        __m512 d0[G], d1[G];
        for (int i = 0; i < G; ++i) d0[i] = d1[i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < D / 32; ++c) {
            if (j < nk) {
                const __m512bh k = (__m512bh)_mm512_loadu_si512(kr + j * row + 32 * c);
                for (int i = 0; i < G; ++i) d0[i] = _mm512_dpbf16_ps(d0[i], qv[i][c], k);
            }
            if (j + 1 < nk) {
                const __m512bh k = (__m512bh)_mm512_loadu_si512(kr + (j + 1) * row + 32 * c);
                for (int i = 0; i < G; ++i) d1[i] = _mm512_dpbf16_ps(d1[i], qv[i][c], k);
            }
        }
        for (int i = 0; i < G; ++i) t[i][j / 2] = pair_sum(d0[i], d1[i]);
    }
    for (int i = 0; i < G; ++i) raw[i] = sum_pairs(t[i]);
}

// Scores of 16 keys for G rows from the transposed keys kg[pair c][key]: 16 lanes of
// vdpbf16ps with a row's pair c broadcast are 16 keys' partial sums; two chains a row.
template <int G, int64_t D>
static inline void transposed_scores(const uint16_t* q, const uint32_t* kg, __m512 (&raw)[G]) {
    const uint32_t* qp = (const uint32_t*)q;             // row i's pairs: qp[i * D / 2 + c]
    __m512 even[G], odd[G];
    for (int i = 0; i < G; ++i) even[i] = odd[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D / 2; c += 2) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kg + 16 * c);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kg + 16 * c + 16);
        for (int i = 0; i < G; ++i) {
            even[i] = _mm512_dpbf16_ps(even[i], k0,
                                       (__m512bh)_mm512_set1_epi32((int)qp[i * D / 2 + c]));
            odd[i] = _mm512_dpbf16_ps(odd[i], k1,
                                      (__m512bh)_mm512_set1_epi32((int)qp[i * D / 2 + c + 1]));
        }
    }
    for (int i = 0; i < G; ++i) raw[i] = _mm512_add_ps(even[i], odd[i]);
}

// One block's keys for G rows, 16 at a time: scores, one online-softmax step per row, then
// p . v: the weights rounded to bfloat16 (as FlashAttention's P before its PV matmul) against
// the value pairs, two keys per vdpbf16ps, each pair's registers loaded once for the G rows.
template <int G, int64_t D, bool TRANSPOSED>
static void attend_rows(const RowGroup& x) {
    __m512bh qv[G][D / 32];
    __m512 a[G][D / 16];
    for (int i = 0; i < G; ++i) {
        for (int64_t c = 0; c < D / 32; ++c)
            qv[i][c] = (__m512bh)_mm512_loadu_si512(x.q + i * D + 32 * c);
        for (int64_t e = 0; e < D / 16; ++e) a[i][e] = _mm512_loadu_ps(x.acc + i * D + 16 * e);
    }
    for (int64_t o0 = 0; o0 < x.cnt; o0 += 16) {
        const int64_t nk = x.cnt - o0 < 16 ? x.cnt - o0 : 16;
        __mmask16 valid = (__mmask16)((1u << nk) - 1u);
        if (x.bits != -1)                                    // a tree row: hide non-ancestors
            for (int64_t j = 0; j < nk; ++j)
                if (hidden(x.bits, x.first + o0 + j)) valid &= (__mmask16)~(1u << j);
        __m512 raw[G];
        if constexpr (TRANSPOSED)
            transposed_scores<G, D>(x.q, (const uint32_t*)x.keys + o0 / 16 * (D / 2) * 16, raw);
        else
            key_scores<G, D>(qv, (const uint16_t*)x.keys + o0 * x.row, x.row, nk, raw);
        alignas(32) uint32_t wp[G][8];                       // the weights' bfloat16 pairs
        for (int i = 0; i < G; ++i) {
            const __m512 sc = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY),
                                                   _mm512_mul_ps(raw[i], _mm512_set1_ps(x.scale)));
            const float top = _mm512_reduce_max_ps(sc), best = top > x.m[i] ? top : x.m[i];
            const float alpha = exp_neg16(_mm512_set1_ps(x.m[i] - best))[0];
            const __m512 w = _mm512_maskz_mov_ps(
                valid, exp_neg16(_mm512_sub_ps(sc, _mm512_set1_ps(best))));
            x.l[i] = x.l[i] * alpha + _mm512_reduce_add_ps(w);
            x.m[i] = best;
            _mm256_store_si256((__m256i*)wp[i], (__m256i)_mm512_cvtneps_pbh(w));
            for (int64_t e = 0; e < D / 16; ++e)
                a[i][e] = _mm512_mul_ps(a[i][e], _mm512_set1_ps(alpha));
        }
        const uint32_t* vr = x.vals + o0 / 2 * x.row;
        for (int64_t p = 0; p < (nk + 1) / 2; ++p) {
            __m512bh wv[G];
            for (int i = 0; i < G; ++i) wv[i] = (__m512bh)_mm512_set1_epi32((int)wp[i][p]);
            for (int64_t e = 0; e < D / 16; ++e) {
                const __m512bh v = (__m512bh)_mm512_loadu_si512(vr + p * x.row + 16 * e);
                for (int i = 0; i < G; ++i) a[i][e] = _mm512_dpbf16_ps(a[i][e], v, wv[i]);
            }
        }
    }
    for (int i = 0; i < G; ++i)
        for (int64_t e = 0; e < D / 16; ++e) _mm512_storeu_ps(x.acc + i * D + 16 * e, a[i][e]);
}

// attend_rows for g rows, up to four at a time.
template <int64_t D, bool TRANSPOSED>
static void attend_group(RowGroup x, int64_t g) {
    for (int64_t i = 0; i < g; i += 4) {
        switch (g - i < 4 ? g - i : 4) {
            case 1: attend_rows<1, D, TRANSPOSED>(x); break;
            case 2: attend_rows<2, D, TRANSPOSED>(x); break;
            case 3: attend_rows<3, D, TRANSPOSED>(x); break;
            default: attend_rows<4, D, TRANSPOSED>(x);
        }
        x.q += 4 * D; x.m += 4; x.l += 4; x.acc += 4 * D;
    }
}

// The bfloat16 path on CPUs with AVX512-BF16: per block, its values paired (pair_values) and,
// for a prompt chunk, its keys transposed; then attend_rows for each new token's rows of each
// KV head (q . k and p . v with vdpbf16ps: exact products, float32 sums). Same loop and
// semantics as attend.
template <int64_t D>
static void attend_bf16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                        const int32_t* tables, int64_t width, const int32_t* seq_lens,
                        const int32_t* cu_q, const int32_t* seqs, int64_t n_seqs, uint16_t* out,
                        int64_t hq, int64_t hkv, int64_t bs, float scale,
                        const int64_t* row_bits, const int32_t* mask_from) {
    static_assert(D % 32 == 0, "a head is whole 32-lane bfloat16 registers");
    const int64_t g = hq / hkv, row = hkv * D;
    const std::vector<Item> items = work_items(cu_q, seq_lens, seqs, n_seqs);
    #pragma omp parallel for schedule(dynamic, 1)
    for (size_t item = 0; item < items.size(); ++item) {
        const auto [s, q0, nq, ctx] = items[item];
        const int64_t len = ctx + nq, rows = nq * hq;
        std::vector<float> acc(rows * D, 0.0f), m(rows, -INFINITY), l(rows, 0.0f);
        std::vector<uint32_t> vp((bs + 1) / 2 * row);
        // Many rows per KV head (a prompt chunk): the block's keys are also laid out as
        // kt[kv head][16-key group][pair c][key], so that 16 lanes of vdpbf16ps with q's pair c
        // broadcast are 16 keys' partial dot products: no reduction per row. Decodes (a few
        // rows) do not repay the transpose. Decided by the sequence's new rows, not the
        // item's, so that the result does not depend on how many threads cut it.
        const int64_t groups = (bs + 15) / 16;
        const bool transposed = (cu_q[s + 1] - cu_q[s]) * g >= 16;
        std::vector<uint32_t> kt(transposed ? hkv * groups * (D / 2) * 16 : 0);
        for (int64_t p0 = 0; p0 < len; p0 += bs) {
            const int64_t n = len - p0 < bs ? len - p0 : bs;
            const uint16_t* kb = kc + tables[s * width + p0 / bs] * bs * row;
            const uint16_t* vb = vc + tables[s * width + p0 / bs] * bs * row;
            // Two blocks ahead (one ahead arrived too late here: 10% slower decodes); at the
            // start the first one ahead in one burst as well.
            const auto table_at = [&](int64_t i) {
                return i * bs < len ? (int64_t)tables[s * width + i] : (int64_t)-1;
            };
            const NextBlock next(kc, vc, table_at(p0 / bs + 2), bs * row, rows);
            if (p0 == 0) NextBlock(kc, vc, table_at(1), bs * row, 1).fetch_slice(0);
            pair_values(vb, n, row, vp.data());
            if (transposed)
                for (int64_t h = 0; h < hkv; ++h)
                    for (int64_t o = 0; o < groups * 16; ++o) {
                        uint32_t* dst = &kt[(h * groups + o / 16) * (D / 2) * 16 + o % 16];
                        const uint32_t* src = (const uint32_t*)(kb + o * row + h * D);
                        for (int64_t c = 0; c < D / 2; ++c) dst[16 * c] = o < n ? src[c] : 0u;
                    }
            for (int64_t r0 = 0; r0 < rows; r0 += g) {           // one token's rows of a KV head
                const int64_t seen = ctx + r0 / hq + 1 - p0;
                const int64_t cnt = seen < n ? seen : n, kvh = (r0 % hq) / g;
                if (cnt <= 0) {
                    for (int64_t r = r0; r < r0 + g; ++r) next.fetch_slice(r);
                    continue;
                }
                const void* keys = transposed ? (const void*)&kt[kvh * groups * (D / 2) * 16]
                                              : (const void*)(kb + kvh * D);
                RowGroup x{q + (q0 * hq + r0) * D, keys, &vp[kvh * D], row, cnt,
                           row_bits ? row_bits[q0 + r0 / hq] : -1,
                           row_bits ? p0 - mask_from[s] : 0, scale, &m[r0], &l[r0], &acc[r0 * D]};
                if (transposed) {              // a prompt chunk's rows: four at a time
                    for (int64_t r = r0; r < r0 + g; ++r) next.fetch_slice(r);
                    attend_group<D, true>(x, g);
                    continue;
                }
                // A decode's rows one at a time, each after its slice of the next block: with
                // the rows of a KV head together (their keys and values loaded once) the
                // compute was 30% faster with the block in cache, but decodes, which read it
                // from memory, were 10% slower.
                for (int64_t r = r0; r < r0 + g; ++r, x.q += D, ++x.m, ++x.l, x.acc += D) {
                    next.fetch_slice(r);
                    attend_rows<1, D, false>(x);
                }
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

// T: q's and out's element type; C: the cache's (T, bfloat16 below a float32 T, or int8 with
// scales ks, vs [num_blocks, bs, hkv]; null for a float cache).
template <typename T, typename C, int64_t D>     // D > 0: the head dim, known when compiled
static void attend(const T* q, const C* kc, const C* vc, const int32_t* tables, int64_t width,
                   const int32_t* seq_lens, const int32_t* cu_q, const int32_t* seqs,
                   int64_t n_seqs, T* out, int64_t hq, int64_t hkv, int64_t dim, int64_t bs,
                   float scale, const float* ks, const float* vs, const int64_t* row_bits,
                   const int32_t* mask_from) {
    const int64_t d = D > 0 ? D : dim, g = hq / hkv, row = hkv * d;   // row: one cached token
    constexpr bool int8 = std::is_same_v<C, int8_t>;
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
            const int64_t block = tables[s * width + p0 / bs];
            const C* kb = kc + block * bs * row;
            const C* vb = vc + block * bs * row;
            const NextBlock next(kc, vc, p0 + bs < len ? tables[s * width + p0 / bs + 1] : -1,
                                 bs * row, rows);
            const auto* kf = readable(kb, kbuf.data(), n * row);
            const auto* vf = readable(vb, vbuf.data(), n * row);
            const float* k_scale = int8 ? ks + block * bs * hkv : nullptr;   // [n, hkv]
            const float* v_scale = int8 ? vs + block * bs * hkv : nullptr;
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
                if (int8)                                    // q . (s k) = s (q . k)
                    for (o = 0; o < cnt; ++o) p[o] *= k_scale[o * hkv + kvh];
                const int64_t bits = row_bits ? row_bits[q0 + r / hq] : -1;
                if (bits != -1)                              // a tree row: hide non-ancestors
                    for (o = 0; o < cnt; ++o)
                        if (hidden(bits, p0 + o - mask_from[s])) p[o] = -INFINITY;
                for (o = 0; o < cnt; ++o) best = p[o] > best ? p[o] : best;
                const float alpha = exp_neg(m[r] - best);
                float sum = 0.0f;
                #pragma omp simd reduction(+:sum)
                for (int64_t o = 0; o < cnt; ++o) { p[o] = exp_neg(p[o] - best); sum += p[o]; }
                if (int8)                                    // w (s v) = (w s) v
                    for (o = 0; o < cnt; ++o) p[o] *= v_scale[o * hkv + kvh];
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

#define ENTRY(NAME, T, C)                                                                   \
extern "C" void NAME(const void* q, const void* kc, const void* vc, const int32_t* tables,  \
                     int64_t width, const int32_t* seq_lens, const int32_t* cu_q,            \
                     const int32_t* seqs, int64_t n_seqs, void* out, int64_t hq, int64_t hkv, \
                     int64_t d, int64_t bs, float scale, const float* ks, const float* vs,   \
                     const int64_t* rb, const int32_t* mf) {                                 \
    auto run = d == 64 ? attend<T, C, 64> : d == 128 ? attend<T, C, 128> : attend<T, C, 0>; \
    run((const T*)q, (const C*)kc, (const C*)vc, tables, width, seq_lens, cu_q, seqs,       \
        n_seqs, (T*)out, hq, hkv, d, bs, scale, ks, vs, rb, mf);                            \
}
ENTRY(paged_attention_f32, float, float)
ENTRY(paged_attention_f32_kvbf16, float, uint16_t)
ENTRY(paged_attention_f32_kvi8, float, int8_t)
ENTRY(paged_attention_bf16_kvi8, uint16_t, int8_t)
#ifdef HAVE_AVX512_BF16
extern "C" void paged_attention_bf16(const void* q, const void* kc, const void* vc,
                                     const int32_t* tables, int64_t width, const int32_t* seq_lens,
                                     const int32_t* cu_q, const int32_t* seqs, int64_t n_seqs,
                                     void* out, int64_t hq, int64_t hkv, int64_t d, int64_t bs,
                                     float scale, const float*, const float*,
                                     const int64_t* rb, const int32_t* mf) {
    auto fast = d == 64 ? attend_bf16<64> : d == 128 ? attend_bf16<128> : nullptr;
    if (fast != nullptr)
        return fast((const uint16_t*)q, (const uint16_t*)kc, (const uint16_t*)vc, tables, width,
                    seq_lens, cu_q, seqs, n_seqs, (uint16_t*)out, hq, hkv, bs, scale, rb, mf);
    auto run = attend<uint16_t, uint16_t, 0>;
    run((const uint16_t*)q, (const uint16_t*)kc, (const uint16_t*)vc, tables, width, seq_lens,
        cu_q, seqs, n_seqs, (uint16_t*)out, hq, hkv, d, bs, scale, nullptr, nullptr, rb, mf);
}
#else
ENTRY(paged_attention_bf16, uint16_t, uint16_t)
#endif
