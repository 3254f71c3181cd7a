/*
 * bench_kernels.c — es_matvec speed per weight type, the run-time chosen
 * kernels against the portable scalar ones, measured side by side.
 *
 *   cmake -S . -B build && cmake --build build -j2   (the kernel files need their ISA flags)
 *   cc -O3 -Icsrc benchmarks/bench_kernels.c -Lbuild -ledgespec -Wl,-rpath,$PWD/build -lm -ldl -o /tmp/bench_kernels
 *   /tmp/bench_kernels [n] [rows] [reps]     (default 2048 4096 20)
 *   EDGESPEC_KERNELS=avx2 /tmp/bench_kernels  (another set than the best, as the engine's switch)
 *
 * One thread. Measured with the scalar kernels (es_kernels_select), then with
 * the best this CPU runs (or EDGESPEC_KERNELS's set); each line gives ns per
 * row, weight GB/s and the speed-up. Then the batch cost curve of es_matmat, over the rows as they
 * are and over their repacked copy. Weights are random bytes with sane
 * block scales.
 */
#define _POSIX_C_SOURCE 200809L

#include "native/native_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dlfcn.h>
#include <time.h>

static const int32_t TYPES[] = {
    ES_TYPE_F32,  ES_TYPE_F16,  ES_TYPE_BF16, ES_TYPE_Q4_0, ES_TYPE_Q4_1, ES_TYPE_Q5_0,
    ES_TYPE_Q5_1, ES_TYPE_Q8_0, ES_TYPE_Q4_K, ES_TYPE_Q5_K, ES_TYPE_Q6_K,
};
#define N_BENCH ((int) (sizeof(TYPES) / sizeof(TYPES[0])))

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t next_u32(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t) (rng >> 16);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec + 1e-9 * (double) ts.tv_nsec;
}

// Random rows whose half scales are small normal numbers (no inf/nan).
static uint8_t * random_rows(int32_t type, int64_t n, int64_t rows) {
    const size_t rb = es_type_row_bytes(type, n);
    uint8_t * w = malloc(rb * (size_t) rows);
    for (size_t i = 0; i < rb * (size_t) rows; i++) w[i] = (uint8_t) next_u32();
    const int32_t blk = es_type_block(type);
    const size_t bb = rb / (size_t) (n / blk);
    if (type == ES_TYPE_F32)
        for (int64_t i = 0; i < n * rows; i++) ((float *) w)[i] = (float) (next_u32() % 2001) / 1000.f - 1.f;
    else if (type == ES_TYPE_F16 || type == ES_TYPE_BF16)
        for (int64_t i = 0; i < n * rows; i++) {
            const uint16_t base = type == ES_TYPE_F16 ? 0x3000 : 0x3E00;
            ((uint16_t *) w)[i] = (uint16_t) (base | (next_u32() & (type == ES_TYPE_F16 ? 0x83FF : 0x807F)));
        }
    else
        for (size_t b = 0; b < (size_t) rows * (size_t) (n / blk); b++) {
            uint8_t * p = w + b * bb;
            // Half scale fields: d (and m/dmin) at the front, Q6_K's d at the end.
            const int off = type == ES_TYPE_Q6_K ? 208 : 0;
            p[off + 1] = 0x1C;
            if (type == ES_TYPE_Q4_1 || type == ES_TYPE_Q5_1 || type == ES_TYPE_Q4_K || type == ES_TYPE_Q5_K)
                p[3] = 0x1C;
        }
    return w;
}

// ggml's CPU kernels, when a libggml-cpu is given.
typedef void (*ggml_dot_fn)(int n, float * s, size_t bs, const void * x, size_t bx, const void * y,
                            size_t by, int nrc);
typedef void (*ggml_quant_fn)(const float * x, void * y, int64_t k);
static ggml_dot_fn   ggml_dot[ES_TYPE_BF16 + 1];
static ggml_quant_fn ggml_quant[ES_TYPE_BF16 + 1];  // by activation type

static void load_ggml(const char * path) {
    void * h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "error: %s\n", dlerror());
        exit(2);
    }
    void (*init)(void) = (void (*)(void)) dlsym(h, "ggml_cpu_init");
    if (init) init();
    static const struct { int32_t type; const char * sym; } dots[] = {
        {ES_TYPE_F32, "ggml_vec_dot_f32"},        {ES_TYPE_Q4_0, "ggml_vec_dot_q4_0_q8_0"},
        {ES_TYPE_Q4_1, "ggml_vec_dot_q4_1_q8_1"}, {ES_TYPE_Q5_0, "ggml_vec_dot_q5_0_q8_0"},
        {ES_TYPE_Q5_1, "ggml_vec_dot_q5_1_q8_1"}, {ES_TYPE_Q8_0, "ggml_vec_dot_q8_0_q8_0"},
        {ES_TYPE_Q4_K, "ggml_vec_dot_q4_K_q8_K"}, {ES_TYPE_Q5_K, "ggml_vec_dot_q5_K_q8_K"},
        {ES_TYPE_Q6_K, "ggml_vec_dot_q6_K_q8_K"},
    };
    for (size_t i = 0; i < sizeof(dots) / sizeof(dots[0]); i++)
        ggml_dot[dots[i].type] = (ggml_dot_fn) dlsym(h, dots[i].sym);
    ggml_quant[ES_TYPE_Q8_0] = (ggml_quant_fn) dlsym(h, "quantize_row_q8_0");
    ggml_quant[ES_TYPE_Q8_1] = (ggml_quant_fn) dlsym(h, "quantize_row_q8_1");
    ggml_quant[ES_TYPE_Q8_K] = (ggml_quant_fn) dlsym(h, "quantize_row_q8_K");
}

// ns per row of ggml's vec_dot for each type (NAN: none), on the same data;
// also counts activation blocks where ggml's quantization differs from ours.
static void measure_ggml(int64_t n, int64_t rows, int reps, double * ns_per_row, int * quant_diff) {
    float * x = malloc((size_t) n * sizeof(float));
    float * y = malloc((size_t) rows * sizeof(float));
    for (int64_t i = 0; i < n; i++) x[i] = (float) (next_u32() % 2001) / 1000.f - 1.f;
    for (int t = 0; t < N_BENCH; t++) {
        const int32_t act = es_act_type(TYPES[t]);
        ns_per_row[t] = NAN;
        quant_diff[t] = 0;
        if (es_type_row_bytes(TYPES[t], n) == 0) continue;
        uint8_t * w = random_rows(TYPES[t], n, rows);
        if (!ggml_dot[TYPES[t]] || (act != ES_TYPE_F32 && !ggml_quant[act])) {
            free(w);
            continue;
        }
        const size_t rb = es_type_row_bytes(TYPES[t], n), ab = es_type_row_bytes(act, n);
        uint8_t * xq = malloc(ab), * ours = malloc(ab);
        es_quantize_act(TYPES[t], x, ours, n);
        if (act == ES_TYPE_F32) memcpy(xq, x, ab);
        else ggml_quant[act](x, xq, n);
        quant_diff[t] = memcmp(xq, ours, ab) != 0;
        double best = INFINITY;
        for (int r = 0; r <= reps; r++) {
            const double t0 = now_s();
            for (int64_t i = 0; i < rows; i++) ggml_dot[TYPES[t]]((int) n, &y[i], 0, w + (size_t) i * rb, 0, xq, 0, 1);
            if (r) best = fmin(best, now_s() - t0);  // r = 0 warms up
        }
        ns_per_row[t] = 1e9 * best / (double) rows;
        free(ours);
        free(xq);
        free(w);
    }
    free(y);
    free(x);
}

// The batch cost curve: ns per weight row of one es_matmat over B tokens,
// for each B in BATCHES (B = 1 is es_matvec's work), over the rows as the
// GGUF has them (how = 0) and over their repacked copy (how = 1; NAN for a
// type without a repacked layout). Verifying B drafted tokens costs
// curve[B] / curve[1] single tokens' worth of matmul.
static const int BATCHES[] = {1, 2, 4, 8, 12, 16};
#define N_BATCHES ((int) (sizeof(BATCHES) / sizeof(BATCHES[0])))
#define MAX_BATCH 16
static void measure_batch(int64_t n, int64_t rows, int reps, double ns[2][N_BENCH][N_BATCHES]) {
    float * x = malloc((size_t) n * sizeof(float));
    float * y = malloc((size_t) rows * MAX_BATCH * sizeof(float));
    for (int t = 0; t < N_BENCH; t++) {
        for (int b = 0; b < N_BATCHES; b++) ns[0][t][b] = ns[1][t][b] = NAN;
        if (es_type_row_bytes(TYPES[t], n) == 0) continue;
        uint8_t * w = random_rows(TYPES[t], n, rows);
        const size_t pb = es_repack_bytes(TYPES[t], n, rows);
        uint8_t * packed = pb ? malloc(pb) : NULL;
        if (packed) es_repack(TYPES[t], w, n, rows, packed);
        const size_t ab = es_type_row_bytes(es_act_type(TYPES[t]), n);
        uint8_t * xq = malloc(ab * MAX_BATCH);
        for (int b = 0; b < MAX_BATCH; b++) {
            for (int64_t i = 0; i < n; i++) x[i] = (float) (next_u32() % 2001) / 1000.f - 1.f;
            es_quantize_act(TYPES[t], x, xq + (size_t) b * ab, n);
        }
        // Batch sizes and layouts interleaved within each repeat, the best of
        // each kept: a busy spell on the machine then slows every one alike.
        double best[2][N_BATCHES];
        for (int b = 0; b < N_BATCHES; b++) best[0][b] = best[1][b] = INFINITY;
        for (int r = 0; r <= reps; r++) {  // r = 0 warms up
            for (int b = 0; b < N_BATCHES; b++) {
                for (int how = 0; how < (packed ? 2 : 1); how++) {
                    const double t0 = now_s();
                    es_matmat(TYPES[t], w, how ? packed : NULL, xq, ab, BATCHES[b], n, 0, rows, y, (size_t) rows);
                    if (r) best[how][b] = fmin(best[how][b], now_s() - t0);
                }
            }
        }
        for (int b = 0; b < N_BATCHES; b++) {
            ns[0][t][b] = 1e9 * best[0][b] / (double) rows;
            if (packed) ns[1][t][b] = 1e9 * best[1][b] / (double) rows;
        }
        free(xq);
        free(packed);
        free(w);
    }
    free(y);
    free(x);
}

// ns per row for each type, in TYPES order.
static void measure(int64_t n, int64_t rows, int reps, double * ns_per_row) {
    float * x = malloc((size_t) n * sizeof(float));
    float * y = malloc((size_t) rows * sizeof(float));
    for (int64_t i = 0; i < n; i++) x[i] = (float) (next_u32() % 2001) / 1000.f - 1.f;
    for (int t = 0; t < N_BENCH; t++) {
        ns_per_row[t] = NAN;
        if (es_type_row_bytes(TYPES[t], n) == 0) continue;  // n not whole blocks (K-quants: 256)
        uint8_t * w = random_rows(TYPES[t], n, rows);
        void * xq = malloc(es_type_row_bytes(es_act_type(TYPES[t]), n));
        es_quantize_act(TYPES[t], x, xq, n);
        es_matvec(TYPES[t], w, xq, n, 0, rows, y);  // warm up
        double best = INFINITY;
        for (int r = 0; r < reps; r++) {
            const double t0 = now_s();
            es_matvec(TYPES[t], w, xq, n, 0, rows, y);
            best = fmin(best, now_s() - t0);
        }
        ns_per_row[t] = 1e9 * best / (double) rows;
        free(xq);
        free(w);
    }
    free(y);
    free(x);
}

int main(int argc, char ** argv) {
    const int64_t n    = argc > 1 ? atoll(argv[1]) : 2048;
    const int64_t rows = argc > 2 ? atoll(argv[2]) : 4096;
    const int     reps = argc > 3 ? atoi(argv[3]) : 20;
    if (n <= 0 || n % 32 || rows <= 0 || reps <= 0) {
        fprintf(stderr, "error: n must be a positive multiple of 32, rows and reps positive\n");
        return 2;
    }
    const char * env = getenv("EDGESPEC_KERNELS"), * set = env && *env ? env : "auto";
    if (es_kernels_select(set) != ES_OK) {
        fprintf(stderr, "error: EDGESPEC_KERNELS=%s: no such kernel set on this CPU\n", set);
        return 2;
    }
    double scalar[N_BENCH], fast[N_BENCH];
    if (es_kernels_select("scalar") != ES_OK) return 1;
    measure(n, rows, reps, scalar);
    if (es_kernels_select(set) != ES_OK) return 1;
    measure(n, rows, reps, fast);
    double ggml[N_BENCH];
    int quant_diff[N_BENCH] = {0};
    for (int t = 0; t < N_BENCH; t++) ggml[t] = NAN;
    if (argc > 4) {
        load_ggml(argv[4]);
        measure_ggml(n, rows, reps, ggml, quant_diff);
    }

    printf("es_matvec, n=%lld, %lld rows, best of %d, 1 thread; kernels: %s\n", (long long) n,
           (long long) rows, reps, es_kernels_name());
    printf("%-5s %10s %10s %10s %8s %8s %9s %10s\n", "type", "scalar ns", "fast ns", "ggml ns",
           "fast GB/s", "vs scalar", "vs ggml", "act==ggml");
    for (int t = 0; t < N_BENCH; t++) {
        const double bytes = (double) es_type_row_bytes(TYPES[t], n);
        printf("%-5s %10.1f %10.1f %10.1f %8.2f %8.2fx %8.2fx %10s\n", es_type_name(TYPES[t]), scalar[t],
               fast[t], ggml[t], bytes / fast[t], scalar[t] / fast[t], ggml[t] / fast[t],
               isnan(ggml[t]) ? "-" : quant_diff[t] ? "DIFFERS" : "yes");
    }
    printf("(per row, lower is better; ratios > 1 mean ours is faster)\n");

    static double curve[2][N_BENCH][N_BATCHES];
    measure_batch(n, rows, reps, curve);
    for (int how = 0; how < 2; how++) {
        printf("\nbatch cost curve (%s, %s): es_matmat ns per weight row over B tokens, / B = 1, "
               "and int8 GMAC/s\n", es_kernels_name(), how ? "repacked" : "rows as in the GGUF");
        printf("%-5s", "type");
        for (int b = 0; b < N_BATCHES; b++) printf(" %9s%-2d %6s %6s", "B=", BATCHES[b], "x1", "GMAC");
        printf("\n");
        for (int t = 0; t < N_BENCH; t++) {
            if (isnan(curve[how][t][0])) continue;
            printf("%-5s", es_type_name(TYPES[t]));
            for (int b = 0; b < N_BATCHES; b++)
                printf(" %11.1f %5.2fx %6.1f", curve[how][t][b], curve[how][t][b] / curve[how][t][0],
                       (double) n * BATCHES[b] / curve[how][t][b]);
            printf("\n");
        }
    }
    return 0;
}
