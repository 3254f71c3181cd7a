/*
 * model.c — the native engine's model and context: es_model (the GGUF mapped
 * and validated by gguf.c and validate.c, its architecture found by
 * general.architecture in es__archs, its tensors bound by arch->load through
 * binding.c, its matrices repacked for the tile kernels), es_context (thread
 * pool, KV cache (F16 or Q8_0) and its saved state, batch buffers, logits), and
 * es_decode: positions and visibility of a chain or tree batch, embeddings,
 * arch->layer for every layer (built of blocks.c's blocks), final norm,
 * output matmul.
 */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE  // madvise's MADV_HUGEPAGE (glibc: not POSIX)

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "native/native_internal.h"

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
            es__set_err(err, err_cap, "tensor %s is not used by the %s architecture of this engine "
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
        m->n_rot <= 0 || m->n_rot > m->head_dim || m->n_rot % 2 != 0 || m->traits.n_swa < 0 ||
        !(m->norm_eps > 0) || m->n_layer > 4096 || m->n_head > 4096 || m->head_dim > 4096) {
        es__set_err(err, err_cap, "bad hyperparameters: n_embd %d, n_layer %d, n_head %d, "
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

// Every weight's type, shape and repacked bytes, each type's group size
// (the block layouts) and the engine's version: what a repack cache file
// must have been written for.
static uint64_t packed_layout(const es_model * m, const es_weight * const * ws, int32_t nw) {
    uint64_t h = es__fnv1a(ES_FNV_OFFSET, ES_VERSION, strlen(ES_VERSION));
    for (int32_t t = 0; t <= ES_TYPE_BF16; t++) {
        const size_t group = es_repack_bytes(t, 256 * 32, ES_GROUP_ROWS);  // a width every type divides
        h = es__fnv1a(h, &group, sizeof group);
    }
    for (int32_t j = 0; j < nw; j++) {
        const int64_t w[4] = { ws[j]->type, ws[j]->n_in, ws[j]->n_out,
                               repacks(m, ws[j]) ? (int64_t) es_repack_bytes(ws[j]->type, ws[j]->n_in, ws[j]->n_out) : 0 };
        h = es__fnv1a(h, w, sizeof w);
    }
    return h;
}

// Points each repacked weight at its part of base, in model_weights order.
static void bind_packed(es_model * m, const es_weight * const * ws, int32_t nw, const uint8_t * base) {
    size_t at = 0;
    for (int32_t j = 0; j < nw; j++) {
        if (!repacks(m, ws[j])) continue;
        ((es_weight *) ws[j])->packed = base + at;  // m's own, as model_weights lists them
        at += es_repack_bytes(ws[j]->type, ws[j]->n_in, ws[j]->n_out);
    }
}

// The repack cache file of this layout: p->repack_cache followed by the
// layout's 16 hex digits and ".pack" (malloc'd; NULL where memory ran out).
static char * packed_file_name(const char * prefix, uint64_t layout) {
    const size_t n = strlen(prefix) + 16 + sizeof ".pack";
    char * name = malloc(n);
    if (name) snprintf(name, n, "%s%016llx.pack", prefix, (unsigned long long) layout);
    return name;
}

// Repacks the model's matrices into one allocation (m->packed), once the
// total is known to fit the budget, on a pool of one thread per CPU; a type
// without a repacked layout, or a remainder of rows, stays in the mapping
// only. With a repack cache (p->repack_cache and p->repack_secret, from
// path's GGUF) the weights are mapped from its file of this layout when it
// was written for this file and layout, and written to it after a repack
// otherwise (not where the file is foreign: see es_model_params).
static int repack_weights(es_model * m, const es_model_params * p, const char * path, char * err,
                          size_t err_cap) {
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
    const bool cached = p->repack_cache && p->repack_secret;
    const es_packed_key key = { .source = cached ? es__packed_source(m->gguf, path) : 0,
                                .layout = packed_layout(m, ws, nw), .bytes = total };
    if (key.source && total > 0) m->packed_file = packed_file_name(p->repack_cache, key.layout);
    const char * cache = m->packed_file;
    const void * mapped = NULL;
    const int found = cache ? es__packed_file_map(cache, &key, p->repack_secret, &mapped, &m->packed_map,
                                                  &m->packed_map_size)
                            : ES_ERR_IO;
    if (found == ES_OK) {
        bind_packed(m, ws, nw, mapped);
        // The checks at open read every block's scales: the source rows the
        // file now serves leave the process's resident memory, as a repack's do.
        for (int32_t j = 0; j < nw; j++) {
            if (!repacks(m, ws[j])) continue;
            const size_t packed_rows = (size_t) (ws[j]->n_out / ES_GROUP_ROWS * ES_GROUP_ROWS);
            es_gguf_release(m->gguf, ws[j]->data, packed_rows * es_type_row_bytes(ws[j]->type, ws[j]->n_in));
        }
        m->packed_from = ES_PACKED_MAPPED;
        free(ws);
        return ES_OK;
    }
    if (found == ES_PACKED_FILE_FOREIGN) cache = NULL;   // left as it is: repacked in memory
    const int64_t budget = p->repack_max_bytes > 0 ? p->repack_max_bytes : available_memory();
    int rc = ES_OK;
    if (total > 0 && budget >= 0 && (double) total > (double) budget) {
        es__set_err(err, err_cap, "repacking the weights needs %.1f MiB and %.1f MiB %s (repacking off: "
                "es_model_params.repack = false, EDGESPEC_REPACK=0)", (double) total / 1048576.0,
                (double) budget / 1048576.0, p->repack_max_bytes > 0 ? "are allowed" : "are available");
        rc = ES_ERR_NO_MEMORY;
    } else if (total > 0) {
        uint8_t * dst = NULL;
        es_packed_writer writer = { .fd = -1 };
        const bool writing = cache && es__packed_file_begin(cache, total, &writer, &dst) == ES_OK;
        if (!writing) {
            // In 2 MiB pages where the system gives them (Linux: transparent
            // huge pages on request): 512 times fewer page faults while
            // repacking and TLB misses while the weights stream by.
            void * packed = NULL;
            rc = posix_memalign(&packed, HUGE_PAGE, total) == 0 ? ES_OK : ES_ERR_NO_MEMORY;
#if defined(MADV_HUGEPAGE)
            if (rc == ES_OK) madvise(packed, total, MADV_HUGEPAGE);
#endif
            m->packed = dst = packed;
        }
        repack_job job = { .gguf = m->gguf, .tasks = malloc((size_t) n_tasks * sizeof *job.tasks) };
        if (!job.tasks) rc = ES_ERR_NO_MEMORY;
        if (rc == ES_OK) bind_packed(m, ws, nw, dst);
        for (int32_t j = 0; j < nw && rc == ES_OK; j++) {
            if (!repacks(m, ws[j])) continue;
            const size_t gb = es_repack_bytes(ws[j]->type, ws[j]->n_in, ES_GROUP_ROWS);
            const int64_t n_groups = (int64_t) (es_repack_bytes(ws[j]->type, ws[j]->n_in, ws[j]->n_out) / gb);
            const int64_t per = (int64_t) (REPACK_TASK_BYTES / gb) > 0 ? (int64_t) (REPACK_TASK_BYTES / gb) : 1;
            for (int64_t g = 0; g < n_groups; g += per) {
                job.tasks[job.n_tasks++] = (repack_task) {
                    .w = ws[j], .g0 = g, .g1 = g + per < n_groups ? g + per : n_groups,
                    .dst = (uint8_t *) ws[j]->packed};
            }
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
        if (writing && rc != ES_OK) {
            es__packed_file_abandon(&writer);
        } else if (writing) {
            m->packed_from = es__packed_file_commit(&writer, cache, &key, p->repack_secret) == ES_OK
                                 ? ES_PACKED_WRITTEN : ES_PACKED_REPACKED;
            m->packed_map = writer.map, m->packed_map_size = writer.size;
        } else if (rc == ES_OK) {
            m->packed_from = found == ES_PACKED_FILE_FOREIGN ? ES_PACKED_FOREIGN : ES_PACKED_REPACKED;
        }
    }
    free(ws);
    return rc;
}

es_model_params es_model_default_params(void) {
    return (es_model_params) {
        .experts = ES_EXPERTS_MAPPED, .expert_cache_bytes = 0,
        .expert_precision = ES_PRECISION_EXACT, .expert_policy = ES_POLICY_ADAPTIVE,
        .prefetch_depth = 3, .expert_sidecar = NULL, .repack_max_bytes = 0, .repack = true,
        .repack_cache = NULL, .repack_secret = NULL,
    };
}

int es_model_load(const char * path, const es_model_params * params, es_model ** out,
                  char * err, size_t err_cap) {
    if (err && err_cap) err[0] = '\0';
    if (out) *out = NULL;
    if (!path || !out) {
        es__set_err(err, err_cap, "no path given");
        return ES_ERR_INVALID_ARG;
    }
    const es_model_params p = params ? *params : es_model_default_params();
    if (p.experts != ES_EXPERTS_MAPPED && p.experts != ES_EXPERTS_F32) {
        es__set_err(err, err_cap, "unknown experts mode %d", (int) p.experts);
        return ES_ERR_INVALID_ARG;
    }
    if (p.expert_cache_bytes < 0 || (p.expert_cache_bytes > 0 && p.experts != ES_EXPERTS_MAPPED)) {
        es__set_err(err, err_cap, "an expert cache of %lld bytes with experts mode %d: the cache "
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
        es__set_err(err, err_cap, "metadata key general.architecture is missing");
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
        es__set_err(err, err_cap, "architecture '%.64s' is not supported by the native engine "
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
    if (rc == ES_OK && p.repack) rc = repack_weights(m, &p, path, err, err_cap);
    m->params.repack_cache = NULL;  // the caller's string and secret: read at load only
    m->params.repack_secret = NULL;
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
    if (m->packed_map) munmap(m->packed_map, m->packed_map_size);
    free(m->packed_file);
    free(m->layers);
    es_gguf_close(m->gguf);
    free(m);
}

const char * es_model_arch(const es_model * m) { return m && m->arch ? m->arch->name : ""; }
int32_t es_model_n_vocab(const es_model * m) { return m ? m->n_vocab : 0; }
int32_t es_model_n_ctx_train(const es_model * m) { return m ? m->n_ctx_train : 0; }
int32_t es_model_n_embd(const es_model * m) { return m ? m->n_embd : 0; }
int32_t es_model_packed_from(const es_model * m) { return m ? m->packed_from : ES_PACKED_NONE; }
const char * es_model_packed_file(const es_model * m) { return m && m->packed_file ? m->packed_file : ""; }

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
    return (es_context_params) { .n_ctx = 4096, .n_batch = 512, .n_threads = 0,
                                 .type_k = ES_TYPE_F16, .type_v = ES_TYPE_F16, .embeddings = false };
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

static int32_t threads_or_cpus(int32_t n_threads) {
    if (n_threads > 0) return n_threads;
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int32_t) (n < 256 ? n : 256) : 1;
}

// A context of n_batch token rows; with_kv: its own KV cache of n_ctx cells
// with keys of type_k and values of type_v (an es_context), else none (a
// group's work context, whose n_ctx only sizes the attention scratch: the
// longest member cache it can read).
static int context_new(es_model * m, int32_t n_ctx, int32_t n_batch, int32_t n_threads,
                       int32_t type_k, int32_t type_v, bool embeddings, bool with_kv, es_context ** out) {
    es_context * c = calloc(1, sizeof *c);
    if (!c) return ES_ERR_NO_MEMORY;
    c->model = m;
    c->n_ctx = n_ctx;
    c->n_batch = n_batch;
    c->n_threads = n_threads;
    c->embeddings = embeddings;
    c->type_k = type_k;
    c->type_v = type_v;
    c->k_row = es_type_row_bytes(type_k, m->head_dim);
    c->v_row = es_type_row_bytes(type_v, m->head_dim);
    int rc = es_pool_init(n_threads, &c->pool);
    if (rc == ES_OK && m->experts) rc = es_moe_init(m->experts, n_batch, &c->moe);
    if (rc != ES_OK) { es_context_free(c); return rc; }

    const size_t B = (size_t) n_batch, D = (size_t) m->n_embd, HD = (size_t) m->head_dim;
    // The cache is the one allocation a large n_ctx could make overflow size_t.
    if ((double) m->n_layer * m->n_head_kv * n_ctx * (double) HD > (double) (SIZE_MAX / 8) ||
        (double) B * (double) B > (double) (SIZE_MAX / 8)) {
        es_context_free(c);
        return ES_ERR_NO_MEMORY;
    }
    const size_t cells = with_kv ? (size_t) m->n_layer * (size_t) m->n_head_kv * (size_t) n_ctx : 0;
    const size_t ff = m->n_ff > 0 ? (size_t) m->n_ff : 1;
    c->act_row  = widest_act_row(m);
    if (with_kv) {
        c->k_cache  = calloc(cells, c->k_row);
        c->v_cache  = calloc(cells, c->v_row);
        c->cell_pos = calloc((size_t) n_ctx, sizeof *c->cell_pos);
    }
    c->seqs     = malloc(B * sizeof *c->seqs);
    c->row_seq  = malloc(B * sizeof *c->row_seq);
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
    if (!c->act_row || (with_kv && (!c->k_cache || !c->v_cache || !c->cell_pos)) || !c->seqs ||
        !c->row_seq || !c->pos || !c->sees ||
        !c->x || !c->xn || !c->q || !c->k || !c->v || !c->att || !c->ff_gate || !c->ff_up ||
        !c->out || !c->act || !c->scratch) {
        es_context_free(c);
        return ES_ERR_NO_MEMORY;
    }
    *out = c;
    return ES_OK;
}

int es_context_init(es_model * m, const es_context_params * params, es_context ** out) {
    if (!m || !out) return ES_ERR_INVALID_ARG;
    *out = NULL;
    const es_context_params p = params ? *params : es_context_default_params();
    int32_t n_ctx = p.n_ctx > 0 ? p.n_ctx : m->n_ctx_train;
    if (n_ctx <= 0 || p.n_batch <= 0) return ES_ERR_INVALID_ARG;
    for (int i = 0; i < 2; i++) {
        const int32_t type = i == 0 ? p.type_k : p.type_v;
        if (type != ES_TYPE_F16 && type != ES_TYPE_Q8_0) return ES_ERR_INVALID_ARG;
        if (es_type_row_bytes(type, m->head_dim) == 0) return ES_ERR_UNSUPPORTED;  // head_dim % 32
    }
    const int32_t n_batch = p.n_batch < n_ctx ? p.n_batch : n_ctx;
    return context_new(m, n_ctx, n_batch, threads_or_cpus(p.n_threads), p.type_k, p.type_v, p.embeddings,
                       true, out);
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
    free(c->row_seq);
    free(c->seqs);
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
size_t es_context_kv_cell_bytes(const es_context * c) {
    return c ? (size_t) c->model->n_layer * (size_t) c->model->n_head_kv * (c->k_row + c->v_row) : 0;
}
const float * es_context_logits(const es_context * c) { return c ? c->logits : NULL; }
const float * es_context_embeddings(const es_context * c) {
    return c && (c->embeddings || c->features) && c->n_embd_rows > 0 ? c->xn : NULL;
}
void es_context_keep_features(es_context * c, bool on) {
    if (c) c->features = on;
}

int es_context_truncate(es_context * c, int32_t n_keep) {
    if (!c || n_keep < 0 || n_keep > c->n_past) return ES_ERR_INVALID_ARG;
    c->n_past = n_keep;
    return ES_OK;
}

/* ---- the KV cache's state: save and restore a slot ------------------------ */

// The state of n cells: the cache's types (int32 type_k, type_v), then per
// layer and KV head the n keys (k_row bytes each), per layer and KV head the
// n values (v_row bytes each), then the n cells' positions (int32).
#define STATE_HEAD (2 * sizeof(int32_t))

static size_t state_bytes(const es_context * c, int32_t n) {
    return STATE_HEAD + (size_t) n * (es_context_kv_cell_bytes(c) + sizeof(int32_t));
}

size_t es_context_state_size(const es_context * c) {
    return c ? state_bytes(c, c->n_past) : 0;
}

// Copies (or, with set, fills) the n cells' rows of every (layer, head)
// block of the cache, whose row stride is n_ctx cells; buf after the types.
static void state_copy(es_context * c, uint8_t * buf, int32_t n, bool set) {
    const es_model * m = c->model;
    for (int pass = 0; pass < 2; pass++) {
        uint8_t * cache = pass == 0 ? c->k_cache : c->v_cache;
        const size_t row = pass == 0 ? c->k_row : c->v_row, block = (size_t) n * row;
        for (int64_t b = 0; b < (int64_t) m->n_layer * m->n_head_kv; b++) {
            uint8_t * at = cache + (size_t) b * c->n_ctx * row;
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
    const int32_t types[2] = { c->type_k, c->type_v };
    memcpy(buf, types, STATE_HEAD);
    state_copy(c, (uint8_t *) buf + STATE_HEAD, c->n_past, false);
    return ES_OK;
}

int es_context_state_set(es_context * c, const void * buf, size_t size, int32_t n_past) {
    if (!c || !buf || c->embeddings || n_past < 0 || n_past > c->n_ctx || size != state_bytes(c, n_past))
        return ES_ERR_INVALID_ARG;
    int32_t types[2];
    memcpy(types, buf, STATE_HEAD);
    if (types[0] != c->type_k || types[1] != c->type_v) return ES_ERR_INVALID_ARG;
    for (int32_t i = 0; i < n_past; i++) {   // a cell's position is at most its index (a chain: equal)
        int32_t pos;
        memcpy(&pos, (const uint8_t *) buf + size - (size_t) (n_past - i) * sizeof(int32_t), sizeof pos);
        if (pos < 0 || pos > i) return ES_ERR_INVALID_ARG;
    }
    state_copy(c, (uint8_t *) buf + STATE_HEAD, n_past, true);
    c->n_past = n_past;
    return ES_OK;
}

/* ---- es_decode, es_decode_group ------------------------------------------ */

// Positions and visibility of sequence s of w's batch: its token i sits at its
// parent's position + 1 (the first at its cache's next position) and sees its
// ancestors in the sequence and itself. Writes the cells' positions in s->kv.
static int plan_seq(es_context * w, const es_seq_rows * s, const int32_t * parents) {
    es_context * kv = s->kv;
    const int32_t base = kv->n_past > 0 ? kv->cell_pos[kv->n_past - 1] + 1 : 0;
    const size_t B = (size_t) w->n_batch;
    for (int32_t i = 0; i < s->n; i++) {
        const int32_t par = parents ? parents[i] : i - 1;
        if (par < -1 || par >= i) return ES_ERR_INVALID_ARG;
        const int32_t r = s->r0 + i;
        uint8_t * row = w->sees + (size_t) r * B;   // (s->n) columns: the sequence's tokens
        if (par < 0) {
            memset(row, 0, (size_t) s->n);
            w->pos[r] = base;
        } else {
            memcpy(row, w->sees + (size_t) (s->r0 + par) * B, (size_t) s->n);
            w->pos[r] = w->pos[s->r0 + par] + 1;
        }
        row[i] = 1;
        w->row_seq[r] = (int32_t) (s - w->seqs);
    }
    for (int32_t i = 0; i < s->n; i++) kv->cell_pos[kv->n_past + i] = w->pos[s->r0 + i];
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

// The vocabulary projection of w->xn's first rows rows into w->logits
// (reserved here), soft-capped where the model says. The kept rows of a
// restricted output layer (es_model_set_output_rows) go to w->kept and are
// spread out, the others -infinity.
int es__output_logits(es_context * w, int32_t rows) {
    const es_model * m = w->model;
    int rc = reserve_logits(w, rows);
    if (rc != ES_OK) return rc;
    const bool restricted = m->n_output_rows > 0;
    const es_weight * out_w = restricted ? &m->output_rows : &m->output;
    const int64_t width = restricted ? m->n_output_rows : m->n_vocab;
    if (restricted && (size_t) rows * (size_t) width > w->kept_cap) {
        float * k = malloc((size_t) rows * (size_t) width * sizeof *k);
        if (!k) return ES_ERR_NO_MEMORY;
        free(w->kept);
        w->kept = k;
        w->kept_cap = (size_t) rows * (size_t) width;
    }
    float * out = restricted ? w->kept : w->logits;
    rc = es__matmul(w, 1, &out_w, w->xn, &out, rows);
    if (rc != ES_OK) return rc;
    if (m->traits.final_softcap > 0.0f) {
        const float c = m->traits.final_softcap, inv = 1.0f / c;
        const size_t nl = (size_t) rows * (size_t) width;
        for (size_t i = 0; i < nl; i++) out[i] = tanhf(out[i] * inv) * c;
    }
    for (int32_t r = 0; restricted && r < rows; r++) {
        float * row = w->logits + (size_t) r * (size_t) m->n_vocab;
        for (int64_t i = 0; i < m->n_vocab; i++) row[i] = -INFINITY;
        for (int64_t i = 0; i < width; i++) row[m->output_ids[i]] = w->kept[(size_t) r * (size_t) width + i];
    }
    return ES_OK;
}

// Evaluates the batch planned in w (w->n rows in w->n_seqs sequences, the
// logits buffer reserved): embeddings, every layer, then the final norm of
// each sequence's kept rows and (without embeddings) their vocabulary
// projection into w->logits, the sequences' rows one after another. Each
// sequence's cache then holds its tokens; on error every cache is as before.
static int forward(es_context * w) {
    const es_model * m = w->model;
    const int64_t D = m->n_embd;
    const size_t emb_row = es_type_row_bytes(m->tok_embd.type, D);
    w->n_embd_rows = 0;

    // Token embeddings.
    for (int32_t s = 0; s < w->n_seqs; s++) {
        const es_seq_rows * seq = &w->seqs[s];
        for (int32_t i = 0; i < seq->n; i++) {
            float * x = w->x + (size_t) (seq->r0 + i) * D;
            es_dequantize_row(m->tok_embd.type, (const uint8_t *) m->tok_embd.data +
                              (size_t) seq->tokens[i] * emb_row, x, D);
            if (m->traits.embd_scale != 1.0f) for (int64_t k = 0; k < D; k++) x[k] *= m->traits.embd_scale;
        }
    }
    int rc = ES_OK;
    for (int32_t il = 0; il < m->n_layer && rc == ES_OK; il++) rc = m->arch->layer(w, il);
    if (rc != ES_OK) { w->n = 0; return rc; }

    // Output rows: the kept rows moved to the front of x (a row only ever
    // moves down, past rows already moved), final norm, then the vocabulary
    // projection (hidden states for embeddings stop at the norm). The normed
    // rows stay in xn (the projection only reads them): the features a
    // context keeps (es_context_keep_features).
    int32_t rows = 0;
    for (int32_t s = 0; s < w->n_seqs; s++) {
        const es_seq_rows * seq = &w->seqs[s];
        for (int32_t i = seq->keep_from; i < seq->n; i++, rows++) {
            const int32_t r = seq->r0 + i;
            if (r != rows) memmove(w->x + (size_t) rows * D, w->x + (size_t) r * D, (size_t) D * sizeof *w->x);
        }
    }
    es__rms_norm(w->x, &m->output_norm, w->xn, rows, D, m->norm_eps);
    w->n_embd_rows = rows;
    if (!w->embeddings) rc = es__output_logits(w, rows);
    if (rc != ES_OK) { w->n = 0; return rc; }
    for (int32_t s = 0; s < w->n_seqs; s++) w->seqs[s].kv->n_past += w->seqs[s].n;
    w->n = 0;
    return ES_OK;
}

static bool tokens_in_vocab(const es_model * m, const es_token * tokens, int32_t n) {
    for (int32_t i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= m->n_vocab) return false;
    }
    return true;
}

int es_decode(es_context * ctx, const es_token * tokens, const int32_t * parents, int32_t n,
              int32_t logits_from) {
    if (!ctx || !tokens || n <= 0 || n > ctx->n_batch || logits_from < 0 || logits_from > n ||
        !tokens_in_vocab(ctx->model, tokens, n)) {
        return ES_ERR_INVALID_ARG;
    }
    if (ctx->n_past + n > ctx->n_ctx) return ES_ERR_CONTEXT_FULL;
    // One sequence, the context's own.
    ctx->seqs[0] = (es_seq_rows) { .kv = ctx, .tokens = tokens, .r0 = 0, .n = n, .keep_from = logits_from };
    ctx->n_seqs = 1;
    int rc = plan_seq(ctx, &ctx->seqs[0], parents);
    if (rc == ES_OK && !ctx->embeddings) rc = reserve_logits(ctx, n - logits_from);
    if (rc != ES_OK) return rc;
    ctx->n = n;
    return forward(ctx);
}

/* ---- groups ------------------------------------------------------------------ */

struct es_group {
    es_context * work;   // owned: batch buffers, thread pool, the batch's logits; no KV cache
};

es_group_params es_group_default_params(void) {
    return (es_group_params) { .n_batch = 64, .n_ctx = 4096, .n_threads = 0 };
}

int es_group_init(es_model * m, const es_group_params * params, es_group ** out) {
    if (!m || !out) return ES_ERR_INVALID_ARG;
    *out = NULL;
    const es_group_params p = params ? *params : es_group_default_params();
    const int32_t n_ctx = p.n_ctx > 0 ? p.n_ctx : m->n_ctx_train;
    if (n_ctx <= 0 || p.n_batch <= 0) return ES_ERR_INVALID_ARG;
    es_group * g = calloc(1, sizeof *g);
    if (!g) return ES_ERR_NO_MEMORY;
    const int rc = context_new(m, n_ctx, p.n_batch, threads_or_cpus(p.n_threads), ES_TYPE_F16, ES_TYPE_F16,
                               false, false, &g->work);
    if (rc != ES_OK) {
        es_group_free(g);
        return rc;
    }
    *out = g;
    return ES_OK;
}

void es_group_free(es_group * g) {
    if (!g) return;
    es_context_free(g->work);
    free(g);
}

int32_t es_group_n_batch(const es_group * g) { return g ? g->work->n_batch : 0; }

// A member es_decode_group refuses with ES_ERR_INVALID_ARG: another model's
// context, an embeddings context, one longer than the group's n_ctx, a
// context given twice, bad tokens or logits_from, more kept rows than a
// context keeping features holds (its n_batch).
static bool member_ok(const es_group * g, const es_group_seq * seqs, int32_t i) {
    const es_group_seq * q = &seqs[i];
    const es_context * w = g->work;
    if (!q->ctx || q->ctx->model != w->model || q->ctx->embeddings || q->ctx->n_ctx > w->n_ctx ||
        !q->tokens || q->n <= 0 || q->logits_from < 0 || q->logits_from > q->n ||
        (q->ctx->features && q->n - q->logits_from > q->ctx->n_batch) ||
        !tokens_in_vocab(w->model, q->tokens, q->n)) {
        return false;
    }
    for (int32_t j = 0; j < i; j++) {
        if (seqs[j].ctx == q->ctx) return false;
    }
    return true;
}

int es_decode_group(es_group * g, const es_group_seq * seqs, int32_t n_seqs) {
    if (!g || !seqs || n_seqs <= 0 || n_seqs > g->work->n_batch) return ES_ERR_INVALID_ARG;
    es_context * w = g->work;
    int64_t total = 0;
    for (int32_t i = 0; i < n_seqs; i++) {
        if (!member_ok(g, seqs, i)) return ES_ERR_INVALID_ARG;
        total += seqs[i].n;
    }
    if (total > w->n_batch) return ES_ERR_INVALID_ARG;
    for (int32_t i = 0; i < n_seqs; i++) {
        if (seqs[i].ctx->n_past + seqs[i].n > seqs[i].ctx->n_ctx) return ES_ERR_CONTEXT_FULL;
    }
    // The members' rows one after another, each planned against its own
    // cache; room for every member's logits in its own context first.
    int32_t r0 = 0, rows = 0;
    int rc = ES_OK;
    w->n_seqs = n_seqs;
    for (int32_t i = 0; i < n_seqs && rc == ES_OK; i++) {
        const es_group_seq * q = &seqs[i];
        w->seqs[i] = (es_seq_rows) { .kv = q->ctx, .tokens = q->tokens, .r0 = r0, .n = q->n,
                                     .keep_from = q->logits_from };
        rc = plan_seq(w, &w->seqs[i], q->parents);
        if (rc == ES_OK) rc = reserve_logits(q->ctx, q->n - q->logits_from);
        r0 += q->n;
        rows += q->n - q->logits_from;
    }
    if (rc == ES_OK) rc = reserve_logits(w, rows);
    if (rc != ES_OK) return rc;
    w->n = r0;
    rc = forward(w);
    if (rc != ES_OK) return rc;
    // Each member's rows into its own context, where es_context_logits (and,
    // keeping features, es_context_embeddings) finds them as after its own
    // es_decode (the copy is a small fraction of the batch's work; a member's
    // rows then outlive the group's next decode).
    const size_t row = (size_t) w->model->n_vocab, D = (size_t) w->model->n_embd;
    rows = 0;
    for (int32_t i = 0; i < n_seqs; i++) {
        es_context * c = seqs[i].ctx;
        const int32_t kept = seqs[i].n - seqs[i].logits_from;
        if (kept > 0) memcpy(c->logits, w->logits + (size_t) rows * row, (size_t) kept * row * sizeof *w->logits);
        if (c->features && kept > 0) memcpy(c->xn, w->xn + (size_t) rows * D, (size_t) kept * D * sizeof *w->xn);
        c->n_embd_rows = c->features ? kept : 0;
        rows += kept;
    }
    return ES_OK;
}
