/*
 * es_spec.h — the speculative core: sampling, verification of draft trees, and
 * the drafters' data structures (n-gram index and cache, token recycling).
 *
 * It works on logits rows that a backend (llama.cpp, the native engine,
 * ONNX Runtime) already holds in memory and copies a vocabulary-sized row
 * only where a function says so.
 */
#ifndef ES_SPEC_H
#define ES_SPEC_H

#include "es_base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ========================================================================
 * Sampler
 *
 * Turns one row of logits into one token. The pipeline, in order:
 *   penalties (repetition, presence, frequency) -> allowed-token mask ->
 *   greedy (temperature <= 0) or
 *   temperature -> top-k -> softmax -> top-p -> min-p -> draw.
 * The same pipeline defines the target distribution that speculative
 * verification keeps exactly.
 *
 * An allowed-token mask (a grammar's, for structured output) is a bitmask of
 * ES_MASK_WORDS(n_vocab) words: bit (t % 32) of word t / 32 set means token t
 * may be chosen. Masked-out tokens get probability 0 before anything else is
 * decided, so greedy, sampling and verification all stay inside the mask.
 * ======================================================================== */

#define ES_MASK_WORDS(n_vocab) (((n_vocab) + 31) / 32)

typedef struct es_sampler es_sampler;

typedef struct es_sampler_params {
    float    temperature;     // <= 0: greedy (argmax); default 0
    int32_t  top_k;           // keep the k most likely tokens; <= 0: off; default 0
    float    top_p;           // nucleus mass in (0, 1]; 1: off; default 1
    float    min_p;           // drop tokens below min_p * p(max), [0, 1); 0: off; default 0
    float    repeat_penalty;  // > 0; 1: off; divides positive logits of recent tokens
    float    presence_penalty;   // subtracted once from the logit of each recent token; 0: off
    float    frequency_penalty;  // subtracted per occurrence of a recent token; 0: off
    int32_t  repeat_last_n;   // how many recent tokens the penalties see; default 64
    uint64_t seed;            // seeds the sampler's own RNG (xoshiro256**)
} es_sampler_params;

es_sampler_params es_sampler_default_params(void);

// Makes a sampler for rows of n_vocab logits. *out is set on ES_OK only.
int  es_sampler_init(const es_sampler_params * params, int32_t n_vocab, es_sampler ** out);
void es_sampler_free(es_sampler * smpl);

// Forgets the penalty history and reseeds the RNG with params.seed.
void es_sampler_reset(es_sampler * smpl);

// Adds bias[i] to the logit of token ids[i] in every row, before the
// penalties (OpenAI's and llama.cpp's logit_bias; -INFINITY bans a token),
// for sampling and verification alike. The arrays are copied; a later call
// replaces them, n = 0 clears them. ES_ERR_INVALID_ARG for an id outside
// [0, n_vocab) or a NaN or +inf bias (the sampler is then unchanged);
// ES_ERR_NO_MEMORY.
int  es_sampler_set_bias(es_sampler * smpl, const es_token * ids, const float * bias, int32_t n);

// Records a token that became part of the text (prompt or generated), for
// the repetition penalty. Tokens outside [0, n_vocab) are ignored.
void es_sampler_accept(es_sampler * smpl, es_token token);

// Samples one token from logits (n_vocab floats, read only), inside mask
// (ES_MASK_WORDS(n_vocab) words; NULL: every token allowed). Does not record
// it: call es_sampler_accept() for the token that is kept. ES_ERR_EMPTY when
// no allowed token has a finite logit.
int  es_sampler_sample(es_sampler * smpl, const float * logits, const uint32_t * mask, es_token * out);

// Writes the sampler's final distribution for logits (inside mask, may be
// NULL) into probs (n_vocab floats): zero outside the kept set, summing to 1.
// For greedy, a one-hot row.
int  es_sampler_probs(es_sampler * smpl, const float * logits, const uint32_t * mask, float * probs);

/* ========================================================================
 * Verification
 *
 * A draft is a tree of proposed tokens hanging under the root: the last
 * token of the text, which the target evaluates together with the draft in
 * one batch. Node i holds tokens[i] and parents[i] (-1: a child of the root),
 * with parents[i] < i, and siblings carry distinct tokens. A chain is the
 * tree with parents[i] = i - 1.
 *
 * The target's logits come as n_nodes + 1 rows, n_vocab floats apart
 * (row-major, (n_nodes + 1, n_vocab)): row 0 is the root's, row i + 1 node i's.
 *
 * With masks, row r's distribution is restricted to masks row r: a drafted
 * token outside its parent row's mask is rejected, and the output keeps the
 * constrained distribution exactly (the mask of a node's row is the grammar's
 * state after the path to that node).
 *
 * Greedy (temperature <= 0): a node is accepted when it is the argmax of its
 * parent's row, so the output equals plain greedy decoding token for token.
 * Sampling: speculative (rejection) sampling that leaves the target's
 * distribution — the sampler's kept set — exactly unchanged:
 *   - deterministic proposals (probs == NULL): the children of a node are
 *     tried in order; child c is accepted with probability p(c) under the
 *     current residual p, else p loses c and is renormalised; when every
 *     child is rejected the token is drawn from the residual;
 *   - drafter distributions (probs != NULL, chains only): node i is accepted
 *     with probability min(1, p(x)/q(x)), else a token is drawn from
 *     norm(max(p - q, 0)).
 * ======================================================================== */

typedef struct es_draft_tree {
    const es_token * tokens;   // (n_nodes) proposed tokens
    const int32_t  * parents;  // (n_nodes) parent node or -1; NULL: a chain
    const float    * probs;    // (n_nodes, n_vocab) distribution node i was drawn
                               //   from (the drafter's es_sampler_probs row), or
                               //   NULL for deterministic proposals; chains only
    int32_t          n_nodes;  // >= 0; 0 makes verification plain sampling
    const uint32_t * masks;    // (n_nodes + 1, ES_MASK_WORDS(n_vocab)) allowed tokens of
                               //   each logits row, or NULL: unconstrained. A row that
                               //   verification never reaches (below a rejected node)
                               //   may hold anything.
} es_draft_tree;

// Verifies a draft against the target's logits (see above).
// out_tokens (n_nodes + 1): the accepted draft tokens, then one token chosen
//   by the target (the correction, or the bonus after a fully accepted path);
// out_path (n_nodes, may be NULL): the node index of each accepted token;
// *n_out: number of tokens written to out_tokens (accepted + 1).
// Every token written is recorded with es_sampler_accept().
// Returns ES_OK, ES_ERR_INVALID_ARG (bad tree: parent out of order, probs with
// branching), ES_ERR_EMPTY.
int es_verify(es_sampler * smpl, const float * logits, const es_draft_tree * tree,
              es_token * out_tokens, int32_t * out_path, int32_t * n_out);

/* ========================================================================
 * Drafting data structures
 * ======================================================================== */

/* --- N-gram index: prompt lookup / context copy ---------------------------
 * Indexes a growing token sequence (prompt + output) by its n-grams,
 * n_min <= n <= n_max, and proposes the continuation of the most recent
 * earlier occurrence of the longest suffix of the sequence. */

typedef struct es_ngram_index es_ngram_index;

typedef struct es_ngram_index_params {
    int32_t n_min;  // shortest suffix worth matching; default 2 (>= 1)
    int32_t n_max;  // longest suffix tried first; default 5 (>= n_min, <= 16)
} es_ngram_index_params;

es_ngram_index_params es_ngram_index_default_params(void);
int  es_ngram_index_init(const es_ngram_index_params * params, es_ngram_index ** out);
void es_ngram_index_free(es_ngram_index * idx);
// Forgets the sequence.
void es_ngram_index_reset(es_ngram_index * idx);
// Appends tokens to the indexed sequence.
int  es_ngram_index_append(es_ngram_index * idx, const es_token * tokens, int32_t n_tokens);
// Length of the indexed sequence.
int32_t es_ngram_index_size(const es_ngram_index * idx);
// Writes up to max_draft tokens continuing the sequence into out and returns
// how many (0: no earlier occurrence of any suffix); *match_len (may be NULL)
// gets the n of the suffix that matched.
int32_t es_ngram_index_draft(const es_ngram_index * idx, es_token * out, int32_t max_draft,
                             int32_t * match_len);

/* --- N-gram cache: next-token counts from a corpus ------------------------
 * For every context of 1..n_max tokens seen in the text added, the counts of
 * the tokens that followed. Static caches are built from a corpus and saved;
 * a dynamic one learns the session's own text. Drafting walks the most
 * frequent continuation of the longest known context. */

typedef struct es_ngram_cache es_ngram_cache;

int  es_ngram_cache_init(int32_t n_max, es_ngram_cache ** out);  // n_max in [1, 8]
void es_ngram_cache_free(es_ngram_cache * cache);
// Counts every (context, next token) pair in tokens.
int  es_ngram_cache_add(es_ngram_cache * cache, const es_token * tokens, int32_t n_tokens);
// Number of distinct contexts held.
int64_t es_ngram_cache_size(const es_ngram_cache * cache);
// Saves to / loads from a file (path in UTF-8). Saving writes path as given:
// the caller writes to a temporary name and renames. Loading checks the
// header, sizes and a checksum and fails with ES_ERR_FORMAT on a bad file.
int  es_ngram_cache_save(const es_ngram_cache * cache, const char * path);
int  es_ngram_cache_load(const char * path, es_ngram_cache ** out);
// Drafts a chain of up to max_draft tokens after context (n_context tokens,
// the end of the text). Each step uses the longest context the cache (or,
// first, the optional second cache `primary`, e.g. the session's dynamic
// cache) knows, and stops when the best next token's share of its context's
// count falls below min_share in [0, 1]. Returns the number written.
int32_t es_ngram_cache_draft(const es_ngram_cache * cache, const es_ngram_cache * primary,
                             const es_token * context, int32_t n_context,
                             es_token * out, int32_t max_draft, float min_share);

/* --- Token recycling: adjacency of candidates the target already produced ---
 * For each token t, the top-k tokens of the target's most recent logits row
 * computed right after t: an (n_vocab, k) matrix. Drafting expands it
 * breadth-first from the last token into a draft tree. */

typedef struct es_recycle es_recycle;

int  es_recycle_init(int32_t n_vocab, int32_t k, es_recycle ** out);  // k in [1, 32]
void es_recycle_free(es_recycle * rec);
// Records, for each of n_rows rows, the top-k of logits row i (n_vocab floats,
// rows n_vocab apart) as the candidates that follow row_tokens[i].
int  es_recycle_update(es_recycle * rec, const es_token * row_tokens, const float * logits, int32_t n_rows);
// Builds a tree below root: breadth-first, node children are the first
// `branch` candidates of its token (deeper levels take fewer: level d uses
// max(1, branch >> d)), at most max_depth levels and max_nodes nodes.
// Writes tokens and parents (max_nodes each) and returns the node count.
int32_t es_recycle_draft(const es_recycle * rec, es_token root, int32_t branch, int32_t max_depth,
                         int32_t max_nodes, es_token * tokens, int32_t * parents);

#ifdef __cplusplus
}
#endif

#endif  // ES_SPEC_H
