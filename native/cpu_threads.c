/*
 * A small persistent thread pool for the CPU GEMM.
 *
 * Work is handed out in small items from one shared atomic counter, so a slow or stolen core simply
 * takes fewer items. Nobody spins: idle workers sleep on a condition variable, and the caller, once
 * the counter is exhausted, "closes" the job and waits only for the workers that actually joined it
 * (each of those is busy with its last item). A worker that was descheduled before it could join
 * finds the job closed when it wakes and goes back to sleep, so the caller never waits for it.
 * One job runs at a time; a concurrent caller (another Python thread) runs its job inline.
 */
#include "w4p_cpu_internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#define W4P_MAX_THREADS 256

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER; /* guards the fields below */
static pthread_mutex_t pool_busy = PTHREAD_MUTEX_INITIALIZER; /* held by the caller running a job */
static pthread_cond_t work_cv = PTHREAD_COND_INITIALIZER;
static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER;
static int n_workers;          /* started so far */
static uint64_t generation;    /* bumped for every job */
static int job_open;           /* workers may still join */
static int job_slots;          /* how many workers may join this job */
static int joined, finished;
static w4p_task_fn job_fn;
static void *job_ctx;
static int64_t job_n;
static atomic_llong job_next;

static void run_items(w4p_task_fn fn, void *ctx, int64_t n) {
    for (;;) {
        int64_t i = atomic_fetch_add_explicit(&job_next, 1, memory_order_relaxed);
        if (i >= n) break;
        fn(ctx, i);
    }
}

static void *worker_main(void *arg) {
    (void)arg;
    uint64_t seen = 0;
    pthread_mutex_lock(&pool_lock);
    seen = generation;
    for (;;) {
        while (generation == seen) pthread_cond_wait(&work_cv, &pool_lock);
        seen = generation;
        if (!job_open || joined >= job_slots) continue;
        joined++;
        w4p_task_fn fn = job_fn;
        void *ctx = job_ctx;
        int64_t n = job_n;
        pthread_mutex_unlock(&pool_lock);
        run_items(fn, ctx, n);
        pthread_mutex_lock(&pool_lock);
        finished++;
        if (!job_open && finished == joined) pthread_cond_signal(&done_cv);
    }
    return NULL;
}

/* After fork() the child has none of the parent's workers: forget them (and any job state). */
static void pool_after_fork_child(void) {
    pthread_mutex_init(&pool_lock, NULL);
    pthread_mutex_init(&pool_busy, NULL);
    pthread_cond_init(&work_cv, NULL);
    pthread_cond_init(&done_cv, NULL);
    n_workers = 0;
    job_open = 0;
    joined = finished = 0;
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void register_atfork(void) { pthread_atfork(NULL, NULL, pool_after_fork_child); }

void w4p_parallel_for(int64_t n, int threads, w4p_task_fn fn, void *ctx) {
    if (n <= 0) return;
    pthread_once(&atfork_once, register_atfork);
    if (threads > W4P_MAX_THREADS) threads = W4P_MAX_THREADS;
    if (threads > n) threads = (int)n;
    if (threads <= 1 || pthread_mutex_trylock(&pool_busy) != 0) {
        for (int64_t i = 0; i < n; i++) fn(ctx, i);
        return;
    }
    pthread_mutex_lock(&pool_lock);
    while (n_workers < threads - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, worker_main, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0) break; /* run with the workers we have */
        n_workers++;
    }
    job_fn = fn;
    job_ctx = ctx;
    job_n = n;
    atomic_store(&job_next, 0);
    job_slots = threads - 1;
    joined = finished = 0;
    job_open = 1;
    generation++;
    pthread_cond_broadcast(&work_cv);
    pthread_mutex_unlock(&pool_lock);

    run_items(fn, ctx, n);

    pthread_mutex_lock(&pool_lock);
    job_open = 0;
    while (finished < joined) pthread_cond_wait(&done_cv, &pool_lock);
    pthread_mutex_unlock(&pool_lock);
    pthread_mutex_unlock(&pool_busy);
}
