/* The native kernels' threads (native_parallel.c): reflrl_parallel(fn, ctx, n) runs fn(ctx, tid, n) on
 * n threads, tid = 0 on the caller, and returns when all have returned.
 *
 * The decode step calls a kernel a few hundred times, each call a few to a few hundred microseconds of
 * work. An OpenMP parallel region pays a wake-up of its sleeping workers at every call when threads sleep
 * while they wait (OMP_WAIT_POLICY=PASSIVE, which reflrl sets so that a background process does not
 * stall PyTorch's barriers), and more when the calling thread is not the one that started OpenMP (the
 * decode loop runs in an executor thread): tens of microseconds a call on the machines measured. These
 * workers spin for a short while after each job (the next call of a decode step comes within
 * microseconds), then sleep on a futex: an idle process holds no core. */
#ifndef REFLRL_NATIVE_PARALLEL_H
#define REFLRL_NATIVE_PARALLEL_H

typedef void (*reflrl_task_fn)(void *ctx, int tid, int nthreads);

void reflrl_parallel(reflrl_task_fn fn, void *ctx, int nthreads);

/* [*lo, *hi): the share of items [0, n) of thread tid among nthreads (contiguous, as OpenMP's static) */
static inline void reflrl_share(int n, int tid, int nthreads, int *lo, int *hi) {
    int per = n / nthreads, extra = n % nthreads;
    *lo = tid * per + (tid < extra ? tid : extra);
    *hi = *lo + per + (tid < extra ? 1 : 0);
}

#endif
