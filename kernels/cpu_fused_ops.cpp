
template <typename T> static inline T round_to(float x) { T y; narrow(x, &y); return y; }
// a float32 result rounded as a T tensor would hold it (bfloat16: to 8 bits of mantissa)
template <typename T> static inline float as(float x) { return widen(round_to<T>(x)); }

static const int64_t PARALLEL_ELEMENTS = 1 << 15;    // below this one thread is faster

// x [n, d] (row stride ldx); residual [n, d] (row stride ldr) or null: x += residual (rounded
// to T), then out [n, d] = weight * T(x * rsqrt(mean(x^2) + eps)), as minillm's RMSNorm.
template <typename T>
static void add_rms_norm(T* x, int64_t ldx, const T* residual, int64_t ldr, const T* weight,
                         T* out, int64_t n, int64_t d, float eps) {
    #pragma omp parallel for if (n * d >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < n; ++r) {
        T* xr = x + r * ldx;
        if (residual) {
            const T* rr = residual + r * ldr;
            for (int64_t i = 0; i < d; ++i) xr[i] = round_to<T>(widen(xr[i]) + widen(rr[i]));
        }
        float part[16] = {0};
        int64_t i = 0;
        for (; i + 16 <= d; i += 16)
            for (int j = 0; j < 16; ++j) { const float v = widen(xr[i + j]); part[j] += v * v; }
        for (; i < d; ++i) { const float v = widen(xr[i]); part[0] += v * v; }
        float ss = 0.0f;
        for (int j = 0; j < 16; ++j) ss += part[j];
        const float inv = 1.0f / std::sqrt(ss / (float)d + eps);
        T* o = out + r * d;
        for (int64_t i = 0; i < d; ++i)
            o[i] = round_to<T>(widen(weight[i]) * as<T>(widen(xr[i]) * inv));
    }
}

// one head's d values at x rotated by RoPE into y: y = x cos + rotate_half(x) sin, each
// product and the sum rounded to T (cos, sin: the position's d values, already T)
template <typename T>
static inline void rotate(const T* x, const T* cos, const T* sin, T* y, int64_t d) {
    const int64_t h = d / 2;
    for (int64_t i = 0; i < d; ++i) {
        const float rot = i < h ? -widen(x[i + h]) : widen(x[i - h]);
        y[i] = round_to<T>(as<T>(widen(x[i]) * widen(cos[i])) + as<T>(rot * widen(sin[i])));
    }
}

// q [n, hq * d], k, v [n, hkv * d] (row stride ld, e.g. views of one qkv matmul output);
// cos, sin [n, d]. q_out [n, hq, d] = rope(q); k_cache, v_cache [slots, hkv, d] at
// slots[r]: rope(k), v.
template <typename T>
static void rope_store(const T* q, const T* k, const T* v, int64_t ld, const T* cos,
                       const T* sin, T* q_out, T* k_cache, T* v_cache, const int64_t* slots,
                       int64_t n, int64_t hq, int64_t hkv, int64_t d) {
    #pragma omp parallel for if (n * (hq + 2 * hkv) * d >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < n; ++r) {
        const T *c = cos + r * d, *s = sin + r * d;
        for (int64_t h = 0; h < hq; ++h)
            rotate(q + r * ld + h * d, c, s, q_out + (r * hq + h) * d, d);
        const int64_t slot = slots[r] * hkv * d;
        for (int64_t h = 0; h < hkv; ++h)
            rotate(k + r * ld + h * d, c, s, k_cache + slot + h * d, d);
        std::memcpy(v_cache + slot, v + r * ld, hkv * d * sizeof(T));
    }
}

// out [n, f] = T(silu(gate)) * up, gate and up [n, f] with row stride ld
template <typename T>
static void silu_mul(const T* gate, const T* up, int64_t ld, T* out, int64_t n, int64_t f) {
    #pragma omp parallel for if (n * f >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < n; ++r) {
        const T *g = gate + r * ld, *u = up + r * ld;
        T* o = out + r * f;
        for (int64_t i = 0; i < f; ++i) {
            const float x = widen(g[i]);
            const float e = exp_neg(x < 0.0f ? x : -x);          // exp(-|x|)
            const float sig = x < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e);
            o[i] = round_to<T>(as<T>(x * sig) * widen(u[i]));
        }
    }
}

#define ENTRIES(NAME, T)                                                                      \
extern "C" void add_rms_norm_##NAME(void* x, int64_t ldx, const void* res, int64_t ldr,      \
                                    const void* w, void* out, int64_t n, int64_t d,          \
                                    float eps) {                                             \
    add_rms_norm<T>((T*)x, ldx, (const T*)res, ldr, (const T*)w, (T*)out, n, d, eps);        \
}                                                                                             \
extern "C" void rope_store_##NAME(const void* q, const void* k, const void* v, int64_t ld,  \
                                  const void* cos, const void* sin, void* q_out,            \
                                  void* k_cache, void* v_cache, const int64_t* slots,       \
                                  int64_t n, int64_t hq, int64_t hkv, int64_t d) {          \
    rope_store<T>((const T*)q, (const T*)k, (const T*)v, ld, (const T*)cos, (const T*)sin,  \
                  (T*)q_out, (T*)k_cache, (T*)v_cache, slots, n, hq, hkv, d);               \
}                                                                                             \
extern "C" void silu_mul_##NAME(const void* g, const void* u, int64_t ld, void* out,        \
                                int64_t n, int64_t f) {                                      \
    silu_mul<T>((const T*)g, (const T*)u, ld, (T*)out, n, f);                                \
}
ENTRIES(f32, float)
ENTRIES(bf16, uint16_t)
