/*
 * test_verify.c — unit and statistical tests of speculative verification
 * (es_verify, csrc/verify.c).
 *
 * Plain C, no framework: CHECK() prints file:line and the failed expression,
 * and the program exits nonzero when any check failed.
 *   - greedy: hand-made rows whose argmax is set on purpose, then random
 *     trees against a sequential reference walk, with a repetition penalty;
 *   - errors: invalid trees and empty rows leave the sampler untouched;
 *   - sampling: on a toy "model" whose next-token logits depend on the
 *     position and the previous token, the first two tokens of the text must
 *     follow p0(x) * p1(y | x), the target's own distributions, whatever the
 *     draft (deterministic chain, sibling candidates, drafter q rows).
 */
#include "speculative/es_spec.h"
#include "speculative/spec_internal.h"  // sampler internals for the state checks

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* ------------------------------------------------------------------------
 * Helpers
 * ------------------------------------------------------------------------ */

// A sampler for n_vocab logits with params p; NULL (and a failed check) on error.
static es_sampler * make(es_sampler_params p, int32_t n_vocab) {
    es_sampler * s = NULL;
    CHECK(es_sampler_init(&p, n_vocab, &s) == ES_OK);
    return s;
}

static es_sampler_params sampling_params(float temperature, uint64_t seed) {
    es_sampler_params p = es_sampler_default_params();
    p.temperature = temperature;
    p.seed = seed;
    return p;
}

static es_draft_tree make_tree(const es_token * tokens, const int32_t * parents,
                               const float * probs, int32_t n_nodes) {
    es_draft_tree t = {tokens, parents, probs, n_nodes, NULL};
    return t;
}

// The test's own generator (xorshift64*), apart from the samplers' RNGs.
static uint64_t test_rng = 0x243f6a8885a308d3ULL;

static uint32_t rand_below(uint32_t n) {
    test_rng ^= test_rng >> 12; test_rng ^= test_rng << 25; test_rng ^= test_rng >> 27;
    return (uint32_t) ((test_rng * 0x2545f4914f6cdd1dULL) >> 33) % n;
}

// row (n_vocab): small logits with a clear maximum at token t.
static void peak_row(float * row, int32_t n_vocab, es_token t) {
    for (int32_t v = 0; v < n_vocab; v++) row[v] = 0.1f * (float) (v % 3);
    row[t] = 2.0f;
}

// True when two samplers hold the same RNG state and the same history ring.
static bool same_state(const es_sampler * a, const es_sampler * b) {
    return memcmp(a->rng, b->rng, sizeof a->rng) == 0 && a->n_history == b->n_history &&
           a->history_head == b->history_head &&
           memcmp(a->history, b->history, sizeof(es_token) * (size_t) a->n_history) == 0;
}

/* ------------------------------------------------------------------------
 * Greedy: hand-made cases
 * ------------------------------------------------------------------------ */

enum { VG = 8 };  // vocabulary of the hand-made greedy cases

static void test_greedy_chain_all_accepted(void) {
    const es_token draft[] = {3, 5, 1};
    float logits[4 * VG];  // (n_nodes + 1, VG)
    peak_row(logits + 0 * VG, VG, 3);
    peak_row(logits + 1 * VG, VG, 5);
    peak_row(logits + 2 * VG, VG, 1);
    peak_row(logits + 3 * VG, VG, 6);  // the bonus
    es_sampler * s = make(sampling_params(0.0f, 1), VG);
    const es_draft_tree tree = make_tree(draft, NULL, NULL, 3);
    es_token out[4];
    int32_t path[3], n_out = -1;
    CHECK(es_verify(s, logits, &tree, out, path, &n_out) == ES_OK);
    CHECK(n_out == 4);
    CHECK(out[0] == 3 && out[1] == 5 && out[2] == 1 && out[3] == 6);
    CHECK(path[0] == 0 && path[1] == 1 && path[2] == 2);
    CHECK(s->n_history == 4);  // every written token recorded
    es_sampler_free(s);
}

static void test_greedy_rejections(void) {
    const es_token draft[] = {3, 5, 1};
    float logits[4 * VG];
    es_token out[4];
    int32_t path[3], n_out = -1;
    const es_draft_tree tree = make_tree(draft, NULL, NULL, 3);
    es_sampler * s = make(sampling_params(0.0f, 1), VG);

    // at position 0: the correction is row 0's argmax
    peak_row(logits + 0 * VG, VG, 4);
    peak_row(logits + 1 * VG, VG, 5);
    peak_row(logits + 2 * VG, VG, 1);
    peak_row(logits + 3 * VG, VG, 6);
    CHECK(es_verify(s, logits, &tree, out, path, &n_out) == ES_OK);
    CHECK(n_out == 1 && out[0] == 4);

    // in the middle: draft[0] accepted, draft[1] replaced by row 1's argmax
    peak_row(logits + 0 * VG, VG, 3);
    peak_row(logits + 1 * VG, VG, 7);
    CHECK(es_verify(s, logits, &tree, out, NULL, &n_out) == ES_OK);  // out_path may be NULL
    CHECK(n_out == 2 && out[0] == 3 && out[1] == 7);
    es_sampler_free(s);
}

static void test_greedy_second_sibling(void) {
    // three candidates for the next token; the target picks the second
    const es_token tokens[]  = {2, 6, 4};
    const int32_t  parents[] = {-1, -1, -1};
    float logits[4 * VG];
    peak_row(logits + 0 * VG, VG, 6);
    peak_row(logits + 1 * VG, VG, 0);
    peak_row(logits + 2 * VG, VG, 5);  // node 1's row: the bonus after 6
    peak_row(logits + 3 * VG, VG, 0);
    es_sampler * s = make(sampling_params(0.0f, 1), VG);
    const es_draft_tree tree = make_tree(tokens, parents, NULL, 3);
    es_token out[4];
    int32_t path[3], n_out = -1;
    CHECK(es_verify(s, logits, &tree, out, path, &n_out) == ES_OK);
    CHECK(n_out == 2 && out[0] == 6 && out[1] == 5 && path[0] == 1);
    es_sampler_free(s);
}

static void test_greedy_deep_tree(void) {
    //  root ─┬─ n0:1 ── n2:7
    //        └─ n1:2 ─┬─ n3:4
    //                 └─ n4:5 ── n5:6
    const es_token tokens[]  = {1, 2, 7, 4, 5, 6};
    const int32_t  parents[] = {-1, -1, 0, 1, 1, 4};
    float logits[7 * VG];
    peak_row(logits + 0 * VG, VG, 2);  // root  -> n1
    peak_row(logits + 1 * VG, VG, 7);  // n0    (off the path)
    peak_row(logits + 2 * VG, VG, 5);  // n1    -> n4
    peak_row(logits + 3 * VG, VG, 0);  // n2    (off the path)
    peak_row(logits + 4 * VG, VG, 0);  // n3    (off the path)
    peak_row(logits + 5 * VG, VG, 6);  // n4    -> n5
    peak_row(logits + 6 * VG, VG, 3);  // n5    bonus
    es_sampler * s = make(sampling_params(0.0f, 1), VG);
    const es_draft_tree tree = make_tree(tokens, parents, NULL, 6);
    es_token out[7];
    int32_t path[6], n_out = -1;
    CHECK(es_verify(s, logits, &tree, out, path, &n_out) == ES_OK);
    CHECK(n_out == 4);
    CHECK(out[0] == 2 && out[1] == 5 && out[2] == 6 && out[3] == 3);
    CHECK(path[0] == 1 && path[1] == 4 && path[2] == 5);
    es_sampler_free(s);
}

// A chain given through parents[i] = i - 1 is a chain: drafter rows allowed.
static void test_chain_through_parents(void) {
    const es_token tokens[]  = {3, 5};
    const int32_t  parents[] = {-1, 0};
    float probs[2 * VG] = {0};  // (n_nodes, VG)
    probs[0 * VG + 3] = 1.0f;
    probs[1 * VG + 5] = 1.0f;
    float logits[3 * VG];
    peak_row(logits + 0 * VG, VG, 3);
    peak_row(logits + 1 * VG, VG, 5);
    peak_row(logits + 2 * VG, VG, 2);
    es_sampler * s = make(sampling_params(0.0f, 1), VG);
    const es_draft_tree tree = make_tree(tokens, parents, probs, 2);
    es_token out[3];
    int32_t n_out = -1;
    CHECK(es_verify(s, logits, &tree, out, NULL, &n_out) == ES_OK);
    CHECK(n_out == 3 && out[0] == 3 && out[1] == 5 && out[2] == 2);
    es_sampler_free(s);
}

/* ------------------------------------------------------------------------
 * Greedy: random trees against the sequential reference walk
 * ------------------------------------------------------------------------ */

enum { VR = 10, MAX_NODES_R = 9 };  // MAX_NODES_R < VR: room for distinct siblings

// The definition of greedy verification, one es_sampler_sample at a time:
// take the argmax of the current row, move to the child holding it (first
// in node order), stop at the first token no child holds.
static int32_t reference_walk(es_sampler * r, const float * logits, const es_token * tokens,
                              const int32_t * parents, int32_t n_nodes, es_token * out,
                              int32_t * path) {
    int32_t n = 0, node = -1;
    for (;;) {
        es_token t = -1;
        CHECK(es_sampler_sample(r, logits + (size_t) (node + 1) * VR, NULL, &t) == ES_OK);
        es_sampler_accept(r, t);
        out[n] = t;
        int32_t next = -1;
        for (int32_t c = 0; c < n_nodes && next < 0; c++) {
            if (parents[c] == node && tokens[c] == t) next = c;
        }
        if (next < 0) return n + 1;
        path[n++] = next;
        node = next;
    }
}

static void test_greedy_random_trees_with_penalty(void) {
    es_sampler_params p = sampling_params(0.0f, 1);
    p.repeat_penalty = 1.6f;
    p.repeat_last_n = 4;
    es_sampler * s = make(p, VR);
    es_sampler * r = make(p, VR);
    int32_t n_penalty_mattered = 0;
    for (int trial = 0; trial < 3000; trial++) {
        // rows quantized to 0.25, so ties (lowest id wins) occur
        float logits[(MAX_NODES_R + 1) * VR];  // (n_nodes + 1, VR)
        for (int32_t i = 0; i < N_ELEMS(logits); i++) logits[i] = 0.25f * (float) rand_below(9);
        const int32_t n_nodes = (int32_t) rand_below(MAX_NODES_R + 1);
        es_token tokens[MAX_NODES_R];
        int32_t parents[MAX_NODES_R];
        for (int32_t i = 0; i < n_nodes; i++) {
            parents[i] = trial % 3 == 0 ? i - 1 : (int32_t) rand_below((uint32_t) i + 1) - 1;
            // half the time the parent row's unpenalized argmax, as a drafter
            // unaware of the penalty would guess; then the next free token
            const float * row = logits + (size_t) (parents[i] + 1) * VR;
            es_token t = (es_token) rand_below(VR);
            if (rand_below(2)) {
                t = 0;
                for (es_token v = 1; v < VR; v++) if (row[v] > row[t]) t = v;
            }
            for (bool taken = true; taken;) {
                taken = false;
                for (int32_t j = 0; j < i; j++) taken = taken || (parents[j] == parents[i] && tokens[j] == t);
                if (taken) t = (t + 1) % VR;
            }
            tokens[i] = t;
        }
        // the same recent text in both samplers
        es_sampler_reset(s);
        es_sampler_reset(r);
        for (int k = 0; k < 4; k++) {
            const es_token h = (es_token) rand_below(VR);
            es_sampler_accept(s, h);
            es_sampler_accept(r, h);
        }
        es_token ref_out[MAX_NODES_R + 1], out[MAX_NODES_R + 1];
        int32_t ref_path[MAX_NODES_R], path[MAX_NODES_R], n_out = -1;
        es_token plain = 0;  // row 0's argmax without the penalty
        for (es_token v = 1; v < VR; v++) if (logits[v] > logits[plain]) plain = v;
        const int32_t n_ref = reference_walk(r, logits, tokens, parents, n_nodes, ref_out, ref_path);
        n_penalty_mattered += ref_out[0] != plain;

        const es_draft_tree tree = make_tree(tokens, parents, NULL, n_nodes);
        CHECK(es_verify(s, logits, &tree, out, path, &n_out) == ES_OK);
        CHECK(n_out == n_ref);
        if (n_out != n_ref) continue;
        CHECK(memcmp(out, ref_out, sizeof(es_token) * (size_t) n_out) == 0);
        CHECK(memcmp(path, ref_path, sizeof(int32_t) * (size_t) (n_out - 1)) == 0);
        CHECK(same_state(s, r));
    }
    CHECK(n_penalty_mattered > 100);  // the penalty did change decisions
    es_sampler_free(r);
    es_sampler_free(s);
}

/* ------------------------------------------------------------------------
 * An empty draft is plain sampling
 * ------------------------------------------------------------------------ */

static void test_empty_draft_is_plain_sampling(void) {
    const float temperatures[] = {0.0f, 1.0f};
    for (int32_t k = 0; k < N_ELEMS(temperatures); k++) {
        es_sampler_params p = sampling_params(temperatures[k], 42);
        p.top_p = 0.9f;
        p.repeat_penalty = 1.3f;
        p.repeat_last_n = 8;
        es_sampler * s = make(p, VR);
        es_sampler * r = make(p, VR);
        const es_draft_tree tree = make_tree(NULL, NULL, NULL, 0);
        for (int i = 0; i < 1000; i++) {
            float row[VR];
            for (int32_t v = 0; v < VR; v++) row[v] = 0.5f * (float) rand_below(7);
            es_token out[1], expected = -1;
            int32_t n_out = -1;
            CHECK(es_verify(s, row, &tree, out, NULL, &n_out) == ES_OK);
            CHECK(es_sampler_sample(r, row, NULL, &expected) == ES_OK);
            es_sampler_accept(r, expected);
            CHECK(n_out == 1 && out[0] == expected);
            CHECK(same_state(s, r));
        }
        es_sampler_free(r);
        es_sampler_free(s);
    }
}

/* ------------------------------------------------------------------------
 * Errors leave the sampler as it was
 * ------------------------------------------------------------------------ */

// Expects ES_ERR_INVALID_ARG, with *n_out, the RNG and the history untouched.
static void check_invalid(es_sampler * s, const float * logits, const es_draft_tree * tree) {
    es_sampler before = *s;
    es_token history[8];
    memcpy(history, s->history, sizeof history);
    es_token out[8];
    int32_t path[8], n_out = 77;
    CHECK(es_verify(s, logits, tree, out, path, &n_out) == ES_ERR_INVALID_ARG);
    CHECK(n_out == 77);
    CHECK(same_state(s, &before));
    CHECK(memcmp(history, s->history, sizeof history) == 0);
}

static void test_invalid_trees(void) {
    es_sampler_params p = sampling_params(1.0f, 5);
    p.repeat_last_n = 8;
    es_sampler * s = make(p, VG);
    for (es_token t = 0; t < 3; t++) es_sampler_accept(s, t);
    float logits[8 * VG] = {0};
    float probs[4 * VG] = {0};

    const es_token tokens[] = {1, 2, 3, 4};
    const struct { int32_t parents[4]; es_token tokens[4]; bool probs; } bad[] = {
        {{0, 0, 1, 2},   {1, 2, 3, 4}, false},  // node 0 its own parent
        {{-1, -2, 1, 2}, {1, 2, 3, 4}, false},  // parent below -1
        {{-1, 0, 2, 2},  {1, 2, 3, 4}, false},  // parent not before the node
        {{-1, 0, 1, 9},  {1, 2, 3, 4}, false},  // parent past the end
        {{-1, 0, 0, 1},  {1, 2, 2, 4}, false},  // siblings with one token
        {{-1, -1, 0, 1}, {1, 1, 3, 4}, false},  // root children with one token
        {{-1, 0, 1, 2},  {1, 2, -1, 4}, false}, // token below 0
        {{-1, 0, 1, 2},  {1, 2, VG, 4}, false}, // token past the vocabulary
        {{-1, 0, 0, 1},  {1, 2, 3, 4}, true},   // drafter rows on a branching tree
        {{-1, -1, 0, 1}, {1, 2, 3, 4}, true},   // ... branching at the root
    };
    for (int32_t k = 0; k < N_ELEMS(bad); k++) {
        const es_draft_tree tree = make_tree(bad[k].tokens, bad[k].parents,
                                             bad[k].probs ? probs : NULL, 4);
        check_invalid(s, logits, &tree);
    }

    es_draft_tree tree = make_tree(tokens, NULL, NULL, -1);  // negative size
    check_invalid(s, logits, &tree);
    tree = make_tree(NULL, NULL, NULL, 2);                    // no tokens
    check_invalid(s, logits, &tree);

    // NULL arguments (out_path alone may be NULL)
    tree = make_tree(tokens, NULL, NULL, 2);
    es_token out[3];
    int32_t n_out = 77;
    CHECK(es_verify(NULL, logits, &tree, out, NULL, &n_out) == ES_ERR_INVALID_ARG);
    CHECK(es_verify(s, NULL, &tree, out, NULL, &n_out) == ES_ERR_INVALID_ARG);
    CHECK(es_verify(s, logits, NULL, out, NULL, &n_out) == ES_ERR_INVALID_ARG);
    CHECK(es_verify(s, logits, &tree, NULL, NULL, &n_out) == ES_ERR_INVALID_ARG);
    CHECK(es_verify(s, logits, &tree, out, NULL, NULL) == ES_ERR_INVALID_ARG);
    CHECK(n_out == 77 && s->n_history == 3);
    es_sampler_free(s);
}

// A row with nothing to choose from, met after tokens were already accepted
// (and a full history ring overwritten): ES_ERR_EMPTY, and the RNG and the
// history are put back as they were before the call.
static void test_empty_row_midway_restores_state(void) {
    const float temperatures[] = {0.0f, 1.0f};
    for (int32_t k = 0; k < N_ELEMS(temperatures); k++) {
        es_sampler_params p = sampling_params(temperatures[k], 9);
        p.repeat_last_n = 2;
        es_sampler * s = make(p, VG);
        for (es_token t = 0; t < 3; t++) es_sampler_accept(s, t);  // ring full, wrapped

        const es_token draft[] = {3, 5};
        float logits[3 * VG];
        for (int32_t v = 0; v < VG; v++) logits[v] = v == 3 ? 50.0f : 0.0f;  // draft[0] sure
        for (int32_t v = 0; v < VG; v++) logits[VG + v] = -INFINITY;          // node 0: empty
        peak_row(logits + 2 * VG, VG, 1);
        const es_sampler before = *s;
        es_token history[2];
        memcpy(history, s->history, sizeof history);

        const es_draft_tree tree = make_tree(draft, NULL, NULL, 2);
        es_token out[3];
        int32_t n_out = 77;
        CHECK(es_verify(s, logits, &tree, out, NULL, &n_out) == ES_ERR_EMPTY);
        CHECK(n_out == 77);
        CHECK(same_state(s, &before));
        CHECK(memcmp(history, s->history, sizeof history) == 0);
        es_sampler_free(s);
    }
}

/* ------------------------------------------------------------------------
 * Sampling: exactness on a toy model
 *
 * The toy target's logits for the token at position pos (0: the token after
 * the root) depend on pos and the previous token, so every node's row
 * differs, and a node's row is the right one only if its path is the text.
 * Each trial prefills the history (the ring is exactly that long, so every
 * trial starts from the same history), verifies one draft and takes the
 * first two tokens of the text: the second comes from plain sampling when
 * verification stopped after one. Their frequencies must match
 * p0(x) * p1(y | x) worked out with es_sampler_probs.
 * ------------------------------------------------------------------------ */

enum { VS = 6, N_TRIALS = 200000, MAX_NODES_S = 6 };
static const es_token STAT_ROOT = 3;
static const es_token STAT_PREFILL[] = {1, 4, 2};
#define STAT_TOL 0.006

// Logit of token v at position pos after token prev, for model 0 (the
// target) or 1 (a drafter): a hash mapped to [0, 2.5).
static float toy_logit(uint32_t model, int32_t pos, es_token prev, int32_t v) {
    uint32_t h = model * 0x9e3779b1u ^ (uint32_t) pos * 0x85ebca6bu ^
                 (uint32_t) prev * 0xc2b2ae35u ^ (uint32_t) v * 0x27d4eb2fu;
    h ^= h >> 15; h *= 0x2c1b3c6du; h ^= h >> 12; h *= 0x297a2d39u; h ^= h >> 15;
    return (float) (h % 1000u) / 400.0f;
}

static void toy_row(uint32_t model, int32_t pos, es_token prev, float * row) {  // row: (VS)
    for (int32_t v = 0; v < VS; v++) row[v] = toy_logit(model, pos, prev, v);
}

static void prefill(es_sampler * s) {
    for (int32_t i = 0; i < N_ELEMS(STAT_PREFILL); i++) es_sampler_accept(s, STAT_PREFILL[i]);
}

static es_sampler_params stat_params(float temperature, int32_t top_k, float top_p, float min_p,
                                     float repeat_penalty) {
    es_sampler_params p = sampling_params(temperature, 2024);
    p.top_k = top_k;
    p.top_p = top_p;
    p.min_p = min_p;
    p.repeat_penalty = repeat_penalty;
    p.repeat_last_n = N_ELEMS(STAT_PREFILL);
    return p;
}

// joint (VS, VS): the target's p0(x) * p1(y | x), each under the history the
// text has at that point.
static void reference_joint(const es_sampler_params * p, double * joint) {
    es_sampler * r = make(*p, VS);
    float row[VS], p0[VS], p1[VS];
    prefill(r);
    toy_row(0, 0, STAT_ROOT, row);
    CHECK(es_sampler_probs(r, row, NULL, p0) == ES_OK);
    for (es_token x = 0; x < VS; x++) {
        prefill(r);
        es_sampler_accept(r, x);
        toy_row(0, 1, x, row);
        CHECK(es_sampler_probs(r, row, NULL, p1) == ES_OK);
        for (es_token y = 0; y < VS; y++) joint[x * VS + y] = (double) p0[x] * p1[y];
    }
    es_sampler_free(r);
}

// logits (n_nodes + 1, VS): row 0 the root's, row i + 1 node i's, from the
// toy target at the node's depth after the node's token.
static void tree_logits(const es_token * tokens, const int32_t * parents, int32_t n_nodes,
                        float * logits) {
    int32_t depth[MAX_NODES_S];
    toy_row(0, 0, STAT_ROOT, logits);
    for (int32_t i = 0; i < n_nodes; i++) {
        const int32_t parent = parents ? parents[i] : i - 1;
        depth[i] = parent < 0 ? 0 : depth[parent] + 1;
        toy_row(0, depth[i] + 1, tokens[i], logits + (size_t) (i + 1) * VS);
    }
}

// One trial from a prefilled history: verify, then add the first two tokens
// of the text to counts (VS, VS).
static void count_first_two(es_sampler * s, const float * logits, const es_draft_tree * tree,
                            int64_t * counts) {
    es_token out[MAX_NODES_S + 1];
    int32_t n_out = 0;
    CHECK(es_verify(s, logits, tree, out, NULL, &n_out) == ES_OK);
    if (n_out < 2) {
        float row[VS];
        toy_row(0, 1, out[0], row);
        CHECK(es_sampler_sample(s, row, NULL, &out[1]) == ES_OK);
        es_sampler_accept(s, out[1]);
    }
    counts[out[0] * VS + out[1]]++;
}

// Largest |frequency - probability| over the first token and over the pair.
static void check_frequencies(const char * what, const int64_t * counts, const double * joint) {
    double err_first = 0.0, err_pair = 0.0;
    for (es_token x = 0; x < VS; x++) {
        double f = 0.0, p = 0.0;
        for (es_token y = 0; y < VS; y++) {
            const double fxy = (double) counts[x * VS + y] / N_TRIALS;
            err_pair = fmax(err_pair, fabs(fxy - joint[x * VS + y]));
            f += fxy;
            p += joint[x * VS + y];
        }
        err_first = fmax(err_first, fabs(f - p));
    }
    if (err_first >= STAT_TOL || err_pair >= STAT_TOL) {
        fprintf(stderr, "%s: max error first token %.4f, pair %.4f\n", what, err_first, err_pair);
    }
    CHECK(err_first < STAT_TOL);
    CHECK(err_pair < STAT_TOL);
}

// The settings each statistical test runs under: target temperature, top-k,
// top-p, min-p and repetition penalty.
static const struct { float t; int32_t k; float top_p, min_p, pen; const char * name; } STAT_CASES[] = {
    {1.0f, 0, 1.0f,  0.0f, 1.0f, "T=1"},
    {0.7f, 4, 1.0f,  0.0f, 1.0f, "T=0.7 top-k 4"},
    {1.3f, 0, 0.75f, 0.1f, 1.0f, "T=1.3 top-p 0.75 min-p 0.1"},
    {1.0f, 0, 1.0f,  0.0f, 2.0f, "T=1 penalty 2"},
};

// (a) a deterministic chain, the toy target's own greedy continuation, so
// its tokens are often (not always) accepted.
static void test_stat_deterministic_chain(void) {
    es_token tokens[3];
    es_token prev = STAT_ROOT;
    for (int32_t i = 0; i < 3; i++) {
        float row[VS];
        toy_row(0, i, prev, row);
        es_token best = 0;
        for (es_token v = 1; v < VS; v++) if (row[v] > row[best]) best = v;
        tokens[i] = prev = best;
    }
    float logits[4 * VS];
    tree_logits(tokens, NULL, 3, logits);
    const es_draft_tree tree = make_tree(tokens, NULL, NULL, 3);
    for (int32_t c = 0; c < N_ELEMS(STAT_CASES); c++) {
        const es_sampler_params p = stat_params(STAT_CASES[c].t, STAT_CASES[c].k, STAT_CASES[c].top_p,
                                                STAT_CASES[c].min_p, STAT_CASES[c].pen);
        double joint[VS * VS];
        reference_joint(&p, joint);
        int64_t counts[VS * VS] = {0};
        es_sampler * s = make(p, VS);
        for (int trial = 0; trial < N_TRIALS; trial++) {
            prefill(s);
            count_first_two(s, logits, &tree, counts);
        }
        char what[96];
        snprintf(what, sizeof what, "deterministic chain, %s", STAT_CASES[c].name);
        check_frequencies(what, counts, joint);
        es_sampler_free(s);
    }
}

// (b) three candidates under the root, one of them with descendants, and
// one (token 5) usually improbable or outside the kept set.
static void test_stat_sibling_candidates(void) {
    const es_token tokens[]  = {0, 5, 2, 1, 4, 3};
    const int32_t  parents[] = {-1, -1, -1, 0, 2, 3};
    float logits[7 * VS];
    tree_logits(tokens, parents, 6, logits);
    const es_draft_tree tree = make_tree(tokens, parents, NULL, 6);
    for (int32_t c = 0; c < N_ELEMS(STAT_CASES); c++) {
        const es_sampler_params p = stat_params(STAT_CASES[c].t, STAT_CASES[c].k, STAT_CASES[c].top_p,
                                                STAT_CASES[c].min_p, STAT_CASES[c].pen);
        double joint[VS * VS];
        reference_joint(&p, joint);
        int64_t counts[VS * VS] = {0};
        es_sampler * s = make(p, VS);
        for (int trial = 0; trial < N_TRIALS; trial++) {
            prefill(s);
            count_first_two(s, logits, &tree, counts);
        }
        char what[96];
        snprintf(what, sizeof what, "sibling candidates, %s", STAT_CASES[c].name);
        check_frequencies(what, counts, joint);
        es_sampler_free(s);
    }
}

// Drafts a chain of n_nodes from drafter d (toy model `model`, no history):
// tokens drawn from its rows, probs (n_nodes, VS) those rows' distributions.
static void draft_chain(es_sampler * d, uint32_t model, int32_t n_nodes, es_token * tokens,
                        float * probs) {
    es_token prev = STAT_ROOT;
    for (int32_t i = 0; i < n_nodes; i++) {
        float row[VS];
        toy_row(model, i, prev, row);
        CHECK(es_sampler_probs(d, row, NULL, probs + (size_t) i * VS) == ES_OK);
        CHECK(es_sampler_sample(d, row, NULL, &tokens[i]) == ES_OK);
        prev = tokens[i];
    }
}

// (c) drafter distributions q != p: a different toy model, with no top-k
// (so q has mass where the target's kept set has none), and greedy (one-hot q).
static void test_stat_drafter_chain(void) {
    const float drafter_temperatures[] = {1.0f, 0.0f};
    for (int32_t dt = 0; dt < N_ELEMS(drafter_temperatures); dt++) {
        for (int32_t c = 0; c < N_ELEMS(STAT_CASES); c++) {
            const es_sampler_params p = stat_params(STAT_CASES[c].t, STAT_CASES[c].k,
                                                    STAT_CASES[c].top_p, STAT_CASES[c].min_p,
                                                    STAT_CASES[c].pen);
            double joint[VS * VS];
            reference_joint(&p, joint);
            int64_t counts[VS * VS] = {0};
            es_sampler * s = make(p, VS);
            es_sampler * d = make(sampling_params(drafter_temperatures[dt], 77), VS);
            for (int trial = 0; trial < N_TRIALS; trial++) {
                es_token tokens[3];
                float probs[3 * VS], logits[4 * VS];
                draft_chain(d, 1, 3, tokens, probs);
                tree_logits(tokens, NULL, 3, logits);
                const es_draft_tree tree = make_tree(tokens, NULL, probs, 3);
                prefill(s);
                count_first_two(s, logits, &tree, counts);
            }
            char what[96];
            snprintf(what, sizeof what, "drafter chain (drafter T=%.0f), %s",
                     drafter_temperatures[dt], STAT_CASES[c].name);
            check_frequencies(what, counts, joint);
            es_sampler_free(d);
            es_sampler_free(s);
        }
    }
}

// Self-speculation: a drafter that is the target itself (same model, same
// settings, same history) has q == p, so every draft token is accepted.
static void test_self_speculation_accepts_all(void) {
    const es_sampler_params p = stat_params(0.9f, 4, 0.9f, 0.0f, 1.5f);
    es_sampler * s = make(p, VS);
    es_sampler * d = make(p, VS);
    int64_t n_accepted = 0;
    const int n_trials = 2000;
    for (int trial = 0; trial < n_trials; trial++) {
        es_token tokens[4];
        float probs[4 * VS], logits[5 * VS];
        prefill(d);
        es_token prev = STAT_ROOT;
        for (int32_t i = 0; i < 4; i++) {  // draft_chain with the target's model and history
            toy_row(0, i, prev, logits + (size_t) i * VS);
            CHECK(es_sampler_probs(d, logits + (size_t) i * VS, NULL, probs + (size_t) i * VS) == ES_OK);
            CHECK(es_sampler_sample(d, logits + (size_t) i * VS, NULL, &tokens[i]) == ES_OK);
            es_sampler_accept(d, tokens[i]);
            prev = tokens[i];
        }
        tree_logits(tokens, NULL, 4, logits);
        const es_draft_tree tree = make_tree(tokens, NULL, probs, 4);
        es_token out[5];
        int32_t n_out = 0;
        prefill(s);
        CHECK(es_verify(s, logits, &tree, out, NULL, &n_out) == ES_OK);
        n_accepted += n_out - 1;
    }
    CHECK(n_accepted == 4 * n_trials);
    es_sampler_free(d);
    es_sampler_free(s);
}

/* ------------------------------------------------------------------------
 * Allowed-token masks: a drafted token outside its row's mask is rejected,
 * and the output keeps the constrained distribution
 * ------------------------------------------------------------------------ */

static void test_masked_greedy(void) {
    // The unconstrained argmax of row 0 is 5; the mask allows only 2 and 4.
    float logits[2 * VG];
    peak_row(logits, VG, 5);
    logits[4] = 1.0f;
    peak_row(logits + VG, VG, 1);
    uint32_t masks[2] = {(1u << 2) | (1u << 4), 0xffu};
    es_sampler * s = make(sampling_params(0.0f, 1), VG);
    const es_token draft[1] = {5};
    es_draft_tree tree = make_tree(draft, NULL, NULL, 1);
    tree.masks = masks;
    es_token out[2];
    int32_t n_out = 0;
    CHECK(es_verify(s, logits, &tree, out, NULL, &n_out) == ES_OK);
    CHECK(n_out == 1 && out[0] == 4);  // 5 rejected: outside the mask
    const es_token good[1] = {4};
    tree.tokens = good;
    CHECK(es_verify(s, logits, &tree, out, NULL, &n_out) == ES_OK);
    CHECK(n_out == 2 && out[0] == 4 && out[1] == 1);
    es_sampler_free(s);
}

static void test_masked_sampling_distribution(void) {
    float logits[2 * VS];
    for (int32_t v = 0; v < VS; v++) logits[v] = 0.3f * (float) v;
    for (int32_t v = 0; v < VS; v++) logits[VS + v] = 0.0f;
    const uint32_t masks[2] = {(1u << 1) | (1u << 2) | (1u << 4), (1u << VS) - 1};
    es_sampler * s = make(sampling_params(1.0f, 9), VS);
    float p[VS];
    CHECK(es_sampler_probs(s, logits, masks, p) == ES_OK);
    const es_token drafts[2] = {2, 5};  // inside and outside the root's mask
    for (int32_t d = 0; d < 2; d++) {
        es_draft_tree tree = make_tree(&drafts[d], NULL, NULL, 1);
        tree.masks = masks;
        int64_t counts[VS] = {0};
        const int n = 50000;
        for (int trial = 0; trial < n; trial++) {
            es_token out[2];
            int32_t n_out = 0;
            CHECK(es_verify(s, logits, &tree, out, NULL, &n_out) == ES_OK);
            counts[out[0]]++;
            if (drafts[d] == 5) CHECK(n_out == 1);  // never accepted
        }
        for (int32_t v = 0; v < VS; v++) {
            const double sd = sqrt(p[v] * (1.0 - p[v]) / n);
            CHECK_NEAR((double) counts[v] / n, p[v], 5.0 * sd + 1e-9);
        }
    }
    es_sampler_free(s);
}

int main(void) {
    test_greedy_chain_all_accepted();
    test_greedy_rejections();
    test_greedy_second_sibling();
    test_greedy_deep_tree();
    test_chain_through_parents();
    test_greedy_random_trees_with_penalty();
    test_empty_draft_is_plain_sampling();
    test_invalid_trees();
    test_empty_row_midway_restores_state();
    test_stat_deterministic_chain();
    test_stat_sibling_candidates();
    test_stat_drafter_chain();
    test_self_speculation_accepts_all();
    test_masked_greedy();
    test_masked_sampling_distribution();
    return check_report("test_verify");
}
