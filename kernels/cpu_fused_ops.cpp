
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

// One head's d values x (floats) into a cache slot of another format: bfloat16 rounded to
// nearest even; int8 as round(x / s) with s = max|x| / 127 written to *scale (ties to even,
// as torch.round: the engine's minillm.attention.kv_quant.quantize_int8, value for value).
static inline void put(const float* x, uint16_t* dst, float*, int64_t d) {
    for (int64_t i = 0; i < d; ++i) narrow(x[i], &dst[i]);
}
static inline void put(const float* x, int8_t* dst, float* scale, int64_t d) {
    float amax = 0.0f;
    for (int64_t i = 0; i < d; ++i) amax = std::fabs(x[i]) > amax ? std::fabs(x[i]) : amax;
    const float s = amax / 127.0f, safe = s > 0.0f ? s : 1.0f;
    *scale = s;
    for (int64_t i = 0; i < d; ++i) {
        const float r = std::nearbyint(x[i] / safe);
        dst[i] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
    }
}

// rope_store into a cache stored as C (bfloat16 below float32, or int8 with scales k_scale,
// v_scale [slots, hkv]): rope(k) rounded to T first, as the eager model computes it.
constexpr int64_t MAX_HEAD = 256;
template <typename T, typename C>
static void rope_store_kv(const T* q, const T* k, const T* v, int64_t ld, const T* cos,
                          const T* sin, T* q_out, C* k_cache, C* v_cache, float* k_scale,
                          float* v_scale, const int64_t* slots, int64_t n, int64_t hq,
                          int64_t hkv, int64_t d) {
    #pragma omp parallel for if (n * (hq + 2 * hkv) * d >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < n; ++r) {
        const T *c = cos + r * d, *s = sin + r * d;
        for (int64_t h = 0; h < hq; ++h)
            rotate(q + r * ld + h * d, c, s, q_out + (r * hq + h) * d, d);
        T rotated[MAX_HEAD];
        float x[MAX_HEAD];
        for (int64_t h = 0; h < hkv; ++h) {
            const int64_t at = slots[r] * hkv + h;              // [slots, hkv] index
            rotate(k + r * ld + h * d, c, s, rotated, d);
            for (int64_t i = 0; i < d; ++i) x[i] = widen(rotated[i]);
            put(x, k_cache + at * d, k_scale ? k_scale + at : nullptr, d);
            for (int64_t i = 0; i < d; ++i) x[i] = widen(v[r * ld + h * d + i]);
            put(x, v_cache + at * d, v_scale ? v_scale + at : nullptr, d);
        }
    }
}

#define KV_ENTRY(NAME, T, C)                                                                  \
extern "C" void rope_store_kv_##NAME(const void* q, const void* k, const void* v, int64_t ld, \
                                     const void* cos, const void* sin, void* q_out,          \
                                     void* k_cache, void* v_cache, float* k_scale,           \
                                     float* v_scale, const int64_t* slots, int64_t n,        \
                                     int64_t hq, int64_t hkv, int64_t d) {                   \
    rope_store_kv<T, C>((const T*)q, (const T*)k, (const T*)v, ld, (const T*)cos,          \
                        (const T*)sin, (T*)q_out, (C*)k_cache, (C*)v_cache, k_scale, v_scale,\
                        slots, n, hq, hkv, d);                                                \
}
KV_ENTRY(f32_kvbf16, float, uint16_t)
KV_ENTRY(f32_kvi8, float, int8_t)
KV_ENTRY(bf16_kvi8, uint16_t, int8_t)

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
