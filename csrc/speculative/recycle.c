/*
 * recycle.c — token recycling: the candidates the target already produced.
 *
 * Every verification step computes full logits rows whose runners-up are
 * thrown away. Recycling keeps, for each token t, the top-k tokens of the
 * most recent row computed right after t, and grows a draft tree from them:
 * what the target thought likely after a token last time is a good guess for
 * next time (Luo et al., "Turning Trash into Treasure", 2024).
 */
#include "speculative/es_spec.h"

#include <math.h>
#include <stdlib.h>

#define RECYCLE_MAX_K 32

struct es_recycle {
    int32_t    n_vocab;
    int32_t    k;
    es_token * adj;  // (n_vocab, k) candidates after each token, best first; -1: unknown
};

int es_recycle_init(int32_t n_vocab, int32_t k, es_recycle ** out) {
    if (!out || n_vocab <= 0 || k < 1 || k > RECYCLE_MAX_K) return ES_ERR_INVALID_ARG;
    es_recycle * rec = calloc(1, sizeof *rec);
    if (!rec) return ES_ERR_NO_MEMORY;
    rec->n_vocab = n_vocab;
    rec->k = k;
    const size_t n = (size_t) n_vocab * (size_t) k;
    rec->adj = malloc(sizeof(es_token) * n);
    if (!rec->adj) {
        es_recycle_free(rec);
        return ES_ERR_NO_MEMORY;
    }
    for (size_t i = 0; i < n; i++) rec->adj[i] = -1;
    *out = rec;
    return ES_OK;
}

void es_recycle_free(es_recycle * rec) {
    if (!rec) return;
    free(rec->adj);
    free(rec);
}

/* ------------------------------------------------------------------------
 * Update
 * ------------------------------------------------------------------------ */

// Writes the k largest values of row (n floats) into top (k ids, best first;
// ties keep the lower id first; -1 fills the rest when fewer than k values
// can be chosen: NaN and -inf never are). An insertion-sorted buffer of k:
// most values are rejected by one comparison with the current k-th best.
static void row_top_k(const float * row, int32_t n, int32_t k, es_token * top) {
    float best[RECYCLE_MAX_K];  // (k) values of top, descending
    int32_t m = 0;              // filled entries
    for (int32_t t = 0; t < n; t++) {
        const float v = row[t];
        if (!(v > -INFINITY)) continue;  // drops -inf and NaN
        if (m == k && !(v > best[k - 1])) continue;
        int32_t j = m < k ? m++ : k - 1;  // the slot to fill, then sink upwards
        while (j > 0 && v > best[j - 1]) {
            best[j] = best[j - 1];
            top[j] = top[j - 1];
            j--;
        }
        best[j] = v;
        top[j] = t;
    }
    for (int32_t j = m; j < k; j++) top[j] = -1;
}

int es_recycle_update(es_recycle * rec, const es_token * row_tokens, const float * logits, int32_t n_rows) {
    if (!rec || n_rows < 0 || (n_rows > 0 && (!row_tokens || !logits))) return ES_ERR_INVALID_ARG;
    for (int32_t i = 0; i < n_rows; i++) {
        if (row_tokens[i] < 0 || row_tokens[i] >= rec->n_vocab) return ES_ERR_INVALID_ARG;
    }
    // Later rows overwrite earlier ones for a repeated token: the most recent wins.
    for (int32_t i = 0; i < n_rows; i++) {
        const float * row = logits + (size_t) i * (size_t) rec->n_vocab;
        row_top_k(row, rec->n_vocab, rec->k, rec->adj + (size_t) row_tokens[i] * (size_t) rec->k);
    }
    return ES_OK;
}

/* ------------------------------------------------------------------------
 * Draft tree
 *
 * Breadth-first from the root (depth 0). A node at depth d gets as children
 * the first max(1, branch >> d) known candidates of its token, so the tree
 * is wide near the root, where acceptance is likeliest, and thins to chains.
 * Nodes are written in breadth-first order, so parents[i] < i.
 * ------------------------------------------------------------------------ */

int32_t es_recycle_draft(const es_recycle * rec, es_token root, int32_t branch, int32_t max_depth,
                         int32_t max_nodes, es_token * tokens, int32_t * parents) {
    if (!rec || branch < 1 || max_depth < 0 || max_nodes < 0) return ES_ERR_INVALID_ARG;
    if (max_nodes > 0 && (!tokens || !parents)) return ES_ERR_INVALID_ARG;
    if (root < 0 || root >= rec->n_vocab) return ES_ERR_INVALID_ARG;

    int32_t n = 0;
    int32_t level_begin = -1, level_end = 0;  // nodes of the level being expanded; -1: the root
    for (int32_t d = 0; d < max_depth && n < max_nodes && level_begin < level_end; d++) {
        int32_t width = branch >> (d < 31 ? d : 31);
        if (width < 1) width = 1;
        if (width > rec->k) width = rec->k;
        const int32_t next_begin = n;
        for (int32_t p = level_begin; p < level_end && n < max_nodes; p++) {
            const es_token t = p < 0 ? root : tokens[p];
            const es_token * cand = rec->adj + (size_t) t * (size_t) rec->k;
            const int32_t first_child = n;
            for (int32_t j = 0, taken = 0; j < rec->k && taken < width && n < max_nodes; j++) {
                const es_token c = cand[j];
                if (c < 0) continue;
                bool seen = false;  // siblings carry distinct tokens
                for (int32_t s = first_child; s < n && !seen; s++) seen = tokens[s] == c;
                if (seen) continue;
                tokens[n] = c;
                parents[n] = p;
                n++;
                taken++;
            }
        }
        level_begin = next_begin;
        level_end = n;
    }
    return n;
}
