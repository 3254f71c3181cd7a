/*
 * verify.c — speculative verification of a draft tree against the target's
 * logits (es_verify, documented in speculative/es_spec.h).
 *
 * The walk starts at the root and, at each node, builds the kept set of the
 * node's row with es__kept_set(): the very distribution plain sampling draws
 * from, inside the row's allowed-token mask, under the same penalty history, because every accepted
 * token is recorded before the next row is read. One step then either
 * accepts a child (and the walk moves to its row) or chooses the token that
 * ends the call:
 *   - greedy: the child whose token is the argmax, else the argmax itself;
 *   - deterministic proposals: children tried in node order against a
 *     residual that loses each rejected child, then a draw from the residual;
 *   - drafter distributions (chains): min(1, p/q) acceptance, then a draw
 *     from norm(max(p - q, 0)).
 * Randomness is drawn only where an outcome is uncertain: a child with
 * p = 0 is rejected, and one holding all the remaining mass accepted,
 * without touching the RNG. Which uniforms are consumed is a function of the
 * draft and the rows, so a seed still reproduces a run.
 */
#include "speculative/spec_internal.h"

#include <string.h>

/* ------------------------------------------------------------------------
 * The draft tree: validation and children
 * ------------------------------------------------------------------------ */

// Parent of node i; tree->parents == NULL means a chain.
static int32_t parent_of(const es_draft_tree * tree, int32_t i) {
    return tree->parents ? tree->parents[i] : i - 1;
}

// Checks everything the walk relies on, before anything is written:
// parents in [-1, i), tokens in [0, n_vocab), distinct tokens among siblings,
// and drafter distributions only on a chain. With parents[i] < i, "every
// node, the root included, has at most one child" is exactly parents[i] = i - 1.
static bool tree_valid(const es_draft_tree * tree, int32_t n_vocab) {
    if (tree->n_nodes < 0) return false;
    if (tree->n_nodes > 0 && !tree->tokens) return false;
    bool chain = true;
    for (int32_t i = 0; i < tree->n_nodes; i++) {
        const int32_t p = parent_of(tree, i);
        const es_token t = tree->tokens[i];
        if (p < -1 || p >= i) return false;
        if (t < 0 || t >= n_vocab) return false;
        chain = chain && p == i - 1;
        // Siblings have indices above their parent's; n_nodes is small (a
        // few dozen), so the pairwise scan costs less than one logits row.
        if (tree->parents) {
            for (int32_t j = p + 1; j < i; j++) {
                if (tree->parents[j] == p && tree->tokens[j] == t) return false;
            }
        }
    }
    return !tree->probs || chain;
}

// The first child of node (-1: the root) with an index above `after`, or -1.
// Children have larger indices than their parent, so the scan starts there.
static int32_t next_child(const es_draft_tree * tree, int32_t node, int32_t after) {
    const int32_t from = after > node ? after + 1 : node + 1;
    if (!tree->parents) return from == node + 1 && from < tree->n_nodes ? from : -1;
    for (int32_t j = from; j < tree->n_nodes; j++) {
        if (tree->parents[j] == node) return j;
    }
    return -1;
}

static int32_t first_child(const es_draft_tree * tree, int32_t node) {
    return next_child(tree, node, node);
}

/* ------------------------------------------------------------------------
 * Undo: a failed call leaves the sampler as it found it
 * ------------------------------------------------------------------------ */

// The sampler state a call changes: the RNG, and the history ring, of which
// a draft of n_nodes overwrites at most n_nodes + 1 slots from history_head
// on (their old values go to s->history_undo).
typedef struct {
    uint64_t rng[4];
    int32_t  n_history;
    int32_t  history_head;
    int32_t  n_saved;  // ring slots copied to s->history_undo
} sampler_state;

static void save_state(es_sampler * s, int32_t n_nodes, sampler_state * st) {
    const int32_t ring = s->params.repeat_last_n;
    memcpy(st->rng, s->rng, sizeof st->rng);
    st->n_history = s->n_history;
    st->history_head = s->history_head;
    st->n_saved = n_nodes < ring ? n_nodes + 1 : ring;
    for (int32_t i = 0; i < st->n_saved; i++) {
        s->history_undo[i] = s->history[(st->history_head + i) % ring];
    }
}

static void restore_state(es_sampler * s, const sampler_state * st) {
    const int32_t ring = s->params.repeat_last_n;
    memcpy(s->rng, st->rng, sizeof st->rng);
    s->n_history = st->n_history;
    s->history_head = st->history_head;
    for (int32_t i = 0; i < st->n_saved; i++) {
        s->history[(st->history_head + i) % ring] = s->history_undo[i];
    }
}

/* ------------------------------------------------------------------------
 * One step of the walk, on the kept set of the current node's row
 *
 * On entry s->cand / s->cand_p[0, n_kept) hold the kept set (probabilities
 * summing to 1). Each step returns the accepted child, or -1 after writing
 * the token that ends the call to *out. The residuals are built in place in
 * s->cand_p: p is 0 outside the kept set, so nothing outside it can ever
 * carry residual mass and no vocabulary-sized buffer is needed.
 * ------------------------------------------------------------------------ */

// Index of token t in the kept set, or -1 (t has p = 0).
static int32_t kept_index(const es_sampler * s, int32_t n_kept, es_token t) {
    for (int32_t j = 0; j < n_kept; j++) {
        if (s->cand[j] == t) return j;
    }
    return -1;
}

// Greedy: the kept set is the argmax alone, the token plain decoding emits.
static int32_t step_greedy(const es_sampler * s, const es_draft_tree * tree, int32_t node,
                           es_token * out) {
    const es_token best = s->cand[0];
    for (int32_t c = first_child(tree, node); c >= 0; c = next_child(tree, node, c)) {
        if (tree->tokens[c] == best) return c;
    }
    *out = best;
    return -1;
}

// Deterministic proposals: child c is accepted with probability
// r(c) / sum(r), r the residual (p less the children rejected so far). The
// sum is recomputed rather than decremented, so that a child left holding
// all of the remaining mass is accepted exactly, not up to rounding.
static int32_t step_candidates(es_sampler * s, const es_draft_tree * tree, int32_t node,
                               int32_t n_kept, es_token * out) {
    bool rejected = false;
    for (int32_t c = first_child(tree, node); c >= 0; c = next_child(tree, node, c)) {
        const int32_t k = kept_index(s, n_kept, tree->tokens[c]);
        if (k < 0 || !(s->cand_p[k] > 0.0f)) continue;  // r(c) = 0: rejected for sure
        double mass = 0.0;
        for (int32_t j = 0; j < n_kept; j++) mass += s->cand_p[j];
        const double r_c = s->cand_p[k];
        if (r_c >= mass || es__rng_uniform(s->rng) < r_c / mass) return c;
        s->cand_p[k] = 0.0f;
        rejected = true;
    }
    // Every child rejected: draw from the renormalised residual. Untouched,
    // the kept set is drawn as es_sampler_sample draws it, bit for bit. The
    // residual keeps positive mass: the last token holding any is accepted.
    if (rejected) {
        double mass = 0.0;
        for (int32_t j = 0; j < n_kept; j++) mass += s->cand_p[j];
        for (int32_t j = 0; j < n_kept; j++) s->cand_p[j] = (float) (s->cand_p[j] / mass);
    }
    *out = es__draw(s, n_kept);
    return -1;
}

// Drafter distributions on a chain: the child of node is node + 1, drawn
// from q = tree->probs row node + 1 (n_vocab floats). Accepted with
// probability min(1, p(x) / q(x)); a q(x) <= 0 (x could not have been drawn)
// accepts any x with p(x) > 0, and a NaN q(x) rejects it.
static int32_t step_drafter(es_sampler * s, const es_draft_tree * tree, int32_t node,
                            int32_t n_kept, es_token * out) {
    const int32_t c = node + 1;
    if (c >= tree->n_nodes) {  // a leaf: the bonus token comes from p
        *out = es__draw(s, n_kept);
        return -1;
    }
    const float * q = tree->probs + (size_t) c * (size_t) s->n_vocab;  // (n_vocab)
    const es_token x = tree->tokens[c];
    const int32_t k = kept_index(s, n_kept, x);
    const float p_x = k < 0 ? 0.0f : s->cand_p[k];
    if (p_x > 0.0f && (p_x >= q[x] || es__rng_uniform(s->rng) < (double) p_x / q[x])) return c;

    // Rejected: draw from norm(max(p - q, 0)), zero outside the kept set. An
    // all-zero residual means p <= q on the kept set, i.e. p == q: draw from p.
    double mass = 0.0;
    for (int32_t j = 0; j < n_kept; j++) {
        const float d = s->cand_p[j] - q[s->cand[j]];
        if (d > 0.0f) mass += d;
    }
    if (mass > 0.0) {
        for (int32_t j = 0; j < n_kept; j++) {
            const float d = s->cand_p[j] - q[s->cand[j]];
            s->cand_p[j] = d > 0.0f ? (float) (d / mass) : 0.0f;
        }
    }
    *out = es__draw(s, n_kept);
    return -1;
}

/* ------------------------------------------------------------------------
 * The walk
 * ------------------------------------------------------------------------ */

int es_verify(es_sampler * s, const float * logits, const es_draft_tree * tree,
              es_token * out_tokens, int32_t * out_path, int32_t * n_out) {
    if (!s || !logits || !tree || !out_tokens || !n_out) return ES_ERR_INVALID_ARG;
    if (!tree_valid(tree, s->n_vocab)) return ES_ERR_INVALID_ARG;

    const bool greedy = s->params.temperature <= 0.0f;
    const size_t V = (size_t) s->n_vocab;
    const size_t W = (size_t) ES_MASK_WORDS(s->n_vocab);
    sampler_state saved;
    save_state(s, tree->n_nodes, &saved);

    int32_t n = 0;      // tokens written to out_tokens
    int32_t node = -1;  // current node (-1: the root); its row is node + 1
    for (;;) {
        // 1. the target distribution at this node, under the history so far
        int32_t n_kept = 0;
        const uint32_t * mask = tree->masks ? tree->masks + (size_t) (node + 1) * W : NULL;
        const int rc = es__kept_set(s, logits + (size_t) (node + 1) * V, mask, &n_kept);
        if (rc != ES_OK) {
            restore_state(s, &saved);
            return rc;
        }

        // 2. accept a child, or choose the token that ends the call
        es_token last = -1;
        const int32_t child =
            greedy       ? step_greedy(s, tree, node, &last)
            : tree->probs ? step_drafter(s, tree, node, n_kept, &last)
                          : step_candidates(s, tree, node, n_kept, &last);

        // 3. record it, so the next row's penalty sees it as plain decoding would
        if (child < 0) {
            out_tokens[n++] = last;
            es_sampler_accept(s, last);
            break;
        }
        if (out_path) out_path[n] = child;
        out_tokens[n++] = tree->tokens[child];
        es_sampler_accept(s, tree->tokens[child]);
        node = child;
    }
    *n_out = n;
    return ES_OK;
}
