/*
 * model.c — the native engine: es_model / es_context, the KV cache, the
 * blocks every architecture shares (the MoE block is moe.c's), and es_decode.
 *
 *   model        GGUF mapped and validated (gguf.c, validate.c), architecture
 *                found by general.architecture in es__archs, tensors bound by arch->load
 *   context      thread pool, F16 KV cache, batch buffers, logits
 *   blocks       RMSNorm, RoPE, attention, matmul, dense FFN
 *   es_decode    positions and visibility of a chain or tree batch, embeddings,
 *                arch->layer for every layer, final norm, output matmul
 *
 * Batch invariance: every token row goes through the same sequence of
 * operations whatever the batch or thread count — matmuls are per-row
 * es_matvec calls (fixed reduction order), attention reduces over the cells a
 * token sees in ascending cell order — so a token's logits are bit-identical
 * alone, in a chain or in a tree. Exact speculative decoding relies on it.
 */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE  // madvise's MADV_HUGEPAGE (glibc: not POSIX)

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "native/native_internal.h"

extern const es_arch es__arch_llama;
extern const es_arch es__arch_gemma3;
extern const es_arch es__arch_qwen2;
extern const es_arch es__arch_qwen3moe;

const es_arch * const es__archs[] = {
    &es__arch_llama,
    &es__arch_gemma3,
    &es__arch_qwen2,
    &es__arch_qwen3moe,
    NULL,
};

const es_arch * es__arch(const char * name) {
    for (int32_t i = 0; name && es__archs[i]; i++) {
        if (strcmp(es__archs[i]->name, name) == 0) return es__archs[i];
    }
    return NULL;
}

const char * es_arch_name(int32_t i) {
    const int32_t n = (int32_t) (sizeof es__archs / sizeof es__archs[0]) - 1;
    return i >= 0 && i < n ? es__archs[i]->name : NULL;
}

bool es_arch_tensor(const char * arch, int32_t i, es_tensor_spec * out) {
    const es_arch * a = es__arch(arch);
    if (!a || !out || i < 0 || i >= a->n_tensors) return false;
    *out = a->tensors[i].spec;
    return true;
}

/* ---- small helpers ------------------------------------------------------- */

static void set_err(char * err, size_t err_cap, const char * fmt, ...) {
    if (!err || err_cap == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_cap, fmt, ap);
    va_end(ap);
}

// Runs fn over the pool, or on the calling thread alone when the work is one
// row (a decode step): a pool round trip costs more than the work then.
static void run(es_context * ctx, es_pool_fn fn, void * arg, int32_t n_rows) {
    if (n_rows <= 1) fn(arg, 0, 1);
    else es_pool_run(ctx->pool, fn, arg);
}

/* ---- binding tensors and keys -------------------------------------------- */

// The tensor named name (already "blk.<il>." prefixed for a layer's) as an
// (n_in, n_out) matrix (n_out = 1: a vector; 0: whatever the file has) of a
// type the kernels implement. Absent and not required: *out zeroed, ES_OK.
// Errors name the tensor.
static int bind_tensor(const es_model * m, const char * name, int64_t n_in, int64_t n_out, bool required,
                       es_weight * out, char * err, size_t err_cap) {
    memset(out, 0, sizeof *out);
    const es_tensor * t = es_gguf_find_tensor(m->gguf, name);
    if (!t) {
        if (!required) return ES_OK;
        // The file passed es_gguf_validate, which asks for every tensor
        // llama.cpp needs: this one is optional there (a variant, such as
        // qwen2 without one of its biases), which this engine does not read.
        set_err(err, err_cap, "tensor %s is missing (a variant the native engine does not read)", name);
        return ES_ERR_UNSUPPORTED;
    }
    const int64_t want_out = n_out > 0 ? n_out : t->ne[1];
    if (t->ne[0] != n_in || t->ne[1] != want_out || t->ne[2] != 1 || t->ne[3] != 1) {
        set_err(err, err_cap, "tensor %s has shape (%lld, %lld, %lld, %lld), expected (%lld, %lld)",
                name, (long long) t->ne[0], (long long) t->ne[1], (long long) t->ne[2],
                (long long) t->ne[3], (long long) n_in, (long long) want_out);
        return ES_ERR_FORMAT;
    }
    if (es_type_row_bytes(t->type, n_in) == 0 || es_act_type(t->type) < 0) {
        set_err(err, err_cap, "tensor %s: weight type %s is not supported", name,
                es_type_name(t->type));
        return ES_ERR_UNSUPPORTED;
    }
    // Norm and bias vectors are read as floats directly.
    if (want_out == 1 && t->type != ES_TYPE_F32) {
        set_err(err, err_cap, "tensor %s: expected F32, found %s", name, es_type_name(t->type));
        return ES_ERR_UNSUPPORTED;
    }
    *out = (es_weight) { .data = t->data, .type = t->type, .n_in = n_in, .n_out = want_out };
    return ES_OK;
}

// The sizes the es_dim symbols stand for in model m (every layer alike here).
static void model_dims(const es_model * m, int64_t size[ES_DIM_COUNT]) {
    const int64_t Q = (int64_t) m->n_head * m->head_dim, KV = (int64_t) m->n_head_kv * m->head_dim;
    memset(size, 0, ES_DIM_COUNT * sizeof size[0]);
    size[ES_DIM_ONE] = 1;
    size[ES_DIM_EMBD] = m->n_embd;
    size[ES_DIM_VOCAB] = m->n_vocab;
    size[ES_DIM_FF] = m->n_ff;
    size[ES_DIM_Q] = Q;
    size[ES_DIM_K] = size[ES_DIM_V] = KV;
    size[ES_DIM_HEAD] = m->head_dim;
    size[ES_DIM_QKV] = Q + 2 * KV;
}

// Whether table row flags apply to a model with or without experts.
static bool row_applies(int32_t flags, bool experts) {
    return !((flags & ES_TENSOR_DENSE) && experts) && !((flags & ES_TENSOR_EXPERTS) && !experts);
}

int es__bind_tensors(es_model * m, bool experts, char * err, size_t err_cap) {
    const es_tensor * embd = es_gguf_find_tensor(m->gguf, "token_embd.weight");
    if (!embd) {
        set_err(err, err_cap, "tensor token_embd.weight is missing");
        return ES_ERR_FORMAT;
    }
    m->n_vocab = (int32_t) embd->ne[1];
    m->layers = calloc((size_t) m->n_layer, sizeof *m->layers);
    if (!m->layers) return ES_ERR_NO_MEMORY;
    int64_t size[ES_DIM_COUNT];
    model_dims(m, size);
    int rc = ES_OK;
    for (int32_t r = 0; rc == ES_OK && r < m->arch->n_tensors; r++) {
        const es_arch_row * row = &m->arch->tensors[r];
        const es_tensor_spec * sp = &row->spec;
        if (row->field == ES_UNBOUND || !row_applies(sp->flags, experts)) continue;
        const int64_t n_in = size[sp->ne[0]], n_out = size[sp->ne[1]];
        const int32_t n_layers = sp->flags & ES_TENSOR_LAYER ? m->n_layer : 1;
        for (int32_t il = 0; rc == ES_OK && il < n_layers; il++) {
            char name[96];
            if (sp->flags & ES_TENSOR_LAYER) snprintf(name, sizeof name, "blk.%d.%s", (int) il, sp->name);
            else snprintf(name, sizeof name, "%s", sp->name);
            bool required = sp->flags & ES_TENSOR_REQUIRED;
            if (sp->flags & ES_TENSOR_UNFUSED) {
                char fused[96];
                snprintf(fused, sizeof fused, "blk.%d.attn_qkv.weight", (int) il);
                if (es_gguf_find_tensor(m->gguf, fused) && !es_gguf_find_tensor(m->gguf, name)) {
                    set_err(err, err_cap, "tensor %s: a fused attention projection is not read by the "
                            "native engine", fused);
                    return ES_ERR_UNSUPPORTED;
                }
                required = true;
            }
            char * base = sp->flags & ES_TENSOR_LAYER ? (char *) &m->layers[il] : (char *) m;
            rc = bind_tensor(m, name, n_in, n_out, required, (es_weight *) (base + row->field), err, err_cap);
        }
    }
    if (rc == ES_OK && !m->output.data) m->output = m->tok_embd;  // tied embeddings
    return rc;
}

static int key_num(const es_model * m, const char * key, bool required, double * out,
                   char * err, size_t err_cap) {
    char full[128];
    snprintf(full, sizeof full, "%s.%s", m->arch->name, key);
    int64_t i;
    float f;
    if (es_gguf_get_i64(m->gguf, full, &i)) { *out = (double) i; return 1; }
    if (es_gguf_get_f32(m->gguf, full, &f)) { *out = f; return 1; }
    if (!required) return 0;
    set_err(err, err_cap, "metadata key %s is missing", full);
    return ES_ERR_FORMAT;
}

int es__key_i32(const es_model * m, const char * key, bool required, int32_t * out,
                char * err, size_t err_cap) {
    double v;
    const int rc = key_num(m, key, required, &v, err, err_cap);
    if (rc <= 0) return rc;
    if (v != floor(v) || v < 0 || v > (double) INT32_MAX) {
        set_err(err, err_cap, "metadata key %s.%s = %g is out of range", m->arch->name, key, v);
        return ES_ERR_FORMAT;
    }
    *out = (int32_t) v;
    return ES_OK;
}

int es__key_f32(const es_model * m, const char * key, bool required, float * out,
                char * err, size_t err_cap) {
    double v;
    const int rc = key_num(m, key, required, &v, err, err_cap);
    if (rc <= 0) return rc;
    if (!isfinite(v)) {
        set_err(err, err_cap, "metadata key %s.%s is not finite", m->arch->name, key);
        return ES_ERR_FORMAT;
    }
    *out = (float) v;
    return ES_OK;
}

int es__rope_freq_scale(const es_model * m, float * scale, char * err, size_t err_cap) {
    char key[96];
    snprintf(key, sizeof key, "%s.rope.scaling.type", m->arch->name);
    const char * type = es_gguf_get_str(m->gguf, key);
    *scale = 1.0f;
    if (type && strcmp(type, "none") == 0) return ES_OK;
    if (type && strcmp(type, "linear") != 0) {
        set_err(err, err_cap, "RoPE scaling '%.32s' is not supported", type);
        return ES_ERR_UNSUPPORTED;
    }
    float factor = 0.0f;
    int rc = es__key_f32(m, "rope.scaling.factor", false, &factor, err, err_cap);
    if (rc == ES_OK && factor == 0.0f) rc = es__key_f32(m, "rope.scale_linear", false, &factor, err, err_cap);
    if (rc == ES_OK && factor < 0.0f) {
        set_err(err, err_cap, "RoPE scaling factor %g is negative", factor);
        rc = ES_ERR_FORMAT;
    }
    if (factor > 0.0f) *scale = 1.0f / factor;
    return rc;
}

// The attention hyperparameters every architecture here shares, read and
// checked once: widths, heads, head size (key = value = RoPE dimensions),
// training context, norm epsilon, RoPE base (default 10000) and linear scale.
int es__load_attention_hparams(es_model * m, float * rope_base, float * rope_scale,
                               char * err, size_t err_cap) {
    int rc = ES_OK;
    *rope_base = 10000.0f;
#define TRY(call) do { if (rc == ES_OK) rc = (call); } while (0)
    TRY(es__key_i32(m, "embedding_length", true, &m->n_embd, err, err_cap));
    TRY(es__key_i32(m, "block_count", true, &m->n_layer, err, err_cap));
    TRY(es__key_i32(m, "attention.head_count", true, &m->n_head, err, err_cap));
    TRY(es__key_i32(m, "attention.head_count_kv", false, &m->n_head_kv, err, err_cap));
    TRY(es__key_i32(m, "attention.key_length", false, &m->head_dim, err, err_cap));
    TRY(es__key_i32(m, "rope.dimension_count", false, &m->n_rot, err, err_cap));
    TRY(es__key_i32(m, "context_length", false, &m->n_ctx_train, err, err_cap));
    TRY(es__key_f32(m, "attention.layer_norm_rms_epsilon", true, &m->norm_eps, err, err_cap));
    TRY(es__key_f32(m, "rope.freq_base", false, rope_base, err, err_cap));
    TRY(es__rope_freq_scale(m, rope_scale, err, err_cap));
    if (rc != ES_OK) return rc;
    if (m->n_head <= 0 || m->n_embd <= 0 || m->n_layer <= 0 || m->n_layer > 4096) {
        set_err(err, err_cap, "bad hyperparameters: n_embd %d, n_layer %d, n_head %d",
                (int) m->n_embd, (int) m->n_layer, (int) m->n_head);
        return ES_ERR_FORMAT;
    }
    if (m->n_head_kv == 0) m->n_head_kv = m->n_head;
    if (m->head_dim == 0) m->head_dim = m->n_embd / m->n_head;
    if (m->n_rot == 0) m->n_rot = m->head_dim;
    int32_t v_len = m->head_dim;
    TRY(es__key_i32(m, "attention.value_length", false, &v_len, err, err_cap));
#undef TRY
    if (rc != ES_OK) return rc;
    if (v_len != m->head_dim || m->n_rot != m->head_dim) {
        set_err(err, err_cap, "key length %d, value length %d and RoPE dimensions %d differ",
                (int) m->head_dim, (int) v_len, (int) m->n_rot);
        return ES_ERR_UNSUPPORTED;
    }
    return ES_OK;
}

/* ---- model ---------------------------------------------------------------- */

// Every weight a model binds, for the checks after loading.
static int32_t model_weights(const es_model * m, const es_weight ** out, int32_t cap) {
    int32_t n = 0;
#define ADD(w) do { if ((w).data && n < cap) out[n++] = &(w); } while (0)
    ADD(m->tok_embd);
    ADD(m->output_norm);
    ADD(m->output);
    for (int32_t il = 0; il < m->n_layer; il++) {
        const es_layer * L = &m->layers[il];
        ADD(L->attn_norm); ADD(L->wq); ADD(L->wk); ADD(L->wv); ADD(L->wo);
        ADD(L->bq); ADD(L->bk); ADD(L->bv);
        ADD(L->attn_q_norm); ADD(L->attn_k_norm); ADD(L->attn_post_norm);
        ADD(L->ffn_norm); ADD(L->ffn_gate); ADD(L->ffn_up); ADD(L->ffn_down);
        ADD(L->ffn_post_norm);
    }
#undef ADD
    return n;
}

enum { WEIGHTS_PER_LAYER = 16 };

// A tensor the architecture does not read (a bias, RoPE factors, ...) means
// a variant this engine would get wrong: refuse it rather than ignore it.
static int check_all_used(const es_model * m, char * err, size_t err_cap) {
    const int32_t cap = 3 + WEIGHTS_PER_LAYER * m->n_layer;
    const es_weight ** ws = malloc((size_t) cap * sizeof *ws);
    if (!ws) return ES_ERR_NO_MEMORY;
    const int32_t nw = model_weights(m, ws, cap);
    int rc = ES_OK;
    for (int64_t i = 0; i < es_gguf_n_tensors(m->gguf) && rc == ES_OK; i++) {
        const es_tensor * t = es_gguf_tensor_at(m->gguf, i);
        bool used = false;
        for (int32_t j = 0; j < nw && !used; j++) used = ws[j]->data == t->data;
        if (!used && m->experts) {
            int il;
            char kind[32];
            used = sscanf(t->name, "blk.%d.%31[a-z_].weight", &il, kind) == 2 &&
                   il >= 0 && il < m->n_layer &&
                   (!strcmp(kind, "ffn_gate_inp") || !strcmp(kind, "ffn_gate_exps") ||
                    !strcmp(kind, "ffn_up_exps") || !strcmp(kind, "ffn_down_exps"));
        }
        if (!used) {
            set_err(err, err_cap, "tensor %s is not used by the %s architecture of this engine "
                    "(an unsupported variant)", t->name, m->arch->name);
            rc = ES_ERR_UNSUPPORTED;
        }
    }
    free(ws);
    return rc;
}

static int check_hparams(const es_model * m, char * err, size_t err_cap) {
    if (m->n_embd <= 0 || m->n_layer <= 0 || m->n_head <= 0 || m->n_head_kv <= 0 ||
        m->head_dim <= 0 || m->n_vocab <= 0 || m->n_head % m->n_head_kv != 0 ||
        m->n_rot <= 0 || m->n_rot > m->head_dim || m->n_rot % 2 != 0 || m->n_swa < 0 ||
        !(m->norm_eps > 0) || m->n_layer > 4096 || m->n_head > 4096 || m->head_dim > 4096) {
        set_err(err, err_cap, "bad hyperparameters: n_embd %d, n_layer %d, n_head %d, "
                "n_head_kv %d, head_dim %d, n_rot %d, n_vocab %d", (int) m->n_embd,
                (int) m->n_layer, (int) m->n_head, (int) m->n_head_kv, (int) m->head_dim,
                (int) m->n_rot, (int) m->n_vocab);
        return ES_ERR_FORMAT;
    }
    return ES_OK;
}

/* ---- repacked weights ------------------------------------------------------ */

// Bytes the system says a new allocation can take (Linux: MemAvailable,
// which counts reclaimable page cache, the mapped model's pages among them);
// -1 where it does not say.
static int64_t available_memory(void) {
    FILE * f = fopen("/proc/meminfo", "r");
    if (!f) return -1;
    char line[128];
    long long kb = -1;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "MemAvailable: %lld kB", &kb) == 1) break;
    }
    fclose(f);
    return kb >= 0 ? (int64_t) kb * 1024 : -1;
}

// Every matrix es__matmul multiplies by (the token embedding's rows are
// read one at a time; a tied output is its own es_weight over the same data)
// whose type the kernel set in use has tile kernels for: a set without them
// (NEON; AVX2 for Q8_0) would only hold the copy.
static bool repacks(const es_model * m, const es_weight * w) {
    return w != &m->tok_embd && w->n_out > 1 && es_kernels_tile(w->type);
}


// One task of the repack: groups [g0, g1) of a weight, into dst.
typedef struct repack_task {
    const es_weight * w;
    int64_t           g0, g1;
    uint8_t         * dst;   // the weight's copy
} repack_task;

typedef struct repack_job {
    const es_gguf *   gguf;
    repack_task *     tasks;
    int64_t           n_tasks;
    _Atomic int64_t   next;
} repack_job;

// Each thread takes tasks in turn, repacks them, and releases the source
// pages from the process's resident memory (the copy serves the tile
// kernels; the few reads left, a token's embedding row or a set without
// tile kernels, fault them back from the page cache).
static void repack_run(void * arg, int32_t ith, int32_t nth) {
    (void) ith, (void) nth;
    repack_job * job = arg;
    for (int64_t k; (k = atomic_fetch_add_explicit(&job->next, 1, memory_order_relaxed)) < job->n_tasks;) {
        const repack_task * t = &job->tasks[k];
        const size_t row_bytes = es_type_row_bytes(t->w->type, t->w->n_in);
        const size_t gb = es_repack_bytes(t->w->type, t->w->n_in, ES_GROUP_ROWS);
        const uint8_t * rows = (const uint8_t *) t->w->data + (size_t) (ES_GROUP_ROWS * t->g0) * row_bytes;
        const int64_t n_rows = ES_GROUP_ROWS * (t->g1 - t->g0);
        es_repack(t->w->type, rows, t->w->n_in, n_rows, t->dst + (size_t) t->g0 * gb);
        es_gguf_release(job->gguf, rows, (size_t) n_rows * row_bytes);
    }
}

#define HUGE_PAGE ((size_t) 2 << 20)
#define REPACK_TASK_BYTES ((size_t) 4 << 20)  // of the copy per task: threads balance, few tasks

// Repacks the model's matrices into one allocation (m->packed), once the
// total is known to fit the budget, on a pool of one thread per CPU; a type
// without a repacked layout, or a remainder of rows, stays in the mapping only.
static int repack_weights(es_model * m, int64_t max_bytes, char * err, size_t err_cap) {
    const int32_t cap = 3 + WEIGHTS_PER_LAYER * m->n_layer;
    const es_weight ** ws = malloc((size_t) cap * sizeof *ws);
    if (!ws) return ES_ERR_NO_MEMORY;
    const int32_t nw = model_weights(m, ws, cap);
    size_t total = 0;
    int64_t n_tasks = 0;
    for (int32_t j = 0; j < nw; j++) {
        if (!repacks(m, ws[j])) continue;
        const size_t bytes = es_repack_bytes(ws[j]->type, ws[j]->n_in, ws[j]->n_out);
        total += bytes;
        n_tasks += (int64_t) ((bytes + REPACK_TASK_BYTES - 1) / REPACK_TASK_BYTES);
    }
    const int64_t budget = max_bytes > 0 ? max_bytes : available_memory();
    int rc = ES_OK;
    if (total > 0 && budget >= 0 && (double) total > (double) budget) {
        set_err(err, err_cap, "repacking the weights needs %.1f MiB and %.1f MiB %s (repacking off: "
                "es_model_params.repack = false, EDGESPEC_REPACK=0)", (double) total / 1048576.0,
                (double) budget / 1048576.0, max_bytes > 0 ? "are allowed" : "are available");
        rc = ES_ERR_NO_MEMORY;
    } else if (total > 0) {
        // In 2 MiB pages where the system gives them (Linux: transparent huge
        // pages on request): 512 times fewer page faults while repacking and
        // TLB misses while the weights stream by.
        void * packed = NULL;
        repack_job job = { .gguf = m->gguf, .tasks = malloc((size_t) n_tasks * sizeof *job.tasks) };
        rc = job.tasks && posix_memalign(&packed, HUGE_PAGE, total) == 0 ? ES_OK : ES_ERR_NO_MEMORY;
#if defined(MADV_HUGEPAGE)
        if (rc == ES_OK) madvise(packed, total, MADV_HUGEPAGE);
#endif
        m->packed = packed;
        size_t at = 0;
        for (int32_t j = 0; j < nw && rc == ES_OK; j++) {
            es_weight * w = (es_weight *) ws[j];  // m's own, as model_weights lists them
            const size_t bytes = repacks(m, w) ? es_repack_bytes(w->type, w->n_in, w->n_out) : 0;
            if (bytes == 0) continue;
            w->packed = (uint8_t *) m->packed + at;
            const size_t gb = es_repack_bytes(w->type, w->n_in, ES_GROUP_ROWS);
            const int64_t n_groups = (int64_t) (bytes / gb);
            const int64_t per = (int64_t) (REPACK_TASK_BYTES / gb) > 0 ? (int64_t) (REPACK_TASK_BYTES / gb) : 1;
            for (int64_t g = 0; g < n_groups; g += per) {
                job.tasks[job.n_tasks++] = (repack_task) {
                    .w = w, .g0 = g, .g1 = g + per < n_groups ? g + per : n_groups, .dst = (uint8_t *) m->packed + at};
            }
            at += bytes;
        }
        es_pool * pool = NULL;
        const long n_cpu = sysconf(_SC_NPROCESSORS_ONLN);
        if (rc == ES_OK) rc = es_pool_init(n_cpu > 0 ? (int32_t) (n_cpu < 64 ? n_cpu : 64) : 1, &pool);
        if (rc == ES_OK) {
            atomic_init(&job.next, 0);
            es_pool_run(pool, repack_run, &job);
        }
        es_pool_free(pool);
        free(job.tasks);
    }
    free(ws);
    return rc;
}

es_model_params es_model_default_params(void) {
    return (es_model_params) {
        .experts = ES_EXPERTS_MAPPED, .expert_cache_bytes = 0,
        .expert_precision = ES_PRECISION_EXACT, .expert_policy = ES_POLICY_ADAPTIVE,
        .prefetch_depth = 3, .expert_sidecar = NULL, .repack_max_bytes = 0, .repack = true,
    };
}

int es_model_load(const char * path, const es_model_params * params, es_model ** out,
                  char * err, size_t err_cap) {
    if (err && err_cap) err[0] = '\0';
    if (out) *out = NULL;
    if (!path || !out) {
        set_err(err, err_cap, "no path given");
        return ES_ERR_INVALID_ARG;
    }
    const es_model_params p = params ? *params : es_model_default_params();
    if (p.experts != ES_EXPERTS_MAPPED && p.experts != ES_EXPERTS_F32) {
        set_err(err, err_cap, "unknown experts mode %d", (int) p.experts);
        return ES_ERR_INVALID_ARG;
    }
    if (p.expert_cache_bytes < 0 || (p.expert_cache_bytes > 0 && p.experts != ES_EXPERTS_MAPPED)) {
        set_err(err, err_cap, "an expert cache of %lld bytes with experts mode %d: the cache "
                "takes the place of the mapped experts only", (long long) p.expert_cache_bytes,
                (int) p.experts);
        return ES_ERR_INVALID_ARG;
    }
    es_model * m = calloc(1, sizeof *m);
    if (!m) return ES_ERR_NO_MEMORY;
    m->params = p;
    int rc = es_gguf_open(path, &m->gguf, err, err_cap);
    if (rc != ES_OK) { free(m); return rc; }

    const char * arch = es_gguf_get_str(m->gguf, "general.architecture");
    if (!arch) {
        set_err(err, err_cap, "metadata key general.architecture is missing");
        es_model_free(m);
        return ES_ERR_FORMAT;
    }
    for (int i = 0; es__archs[i]; i++) {
        if (strcmp(es__archs[i]->name, arch) == 0) m->arch = es__archs[i];
    }
    if (!m->arch) {
        char names[256] = "";
        for (int i = 0; es__archs[i]; i++) {
            strncat(names, i ? ", " : "", sizeof names - strlen(names) - 1);
            strncat(names, es__archs[i]->name, sizeof names - strlen(names) - 1);
        }
        set_err(err, err_cap, "architecture '%.64s' is not supported by the native engine "
                "(supported: %s)", arch, names);
        es_model_free(m);
        return ES_ERR_UNSUPPORTED;
    }
    m->n_ctx_train = 0;
    // What llama.cpp would assert on is refused here too, in the same words.
    rc = es_gguf_validate(m->gguf, err, err_cap);
    if (rc == ES_OK) rc = m->arch->load(m, err, err_cap);
    if (rc == ES_OK) rc = check_hparams(m, err, err_cap);
    if (rc == ES_OK) rc = check_all_used(m, err, err_cap);
    if (rc == ES_OK && p.repack) rc = repack_weights(m, p.repack_max_bytes, err, err_cap);
    if (rc == ES_OK && m->experts && p.expert_cache_bytes > 0) {
        rc = es_expert_cache_init(m->gguf, path, m->experts, &p, &m->expert_cache, err, err_cap);
        if (rc == ES_OK) {
            es_experts_set_provider(m->experts, es_expert_cache_provider(m->expert_cache));
        }
        m->params.expert_sidecar = NULL;  // the caller's string: read at load only
    }
    if (rc != ES_OK) {
        es_model_free(m);
        return rc;
    }
    *out = m;
    return ES_OK;
}

int es_model_set_output_rows(es_model * m, const es_token * ids, int32_t n) {
    if (!m || n < 0 || (n > 0 && !ids)) return ES_ERR_INVALID_ARG;
    const int64_t D = m->n_embd;
    const size_t row = es_type_row_bytes(m->output.type, D);
    uint8_t * seen = n > 0 ? calloc((size_t) m->n_vocab, 1) : NULL;
    if (n > 0 && !seen) return ES_ERR_NO_MEMORY;
    for (int32_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= m->n_vocab || seen[ids[i]]) {
            free(seen);
            return ES_ERR_INVALID_ARG;
        }
        seen[ids[i]] = 1;
    }
    free(seen);
    // The kept rows are repacked as the full layer was (its packed copy set
    // when the model was loaded with repacking on).
    const size_t packed_bytes = n > 0 && m->output.packed ? es_repack_bytes(m->output.type, D, n) : 0;
    uint8_t * data = n > 0 ? malloc((size_t) n * row) : NULL;
    es_token * kept = n > 0 ? malloc((size_t) n * sizeof *kept) : NULL;
    void * packed = packed_bytes > 0 ? malloc(packed_bytes) : NULL;
    if (n > 0 && (!data || !kept || (packed_bytes > 0 && !packed))) {
        free(data);
        free(kept);
        free(packed);
        return ES_ERR_NO_MEMORY;
    }
    for (int32_t i = 0; i < n; i++) {   // (n, n_embd): row i is token ids[i]'s
        memcpy(data + (size_t) i * row, (const uint8_t *) m->output.data + (size_t) ids[i] * row, row);
        kept[i] = ids[i];
    }
    if (packed) es_repack(m->output.type, data, D, n, packed);
    free((void *) m->output_rows.data);
    free((void *) m->output_rows.packed);
    free(m->output_ids);
    m->output_rows = n > 0 ? (es_weight) { .data = data, .packed = packed, .type = m->output.type,
                                           .n_in = D, .n_out = n }
                           : (es_weight) { 0 };
    m->output_ids = kept;
    m->n_output_rows = n;
    return ES_OK;
}

void es_model_free(es_model * m) {
    if (!m) return;
    free((void *) m->output_rows.data);
    free((void *) m->output_rows.packed);
    free(m->output_ids);
    es_expert_cache_free(m->expert_cache);
    es_experts_free(m->experts);
    free(m->packed);
    free(m->layers);
    es_gguf_close(m->gguf);
    free(m);
}

const char * es_model_arch(const es_model * m) { return m && m->arch ? m->arch->name : ""; }
int32_t es_model_n_vocab(const es_model * m) { return m ? m->n_vocab : 0; }
int32_t es_model_n_ctx_train(const es_model * m) { return m ? m->n_ctx_train : 0; }
int32_t es_model_n_embd(const es_model * m) { return m ? m->n_embd : 0; }

int es_model_expert_stats(const es_model * m, es_expert_stats * out) {
    if (!m || !m->expert_cache || !out) return ES_ERR_INVALID_ARG;
    es_expert_cache_stats(m->expert_cache, out);
    return ES_OK;
}

void es_model_expert_stats_reset(es_model * m) {
    if (m && m->expert_cache) es_expert_cache_stats_reset(m->expert_cache);
}

const char * es_model_expert_error(const es_model * m) {
    return m && m->expert_cache ? es_expert_cache_error(m->expert_cache) : "";
}

/* ---- context --------------------------------------------------------------- */

es_context_params es_context_default_params(void) {
    return (es_context_params) { .n_ctx = 4096, .n_batch = 512, .n_threads = 0, .embeddings = false };
}

// The widest activation row (bytes) any of the model's dense weights reads.
static size_t widest_act_row(const es_model * m) {
    const int32_t cap = 3 + WEIGHTS_PER_LAYER * m->n_layer;
    const es_weight ** ws = malloc((size_t) cap * sizeof *ws);
    if (!ws) return 0;
    const int32_t nw = model_weights(m, ws, cap);
    size_t row = 0;
    for (int32_t j = 0; j < nw; j++) {
        const size_t r = es_type_row_bytes(es_act_type(ws[j]->type), ws[j]->n_in);
        row = r > row ? r : row;
    }
    free(ws);
    return row;
}

// Matmul outputs start on a cache line: threads write whole lines of 16
// rows (es__matmul's chunks), none shared with another thread.
static void * alloc_lines(size_t bytes) {
    void * p = NULL;
    return posix_memalign(&p, 64, bytes ? bytes : 1) == 0 ? p : NULL;
}

int es_context_init(es_model * m, const es_context_params * params, es_context ** out) {
    if (!m || !out) return ES_ERR_INVALID_ARG;
    *out = NULL;
    const es_context_params p = params ? *params : es_context_default_params();
    int32_t n_ctx = p.n_ctx > 0 ? p.n_ctx : m->n_ctx_train;
    if (n_ctx <= 0 || p.n_batch <= 0) return ES_ERR_INVALID_ARG;
    int32_t n_threads = p.n_threads;
    if (n_threads <= 0) {
        const long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int32_t) (n < 256 ? n : 256) : 1;
    }
    const int32_t n_batch = p.n_batch < n_ctx ? p.n_batch : n_ctx;

    es_context * c = calloc(1, sizeof *c);
    if (!c) return ES_ERR_NO_MEMORY;
    c->model = m;
    c->n_ctx = n_ctx;
    c->n_batch = n_batch;
    c->n_threads = n_threads;
    c->embeddings = p.embeddings;
    int rc = es_pool_init(n_threads, &c->pool);
    if (rc == ES_OK && m->experts) rc = es_moe_init(m->experts, n_batch, &c->moe);
    if (rc != ES_OK) { es_context_free(c); return rc; }

    const size_t B = (size_t) n_batch, D = (size_t) m->n_embd, HD = (size_t) m->head_dim;
    // The cache is the one allocation a large n_ctx could make overflow size_t.
    if ((double) m->n_layer * m->n_head_kv * n_ctx * (double) HD > (double) (SIZE_MAX / 8)) {
        es_context_free(c);
        return ES_ERR_NO_MEMORY;
    }
    const size_t kv = (size_t) m->n_layer * (size_t) m->n_head_kv * (size_t) n_ctx * HD;
    const size_t ff = m->n_ff > 0 ? (size_t) m->n_ff : 1;
    c->act_row  = widest_act_row(m);
    c->k_cache  = calloc(kv, sizeof *c->k_cache);
    c->v_cache  = calloc(kv, sizeof *c->v_cache);
    c->cell_pos = calloc((size_t) n_ctx, sizeof *c->cell_pos);
    c->pos      = malloc(B * sizeof *c->pos);
    c->sees     = malloc(B * B);
    c->x        = alloc_lines(B * D * sizeof *c->x);
    c->xn       = alloc_lines(B * D * sizeof *c->xn);
    c->q        = alloc_lines(B * (size_t) m->n_head * HD * sizeof *c->q);
    c->k        = alloc_lines(B * (size_t) m->n_head_kv * HD * sizeof *c->k);
    c->v        = alloc_lines(B * (size_t) m->n_head_kv * HD * sizeof *c->v);
    c->att      = alloc_lines(B * (size_t) m->n_head * HD * sizeof *c->att);
    c->ff_gate  = alloc_lines(B * ff * sizeof *c->ff_gate);
    c->ff_up    = alloc_lines(B * ff * sizeof *c->ff_up);
    c->out      = alloc_lines(B * D * sizeof *c->out);
    c->act      = malloc(3 * B * (c->act_row ? c->act_row : 1));
    c->scratch  = malloc((size_t) n_threads * ((size_t) n_ctx + 3 * HD) * sizeof *c->scratch);
    if (!c->act_row || !c->k_cache || !c->v_cache || !c->cell_pos || !c->pos || !c->sees ||
        !c->x || !c->xn || !c->q || !c->k || !c->v || !c->att || !c->ff_gate || !c->ff_up ||
        !c->out || !c->act || !c->scratch) {
        es_context_free(c);
        return ES_ERR_NO_MEMORY;
    }
    *out = c;
    return ES_OK;
}

void es_context_free(es_context * c) {
    if (!c) return;
    free(c->logits);
    free(c->kept);
    free(c->scratch);
    free(c->act);
    free(c->out);
    free(c->ff_up);
    free(c->ff_gate);
    free(c->att);
    free(c->v);
    free(c->k);
    free(c->q);
    free(c->xn);
    free(c->x);
    free(c->sees);
    free(c->pos);
    free(c->cell_pos);
    free(c->v_cache);
    free(c->k_cache);
    es_moe_free(c->moe);
    es_pool_free(c->pool);
    free(c);
}

int32_t es_context_n_ctx(const es_context * c) { return c ? c->n_ctx : 0; }
int32_t es_context_n_batch(const es_context * c) { return c ? c->n_batch : 0; }
int32_t es_context_n_past(const es_context * c) { return c ? c->n_past : 0; }
const float * es_context_logits(const es_context * c) { return c ? c->logits : NULL; }
const float * es_context_embeddings(const es_context * c) {
    return c && c->embeddings && c->n_embd_rows > 0 ? c->xn : NULL;
}

int es_context_truncate(es_context * c, int32_t n_keep) {
    if (!c || n_keep < 0 || n_keep > c->n_past) return ES_ERR_INVALID_ARG;
    c->n_past = n_keep;
    return ES_OK;
}

/* ---- the KV cache's state: save and restore a slot ------------------------ */

// The state of n cells: per layer and KV head, the n keys then the n values
// (head_dim F16 each), then the n cells' positions (int32).
static size_t state_bytes(const es_model * m, int32_t n) {
    return (size_t) n * ((size_t) 2 * m->n_layer * m->n_head_kv * m->head_dim * sizeof(uint16_t) + sizeof(int32_t));
}

size_t es_context_state_size(const es_context * c) {
    return c ? state_bytes(c->model, c->n_past) : 0;
}

// Copies (or, with set, fills) the n_past cells' rows of every (layer, head)
// block of the cache, whose row stride is n_ctx cells.
static void state_copy(es_context * c, uint8_t * buf, int32_t n, bool set) {
    const es_model * m = c->model;
    const size_t row = (size_t) m->head_dim * sizeof(uint16_t), block = (size_t) n * row;
    for (int pass = 0; pass < 2; pass++) {
        uint16_t * cache = pass == 0 ? c->k_cache : c->v_cache;
        for (int64_t b = 0; b < (int64_t) m->n_layer * m->n_head_kv; b++) {
            uint8_t * at = (uint8_t *) (cache + (size_t) b * c->n_ctx * m->head_dim);
            if (set) memcpy(at, buf, block);
            else memcpy(buf, at, block);
            buf += block;
        }
    }
    if (set) memcpy(c->cell_pos, buf, (size_t) n * sizeof(int32_t));
    else memcpy(buf, c->cell_pos, (size_t) n * sizeof(int32_t));
}

int es_context_state_get(es_context * c, void * buf, size_t cap) {
    if (!c || !buf || cap < es_context_state_size(c) || c->embeddings) return ES_ERR_INVALID_ARG;
    state_copy(c, buf, c->n_past, false);
    return ES_OK;
}

int es_context_state_set(es_context * c, const void * buf, size_t size, int32_t n_past) {
    if (!c || !buf || c->embeddings || n_past < 0 || n_past > c->n_ctx || size != state_bytes(c->model, n_past))
        return ES_ERR_INVALID_ARG;
    for (int32_t i = 0; i < n_past; i++) {   // a cell's position is at most its index (a chain: equal)
        int32_t pos;
        memcpy(&pos, (const uint8_t *) buf + size - (size_t) (n_past - i) * sizeof(int32_t), sizeof pos);
        if (pos < 0 || pos > i) return ES_ERR_INVALID_ARG;
    }
    state_copy(c, (uint8_t *) buf, n_past, true);
    c->n_past = n_past;
    return ES_OK;
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
    const es_layer * L = &m->layers[il];
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
                const int32_t a = m->rope_type == ES_ROPE_NEOX ? i : 2 * i;
                const int32_t b = m->rope_type == ES_ROPE_NEOX ? i + half : 2 * i + 1;
                const float x0 = v[a], x1 = v[b], c = cs[2 * i], s = cs[2 * i + 1];
                v[a] = x0 * c - x1 * s;
                v[b] = x0 * s + x1 * c;
            }
        }
    }
}

/* ---- blocks: attention ----------------------------------------------------- */

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
    const es_layer * L = &m->layers[job->il];
    const int32_t hd = m->head_dim, n_head = m->n_head, group = m->n_head / m->n_head_kv;
    const int32_t n_past = ctx->n_past;
    float * scores = ctx->scratch + (size_t) ith * ((size_t) ctx->n_ctx + 3 * hd);  // (n_ctx)
    float * qr  = scores + ctx->n_ctx;   // (hd) the query, rounded to F16 as llama.cpp does
    float * qa  = qr + hd;               // (hd floats of room) qr in the F16 dot's activation
                                         //   format (F32 or F16: at most 4 bytes a value)
    float * acc = qa + hd;               // (hd) the weighted sum of V rows
    for (int32_t task = ith; task < ctx->n * n_head; task += nth) {
        const int32_t t = task / n_head, h = task % n_head, g = h / group;
        const int32_t p = ctx->pos[t];
        const size_t head = ((size_t) job->il * m->n_head_kv + g) * (size_t) ctx->n_ctx;
        const uint16_t * K = ctx->k_cache + head * hd;  // (n_ctx, hd)
        const uint16_t * V = ctx->v_cache + head * hd;  // (n_ctx, hd)
        const uint8_t * sees = ctx->sees + (size_t) t * ctx->n_batch;
        const int32_t end = n_past + t + 1;  // the token's own cell is its last candidate
        // Cells before c0 fall out of a sliding window.
        int32_t c0 = 0;
        if (L->swa) {
            while (c0 < n_past && p - ctx->cell_pos[c0] >= m->n_swa) c0++;
        }
        const float * q = ctx->q + ((size_t) t * n_head + h) * hd;
        for (int32_t d = 0; d < hd; d++) qr[d] = es_half_to_f32(es_f32_to_half(q[d]));
        es_quantize_act(ES_TYPE_F16, qr, qa, hd);
        es_matvec(ES_TYPE_F16, K, qa, hd, c0, end, scores + c0);

        float max = -INFINITY;
        for (int32_t c = c0; c < end; c++) {
            const bool seen = c < n_past ? true : sees[c - n_past] != 0;
            if (!seen || (L->swa && p - ctx->cell_pos[c] >= m->n_swa)) {
                scores[c] = -INFINITY;
                continue;
            }
            scores[c] *= job->kq_scale;
            max = scores[c] > max ? scores[c] : max;
        }
        float sum = 0.0f;
        memset(acc, 0, (size_t) hd * sizeof *acc);
        for (int32_t c = c0; c < end; c++) {
            if (scores[c] == -INFINITY) continue;
            const float e = expf(scores[c] - max);
            sum += e;
            es_axpy_f16(hd, e, V + (size_t) c * hd, acc);
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
    // The batch's K and V into its cells, as F16 (llama.cpp's cache type).
    for (int32_t t = 0; t < ctx->n; t++) {
        for (int32_t g = 0; g < n_kv; g++) {
            const size_t cell = (((size_t) il * n_kv + g) * ctx->n_ctx + ctx->n_past + t) * hd;
            const float * k = ctx->k + ((size_t) t * n_kv + g) * hd;
            const float * v = ctx->v + ((size_t) t * n_kv + g) * hd;
            for (int32_t d = 0; d < hd; d++) {
                ctx->k_cache[cell + d] = es_f32_to_half(k[d]);
                ctx->v_cache[cell + d] = es_f32_to_half(v[d]);
            }
        }
    }
    attn_job job = { .ctx = ctx, .il = il, .kq_scale = kq_scale };
    run(ctx, attn_heads, &job, ctx->n * m->n_head);
}

/* ---- blocks: feed-forward -------------------------------------------------- */

typedef struct glu_job {
    es_context * ctx;
    int32_t      act;
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
        if (job->act == ES_FFN_GELU) {
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
    if (act == ES_FFN_GELU) pthread_once(&gelu_table_once, gelu_table_build);
    glu_job job = { .ctx = ctx, .act = act, .n_ff = L->ffn_gate.n_out };
    run(ctx, glu_rows, &job, ctx->n);
    const es_weight * down = &L->ffn_down;
    return es__matmul(ctx, 1, &down, ctx->ff_gate, &ctx->out, ctx->n);
}

/* ---- es_decode -------------------------------------------------------------- */

// Positions and visibility: token i sits at its parent's position + 1 and
// sees its ancestors in the batch and itself.
static int plan_batch(es_context * ctx, const int32_t * parents, int32_t n) {
    const int32_t base = ctx->n_past > 0 ? ctx->cell_pos[ctx->n_past - 1] + 1 : 0;
    const size_t B = (size_t) ctx->n_batch;
    for (int32_t i = 0; i < n; i++) {
        const int32_t par = parents ? parents[i] : i - 1;
        if (par < -1 || par >= i) return ES_ERR_INVALID_ARG;
        uint8_t * row = ctx->sees + (size_t) i * B;
        if (par < 0) {
            memset(row, 0, (size_t) n);
            ctx->pos[i] = base;
        } else {
            memcpy(row, ctx->sees + (size_t) par * B, (size_t) n);
            ctx->pos[i] = ctx->pos[par] + 1;
        }
        row[i] = 1;
    }
    for (int32_t i = 0; i < n; i++) ctx->cell_pos[ctx->n_past + i] = ctx->pos[i];
    return ES_OK;
}

// Room for rows logits rows; the buffer grows on demand (a vocabulary of
// 262k makes n_batch rows a gigabyte).
static int reserve_logits(es_context * ctx, int32_t rows) {
    const size_t need = (size_t) rows * (size_t) ctx->model->n_vocab;
    if (need <= ctx->logits_cap) return ES_OK;
    float * l = alloc_lines(need * sizeof *l);
    if (!l) return ES_ERR_NO_MEMORY;
    free(ctx->logits);
    ctx->logits = l;
    ctx->logits_cap = need;
    return ES_OK;
}

int es_decode(es_context * ctx, const es_token * tokens, const int32_t * parents, int32_t n,
              int32_t logits_from) {
    if (!ctx || !tokens || n <= 0 || n > ctx->n_batch || logits_from < 0 || logits_from > n) {
        return ES_ERR_INVALID_ARG;
    }
    const es_model * m = ctx->model;
    for (int32_t i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= m->n_vocab) return ES_ERR_INVALID_ARG;
    }
    if (ctx->n_past + n > ctx->n_ctx) return ES_ERR_CONTEXT_FULL;
    int rc = plan_batch(ctx, parents, n);
    if (rc == ES_OK && !ctx->embeddings) rc = reserve_logits(ctx, n - logits_from);
    if (rc != ES_OK) return rc;
    ctx->n = n;
    ctx->n_embd_rows = 0;

    // Token embeddings.
    const int64_t D = m->n_embd;
    const size_t emb_row = es_type_row_bytes(m->tok_embd.type, D);
    for (int32_t t = 0; t < n; t++) {
        float * x = ctx->x + (size_t) t * D;
        es_dequantize_row(m->tok_embd.type, (const uint8_t *) m->tok_embd.data +
                          (size_t) tokens[t] * emb_row, x, D);
        if (m->embd_scale != 1.0f) for (int64_t i = 0; i < D; i++) x[i] *= m->embd_scale;
    }
    for (int32_t il = 0; il < m->n_layer; il++) {
        rc = m->arch->layer(ctx, il);
        if (rc != ES_OK) { ctx->n = 0; return rc; }
    }

    // Output rows: final norm, then the vocabulary projection (hidden states
    // for embeddings stop at the norm).
    const int32_t rows = n - logits_from;
    float * xo = ctx->x + (size_t) logits_from * D;
    es__rms_norm(xo, &m->output_norm, ctx->xn, rows, D, m->norm_eps);
    if (ctx->embeddings) {
        ctx->n_embd_rows = rows;
        ctx->n_past += n;
        ctx->n = 0;
        return ES_OK;
    }
    // The kept rows of a restricted output layer (es_model_set_output_rows)
    // go to ctx->kept and are spread out, the others -infinity.
    const bool restricted = m->n_output_rows > 0;
    const es_weight * out_w = restricted ? &m->output_rows : &m->output;
    const int64_t width = restricted ? m->n_output_rows : m->n_vocab;
    if (restricted && (size_t) rows * (size_t) width > ctx->kept_cap) {
        float * k = malloc((size_t) rows * (size_t) width * sizeof *k);
        if (!k) { ctx->n = 0; return ES_ERR_NO_MEMORY; }
        free(ctx->kept);
        ctx->kept = k;
        ctx->kept_cap = (size_t) rows * (size_t) width;
    }
    float * out = restricted ? ctx->kept : ctx->logits;
    rc = es__matmul(ctx, 1, &out_w, ctx->xn, &out, rows);
    if (rc != ES_OK) { ctx->n = 0; return rc; }
    if (m->final_softcap > 0.0f) {
        const float c = m->final_softcap, inv = 1.0f / c;
        const size_t nl = (size_t) rows * (size_t) width;
        for (size_t i = 0; i < nl; i++) out[i] = tanhf(out[i] * inv) * c;
    }
    for (int32_t r = 0; restricted && r < rows; r++) {
        float * row = ctx->logits + (size_t) r * (size_t) m->n_vocab;
        for (int64_t i = 0; i < m->n_vocab; i++) row[i] = -INFINITY;
        for (int64_t i = 0; i < width; i++) row[m->output_ids[i]] = ctx->kept[(size_t) r * (size_t) width + i];
    }

    ctx->n_past += n;
    ctx->n = 0;
    return ES_OK;
}
