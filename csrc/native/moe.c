/*
 * moe.c — mixture-of-experts feed-forward blocks, shared by every
 * architecture with experts (Mixtral-style llama, qwen3moe).
 *
 *   es_experts   a model's experts: the router and the three expert stacks of
 *                each layer, bound and checked once, and the provider through
 *                which es_moe_ffn reaches one expert's matrix
 *   es_moe       one context's scratch for es_moe_ffn
 *   es_moe_ffn   route each token to its top-k experts, run those SwiGLU FFNs,
 *                add their outputs weighted, best expert first
 *
 * A token's output depends on its own row alone: the router, every expert
 * matvec and the weighted sum read one token at a time, in an order fixed by
 * the token's own routing, so results do not change with the other tokens of
 * a batch or the number of threads (batch invariance, which exact
 * speculative decoding relies on).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "native/native_internal.h"

/* ---- binding the experts ------------------------------------------------- */

// One layer's tensors as the GGUF stores them (ne order, innermost first).
typedef struct moe_layer {
    const es_tensor * gate_inp;   // (n_embd, n_expert): the router
    const es_tensor * exps[3];    // ES_EXPERT_GATE, _UP: (n_embd, n_ff, n_expert);
                                  // ES_EXPERT_DOWN: (n_ff, n_embd, n_expert)
} moe_layer;

struct es_experts {
    es_moe_params      p;
    moe_layer        * layers;     // (n_layer), owned
    es_expert_provider provider;   // what es_moe_ffn calls: the mapping's or the F32
                                   // copies' (self: this es_experts), or one set in
                                   // its place (es_experts_set_provider)
};

static const char * const EXPS_NAME[3] = { "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps" };

// Finds blk.<il>.<kind>.weight and checks its shape (ne0, ne1, ne2; ne2 = 1
// for a matrix) and that the kernels can read its type.
static int bind_tensor(const es_gguf * g, int32_t il, const char * kind, int64_t ne0,
                       int64_t ne1, int64_t ne2, const es_tensor ** out, char * err,
                       size_t err_cap) {
    char name[64];
    snprintf(name, sizeof name, "blk.%d.%s.weight", (int) il, kind);
    const es_tensor * t = es_gguf_find_tensor(g, name);
    if (!t) {
        snprintf(err, err_cap, "tensor %s is missing", name);
        return ES_ERR_FORMAT;
    }
    if (t->ne[0] != ne0 || t->ne[1] != ne1 || t->ne[2] != ne2 || t->ne[3] != 1) {
        snprintf(err, err_cap, "tensor %s has shape (%lld, %lld, %lld, %lld), expected "
                 "(%lld, %lld, %lld)", name, (long long) t->ne[0], (long long) t->ne[1],
                 (long long) t->ne[2], (long long) t->ne[3], (long long) ne0, (long long) ne1,
                 (long long) ne2);
        return ES_ERR_FORMAT;
    }
    if (es_type_row_bytes(t->type, ne0) == 0 || es_act_type(t->type) < 0) {
        snprintf(err, err_cap, "tensor %s: weight type %s is not supported", name,
                 es_type_name(t->type));
        return ES_ERR_UNSUPPORTED;
    }
    *out = t;
    return ES_OK;
}

// The mapped provider: expert e of a stack is its e-th (ne1, ne0) slab.
static int mapped_get(void * self, int32_t il, int32_t expert, int32_t which,
                      es_expert_view * out) {
    const es_experts * ex = self;
    const es_tensor * t = ex->layers[il].exps[which];
    const size_t slab = (size_t) t->ne[1] * es_type_row_bytes(t->type, t->ne[0]);
    out->data = (const char *) t->data + (size_t) expert * slab;
    out->type = t->type;
    return ES_OK;
}

static void mapped_put(void * self, int32_t il, int32_t expert, int32_t which,
                       const es_expert_view * view) {
    (void) self; (void) il; (void) expert; (void) which; (void) view;
}

// The dequantizing provider (ES_EXPERTS_F32): an F32 copy of the
// mapped slab, made on get and freed on put. It takes the path a cache of
// experts will take (a buffer filled on demand, of another type than the
// file's), so tests can check that path against the mapped one.
static int f32_get(void * self, int32_t il, int32_t expert, int32_t which,
                   es_expert_view * out) {
    const es_experts * ex = self;
    const es_tensor * t = ex->layers[il].exps[which];
    es_expert_view src;
    mapped_get(self, il, expert, which, &src);
    const int64_t n = t->ne[0], rows = t->ne[1];
    float * dst = malloc((size_t) (rows * n) * sizeof *dst);   // (rows, n)
    if (!dst) return ES_ERR_NO_MEMORY;
    const size_t row_bytes = es_type_row_bytes(t->type, n);
    for (int64_t r = 0; r < rows; r++) {
        es_dequantize_row(t->type, (const char *) src.data + (size_t) r * row_bytes,
                          dst + r * n, n);
    }
    out->data = dst;
    out->type = ES_TYPE_F32;
    return ES_OK;
}

static void f32_put(void * self, int32_t il, int32_t expert, int32_t which,
                    const es_expert_view * view) {
    (void) self; (void) il; (void) expert; (void) which;
    free((void *) view->data);
}

int es_experts_init(const es_gguf * g, const es_moe_params * p, es_experts ** out,
                    char * err, size_t err_cap) {
    char scratch[8];
    if (!err || !err_cap) { err = scratch; err_cap = sizeof scratch; }
    err[0] = '\0';
    if (!g || !p || !out) return ES_ERR_INVALID_ARG;
    *out = NULL;
    if (p->n_layer <= 0 || p->n_embd <= 0 || p->n_ff <= 0 || p->n_expert <= 0 ||
        p->n_expert_used <= 0 || p->n_expert_used > p->n_expert ||
        p->n_expert > ES_MOE_MAX_EXPERTS) {
        snprintf(err, err_cap, "bad expert counts: %d used of %d experts (at most %d)",
                 (int) p->n_expert_used, (int) p->n_expert, ES_MOE_MAX_EXPERTS);
        return ES_ERR_FORMAT;
    }
    if (p->experts != ES_EXPERTS_MAPPED && p->experts != ES_EXPERTS_F32) {
        snprintf(err, err_cap, "unknown experts mode %d", (int) p->experts);
        return ES_ERR_INVALID_ARG;
    }
    const bool f32 = p->experts == ES_EXPERTS_F32;

    es_experts * ex = calloc(1, sizeof *ex);
    if (!ex) return ES_ERR_NO_MEMORY;
    ex->p = *p;
    ex->layers = calloc((size_t) p->n_layer, sizeof *ex->layers);
    if (!ex->layers) { es_experts_free(ex); return ES_ERR_NO_MEMORY; }
    const int64_t E = p->n_expert, D = p->n_embd, F = p->n_ff;
    for (int32_t il = 0; il < p->n_layer; il++) {
        moe_layer * L = &ex->layers[il];
        int rc = bind_tensor(g, il, "ffn_gate_inp", D, E, 1, &L->gate_inp, err, err_cap);
        if (rc == ES_OK) rc = bind_tensor(g, il, EXPS_NAME[ES_EXPERT_GATE], D, F, E,
                                          &L->exps[ES_EXPERT_GATE], err, err_cap);
        if (rc == ES_OK) rc = bind_tensor(g, il, EXPS_NAME[ES_EXPERT_UP], D, F, E,
                                          &L->exps[ES_EXPERT_UP], err, err_cap);
        if (rc == ES_OK) rc = bind_tensor(g, il, EXPS_NAME[ES_EXPERT_DOWN], F, D, E,
                                          &L->exps[ES_EXPERT_DOWN], err, err_cap);
        if (rc != ES_OK) { es_experts_free(ex); return rc; }
    }
    ex->provider = (es_expert_provider) {
        .self = ex, .get = f32 ? f32_get : mapped_get, .put = f32 ? f32_put : mapped_put,
    };
    *out = ex;
    return ES_OK;
}

void es_experts_free(es_experts * ex) {
    if (!ex) return;
    free(ex->layers);
    free(ex);
}

const es_moe_params * es_experts_params(const es_experts * ex) { return &ex->p; }

const es_tensor * es_experts_tensor(const es_experts * ex, int32_t il, int32_t which) {
    return ex->layers[il].exps[which];
}

const es_expert_provider * es_experts_provider(const es_experts * ex) { return &ex->provider; }

void es_experts_set_provider(es_experts * ex, const es_expert_provider * provider) {
    ex->provider = *provider;
}

/* ---- scratch ------------------------------------------------------------- */

// Each token's input row is converted once per activation format
// (es_act_type) that a layer's active gate and up matrices read; the
// kernels have four (F32, Q8_0, Q8_1, Q8_K).
enum { N_ACT = 4 };

// A pair is one (token t, choice j) of a batch, numbered t * k + j.
struct es_moe {
    const es_experts * ex;
    int32_t   n_batch;
    float   * probs;       // (n_batch, n_expert) router logits, then probabilities
    int32_t * chosen;      // (n_batch, k) each token's experts, best first
    float   * weight;      // (n_batch, k) their weights
    int32_t * start;       // (n_expert + 1) where each expert's pairs begin in order[]
    int32_t * order;       // (n_batch * k) pairs grouped by expert, tokens ascending
    int32_t * cursor;      // (n_expert) scratch of the grouping
    int32_t * active;      // (n_expert) experts with at least one pair, ascending
    int32_t   n_active;
    float   * importance;  // (n_expert) per active expert: its largest weight in the batch
    int32_t   a0, a1;      // the group of active[] being computed
    float   * pf_probs;    // (n_expert) prefetch: a later layer's router on one token
    int32_t * pf_chosen;   // (n_batch * k) the experts it predicts, per token
    float   * pf_weight;   // (n_batch * k)
    int32_t * pf_experts;  // (n_expert) their union, and
    float   * pf_imp;      // (n_expert) each one's largest weight
    uint8_t * pf_in;       // (router row) one token's input in that router's format
    es_expert_view * view; // (n_expert, 3) the active experts' matrices
    uint8_t * router_in;   // (n_batch, router row) inputs in the router's activation format
    size_t    router_row;
    uint8_t * x_act[N_ACT];     // (n_batch, row of n_embd) inputs, one per format in use
    size_t    x_act_cap[N_ACT]; // bytes allocated
    int32_t   act_type[N_ACT];  // this layer's formats in use: es_act_type of ...
    int32_t   act_wtype[N_ACT]; // ... this weight type, which es_quantize_act takes
    int32_t   n_act;
    float   * gate;        // (n_batch * k, n_ff) gate outputs, then SwiGLU outputs
    float   * up;          // (n_batch * k, n_ff)
    uint8_t * down_in;     // (n_batch * k, down_row) SwiGLU outputs in down's format
    size_t    down_in_cap;
    size_t    down_row;    // bytes per pair in down_in: the widest format of this layer
    float   * y;           // (n_batch * k, n_embd) unweighted expert outputs
};

int es_moe_init(const es_experts * ex, int32_t n_batch, es_moe ** out) {
    if (!ex || n_batch <= 0 || !out) return ES_ERR_INVALID_ARG;
    *out = NULL;
    const es_moe_params * p = &ex->p;
    const size_t B = (size_t) n_batch, K = (size_t) p->n_expert_used, E = (size_t) p->n_expert;
    es_moe * m = calloc(1, sizeof *m);
    if (!m) return ES_ERR_NO_MEMORY;
    m->ex = ex;
    m->n_batch = n_batch;
    // The widest activation row any router type needs (F32: 4 bytes a value).
    m->router_row = es_type_row_bytes(ES_TYPE_F32, p->n_embd);
    m->probs     = malloc(B * E * sizeof *m->probs);
    m->chosen    = malloc(B * K * sizeof *m->chosen);
    m->weight    = malloc(B * K * sizeof *m->weight);
    m->start     = malloc((E + 1) * sizeof *m->start);
    m->order     = malloc(B * K * sizeof *m->order);
    m->cursor    = malloc(E * sizeof *m->cursor);
    m->active    = malloc(E * sizeof *m->active);
    m->importance = malloc(E * sizeof *m->importance);
    m->pf_probs  = malloc(E * sizeof *m->pf_probs);
    m->pf_chosen = malloc(B * K * sizeof *m->pf_chosen);
    m->pf_weight = malloc(B * K * sizeof *m->pf_weight);
    m->pf_experts = malloc(E * sizeof *m->pf_experts);
    m->pf_imp    = malloc(E * sizeof *m->pf_imp);
    m->pf_in     = malloc(m->router_row);
    m->view      = malloc(E * 3 * sizeof *m->view);
    m->router_in = malloc(B * m->router_row);
    m->gate      = malloc(B * K * (size_t) p->n_ff * sizeof *m->gate);
    m->up        = malloc(B * K * (size_t) p->n_ff * sizeof *m->up);
    m->y         = malloc(B * K * (size_t) p->n_embd * sizeof *m->y);
    if (!m->probs || !m->chosen || !m->weight || !m->start || !m->order || !m->cursor ||
        !m->active || !m->importance || !m->pf_probs || !m->pf_chosen || !m->pf_weight ||
        !m->pf_experts || !m->pf_imp || !m->pf_in ||
        !m->view || !m->router_in || !m->gate || !m->up || !m->y) {
        es_moe_free(m);
        return ES_ERR_NO_MEMORY;
    }
    *out = m;
    return ES_OK;
}

void es_moe_free(es_moe * m) {
    if (!m) return;
    free(m->y);
    free(m->down_in);
    free(m->up);
    free(m->gate);
    for (int i = 0; i < N_ACT; i++) free(m->x_act[i]);
    free(m->router_in);
    free(m->view);
    free(m->active);
    free(m->importance);
    free(m->pf_probs);
    free(m->pf_chosen);
    free(m->pf_weight);
    free(m->pf_experts);
    free(m->pf_imp);
    free(m->pf_in);
    free(m->cursor);
    free(m->order);
    free(m->start);
    free(m->weight);
    free(m->chosen);
    free(m->probs);
    free(m);
}

// The slot of activation format act among this layer's; -1: none.
static int32_t act_slot(const es_moe * m, int32_t act) {
    for (int32_t s = 0; s < m->n_act; s++) {
        if (m->act_type[s] == act) return s;
    }
    return -1;
}

// Grows *buf to at least need bytes; the contents are not kept.
static int reserve(uint8_t ** buf, size_t * cap, size_t need) {
    if (need <= *cap) return ES_OK;
    uint8_t * b = malloc(need);
    if (!b) return ES_ERR_NO_MEMORY;
    free(*buf);
    *buf = b;
    *cap = need;
    return ES_OK;
}

/* ---- routing ------------------------------------------------------------- */

// Softmax over all experts, the top k (ties: lower index first), and with
// norm_w the k weights divided by their sum — llama.cpp's build_moe_ffn
// with softmax gating, step for step (its float and double roundings too),
// which Mixtral and Qwen MoE models use.
static void route(const es_moe_params * p, float * probs, int32_t * chosen, float * weight) {
    const int32_t E = p->n_expert, K = p->n_expert_used;
    float max = probs[0];
    for (int32_t e = 1; e < E; e++) max = probs[e] > max ? probs[e] : max;
    double sum = 0.0;
    for (int32_t e = 0; e < E; e++) {
        probs[e] = expf(probs[e] - max);
        sum += (double) probs[e];
    }
    const float inv = (float) (1.0 / sum);
    for (int32_t e = 0; e < E; e++) probs[e] *= inv;

    bool taken[ES_MOE_MAX_EXPERTS] = { false };
    for (int32_t j = 0; j < K; j++) {
        int32_t best = -1;
        for (int32_t e = 0; e < E; e++) {
            if (!taken[e] && (best < 0 || probs[e] > probs[best])) best = e;
        }
        taken[best] = true;
        chosen[j] = best;
        weight[j] = probs[best];
    }
    if (p->norm_w) {
        double wsum = 0.0;
        for (int32_t j = 0; j < K; j++) wsum += (double) weight[j];
        // As llama.cpp: the sum clamped to F16's smallest normal, never 0.
        const float s = fmaxf((float) wsum, 6.103515625e-5f);
        for (int32_t j = 0; j < K; j++) weight[j] /= s;
    }
}

/* ---- the parallel steps ---------------------------------------------------- */

typedef struct moe_job {
    es_moe      * m;
    int32_t       il;
    const float * x;         // (n_tokens, n_embd)
    int32_t       n_tokens;
    float       * out;       // (n_tokens, n_embd)
} moe_job;

// Rows [*r0, *r1) of n for thread ith of nth.
static void split(int64_t n, int32_t ith, int32_t nth, int64_t * r0, int64_t * r1) {
    *r0 = n * ith / nth;
    *r1 = n * (ith + 1) / nth;
}

// Step 1: router logits and routing, tokens striped over threads.
static void step_route(void * arg, int32_t ith, int32_t nth) {
    moe_job * job = arg;
    es_moe * m = job->m;
    const es_moe_params * p = &m->ex->p;
    const es_tensor * router = m->ex->layers[job->il].gate_inp;
    const int32_t K = p->n_expert_used;
    for (int32_t t = ith; t < job->n_tokens; t += nth) {
        uint8_t * xq = m->router_in + (size_t) t * m->router_row;
        float * probs = m->probs + (size_t) t * p->n_expert;
        es_quantize_act(router->type, job->x + (size_t) t * p->n_embd, xq, p->n_embd);
        es_matvec(router->type, router->data, xq, p->n_embd, 0, p->n_expert, probs);
        route(p, probs, m->chosen + (size_t) t * K, m->weight + (size_t) t * K);
    }
}

// Step 2: each token's input in every activation format the active experts'
// gate and up matrices read.
static void step_inputs(void * arg, int32_t ith, int32_t nth) {
    moe_job * job = arg;
    es_moe * m = job->m;
    const int64_t D = m->ex->p.n_embd;
    for (int32_t s = 0; s < m->n_act; s++) {
        const size_t row = es_type_row_bytes(m->act_type[s], D);
        for (int32_t t = ith; t < job->n_tokens; t += nth) {
            es_quantize_act(m->act_wtype[s], job->x + (size_t) t * D,
                            m->x_act[s] + (size_t) t * row, D);
        }
    }
}

// Step 3: gate and up of the group's experts for their pairs; each thread
// takes the same share of every expert's rows.
static void step_gate_up(void * arg, int32_t ith, int32_t nth) {
    moe_job * job = arg;
    es_moe * m = job->m;
    const int64_t D = m->ex->p.n_embd, F = m->ex->p.n_ff;
    int64_t r0, r1;
    split(F, ith, nth, &r0, &r1);
    for (int32_t a = m->a0; a < m->a1; a++) {
        const int32_t e = m->active[a];
        for (int w = ES_EXPERT_GATE; w <= ES_EXPERT_UP; w++) {
            const es_expert_view * v = &m->view[e * 3 + w];
            const int32_t act = es_act_type(v->type);
            const size_t row = es_type_row_bytes(act, D);
            const uint8_t * xs = m->x_act[act_slot(m, act)];
            float * h = w == ES_EXPERT_GATE ? m->gate : m->up;
            for (int32_t i = m->start[e]; i < m->start[e + 1]; i++) {
                const int32_t pair = m->order[i], t = pair / m->ex->p.n_expert_used;
                es_matvec(v->type, v->data, xs + (size_t) t * row, D, r0, r1,
                          h + (size_t) pair * F + r0);
            }
        }
    }
}

// Step 4: SwiGLU, silu(gate) * up, and its conversion for down; the
// group's pairs (consecutive in order[]) striped over threads.
static void step_swiglu(void * arg, int32_t ith, int32_t nth) {
    moe_job * job = arg;
    es_moe * m = job->m;
    const int64_t F = m->ex->p.n_ff;
    const int32_t i0 = m->start[m->active[m->a0]], i1 = m->start[m->active[m->a1 - 1] + 1];
    for (int32_t i = i0 + ith; i < i1; i += nth) {
        const int32_t pair = m->order[i], e = m->chosen[pair];
        const int32_t dtype = m->view[e * 3 + ES_EXPERT_DOWN].type;
        float * g = m->gate + (size_t) pair * F;
        const float * u = m->up + (size_t) pair * F;
        es__swiglu(g, u, F);
        es_quantize_act(dtype, g, m->down_in + (size_t) pair * m->down_row, F);
    }
}

// Step 5: down of every active expert for its pairs, rows shared as in step 3.
static void step_down(void * arg, int32_t ith, int32_t nth) {
    moe_job * job = arg;
    es_moe * m = job->m;
    const int64_t D = m->ex->p.n_embd, F = m->ex->p.n_ff;
    int64_t r0, r1;
    split(D, ith, nth, &r0, &r1);
    for (int32_t a = m->a0; a < m->a1; a++) {
        const int32_t e = m->active[a];
        const es_expert_view * v = &m->view[e * 3 + ES_EXPERT_DOWN];
        for (int32_t i = m->start[e]; i < m->start[e + 1]; i++) {
            const int32_t pair = m->order[i];
            es_matvec(v->type, v->data, m->down_in + (size_t) pair * m->down_row, F, r0, r1,
                      m->y + (size_t) pair * D + r0);
        }
    }
}

// Step 6: out = sum over j of weight_j * y_j, j from the best expert down,
// as llama.cpp adds its expert views; tokens striped over threads.
static void step_combine(void * arg, int32_t ith, int32_t nth) {
    moe_job * job = arg;
    es_moe * m = job->m;
    const int64_t D = m->ex->p.n_embd;
    const int32_t K = m->ex->p.n_expert_used;
    for (int32_t t = ith; t < job->n_tokens; t += nth) {
        float * o = job->out + (size_t) t * D;
        for (int32_t j = 0; j < K; j++) {
            const int32_t pair = t * K + j;
            const float w = m->weight[pair];
            const float * y = m->y + (size_t) pair * D;
            if (j == 0) {
                for (int64_t i = 0; i < D; i++) o[i] = y[i] * w;
            } else {
                for (int64_t i = 0; i < D; i++) o[i] += y[i] * w;
            }
        }
    }
}

/* ---- the block ------------------------------------------------------------ */

// Groups the batch's pairs by expert (a counting sort, tokens ascending
// within an expert), lists the active experts and their importance.
static void group_pairs(es_moe * m, int32_t n_tokens) {
    const int32_t E = m->ex->p.n_expert, P = n_tokens * m->ex->p.n_expert_used;
    memset(m->start, 0, (size_t) (E + 1) * sizeof *m->start);
    for (int32_t pair = 0; pair < P; pair++) m->start[m->chosen[pair] + 1]++;
    m->n_active = 0;
    for (int32_t e = 0; e < E; e++) {
        if (m->start[e + 1]) m->active[m->n_active++] = e;
        m->start[e + 1] += m->start[e];
    }
    memcpy(m->cursor, m->start, (size_t) E * sizeof *m->cursor);
    for (int32_t pair = 0; pair < P; pair++) m->order[m->cursor[m->chosen[pair]]++] = pair;
    for (int32_t a = 0; a < m->n_active; a++) {
        const int32_t e = m->active[a];
        float w = 0.0f;
        for (int32_t i = m->start[e]; i < m->start[e + 1]; i++) {
            w = fmaxf(w, m->weight[m->order[i]]);
        }
        m->importance[a] = w;
    }
}

// Lists the activation formats the group's gate and up matrices read, and
// sizes the buffers for them and for down's inputs.
// ES_ERR_UNSUPPORTED: the provider gave a type es_matvec does not take.
static int plan_buffers(es_moe * m, int32_t n_tokens) {
    const es_moe_params * p = &m->ex->p;
    m->n_act = 0;
    m->down_row = 0;
    for (int32_t a = m->a0; a < m->a1; a++) {
        const int32_t e = m->active[a];
        for (int w = 0; w < 3; w++) {
            if (es_act_type(m->view[e * 3 + w].type) < 0) return ES_ERR_UNSUPPORTED;
        }
        for (int w = ES_EXPERT_GATE; w <= ES_EXPERT_UP; w++) {
            const int32_t wtype = m->view[e * 3 + w].type, act = es_act_type(wtype);
            if (act_slot(m, act) >= 0) continue;
            if (m->n_act == N_ACT) return ES_ERR_UNSUPPORTED;
            const int32_t s = m->n_act++;
            m->act_type[s] = act;
            m->act_wtype[s] = wtype;
            const int rc = reserve(&m->x_act[s], &m->x_act_cap[s],
                                   (size_t) n_tokens * es_type_row_bytes(act, p->n_embd));
            if (rc != ES_OK) return rc;
        }
        const int32_t dtype = m->view[e * 3 + ES_EXPERT_DOWN].type;
        const size_t row = es_type_row_bytes(es_act_type(dtype), p->n_ff);
        m->down_row = row > m->down_row ? row : m->down_row;
    }
    return reserve(&m->down_in, &m->down_in_cap,
                   (size_t) n_tokens * (size_t) p->n_expert_used * m->down_row);
}

// Hands back the views of active[a0, a1) and ends the provider's hold.
static void put_views(es_moe * m, int32_t il, int32_t a0, int32_t a1) {
    const es_expert_provider * pv = &m->ex->provider;
    for (int32_t a = a0; a < a1; a++) {
        const int32_t e = m->active[a];
        for (int w = 0; w < 3; w++) pv->put(pv->self, il, e, w, &m->view[e * 3 + w]);
    }
    if (pv->end) pv->end(pv->self, il);
}

// Tokens up to which a batch's later layers are predicted (decoding and
// short verification batches; a prompt's batch would name every expert).
enum { PREFETCH_MAX_TOKENS = 8 };

// Names to the provider the experts that the routers of layers il+1 ..
// il+depth choose for the batch's input x of layer il.
static void prefetch(es_moe * m, int32_t il, const float * x, int32_t n_tokens) {
    const es_expert_provider * pv = &m->ex->provider;
    if (!pv->prefetch || n_tokens > PREFETCH_MAX_TOKENS) return;
    const es_moe_params * p = &m->ex->p;
    const int32_t depth = pv->prefetch_depth(pv->self), K = p->n_expert_used;
    for (int32_t d = 1; d <= depth && il + d < p->n_layer; d++) {
        const es_tensor * router = m->ex->layers[il + d].gate_inp;
        for (int32_t e = 0; e < p->n_expert; e++) m->pf_imp[e] = -1.0f;
        for (int32_t t = 0; t < n_tokens; t++) {
            es_quantize_act(router->type, x + (size_t) t * p->n_embd, m->pf_in, p->n_embd);
            es_matvec(router->type, router->data, m->pf_in, p->n_embd, 0, p->n_expert,
                      m->pf_probs);
            route(p, m->pf_probs, m->pf_chosen + (size_t) t * K, m->pf_weight + (size_t) t * K);
            for (int32_t j = 0; j < K; j++) {
                const int32_t e = m->pf_chosen[t * K + j];
                m->pf_imp[e] = fmaxf(m->pf_imp[e], m->pf_weight[t * K + j]);
            }
        }
        int32_t n = 0;
        for (int32_t e = 0; e < p->n_expert; e++) {
            if (m->pf_imp[e] >= 0.0f) {
                m->pf_experts[n] = e;
                m->pf_imp[n++] = m->pf_imp[e];
            }
        }
        pv->prefetch(pv->self, il + d, n, m->pf_experts, m->pf_imp);
    }
}

// Gets the views of active[a0, a1) (after the provider's begin, and for
// the first group the prefetch of later layers, which runs while the
// group's misses are read); on failure none is held.
static int get_views(es_moe * m, int32_t il, const float * x, int32_t n_tokens, int32_t a0,
                     int32_t a1) {
    const es_expert_provider * pv = &m->ex->provider;
    if (pv->begin) {
        const int rc = pv->begin(pv->self, il, n_tokens, a1 - a0, m->active + a0,
                                 m->importance + a0);
        if (rc != ES_OK) return rc;
    }
    if (a0 == 0) prefetch(m, il, x, n_tokens);
    for (int32_t a = a0; a < a1; a++) {
        const int32_t e = m->active[a];
        for (int w = 0; w < 3; w++) {
            const int rc = pv->get(pv->self, il, e, w, &m->view[e * 3 + w]);
            if (rc != ES_OK) {
                // Hand back what this expert and the ones before it got.
                for (int v = 0; v < w; v++) pv->put(pv->self, il, e, v, &m->view[e * 3 + v]);
                put_views(m, il, a0, a);
                return rc;
            }
        }
    }
    return ES_OK;
}

int es_moe_ffn(es_moe * m, es_pool * pool, int32_t il, const float * x, int32_t n_tokens,
               float * out) {
    if (!m || !pool || !x || !out || il < 0 || il >= m->ex->p.n_layer || n_tokens < 0 ||
        n_tokens > m->n_batch) {
        return ES_ERR_INVALID_ARG;
    }
    if (n_tokens == 0) return ES_OK;
    moe_job job = { .m = m, .il = il, .x = x, .n_tokens = n_tokens, .out = out };

    es_pool_run(pool, step_route, &job);
    group_pairs(m, n_tokens);

    // The active experts, in groups of as many as the provider holds at once
    // (every pair's output is computed alike whatever the grouping).
    const es_expert_provider * pv = &m->ex->provider;
    const int32_t group = pv->max_held > 0 ? pv->max_held : m->n_active;
    for (m->a0 = 0; m->a0 < m->n_active; m->a0 = m->a1) {
        m->a1 = m->a0 + group < m->n_active ? m->a0 + group : m->n_active;
        int rc = get_views(m, il, x, n_tokens, m->a0, m->a1);
        if (rc == ES_OK) {
            rc = plan_buffers(m, n_tokens);
            if (rc != ES_OK) put_views(m, il, m->a0, m->a1);
        }
        if (rc != ES_OK) return rc;
        es_pool_run(pool, step_inputs, &job);
        es_pool_run(pool, step_gate_up, &job);
        es_pool_run(pool, step_swiglu, &job);
        es_pool_run(pool, step_down, &job);
        put_views(m, il, m->a0, m->a1);
    }
    es_pool_run(pool, step_combine, &job);
    return ES_OK;
}
