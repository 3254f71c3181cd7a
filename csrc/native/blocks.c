/*
 * blocks.c — the blocks every architecture's layer is made of (the MoE block
 * is moe.c's): RMSNorm and residuals, the matmul over the context's pool,
 * RoPE, attention over the KV cache (F16 or Q8_0), the dense feed-forward and its
 * activations.
 *
 * Batch invariance: every token row goes through the same operations whatever
 * the batch or thread count (matmuls are per-row es_matvec arithmetic with a
 * fixed reduction order; attention reduces over the cells a token sees in
 * ascending cell order), so a token's logits are bit-identical alone, in a
 * chain or in a tree. Exact speculative decoding relies on it.
 */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "native/native_internal.h"

// Runs fn over the pool, or on the calling thread alone when the work is one
// row (a decode step): a pool round trip costs more than the work then.
static void run(es_context * ctx, es_pool_fn fn, void * arg, int32_t n_rows) {
    if (n_rows <= 1) fn(arg, 0, 1);
    else es_pool_run(ctx->pool, fn, arg);
}

/* ---- blocks: norms, residuals --------------------------------------------- */

// As ggml_rms_norm: the sum of squares in double, then a float scale; the
// weight multiplies afterwards (a separate ggml_mul in llama.cpp).
void es__rms_norm(const float * x, const es_weight * w, float * y, int64_t n_rows, int64_t dim,
                  float eps) {
    const float * g = w && w->data ? (const float *) w->data : NULL;
    for (int64_t r = 0; r < n_rows; r++) {
        const float * xr = x + r * dim;
        float * yr = y + r * dim;
        double sum = 0.0;
        for (int64_t i = 0; i < dim; i++) sum += (double) (xr[i] * xr[i]);
        const float scale = 1.0f / sqrtf((float) (sum / (double) dim) + eps);
        if (g) for (int64_t i = 0; i < dim; i++) yr[i] = (xr[i] * scale) * g[i];
        else   for (int64_t i = 0; i < dim; i++) yr[i] = xr[i] * scale;
    }
}

void es__add(float * x, const float * y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

/* ---- blocks: matmul -------------------------------------------------------- */

typedef struct matmul_job {
    int32_t           n_w;
    const es_weight * w[3];
    float           * y[3];     // (n, w->n_out)
    const uint8_t   * xq[3];    // (n, xq_row) activations in w's format
    size_t            xq_row[3];
    // Conversion of x into the formats: format f from x with weight type wtype[f].
    const float     * x;        // (n, n_in)
    int64_t           n_in;
    int32_t           n_fmt;
    int32_t           fmt_wtype[3];
    uint8_t         * fmt_buf[3];
    size_t            fmt_row[3];
    int32_t           n;
    // Rows of all weights, concatenated, handed out in chunks: a thread
    // that finishes early takes more, so no thread waits out another's
    // slower share (a busy core, a thread woken late).
    int64_t           total_rows, chunk;
    _Atomic int64_t   next_row;
} matmul_job;

static void matmul_quantize(void * arg, int32_t ith, int32_t nth) {
    matmul_job * job = arg;
    for (int32_t t = ith; t < job->n; t += nth) {
        for (int32_t f = 0; f < job->n_fmt; f++) {
            es_quantize_act(job->fmt_wtype[f], job->x + (size_t) t * job->n_in,
                            job->fmt_buf[f] + (size_t) t * job->fmt_row[f], job->n_in);
        }
    }
}

static void matmul_rows(void * arg, int32_t ith, int32_t nth) {
    (void) ith, (void) nth;
    matmul_job * job = arg;
    for (;;) {
        const int64_t g0 = atomic_fetch_add_explicit(&job->next_row, job->chunk, memory_order_relaxed);
        if (g0 >= job->total_rows) return;
        const int64_t g1 = g0 + job->chunk < job->total_rows ? g0 + job->chunk : job->total_rows;
        int64_t base = 0;
        for (int32_t i = 0; i < job->n_w; i++) {
            const es_weight * w = job->w[i];
            const int64_t r0 = g0 > base ? g0 - base : 0;
            const int64_t r1 = g1 - base < w->n_out ? g1 - base : w->n_out;
            base += w->n_out;
            if (r0 >= r1) continue;
            // Rows outer, tokens inner: each weight row is read once for the batch.
            es_matmat(w->type, w->data, w->packed, job->xq[i], job->xq_row[i], job->n, w->n_in, r0, r1,
                      job->y[i] + r0, (size_t) w->n_out);
        }
    }
}

static bool all_finite(const float * x, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(x[i])) return false;
    }
    return true;
}

int es__matmul(es_context * ctx, int32_t n_w, const es_weight * const * w, const float * x,
               float * const * y, int32_t n) {
    if (n_w < 1 || n_w > 3 || n < 0 || n > ctx->n_batch) return ES_ERR_INVALID_ARG;
    if (n == 0) return ES_OK;
    matmul_job job = { .n_w = n_w, .x = x, .n_in = w[0]->n_in, .n = n };
    for (int32_t i = 0; i < n_w; i++) {
        const int32_t act = es_act_type(w[i]->type);
        int32_t f = 0;
        while (f < job.n_fmt && es_act_type(job.fmt_wtype[f]) != act) f++;
        if (f == job.n_fmt) {
            job.fmt_wtype[f] = w[i]->type;
            job.fmt_row[f] = es_type_row_bytes(act, job.n_in);
            job.fmt_buf[f] = ctx->act + (size_t) f * (size_t) ctx->n_batch * ctx->act_row;
            job.n_fmt++;
        }
        job.w[i] = w[i];
        job.y[i] = y[i];
        job.xq[i] = job.fmt_buf[f];
        job.xq_row[i] = job.fmt_row[f];
    }
    run(ctx, matmul_quantize, &job, n);
    // About 8 chunks per thread, whole cache lines of results (16 floats).
    for (int32_t i = 0; i < n_w; i++) job.total_rows += w[i]->n_out;
    const int64_t per = job.total_rows / (8 * (int64_t) es_pool_size(ctx->pool)) + 1;
    job.chunk = (per + 15) / 16 * 16;
    atomic_init(&job.next_row, 0);
    es_pool_run(ctx->pool, matmul_rows, &job);
    // A token whose input is not finite gets NaN outputs, as real arithmetic
    // (and llama.cpp) gives them: the activation rounding would turn a NaN or
    // an infinity into finite numbers (fmaxf skips NaN), and a model whose
    // weights overflow into fluent nonsense instead of the sampler's refusal.
    for (int32_t t = 0; t < n; t++) {
        if (all_finite(x + (size_t) t * job.n_in, job.n_in)) continue;
        for (int32_t i = 0; i < n_w; i++) {
            float * row = y[i] + (size_t) t * (size_t) w[i]->n_out;
            for (int64_t r = 0; r < w[i]->n_out; r++) row[r] = NAN;
        }
    }
    return ES_OK;
}

/* ---- blocks: RoPE ---------------------------------------------------------- */

// As ggml's rope (no YaRN): theta_i = pos * base^(-2i/n_rot) built by
// repeated float multiplication, scaled by freq_scale; cosf/sinf of it.
void es__rope(es_context * ctx, int32_t il, float * x, int32_t n_heads) {
    const es_model * m = ctx->model;
    const es_layer_traits * L = &m->layers[il].traits;
    const bool neox = m->traits.arch.rope_type == ES_ROPE_NEOX;
    const int32_t hd = m->head_dim, n_rot = m->n_rot, half = n_rot / 2;
    const float theta_scale = powf(L->rope_base, -2.0f / (float) n_rot);
    float * cs = ctx->scratch;  // (n_rot) cos, sin pairs; calling thread's slice
    for (int32_t t = 0; t < ctx->n; t++) {
        float theta = (float) ctx->pos[t];
        for (int32_t i = 0; i < half; i++) {
            const float th = L->rope_scale * theta;
            cs[2 * i] = cosf(th);
            cs[2 * i + 1] = sinf(th);
            theta *= theta_scale;
        }
        for (int32_t h = 0; h < n_heads; h++) {
            float * v = x + ((size_t) t * n_heads + h) * hd;
            for (int32_t i = 0; i < half; i++) {
                // NORM: adjacent pairs; NEOX: the two halves of the rotated dims.
                const int32_t a = neox ? i : 2 * i;
                const int32_t b = neox ? i + half : 2 * i + 1;
                const float x0 = v[a], x1 = v[b], c = cs[2 * i], s = cs[2 * i + 1];
                v[a] = x0 * c - x1 * s;
                v[b] = x0 * s + x1 * c;
            }
        }
    }
}

/* ---- blocks: attention ----------------------------------------------------- */

// Q8_0 keys are stored rotated, as llama.cpp stores quantized keys (its
// "rotate activations", PR 21038): a head row times the orthonormal Hadamard
// matrix H / sqrt(head_dim) spreads the few large values of a key (Qwen2's
// key biases put them in fixed dims) over every block, so no block's scale
// is set by one outlier; the query gets the same rotation, which leaves
// q.k unchanged. Head widths that are powers of two (the fast transform's).
static bool keys_rotated(const es_context * kv, int32_t hd) {
    return kv->type_k == ES_TYPE_Q8_0 && (hd & (hd - 1)) == 0;
}

// In place: x (n values, n a power of two) times H / sqrt(n), by the fast
// Walsh-Hadamard butterflies in a fixed order.
static void hadamard(float * x, int32_t n) {
    for (int32_t len = 1; len < n; len <<= 1) {
        for (int32_t i = 0; i < n; i += 2 * len) {
            for (int32_t j = i; j < i + len; j++) {
                const float a = x[j], b = x[j + len];
                x[j] = a + b;
                x[j + len] = a - b;
            }
        }
    }
    const float scale = 1.0f / sqrtf((float) n);
    for (int32_t i = 0; i < n; i++) x[i] *= scale;
}

typedef struct attn_job {
    es_context * ctx;
    int32_t      il;
    float        kq_scale;
} attn_job;

// One (token, head) per task, tasks striped over threads. Scores over the
// cells the token sees, softmax and the weighted sum of V rows, all in
// ascending cell order: the same arithmetic whichever batch the token is in.
static void attn_heads(void * arg, int32_t ith, int32_t nth) {
    const attn_job * job = arg;
    es_context * ctx = job->ctx;
    const es_model * m = ctx->model;
    const bool swa = m->layers[job->il].traits.swa;
    const int32_t n_swa = m->traits.n_swa;
    const int32_t hd = m->head_dim, n_head = m->n_head, group = m->n_head / m->n_head_kv;
    float * scores = ctx->scratch + (size_t) ith * ((size_t) ctx->n_ctx + 3 * hd);  // (n_ctx)
    float * qr  = scores + ctx->n_ctx;   // (hd) the query rotated, for rotated keys
    float * qa  = qr + hd;               // (hd floats of room) the query in the keys' dot format:
                                         //   F16 (rounded as llama.cpp does) or Q8_0 (ggml's
                                         //   vec_dot_type for Q8_0 keys): at most 4 bytes a value
    float * acc = qa + hd;               // (hd) the weighted sum of V rows
    for (int32_t task = ith; task < ctx->n * n_head; task += nth) {
        const int32_t t = task / n_head, h = task % n_head, g = h / group;
        const int32_t p = ctx->pos[t];
        // The token's sequence: its own KV cache, the row's index within it.
        const es_seq_rows * seq = &ctx->seqs[ctx->row_seq[t]];
        const es_context * kv = seq->kv;
        const int32_t n_past = kv->n_past;
        const int32_t * cell_pos = kv->cell_pos;
        const size_t head = ((size_t) job->il * m->n_head_kv + g) * (size_t) kv->n_ctx;
        const uint8_t * K = kv->k_cache + head * kv->k_row;  // (n_ctx) rows of hd keys in type_k
        const uint8_t * V = kv->v_cache + head * kv->v_row;  // (n_ctx) rows of hd values in type_v
        const uint8_t * sees = ctx->sees + (size_t) t * ctx->n_batch;
        const int32_t end = n_past + (t - seq->r0) + 1;  // the token's own cell is its last candidate
        // Cells before c0 fall out of a sliding window.
        int32_t c0 = 0;
        if (swa) {
            while (c0 < n_past && p - cell_pos[c0] >= n_swa) c0++;
        }
        const float * q = ctx->q + ((size_t) t * n_head + h) * hd;
        if (keys_rotated(kv, hd)) {
            memcpy(qr, q, (size_t) hd * sizeof *qr);
            hadamard(qr, hd);
            q = qr;
        }
        es_quantize_act(kv->type_k, q, qa, hd);
        es_matvec(kv->type_k, K, qa, hd, c0, end, scores + c0);

        float max = -INFINITY;
        for (int32_t c = c0; c < end; c++) {
            const bool seen = c < n_past ? true : sees[c - n_past] != 0;
            if (!seen || (swa && p - cell_pos[c] >= n_swa)) {
                scores[c] = -INFINITY;
                continue;
            }
            scores[c] *= job->kq_scale;
            max = scores[c] > max ? scores[c] : max;
        }
        // The weighted sum of the seen cells' V rows, in cell order.
        float sum = 0.0f;
        memset(acc, 0, (size_t) hd * sizeof *acc);
        if (kv->type_v == ES_TYPE_Q8_0) {
            // Every weight first, in place of its score (0: a cell not seen),
            // then one call over the rows, acc held in registers throughout.
            for (int32_t c = c0; c < end; c++) {
                scores[c] = scores[c] == -INFINITY ? 0.0f : expf(scores[c] - max);
                sum += scores[c];
            }
            es_axpy_q8_0(hd, end - c0, scores + c0, V + (size_t) c0 * kv->v_row, acc);
        } else {
            // Row by row: a row's expf overlaps the previous row's accumulation
            // (as two passes, F16 decode at 4,096 cells took 13% longer).
            for (int32_t c = c0; c < end; c++) {
                if (scores[c] == -INFINITY) continue;
                const float e = expf(scores[c] - max);
                sum += e;
                es_axpy_f16(hd, e, (const uint16_t *) (V + (size_t) c * kv->v_row), acc);
            }
        }
        float * o = ctx->att + ((size_t) t * n_head + h) * hd;
        const float inv = 1.0f / sum;
        for (int32_t d = 0; d < hd; d++) o[d] = acc[d] * inv;
    }
}

int es__attention_inputs(es_context * ctx, int32_t il) {
    const es_layer * L = &ctx->model->layers[il];
    es__rms_norm(ctx->x, &L->attn_norm, ctx->xn, ctx->n, ctx->model->n_embd, ctx->model->norm_eps);
    const es_weight * qkv[3] = { &L->wq, &L->wk, &L->wv };
    float * qkv_out[3] = { ctx->q, ctx->k, ctx->v };
    const int rc = es__matmul(ctx, 3, qkv, ctx->xn, qkv_out, ctx->n);
    if (rc != ES_OK) return rc;
    const es_weight * bias[3] = { &L->bq, &L->bk, &L->bv };
    for (int32_t i = 0; i < 3; i++) {
        if (!bias[i]->data) continue;
        const int64_t width = bias[i]->n_in;  // (n, width) rows of qkv_out[i]
        for (int32_t t = 0; t < ctx->n; t++) {
            es__add(qkv_out[i] + (size_t) t * (size_t) width, bias[i]->data, width);
        }
    }
    return ES_OK;
}

void es__attention(es_context * ctx, int32_t il, float kq_scale) {
    const es_model * m = ctx->model;
    const int32_t hd = m->head_dim, n_kv = m->n_head_kv;
    // The batch's K and V into its sequences' cells, in each cache's types
    // (F16: llama.cpp's default; Q8_0: ggml's rounding, the activations'):
    // each row by itself, so its bytes never depend on the batch (Q8_0
    // keys rotated first, in the batch's own buffer).
    for (int32_t t = 0; t < ctx->n; t++) {
        const es_seq_rows * seq = &ctx->seqs[ctx->row_seq[t]];
        es_context * kv = seq->kv;
        for (int32_t g = 0; g < n_kv; g++) {
            const size_t cell = ((size_t) il * n_kv + g) * kv->n_ctx + kv->n_past + (t - seq->r0);
            float * k = ctx->k + ((size_t) t * n_kv + g) * hd;
            if (keys_rotated(kv, hd)) hadamard(k, hd);
            es_quantize_act(kv->type_k, k, kv->k_cache + cell * kv->k_row, hd);
            es_quantize_act(kv->type_v, ctx->v + ((size_t) t * n_kv + g) * hd, kv->v_cache + cell * kv->v_row, hd);
        }
    }
    attn_job job = { .ctx = ctx, .il = il, .kq_scale = kq_scale };
    run(ctx, attn_heads, &job, ctx->n * m->n_head);
}

/* ---- blocks: feed-forward -------------------------------------------------- */

typedef struct glu_job {
    es_context * ctx;
    int32_t      act;     // enum es_activation
    int64_t      n_ff;
} glu_job;

// ggml's GELU (tanh form) as llama.cpp evaluates it on CPU: a function of
// the F16-rounded input with an F16-rounded output. There are only 2^16
// inputs, so they are tabulated once (128 KB) instead of calling tanhf per
// element (a fifth of gemma3's prefill); the values are the same.
static uint16_t gelu_table[1 << 16];   // (F16 input bits) -> F16 output bits
static pthread_once_t gelu_table_once = PTHREAD_ONCE_INIT;

static void gelu_table_build(void) {
    for (uint32_t i = 0; i < (1u << 16); i++) {
        const float h = es_half_to_f32((uint16_t) i);
        const float g = 0.5f * h * (1.0f + tanhf(0.79788456080286535588f * h * (1.0f + 0.044715f * h * h)));
        gelu_table[i] = es_f32_to_half(g);
    }
}

static inline float gelu(float x) {
    if (x <= -10.0f) return 0.0f;
    if (x >= 10.0f) return x;
    return es_half_to_f32(gelu_table[es_f32_to_half(x)]);
}

void es__swiglu(float * g, const float * u, int64_t n) {
    for (int64_t i = 0; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static void glu_rows(void * arg, int32_t ith, int32_t nth) {
    const glu_job * job = arg;
    es_context * ctx = job->ctx;
    for (int32_t t = ith; t < ctx->n; t += nth) {
        float * g = ctx->ff_gate + (size_t) t * job->n_ff;
        const float * u = ctx->ff_up + (size_t) t * job->n_ff;
        if (job->act == ES_ACT_GELU_TANH) {
            for (int64_t i = 0; i < job->n_ff; i++) g[i] = gelu(g[i]) * u[i];
        } else {
            es__swiglu(g, u, job->n_ff);
        }
    }
}

int es__ffn(es_context * ctx, int32_t il, int32_t act) {
    const es_layer * L = &ctx->model->layers[il];
    const es_weight * gu[2] = { &L->ffn_gate, &L->ffn_up };
    float * gu_out[2] = { ctx->ff_gate, ctx->ff_up };
    int rc = es__matmul(ctx, 2, gu, ctx->xn, gu_out, ctx->n);
    if (rc != ES_OK) return rc;
    if (act == ES_ACT_GELU_TANH) pthread_once(&gelu_table_once, gelu_table_build);
    glu_job job = { .ctx = ctx, .act = act, .n_ff = L->ffn_gate.n_out };
    run(ctx, glu_rows, &job, ctx->n);
    const es_weight * down = &L->ffn_down;
    return es__matmul(ctx, 1, &down, ctx->ff_gate, &ctx->out, ctx->n);
}
