
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define WIDE 1                                    // 512-bit registers: 16 blocks at a time
#endif

static const int QK = 32, CHUNK = 16;
static const int TILE = 4;                        // activation rows per pass over a weight row
static const int64_t PARALLEL_MACS = 1 << 16;     // below this one thread is faster

// The int8 layout (weights, and the activations they meet): a row's blocks of 32 go in chunks of
// CHUNK blocks (fewer in the last one); a chunk of c blocks is 8 vectors of c lanes of 4 bytes,
// vector t lane l holding elements 4t..4t+3 of the chunk's block l. So an integer multiply-add
// of vector t adds into lane l a part of block l's dot product only, and after the 8 vectors
// the lanes hold the c blocks' dot products, ready for their scales: no horizontal sums.
// Offset of element e of block b in a row of nb blocks:
static inline int64_t lay(int64_t b, int64_t e, int64_t nb) {
    const int64_t b0 = b / CHUNK * CHUNK, c = nb - b0 < CHUNK ? nb - b0 : CHUNK;
    return b0 * QK + (e / 4) * c * 4 + (b - b0) * 4 + e % 4;
}

// x [m, k] (row stride ldx) -> qx [m, k] int8 in the layout, d [m, k/32] (block scales),
// ds [m, k/32] (d * sum of the block's codes): q = round(x * (1 / d)) with d = max|x| / 127,
// as quantize_activations in Python computes it.
// laid false: each row's values in their own order instead (the int4 kernel's).
template <typename T>
static void quantize_rows(const T* x, int64_t ldx, int64_t m, int64_t k, int8_t* qx, float* d,
                          float* ds, bool laid) {
    const int64_t nb = k / QK;
    for (int64_t r = 0; r < m; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            const T* xb = x + r * ldx + b * QK;
            float amax = 0.0f, v[QK];
            for (int i = 0; i < QK; ++i) {
                v[i] = widen(xb[i]);
                amax = std::fmax(amax, std::fabs(v[i]));
            }
            const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
            int sum = 0;
            int8_t q[QK];
            for (int i = 0; i < QK; ++i) {
                float e = std::nearbyint(v[i] * id);
                e = e > 127.0f ? 127.0f : (e < -127.0f ? -127.0f : e);
                q[i] = (int8_t)e; sum += (int)e;
            }
            const int64_t b0 = b / CHUNK * CHUNK, vec = 4 * (nb - b0 < CHUNK ? nb - b0 : CHUNK);
            if (laid) {
                int8_t* out = qx + r * k + lay(b, 0, nb);  // element 4t + j at t * vec + j
                for (int t = 0; t < 8; ++t) std::memcpy(out + t * vec, q + 4 * t, 4);
            } else {
                std::memcpy(qx + r * k + b * QK, q, QK);
            }
            d[r * nb + b] = db; ds[r * nb + b] = db * (float)sum;
        }
}

#if defined(WIDE)
// int32 lanes += 4-byte dot products of u (unsigned) and s (signed)
static inline __m512i madd(__m512i acc, __m512i u, __m512i s) {
    return _mm512_dpbusd_epi32(acc, u, s);
}
#endif
#if defined(__AVX2__)
static inline __m256i madd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else   // pairs summed in int16 (at most 2 * 127 * 127 here: no saturation), then fours
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                   _mm256_set1_epi16(1)));
#endif
}
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#if defined(__AVX2__)
// Lanes h..h+7 (those below c) of the chunk of c int8 blocks at block b0, 256 bits at a time:
// adds d_b * dot_b of each activation row r into the eight floats of acc[r].
template <int R>
static inline void lanes8(const uint8_t* wc, const int8_t* qx, const float* d, int64_t k,
                          int64_t b0, int64_t c, int64_t h, __m256* acc) {
    const int64_t nb = k / QK, vec = 4 * c, n = c - h < 8 ? c - h : 8;
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n),
                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    auto load = [&](const void* p) { return _mm256_maskload_epi32((const int*)p + h, m); };
    __m256i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
    for (int t = 0; t < 8; ++t) {
        const __m256i v = load(wc + t * vec);
        const __m256i u = _mm256_sign_epi8(v, v);                        // |w|, sign onto q
        for (int r = 0; r < R; ++r) {
            const __m256i a = load(qx + r * k + b0 * QK + t * vec);
            dot[r] = madd(dot[r], u, _mm256_sign_epi8(a, v));
        }
    }
    for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]),
                                 _mm256_maskload_ps(d + r * nb + b0 + h, m), acc[r]);
}
#endif

#if defined(WIDE)
// The chunk of c (9..16) int8 blocks at b0 in 512-bit registers, into the 16 floats of acc[r].
template <int R>
static inline void lanes16(const uint8_t* wc, const int8_t* qx, const float* d, int64_t k,
                           int64_t b0, int64_t c, __m512* acc) {
    const int64_t nb = k / QK, vec = 4 * c;
    const __mmask64 bytes = c == CHUNK ? ~0ULL : (1ULL << vec) - 1;
    const __mmask16 lanes = (__mmask16)((1u << c) - 1u);
    const __m512i zero = _mm512_setzero_si512();
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = zero;
    for (int t = 0; t < 8; ++t) {                          // |w|, and w's sign moved onto q
        const __m512i v = _mm512_maskz_loadu_epi8(bytes, wc + t * vec);
        const __m512i u = _mm512_abs_epi8(v);
        const __mmask64 neg = _mm512_movepi8_mask(v);
        for (int r = 0; r < R; ++r) {
            const __m512i a = _mm512_maskz_loadu_epi8(bytes, qx + r * k + b0 * QK + t * vec);
            dot[r] = madd(dot[r], u, _mm512_mask_sub_epi8(a, neg, zero, a));
        }
    }
    for (int r = 0; r < R; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]),
                                 _mm512_maskz_loadu_ps(lanes, d + r * nb + b0), acc[r]);
}
#endif

// One int8 weight row against R activation rows (qx, d: the rows' quantized values and block
// scales, in the layout): out[r] = sum_b d_b * dot_b (the channel scale is applied by the
// caller). A chunk of up to 8 blocks goes through 256-bit registers even where 512-bit ones
// exist (which some CPUs, AMD's Zen 4, run at half the rate: a short chunk would pay for 16
// lanes).
template <int R>
static inline void int8_row(const uint8_t* w, const int8_t* qx, const float* d, int64_t k,
                            float* out) {
    const int64_t nb = k / QK;
#if defined(__AVX2__)
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
#if defined(WIDE)
    __m512 wide[R];
    for (int r = 0; r < R; ++r) wide[r] = _mm512_setzero_ps();
#endif
    for (int64_t b0 = 0; b0 < nb; b0 += CHUNK) {
        const int64_t c = nb - b0 < CHUNK ? nb - b0 : CHUNK;
        const uint8_t* wc = w + b0 * QK;
#if defined(WIDE)
        if (c > 8) { lanes16<R>(wc, qx, d, k, b0, c, wide); continue; }
#endif
        for (int64_t h = 0; h < c; h += 8) lanes8<R>(wc, qx, d, k, b0, c, h, acc);
    }
    for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
#if defined(WIDE)
    for (int r = 0; r < R; ++r) out[r] += _mm512_reduce_add_ps(wide[r]);
#endif
#else
    for (int r = 0; r < R; ++r) {
        float total = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
            int dot = 0;
            for (int e = 0; e < QK; ++e) {
                const int64_t at = lay(b, e, nb);
                dot += (int8_t)w[at] * qx[r * k + at];
            }
            total += d[r * nb + b] * (float)dot;
        }
        out[r] = total;
    }
#endif
}

// ---------------------------------------------------------------- int4: rows in groups of 16
// The int4 layout: weight rows in groups of ROWS = 16; block b (32 codes) of a group's 16 rows
// is 256 bytes, four vectors u = 0..3 of 16 lanes (one per row) of 4 bytes: lane l byte i holds
// row l's element 4u + i in its low nibble and element 16 + 4u + i in its high one. So a mask,
// a shift and eight integer multiply-adds against four broadcast bytes of the activation block
// leave the 16 rows' dot products in the 16 lanes: every lane is one output, every register
// full, whatever K is, and no horizontal sums. scale and mn: float32 [groups, nb, 16].
static const int ROWS = 16;

static inline int32_t word(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return v; }

// The group scales and minima are float32, or float16 (S = uint16_t: its bits) where they are
// exactly float16 numbers (a quarter of the int4 bytes fewer to read).
static inline float scalar(float v) { return v; }
static inline float scalar(uint16_t h) {           // float16 -> float32, exactly
    const int exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    const float f = exp == 0 ? std::ldexp((float)man, -24)
                  : exp == 31 ? (man ? NAN : INFINITY) : std::ldexp((float)(1024 + man), exp - 25);
    return h & 0x8000 ? -f : f;
}
#if defined(WIDE)
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
#elif defined(__AVX2__)
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
    return _mm256_setr_ps(scalar(p[0]), scalar(p[1]), scalar(p[2]), scalar(p[3]),
                          scalar(p[4]), scalar(p[5]), scalar(p[6]), scalar(p[7]));
#endif
}
#endif

// out[r][l] = row l of the group . activation row r (qx, d, ds natural order, k values each):
// sum_b d_b * (sc_lb * (codes_lb . q_b) + mn_lb * sum(q_b)) with ds_b = d_b * sum(q_b).
// next (or null): the group done after this one; each block's codes ask for the same block of
// next to come into L2, so memory streams the next group while this one computes.
template <int R, typename S>
static inline void int4_group(const uint8_t* w, const S* sc, const S* mn,
                              const int8_t* qx, const float* d, const float* ds, int64_t k,
                              float (*out)[ROWS], const uint8_t* next) {
    const int64_t nb = k / QK;
#if defined(WIDE)
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* wb = w + b * ROWS * QK / 2;
        __m512i lo[4], hi[4];
        for (int u = 0; u < 4; ++u) {
            if (next)
                _mm_prefetch((const char*)(next + b * ROWS * QK / 2 + 64 * u), _MM_HINT_T1);
            const __m512i v = _mm512_loadu_si512(wb + 64 * u);
            lo[u] = _mm512_and_si512(v, low);
            hi[u] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        const __m512 s = load16(sc + b * ROWS), m = load16(mn + b * ROWS);
        for (int r = 0; r < R; ++r) {
            const int8_t* a = qx + r * k + b * QK;
            __m512i dot = _mm512_setzero_si512();
            for (int u = 0; u < 4; ++u) {
                dot = madd(dot, lo[u], _mm512_set1_epi32(word(a + 4 * u)));
                dot = madd(dot, hi[u], _mm512_set1_epi32(word(a + 16 + 4 * u)));
            }
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                     _mm512_mul_ps(s, _mm512_set1_ps(d[r * nb + b])), acc[r]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(ds[r * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[r], acc[r]);
#elif defined(__AVX2__)
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int half = 0; half < 2; ++half) {                // rows 0..7, then 8..15
        __m256 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* wb = w + b * ROWS * QK / 2 + 32 * half;
            __m256i lo[4], hi[4];
            for (int u = 0; u < 4; ++u) {
                if (next && half == 0)
                    _mm_prefetch((const char*)(next + b * ROWS * QK / 2 + 64 * u), _MM_HINT_T1);
                const __m256i v = _mm256_loadu_si256((const __m256i*)(wb + 64 * u));
                lo[u] = _mm256_and_si256(v, low);
                hi[u] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            const __m256 s = load8(sc + b * ROWS + 8 * half);
            const __m256 m = load8(mn + b * ROWS + 8 * half);
            for (int r = 0; r < R; ++r) {
                const int8_t* a = qx + r * k + b * QK;
                __m256i dot = _mm256_setzero_si256();
                for (int u = 0; u < 4; ++u) {
                    dot = madd(dot, lo[u], _mm256_set1_epi32(word(a + 4 * u)));
                    dot = madd(dot, hi[u], _mm256_set1_epi32(word(a + 16 + 4 * u)));
                }
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                         _mm256_mul_ps(s, _mm256_set1_ps(d[r * nb + b])), acc[r]);
                acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(ds[r * nb + b]), acc[r]);
            }
        }
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(out[r] + 8 * half, acc[r]);
    }
#else
    for (int r = 0; r < R; ++r)
        for (int l = 0; l < ROWS; ++l) {
            float total = 0.0f;
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t* wb = w + b * ROWS * QK / 2;
                const int8_t* a = qx + r * k + b * QK;
                int dot = 0;
                for (int u = 0; u < 4; ++u)
                    for (int i = 0; i < 4; ++i) {
                        const uint8_t byte = wb[64 * u + 4 * l + i];
                        dot += (byte & 15) * a[4 * u + i] + (byte >> 4) * a[16 + 4 * u + i];
                    }
                total += scalar(sc[b * ROWS + l]) * d[r * nb + b] * (float)dot
                       + scalar(mn[b * ROWS + l]) * ds[r * nb + b];
            }
            out[r][l] = total;
        }
#endif
}

struct Quantized {                  // the activation rows, quantized once per call
    std::vector<int8_t> qx; std::vector<float> d, ds;
};

// y [m, n] (row stride ldy) = x [m, k] W^T, W [n, k]: int8 (w [n, k] in the chunk layout,
// scale [n]: W = scale * w) or int4 (w: packed codes in the row-group layout, n a multiple of
// 16; scale and mn [n / 16, k / 32, 16] of S: W = code * scale + mn)
template <typename T, bool INT4, typename S = float>
static void quant_matmul(const T* x, int64_t ldx, const void* w, const S* scale,
                         const S* mn, T* y, int64_t ldy, int64_t m, int64_t n, int64_t k) {
    static thread_local Quantized a;
    const int64_t nb = k / QK;
    a.qx.resize(m * k); a.d.resize(m * nb); a.ds.resize(m * nb);
    quantize_rows(x, ldx, m, k, a.qx.data(), a.d.data(), a.ds.data(), !INT4);
    const int8_t* qx = a.qx.data();           // (a is this thread's: OpenMP's see theirs)
    const float *dx = a.d.data(), *dsx = a.ds.data();
    const int64_t units = INT4 ? n / ROWS : n;  // weight rows, or groups of 16 of them
    #pragma omp parallel for schedule(static) if (m * n * k >= PARALLEL_MACS)
    for (int64_t j = 0; j < units; ++j) {
        for (int64_t r0 = 0; r0 < m; r0 += TILE) {
            const int8_t* q = qx + r0 * k;
            const float *d = dx + r0 * nb, *ds = dsx + r0 * nb;
            const int64_t rows = m - r0 < TILE ? m - r0 : TILE;
            if (INT4) {
                const uint8_t* wj = (const uint8_t*)w + j * nb * ROWS * QK / 2;
                const S *sj = scale + j * nb * ROWS, *mj = mn + j * nb * ROWS;
                const uint8_t* next = j + 1 < units ? wj + nb * ROWS * QK / 2 : nullptr;
                float out[TILE][ROWS];
                switch (rows) {
                    case 4: int4_group<4>(wj, sj, mj, q, d, ds, k, out, next); break;
                    case 3: int4_group<3>(wj, sj, mj, q, d, ds, k, out, next); break;
                    case 2: int4_group<2>(wj, sj, mj, q, d, ds, k, out, next); break;
                    default: int4_group<1>(wj, sj, mj, q, d, ds, k, out, next);
                }
                for (int64_t r = 0; r < rows; ++r)
                    for (int l = 0; l < ROWS; ++l) narrow(out[r][l], y + (r0 + r) * ldy + j * ROWS + l);
            } else {
                const uint8_t* wj = (const uint8_t*)w + j * k;
                float out[TILE];
                switch (rows) {
                    case 4: int8_row<4>(wj, q, d, k, out); break;
                    case 3: int8_row<3>(wj, q, d, k, out); break;
                    case 2: int8_row<2>(wj, q, d, k, out); break;
                    default: int8_row<1>(wj, q, d, k, out);
                }
                for (int64_t r = 0; r < rows; ++r)
                    narrow(out[r] * scalar(scale[j]), y + (r0 + r) * ldy + j);
            }
        }
    }
}

#define ENTRIES(NAME, T)                                                                      \
extern "C" void int8_matmul_##NAME(const void* x, int64_t ldx, const void* w,                \
                                   const float* scale, void* y, int64_t ldy, int64_t m,      \
                                   int64_t n, int64_t k) {                                   \
    quant_matmul<T, false, float>((const T*)x, ldx, w, scale, nullptr, (T*)y, ldy, m, n, k); \
}                                                                                             \
extern "C" void int4_matmul_##NAME(const void* x, int64_t ldx, const void* w,                \
                                   const float* scale, const float* mn, void* y,             \
                                   int64_t ldy, int64_t m, int64_t n, int64_t k) {           \
    quant_matmul<T, true, float>((const T*)x, ldx, w, scale, mn, (T*)y, ldy, m, n, k);       \
}                                                                                             \
extern "C" void int4h_matmul_##NAME(const void* x, int64_t ldx, const void* w,               \
                                    const uint16_t* scale, const uint16_t* mn, void* y,      \
                                    int64_t ldy, int64_t m, int64_t n, int64_t k) {          \
    quant_matmul<T, true, uint16_t>((const T*)x, ldx, w, scale, mn, (T*)y, ldy, m, n, k);    \
}
ENTRIES(f32, float)
ENTRIES(bf16, uint16_t)
