/*
 * bandwidth.c — the two ceilings `edgespec bench --roofline` holds a model
 * against: how fast this machine streams memory into the cores (the bound
 * of a memory-bound decode step: bandwidth over the bytes a token reads),
 * and how many int8 multiply-accumulates its cores do per second (the
 * bound of a batch of many tokens: the peak over the batch's MACs).
 *
 * One pool run per pass; thread ith reads slice ith of the buffer with
 * 32-byte vector loads into eight independent sums (enough loads in flight
 * to saturate the memory system, no dependency chain on one register),
 * stored where the caller can see them, so the compiler keeps every load.
 */
#define _POSIX_C_SOURCE 200809L

#include "native/native_internal.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define DEFAULT_BYTES (512ll << 20)
#define DEFAULT_PASSES 5
#define LANE 32  // bytes per vector

typedef uint64_t v4u64 __attribute__((vector_size(LANE)));

typedef struct read_job {
    const uint8_t * buf;      // (n_bytes), 64-byte aligned
    uint8_t *       fill;     // the same buffer, written once before timing; NULL when reading
    int64_t         n_bytes;  // multiple of 8 * LANE * nth
    uint64_t *      sums;     // (nth, 8): thread ith's sum in [ith * 8], a cache line each
} read_job;

// This thread's slice: [begin, end) in bytes, multiples of 8 * LANE.
static void slice(const read_job * job, int32_t ith, int32_t nth, int64_t * begin, int64_t * end) {
    const int64_t step = 8 * LANE, n_steps = job->n_bytes / step;
    *begin = n_steps * ith / nth * step;
    *end = n_steps * (ith + 1) / nth * step;
}

static void read_slice(void * arg, int32_t ith, int32_t nth) {
    read_job * job = arg;
    int64_t begin, end;
    slice(job, ith, nth, &begin, &end);
    if (job->fill) {
        memset(job->fill + begin, (int) (ith + 1), (size_t) (end - begin));
        return;
    }
    v4u64 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}, s4 = {0}, s5 = {0}, s6 = {0}, s7 = {0};
    for (int64_t i = begin; i < end; i += 8 * LANE) {
        const v4u64 * p = (const v4u64 *) (job->buf + i);
        s0 += p[0]; s1 += p[1]; s2 += p[2]; s3 += p[3];
        s4 += p[4]; s5 += p[5]; s6 += p[6]; s7 += p[7];
    }
    const v4u64 s = s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7;
    job->sums[(size_t) ith * 8] = s[0] + s[1] + s[2] + s[3];
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec + 1e-9 * (double) ts.tv_nsec;
}

es_bandwidth_params es_bandwidth_default_params(void) {
    return (es_bandwidth_params) { .n_bytes = DEFAULT_BYTES, .n_threads = 0, .n_passes = DEFAULT_PASSES };
}

// A pool of n_threads (<= 0: one per online CPU) for a measurement.
static int measure_pool(int32_t n_threads, es_pool ** pool) {
    if (n_threads <= 0) {
        const long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int32_t) (n < 256 ? n : 256) : 1;
    }
    return es_pool_init(n_threads, pool);
}

int es_measure_bandwidth(const es_bandwidth_params * params, double * bytes_per_s) {
    if (!bytes_per_s) return ES_ERR_INVALID_ARG;
    const es_bandwidth_params p = params ? *params : es_bandwidth_default_params();
    es_pool * pool = NULL;
    int rc = measure_pool(p.n_threads, &pool);
    if (rc != ES_OK) return rc;
    const int32_t nth = es_pool_size(pool);
    const int64_t unit = 8 * LANE * (int64_t) nth;
    int64_t n_bytes = p.n_bytes > 0 ? p.n_bytes : DEFAULT_BYTES;
    n_bytes = (n_bytes + unit - 1) / unit * unit;
    read_job job = { .n_bytes = n_bytes, .sums = calloc((size_t) nth * 8, sizeof(uint64_t)) };
    uint8_t * buf = aligned_alloc(64, (size_t) n_bytes);
    if (!job.sums || !buf) {
        free(job.sums);
        free(buf);
        es_pool_free(pool);
        return ES_ERR_NO_MEMORY;
    }
    job.fill = buf;
    es_pool_run(pool, read_slice, &job);  // first touch, by the thread that reads the slice
    job.fill = NULL;
    job.buf = buf;
    es_pool_run(pool, read_slice, &job);  // one untimed pass: threads awake
    double best = 0.0;
    for (int32_t pass = 0; pass < (p.n_passes > 0 ? p.n_passes : DEFAULT_PASSES); pass++) {
        const double t0 = now_s();
        es_pool_run(pool, read_slice, &job);
        const double t = now_s() - t0;
        if (t > 0.0 && (double) n_bytes / t > best) best = (double) n_bytes / t;
    }
    *bytes_per_s = best;
    free(buf);
    free(job.sums);
    es_pool_free(pool);
    return ES_OK;
}

/* ---- int8 peak --------------------------------------------------------------- */

typedef struct peak_job {
    int64_t   iterations;
    int64_t * macs;   // (nth, 8): thread ith's count in [ith * 8], a cache line each
    int32_t * sinks;  // (nth, 16)
} peak_job;

static void peak_run(void * arg, int32_t ith, int32_t nth) {
    (void) nth;
    peak_job * job = arg;
    job->macs[(size_t) ith * 8] = es_int8_loop(job->iterations, &job->sinks[(size_t) ith * 16]);
}

es_int8_peak_params es_int8_peak_default_params(void) {
    return (es_int8_peak_params) { .n_threads = 0, .n_passes = DEFAULT_PASSES, .iterations = 1 << 20 };
}

int es_measure_int8_peak(const es_int8_peak_params * params, double * macs_per_s) {
    if (!macs_per_s) return ES_ERR_INVALID_ARG;
    const es_int8_peak_params p = params ? *params : es_int8_peak_default_params();
    es_pool * pool = NULL;
    int rc = measure_pool(p.n_threads, &pool);
    if (rc != ES_OK) return rc;
    const int32_t nth = es_pool_size(pool);
    peak_job job = { .iterations = p.iterations > 0 ? p.iterations : 1 << 20,
                     .macs = calloc((size_t) nth * 8, sizeof(int64_t)),
                     .sinks = calloc((size_t) nth * 16, sizeof(int32_t)) };
    if (!job.macs || !job.sinks) {
        free(job.macs);
        free(job.sinks);
        es_pool_free(pool);
        return ES_ERR_NO_MEMORY;
    }
    es_pool_run(pool, peak_run, &job);  // one untimed pass: threads awake, clocks up
    double best = 0.0;
    for (int32_t pass = 0; pass < (p.n_passes > 0 ? p.n_passes : DEFAULT_PASSES); pass++) {
        const double t0 = now_s();
        es_pool_run(pool, peak_run, &job);
        const double t = now_s() - t0;
        double macs = 0.0;
        for (int32_t i = 0; i < nth; i++) macs += (double) job.macs[(size_t) i * 8];
        if (t > 0.0 && macs / t > best) best = macs / t;
    }
    *macs_per_s = best;
    free(job.macs);
    free(job.sinks);
    es_pool_free(pool);
    return ES_OK;
}
