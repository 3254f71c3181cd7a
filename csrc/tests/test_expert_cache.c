/*
 * test_expert_cache.c — the expert cache (expert_cache.c) on a small MoE
 * file written to a temporary path.
 *
 * Scripted routing traces drive its provider directly: what get() hands out
 * is the file's bytes, the budget is never exceeded and one below a layer's
 * active experts is refused naming the minimum, the adaptive policy keeps
 * hits where LRU has none on the layers' cycle, prefetched experts are hits
 * and counted as used, a file changed on disk is reported, and es_moe_ffn
 * through the cache (in groups when a batch's experts exceed the slots)
 * matches the mapped experts bit for bit. Built with -DEDGESPEC_TSAN=ON it
 * checks the I/O thread under ThreadSanitizer.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "native/native_internal.h"
#include "check.h"
#include "gguf_bytes.h"

enum { D = 32, F = 32, E = 4, K = 2, NL = 4, T = 6 };   // n_embd, n_ff, experts, top-k, layers, tokens
enum { SLOT = 3 * D * F * 4 };                          // bytes of one F32 expert (a multiple of 64)

static float rnd(uint64_t * s) {   // uniform in [-1, 1)
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float) ((*s >> 40) & 0xFFFFFF) / (float) 0x800000 - 1.0f;
}

// A GGUF of NL layers of F32 routers and experts, written to a temporary file.
static void write_model(char * path) {
    static const char * const KIND[4] = { "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps",
                                          "ffn_down_exps" };
    buf b = {0};
    put(&b, "GGUF", 4);
    put_le(&b, 3, 4);
    put_le(&b, NL * 4, 8);
    put_le(&b, 0, 8);
    uint64_t offset = 0;
    int64_t ne[NL * 4][3];
    for (int i = 0; i < NL * 4; i++) {
        const int k = i % 4;
        char name[48];
        snprintf(name, sizeof name, "blk.%d.%s.weight", i / 4, KIND[k]);
        ne[i][0] = k == 3 ? F : D;
        ne[i][1] = k == 0 ? E : (k == 3 ? D : F);
        ne[i][2] = k == 0 ? 1 : E;
        put_str(&b, name);
        put_le(&b, k == 0 ? 2 : 3, 4);
        for (int d = 0; d < (k == 0 ? 2 : 3); d++) put_le(&b, (uint64_t) ne[i][d], 8);
        put_le(&b, ES_TYPE_F32, 4);
        put_le(&b, offset, 8);
        offset += (uint64_t) (ne[i][0] * ne[i][1] * ne[i][2]) * 4;
    }
    const uint8_t zero = 0;
    while (b.n % 32) put(&b, &zero, 1);
    uint64_t seed = 11;
    for (int i = 0; i < NL * 4; i++) {
        const int64_t count = ne[i][0] * ne[i][1] * ne[i][2];
        const float scale = (i % 4 == 0 ? 3.0f : 1.0f) * 0.3f;
        for (int64_t j = 0; j < count; j++) {
            const float v = rnd(&seed) * scale;
            put(&b, &v, 4);
        }
    }
    strcpy(path, "/tmp/es-test-expert-cache-XXXXXX");
    const int fd = mkstemp(path);
    CHECK(fd >= 0 && write(fd, b.p, b.n) == (ssize_t) b.n);
    close(fd);
    free(b.p);
}

typedef struct fixture {
    char         path[64];
    es_gguf    * g;
    es_experts * ex;
} fixture;

static es_moe_params moe_params(void) {
    return (es_moe_params) { .n_layer = NL, .n_expert = E, .n_expert_used = K, .n_embd = D,
                             .n_ff = F, .norm_w = true };
}

static es_model_params cache_params(int64_t budget, int32_t policy, int32_t depth) {
    es_model_params p = es_model_default_params();
    p.expert_cache_bytes = budget;
    p.expert_policy = policy;
    p.prefetch_depth = depth;
    return p;
}

static es_expert_cache * open_cache(const fixture * fx, int64_t budget, int32_t policy,
                                    int32_t depth) {
    es_model_params p = cache_params(budget, policy, depth);
    es_expert_cache * c = NULL;
    char err[256];
    const int rc = es_expert_cache_init(fx->g, fx->path, fx->ex, &p, &c, err, sizeof err);
    CHECK(rc == ES_OK);
    if (rc != ES_OK) fprintf(stderr, "es_expert_cache_init: %s\n", err);
    return c;
}

// One layer's lookups of `experts` (n of them): begin, every get (checked
// against the file's bytes), end.
static void step(const fixture * fx, es_expert_cache * c, int32_t il, int32_t n,
                 const int32_t * experts) {
    const es_expert_provider * pv = es_expert_cache_provider(c);
    float imp[E];
    for (int i = 0; i < n; i++) imp[i] = 0.5f;
    CHECK(pv->begin(pv->self, il, 1, n, experts, imp) == ES_OK);
    for (int i = 0; i < n; i++) {
        for (int w = 0; w < 3; w++) {
            es_expert_view v;
            CHECK(pv->get(pv->self, il, experts[i], w, &v) == ES_OK);
            const es_tensor * t = es_experts_tensor(fx->ex, il, w);
            const size_t slab = t->nbytes / E;
            CHECK(v.type == ES_TYPE_F32);
            CHECK(memcmp(v.data, (const char *) t->data + (size_t) experts[i] * slab, slab) == 0);
            pv->put(pv->self, il, experts[i], w, &v);
        }
    }
    pv->end(pv->self, il);
}

static void test_budget(const fixture * fx) {
    // Below one layer's K experts: refused, naming the minimum.
    es_model_params p = cache_params(K * SLOT - 1, ES_POLICY_ADAPTIVE, 0);
    es_expert_cache * c = NULL;
    char err[256] = "";
    CHECK(es_expert_cache_init(fx->g, fx->path, fx->ex, &p, &c, err, sizeof err) ==
          ES_ERR_INVALID_ARG);
    CHECK(c == NULL);
    CHECK(strstr(err, "minimum of 0.03 MB") != NULL);
    // Balanced precision without a sidecar: refused.
    p = cache_params(4 * SLOT, ES_POLICY_ADAPTIVE, 0);
    p.expert_precision = ES_PRECISION_BALANCED;
    CHECK(es_expert_cache_init(fx->g, fx->path, fx->ex, &p, &c, err, sizeof err) ==
          ES_ERR_INVALID_ARG);
    CHECK(strstr(err, "sidecar") != NULL);

    // The slots fit the budget, and stay what they are through any trace.
    const int64_t budget = 5 * SLOT + 100;
    c = open_cache(fx, budget, ES_POLICY_ADAPTIVE, 0);
    if (!c) return;
    uint64_t seed = 3;
    for (int i = 0; i < 200; i++) {
        const int32_t a = (int32_t) ((rnd(&seed) + 1.0f) * 0.5f * E) % E;
        const int32_t ex[2] = { a < (a + 1) % E ? a : (a + 1) % E, a < (a + 1) % E ? (a + 1) % E : a };
        step(fx, c, i % NL, 2, ex);
    }
    es_expert_stats st;
    es_expert_cache_stats(c, &st);
    CHECK(st.n_slots == 5);
    CHECK(st.cache_bytes == 5 * SLOT && st.cache_bytes <= budget);
    CHECK(st.lookups == 400);
    CHECK(st.hits + st.loads == st.lookups);      // no prefetch: every miss one read
    CHECK(st.bytes_read == st.loads * SLOT);
    CHECK(st.loads - st.evictions <= st.n_slots);  // never more held than slots
    es_expert_cache_free(c);
}

// The layers' cycle over 8 experts with 6 slots: LRU always evicts the one
// needed next and never hits; the adaptive policy evicts the layer just
// used (the furthest from its next use) and keeps hitting.
static int64_t cycle_hits(const fixture * fx, int32_t policy) {
    es_expert_cache * c = open_cache(fx, 6 * SLOT, policy, 0);
    if (!c) return -1;
    const int32_t ex[2] = { 1, 3 };
    for (int token = 0; token < 20; token++) {
        for (int il = 0; il < NL; il++) step(fx, c, il, 2, ex);
    }
    es_expert_stats st;
    es_expert_cache_stats(c, &st);
    es_expert_cache_free(c);
    return st.hits;
}

static void test_policy(const fixture * fx) {
    const int64_t lru = cycle_hits(fx, ES_POLICY_LRU), adaptive = cycle_hits(fx, ES_POLICY_ADAPTIVE);
    CHECK(lru == 0);
    CHECK(adaptive >= 19 * 3);  // after the first token, at least 3 of every 8 lookups
}

static void test_prefetch(const fixture * fx) {
    es_expert_cache * c = open_cache(fx, 8 * SLOT, ES_POLICY_ADAPTIVE, 2);
    if (!c) return;
    const es_expert_provider * pv = es_expert_cache_provider(c);
    CHECK(pv->prefetch != NULL && pv->prefetch_depth(pv->self) == 1);
    const int32_t first[2] = { 0, 1 }, predicted[2] = { 2, 3 }, wrong[1] = { 0 };
    const float imp[2] = { 0.6f, 0.4f };
    step(fx, c, 0, 2, first);
    pv->prefetch(pv->self, 1, 2, predicted, imp);
    pv->prefetch(pv->self, 2, 1, wrong, imp);
    step(fx, c, 1, 2, predicted);   // both prefetched: hits
    const int32_t used[2] = { 1, 2 };
    step(fx, c, 2, 2, used);        // the prediction was wrong: misses
    es_expert_stats st;
    es_expert_cache_stats(c, &st);
    CHECK(st.prefetches == 3);
    CHECK(st.prefetch_used == 2);
    CHECK(st.hits == 2);
    CHECK(st.loads >= 2 + 2 + 2);   // the wrong prefetch may still be on its way
    es_expert_cache_free(c);
}

static void test_file_changed(fixture * fx) {
    es_expert_cache * c = open_cache(fx, 2 * SLOT, ES_POLICY_LRU, 0);
    if (!c) return;
    const int32_t ex[2] = { 0, 1 };
    step(fx, c, 0, 2, ex);
    const struct timespec times[2] = { { 0, UTIME_OMIT }, { 12345, 0 } };   // a new mtime
    CHECK(utimensat(AT_FDCWD, fx->path, times, 0) == 0);
    const es_expert_provider * pv = es_expert_cache_provider(c);
    const float imp[2] = { 0.5f, 0.5f };
    CHECK(pv->begin(pv->self, 1, 1, 2, ex, imp) == ES_OK);
    es_expert_view v;
    CHECK(pv->get(pv->self, 1, 0, 0, &v) == ES_ERR_IO);
    pv->end(pv->self, 1);
    CHECK(strstr(es_expert_cache_error(c), "changed on disk") != NULL);
    es_expert_cache_free(c);
}

// es_moe_ffn through the cache against the mapped experts, over batches
// whose experts exceed the slots (groups of max_held) and decode steps
// with prefetch, on two threads.
static void test_moe_ffn(const fixture * fx) {
    static float x[T * D], want[T * D], got[T * D];
    uint64_t seed = 5;
    for (int i = 0; i < T * D; i++) x[i] = rnd(&seed) * 1.7f;
    es_moe * moe = NULL;
    es_pool * pool = NULL;
    CHECK(es_pool_init(2, &pool) == ES_OK);
    CHECK(es_moe_init(fx->ex, T, &moe) == ES_OK);
    if (!pool || !moe) return;
    const int32_t budgets[2] = { 2, 5 };
    for (int b = 0; b < 2; b++) {
        es_expert_cache * c = open_cache(fx, budgets[b] * SLOT, ES_POLICY_ADAPTIVE, 2);
        if (!c) continue;
        const es_expert_provider mapped = *es_experts_provider(fx->ex);
        for (int rep = 0; rep < 3; rep++) {
            for (int il = 0; il < NL; il++) {
                es_experts_set_provider(fx->ex, &mapped);
                CHECK(es_moe_ffn(moe, pool, il, x, T, want) == ES_OK);
                es_experts_set_provider(fx->ex, es_expert_cache_provider(c));
                CHECK(es_moe_ffn(moe, pool, il, x, T, got) == ES_OK);    // the batch
                CHECK(memcmp(want, got, sizeof want) == 0);
                for (int t = 0; t < T; t++) {                             // token by token
                    CHECK(es_moe_ffn(moe, pool, il, x + t * D, 1, got + t * D) == ES_OK);
                }
                CHECK(memcmp(want, got, sizeof want) == 0);
            }
        }
        es_experts_set_provider(fx->ex, &mapped);
        es_expert_stats st;
        es_expert_cache_stats(c, &st);
        CHECK(st.cache_bytes <= budgets[b] * SLOT);
        CHECK(b == 0 || st.prefetches > 0);   // two slots: both held by every batch
        es_expert_cache_free(c);
    }
    es_moe_free(moe);
    es_pool_free(pool);
}

int main(void) {
    fixture fx = {0};
    write_model(fx.path);
    char err[256];
    CHECK(es_gguf_open(fx.path, &fx.g, err, sizeof err) == ES_OK);
    const es_moe_params mp = moe_params();
    if (fx.g) CHECK(es_experts_init(fx.g, &mp, &fx.ex, err, sizeof err) == ES_OK);
    if (fx.ex) {
        test_budget(&fx);
        test_policy(&fx);
        test_prefetch(&fx);
        test_moe_ffn(&fx);
        test_file_changed(&fx);   // last: it changes the file
    }
    es_experts_free(fx.ex);
    es_gguf_close(fx.g);
    unlink(fx.path);
    return check_report("test_expert_cache");
}
