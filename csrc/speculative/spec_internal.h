/*
 * edgespec_internal.h — declarations shared by the C core's files, not part
 * of the public ABI.
 */
#ifndef EDGESPEC_INTERNAL_H
#define EDGESPEC_INTERNAL_H

#include "speculative/es_spec.h"

struct es_sampler {
    es_sampler_params params;
    int32_t    n_vocab;
    uint64_t   rng[4];        // xoshiro256** state
    float    * work;          // (n_vocab) biased and penalized copy of a logits row
    es_token * bias_ids;      // (n_bias) tokens whose logits get a bias (es_sampler_set_bias)
    float    * bias;          // (n_bias) their biases
    int32_t    n_bias;
    es_token * cand;          // (n_vocab) candidate token ids of the kept set
    float    * cand_p;        // (n_vocab) their scaled logits, then probabilities
    es_token * history;       // (repeat_last_n) ring of recent tokens
    es_token * history_undo;  // (repeat_last_n) ring slots es_verify overwrites, kept
                              //   to put back when the call fails midway
    int32_t    n_history;     // valid entries in history
    int32_t    history_head;  // next slot to write
};

void   es__rng_seed(uint64_t state[4], uint64_t seed);
double es__rng_uniform(uint64_t state[4]);  // [0, 1)

// Builds the kept set of one logits row, inside mask (NULL: all allowed), into
// s->cand / s->cand_p[0, *n_kept): probabilities summing to 1. Greedy keeps
// the argmax alone with p = 1.
int      es__kept_set(es_sampler * s, const float * logits, const uint32_t * mask, int32_t * n_kept);
// Draws one token from the kept set with the sampler's RNG.
es_token es__draw(es_sampler * s, int32_t n_kept);

#endif  // EDGESPEC_INTERNAL_H
