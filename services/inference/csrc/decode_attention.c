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

/* 16 floats: one AVX-512 register, two AVX2 ones; GCC's vector extension keeps accumulators declared as
 * such in registers, where arrays of floats spill to the stack */
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

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

/* Prefill attention: S query tokens per row, same grouping and masking rules, written so that no dot
 * product needs a horizontal sum. Per (row, kv head) the G*S queries of the group are transposed into
 * qt[d][j] (j = g*S + s, padded to a multiple of BLOCK); scores[w][j] = sum_d k[w][d] * qt[d][j]
 * accumulates BLOCK queries at once in registers; softmax runs down each column j; the output
 * out[j][d] = sum_w p[w][j] * v[w][d] again accumulates BLOCK queries per value element.
 *
 *   q      [B, H, S, D]          strides (qsb, qsh, qss, 1)
 *   mask_t [B, W, S] bytes       contiguous (the transposed [B, 1, S, W] mask); 0 = masked
 *   out    [B, S, H, D]          contiguous, the dtype of q
 * scratch holds D * J + W * J + 2 * J + 2 * W * D floats, J = G * S rounded up to BLOCK. A query with every column
 * masked (a left-padding token) gets zeros.
 */
#define BLOCK 64

#define DEFINE_PREFILL(NAME, T, LOAD, STORE)                                                              \
    int NAME(const T *q, const T *k, const T *v, const uint8_t *mask_t, T *out, int64_t B, int64_t H,    \
             int64_t KV, int64_t S, int64_t W, int64_t D, int64_t qsb, int64_t qsh, int64_t qss,         \
             int64_t ksb, int64_t ksh, int64_t ksw, int64_t vsb, int64_t vsh, int64_t vsw, float scale,  \
             float *scratch) {                                                                            \
        if (KV <= 0 || H % KV != 0 || D % 4 != 0) return -1;                                              \
        const int64_t G = H / KV, GS = G * S, J = (GS + BLOCK - 1) / BLOCK * BLOCK;                       \
        float *qt = scratch, *sc = scratch + D * J, *top = sc + W * J, *total = top + J;                  \
        float *kf = total + J, *vf = kf + W * D; /* the group's keys and values in float32 */            \
        for (int64_t b = 0; b < B; b++) {                                                                 \
            const uint8_t *mb = mask_t + b * W * S;                                                       \
            for (int64_t kh = 0; kh < KV; kh++) {                                                         \
                for (int64_t w = 0; w < W; w++) {                                                         \
                    const T *kr = k + b * ksb + kh * ksh + w * ksw, *vr = v + b * vsb + kh * vsh + w * vsw; \
                    for (int64_t d = 0; d < D; d++) kf[w * D + d] = LOAD(kr[d]);                          \
                    for (int64_t d = 0; d < D; d++) vf[w * D + d] = LOAD(vr[d]);                          \
                }                                                                                         \
                for (int64_t d = 0; d < D; d++)                                                           \
                    for (int64_t j = GS; j < J; j++) qt[d * J + j] = 0.0f;                                \
                for (int64_t g = 0; g < G; g++)                                                           \
                    for (int64_t s = 0; s < S; s++) {                                                     \
                        const T *qr = q + b * qsb + (kh * G + g) * qsh + s * qss;                         \
                        for (int64_t d = 0; d < D; d++) qt[d * J + g * S + s] = LOAD(qr[d]) * scale;      \
                    }                                                                                     \
                /* scores, masked */                                                                      \
                for (int64_t j = 0; j < J; j++) top[j] = -INFINITY;                                       \
                for (int64_t w0 = 0; w0 < W; w0 += 4) { /* 4 key rows x BLOCK queries in registers */     \
                    const int64_t n = W - w0 < 4 ? W - w0 : 4;                                            \
                    const float *kr[4];                                                                   \
                    for (int64_t r = 0; r < 4; r++) kr[r] = kf + (w0 + (r < n ? r : 0)) * D;              \
                    for (int64_t jb = 0; jb < J; jb += BLOCK) {                                           \
                        v16 a00 = {0}, a01 = {0}, a02 = {0}, a03 = {0}, a10 = {0}, a11 = {0}, a12 = {0};  \
                        v16 a13 = {0}, a20 = {0}, a21 = {0}, a22 = {0}, a23 = {0}, a30 = {0}, a31 = {0};  \
                        v16 a32 = {0}, a33 = {0};                                                         \
                        for (int64_t d = 0; d < D; d++) {                                                 \
                            const v16u *qd = (const v16u *)(qt + d * J + jb);                             \
                            const v16 q0 = qd[0], q1 = qd[1], q2 = qd[2], q3 = qd[3];                     \
                            const float k0 = kr[0][d], k1 = kr[1][d], k2 = kr[2][d], k3 = kr[3][d];       \
                            a00 += k0 * q0, a01 += k0 * q1, a02 += k0 * q2, a03 += k0 * q3;               \
                            a10 += k1 * q0, a11 += k1 * q1, a12 += k1 * q2, a13 += k1 * q3;               \
                            a20 += k2 * q0, a21 += k2 * q1, a22 += k2 * q2, a23 += k2 * q3;               \
                            a30 += k3 * q0, a31 += k3 * q1, a32 += k3 * q2, a33 += k3 * q3;               \
                        }                                                                                 \
                        const v16 rows[4][4] = {                                                          \
                            {a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}, {a30, a31, a32, a33}}; \
                        for (int64_t r = 0; r < n; r++)                                                   \
                            for (int64_t c = 0; c < 4; c++)                                               \
                                *(v16u *)(sc + (w0 + r) * J + jb + 16 * c) = rows[r][c];                  \
                    }                                                                                     \
                    for (int64_t w = w0; w < w0 + n; w++) {                                               \
                        const uint8_t *mw = mb + w * S;                                                   \
                        float *row = sc + w * J;                                                          \
                        for (int64_t g = 0; g < G; g++) {                                                 \
                            float *rg = row + g * S, *tg = top + g * S;                                   \
                            _Pragma("omp simd") for (int64_t s = 0; s < S; s++) {                         \
                                const float x = mw[s] ? rg[s] : -INFINITY;                                \
                                rg[s] = x;                                                                \
                                tg[s] = x > tg[s] ? x : tg[s];                                            \
                            }                                                                             \
                        }                                                                                 \
                    }                                                                                     \
                }                                                                                         \
                /* softmax weights down each column; masked entries weigh exactly 0 */                   \
                for (int64_t j = 0; j < J; j++) total[j] = 0.0f;                                          \
                for (int64_t w = 0; w < W; w++) {                                                         \
                    float *row = sc + w * J;                                                              \
                    _Pragma("omp simd") for (int64_t j = 0; j < GS; j++) {                                \
                        const float e =                                                                   \
                            row[j] == -INFINITY ? 0.0f : exp_nonpositive(row[j] - top[j]);                \
                        row[j] = e;                                                                       \
                        total[j] += e;                                                                    \
                    }                                                                                     \
                    for (int64_t j = GS; j < J; j++) row[j] = 0.0f;                                       \
                }                                                                                         \
                /* weighted values: out[j][d..d+3] over BLOCK queries at a time */                       \
                for (int64_t jb = 0; jb < J; jb += BLOCK) {                                               \
                    for (int64_t d = 0; d < D; d += 4) {                                                  \
                        v16 a00 = {0}, a01 = {0}, a02 = {0}, a03 = {0}, a10 = {0}, a11 = {0}, a12 = {0};  \
                        v16 a13 = {0}, a20 = {0}, a21 = {0}, a22 = {0}, a23 = {0}, a30 = {0}, a31 = {0};  \
                        v16 a32 = {0}, a33 = {0};                                                         \
                        for (int64_t w = 0; w < W; w++) {                                                 \
                            const float *vr = vf + w * D + d;                                             \
                            const float v0 = vr[0], v1 = vr[1], v2 = vr[2], v3 = vr[3];                   \
                            const v16u *pw = (const v16u *)(sc + w * J + jb);                             \
                            const v16 p0 = pw[0], p1 = pw[1], p2 = pw[2], p3 = pw[3];                     \
                            a00 += v0 * p0, a01 += v0 * p1, a02 += v0 * p2, a03 += v0 * p3;               \
                            a10 += v1 * p0, a11 += v1 * p1, a12 += v1 * p2, a13 += v1 * p3;               \
                            a20 += v2 * p0, a21 += v2 * p1, a22 += v2 * p2, a23 += v2 * p3;               \
                            a30 += v3 * p0, a31 += v3 * p1, a32 += v3 * p2, a33 += v3 * p3;               \
                        }                                                                                 \
                        float acc[4][BLOCK];                                                              \
                        const v16 cols[4][4] = {                                                          \
                            {a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}, {a30, a31, a32, a33}}; \
                        for (int64_t r = 0; r < 4; r++)                                                   \
                            for (int64_t c = 0; c < 4; c++) *(v16u *)(acc[r] + 16 * c) = cols[r][c];      \
                        for (int64_t i = 0; i < BLOCK && jb + i < GS; i++) {                              \
                            const int64_t j = jb + i, g = j / S, s = j % S;                               \
                            const float inv = total[j] > 0.0f ? 1.0f / total[j] : 0.0f;                   \
                            T *o = out + ((b * S + s) * H + kh * G + g) * D + d;                          \
                            for (int64_t r = 0; r < 4; r++) o[r] = STORE(acc[r][i] * inv);                \
                        }                                                                                 \
                    }                                                                                     \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        return 0;                                                                                         \
    }

DEFINE_PREFILL(prefill_attention_f32, float, LOAD_F32, STORE_F32)
DEFINE_PREFILL(prefill_attention_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
