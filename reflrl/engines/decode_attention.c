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
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_parallel.h"

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

/* One call's arguments, for its threads (the plain attention's or the fused rotary one's). */
struct att_args {
    const void *q, *qkv, *cos, *sin;
    const int64_t *col;
    void *k, *v, *out;
    const uint8_t *mask;
    const int32_t *width;
    int64_t q_sb, q_sh, qkv_sb, cs_sb, kv_sb, kv_sh, m_sb;
    int B, H, G, D, wmax;
    float scale;
    atomic_int next, failed;
};

static void att_args_init(struct att_args *A) {
    int wmax = 1;
    for (int b = 0; b < A->B; b++) wmax = A->width[b] > wmax ? A->width[b] : wmax;
    A->wmax = wmax;
    atomic_init(&A->next, 0);
    atomic_init(&A->failed, 0);
}

/* The (row, key/value head) tasks of one call shared among the threads (native_parallel.c), each taking
 * the next task when done with one, each with its own scores buffer; the body runs for each live task with
 * b, h, w (the row's width), kt, vt (its cache), ot (its output), s (the buffer) and the call's arguments
 * in scope (the macro's last arguments); idle rows get zeros. Defines WORK, the threads' function. */
#define EACH_ROW_HEAD(WORK, T, ...)                                                                    \
static void WORK(void *ctx, int tid, int nthreads) {                                                   \
    struct att_args *A = ctx;                                                                          \
    (void)tid; (void)nthreads;                                                                         \
    const T *q = A->q, *qkv = A->qkv, *cos = A->cos, *sin = A->sin;                                    \
    const int64_t *col = A->col;                                                                       \
    T *k = A->k, *v = A->v, *out = A->out;                                                             \
    const uint8_t *mask = A->mask;                                                                     \
    const int32_t *width = A->width;                                                                   \
    int64_t q_sb = A->q_sb, q_sh = A->q_sh, qkv_sb = A->qkv_sb, cs_sb = A->cs_sb, kv_sb = A->kv_sb,    \
            kv_sh = A->kv_sh, m_sb = A->m_sb;                                                          \
    int H = A->H, G = A->G, D = A->D;                                                                  \
    float scale = A->scale;                                                                            \
    (void)q; (void)qkv; (void)cos; (void)sin; (void)col; (void)q_sb; (void)q_sh; (void)qkv_sb;         \
    (void)cs_sb;                                                                                       \
    float *s = (float *)malloc(sizeof(float) * (size_t)G * (size_t)A->wmax);                           \
    if (!s) { atomic_store(&A->failed, 1); return; }                                                   \
    for (;;) {                                                                                         \
        int t = atomic_fetch_add(&A->next, 1);                                                         \
        if (t >= A->B * H) break;                                                                      \
        int b = t / H, h = t % H, w = width[b];                                                        \
        T *kt = k + b * kv_sb + h * kv_sh, *vt = v + b * kv_sb + h * kv_sh;                            \
        T *ot = out + (int64_t)t * G * D;                                                              \
        if (w <= 0) { memset(ot, 0, sizeof(T) * (size_t)(G * D)); continue; }                          \
        __VA_ARGS__                                                                                    \
    }                                                                                                  \
    free(s);                                                                                           \
}

#define DEFINE_ENTRY(NAME, T, TASK, TASK_3x64)                                                         \
EACH_ROW_HEAD(NAME##_work, T,                                                                          \
    const T *qt = q + b * q_sb + h * q_sh;                                                             \
    if (G == 3 && D == 64) TASK_3x64(qt, kt, vt, mask + b * m_sb, w, ot, scale, s);                    \
    else TASK(qt, kt, vt, mask + b * m_sb, w, ot, G, D, scale, s);)                                    \
int NAME(const T *q, int64_t q_sb, int64_t q_sh, const T *k, const T *v, int64_t kv_sb, int64_t kv_sh,   \
         const uint8_t *mask, int64_t m_sb, const int32_t *width, T *out, int B, int H, int G, int D,    \
         float scale, int threads) {                                                                   \
    if (G < 1 || G > GMAX || D < 1 || D > DMAX) return 1;                                              \
    struct att_args A = {.q = q, .k = (void *)k, .v = (void *)v, .out = out, .mask = mask,              \
                         .width = width, .q_sb = q_sb, .q_sh = q_sh, .kv_sb = kv_sb, .kv_sh = kv_sh,    \
                         .m_sb = m_sb, .B = B, .H = H, .G = G, .D = D, .scale = scale};                \
    att_args_init(&A);                                                                                 \
    reflrl_parallel(NAME##_work, &A, threads);                                                         \
    return atomic_load(&A.failed) ? 2 : 0;                                                             \
}

DEFINE_ENTRY(reflrl_decode_attention_f32, float, task_f32, task_f32_3x64)
DEFINE_ENTRY(reflrl_decode_attention_bf16, uint16_t, task_bf16, task_bf16_3x64)

/* ------------------------------------------------------------------------------------------------
 * The decode step's rotary embedding and cache write fused with the attention above: per row, the
 * q/k/v projection's output [heads + 2 kv heads, D] (q heads first, then k, then v), the row's cos and
 * sin [D]; the row's rotated key and its value are written to column col[b] of its cache, its query heads
 * rotated, and the attention runs as above (over columns < width[b], col[b] included). The rotation is
 * transformers' apply_rotary_pos_emb in the storage type: x*cos + rotate_half(x)*sin, each product and
 * the sum rounded to T. Rows with width 0 (idle) write nothing and get zeros.
 *   qkv [B, (H*G + 2H) * D] at qkv + b*qkv_sb;  cos, sin [B, D] at cos + b*cs_sb;  col [B]
 */
#define DEFINE_ROPE(NAME, T, LOAD, STORE)                                                              \
static inline __attribute__((always_inline)) void NAME(const T *x, const T *c, const T *s, T *out,       \
                                                      int D) {                                        \
    int half = D / 2;                                                                                  \
    for (int d = 0; d < D; d++) {                                                                      \
        float r = d < half ? -LOAD(x[d + half]) : LOAD(x[d - half]);                                   \
        float a = LOAD(STORE(LOAD(x[d]) * LOAD(c[d])));                                                \
        float b = LOAD(STORE(r * LOAD(s[d])));                                                         \
        out[d] = STORE(a + b);                                                                         \
    }                                                                                                  \
}

DEFINE_ROPE(rope_f32, float, LOAD_F32, STORE_F32)
DEFINE_ROPE(rope_bf16, uint16_t, bf16_to_f32, f32_to_bf16)

#define DEFINE_ROPE_ENTRY(NAME, T, ROPE, TASK, TASK_3x64)                                              \
EACH_ROW_HEAD(NAME##_work, T,                                                                          \
    const T *row = qkv + b * qkv_sb, *c = cos + b * cs_sb, *sn = sin + b * cs_sb;                      \
    ROPE(row + (int64_t)(H * G + h) * D, c, sn, kt + col[b] * D, D);                                   \
    memcpy(vt + col[b] * D, row + (int64_t)(H * G + H + h) * D, sizeof(T) * (size_t)D);                \
    T qr[GMAX * DMAX];                                                                                 \
    for (int g = 0; g < G; g++) ROPE(row + (int64_t)(h * G + g) * D, c, sn, qr + g * D, D);            \
    if (G == 3 && D == 64) TASK_3x64(qr, kt, vt, mask + b * m_sb, w, ot, scale, s);                    \
    else TASK(qr, kt, vt, mask + b * m_sb, w, ot, G, D, scale, s);)                                    \
int NAME(const T *qkv, int64_t qkv_sb, const T *cos, const T *sin, int64_t cs_sb, const int64_t *col,   \
         T *k, T *v, int64_t kv_sb, int64_t kv_sh, const uint8_t *mask, int64_t m_sb,                   \
         const int32_t *width, T *out, int B, int H, int G, int D, float scale, int threads) {          \
    if (G < 1 || G > GMAX || D < 2 || D > DMAX || D % 2) return 1;                                     \
    struct att_args A = {.qkv = qkv, .cos = cos, .sin = sin, .col = col, .k = k, .v = v, .out = out,    \
                         .mask = mask, .width = width, .qkv_sb = qkv_sb, .cs_sb = cs_sb, .kv_sb = kv_sb, \
                         .kv_sh = kv_sh, .m_sb = m_sb, .B = B, .H = H, .G = G, .D = D, .scale = scale}; \
    att_args_init(&A);                                                                                 \
    reflrl_parallel(NAME##_work, &A, threads);                                                         \
    return atomic_load(&A.failed) ? 2 : 0;                                                             \
}

DEFINE_ROPE_ENTRY(reflrl_decode_rope_attention_f32, float, rope_f32, task_f32, task_f32_3x64)
DEFINE_ROPE_ENTRY(reflrl_decode_rope_attention_bf16, uint16_t, rope_bf16, task_bf16, task_bf16_3x64)

/* ------------------------------------------------------------------------------------------------
 * transformers' LlamaRMSNorm on rows of type T: y = x * rsqrt(mean(x^2) + eps) in float32, rounded to
 * T, then weight * y rounded to T.   x [B, N] at x + b*x_sb;  w [N];  out [B, N] contiguous
 */
struct rms_args {
    const void *x, *w;
    void *out;
    int64_t x_sb;
    int B, N;
    float eps;
};

#define RMS_PARALLEL_MIN 16384 /* elements below which one thread does it all (no hand-over) */

#define DEFINE_RMS(NAME, T, LOAD, STORE)                                                               \
static void NAME##_work(void *ctx, int tid, int nthreads) {                                            \
    const struct rms_args *a = ctx;                                                                    \
    const T *x = a->x, *w = a->w;                                                                      \
    T *out = a->out;                                                                                   \
    int N = a->N, lo, hi;                                                                              \
    reflrl_share(a->B, tid, nthreads, &lo, &hi);                                                       \
    for (int b = lo; b < hi; b++) {                                                                    \
        const T *xb = x + b * a->x_sb;                                                                 \
        T *ob = out + (int64_t)b * N;                                                                  \
        float ss = 0.0f;                                                                               \
        for (int i = 0; i < N; i++) { float f = LOAD(xb[i]); ss += f * f; }                            \
        float r = 1.0f / sqrtf(ss / (float)N + a->eps);                                                \
        for (int i = 0; i < N; i++) ob[i] = STORE(LOAD(w[i]) * LOAD(STORE(LOAD(xb[i]) * r)));         \
    }                                                                                                  \
}                                                                                                      \
int NAME(const T *x, int64_t x_sb, const T *w, T *out, int B, int N, float eps, int threads) {          \
    struct rms_args a = {x, w, out, x_sb, B, N, eps};                                                  \
    reflrl_parallel(NAME##_work, &a, B > 1 && (int64_t)B * N >= RMS_PARALLEL_MIN ? threads : 1);       \
    return 0;                                                                                          \
}

DEFINE_RMS(reflrl_rms_norm_f32, float, LOAD_F32, STORE_F32)
DEFINE_RMS(reflrl_rms_norm_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
