/*
 * test_moe.c — the MoE block (moe.c) on small in-memory GGUF images.
 *
 * es_moe_ffn against a double-precision reference computed from the
 * dequantized weights (F32 experts in layer 0, Q8_0 in layer 1), batch
 * invariance over batch sizes and thread counts, the F32-copy provider
 * (ES_EXPERTS_F32), a provider that mixes Q8_0 and F32 experts in one
 * layer and fails on demand, and the bind errors that name the tensor.
 */

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "native/native_internal.h"
#include "check.h"

enum { D = 64, F = 32, E = 4, K = 2, NL = 2, T = 9 };   // n_embd, n_ff, experts, top-k, layers, tokens

static const int32_t LAYER_TYPE[NL] = { ES_TYPE_F32, ES_TYPE_Q8_0 };

/* ---- a GGUF image of the experts ------------------------------------------------ */

typedef struct buf { uint8_t * p; size_t n, cap; } buf;

static void put(buf * b, const void * src, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        if (!b->p) abort();
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}
static void put_u32(buf * b, uint32_t v) { put(b, &v, 4); }   // the tests run little-endian
static void put_u64(buf * b, uint64_t v) { put(b, &v, 8); }
static void put_str(buf * b, const char * s) { put_u64(b, strlen(s)); put(b, s, strlen(s)); }

typedef struct tensor {
    char     name[48];
    int64_t  ne[3];
    int32_t  type;
    float  * w;      // (ne2, ne1, ne0) values, stored as type
} tensor;

static float rnd(uint64_t * s) {   // uniform in [-1, 1)
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float) ((*s >> 40) & 0xFFFFFF) / (float) 0x800000 - 1.0f;
}

// Rows of n values as `type` bytes: F32 as is, Q8_0 through es_quantize_act
// (the activation format of Q8_0 weights is Q8_0 itself).
static void put_rows(buf * b, int32_t type, const float * w, int64_t rows, int64_t n) {
    const size_t rb = es_type_row_bytes(type, n);
    uint8_t * row = malloc(rb);
    for (int64_t r = 0; r < rows; r++) {
        if (type == ES_TYPE_F32) memcpy(row, w + r * n, rb);
        else es_quantize_act(type, w + r * n, row, n);
        put(b, row, rb);
    }
    free(row);
}

static buf image(const tensor * ts, int n_tensors) {
    buf b = {0};
    put(&b, "GGUF", 4);
    put_u32(&b, 3);
    put_u64(&b, (uint64_t) n_tensors);
    put_u64(&b, 0);
    uint64_t offset = 0;
    for (int i = 0; i < n_tensors; i++) {
        const tensor * t = &ts[i];
        put_str(&b, t->name);
        const uint32_t n_dims = t->ne[2] > 1 ? 3 : 2;
        put_u32(&b, n_dims);
        for (uint32_t d = 0; d < n_dims; d++) put_u64(&b, (uint64_t) t->ne[d]);
        put_u32(&b, (uint32_t) t->type);
        put_u64(&b, offset);
        offset += es_type_row_bytes(t->type, t->ne[0]) * (size_t) (t->ne[1] * t->ne[2]);
        offset = (offset + 31) / 32 * 32;
    }
    const uint8_t zero = 0;
    while (b.n % 32) put(&b, &zero, 1);
    for (int i = 0; i < n_tensors; i++) {
        const tensor * t = &ts[i];
        put_rows(&b, t->type, t->w, t->ne[1] * t->ne[2], t->ne[0]);
        while (b.n % 32) put(&b, &zero, 1);
    }
    return b;
}

// The standard model: per layer a router (E, D) F32 and expert stacks of LAYER_TYPE.
static int make_tensors(tensor * ts, uint64_t seed) {
    static const char * const KIND[4] = { "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps",
                                          "ffn_down_exps" };
    int n = 0;
    for (int il = 0; il < NL; il++) {
        for (int k = 0; k < 4; k++) {
            tensor * t = &ts[n++];
            snprintf(t->name, sizeof t->name, "blk.%d.%s.weight", il, KIND[k]);
            const int64_t ne0 = k == 3 ? F : D, ne1 = k == 0 ? E : (k == 3 ? D : F);
            t->ne[0] = ne0; t->ne[1] = ne1; t->ne[2] = k == 0 ? 1 : E;
            t->type = k == 0 ? ES_TYPE_F32 : LAYER_TYPE[il];
            const int64_t count = ne0 * ne1 * t->ne[2];
            t->w = malloc((size_t) count * sizeof *t->w);
            // Entries ~ U(-1, 1) * sqrt(3 / fan_in): unit-scale outputs; a wider router.
            const float scale = (k == 0 ? 3.0f : 1.0f) * sqrtf(3.0f / (float) ne0);
            for (int64_t i = 0; i < count; i++) t->w[i] = rnd(&seed) * scale;
        }
    }
    return n;
}

/* ---- the reference ----------------------------------------------------------------- */

// Weights as the file stores them, dequantized: slab e of tensor t, (ne1, ne0).
static void dequant(const es_tensor * t, int64_t e, float * out) {
    const size_t rb = es_type_row_bytes(t->type, t->ne[0]);
    for (int64_t r = 0; r < t->ne[1]; r++) {
        es_dequantize_row(t->type, (const char *) t->data + (size_t) (e * t->ne[1] + r) * rb,
                          out + r * t->ne[0], t->ne[0]);
    }
}

static const es_tensor * find(const es_gguf * g, int il, const char * kind) {
    char name[48];
    snprintf(name, sizeof name, "blk.%d.%s.weight", il, kind);
    return es_gguf_find_tensor(g, name);
}

// out (D) for input x (D) of layer il: softmax router, top K, renormalized,
// sum of weighted SwiGLU experts, all in double.
static void reference(const es_gguf * g, int il, const float * x, double * out) {
    static float R[E * D], Wg[F * D], Wu[F * D], Wd[D * F];
    dequant(find(g, il, "ffn_gate_inp"), 0, R);
    double p[E], max = -INFINITY, sum = 0;
    for (int e = 0; e < E; e++) {
        p[e] = 0;
        for (int i = 0; i < D; i++) p[e] += (double) R[e * D + i] * x[i];
        max = fmax(max, p[e]);
    }
    for (int e = 0; e < E; e++) sum += p[e] = exp(p[e] - max);
    bool taken[E] = { false };
    int chosen[K];
    double wsum = 0;
    for (int j = 0; j < K; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
        taken[best] = true;
        chosen[j] = best;
        wsum += p[best] / sum;
    }
    memset(out, 0, D * sizeof *out);
    for (int j = 0; j < K; j++) {
        const int e = chosen[j];
        dequant(find(g, il, "ffn_gate_exps"), e, Wg);
        dequant(find(g, il, "ffn_up_exps"), e, Wu);
        dequant(find(g, il, "ffn_down_exps"), e, Wd);
        double h[F];
        for (int r = 0; r < F; r++) {
            double a = 0, b = 0;
            for (int i = 0; i < D; i++) {
                a += (double) Wg[r * D + i] * x[i];
                b += (double) Wu[r * D + i] * x[i];
            }
            h[r] = a / (1 + exp(-a)) * b;
        }
        for (int r = 0; r < D; r++) {
            double y = 0;
            for (int i = 0; i < F; i++) y += (double) Wd[r * F + i] * h[i];
            out[r] += p[e] / sum / wsum * y;
        }
    }
}

/* ---- tests ---------------------------------------------------------------------------- */

static es_moe_params params(void) {
    es_moe_params p = { .n_layer = NL, .n_expert = E, .n_expert_used = K, .n_embd = D,
                        .n_ff = F, .norm_w = true };
    return p;
}

// out (T, D) of layer il for the T tokens of x, in batches of `batch` tokens,
// with experts served as `experts` (enum es_experts_mode) says.
static void run_experts(const es_gguf * g, int32_t experts, int n_threads, int batch, int il,
                        const float * x, float * out) {
    es_moe_params p = params();
    p.experts = experts;
    es_experts * ex = NULL;
    es_moe * moe = NULL;
    es_pool * pool = NULL;
    CHECK(es_experts_init(g, &p, &ex, NULL, 0) == ES_OK);
    CHECK(es_moe_init(ex, batch, &moe) == ES_OK);
    CHECK(es_pool_init(n_threads, &pool) == ES_OK);
    for (int t = 0; t < T; t += batch) {
        const int n = T - t < batch ? T - t : batch;
        CHECK(es_moe_ffn(moe, pool, il, x + t * D, n, out + t * D) == ES_OK);
    }
    es_pool_free(pool);
    es_moe_free(moe);
    es_experts_free(ex);
}

static void run(const es_gguf * g, int n_threads, int batch, int il, const float * x, float * out) {
    run_experts(g, ES_EXPERTS_MAPPED, n_threads, batch, il, x, out);
}

static void test_against_reference(const es_gguf * g, const float * x) {
    static float out[T * D];
    for (int il = 0; il < NL; il++) {
        run(g, 2, T, il, x, out);
        double max_diff = 0, max_ref = 0;
        for (int t = 0; t < T; t++) {
            double ref[D];
            reference(g, il, x + t * D, ref);
            for (int i = 0; i < D; i++) {
                max_diff = fmax(max_diff, fabs(ref[i] - out[t * D + i]));
                max_ref = fmax(max_ref, fabs(ref[i]));
            }
        }
        // F32 experts: float rounding only. Q8_0: activations are quantized
        // to 8 bits too, as llama.cpp does.
        CHECK(max_ref > 0.1);
        CHECK(max_diff <= (LAYER_TYPE[il] == ES_TYPE_F32 ? 1e-5 : 3e-2) * max_ref);
    }
}

static void test_batch_invariance(const es_gguf * g, const float * x) {
    static float want[T * D], got[T * D];
    for (int il = 0; il < NL; il++) {
        run(g, 1, T, il, x, want);
        const int batches[] = { 1, 2, 4 }, threads[] = { 1, 2, 3 };
        for (int b = 0; b < N_ELEMS(batches); b++) {
            for (int n = 0; n < N_ELEMS(threads); n++) {
                run(g, threads[n], batches[b], il, x, got);
                CHECK(memcmp(want, got, sizeof want) == 0);
            }
        }
    }
}

static void test_f32_provider(const es_gguf * g, const float * x) {
    static float mapped[T * D], copies[T * D];
    for (int il = 0; il < NL; il++) {
        run(g, 2, T, il, x, mapped);
        run_experts(g, ES_EXPERTS_F32, 2, T, il, x, copies);
        if (LAYER_TYPE[il] == ES_TYPE_F32) {
            CHECK(memcmp(mapped, copies, sizeof mapped) == 0);   // the same weights and kernels
        } else {
            double max_diff = 0;
            for (int i = 0; i < T * D; i++) max_diff = fmax(max_diff, fabs(mapped[i] - copies[i]));
            CHECK(max_diff > 0 && max_diff < 3e-2);    // F32 activations instead of Q8_0
        }
    }
    es_moe_params p = params();
    p.experts = 7;
    es_experts * ex = NULL;
    char err[128];
    CHECK(es_experts_init(g, &p, &ex, err, sizeof err) == ES_ERR_INVALID_ARG);
    CHECK(ex == NULL && strstr(err, "unknown experts mode 7") != NULL);
}

/* A provider over the default one, as an expert cache is: the even experts
 * of layer 1 come as F32 copies, so one layer mixes Q8_0 and F32 experts
 * (a mixed-precision cache); the get after fail_after gets fails; gets and
 * puts are counted. */
typedef struct mixed {
    es_expert_provider inner;
    int fail_after;    // -1: never
    bool bad_type;     // label layer 1's views Q8_K, an activation-only format
    int n_get, n_put;
} mixed;

static bool mixed_copies(int32_t il, int32_t e) { return il == 1 && e % 2 == 0; }

static int mixed_get(void * self, int32_t il, int32_t e, int32_t which, es_expert_view * out) {
    mixed * m = self;
    if (m->n_get == m->fail_after) return ES_ERR_NO_MEMORY;
    const int rc = m->inner.get(m->inner.self, il, e, which, out);
    if (rc != ES_OK) return rc;
    m->n_get++;
    if (m->bad_type) {
        out->type = ES_TYPE_Q8_K;
        return ES_OK;
    }
    if (mixed_copies(il, e)) {
        const int64_t n = which == ES_EXPERT_DOWN ? F : D, rows = which == ES_EXPERT_DOWN ? D : F;
        const size_t rb = es_type_row_bytes(out->type, n);
        float * copy = malloc((size_t) (rows * n) * sizeof *copy);
        for (int64_t r = 0; r < rows; r++) {
            es_dequantize_row(out->type, (const char *) out->data + r * rb, copy + r * n, n);
        }
        m->inner.put(m->inner.self, il, e, which, out);
        out->data = copy;
        out->type = ES_TYPE_F32;
    }
    return ES_OK;
}

static void mixed_put(void * self, int32_t il, int32_t e, int32_t which,
                      const es_expert_view * view) {
    mixed * m = self;
    m->n_put++;
    if (mixed_copies(il, e) && !m->bad_type) free((void *) view->data);
    else m->inner.put(m->inner.self, il, e, which, view);
}

// out (T, D) of layer 1 through the mixed provider, in batches of `batch`;
// returns the first status other than ES_OK.
static int run_mixed(const es_gguf * g, mixed * mx, int batch, const float * x, float * out) {
    es_moe_params p = params();
    es_experts * ex = NULL;
    es_moe * moe = NULL;
    es_pool * pool = NULL;
    CHECK(es_experts_init(g, &p, &ex, NULL, 0) == ES_OK);
    CHECK(es_moe_init(ex, batch, &moe) == ES_OK);
    CHECK(es_pool_init(2, &pool) == ES_OK);
    mx->inner = *es_experts_provider(ex);
    const es_expert_provider pv = { .self = mx, .get = mixed_get, .put = mixed_put };
    es_experts_set_provider(ex, &pv);
    int rc = ES_OK;
    for (int t = 0; t < T && rc == ES_OK; t += batch) {
        const int n = T - t < batch ? T - t : batch;
        rc = es_moe_ffn(moe, pool, 1, x + t * D, n, out + t * D);
        CHECK(mx->n_get == mx->n_put);   // every view handed back, on success or not
    }
    es_pool_free(pool);
    es_moe_free(moe);
    es_experts_free(ex);
    return rc;
}

static void test_mixed_precision_provider(const es_gguf * g, const float * x) {
    static float mapped[T * D], got[T * D], single[T * D];
    run(g, 2, T, 1, x, mapped);
    mixed mx = { .fail_after = -1 };
    CHECK(run_mixed(g, &mx, T, x, got) == ES_OK);
    CHECK(mx.n_get > 0);
    double max_diff = 0, max_ref = 0;
    for (int t = 0; t < T; t++) {
        double ref[D];
        reference(g, 1, x + t * D, ref);
        for (int i = 0; i < D; i++) {
            max_diff = fmax(max_diff, fabs(ref[i] - got[t * D + i]));
            max_ref = fmax(max_ref, fabs(ref[i]));
        }
    }
    CHECK(max_diff <= 3e-2 * max_ref);
    CHECK(memcmp(mapped, got, sizeof got) != 0);   // the F32 copies were used
    // Batch invariance holds with experts of two types in one layer.
    mixed one = { .fail_after = -1 };
    CHECK(run_mixed(g, &one, 1, x, single) == ES_OK);
    CHECK(memcmp(got, single, sizeof got) == 0);
    // A get that fails: es_moe_ffn returns its status, having put back every
    // view it got, the failing expert's earlier matrices included.
    for (int fail_after = 0; fail_after < 7; fail_after++) {
        mixed bad = { .fail_after = fail_after };
        CHECK(run_mixed(g, &bad, T, x, got) == ES_ERR_NO_MEMORY);
        CHECK(bad.n_get == fail_after && bad.n_put == fail_after);
    }
    // A view of a type es_matvec does not take: refused before any product.
    mixed odd = { .fail_after = -1, .bad_type = true };
    CHECK(run_mixed(g, &odd, T, x, got) == ES_ERR_UNSUPPORTED);
    CHECK(odd.n_get > 0 && odd.n_get == odd.n_put);
}

static void test_arguments(const es_gguf * g, const float * x) {
    es_moe_params p = params();
    es_experts * ex = NULL;
    es_moe * moe = NULL;
    es_pool * pool = NULL;
    static float out[T * D];
    CHECK(es_experts_init(g, &p, &ex, NULL, 0) == ES_OK);
    CHECK(es_experts_params(ex)->n_ff == F);
    CHECK(es_moe_init(ex, 4, &moe) == ES_OK);
    CHECK(es_pool_init(2, &pool) == ES_OK);
    CHECK(es_moe_ffn(moe, pool, 0, x, 5, out) == ES_ERR_INVALID_ARG);   // > n_batch
    CHECK(es_moe_ffn(moe, pool, NL, x, 1, out) == ES_ERR_INVALID_ARG);  // no such layer
    CHECK(es_moe_ffn(moe, pool, -1, x, 1, out) == ES_ERR_INVALID_ARG);
    CHECK(es_moe_ffn(moe, pool, 0, x, 0, out) == ES_OK);
    es_pool_free(pool);
    es_moe_free(moe);
    es_experts_free(ex);

    char err[160];
    p.n_expert_used = E + 1;
    CHECK(es_experts_init(g, &p, &ex, err, sizeof err) == ES_ERR_FORMAT && ex == NULL);
    CHECK(strstr(err, "5 used of 4 experts") != NULL);
    p = params();
    p.n_ff = F * 2;   // the file's experts are narrower
    CHECK(es_experts_init(g, &p, &ex, err, sizeof err) == ES_ERR_FORMAT && ex == NULL);
    CHECK(strstr(err, "blk.0.ffn_gate_exps.weight has shape (64, 32, 4, 1)") != NULL);
    p = params();
    p.n_layer = NL + 1;
    CHECK(es_experts_init(g, &p, &ex, err, sizeof err) == ES_ERR_FORMAT && ex == NULL);
    CHECK(strstr(err, "blk.2.ffn_gate_inp.weight is missing") != NULL);
}

int main(void) {
    tensor ts[NL * 4];
    const int n = make_tensors(ts, 42);
    buf b = image(ts, n);
    es_gguf * g = NULL;
    char err[128];
    CHECK(es_gguf_open_buffer(b.p, b.n, &g, err, sizeof err) == ES_OK);
    if (g) {
        static float x[T * D];
        uint64_t seed = 7;
        for (int i = 0; i < T * D; i++) x[i] = rnd(&seed) * 1.7f;   // unit-RMS rows
        test_against_reference(g, x);
        test_batch_invariance(g, x);
        test_f32_provider(g, x);
        test_mixed_precision_provider(g, x);
        test_arguments(g, x);
        es_gguf_close(g);
    }
    for (int i = 0; i < n; i++) free(ts[i].w);
    free(b.p);
    return check_report("test_moe");
}
