#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define BF16_DOT 1                                // vdpbf16ps: 16 lanes += 2 products each
#endif

static const int ROWS = 16;                       // weight rows side by side, one a lane
static const int TILE = 4;                        // activation rows per pass over a group
static const int64_t PARALLEL_MACS = 1 << 16;     // below this one thread is faster

// The layout: weight rows in groups of 16; pair c of a group (elements 2c, 2c + 1 of each of
// its 16 rows) is 64 bytes, lane l the pair of row l. So one vdpbf16ps of pair c against x's
// pair c broadcast to every lane adds two products into each of 16 rows' sums: the lanes are
// the outputs, and no sum crosses lanes.
// out[r][l] = row l of the group (w: [k / 2, 16] pairs) . activation row r (x, row stride ldx)
template <int R>
static inline void group(const uint32_t* w, const uint16_t* x, int64_t ldx, int64_t k,
                         float (*out)[ROWS]) {
#if defined(BF16_DOT)
    __m512 acc[R][4];                             // four chains of dependent adds a row
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < k / 2; c += 4)
        for (int j = 0; j < 4; ++j) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (c + j) * ROWS);
            for (int r = 0; r < R; ++r) {
                uint32_t pair;
                std::memcpy(&pair, x + r * ldx + 2 * (c + j), 4);
                acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv, (__m512bh)_mm512_set1_epi32((int)pair));
            }
        }
    for (int r = 0; r < R; ++r)
        _mm512_storeu_ps(out[r], _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]),
                                               _mm512_add_ps(acc[r][2], acc[r][3])));
#else
    for (int r = 0; r < R; ++r)
        for (int l = 0; l < ROWS; ++l) {
            float total = 0.0f;
            for (int64_t c = 0; c < k / 2; ++c) {
                const uint32_t pair = w[c * ROWS + l];
                total += widen((uint16_t)(pair & 0xFFFF)) * widen(x[r * ldx + 2 * c])
                       + widen((uint16_t)(pair >> 16)) * widen(x[r * ldx + 2 * c + 1]);
            }
            out[r][l] = total;
        }
#endif
}

// y [m, n] (row stride ldy) = x [m, k] W^T in bfloat16, W [n, k] bfloat16 in the layout
// (n a multiple of 16, k of 8), sums in float32
extern "C" void bf16_gemv(const uint16_t* x, int64_t ldx, const uint32_t* w, uint16_t* y,
                          int64_t ldy, int64_t m, int64_t n, int64_t k) {
    #pragma omp parallel for schedule(static) if (m * n * k >= PARALLEL_MACS)
    for (int64_t g = 0; g < n / ROWS; ++g) {
        const uint32_t* wg = w + g * (k / 2) * ROWS;
        for (int64_t r0 = 0; r0 < m; r0 += TILE) {
            const uint16_t* xr = x + r0 * ldx;
            const int64_t rows = m - r0 < TILE ? m - r0 : TILE;
            float out[TILE][ROWS];
            switch (rows) {
                case 4: group<4>(wg, xr, ldx, k, out); break;
                case 3: group<3>(wg, xr, ldx, k, out); break;
                case 2: group<2>(wg, xr, ldx, k, out); break;
                default: group<1>(wg, xr, ldx, k, out);
            }
            for (int64_t r = 0; r < rows; ++r)
                for (int l = 0; l < ROWS; ++l) narrow(out[r][l], y + (r0 + r) * ldy + g * ROWS + l);
        }
    }
}
