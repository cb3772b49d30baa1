/* The native kernels' worker threads (see native_parallel.h). One job at a time: concurrent callers take
 * turns, and a call from inside a job runs on its caller alone. Workers are started at the first job that
 * needs them and live as long as the process (a forked child starts with none). After a job a worker
 * spins for SPIN_NS, then sleeps on a futex until the next job. */
#define _GNU_SOURCE
#include "native_parallel.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_WORKERS 255
#define SPIN_NS 200000L /* 0.2 ms: longer than the gap between a decode step's calls */

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int started;                 /* workers started (under lock) */
static atomic_uint generation;      /* bumped for each job; the futex word */
static atomic_int pending;          /* workers that have not finished the current job */
static atomic_int sleeping;         /* workers in (or entering) futex_wait */
static reflrl_task_fn job_fn;
static void *job_ctx;
static int job_threads;
static unsigned created_gen;        /* the generation before the job that started a worker */
static _Thread_local int in_job;
static int atfork_set;

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void *worker(void *arg) {
    int tid = (int)(long)arg;
    in_job = 1; /* a kernel called from a job runs on this thread alone */
    unsigned seen = created_gen; /* set before this thread was created, before its first job's bump */
    for (;;) {
        long until = 0;
        for (int i = 0; atomic_load_explicit(&generation, memory_order_acquire) == seen; i++) {
            relax();
            if ((i & 255) == 255) {
                long t = now_ns();
                if (!until) until = t + SPIN_NS;
                else if (t > until) {
                    atomic_fetch_add(&sleeping, 1);
                    syscall(SYS_futex, &generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                    atomic_fetch_sub(&sleeping, 1);
                    until = 0;
                }
            }
        }
        seen = atomic_load(&generation);
        if (tid < job_threads) job_fn(job_ctx, tid, job_threads);
        atomic_fetch_sub_explicit(&pending, 1, memory_order_release);
    }
    return NULL;
}

static void after_fork_in_child(void) { /* the child has this thread only */
    pthread_mutex_init(&lock, NULL);
    started = 0;
    atomic_store(&pending, 0);
    atomic_store(&sleeping, 0);
}

void reflrl_parallel(reflrl_task_fn fn, void *ctx, int nthreads) {
    if (nthreads > MAX_WORKERS + 1) nthreads = MAX_WORKERS + 1;
    if (nthreads <= 1 || in_job) {
        fn(ctx, 0, 1);
        return;
    }
    pthread_mutex_lock(&lock);
    if (!atfork_set) {
        pthread_atfork(NULL, NULL, after_fork_in_child);
        atfork_set = 1;
    }
    created_gen = atomic_load(&generation);
    while (started < nthreads - 1) {
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &a, worker, (void *)(long)(started + 1));
        pthread_attr_destroy(&a);
        if (rc) break;
        started++;
    }
    if (started == 0) { /* no worker could be started: the caller does it all */
        pthread_mutex_unlock(&lock);
        fn(ctx, 0, 1);
        return;
    }
    int n = started + 1 < nthreads ? started + 1 : nthreads;
    job_fn = fn;
    job_ctx = ctx;
    job_threads = n;
    atomic_store(&pending, started);
    atomic_fetch_add_explicit(&generation, 1, memory_order_seq_cst);
    if (atomic_load(&sleeping) > 0)
        syscall(SYS_futex, &generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    in_job = 1;
    fn(ctx, 0, n);
    in_job = 0;
    while (atomic_load_explicit(&pending, memory_order_acquire) > 0) relax();
    pthread_mutex_unlock(&lock);
}
