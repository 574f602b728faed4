/* Decode attention of the CPU inference server: one query token per row over a masked KV window, grouped
 * query heads, float32 accumulation, in one pass over the keys and one over the values.
 *
 * services/inference/kernels.py compiles this file with the system C compiler (-O3 -march=native) into
 * $LEAFE_CACHE/kernels and calls it through ctypes; it checks the result against an exact reference before
 * serving with it. Why a kernel: the same attention as torch matmuls is 48 small matmuls per layer plus a
 * float32 copy of the keys and values per step (~23 ms of a 53 ms decode step, reading the KV at ~10 GB/s);
 * here each key and value row is read once, converted in registers, and used by every query head of its
 * group.
 *
 * Shapes (element strides given by the caller, the last dimension contiguous):
 *   q    [B, H, D]             contiguous
 *   k, v [B, KV, W, D]         strides (sb, sh, sw, 1)
 *   mask [B, W] bytes or NULL  strides (msb, msw); 0 = masked column
 *   out  [B, H, D]             contiguous, the dtype of q
 * Head h reads KV head h / (H / KV) (transformers' repeat_kv). A row with every column masked gets zeros.
 * scratch holds (H / KV) * W floats.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_D 256
#define MAX_G 32

typedef union {
    uint32_t u;
    float f;
} bits32;

static inline float bf16_to_f32(uint16_t h) {
    bits32 x;
    x.u = (uint32_t)h << 16;
    return x.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch */
    bits32 x;
    x.f = f;
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40u); /* NaN stays NaN */
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

/* exp(x) for x <= 0 (scores minus their max): 2^(x log2 e) split into 2^i * 2^f, 2^f by a degree-6
 * polynomial (relative error < 2e-7); written so that the loop over columns vectorizes. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f;
    float i = floorf(t);
    float f = t - i;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    bits32 scale;
    scale.u = (uint32_t)((int32_t)i + 127) << 23;
    return p * scale.f;
}

#define DEFINE_ATTENTION(NAME, T, LOAD, STORE)                                                            \
    static inline __attribute__((always_inline)) void NAME##_body(                                        \
        const T *q, const T *k, const T *v, const uint8_t *mask, T *out, int64_t B, int64_t H,           \
        int64_t KV, int64_t W, const int64_t D, const int64_t G, int64_t ksb, int64_t ksh, int64_t ksw, \
        int64_t vsb, int64_t vsh, int64_t vsw, int64_t msb, int64_t msw, float scale, float *scratch) {  \
        float qf[MAX_G][MAX_D];                                                                           \
        float acc[MAX_G][MAX_D];                                                                          \
        float row[MAX_D];                                                                                 \
        float top[MAX_G], total[MAX_G];                                                                   \
        for (int64_t b = 0; b < B; b++) {                                                                 \
            const uint8_t *m = mask ? mask + b * msb : NULL;                                              \
            for (int64_t kh = 0; kh < KV; kh++) {                                                         \
                const T *kb = k + b * ksb + kh * ksh;                                                     \
                const T *vb = v + b * vsb + kh * vsh;                                                     \
                for (int64_t g = 0; g < G; g++) {                                                         \
                    const T *qh = q + (b * H + kh * G + g) * D;                                           \
                    for (int64_t d = 0; d < D; d++) qf[g][d] = LOAD(qh[d]) * scale;                       \
                    top[g] = -INFINITY;                                                                   \
                }                                                                                         \
                /* scores: one pass over the keys, every head of the group per key row */                 \
                for (int64_t w = 0; w < W; w++) {                                                         \
                    if (m && !m[w * msw]) {                                                               \
                        for (int64_t g = 0; g < G; g++) scratch[g * W + w] = -INFINITY;                   \
                        continue;                                                                         \
                    }                                                                                     \
                    const T *kr = kb + w * ksw;                                                           \
                    for (int64_t d = 0; d < D; d++) row[d] = LOAD(kr[d]);                                 \
                    for (int64_t g = 0; g < G; g++) {                                                     \
                        float s = 0.0f;                                                                   \
                        _Pragma("omp simd reduction(+ : s)") for (int64_t d = 0; d < D; d++) s +=         \
                            qf[g][d] * row[d];                                                            \
                        scratch[g * W + w] = s;                                                           \
                        top[g] = s > top[g] ? s : top[g];                                                 \
                    }                                                                                     \
                }                                                                                         \
                /* softmax weights (unnormalized); masked columns weigh exactly 0 */                     \
                for (int64_t g = 0; g < G; g++) {                                                         \
                    float *s = scratch + g * W, mx = top[g], sum = 0.0f;                                  \
                    if (mx == -INFINITY) {                                                                \
                        memset(s, 0, (size_t)W * sizeof(float));                                          \
                    } else {                                                                              \
                        _Pragma("omp simd reduction(+ : sum)") for (int64_t w = 0; w < W; w++) {          \
                            float e = s[w] == -INFINITY ? 0.0f : exp_nonpositive(s[w] - mx);              \
                            s[w] = e;                                                                     \
                            sum += e;                                                                     \
                        }                                                                                 \
                    }                                                                                     \
                    total[g] = sum;                                                                       \
                    memset(acc[g], 0, (size_t)D * sizeof(float));                                         \
                }                                                                                         \
                /* weighted values: one pass over the value rows */                                       \
                for (int64_t w = 0; w < W; w++) {                                                         \
                    if (m && !m[w * msw]) continue;                                                       \
                    const T *vr = vb + w * vsw;                                                           \
                    for (int64_t d = 0; d < D; d++) row[d] = LOAD(vr[d]);                                 \
                    for (int64_t g = 0; g < G; g++) {                                                     \
                        const float p = scratch[g * W + w];                                               \
                        _Pragma("omp simd") for (int64_t d = 0; d < D; d++) acc[g][d] += p * row[d];      \
                    }                                                                                     \
                }                                                                                         \
                for (int64_t g = 0; g < G; g++) {                                                         \
                    T *o = out + (b * H + kh * G + g) * D;                                                \
                    const float inv = total[g] > 0.0f ? 1.0f / total[g] : 0.0f;                           \
                    for (int64_t d = 0; d < D; d++) o[d] = STORE(acc[g][d] * inv);                        \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
    /* head_dim and group size as constants where models have them: the compiler unrolls those loops */  \
    int NAME(const T *q, const T *k, const T *v, const uint8_t *mask, T *out, int64_t B, int64_t H,      \
             int64_t KV, int64_t W, int64_t D, int64_t ksb, int64_t ksh, int64_t ksw, int64_t vsb,       \
             int64_t vsh, int64_t vsw, int64_t msb, int64_t msw, float scale, float *scratch) {          \
        if (KV <= 0 || H % KV != 0 || D > MAX_D || H / KV > MAX_G) return -1;                            \
        const int64_t G = H / KV;                                                                         \
        if (D == 64 && G == 3)                                                                            \
            NAME##_body(q, k, v, mask, out, B, H, KV, W, 64, 3, ksb, ksh, ksw, vsb, vsh, vsw, msb, msw,  \
                        scale, scratch);                                                                  \
        else if (D == 64)                                                                                 \
            NAME##_body(q, k, v, mask, out, B, H, KV, W, 64, G, ksb, ksh, ksw, vsb, vsh, vsw, msb, msw,  \
                        scale, scratch);                                                                  \
        else if (D == 128)                                                                                \
            NAME##_body(q, k, v, mask, out, B, H, KV, W, 128, G, ksb, ksh, ksw, vsb, vsh, vsw, msb, msw, \
                        scale, scratch);                                                                  \
        else                                                                                              \
            NAME##_body(q, k, v, mask, out, B, H, KV, W, D, G, ksb, ksh, ksw, vsb, vsh, vsw, msb, msw,   \
                        scale, scratch);                                                                  \
        return 0;                                                                                         \
    }

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
DEFINE_ATTENTION(decode_attention_f32, float, LOAD_F32, STORE_F32)
DEFINE_ATTENTION(decode_attention_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
