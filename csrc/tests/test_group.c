/*
 * test_group.c — es_group (model.c): several contexts' batches evaluated in
 * one es_decode_group, on the real models in $EDGESPEC_TEST_MODELS_DIR:
 *   - each member's logits are bit-identical to its own es_decode of the
 *     same tokens (chains of different lengths after caches of different
 *     lengths, a draft tree, logits_from past 0), with 1 and 2 threads, and
 *     each cache then holds what its es_decode would leave; so are the
 *     features of the members keeping them (es_context_keep_features), and
 *     the others have none;
 *   - refused with the caches as before: a context of another es_model, an
 *     embeddings context, one longer than the group's n_ctx, a context
 *     given twice, more tokens than the group's n_batch, more feature rows
 *     than a member's n_batch (ES_ERR_INVALID_ARG),
 *     a member's full cache (ES_ERR_CONTEXT_FULL).
 */
#define _POSIX_C_SOURCE 200809L

#include "native/es_native.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "test_models.h"

enum { N_MEMBERS = 4, N_CTX = 64, GROUP_BATCH = 24 };

static es_context * new_context(es_model * m, int32_t n_threads, int32_t n_ctx, bool embeddings) {
    es_context_params p = es_context_default_params();
    p.n_ctx = n_ctx;
    p.n_batch = 32;
    p.n_threads = n_threads;
    p.embeddings = embeddings;
    es_context * ctx = NULL;
    CHECK(es_context_init(m, &p, &ctx) == ES_OK);
    return ctx;
}

// Member i: a prefix of prefix_len[i] tokens in its cache, then n[i] tokens
// (a tree for member 2) whose rows from logits_from[i] are compared.
static const int32_t prefix_len[N_MEMBERS]  = { 0, 3, 7, 11 };
static const int32_t n_tokens[N_MEMBERS]    = { 5, 1, 4, 2 };
static const int32_t logits_from[N_MEMBERS] = { 2, 0, 0, 1 };
static const int32_t tree_parents[4]        = { -1, 0, 0, 1 };   // member 2: a root, two children, a grandchild

static es_token token_of(int32_t member, int32_t i, int32_t n_vocab) {
    return (es_token) ((member * 104729 + i * 7919 + 13) % n_vocab);
}

// Every member's cache emptied and its prefix decoded again.
static void prefill(es_context ** ctx, int32_t n_vocab) {
    for (int32_t k = 0; k < N_MEMBERS; k++) {
        CHECK(es_context_truncate(ctx[k], 0) == ES_OK);
        if (prefix_len[k] == 0) continue;
        es_token p[16];
        for (int32_t i = 0; i < prefix_len[k]; i++) p[i] = token_of(k, i, n_vocab);
        CHECK(es_decode(ctx[k], p, NULL, prefix_len[k], prefix_len[k]) == ES_OK);
    }
}

static void check_same_as_alone(es_model * m, int32_t n_threads) {
    const int32_t nv = es_model_n_vocab(m);
    es_context * ctx[N_MEMBERS] = { 0 };
    for (int32_t k = 0; k < N_MEMBERS; k++) {
        ctx[k] = new_context(m, n_threads, N_CTX, false);
        es_context_keep_features(ctx[k], k == 1 || k == 2);   // a chain and the tree
    }
    const int32_t D = es_model_n_embd(m);
    es_group_params gp = es_group_default_params();
    gp.n_batch = GROUP_BATCH;
    gp.n_ctx = N_CTX;
    gp.n_threads = n_threads;
    es_group * g = NULL;
    CHECK(es_group_init(m, &gp, &g) == ES_OK);
    CHECK(es_group_n_batch(g) == GROUP_BATCH);
    if (!g || !ctx[0] || !ctx[1] || !ctx[2] || !ctx[3]) goto done;

    es_token tokens[N_MEMBERS][8];
    for (int32_t k = 0; k < N_MEMBERS; k++) {
        for (int32_t i = 0; i < n_tokens[k]; i++) tokens[k][i] = token_of(k, 100 + i, nv);
    }
    // Alone: each member's own es_decode.
    prefill(ctx, nv);
    float * alone[N_MEMBERS] = { 0 }, * features[N_MEMBERS] = { 0 };
    for (int32_t k = 0; k < N_MEMBERS; k++) {
        const int32_t rows = n_tokens[k] - logits_from[k];
        CHECK(es_decode(ctx[k], tokens[k], k == 2 ? tree_parents : NULL, n_tokens[k], logits_from[k]) == ES_OK);
        alone[k] = malloc((size_t) rows * (size_t) nv * sizeof(float));
        if (alone[k]) memcpy(alone[k], es_context_logits(ctx[k]), (size_t) rows * (size_t) nv * sizeof(float));
        const float * f = es_context_embeddings(ctx[k]);
        CHECK((f != NULL) == (k == 1 || k == 2));
        features[k] = f ? malloc((size_t) rows * (size_t) D * sizeof(float)) : NULL;
        if (features[k]) memcpy(features[k], f, (size_t) rows * (size_t) D * sizeof(float));
    }
    // Together: one group decode, then one token more each, which reads the
    // cells the group wrote.
    prefill(ctx, nv);
    es_group_seq seqs[N_MEMBERS];
    for (int32_t k = 0; k < N_MEMBERS; k++) {
        seqs[k] = (es_group_seq) { .ctx = ctx[k], .tokens = tokens[k], .parents = k == 2 ? tree_parents : NULL,
                                   .n = n_tokens[k], .logits_from = logits_from[k] };
    }
    CHECK(es_decode_group(g, seqs, N_MEMBERS) == ES_OK);
    for (int32_t k = 0; k < N_MEMBERS; k++) {
        const int32_t rows = n_tokens[k] - logits_from[k];
        CHECK(es_context_n_past(ctx[k]) == prefix_len[k] + n_tokens[k]);
        const float * got = es_context_logits(ctx[k]);
        CHECK(got != NULL);
        if (got && alone[k]) CHECK(memcmp(got, alone[k], (size_t) rows * (size_t) nv * sizeof(float)) == 0);
        const float * f = es_context_embeddings(ctx[k]);
        CHECK((f != NULL) == (k == 1 || k == 2));
        if (f && features[k]) CHECK(memcmp(f, features[k], (size_t) rows * (size_t) D * sizeof(float)) == 0);
    }

    // The next step: member 3 alone by es_decode, then in a group of two;
    // the same row either way, read from the cache the group wrote.
    const es_token next = token_of(3, 200, nv);
    CHECK(es_decode(ctx[3], &next, NULL, 1, 0) == ES_OK);
    float * step = malloc((size_t) nv * sizeof(float));
    if (step) memcpy(step, es_context_logits(ctx[3]), (size_t) nv * sizeof(float));
    CHECK(es_context_truncate(ctx[3], prefix_len[3] + n_tokens[3]) == ES_OK);
    const es_token one = token_of(0, 201, nv);
    const es_group_seq two[2] = { { .ctx = ctx[0], .tokens = &one, .n = 1 },
                                  { .ctx = ctx[3], .tokens = &next, .n = 1 } };
    CHECK(es_decode_group(g, two, 2) == ES_OK);
    if (step) CHECK(memcmp(es_context_logits(ctx[3]), step, (size_t) nv * sizeof(float)) == 0);
    free(step);
    for (int32_t k = 0; k < N_MEMBERS; k++) free(alone[k]), free(features[k]);
done:
    es_group_free(g);
    for (int32_t k = 0; k < N_MEMBERS; k++) es_context_free(ctx[k]);
}

static void check_refusals(const char * path, es_model * m) {
    const int32_t nv = es_model_n_vocab(m);
    char err[256];
    es_model * other = NULL;
    CHECK(es_model_load(path, NULL, &other, err, sizeof err) == ES_OK);
    es_context * a = new_context(m, 1, N_CTX, false);
    es_context * b = new_context(m, 1, N_CTX, false);
    es_context * foreign = other ? new_context(other, 1, N_CTX, false) : NULL;
    es_context * embed = new_context(m, 1, N_CTX, true);
    es_context * longer = new_context(m, 1, 2 * N_CTX, false);
    es_context_params np = es_context_default_params();
    np.n_ctx = N_CTX;
    np.n_batch = 4;
    np.n_threads = 1;
    es_context * narrow = NULL;   // keeps features: at most 4 rows
    CHECK(es_context_init(m, &np, &narrow) == ES_OK);
    es_context_keep_features(narrow, true);
    es_group_params gp = es_group_default_params();
    gp.n_batch = 8;
    gp.n_ctx = N_CTX;
    gp.n_threads = 1;
    es_group * g = NULL;
    CHECK(es_group_init(m, &gp, &g) == ES_OK);
    gp.n_batch = 0;
    es_group * bad = NULL;
    CHECK(es_group_init(m, &gp, &bad) == ES_ERR_INVALID_ARG && bad == NULL);
    CHECK(es_group_init(NULL, NULL, &bad) == ES_ERR_INVALID_ARG);
    if (g && a && b && foreign && embed && longer && narrow) {
        es_token t[8];
        for (int32_t i = 0; i < 8; i++) t[i] = token_of(1, i, nv);
        CHECK(es_decode(a, t, NULL, 2, 2) == ES_OK);
        es_group_seq s[2] = { { .ctx = a, .tokens = t, .n = 2 }, { .ctx = foreign, .tokens = t, .n = 2 } };
        CHECK(es_decode_group(g, s, 2) == ES_ERR_INVALID_ARG);        // another model's context
        s[1].ctx = embed;
        CHECK(es_decode_group(g, s, 2) == ES_ERR_INVALID_ARG);        // an embeddings context
        s[1].ctx = longer;
        CHECK(es_decode_group(g, s, 2) == ES_ERR_INVALID_ARG);        // longer than the group's n_ctx
        s[1].ctx = a;
        CHECK(es_decode_group(g, s, 2) == ES_ERR_INVALID_ARG);        // a context twice
        s[1] = (es_group_seq) { .ctx = b, .tokens = t, .n = 7 };
        CHECK(es_decode_group(g, s, 2) == ES_ERR_INVALID_ARG);        // 2 + 7 > n_batch 8
        s[1].n = 6;
        s[1].logits_from = 7;
        CHECK(es_decode_group(g, s, 2) == ES_ERR_INVALID_ARG);        // logits_from > n
        const int32_t bad_parents[2] = { -1, 1 };
        s[1] = (es_group_seq) { .ctx = b, .tokens = t, .parents = bad_parents, .n = 2 };
        CHECK(es_decode_group(g, s, 2) == ES_ERR_INVALID_ARG);        // a token its own parent
        es_token fill[32];
        for (int32_t i = 0; i < 32; i++) fill[i] = t[i % 8];
        CHECK(es_decode(b, fill, NULL, 32, 32) == ES_OK);
        CHECK(es_decode(b, fill, NULL, 31, 31) == ES_OK);              // 63 of 64 cells
        s[1] = (es_group_seq) { .ctx = b, .tokens = t, .n = 2 };
        CHECK(es_decode_group(g, s, 2) == ES_ERR_CONTEXT_FULL);
        CHECK(es_decode_group(g, s, 0) == ES_ERR_INVALID_ARG);
        CHECK(es_context_n_past(a) == 2 && es_context_n_past(b) == 63);  // all as before
        s[1].n = 1;
        CHECK(es_decode_group(g, s, 2) == ES_OK);
        CHECK(es_context_n_past(a) == 4 && es_context_n_past(b) == 64);
        s[1] = (es_group_seq) { .ctx = narrow, .tokens = t, .n = 6, .logits_from = 1 };
        CHECK(es_decode_group(g, s, 2) == ES_ERR_INVALID_ARG);        // 5 feature rows, n_batch 4
        s[1].logits_from = 2;
        CHECK(es_decode_group(g, s, 2) == ES_OK);                     // 4 fit
        CHECK(es_context_n_past(narrow) == 6 && es_context_embeddings(narrow) != NULL);
    }
    es_group_free(g);
    es_context_free(narrow);
    es_context_free(longer);
    es_context_free(embed);
    es_context_free(foreign);
    es_context_free(b);
    es_context_free(a);
    es_model_free(other);
}

static void check_model(const char * path) {
    es_model * m = load_test_model(path);
    if (!m) return;
    for (int32_t n_threads = 1; n_threads <= 2; n_threads++) check_same_as_alone(m, n_threads);
    check_refusals(path, m);
    es_model_free(m);
}

int main(void) {
    for_each_test_model(check_model);
    es_group_free(NULL);
    CHECK(es_decode_group(NULL, NULL, 1) == ES_ERR_INVALID_ARG);
    return check_report("test_group");
}
