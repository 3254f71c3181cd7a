/*
 * threadpool.c — a small pool of workers for one parallel loop at a time.
 *
 * es_pool_run is called per matmul (hundreds of times per token), so a run
 * must cost far less than a mutex/condvar round trip: the caller publishes
 * the job by bumping an atomic generation counter, then every thread claims
 * shares (ith = 0..nth-1) from an atomic counter and runs them, and the
 * caller spins until all nth are done. The caller claims first, so it
 * usually runs ith 0, and it takes over the share of a worker that has not
 * started yet: on a machine with more busy threads than cores a descheduled
 * worker delays a run by its own share at most, not by a time slice.
 * Idle workers spin on the generation for a short while (the next matmul
 * usually follows within microseconds) and then sleep on a condition
 * variable; the caller only takes the mutex to wake them when some are asleep.
 */
#define _POSIX_C_SOURCE 200809L

#include "native/native_internal.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

// How long an idle worker spins before sleeping.
#define SPIN_NS 200000  // 0.2 ms

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t) ts.tv_sec * 1000000000 + ts.tv_nsec;
}

typedef struct worker {
    struct es_pool * pool;
    int32_t          ith;  // 1..n-1
    pthread_t        thread;
} worker;

struct es_pool {
    int32_t  n_threads;  // the caller plus n_threads - 1 workers
    worker * workers;    // (n_threads - 1), owned

    // The current job, written by es_pool_run before it resets next.
    es_pool_fn fn;
    void *     arg;

    _Atomic uint32_t gen;         // one more per run; workers wait for a change
    _Atomic int32_t  next;        // the next share to claim; >= n_threads: none left
    _Atomic int32_t  n_done;      // shares finished in the current run
    _Atomic int32_t  n_sleeping;  // workers blocked (or about to block) on cv
    _Atomic bool     stop;

    pthread_mutex_t mutex;  // guards sleeping on cv
    pthread_cond_t  cv;
};

// Waits until pool->gen differs from seen (or stop); returns the new gen.
static uint32_t wait_for_job(es_pool * pool, uint32_t seen) {
    const int64_t t0 = now_ns();
    for (int i = 1;; i++) {
        const uint32_t g = atomic_load_explicit(&pool->gen, memory_order_acquire);
        if (g != seen || atomic_load_explicit(&pool->stop, memory_order_acquire)) return g;
        cpu_relax();
        if ((i & 255) == 0 && now_ns() - t0 > SPIN_NS) break;
    }
    pthread_mutex_lock(&pool->mutex);
    // seq_cst pairs with es_pool_run's store to gen / load of n_sleeping:
    // either we see the new gen here or the runner sees us and broadcasts
    // under the mutex, which we hold until cond_wait releases it.
    atomic_fetch_add(&pool->n_sleeping, 1);
    uint32_t g;
    while ((g = atomic_load(&pool->gen)) == seen && !atomic_load(&pool->stop))
        pthread_cond_wait(&pool->cv, &pool->mutex);
    atomic_fetch_sub(&pool->n_sleeping, 1);
    pthread_mutex_unlock(&pool->mutex);
    return g;
}

// Claims and runs shares of the current job until none is left. The
// acquire on next pairs with es_pool_run's release store resetting it, so
// a claimed share sees that run's fn and arg, even from a worker that woke
// for an earlier generation.
static void run_shares(es_pool * pool) {
    for (;;) {
        const int32_t ith = atomic_fetch_add_explicit(&pool->next, 1, memory_order_acquire);
        if (ith >= pool->n_threads) return;
        pool->fn(pool->arg, ith, pool->n_threads);
        atomic_fetch_add_explicit(&pool->n_done, 1, memory_order_release);
    }
}

static void * worker_main(void * p) {
    worker * w    = p;
    es_pool * pool = w->pool;
    uint32_t seen = 0;
    for (;;) {
        seen = wait_for_job(pool, seen);
        if (atomic_load_explicit(&pool->stop, memory_order_acquire)) return NULL;
        run_shares(pool);
    }
}

// Stops and joins the first n_started workers, then frees the pool.
static void pool_destroy(es_pool * pool, int32_t n_started) {
    pthread_mutex_lock(&pool->mutex);
    atomic_store(&pool->stop, true);
    pthread_cond_broadcast(&pool->cv);
    pthread_mutex_unlock(&pool->mutex);
    for (int32_t i = 0; i < n_started; i++) pthread_join(pool->workers[i].thread, NULL);
    pthread_cond_destroy(&pool->cv);
    pthread_mutex_destroy(&pool->mutex);
    free(pool->workers);
    free(pool);
}

int es_pool_init(int32_t n_threads, es_pool ** out) {
    if (!out || n_threads < 1 || n_threads > 1024) return ES_ERR_INVALID_ARG;
    es_pool * pool = calloc(1, sizeof(*pool));
    if (!pool) return ES_ERR_NO_MEMORY;
    pool->n_threads = n_threads;
    atomic_store(&pool->next, n_threads);  // no job yet
    pool->workers   = calloc((size_t) n_threads, sizeof(worker));  // n - 1 used; never 0 bytes
    if (!pool->workers) {
        free(pool);
        return ES_ERR_NO_MEMORY;
    }
    if (pthread_mutex_init(&pool->mutex, NULL) != 0) {
        free(pool->workers);
        free(pool);
        return ES_ERR_NO_MEMORY;
    }
    if (pthread_cond_init(&pool->cv, NULL) != 0) {
        pthread_mutex_destroy(&pool->mutex);
        free(pool->workers);
        free(pool);
        return ES_ERR_NO_MEMORY;
    }
    for (int32_t i = 0; i < n_threads - 1; i++) {
        pool->workers[i] = (worker) {.pool = pool, .ith = i + 1};
        if (pthread_create(&pool->workers[i].thread, NULL, worker_main, &pool->workers[i]) != 0) {
            pool_destroy(pool, i);
            return ES_ERR_NO_MEMORY;
        }
    }
    *out = pool;
    return ES_OK;
}

void es_pool_free(es_pool * pool) {
    if (pool) pool_destroy(pool, pool->n_threads - 1);
}

int32_t es_pool_size(const es_pool * pool) { return pool ? pool->n_threads : 0; }

void es_pool_run(es_pool * pool, es_pool_fn fn, void * arg) {
    const int32_t n = pool->n_threads;
    if (n == 1) {
        fn(arg, 0, 1);
        return;
    }
    // The previous run is complete (all its shares claimed and done), so no
    // thread reads fn or arg until next is reset below.
    pool->fn  = fn;
    pool->arg = arg;
    atomic_store_explicit(&pool->n_done, 0, memory_order_relaxed);
    atomic_store_explicit(&pool->next, 0, memory_order_release);
    atomic_fetch_add(&pool->gen, 1);  // seq_cst, see wait_for_job
    if (atomic_load(&pool->n_sleeping) > 0) {
        pthread_mutex_lock(&pool->mutex);
        pthread_cond_broadcast(&pool->cv);
        pthread_mutex_unlock(&pool->mutex);
    }
    run_shares(pool);
    // Shares still running on workers end within microseconds unless a
    // worker was descheduled mid-share; yield then.
    for (int i = 1; atomic_load_explicit(&pool->n_done, memory_order_acquire) != n; i++) {
        cpu_relax();
        if ((i & 1023) == 0) sched_yield();
    }
}
