#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define BF16_DOT 1                                // vdpbf16ps: 16 lanes += 2 products each
#endif

static const int ROWS = 16;                       // weight rows side by side, one a lane
static const int TILE = 12;                       // at most this many activation rows a pass
static const int64_t PARALLEL_MACS = 1 << 16;     // below this one thread is faster

// The layout: weight rows in groups of 16; pair c of a group (elements 2c, 2c + 1 of each of
// its 16 rows) is 64 bytes, lane l the pair of row l. So one vdpbf16ps of pair c against x's
// pair c broadcast to every lane adds two products into each of 16 rows' sums: the lanes are
// the outputs, and no sum crosses lanes.
// out[r][16 h + l] = row l of group h (G groups side by side, w: group h at w + h * gstride,
// [k / 2, 16] pairs each) . activation row r (x, row stride ldx). Each broadcast pair of x
// serves the G groups' weight vectors, and each loaded weight vector all R rows; C chains of
// dependent adds hide the instruction's latency. R * G * C accumulators stay in the 32 vector
// registers. next (or null): the weights the caller does after these, in the same layout; each
// weight vector loaded here asks for its counterpart there to come into L2, so the memory
// streams the next weights while this tile computes (without it a pass's arithmetic and the
// next weights' loads from memory take turns).
template <int R, int G, int C>
static inline void groups(const uint32_t* w, int64_t gstride, const uint16_t* x, int64_t ldx,
                          int64_t k, float (*out)[2 * ROWS], const uint32_t* next) {
#if defined(BF16_DOT)
    __m512 acc[R][G][C];
    for (int r = 0; r < R; ++r)
        for (int h = 0; h < G; ++h)
            for (int j = 0; j < C; ++j) acc[r][h][j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < k / 2; c += C)
        for (int j = 0; j < C; ++j) {
            __m512bh wv[G];
            for (int h = 0; h < G; ++h) {
                const int64_t at = h * gstride + (c + j) * ROWS;
                wv[h] = (__m512bh)_mm512_loadu_si512(w + at);
                if (next) _mm_prefetch((const char*)(next + at), _MM_HINT_T1);
            }
            for (int r = 0; r < R; ++r) {
                uint32_t pair;
                std::memcpy(&pair, x + r * ldx + 2 * (c + j), 4);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int h = 0; h < G; ++h)
                    acc[r][h][j] = _mm512_dpbf16_ps(acc[r][h][j], wv[h], xv);
            }
        }
    for (int r = 0; r < R; ++r)
        for (int h = 0; h < G; ++h) {
            __m512 sum = acc[r][h][0];
            if constexpr (C == 4)
                sum = _mm512_add_ps(_mm512_add_ps(acc[r][h][0], acc[r][h][1]),
                                    _mm512_add_ps(acc[r][h][2], acc[r][h][3]));
            else if constexpr (C == 2)
                sum = _mm512_add_ps(acc[r][h][0], acc[r][h][1]);
            _mm512_storeu_ps(out[r] + h * ROWS, sum);
        }
#else
    for (int r = 0; r < R; ++r)
        for (int h = 0; h < G; ++h)
            for (int l = 0; l < ROWS; ++l) {
                float total = 0.0f;
                for (int64_t c = 0; c < k / 2; ++c) {
                    const uint32_t pair = w[h * gstride + c * ROWS + l];
                    total += widen((uint16_t)(pair & 0xFFFF)) * widen(x[r * ldx + 2 * c])
                           + widen((uint16_t)(pair >> 16)) * widen(x[r * ldx + 2 * c + 1]);
                }
                out[r][h * ROWS + l] = total;
            }
#endif
}

// rows of x against G groups: chains so that at least 8 sums are in flight
template <int G>
static void tile(int64_t rows, const uint32_t* w, int64_t gstride, const uint16_t* x,
                 int64_t ldx, int64_t k, float (*out)[2 * ROWS], const uint32_t* next) {
    switch (rows) {
        case 12: groups<12, G, 1>(w, gstride, x, ldx, k, out, next); break;
        case 11: groups<11, G, 1>(w, gstride, x, ldx, k, out, next); break;
        case 10: groups<10, G, 1>(w, gstride, x, ldx, k, out, next); break;
        case 9: groups<9, G, 1>(w, gstride, x, ldx, k, out, next); break;
        case 8: groups<8, G, 1>(w, gstride, x, ldx, k, out, next); break;
        case 7: groups<7, G, 1>(w, gstride, x, ldx, k, out, next); break;
        case 6: groups<6, G, 1>(w, gstride, x, ldx, k, out, next); break;
        case 5: groups<5, G, 1>(w, gstride, x, ldx, k, out, next); break;
        case 4: groups<4, G, 2>(w, gstride, x, ldx, k, out, next); break;
        case 3: groups<3, G, 2>(w, gstride, x, ldx, k, out, next); break;
        case 2: groups<2, G, 4>(w, gstride, x, ldx, k, out, next); break;
        default: groups<1, G, 4>(w, gstride, x, ldx, k, out, next);
    }
}

// y [m, n] (row stride ldy) = x [m, k] W^T in bfloat16, W [n, k] bfloat16 in the layout
// (n a multiple of 16, k of 8), sums in float32. Threads share pairs of groups (32 output
// columns); an odd last group goes alone. The m rows are cut into the fewest tiles of at most
// TILE rows, of equal size (17 rows: 9 and 8), and every tile prefetches the next pair.
extern "C" void bf16_gemv(const uint16_t* x, int64_t ldx, const uint32_t* w, uint16_t* y,
                          int64_t ldy, int64_t m, int64_t n, int64_t k) {
    if (m <= 0) return;
    const int64_t gstride = (k / 2) * ROWS, ngroups = n / ROWS;
    const int64_t tiles = (m + TILE - 1) / TILE, per_tile = (m + tiles - 1) / tiles;
    #pragma omp parallel for schedule(static) if (m * n * k >= PARALLEL_MACS)
    for (int64_t g = 0; g < ngroups; g += 2) {
        const int G = g + 1 < ngroups ? 2 : 1;
        const uint32_t* wg = w + g * gstride;
        const uint32_t* next = g + 2 < ngroups ? wg + 2 * gstride : nullptr;
        for (int64_t r0 = 0; r0 < m; r0 += per_tile) {
            const uint16_t* xr = x + r0 * ldx;
            const int64_t rows = m - r0 < per_tile ? m - r0 : per_tile;
            float out[TILE][2 * ROWS];
            if (G == 2) tile<2>(rows, wg, gstride, xr, ldx, k, out, next);
            else tile<1>(rows, wg, gstride, xr, ldx, k, out, next);
            for (int64_t r = 0; r < rows; ++r)
                for (int l = 0; l < G * ROWS; ++l)
                    narrow(out[r][l], y + (r0 + r) * ldy + g * ROWS + l);
        }
    }
}
