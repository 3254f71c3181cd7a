/*
 * sampling.c — the sampler: one row of logits in, one token out.
 *
 * The kept set of a row (the tokens that may be drawn and their
 * probabilities) is built by one function, es__kept_set(), that both sampling
 * and speculative verification use, so the distribution that verification
 * preserves is exactly the one plain sampling draws from.
 */
#include "speculative/spec_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------
 * RNG: xoshiro256** seeded through splitmix64 (public-domain algorithms by
 * Blackman and Vigna). Our own state, so a seed reproduces a run exactly.
 * ------------------------------------------------------------------------ */

static uint64_t splitmix64(uint64_t * x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

void es__rng_seed(uint64_t state[4], uint64_t seed) {
    for (int i = 0; i < 4; i++) state[i] = splitmix64(&seed);
}

double es__rng_uniform(uint64_t s[4]) {
    const uint64_t result = rotl(s[1] * 5, 7) * 9;
    const uint64_t t = s[1] << 17;
    s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return (double) (result >> 11) * 0x1.0p-53;  // [0, 1)
}

/* ------------------------------------------------------------------------
 * Sampler object
 * ------------------------------------------------------------------------ */

es_sampler_params es_sampler_default_params(void) {
    es_sampler_params p;
    p.temperature    = 0.0f;
    p.top_k          = 0;
    p.top_p          = 1.0f;
    p.min_p          = 0.0f;
    p.repeat_penalty = 1.0f;
    p.presence_penalty  = 0.0f;
    p.frequency_penalty = 0.0f;
    p.repeat_last_n  = 64;
    p.seed           = 0;
    return p;
}

static bool params_valid(const es_sampler_params * p) {
    if (p->temperature != p->temperature) return false;                       // NaN
    if (p->temperature > 0.0f && !isfinite(1.0f / p->temperature)) return false;  // 1/T overflows
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f)) return false;
    if (!(p->min_p >= 0.0f && p->min_p < 1.0f)) return false;
    if (!(p->repeat_penalty > 0.0f)) return false;
    if (!isfinite(p->presence_penalty) || !isfinite(p->frequency_penalty)) return false;
    if (p->repeat_last_n < 0) return false;
    return true;
}

int es_sampler_init(const es_sampler_params * params, int32_t n_vocab, es_sampler ** out) {
    if (!params || !out || n_vocab <= 0 || !params_valid(params)) return ES_ERR_INVALID_ARG;
    es_sampler * s = calloc(1, sizeof *s);
    if (!s) return ES_ERR_NO_MEMORY;
    s->params  = *params;
    s->n_vocab = n_vocab;
    s->work    = malloc(sizeof(float) * (size_t) n_vocab);
    s->cand    = malloc(sizeof(es_token) * (size_t) n_vocab);
    s->cand_p  = malloc(sizeof(float) * (size_t) n_vocab);
    const size_t n_ring = (size_t) (params->repeat_last_n > 0 ? params->repeat_last_n : 1);
    s->history      = malloc(sizeof(es_token) * n_ring);
    s->history_undo = malloc(sizeof(es_token) * n_ring);
    if (!s->work || !s->cand || !s->cand_p || !s->history || !s->history_undo) {
        es_sampler_free(s);
        return ES_ERR_NO_MEMORY;
    }
    es_sampler_reset(s);
    *out = s;
    return ES_OK;
}

void es_sampler_free(es_sampler * s) {
    if (!s) return;
    free(s->bias);
    free(s->bias_ids);
    free(s->history_undo);
    free(s->history);
    free(s->cand_p);
    free(s->cand);
    free(s->work);
    free(s);
}

int es_sampler_set_bias(es_sampler * s, const es_token * ids, const float * bias, int32_t n) {
    if (!s || n < 0 || (n > 0 && (!ids || !bias))) return ES_ERR_INVALID_ARG;
    for (int32_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= s->n_vocab || bias[i] != bias[i] || bias[i] == INFINITY) return ES_ERR_INVALID_ARG;
    }
    es_token * new_ids = n ? malloc(sizeof(es_token) * (size_t) n) : NULL;
    float * new_bias = n ? malloc(sizeof(float) * (size_t) n) : NULL;
    if (n && (!new_ids || !new_bias)) {
        free(new_ids);
        free(new_bias);
        return ES_ERR_NO_MEMORY;
    }
    if (n) {
        memcpy(new_ids, ids, sizeof(es_token) * (size_t) n);
        memcpy(new_bias, bias, sizeof(float) * (size_t) n);
    }
    free(s->bias_ids);
    free(s->bias);
    s->bias_ids = new_ids;
    s->bias = new_bias;
    s->n_bias = n;
    return ES_OK;
}

void es_sampler_reset(es_sampler * s) {
    if (!s) return;
    s->n_history = 0;
    s->history_head = 0;
    es__rng_seed(s->rng, s->params.seed);
}

void es_sampler_accept(es_sampler * s, es_token token) {
    if (!s || token < 0 || token >= s->n_vocab || s->params.repeat_last_n <= 0) return;
    s->history[s->history_head] = token;
    s->history_head = (s->history_head + 1) % s->params.repeat_last_n;
    if (s->n_history < s->params.repeat_last_n) s->n_history++;
}

/* ------------------------------------------------------------------------
 * The kept set
 * ------------------------------------------------------------------------ */

static bool penalties_off(const es_sampler_params * p) {
    return p->repeat_penalty == 1.0f && p->presence_penalty == 0.0f && p->frequency_penalty == 0.0f;
}

// Returns logits with the bias and the penalties applied: the row itself when
// both are off (no copy), else a copy in s->work. The biases are added first
// (as llama.cpp's logit-bias sampler comes first); then each distinct recent
// token t, seen c times in the window: its logit is divided (if positive) or
// multiplied by repeat_penalty, then loses presence_penalty + c * frequency_penalty.
static const float * adjusted(es_sampler * s, const float * logits) {
    const bool penalize = !penalties_off(&s->params) && s->n_history > 0;
    if (!penalize && s->n_bias == 0) return logits;
    memcpy(s->work, logits, sizeof(float) * (size_t) s->n_vocab);
    for (int32_t i = 0; i < s->n_bias; i++) s->work[s->bias_ids[i]] += s->bias[i];
    if (!penalize) return s->work;
    const float pen = s->params.repeat_penalty;
    for (int32_t i = 0; i < s->n_history; i++) {
        const es_token t = s->history[i];
        bool seen = false;  // each distinct token is penalized once
        for (int32_t j = 0; j < i && !seen; j++) seen = s->history[j] == t;
        if (seen) continue;
        int32_t c = 1;
        for (int32_t j = i + 1; j < s->n_history; j++) c += s->history[j] == t;
        float v = s->work[t];
        v = v > 0.0f ? v / pen : v * pen;
        s->work[t] = v - s->params.presence_penalty - (float) c * s->params.frequency_penalty;
    }
    return s->work;
}

static inline bool allowed(const uint32_t * mask, int32_t t) {
    return !mask || (mask[t >> 5] >> (t & 31)) & 1u;
}

// First index of the largest finite-or-inf value among the allowed ones; ties
// go to the lowest id, as numpy.argmax does. -1 when every allowed value is
// NaN or -inf (or nothing is allowed).
static es_token argmax(const float * x, const uint32_t * mask, int32_t n) {
    es_token best = -1;
    float best_v = -INFINITY;
    if (!mask) {
        for (int32_t i = 0; i < n; i++) {
            if (x[i] > best_v) { best_v = x[i]; best = i; }
        }
        return best;
    }
    for (int32_t w = 0; w < ES_MASK_WORDS(n); w++) {
        for (uint32_t bits = mask[w]; bits; bits &= bits - 1) {  // each set bit, lowest first
            const int32_t i = w * 32 + __builtin_ctz(bits);
            if (i >= n) break;
            if (x[i] > best_v) { best_v = x[i]; best = i; }
        }
    }
    return best;
}

typedef struct { float p; es_token id; } prob_id;

// Largest probability first; ties go to the lower token id, so the order,
// and with it the top-p set, is deterministic.
static int cmp_prob_desc(const void * a, const void * b) {
    const prob_id * x = a, * y = b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

// Sorts the first n candidates by probability, largest first.
static int sort_candidates(es_sampler * s, int32_t n) {
    prob_id * tmp = malloc(sizeof(prob_id) * (size_t) n);
    if (!tmp) return ES_ERR_NO_MEMORY;
    for (int32_t i = 0; i < n; i++) { tmp[i].p = s->cand_p[i]; tmp[i].id = s->cand[i]; }
    qsort(tmp, (size_t) n, sizeof(prob_id), cmp_prob_desc);
    for (int32_t i = 0; i < n; i++) { s->cand_p[i] = tmp[i].p; s->cand[i] = tmp[i].id; }
    free(tmp);
    return ES_OK;
}

// Moves candidates with p >= threshold to the front; returns their count.
static int32_t partition_at(es_sampler * s, int32_t n, float threshold) {
    int32_t k = 0;
    for (int32_t i = 0; i < n; i++) {
        if (s->cand_p[i] >= threshold) {
            float p = s->cand_p[i]; s->cand_p[i] = s->cand_p[k]; s->cand_p[k] = p;
            es_token t = s->cand[i]; s->cand[i] = s->cand[k]; s->cand[k] = t;
            k++;
        }
    }
    return k;
}

// Keeps the k largest of n candidates (by logit in cand_p) in front, in any order.
static int32_t select_top_k(es_sampler * s, int32_t n, int32_t k) {
    if (k >= n) return n;
    // Quickselect on cand_p (descending), deterministic middle pivot.
    int32_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const float pivot = s->cand_p[lo + (hi - lo) / 2];
        int32_t i = lo, j = hi;
        while (i <= j) {
            while (s->cand_p[i] > pivot) i++;
            while (s->cand_p[j] < pivot) j--;
            if (i <= j) {
                float p = s->cand_p[i]; s->cand_p[i] = s->cand_p[j]; s->cand_p[j] = p;
                es_token t = s->cand[i]; s->cand[i] = s->cand[j]; s->cand[j] = t;
                i++; j--;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
    return k;
}

int es__kept_set(es_sampler * s, const float * logits, const uint32_t * mask, int32_t * n_kept) {
    const float * x = adjusted(s, logits);
    const int32_t V = s->n_vocab;

    if (s->params.temperature <= 0.0f) {
        const es_token best = argmax(x, mask, V);
        if (best < 0) return ES_ERR_EMPTY;
        s->cand[0] = best;
        s->cand_p[0] = 1.0f;
        *n_kept = 1;
        return ES_OK;
    }

    // 1. every finite allowed candidate, its logit scaled by 1/T
    const float inv_t = 1.0f / s->params.temperature;
    int32_t n = 0;
    float max_l = -INFINITY;
    for (int32_t i = 0; i < V; i++) {
        const float v = x[i];
        if (!(v > -INFINITY) || !allowed(mask, i)) continue;  // drops -inf, NaN, masked
        s->cand[n] = i;
        s->cand_p[n] = v * inv_t;
        if (s->cand_p[n] > max_l) max_l = s->cand_p[n];
        n++;
    }
    if (n == 0) return ES_ERR_EMPTY;

    // 2. top-k on the scaled logits
    if (s->params.top_k > 0) n = select_top_k(s, n, s->params.top_k);

    // 3. softmax over what is left. An infinite max (a +inf logit, or a scaled
    // logit that overflowed) would make x - max_l NaN: take softmax's limit
    // instead, all the mass shared by the tokens at the max, as greedy would.
    double sum = 0.0;
    for (int32_t i = 0; i < n; i++) {
        s->cand_p[i] = isinf(max_l) ? (float) (s->cand_p[i] == max_l)
                                    : expf(s->cand_p[i] - max_l);
        sum += s->cand_p[i];
    }
    const float inv_sum = (float) (1.0 / sum);
    for (int32_t i = 0; i < n; i++) s->cand_p[i] *= inv_sum;

    // 4. top-p: the smallest prefix, by probability, holding top_p of the mass.
    // Only that prefix needs sorting: shrink the threshold until the tokens
    // above it hold enough mass, then sort just those.
    if (s->params.top_p < 1.0f && n > 1) {
        float threshold = 1.0f / 64.0f;
        int32_t m;
        for (;;) {
            m = partition_at(s, n, threshold);
            double mass = 0.0;
            for (int32_t i = 0; i < m; i++) mass += s->cand_p[i];
            if (mass >= s->params.top_p || threshold < 1e-30f) break;
            threshold *= 1.0f / 16.0f;
        }
        const int rc = sort_candidates(s, m);
        if (rc != ES_OK) return rc;
        double cum = 0.0;
        int32_t keep = m;
        for (int32_t i = 0; i < m; i++) {
            cum += s->cand_p[i];
            if (cum >= s->params.top_p) { keep = i + 1; break; }
        }
        n = keep;
    }

    // 5. min-p relative to the most likely token (whose p is unchanged by 4)
    if (s->params.min_p > 0.0f) {
        float p_max = 0.0f;
        for (int32_t i = 0; i < n; i++) if (s->cand_p[i] > p_max) p_max = s->cand_p[i];
        n = partition_at(s, n, s->params.min_p * p_max);
    }

    // 6. renormalise the kept set
    sum = 0.0;
    for (int32_t i = 0; i < n; i++) sum += s->cand_p[i];
    const float renorm = (float) (1.0 / sum);
    for (int32_t i = 0; i < n; i++) s->cand_p[i] *= renorm;
    *n_kept = n;
    return ES_OK;
}

es_token es__draw(es_sampler * s, int32_t n_kept) {
    const double u = es__rng_uniform(s->rng);
    double cum = 0.0;
    es_token last = s->cand[0];  // the last token seen with p > 0
    for (int32_t i = 0; i < n_kept; i++) {
        if (!(s->cand_p[i] > 0.0f)) continue;
        cum += s->cand_p[i];
        last = s->cand[i];
        if (u < cum) return last;
    }
    // Rounding can leave the total just under 1 and u past it: fall back to
    // a token that can be drawn, never one whose p underflowed to 0.
    return last;
}

int es_sampler_sample(es_sampler * s, const float * logits, const uint32_t * mask, es_token * out) {
    if (!s || !logits || !out) return ES_ERR_INVALID_ARG;
    if (s->params.temperature <= 0.0f) {
        // Fast path: no kept-set bookkeeping for argmax.
        const es_token best = argmax(adjusted(s, logits), mask, s->n_vocab);
        if (best < 0) return ES_ERR_EMPTY;
        *out = best;
        return ES_OK;
    }
    int32_t n = 0;
    const int rc = es__kept_set(s, logits, mask, &n);
    if (rc != ES_OK) return rc;
    *out = es__draw(s, n);
    return ES_OK;
}

int es_sampler_probs(es_sampler * s, const float * logits, const uint32_t * mask, float * probs) {
    if (!s || !logits || !probs) return ES_ERR_INVALID_ARG;
    int32_t n = 0;
    const int rc = es__kept_set(s, logits, mask, &n);
    if (rc != ES_OK) return rc;
    memset(probs, 0, sizeof(float) * (size_t) s->n_vocab);
    for (int32_t i = 0; i < n; i++) probs[s->cand[i]] = s->cand_p[i];
    return ES_OK;
}
