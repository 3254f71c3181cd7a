/*
 * test_engine.c — the native engine (model.c, arch/<name>.c) on the real
 * models in $EDGESPEC_TEST_MODELS_DIR (set by tests/test_c_core.py; every
 * one of them must load), under ASan and UBSan there:
 *   - a token's logits are bit-identical alone, in a chain batch and in a
 *     tree batch among decoy siblings (batch invariance), with 1 or 2 threads;
 *   - truncate rolls back exactly; bad tokens, parents, sizes and a full
 *     context are refused with the cache as before;
 *   - an embeddings context gives hidden states instead of logits, the same
 *     for a sequence alone and packed beside another in one batch (two roots);
 *   - a context keeping features gives, beside unchanged logits, the rows an
 *     embeddings pass gives (a chain, logits_from past 0, a tree); none
 *     until asked;
 *   - logits bit-identical with the weights repacked and not; a repack past
 *     repack_max_bytes refused with the sizes;
 *   - a missing file, a file of another format and bad params fail with a message.
 * Numerical parity with llama.cpp is tested from Python (tests/test_native.py).
 */
#define _POSIX_C_SOURCE 200809L

#include "native/native_internal.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "test_models.h"

enum { N_SEQ = 12, N_CTX = 64 };

static int32_t g_refused;  // models whose repack a tiny budget refused

static es_context * new_context(es_model * m, int32_t n_threads) {
    es_context_params p = es_context_default_params();
    p.n_ctx = N_CTX;
    p.n_batch = 32;
    p.n_threads = n_threads;
    es_context * ctx = NULL;
    CHECK(es_context_init(m, &p, &ctx) == ES_OK);
    return ctx;
}

// (n, n_vocab) copy of the last decode's logits.
static float * copy_logits(const es_context * ctx, int32_t n, int32_t n_vocab) {
    float * out = malloc((size_t) n * (size_t) n_vocab * sizeof *out);
    if (out) memcpy(out, es_context_logits(ctx), (size_t) n * (size_t) n_vocab * sizeof *out);
    return out;
}

static bool same_row(const float * a, const float * b, int32_t n_vocab) {
    return memcmp(a, b, (size_t) n_vocab * sizeof *a) == 0;
}

static es_context * new_embeddings_context(es_model * m) {
    es_context_params p = es_context_default_params();
    p.n_ctx = N_CTX;
    p.n_batch = 32;
    p.n_threads = 2;
    p.embeddings = true;
    es_context * ctx = NULL;
    CHECK(es_context_init(m, &p, &ctx) == ES_OK);
    return ctx;
}

// Embeddings: (n, n_embd) hidden states, no logits; two sequences packed as
// two roots of one batch get the rows each gets alone.
static void check_embeddings(es_model * m, const es_token * seq) {
    es_context * ctx = new_embeddings_context(m);
    if (!ctx) return;
    const int32_t D = es_model_n_embd(m), A = 5, B = N_SEQ - A;
    CHECK(D > 0);
    CHECK(es_context_embeddings(ctx) == NULL);   // before any decode
    float * alone = malloc((size_t) N_SEQ * (size_t) D * sizeof *alone);
    CHECK(es_decode(ctx, seq, NULL, A, 0) == ES_OK);
    CHECK(es_context_logits(ctx) == NULL && es_context_embeddings(ctx) != NULL);
    if (alone) memcpy(alone, es_context_embeddings(ctx), (size_t) A * D * sizeof *alone);
    CHECK(es_context_truncate(ctx, 0) == ES_OK);
    CHECK(es_decode(ctx, seq + A, NULL, B, 0) == ES_OK);
    if (alone) memcpy(alone + (size_t) A * D, es_context_embeddings(ctx), (size_t) B * D * sizeof *alone);

    CHECK(es_context_truncate(ctx, 0) == ES_OK);
    int32_t parents[N_SEQ];
    for (int32_t i = 0; i < N_SEQ; i++) parents[i] = i == 0 || i == A ? -1 : i - 1;
    CHECK(es_decode(ctx, seq, parents, N_SEQ, 0) == ES_OK);
    const float * packed = es_context_embeddings(ctx);
    CHECK(packed != NULL);
    if (alone && packed) CHECK(memcmp(alone, packed, (size_t) N_SEQ * D * sizeof *alone) == 0);
    bool finite = true;
    for (int64_t i = 0; packed && i < (int64_t) N_SEQ * D; i++) finite = finite && packed[i] == packed[i];
    CHECK(finite);
    // Rows from logits_from on only.
    CHECK(es_context_truncate(ctx, 0) == ES_OK);
    CHECK(es_decode(ctx, seq, NULL, A, A - 1) == ES_OK);
    if (alone) CHECK(memcmp(es_context_embeddings(ctx), alone + (size_t) (A - 1) * D, (size_t) D * sizeof *alone) == 0);
    free(alone);
    es_context_free(ctx);
}

// Features (es_context_keep_features): a logits context's kept rows'
// hidden states equal the embeddings pass's of the same tokens, bit for
// bit, for a chain from logits_from and for a tree's nodes; the logits are
// those of a context not keeping them; none before it is asked.
static void check_features(es_model * m, const es_token * seq) {
    const int32_t D = es_model_n_embd(m), nv = es_model_n_vocab(m), A = 5;
    es_context * emb = new_embeddings_context(m);
    es_context * ctx = new_context(m, 2);
    if (!emb || !ctx) { es_context_free(emb); es_context_free(ctx); return; }
    // The embeddings pass: every token of seq as one chain.
    CHECK(es_decode(emb, seq, NULL, N_SEQ, 0) == ES_OK);
    float * want = malloc((size_t) N_SEQ * D * sizeof *want);
    if (want) memcpy(want, es_context_embeddings(emb), (size_t) N_SEQ * D * sizeof *want);

    CHECK(es_decode(ctx, seq, NULL, A, 2) == ES_OK);
    CHECK(es_context_embeddings(ctx) == NULL);            // off by default
    float * plain = copy_logits(ctx, A - 2, nv);
    es_context_keep_features(ctx, true);
    CHECK(es_context_truncate(ctx, 0) == ES_OK);
    CHECK(es_decode(ctx, seq, NULL, A, 2) == ES_OK);      // rows 2..4
    const float * f = es_context_embeddings(ctx);
    CHECK(f != NULL);
    if (f && want) CHECK(memcmp(f, want + (size_t) 2 * D, (size_t) (A - 2) * D * sizeof *f) == 0);
    if (plain) CHECK(memcmp(es_context_logits(ctx), plain, (size_t) (A - 2) * nv * sizeof *plain) == 0);
    // A tree after the chain: root seq[A], children seq[A + 1] (a decoy
    // sibling, seq[A + 3]) and grandchild seq[A + 2]: the path's nodes are
    // the chain's tokens A .. A + 2.
    const es_token tree[4] = { seq[A], seq[A + 1], seq[A + 3], seq[A + 2] };
    const int32_t parents[4] = { -1, 0, 0, 1 };
    CHECK(es_decode(ctx, tree, parents, 4, 0) == ES_OK);
    f = es_context_embeddings(ctx);
    CHECK(f != NULL);
    if (f && want) {
        CHECK(memcmp(f, want + (size_t) A * D, (size_t) 2 * D * sizeof *f) == 0);
        CHECK(memcmp(f + (size_t) 3 * D, want + (size_t) (A + 2) * D, (size_t) D * sizeof *f) == 0);
    }
    CHECK(es_decode(ctx, seq, NULL, 1, 1) == ES_OK);      // no rows kept: none
    CHECK(es_context_embeddings(ctx) == NULL);
    es_context_keep_features(ctx, false);
    CHECK(es_decode(ctx, seq, NULL, 1, 0) == ES_OK);
    CHECK(es_context_embeddings(ctx) == NULL);
    free(plain);
    free(want);
    es_context_free(ctx);
    es_context_free(emb);
}

// A restricted output layer (es_model_set_output_rows): the kept ids' logits
// bit-identical to the full layer's, every other one -infinity; bad ids
// refused with the layer as it was; n = 0 gives every row back.
static void check_output_rows(es_model * m, const es_token * seq) {
    const int32_t nv = es_model_n_vocab(m);
    es_context * ctx = new_context(m, 2);
    if (!ctx) return;
    CHECK(es_decode(ctx, seq, NULL, 4, 0) == ES_OK);
    float * full = copy_logits(ctx, 4, nv);
    const es_token keep[5] = {nv - 1, 0, 7 % nv, 1000 % nv == 0 ? 1 : 1000 % nv, 3};
    const es_token twice[2] = {3, 3}, outside[1] = {nv};
    CHECK(es_model_set_output_rows(m, twice, 2) == ES_ERR_INVALID_ARG);
    CHECK(es_model_set_output_rows(m, outside, 1) == ES_ERR_INVALID_ARG);
    CHECK(es_model_set_output_rows(m, keep, 5) == ES_OK);
    CHECK(es_context_truncate(ctx, 0) == ES_OK);
    CHECK(es_decode(ctx, seq, NULL, 4, 0) == ES_OK);
    const float * got = es_context_logits(ctx);
    for (int32_t r = 0; r < 4 && full; r++) {
        int32_t finite = 0;
        for (int32_t i = 0; i < nv; i++) finite += got[(size_t) r * nv + i] > -INFINITY;
        CHECK(finite == 5);
        for (int32_t k = 0; k < 5; k++) {
            CHECK(got[(size_t) r * nv + keep[k]] == full[(size_t) r * nv + keep[k]]);
        }
    }
    CHECK(es_model_set_output_rows(m, NULL, 0) == ES_OK);
    CHECK(es_context_truncate(ctx, 0) == ES_OK);
    CHECK(es_decode(ctx, seq, NULL, 4, 0) == ES_OK);
    CHECK(full && memcmp(es_context_logits(ctx), full, (size_t) 4 * nv * sizeof *full) == 0);
    free(full);
    es_context_free(ctx);
}

// The model with its weights repacked (the default) and as they lie in the
// mapping give bit-identical logits for a chain batch; a repack past
// repack_max_bytes is refused with both sizes, before anything is loaded.
static void check_repack(const char * path, es_model * m, const es_token * seq) {
    char err[256];
    es_model_params p = es_model_default_params();
    CHECK(p.repack && p.repack_max_bytes == 0);
    p.repack = false;
    es_model * plain = NULL;
    CHECK(es_model_load(path, &p, &plain, err, sizeof err) == ES_OK);
    if (!plain) return;
    const int32_t nv = es_model_n_vocab(m);
    es_context * a = new_context(m, 2), * b = new_context(plain, 2);
    if (a && b) {
        CHECK(es_decode(a, seq, NULL, N_SEQ, 0) == ES_OK && es_decode(b, seq, NULL, N_SEQ, 0) == ES_OK);
        for (int32_t i = 0; i < N_SEQ; i++)
            CHECK(same_row(es_context_logits(a) + (size_t) i * nv, es_context_logits(b) + (size_t) i * nv, nv));
    }
    es_context_free(b);
    es_context_free(a);
    es_model_free(plain);

    p = es_model_default_params();
    p.repack_max_bytes = 1;
    es_model * refused = (es_model *) 1;
    err[0] = '\0';
    const int rc = es_model_load(path, &p, &refused, err, sizeof err);
    // Only a model with no matrix of a repacked layout loads.
    CHECK((rc == ES_OK && refused != NULL) ||
          (rc == ES_ERR_NO_MEMORY && refused == NULL && strstr(err, "needs") && strstr(err, "MiB")));
    if (rc == ES_OK) es_model_free(refused);
    g_refused += rc == ES_ERR_NO_MEMORY;
}

static void check_model(const char * path) {
    es_model * m = load_test_model(path);
    if (!m) return;
    const int32_t nv = es_model_n_vocab(m);
    es_token seq[N_SEQ];
    for (int32_t i = 0; i < N_SEQ; i++) seq[i] = (es_token) ((i * 7919 + 13) % nv);

    for (int32_t n_threads = 1; n_threads <= 2; n_threads++) {
        es_context * ctx = new_context(m, n_threads);
        if (!ctx) break;
        // One token at a time.
        float * alone = malloc((size_t) N_SEQ * (size_t) nv * sizeof *alone);
        for (int32_t i = 0; i < N_SEQ && alone; i++) {
            CHECK(es_decode(ctx, &seq[i], NULL, 1, 0) == ES_OK);
            memcpy(alone + (size_t) i * nv, es_context_logits(ctx), (size_t) nv * sizeof *alone);
        }
        CHECK(es_context_n_past(ctx) == N_SEQ);

        // The same tokens as one chain batch.
        CHECK(es_context_truncate(ctx, 0) == ES_OK);
        CHECK(es_decode(ctx, seq, NULL, N_SEQ, 0) == ES_OK);
        float * chain = copy_logits(ctx, N_SEQ, nv);
        for (int32_t i = 0; i < N_SEQ && chain && alone; i++) {
            CHECK(same_row(chain + (size_t) i * nv, alone + (size_t) i * nv, nv));
        }

        // A tree after seq[0..7]: the true path seq[8..11] interleaved with decoys.
        CHECK(es_context_truncate(ctx, 8) == ES_OK);
        const es_token d0 = (seq[8] + 1) % nv, d1 = (seq[9] + 1) % nv;
        const es_token tree[7] = { d0, seq[8], seq[9], d1, seq[10], d0, seq[11] };
        const int32_t parents[7] = { -1, -1, 1, 1, 2, 0, 4 };
        CHECK(es_decode(ctx, tree, parents, 7, 0) == ES_OK);
        const int32_t on_path[4] = { 1, 2, 4, 6 };
        for (int32_t j = 0; j < 4 && alone; j++) {
            CHECK(same_row(es_context_logits(ctx) + (size_t) on_path[j] * nv,
                           alone + (size_t) (8 + j) * nv, nv));
        }

        // Rollback past the tree, then the chain's last tokens again.
        CHECK(es_context_truncate(ctx, 8) == ES_OK);
        CHECK(es_decode(ctx, &seq[8], NULL, 4, 3) == ES_OK);
        if (alone) CHECK(same_row(es_context_logits(ctx), alone + (size_t) 11 * nv, nv));

        // Refusals leave the cache as it was.
        const es_token bad_tok[2] = { seq[0], nv };
        const int32_t bad_par[2] = { -1, 1 };
        CHECK(es_decode(ctx, bad_tok, NULL, 2, 0) == ES_ERR_INVALID_ARG);
        CHECK(es_decode(ctx, seq, bad_par, 2, 0) == ES_ERR_INVALID_ARG);
        CHECK(es_decode(ctx, seq, NULL, 0, 0) == ES_ERR_INVALID_ARG);
        CHECK(es_decode(ctx, seq, NULL, 33, 0) == ES_ERR_INVALID_ARG);    // > n_batch
        CHECK(es_decode(ctx, seq, NULL, 2, 3) == ES_ERR_INVALID_ARG);     // logits_from > n
        CHECK(es_context_truncate(ctx, 13) == ES_ERR_INVALID_ARG);
        CHECK(es_context_n_past(ctx) == N_SEQ);
        es_token fill[32];
        for (int32_t i = 0; i < 32; i++) fill[i] = seq[i % N_SEQ];
        CHECK(es_decode(ctx, fill, NULL, 32, 32) == ES_OK);               // no logits rows
        CHECK(es_decode(ctx, fill, NULL, 32, 31) == ES_ERR_CONTEXT_FULL); // 44 + 32 > 64
        CHECK(es_context_n_past(ctx) == N_SEQ + 32);

        free(chain);
        free(alone);
        es_context_free(ctx);
    }
    check_embeddings(m, seq);
    check_features(m, seq);
    check_output_rows(m, seq);
    check_repack(path, m, seq);
    es_model_free(m);
}

static void test_bad_files(void) {
    char err[256] = "";
    es_model * m = (es_model *) 1;
    CHECK(es_model_load("/nonexistent/model.gguf", NULL, &m, err, sizeof err) == ES_ERR_IO);
    CHECK(m == NULL && err[0] != '\0');
    // This very source file: not a GGUF.
    err[0] = '\0';
    m = (es_model *) 1;
    CHECK(es_model_load(__FILE__, NULL, &m, err, sizeof err) == ES_ERR_FORMAT);
    CHECK(m == NULL && err[0] != '\0');
    CHECK(es_model_load(NULL, NULL, &m, err, sizeof err) == ES_ERR_INVALID_ARG);
    es_model_params p = es_model_default_params();
    CHECK(p.experts == ES_EXPERTS_MAPPED);
    p.experts = 9;
    m = (es_model *) 1;
    CHECK(es_model_load(__FILE__, &p, &m, err, sizeof err) == ES_ERR_INVALID_ARG);
    CHECK(m == NULL && strstr(err, "unknown experts mode 9") != NULL);
    CHECK(es_decode(NULL, NULL, NULL, 1, 0) == ES_ERR_INVALID_ARG);
    es_model_free(NULL);
    es_context_free(NULL);
}

int main(void) {
    test_bad_files();
    for_each_test_model(check_model);
    const char * dir = getenv("EDGESPEC_TEST_MODELS_DIR");
    CHECK(!dir || !*dir || g_refused > 0);  // the built-in models have repacked layouts
    return check_report("test_engine");
}
