/* y = x W^T (+ bias) for the CPU generation's products, over weights laid out once for this kernel
 * (reflrl.engines.native_matmul builds this file with decode_attention.c and calls it).
 *
 *   x    [M, K]  row stride xs, float32 or bfloat16 (the weight's dtype)
 *   W    [N, K]  stored as blocks of BLOCK = 16 outputs: for float32 [ceil(N/32)*2][K][16]; for bfloat16
 *                [ceil(N/32)*2][K/2][16][2] (pairs of consecutive k, as AVX512-BF16's dot product takes them);
 *                the outputs past N are zeros
 *   bias [N]     float32, or NULL
 *   y    [M, N]  row stride ys, the weight's dtype (bfloat16: rounded to nearest even once, from float32)
 *
 * Every output is a float32 sum over k in increasing order (bfloat16: two products a step), whatever M,
 * the other rows or the thread count: a row's result does not depend on the rows beside it. The threads
 * (native_parallel.c) share the blocks of 32 outputs; each goes through the rows 8 (AVX-512) at a time, so the block's
 * weights are read from memory once per call and reused from the cache for every row.
 *
 * float32 needs AVX-512 or AVX2 with FMA, bfloat16 AVX512-BF16; each is built only where the compiler
 * targets it (-march=native; reflrl_matmul_support says which).
 */
#include <stdint.h>
#include <string.h>

#include "native_parallel.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define HAVE_BF16 1
#else
#define HAVE_BF16 0
#endif

#define BLOCK 16
#define NV 2 /* blocks of 16 outputs per task */

#if defined(__AVX512F__)
#define HAVE_F32 1
#define MB_MAX 8
#define LANES 16
typedef __m512 vf;
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VSET1 _mm512_set1_ps
#define VFMA _mm512_fmadd_ps
#define VZERO _mm512_setzero_ps
#elif defined(__AVX2__) && defined(__FMA__)
#define HAVE_F32 1
#define MB_MAX 2 /* 16 vector registers: 2 rows x 2 blocks x 2 halves of accumulators */
#define LANES 8
typedef __m256 vf;
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VSET1 _mm256_set1_ps
#define VFMA _mm256_fmadd_ps
#define VZERO _mm256_setzero_ps
#else
#define HAVE_F32 0
#define MB_MAX 8
#endif

/* 1: float32, 2: bfloat16 (bits) */
int reflrl_matmul_support(void) { return (HAVE_F32 ? 1 : 0) | (HAVE_BF16 ? 2 : 0); }

#if HAVE_F32
#define VPT (NV * BLOCK / LANES) /* vectors of outputs per task */
static inline void f32_task(const float *x, int64_t xs, const float *w0, int K, int n0, int N,
                            float *y, int64_t ys, const float *bias, int mb) {
    vf acc[MB_MAX][VPT];
    for (int m = 0; m < MB_MAX; m++)
        for (int v = 0; v < VPT; v++) acc[m][v] = VZERO();
    /* vector v of the task: block v / (BLOCK / LANES), lanes (v % (BLOCK / LANES)) * LANES.. of it */
#define F32_STEP(MB)                                                                                   \
    for (int k = 0; k < K; k++) {                                                                      \
        vf w[VPT];                                                                                     \
        for (int v = 0; v < VPT; v++)                                                                  \
            w[v] = VLOAD(w0 + ((int64_t)(v / (BLOCK / LANES)) * K + k) * BLOCK + (v % (BLOCK / LANES)) * LANES); \
        for (int m = 0; m < MB; m++) {                                                                 \
            vf xb = VSET1(x[m * xs + k]);                                                              \
            for (int v = 0; v < VPT; v++) acc[m][v] = VFMA(xb, w[v], acc[m][v]);                       \
        }                                                                                              \
    }
    switch (mb) {
    case 1: F32_STEP(1) break;
#if MB_MAX == 8
    case 2: F32_STEP(2) break;
    case 3: F32_STEP(3) break;
    case 4: F32_STEP(4) break;
    case 5: F32_STEP(5) break;
    case 6: F32_STEP(6) break;
    case 7: F32_STEP(7) break;
#endif
    default: F32_STEP(MB_MAX) break;
    }
    for (int m = 0; m < mb; m++) {
        float out[NV * BLOCK];
        for (int v = 0; v < VPT; v++) VSTORE(out + v * LANES, acc[m][v]);
        int left = N - n0;
        if (left > NV * BLOCK) left = NV * BLOCK;
        if (bias)
            for (int i = 0; i < left; i++) out[i] += bias[n0 + i];
        memcpy(y + m * ys + n0, out, sizeof(float) * (left > 0 ? left : 0));
    }
}
#endif

/* one call's arguments, for its threads */
struct mm_args {
    const void *x, *w;
    const float *bias;
    void *y;
    int64_t xs, ys;
    int M, N, K;
};

#if HAVE_F32
static void f32_work(void *c, int tid, int nthreads) {
    const struct mm_args *a = c;
    int lo, hi;
    reflrl_share((a->N + BLOCK * NV - 1) / (BLOCK * NV), tid, nthreads, &lo, &hi);
    for (int t = lo; t < hi; t++) {
        const float *w0 = (const float *)a->w + (int64_t)t * NV * a->K * BLOCK;
        for (int m = 0; m < a->M; m += MB_MAX)
            f32_task((const float *)a->x + m * a->xs, a->xs, w0, a->K, t * BLOCK * NV, a->N,
                     (float *)a->y + m * a->ys, a->ys, a->bias, a->M - m < MB_MAX ? a->M - m : MB_MAX);
    }
}
#endif

int reflrl_matmul_f32(const float *x, int64_t xs, const float *w, const float *bias, float *y, int64_t ys,
                      int M, int N, int K, int threads) {
#if HAVE_F32
    struct mm_args a = {x, w, bias, y, xs, ys, M, N, K};
    reflrl_parallel(f32_work, &a, threads);
    return 0;
#else
    (void)x; (void)xs; (void)w; (void)bias; (void)y; (void)ys; (void)M; (void)N; (void)K; (void)threads;
    return 2;
#endif
}

#if HAVE_BF16
static inline void bf16_task(const uint16_t *x, int64_t xs, const uint16_t *w0, int K, int n0, int N,
                             uint16_t *y, int64_t ys, const float *bias, int mb) {
    __m512 acc[MB_MAX][NV];
    for (int m = 0; m < MB_MAX; m++)
        for (int v = 0; v < NV; v++) acc[m][v] = _mm512_setzero_ps();
    const int KP = K / 2;
#define BF16_STEP(MB)                                                                                  \
    for (int kp = 0; kp < KP; kp++) {                                                                  \
        __m512bh w[NV];                                                                                \
        for (int v = 0; v < NV; v++)                                                                   \
            w[v] = (__m512bh)_mm512_loadu_si512(w0 + ((int64_t)v * KP + kp) * 2 * BLOCK);             \
        for (int m = 0; m < MB; m++) {                                                                 \
            int32_t pair;                                                                              \
            memcpy(&pair, x + m * xs + 2 * kp, sizeof pair);                                           \
            __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);                                           \
            for (int v = 0; v < NV; v++) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xb, w[v]);           \
        }                                                                                              \
    }
    switch (mb) {
    case 1: BF16_STEP(1) break;
    case 2: BF16_STEP(2) break;
    case 3: BF16_STEP(3) break;
    case 4: BF16_STEP(4) break;
    case 5: BF16_STEP(5) break;
    case 6: BF16_STEP(6) break;
    case 7: BF16_STEP(7) break;
    default: BF16_STEP(8) break;
    }
    for (int m = 0; m < mb; m++)
        for (int v = 0; v < NV; v++) {
            int n = n0 + BLOCK * v, left = N - n;
            if (left <= 0) break;
            __m512 a = acc[m][v];
            __mmask16 keep = left >= BLOCK ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
            if (bias) a = _mm512_add_ps(a, _mm512_maskz_loadu_ps(keep, bias + n));
            _mm256_mask_storeu_epi16(y + m * ys + n, keep, (__m256i)_mm512_cvtneps_pbh(a));
        }
}
#endif

#if HAVE_BF16
static void bf16_work(void *c, int tid, int nthreads) {
    const struct mm_args *a = c;
    int lo, hi;
    reflrl_share((a->N + BLOCK * NV - 1) / (BLOCK * NV), tid, nthreads, &lo, &hi);
    for (int t = lo; t < hi; t++) {
        const uint16_t *w0 = (const uint16_t *)a->w + (int64_t)t * NV * a->K * BLOCK;
        for (int m = 0; m < a->M; m += MB_MAX)
            bf16_task((const uint16_t *)a->x + m * a->xs, a->xs, w0, a->K, t * BLOCK * NV, a->N,
                      (uint16_t *)a->y + m * a->ys, a->ys, a->bias, a->M - m < MB_MAX ? a->M - m : MB_MAX);
    }
}
#endif

int reflrl_matmul_bf16(const uint16_t *x, int64_t xs, const uint16_t *w, const float *bias, uint16_t *y,
                       int64_t ys, int M, int N, int K, int threads) {
#if HAVE_BF16
    if (K % 2) return 1;
    struct mm_args a = {x, w, bias, y, xs, ys, M, N, K};
    reflrl_parallel(bf16_work, &a, threads);
    return 0;
#else
    (void)x; (void)xs; (void)w; (void)bias; (void)y; (void)ys; (void)M; (void)N; (void)K; (void)threads;
    return 2;
#endif
}
