
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

// The layout (weights, and the quantized activations): a row's blocks of 32 go in chunks of
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
template <typename T>
static void quantize_rows(const T* x, int64_t ldx, int64_t m, int64_t k, int8_t* qx, float* d,
                          float* ds) {
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
            int8_t* out = qx + r * k + lay(b, 0, nb);      // element 4t + j at t * vec + j
            for (int t = 0; t < 8; ++t) std::memcpy(out + t * vec, q + 4 * t, 4);
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
// Lanes h..h+7 (those below c) of the chunk of c blocks at block b0, 256 bits at a time: adds
// f_b * dot_b (+ mn_b * ds_b) of each activation row r into the eight floats of acc[r].
template <int R, bool INT4>
static inline void lanes8(const uint8_t* wc, const float* sc, const float* mn,
                          const int8_t* qx, const float* d, const float* ds, int64_t k,
                          int64_t b0, int64_t c, int64_t h, __m256* acc) {
    const int64_t nb = k / QK, vec = 4 * c, n = c - h < 8 ? c - h : 8;
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n),
                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    auto load = [&](const void* p) { return _mm256_maskload_epi32((const int*)p + h, m); };
    __m256i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
    for (int t = 0; t < 8; ++t) {
        const __m256i v = load(wc + (INT4 ? t % 4 : t) * vec);
        const __m256i u = !INT4 ? _mm256_sign_epi8(v, v)                 // |w|, sign onto q
                          : t < 4 ? _mm256_and_si256(v, low)
                                  : _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r) {
            const __m256i a = load(qx + r * k + b0 * QK + t * vec);
            dot[r] = madd(dot[r], u, INT4 ? a : _mm256_sign_epi8(a, v));
        }
    }
    const __m256 s = INT4 ? _mm256_maskload_ps(sc + b0 + h, m) : _mm256_set1_ps(1.0f);
    for (int r = 0; r < R; ++r) {
        const __m256 f = _mm256_mul_ps(s, _mm256_maskload_ps(d + r * nb + b0 + h, m));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), f, acc[r]);
        if (INT4) acc[r] = _mm256_fmadd_ps(_mm256_maskload_ps(mn + b0 + h, m),
                                           _mm256_maskload_ps(ds + r * nb + b0 + h, m), acc[r]);
    }
}
#endif

#if defined(WIDE)
// The chunk of c (9..16) blocks at b0 in 512-bit registers, into the 16 floats of acc[r].
template <int R, bool INT4>
static inline void lanes16(const uint8_t* wc, const float* sc, const float* mn,
                           const int8_t* qx, const float* d, const float* ds, int64_t k,
                           int64_t b0, int64_t c, __m512* acc) {
    const int64_t nb = k / QK, vec = 4 * c;
    const __mmask64 bytes = c == CHUNK ? ~0ULL : (1ULL << vec) - 1;
    const __mmask16 lanes = (__mmask16)((1u << c) - 1u);
    const __m512i low = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = zero;
    if (INT4) {
        for (int u = 0; u < 4; ++u) {                      // vector u: codes of t = u, u + 4
            const __m512i v = _mm512_maskz_loadu_epi8(bytes, wc + u * vec);
            const __m512i lo = _mm512_and_si512(v, low);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            for (int r = 0; r < R; ++r) {
                const int8_t* a = qx + r * k + b0 * QK;
                dot[r] = madd(dot[r], lo, _mm512_maskz_loadu_epi8(bytes, a + u * vec));
                dot[r] = madd(dot[r], hi, _mm512_maskz_loadu_epi8(bytes, a + (u + 4) * vec));
            }
        }
    } else {
        for (int t = 0; t < 8; ++t) {                      // |w|, and w's sign moved onto q
            const __m512i v = _mm512_maskz_loadu_epi8(bytes, wc + t * vec);
            const __m512i u = _mm512_abs_epi8(v);
            const __mmask64 neg = _mm512_movepi8_mask(v);
            for (int r = 0; r < R; ++r) {
                const __m512i a = _mm512_maskz_loadu_epi8(bytes, qx + r * k + b0 * QK + t * vec);
                dot[r] = madd(dot[r], u, _mm512_mask_sub_epi8(a, neg, zero, a));
            }
        }
    }
    const __m512 s = INT4 ? _mm512_maskz_loadu_ps(lanes, sc + b0) : _mm512_set1_ps(1.0f);
    for (int r = 0; r < R; ++r) {
        const __m512 f = _mm512_mul_ps(s, _mm512_maskz_loadu_ps(lanes, d + r * nb + b0));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), f, acc[r]);
        if (INT4) acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, mn + b0),
                                           _mm512_maskz_loadu_ps(lanes, ds + r * nb + b0),
                                           acc[r]);
    }
}
#endif

// One weight row against R activation rows (qx, d, ds: the rows' quantized values, block
// scales and scaled code sums): out[r] = sum_b f_b * dot_b (+ sum_b mn_b * ds_b for int4),
// f_b = sc_b * d_b for INT4 (packed codes, per-block scale sc and minimum mn), d_b for int8
// (signed weights; the channel scale is applied by the caller). A chunk of up to 8 blocks
// goes through 256-bit registers even where 512-bit ones exist (which some CPUs, AMD's Zen 4,
// run at half the rate: a short chunk would pay for 16 lanes).
template <int R, bool INT4>
static inline void weight_row(const uint8_t* w, const float* sc, const float* mn,
                              const int8_t* qx, const float* d, const float* ds, int64_t k,
                              float* out) {
    const int64_t nb = k / QK, chunk_bytes = INT4 ? QK / 2 : QK;
#if defined(__AVX2__)
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
#if defined(WIDE)
    __m512 wide[R];
    for (int r = 0; r < R; ++r) wide[r] = _mm512_setzero_ps();
#endif
    for (int64_t b0 = 0; b0 < nb; b0 += CHUNK) {
        const int64_t c = nb - b0 < CHUNK ? nb - b0 : CHUNK;
        const uint8_t* wc = w + b0 * chunk_bytes;
#if defined(WIDE)
        if (c > 8) { lanes16<R, INT4>(wc, sc, mn, qx, d, ds, k, b0, c, wide); continue; }
#endif
        for (int64_t h = 0; h < c; h += 8) lanes8<R, INT4>(wc, sc, mn, qx, d, ds, k, b0, c, h, acc);
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
                int wv;
                if (INT4) {                                // nibble t / 4 of byte (t % 4, lane)
                    const int64_t b0 = b / CHUNK * CHUNK, c = nb - b0 < CHUNK ? nb - b0 : CHUNK;
                    const uint8_t byte =
                        w[b0 * QK / 2 + (e / 4 % 4) * c * 4 + (b - b0) * 4 + e % 4];
                    wv = e / 4 < 4 ? byte & 15 : byte >> 4;
                } else {
                    wv = (int8_t)w[at];
                }
                dot += wv * qx[r * k + at];
            }
            total += INT4 ? sc[b] * d[r * nb + b] * (float)dot + mn[b] * ds[r * nb + b]
                          : d[r * nb + b] * (float)dot;
        }
        out[r] = total;
    }
#endif
}

struct Quantized {                  // the activation rows, quantized once per call
    std::vector<int8_t> qx; std::vector<float> d, ds;
};

// y [m, n] (row stride ldy) = x [m, k] W^T, W [n, k]: int8 (w [n, k], scale [n]: W = scale * w)
// or int4 (w [n, k / 2] packed codes, scale and mn [n, k / 32]: W = code * scale + mn), both
// in the layout
template <typename T, bool INT4>
static void quant_matmul(const T* x, int64_t ldx, const void* w, const float* scale,
                         const float* mn, T* y, int64_t ldy, int64_t m, int64_t n, int64_t k) {
    static thread_local Quantized a;
    const int64_t nb = k / QK, row_bytes = INT4 ? k / 2 : k;
    a.qx.resize(m * k); a.d.resize(m * nb); a.ds.resize(m * nb);
    quantize_rows(x, ldx, m, k, a.qx.data(), a.d.data(), a.ds.data());
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
