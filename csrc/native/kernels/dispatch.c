/*
 * dispatch.c — which kernel set runs: the sets this build and CPU have, best
 * first (avx512, avx2 or neon, then scalar), es_kernels_select, and the
 * front ends es_matvec / es_matmat / es_axpy_f16 / es_axpy_q8_0 over the set in use.
 *
 * The CPU is asked here, in a file compiled without ISA flags, before any
 * function of a file compiled with them runs.
 */
#define _POSIX_C_SOURCE 200809L  // pthread_once under -std=c11

#include "kernels.h"

#include <pthread.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#define ES_X86 1
#endif

// The sets this CPU runs, best first (scalar always last); found once.
static const es_kernel_set * g_available[4];
static int32_t               g_n_available;
// The set in use: the best until es_kernels_select changes it.
static const es_kernel_set * g_kernels;
static pthread_once_t        g_once = PTHREAD_ONCE_INIT;

static void add_set(const es_kernel_set * set) {
    if (set) g_available[g_n_available++] = set;
}

// Runs once, from whichever thread first needs the kernels (a set's tables
// are filled before any thread can use it).
static void find_kernels(void) {
#if defined(ES_X86)
    // F16C through cpuid: not every compiler's __builtin_cpu_supports knows it.
    unsigned eax, ebx, ecx = 0, edx;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c) {
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
            add_set(es__kernels_avx512());
        add_set(es__kernels_avx2());
    }
#endif
    add_set(es__kernels_neon());  // NEON is baseline on aarch64
    add_set(es__kernels_scalar());
    g_kernels = g_available[0];
}

static const es_kernel_set * kernels(void) {
    pthread_once(&g_once, find_kernels);
    return g_kernels;
}

int es_kernels_select(const char * name) {
    if (!name) return ES_ERR_INVALID_ARG;
    pthread_once(&g_once, find_kernels);
    const es_kernel_set * chosen = strcmp(name, "auto") == 0 ? g_available[0] : NULL;
    for (int32_t i = 0; i < g_n_available && !chosen; i++) {
        if (strcmp(name, g_available[i]->name) == 0) chosen = g_available[i];
    }
    if (!chosen) {
        const bool known = strcmp(name, "avx512") == 0 || strcmp(name, "avx2") == 0 || strcmp(name, "neon") == 0;
        return known ? ES_ERR_UNSUPPORTED : ES_ERR_INVALID_ARG;
    }
    // Written only on a change: selecting the set in use races with nothing.
    if (g_kernels != chosen) g_kernels = chosen;
    return ES_OK;
}

const char * es_kernels_name(void) { return kernels()->name; }

const char * es_kernels_available(int32_t i) {
    pthread_once(&g_once, find_kernels);
    return i >= 0 && i < g_n_available ? g_available[i]->name : NULL;
}

void es_matvec(int32_t type, const void * w, const void * xq, int64_t n, int64_t r0, int64_t r1, float * y) {
    const es_kernel_set * k = kernels();
    const size_t row_bytes = es_type_row_bytes(type, n);
    if (type < 0 || type >= N_TYPES || !k->dot[type] || row_bytes == 0 || r0 >= r1) return;
    const uint8_t * row = (const uint8_t *) w + (size_t) r0 * row_bytes;
    if (k->dot_rows[type]) {
        k->dot_rows[type](n, row, r1 - r0, xq, y);
        return;
    }
    for (int64_t r = r0; r < r1; r++, row += row_bytes) y[r - r0] = k->dot[type](n, row, xq);
}

void es_axpy_f16(int64_t n, float e, const uint16_t * v, float * acc) { kernels()->axpy_f16(n, e, v, acc); }

void es_axpy_q8_0(int64_t n, int64_t rows, const float * e, const void * v, float * acc) {
    kernels()->axpy_q8_0(n, rows, e, v, acc);
}

int64_t es_int8_loop(int64_t iterations, int32_t * sink) { return kernels()->int8_loop(iterations, sink); }

bool es_kernels_tile(int32_t type) { return type >= 0 && type < N_TYPES && kernels()->tile[type]; }

// Weight bytes es_matmat walks for one group of tokens before the next
// group: a group's activations stay in L1 while the block's rows stream by,
// from the last-level cache after the first group (a thread's share of it
// on current x86 and Arm parts). Measured on qwen2.5-coder-1.5b and
// smollm2-135m prefill (AVX2, 2 threads): blocks of 128 KB, whose rows stay
// in L2 but make every row re-read the activations from L2, ran 10-25%
// slower than blocks of 1-4 MB.
#define ROW_BLOCK_BYTES (2 * 1024 * 1024)
// Tokens a tile kernel takes in one call.
#define TILE_TOKENS 16

// Rows [r0, r1) of the unpacked weight, y's column 0 being row r0.
static void matmat_rows(const es_kernel_set * k, int32_t type, const void * w, const void * xq,
                        size_t xq_stride, int32_t n_tok, int64_t n, int64_t r0, int64_t r1, float * y,
                        size_t y_stride) {
    const size_t row_bytes = es_type_row_bytes(type, n);
    const vec_dot_fn    dot  = k->dot[type];
    const vec_dotn_fn * dotn = k->dotn[type];
    // A tiled product: a block of rows is read from memory once and reused,
    // from the cache, by every group of up to MAX_NT tokens (each weight
    // block unpacked once per group); a decode-sized batch is one group.
    // Each (row, token) value is the same whatever the grouping, since the
    // kernels give every token es_matvec's result.
    const int64_t block = row_bytes >= ROW_BLOCK_BYTES ? 1 : (int64_t) (ROW_BLOCK_BYTES / row_bytes);
    for (int64_t rb = r0; rb < r1; rb += block) {
        const int64_t re = rb + block < r1 ? rb + block : r1;
        for (int32_t t = 0; t < n_tok; t += MAX_NT) {
            const int32_t nt = n_tok - t < MAX_NT ? n_tok - t : MAX_NT;
            const uint8_t * xt = (const uint8_t *) xq + (size_t) t * xq_stride;
            float * yt = y + (size_t) t * y_stride;  // (nt, y_stride), column r - r0 for row r
            const uint8_t * row = (const uint8_t *) w + (size_t) rb * row_bytes;
            for (int64_t r = rb; r < re; r++, row += row_bytes) {
                if (dotn) {
                    float out[MAX_NT];
                    dotn[nt - 1](n, row, xt, xq_stride, out);
                    for (int32_t j = 0; j < nt; j++) yt[(size_t) j * y_stride + (size_t) (r - r0)] = out[j];
                } else {
                    for (int32_t j = 0; j < nt; j++)
                        yt[(size_t) j * y_stride + (size_t) (r - r0)] = dot(n, row, xt + (size_t) j * xq_stride);
                }
            }
        }
    }
}

// Groups [g0, g1) of the repacked weight, y's column 0 being row 8 g0: the
// same blocking, in whole groups, with tokens TILE_TOKENS at a time.
static void matmat_groups(tile_fn tile, int32_t type, const void * packed, const void * xq,
                          size_t xq_stride, int32_t n_tok, int64_t n, int64_t g0, int64_t g1, float * y,
                          size_t y_stride) {
    const size_t gb = es_repack_bytes(type, n, ES_GROUP_ROWS);
    const int64_t block = gb >= ROW_BLOCK_BYTES ? 1 : (int64_t) (ROW_BLOCK_BYTES / gb);
    for (int64_t gs = g0; gs < g1; gs += block) {
        const int64_t ge = gs + block < g1 ? gs + block : g1;
        for (int32_t t = 0; t < n_tok; t += TILE_TOKENS) {
            const int32_t nt = n_tok - t < TILE_TOKENS ? n_tok - t : TILE_TOKENS;
            tile(n, (const uint8_t *) packed + (size_t) gs * gb, ge - gs,
                 (const uint8_t *) xq + (size_t) t * xq_stride, xq_stride, nt,
                 y + (size_t) t * y_stride + (size_t) (ES_GROUP_ROWS * (gs - g0)), y_stride);
        }
    }
}

void es_matmat(int32_t type, const void * w, const void * packed, const void * xq, size_t xq_stride,
               int32_t n_tok, int64_t n, int64_t r0, int64_t r1, float * y, size_t y_stride) {
    const es_kernel_set * k = kernels();
    if (type < 0 || type >= N_TYPES || !k->dot[type] || es_type_row_bytes(type, n) == 0 || r0 >= r1) return;
    const tile_fn tile = !packed ? NULL : n_tok == 1 && k->tile_one[type] ? k->tile_one[type] : k->tile[type];
    // The whole groups of 8 inside [r0, r1) from the repacked copy (which
    // has every whole group of the weight), the rows around them unpacked.
    const int64_t g0 = (r0 + ES_GROUP_ROWS - 1) / ES_GROUP_ROWS, g1 = r1 / ES_GROUP_ROWS;
    if (!tile || g0 >= g1) {
        matmat_rows(k, type, w, xq, xq_stride, n_tok, n, r0, r1, y, y_stride);
        return;
    }
    const int64_t p0 = ES_GROUP_ROWS * g0, p1 = ES_GROUP_ROWS * g1;
    matmat_rows(k, type, w, xq, xq_stride, n_tok, n, r0, p0, y, y_stride);
    matmat_groups(tile, type, packed, xq, xq_stride, n_tok, n, g0, g1, y + (p0 - r0), y_stride);
    matmat_rows(k, type, w, xq, xq_stride, n_tok, n, p1, r1, y + (p1 - r0), y_stride);
}
