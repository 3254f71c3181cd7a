/*
 * test_drafting.c — unit tests of the drafting data structures: the n-gram
 * index and n-gram cache (csrc/ngram.c) and token recycling (csrc/recycle.c).
 *
 * Plain C, no framework: CHECK() prints file:line and the failed expression,
 * and the program exits nonzero when any check failed. Sequences are short
 * and hand-made where an exact answer is expected; the long random ones are
 * checked against a brute-force reference written out here.
 *
 * Cache files are written to the working directory under es_test_*.bin and
 * removed again.
 */
#include "speculative/es_spec.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* ------------------------------------------------------------------------
 * Helpers
 * ------------------------------------------------------------------------ */

// A small deterministic generator (LCG), so the random tests repeat exactly.
static uint32_t lcg(uint32_t * state) {
    *state = *state * 1664525u + 1013904223u;
    return *state >> 8;
}

static bool same_tokens(const es_token * a, const es_token * b, int32_t n) {
    return memcmp(a, b, sizeof(es_token) * (size_t) n) == 0;
}

static es_ngram_index * make_index(int32_t n_min, int32_t n_max) {
    es_ngram_index_params p = es_ngram_index_default_params();
    p.n_min = n_min;
    p.n_max = n_max;
    es_ngram_index * idx = NULL;
    CHECK(es_ngram_index_init(&p, &idx) == ES_OK);
    return idx;
}

static es_ngram_cache * make_cache(int32_t n_max, const es_token * tokens, int32_t n_tokens) {
    es_ngram_cache * c = NULL;
    CHECK(es_ngram_cache_init(n_max, &c) == ES_OK);
    CHECK(es_ngram_cache_add(c, tokens, n_tokens) == ES_OK);
    return c;
}

// The whole of a file into a new buffer (*n bytes); NULL on failure.
static unsigned char * read_file(const char * path, long * n) {
    FILE * f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    *n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char * buf = malloc((size_t) *n + 1);
    if (buf && fread(buf, 1, (size_t) *n, f) != (size_t) *n) { free(buf); buf = NULL; }
    fclose(f);
    return buf;
}

static void write_file(const char * path, const unsigned char * data, long n) {
    FILE * f = fopen(path, "wb");
    CHECK(f != NULL);
    if (!f) return;
    CHECK(fwrite(data, 1, (size_t) n, f) == (size_t) n);
    fclose(f);
}

// Rewrites the trailing FNV-1a 64 checksum of a cache image of n bytes, so
// that a test can reach the checks behind it.
static void fix_checksum(unsigned char * data, long n) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (long i = 0; i < n - 8; i++) h = (h ^ data[i]) * 0x100000001b3ULL;
    for (int i = 0; i < 8; i++) data[n - 8 + i] = (unsigned char) (h >> (8 * i));
}

// Loads path expecting status want (and no cache unless ES_OK).
static void check_load(const char * path, int want) {
    es_ngram_cache * c = NULL;
    const int rc = es_ngram_cache_load(path, &c);
    CHECK(rc == want);
    if (want != ES_OK) CHECK(c == NULL);
    es_ngram_cache_free(c);
}

/* ------------------------------------------------------------------------
 * N-gram index
 * ------------------------------------------------------------------------ */

static void test_index_params(void) {
    es_ngram_index_params p = es_ngram_index_default_params();
    CHECK(p.n_min == 2 && p.n_max == 5);
    es_ngram_index * idx = NULL;
    p.n_min = 0;
    CHECK(es_ngram_index_init(&p, &idx) == ES_ERR_INVALID_ARG && idx == NULL);
    p.n_min = 3; p.n_max = 2;
    CHECK(es_ngram_index_init(&p, &idx) == ES_ERR_INVALID_ARG);
    p.n_min = 1; p.n_max = 17;
    CHECK(es_ngram_index_init(&p, &idx) == ES_ERR_INVALID_ARG);
    CHECK(es_ngram_index_init(NULL, &idx) == ES_ERR_INVALID_ARG);
    es_ngram_index_free(NULL);
    es_ngram_index_reset(NULL);
    CHECK(es_ngram_index_size(NULL) == 0);
}

static void test_index_longest_suffix(void) {
    // [3 4 5] occurred at 0..2 (then 1); the shorter [4 5] more recently (then 2).
    const es_token seq[] = {3, 4, 5, 1, 4, 5, 2, 3, 4, 5};
    es_ngram_index * idx = make_index(2, 5);
    CHECK(es_ngram_index_append(idx, seq, N_ELEMS(seq)) == ES_OK);
    CHECK(es_ngram_index_size(idx) == N_ELEMS(seq));
    es_token out[8];
    int32_t match = -1;
    const int32_t n = es_ngram_index_draft(idx, out, 8, &match);
    // continuation of the 3-gram up to the end of the sequence: 1 4 5 2 3 4 5
    const es_token want[] = {1, 4, 5, 2, 3, 4, 5};
    CHECK(match == 3);
    CHECK(n == N_ELEMS(want) && same_tokens(out, want, N_ELEMS(want)));
    // max_draft caps it; match_len may be NULL; max_draft 0 drafts nothing
    CHECK(es_ngram_index_draft(idx, out, 2, NULL) == 2 && out[0] == 1 && out[1] == 4);
    CHECK(es_ngram_index_draft(idx, NULL, 0, &match) == 0 && match == 0);
    CHECK(es_ngram_index_draft(idx, NULL, 3, NULL) == ES_ERR_INVALID_ARG);
    es_ngram_index_free(idx);
}

static void test_index_most_recent_wins(void) {
    const es_token seq[] = {1, 2, 7, 1, 2, 8, 1, 2};
    es_ngram_index * idx = make_index(2, 2);
    CHECK(es_ngram_index_append(idx, seq, N_ELEMS(seq)) == ES_OK);
    es_token out[4];
    int32_t match = 0;
    CHECK(es_ngram_index_draft(idx, out, 4, &match) == 3);
    CHECK(match == 2 && out[0] == 8 && out[1] == 1 && out[2] == 2);
    es_ngram_index_free(idx);
}

static void test_index_no_self_match(void) {
    es_ngram_index * idx = make_index(1, 4);
    es_token out[4];
    int32_t match = -1;
    // the suffix [1 2 3] (and [2 3], [3]) occurs only as itself
    const es_token seq[] = {1, 2, 3};
    CHECK(es_ngram_index_append(idx, seq, N_ELEMS(seq)) == ES_OK);
    CHECK(es_ngram_index_draft(idx, out, 4, &match) == 0 && match == 0);
    // [5 5]: the suffix [5] occurred at 0, followed by the 5 that is the suffix
    es_ngram_index_reset(idx);
    const es_token twice[] = {5, 5};
    CHECK(es_ngram_index_append(idx, twice, 2) == ES_OK);
    CHECK(es_ngram_index_draft(idx, out, 4, &match) == 1 && out[0] == 5 && match == 1);
    // empty and one-token sequences have nothing earlier
    es_ngram_index_reset(idx);
    CHECK(es_ngram_index_draft(idx, out, 4, &match) == 0);
    CHECK(es_ngram_index_append(idx, seq, 1) == ES_OK);
    CHECK(es_ngram_index_draft(idx, out, 4, &match) == 0);
    es_ngram_index_free(idx);
}

static void test_index_reset_and_bad_append(void) {
    const es_token seq[] = {1, 2, 3, 1, 2};
    es_ngram_index * idx = make_index(2, 3);
    CHECK(es_ngram_index_append(idx, seq, N_ELEMS(seq)) == ES_OK);
    es_token out[4];
    CHECK(es_ngram_index_draft(idx, out, 4, NULL) == 3 && out[0] == 3);
    es_ngram_index_reset(idx);
    CHECK(es_ngram_index_size(idx) == 0);
    // the old text is forgotten: [1 2] alone has no earlier occurrence
    CHECK(es_ngram_index_append(idx, seq, 2) == ES_OK);
    CHECK(es_ngram_index_draft(idx, out, 4, NULL) == 0);
    // a negative token rejects the whole append
    const es_token bad[] = {4, -1};
    CHECK(es_ngram_index_append(idx, bad, 2) == ES_ERR_INVALID_ARG);
    CHECK(es_ngram_index_size(idx) == 2);
    CHECK(es_ngram_index_append(idx, NULL, 0) == ES_OK);
    CHECK(es_ngram_index_append(idx, NULL, 1) == ES_ERR_INVALID_ARG);
    CHECK(es_ngram_index_append(idx, seq, -1) == ES_ERR_INVALID_ARG);
    es_ngram_index_free(idx);
}

// The draft the index must make, found by scanning: the most recent earlier
// occurrence of the longest suffix, n_max down to n_min.
static int32_t reference_draft(const es_token * seq, int32_t len, int32_t n_min, int32_t n_max,
                               es_token * out, int32_t max_draft, int32_t * match) {
    for (int32_t n = n_max; n >= n_min; n--) {
        if (n > len - 1) continue;
        for (int32_t s = len - n - 1; s >= 0; s--) {
            if (!same_tokens(seq + s, seq + len - n, n)) continue;
            const int32_t pos = s + n;
            int32_t k = 0;
            for (; k < max_draft && pos + k < len; k++) out[k] = seq[pos + k];
            *match = n;
            return k;
        }
    }
    *match = 0;
    return 0;
}

static void test_index_against_reference(void) {
    // A small vocabulary makes matches of every length common; appending one
    // token at a time crosses several table growths.
    enum { LEN = 3000, VOCAB = 6, N_MIN = 2, N_MAX = 6, MAX_DRAFT = 8 };
    static es_token seq[LEN];
    uint32_t rng = 42;
    for (int32_t i = 0; i < LEN; i++) seq[i] = (es_token) (lcg(&rng) % VOCAB);

    es_ngram_index * idx = make_index(N_MIN, N_MAX);
    int32_t n_bad = 0;
    for (int32_t len = 1; len <= LEN; len++) {
        CHECK(es_ngram_index_append(idx, seq + len - 1, 1) == ES_OK);
        es_token got[MAX_DRAFT], want[MAX_DRAFT];
        int32_t got_match = -1, want_match = -1;
        const int32_t n_got = es_ngram_index_draft(idx, got, MAX_DRAFT, &got_match);
        const int32_t n_want = reference_draft(seq, len, N_MIN, N_MAX, want, MAX_DRAFT, &want_match);
        n_bad += n_got != n_want || got_match != want_match || !same_tokens(got, want, n_want);
    }
    CHECK(n_bad == 0);

    // one bulk append indexes exactly as the token-by-token appends did
    es_ngram_index * bulk = make_index(N_MIN, N_MAX);
    CHECK(es_ngram_index_append(bulk, seq, LEN) == ES_OK);
    es_token a[MAX_DRAFT], b[MAX_DRAFT];
    int32_t ma = 0, mb = 0;
    const int32_t na = es_ngram_index_draft(idx, a, MAX_DRAFT, &ma);
    CHECK(na == es_ngram_index_draft(bulk, b, MAX_DRAFT, &mb) && ma == mb && same_tokens(a, b, na));
    es_ngram_index_free(bulk);
    es_ngram_index_free(idx);
}

/* ------------------------------------------------------------------------
 * N-gram cache: counting and drafting
 * ------------------------------------------------------------------------ */

static void test_cache_counts_and_draft(void) {
    // contexts: [1] -> 2 2 3, [2] -> 1 1, [1 2] -> 1 1, [2 1] -> 2 3
    const es_token seq[] = {1, 2, 1, 2, 1, 3};
    es_ngram_cache * c = make_cache(2, seq, N_ELEMS(seq));
    CHECK(es_ngram_cache_size(c) == 4);

    const es_token ctx[] = {5, 1};  // [5 1] is unknown: [1] drafts
    es_token out[8];
    // [1] -> 2 (2/3), [1 2] -> 1 (1), [2 1] -> 2 (1/2; a tie goes to the lower id)
    CHECK(es_ngram_cache_draft(c, NULL, ctx, 2, out, 3, 0.0f) == 3);
    CHECK(out[0] == 2 && out[1] == 1 && out[2] == 2);
    // min_share 0.6 stops at [2 1], whose best share is 1/2
    CHECK(es_ngram_cache_draft(c, NULL, ctx, 2, out, 8, 0.6f) == 2);
    // 0.7 stops at once: 2/3 < 0.7
    CHECK(es_ngram_cache_draft(c, NULL, ctx, 2, out, 8, 0.7f) == 0);
    // an unknown token, or no context at all, drafts nothing
    const es_token unknown[] = {9};
    CHECK(es_ngram_cache_draft(c, NULL, unknown, 1, out, 8, 0.0f) == 0);
    CHECK(es_ngram_cache_draft(c, NULL, NULL, 0, out, 8, 0.0f) == 0);
    // argument checks
    CHECK(es_ngram_cache_draft(c, NULL, ctx, 2, out, 8, 1.5f) == ES_ERR_INVALID_ARG);
    CHECK(es_ngram_cache_draft(c, NULL, ctx, 2, out, 8, NAN) == ES_ERR_INVALID_ARG);
    CHECK(es_ngram_cache_draft(NULL, NULL, ctx, 2, out, 8, 0.0f) == ES_ERR_INVALID_ARG);
    CHECK(es_ngram_cache_draft(c, NULL, ctx, 2, NULL, 8, 0.0f) == ES_ERR_INVALID_ARG);

    // adding more text keeps counting the same contexts: [1] -> 2 2 3 3 3
    const es_token more[] = {1, 3, 1, 3};
    CHECK(es_ngram_cache_add(c, more, N_ELEMS(more)) == ES_OK);
    const es_token one[] = {1};
    CHECK(es_ngram_cache_draft(c, NULL, one, 1, out, 1, 0.0f) == 1 && out[0] == 3);
    // a negative token is refused before anything is counted
    const es_token bad[] = {1, -2};
    const int64_t size = es_ngram_cache_size(c);
    CHECK(es_ngram_cache_add(c, bad, 2) == ES_ERR_INVALID_ARG && es_ngram_cache_size(c) == size);
    es_ngram_cache_free(c);

    es_ngram_cache * none = NULL;
    CHECK(es_ngram_cache_init(0, &none) == ES_ERR_INVALID_ARG && none == NULL);
    CHECK(es_ngram_cache_init(9, &none) == ES_ERR_INVALID_ARG);
    es_ngram_cache_free(NULL);
    CHECK(es_ngram_cache_size(NULL) == 0);
}

static void test_cache_heavy_hitter(void) {
    // [0] is followed by 9 every other time and by 1..8 in turn otherwise:
    // more next tokens than a context keeps, yet 9 must stay the best.
    es_token seq[200];
    int32_t n = 0;
    for (int32_t i = 0; n + 4 <= N_ELEMS(seq); i++) {
        seq[n++] = 0; seq[n++] = 9;
        seq[n++] = 0; seq[n++] = (es_token) (1 + i % 8);
    }
    es_ngram_cache * c = make_cache(1, seq, n);
    const es_token ctx[] = {0};
    es_token out[1];
    CHECK(es_ngram_cache_draft(c, NULL, ctx, 1, out, 1, 0.4f) == 1 && out[0] == 9);
    es_ngram_cache_free(c);
}

static void test_cache_primary(void) {
    const es_token corpus[] = {1, 2, 7, 1, 4};      // [1] -> 2 4, [7 1] -> 4
    const es_token session[] = {1, 3};              // [1] -> 3
    es_ngram_cache * cache = make_cache(2, corpus, N_ELEMS(corpus));
    es_ngram_cache * primary = make_cache(2, session, N_ELEMS(session));
    es_token out[4];
    // at equal length the primary cache is consulted first
    const es_token ctx[] = {1};
    CHECK(es_ngram_cache_draft(cache, primary, ctx, 1, out, 1, 0.0f) == 1 && out[0] == 3);
    CHECK(es_ngram_cache_draft(cache, NULL, ctx, 1, out, 1, 0.0f) == 1 && out[0] == 2);
    // a longer context known only to the cache beats the primary's shorter one
    const es_token longer[] = {7, 1};
    CHECK(es_ngram_cache_draft(cache, primary, longer, 2, out, 1, 0.0f) == 1 && out[0] == 4);
    es_ngram_cache_free(primary);
    es_ngram_cache_free(cache);
}

/* ------------------------------------------------------------------------
 * N-gram cache: files
 * ------------------------------------------------------------------------ */

static const char * CACHE_FILE = "es_test_ngram_cache.bin";
static const char * BROKEN_FILE = "es_test_ngram_broken.bin";

static void test_cache_round_trip(void) {
    enum { LEN = 5000, VOCAB = 40, N_MAX = 4 };
    static es_token seq[LEN];
    uint32_t rng = 7;
    for (int32_t i = 0; i < LEN; i++) seq[i] = (es_token) (lcg(&rng) % VOCAB);
    es_ngram_cache * c = make_cache(N_MAX, seq, LEN);
    CHECK(es_ngram_cache_save(c, CACHE_FILE) == ES_OK);

    es_ngram_cache * back = NULL;
    CHECK(es_ngram_cache_load(CACHE_FILE, &back) == ES_OK);
    CHECK(back != NULL && es_ngram_cache_size(back) == es_ngram_cache_size(c));
    // the same drafts from every context of the text
    int32_t n_bad = 0;
    for (int32_t i = 1; i + N_MAX <= LEN; i += 37) {
        es_token a[6], b[6];
        const int32_t na = es_ngram_cache_draft(c, NULL, seq + i, N_MAX, a, 6, 0.1f);
        const int32_t nb = es_ngram_cache_draft(back, NULL, seq + i, N_MAX, b, 6, 0.1f);
        n_bad += na != nb || !same_tokens(a, b, na);
    }
    CHECK(n_bad == 0);
    // saving what was loaded gives the same bytes
    long n1 = 0, n2 = 0;
    unsigned char * first = read_file(CACHE_FILE, &n1);
    CHECK(es_ngram_cache_save(back, CACHE_FILE) == ES_OK);
    unsigned char * second = read_file(CACHE_FILE, &n2);
    CHECK(first && second && n1 == n2 && memcmp(first, second, (size_t) n1) == 0);
    // 24-byte header, (10 + n_max) words per entry, 8-byte checksum
    CHECK(n1 == 24 + es_ngram_cache_size(c) * 4 * (10 + N_MAX) + 8);
    free(second);
    free(first);
    es_ngram_cache_free(back);

    // an empty cache round-trips too
    es_ngram_cache * empty = make_cache(3, NULL, 0);
    CHECK(es_ngram_cache_save(empty, CACHE_FILE) == ES_OK);
    CHECK(es_ngram_cache_load(CACHE_FILE, &back) == ES_OK && es_ngram_cache_size(back) == 0);
    es_ngram_cache_free(back);
    es_ngram_cache_free(empty);
    es_ngram_cache_free(c);
}

static void test_cache_bad_files(void) {
    const es_token seq[] = {1, 2, 3, 1, 2, 4, 1, 2, 3};
    es_ngram_cache * c = make_cache(3, seq, N_ELEMS(seq));
    CHECK(es_ngram_cache_save(c, CACHE_FILE) == ES_OK);
    es_ngram_cache_free(c);
    long n = 0;
    unsigned char * good = read_file(CACHE_FILE, &n);
    CHECK(good != NULL && n > 64);
    if (!good) return;
    unsigned char * data = malloc((size_t) n);
    const long rec = 4 * (10 + 3);

    check_load(CACHE_FILE, ES_OK);
    check_load("es_test_no_such_file.bin", ES_ERR_IO);
    CHECK(es_ngram_cache_save(NULL, CACHE_FILE) == ES_ERR_INVALID_ARG);
    CHECK(es_ngram_cache_load(CACHE_FILE, NULL) == ES_ERR_INVALID_ARG);

    // truncated anywhere: in the header, in an entry, in the checksum
    const long cuts[] = {0, 5, 23, 24, 24 + rec / 2, n - 8, n - 1};
    for (int32_t i = 0; i < N_ELEMS(cuts); i++) {
        write_file(BROKEN_FILE, good, cuts[i]);
        check_load(BROKEN_FILE, ES_ERR_FORMAT);
    }
    // one byte too many
    memcpy(data, good, (size_t) n);
    unsigned char * longer = malloc((size_t) n + 1);
    memcpy(longer, good, (size_t) n);
    longer[n] = 0;
    write_file(BROKEN_FILE, longer, n + 1);
    check_load(BROKEN_FILE, ES_ERR_FORMAT);
    free(longer);

    // any flipped byte: magic, version, sizes, an entry, the checksum
    for (long at = 0; at < n; at += 7) {
        memcpy(data, good, (size_t) n);
        data[at] ^= 0x20;
        write_file(BROKEN_FILE, data, n);
        check_load(BROKEN_FILE, ES_ERR_FORMAT);
    }

    // damage behind a valid checksum: the structural checks still hold
    struct { long offset; uint32_t value; } edits[] = {
        {8, 2},                          // version 2
        {12, 0},                         // n_max 0
        {12, 9},                         // n_max 9
        {16, 0xffffffffu},               // an entry count the file cannot hold
        {24, 0},                         // first entry: context length 0
        {24, 4},                         // context length > n_max
        {24 + 4 * 4, 5},                 // total != sum of counts
        {24 + 4 * 5, (uint32_t) -7},     // a negative next token with a count
    };
    for (int32_t i = 0; i < N_ELEMS(edits); i++) {
        memcpy(data, good, (size_t) n);
        for (int b = 0; b < 4; b++) data[edits[i].offset + b] = (unsigned char) (edits[i].value >> (8 * b));
        fix_checksum(data, n);
        write_file(BROKEN_FILE, data, n);
        check_load(BROKEN_FILE, ES_ERR_FORMAT);
    }
    // the same entry twice
    memcpy(data, good, (size_t) n);
    memcpy(data + 24 + rec, data + 24, (size_t) rec);
    fix_checksum(data, n);
    write_file(BROKEN_FILE, data, n);
    check_load(BROKEN_FILE, ES_ERR_FORMAT);

    free(data);
    free(good);
    remove(BROKEN_FILE);
    remove(CACHE_FILE);
}

/* ------------------------------------------------------------------------
 * Token recycling
 * ------------------------------------------------------------------------ */

enum { V = 16, K = 4 };

// A row of V logits, all 0 but the given tokens, which get 10, 9, 8, ...
static void ranked_row(float * row, const es_token * best, int32_t n_best) {
    for (int32_t t = 0; t < V; t++) row[t] = 0.0f;
    for (int32_t i = 0; i < n_best; i++) row[best[i]] = 10.0f - (float) i;
}

// Checks the draft tree invariants: parents in order, sibling tokens distinct.
static void check_tree(const es_token * tokens, const int32_t * parents, int32_t n) {
    for (int32_t i = 0; i < n; i++) {
        CHECK(parents[i] >= -1 && parents[i] < i);
        CHECK(tokens[i] >= 0 && tokens[i] < V);
        for (int32_t j = 0; j < i; j++) CHECK(parents[j] != parents[i] || tokens[j] != tokens[i]);
    }
}

static void test_recycle(void) {
    es_recycle * rec = NULL;
    CHECK(es_recycle_init(V, 0, &rec) == ES_ERR_INVALID_ARG && rec == NULL);
    CHECK(es_recycle_init(V, 33, &rec) == ES_ERR_INVALID_ARG);
    CHECK(es_recycle_init(0, K, &rec) == ES_ERR_INVALID_ARG);
    CHECK(es_recycle_init(V, K, &rec) == ES_OK);

    es_token tokens[32];
    int32_t parents[32];
    // nothing known yet
    CHECK(es_recycle_draft(rec, 3, 4, 4, 32, tokens, parents) == 0);

    // rows computed at tokens 3 and 7: after 3 come 7 2 9 1 (best first),
    // after 7 come 5 6 ...
    float logits[2 * V];
    const es_token after3[] = {7, 2, 9, 1, 11};
    const es_token after7[] = {5, 6, 12};
    ranked_row(logits, after3, N_ELEMS(after3));
    ranked_row(logits + V, after7, N_ELEMS(after7));
    const es_token row_tokens[] = {3, 7};
    CHECK(es_recycle_update(rec, row_tokens, logits, 2) == ES_OK);

    // depth 1: the root's first 4 candidates, in order
    int32_t n = es_recycle_draft(rec, 3, 4, 1, 32, tokens, parents);
    CHECK(n == 4);
    const es_token level1[] = {7, 2, 9, 1};
    CHECK(same_tokens(tokens, level1, 4));
    for (int32_t i = 0; i < n; i++) CHECK(parents[i] == -1);

    // depth 2: level 1 takes branch >> 1 = 2 children of each node that has
    // candidates; only 7 has (5 and 6)
    n = es_recycle_draft(rec, 3, 4, 2, 32, tokens, parents);
    CHECK(n == 6);
    CHECK(tokens[4] == 5 && parents[4] == 0 && tokens[5] == 6 && parents[5] == 0);
    check_tree(tokens, parents, n);

    // max_nodes cuts the breadth-first order
    CHECK(es_recycle_draft(rec, 3, 4, 8, 5, tokens, parents) == 5);
    CHECK(tokens[4] == 5);
    CHECK(es_recycle_draft(rec, 3, 4, 8, 0, NULL, NULL) == 0);
    CHECK(es_recycle_draft(rec, 3, 4, 0, 8, tokens, parents) == 0);
    // branch 1 makes a chain: 3 -> 7 -> 5 -> (nothing known after 5)
    n = es_recycle_draft(rec, 3, 1, 8, 32, tokens, parents);
    CHECK(n == 2 && tokens[0] == 7 && parents[0] == -1 && tokens[1] == 5 && parents[1] == 0);

    // the most recent row wins; -inf and NaN are never candidates
    for (int32_t t = 0; t < V; t++) logits[t] = -INFINITY;
    logits[4] = 1.0f;
    logits[8] = 2.0f;
    logits[10] = NAN;
    CHECK(es_recycle_update(rec, row_tokens, logits, 1) == ES_OK);
    n = es_recycle_draft(rec, 3, 4, 1, 32, tokens, parents);
    CHECK(n == 2 && tokens[0] == 8 && tokens[1] == 4);

    // ties keep the lower token id first
    for (int32_t t = 0; t < V; t++) logits[t] = 0.0f;
    CHECK(es_recycle_update(rec, row_tokens, logits, 1) == ES_OK);
    n = es_recycle_draft(rec, 3, 4, 1, 32, tokens, parents);
    CHECK(n == 4 && tokens[0] == 0 && tokens[1] == 1 && tokens[2] == 2 && tokens[3] == 3);

    // a bad row token rejects the whole update
    const es_token bad[] = {7, V};
    CHECK(es_recycle_update(rec, bad, logits, 2) == ES_ERR_INVALID_ARG);
    // (the row after 7 is unchanged: 5 6 12, then 0 first of the zero logits)
    n = es_recycle_draft(rec, 7, 4, 1, 32, tokens, parents);
    CHECK(n == 4 && tokens[0] == 5 && tokens[1] == 6 && tokens[2] == 12 && tokens[3] == 0);
    CHECK(es_recycle_draft(rec, V, 4, 1, 32, tokens, parents) == ES_ERR_INVALID_ARG);
    CHECK(es_recycle_draft(rec, 3, 0, 1, 32, tokens, parents) == ES_ERR_INVALID_ARG);
    es_recycle_free(rec);
    es_recycle_free(NULL);
}

static void test_recycle_random_trees(void) {
    // Full random rows: every tree must keep the invariants and the limits.
    es_recycle * rec = NULL;
    CHECK(es_recycle_init(V, K, &rec) == ES_OK);
    uint32_t rng = 3;
    float logits[V * V];
    es_token row_tokens[V];
    for (int32_t i = 0; i < V; i++) {
        row_tokens[i] = i;
        for (int32_t t = 0; t < V; t++) logits[i * V + t] = (float) (lcg(&rng) % 1000);
    }
    CHECK(es_recycle_update(rec, row_tokens, logits, V) == ES_OK);
    es_token tokens[64];
    int32_t parents[64];
    for (int32_t branch = 1; branch <= 8; branch++) {
        for (int32_t max_nodes = 1; max_nodes <= 64; max_nodes += 9) {
            const int32_t n = es_recycle_draft(rec, (es_token) (branch % V), branch, 5, max_nodes,
                                               tokens, parents);
            CHECK(n >= 1 && n <= max_nodes);
            check_tree(tokens, parents, n);
            // depth never exceeds max_depth
            for (int32_t i = 0; i < n; i++) {
                int32_t depth = 1;
                for (int32_t p = parents[i]; p >= 0; p = parents[p]) depth++;
                CHECK(depth <= 5);
            }
        }
    }
    es_recycle_free(rec);
}

int main(void) {
    test_index_params();
    test_index_longest_suffix();
    test_index_most_recent_wins();
    test_index_no_self_match();
    test_index_reset_and_bad_append();
    test_index_against_reference();
    test_cache_counts_and_draft();
    test_cache_heavy_hitter();
    test_cache_primary();
    test_cache_round_trip();
    test_cache_bad_files();
    test_recycle();
    test_recycle_random_trees();
    return check_report("test_drafting");
}
