/* One-token grouped-query attention over a KV cache, for the CPU decode step
 * (reflrl.engines.native_attention builds this file with the machine's C compiler and calls it).
 *
 * For every row b and key/value head h, the G query heads that share h attend to the columns
 * j < width[b] of that row's cache where mask[b, j] is set:
 *
 *     out[b, h, g] = sum_j softmax_j(scale * q[b, h, g] . k[b, h, j]) v[b, h, j]
 *
 * in float32 whatever the storage type (float32 or bfloat16), each (row, head) by one thread in a fixed
 * order: a row's result does not depend on the other rows of the call, nor on the thread count.
 * Columns that are masked out or beyond width[b] are never read (a slot's stale or uninitialised
 * columns cannot leak into a row). A row with no visible column gets zeros.
 *
 * Layouts (element strides; the last dimension is contiguous):
 *   q    [B, H, G, D] at q + b*q_sb + h*q_sh + g*D
 *   k, v [B, H, W, D] at k + b*kv_sb + h*kv_sh + j*D
 *   mask [B, W]       at mask + b*m_sb + j   (1 = attend)
 *   out  [B, H, G, D] contiguous
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GMAX 16
#define DMAX 256

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c;
    c.u = ((uint32_t)x) << 16;
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    union { uint32_t u; float f; } c;
    c.f = f;
    uint32_t u = c.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* exp(x) for x <= 0, to about 2 ulp: 2^(x log2 e) = 2^n 2^f, n = round(.), |f| <= 1/2, 2^f by a
 * degree-7 polynomial. Written branch-free so that the compiler vectorises the loops that call it. */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f;
    float n = rintf(t); /* round to nearest */
    float f = t - n;
    float p = 1.53533545e-4f;
    p = p * f + 1.33989027e-3f;
    p = p * f + 9.61812911e-3f;
    p = p * f + 5.55041086e-2f;
    p = p * f + 2.40226507e-1f;
    p = p * f + 6.93147182e-1f;
    p = p * f + 1.0f;
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * c.f;
}

#define DEFINE_TASK(NAME, T, LOAD, STORE)                                                              \
static inline __attribute__((always_inline)) void NAME(const T *q, const T *k, const T *v, const uint8_t *m, \
                 int w, T *out, int G, int D,                                                          \
                 float scale, float *s) {                                                              \
    float qf[GMAX * DMAX], acc[GMAX * DMAX], kf[DMAX], mx[GMAX], sum[GMAX];                            \
    for (int i = 0; i < G * D; i++) qf[i] = LOAD(q[i]) * scale;                                        \
    for (int g = 0; g < G; g++) { mx[g] = -INFINITY; sum[g] = 0.0f; }                                  \
    int seen = 0;                                                                                      \
    for (int j = 0; j < w; j++) {                                                                      \
        if (!m[j]) continue;                                                                           \
        seen = 1;                                                                                      \
        const T *kj = k + (int64_t)j * D;                                                              \
        for (int d = 0; d < D; d++) kf[d] = LOAD(kj[d]);                                               \
        for (int g = 0; g < G; g++) {                                                                  \
            const float *qg = qf + g * D;                                                              \
            float a = 0.0f;                                                                            \
            for (int d = 0; d < D; d++) a += qg[d] * kf[d];                                            \
            s[g * w + j] = a;                                                                          \
            mx[g] = a > mx[g] ? a : mx[g];                                                             \
        }                                                                                              \
    }                                                                                                  \
    if (!seen) {                                                                                       \
        for (int i = 0; i < G * D; i++) out[i] = STORE(0.0f);                                          \
        return;                                                                                        \
    }                                                                                                  \
    for (int g = 0; g < G; g++) {                                                                      \
        float *sg = s + g * w, mg = mx[g], t = 0.0f;                                                   \
        for (int j = 0; j < w; j++) {                                                                  \
            float e = m[j] ? exp_neg(sg[j] - mg) : 0.0f;                                               \
            sg[j] = e;                                                                                 \
            t += e;                                                                                    \
        }                                                                                              \
        sum[g] = t;                                                                                    \
    }                                                                                                  \
    memset(acc, 0, sizeof(float) * (size_t)(G * D));                                                   \
    for (int j = 0; j < w; j++) {                                                                      \
        if (!m[j]) continue;                                                                           \
        const T *vj = v + (int64_t)j * D;                                                              \
        for (int d = 0; d < D; d++) kf[d] = LOAD(vj[d]);                                               \
        for (int g = 0; g < G; g++) {                                                                  \
            float p = s[g * w + j];                                                                    \
            float *ag = acc + g * D;                                                                   \
            for (int d = 0; d < D; d++) ag[d] += p * kf[d];                                            \
        }                                                                                              \
    }                                                                                                  \
    for (int g = 0; g < G; g++) {                                                                      \
        float r = 1.0f / sum[g];                                                                       \
        for (int d = 0; d < D; d++) out[g * D + d] = STORE(acc[g * D + d] * r);                        \
    }                                                                                                  \
}

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
DEFINE_TASK(task_f32, float, LOAD_F32, STORE_F32)
DEFINE_TASK(task_bf16, uint16_t, bf16_to_f32, f32_to_bf16)

/* The same tasks with G and D fixed at SmolLM2's 3 and 64: the compiler unrolls and vectorises them. */
static void task_f32_3x64(const float *q, const float *k, const float *v, const uint8_t *m, int w, float *out,
                          float scale, float *s) {
    task_f32(q, k, v, m, w, out, 3, 64, scale, s);
}
static void task_bf16_3x64(const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint8_t *m, int w,
                           uint16_t *out, float scale, float *s) {
    task_bf16(q, k, v, m, w, out, 3, 64, scale, s);
}

#define DEFINE_ENTRY(NAME, T, TASK, TASK_3x64)                                                         \
int NAME(const T *q, int64_t q_sb, int64_t q_sh, const T *k, const T *v, int64_t kv_sb, int64_t kv_sh,   \
         const uint8_t *mask, int64_t m_sb, const int32_t *width, T *out, int B, int H, int G, int D,    \
         float scale, int threads) {                                                                   \
    if (G < 1 || G > GMAX || D < 1 || D > DMAX) return 1;                                              \
    int wmax = 1;                                                                                      \
    for (int b = 0; b < B; b++) wmax = width[b] > wmax ? width[b] : wmax;                              \
    int failed = 0;                                                                                    \
    _Pragma("omp parallel num_threads(threads) reduction(|:failed)")                                   \
    {                                                                                                  \
        float *s = (float *)malloc(sizeof(float) * (size_t)G * (size_t)wmax);                          \
        if (!s) failed = 1;                                                                            \
        _Pragma("omp for schedule(dynamic, 1)")                                                        \
        for (int t = 0; t < B * H; t++) {                                                              \
            if (!s) continue;                                                                          \
            int b = t / H, h = t % H, w = width[b];                                                    \
            const T *qt = q + b * q_sb + h * q_sh;                                                     \
            const T *kt = k + b * kv_sb + h * kv_sh, *vt = v + b * kv_sb + h * kv_sh;                  \
            T *ot = out + (int64_t)t * G * D;                                                          \
            if (w <= 0) { memset(ot, 0, sizeof(T) * (size_t)(G * D)); continue; }                      \
            if (G == 3 && D == 64) TASK_3x64(qt, kt, vt, mask + b * m_sb, w, ot, scale, s);            \
            else TASK(qt, kt, vt, mask + b * m_sb, w, ot, G, D, scale, s);                             \
        }                                                                                              \
        free(s);                                                                                       \
    }                                                                                                  \
    return failed ? 2 : 0;                                                                             \
}

DEFINE_ENTRY(reflrl_decode_attention_f32, float, task_f32, task_f32_3x64)
DEFINE_ENTRY(reflrl_decode_attention_bf16, uint16_t, task_bf16, task_bf16_3x64)
