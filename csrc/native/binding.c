/*
 * binding.c — what an architecture's loader (arch/<name>.c) binds with: its
 * tensor table's rows resolved against the file's hyperparameters and bound
 * as es_weight views into the mapping, hyperparameter keys read and checked,
 * and the error text every loading step writes (es__set_err).
 */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "native/native_internal.h"

void es__set_err(char * err, size_t err_cap, const char * fmt, ...) {
    if (!err || err_cap == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_cap, fmt, ap);
    va_end(ap);
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
        es__set_err(err, err_cap, "tensor %s is missing (a variant the native engine does not read)", name);
        return ES_ERR_UNSUPPORTED;
    }
    const int64_t want_out = n_out > 0 ? n_out : t->ne[1];
    if (t->ne[0] != n_in || t->ne[1] != want_out || t->ne[2] != 1 || t->ne[3] != 1) {
        es__set_err(err, err_cap, "tensor %s has shape (%lld, %lld, %lld, %lld), expected (%lld, %lld)",
                name, (long long) t->ne[0], (long long) t->ne[1], (long long) t->ne[2],
                (long long) t->ne[3], (long long) n_in, (long long) want_out);
        return ES_ERR_FORMAT;
    }
    if (es_type_row_bytes(t->type, n_in) == 0 || es_act_type(t->type) < 0) {
        es__set_err(err, err_cap, "tensor %s: weight type %s is not supported", name,
                es_type_name(t->type));
        return ES_ERR_UNSUPPORTED;
    }
    // Norm and bias vectors are read as floats directly.
    if (want_out == 1 && t->type != ES_TYPE_F32) {
        es__set_err(err, err_cap, "tensor %s: expected F32, found %s", name, es_type_name(t->type));
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

// Binds m->arch's table rows that apply (globals: the global rows too).
static int bind_rows(es_model * m, bool experts, bool globals, char * err, size_t err_cap) {
    int64_t size[ES_DIM_COUNT];
    model_dims(m, size);
    int rc = ES_OK;
    for (int32_t r = 0; rc == ES_OK && r < m->arch->n_tensors; r++) {
        const es_arch_row * row = &m->arch->tensors[r];
        const es_tensor_spec * sp = &row->spec;
        if (row->field == ES_UNBOUND || !row_applies(sp->flags, experts) ||
            (!globals && !(sp->flags & ES_TENSOR_LAYER))) continue;
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
                    es__set_err(err, err_cap, "tensor %s: a fused attention projection is not read by the "
                            "native engine", fused);
                    return ES_ERR_UNSUPPORTED;
                }
                required = true;
            }
            char * base = sp->flags & ES_TENSOR_LAYER ? (char *) &m->layers[il] : (char *) m;
            rc = bind_tensor(m, name, n_in, n_out, required, (es_weight *) (base + row->field), err, err_cap);
        }
    }
    return rc;
}

int es__bind_tensors(es_model * m, bool experts, char * err, size_t err_cap) {
    const es_tensor * embd = es_gguf_find_tensor(m->gguf, "token_embd.weight");
    if (!embd) {
        es__set_err(err, err_cap, "tensor token_embd.weight is missing");
        return ES_ERR_FORMAT;
    }
    m->n_vocab = (int32_t) embd->ne[1];
    const int rc = bind_rows(m, experts, true, err, err_cap);
    if (rc == ES_OK && !m->output.data) m->output = m->tok_embd;  // tied embeddings
    return rc;
}

int es__bind_layers(es_model * m, char * err, size_t err_cap) {
    return bind_rows(m, false, false, err, err_cap);
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
    es__set_err(err, err_cap, "metadata key %s is missing", full);
    return ES_ERR_FORMAT;
}

int es__key_i32(const es_model * m, const char * key, bool required, int32_t * out,
                char * err, size_t err_cap) {
    double v;
    const int rc = key_num(m, key, required, &v, err, err_cap);
    if (rc <= 0) return rc;
    if (v != floor(v) || v < 0 || v > (double) INT32_MAX) {
        es__set_err(err, err_cap, "metadata key %s.%s = %g is out of range", m->arch->name, key, v);
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
        es__set_err(err, err_cap, "metadata key %s.%s is not finite", m->arch->name, key);
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
        es__set_err(err, err_cap, "RoPE scaling '%.32s' is not supported", type);
        return ES_ERR_UNSUPPORTED;
    }
    float factor = 0.0f;
    int rc = es__key_f32(m, "rope.scaling.factor", false, &factor, err, err_cap);
    if (rc == ES_OK && factor == 0.0f) rc = es__key_f32(m, "rope.scale_linear", false, &factor, err, err_cap);
    if (rc == ES_OK && factor < 0.0f) {
        es__set_err(err, err_cap, "RoPE scaling factor %g is negative", factor);
        rc = ES_ERR_FORMAT;
    }
    if (factor > 0.0f) *scale = 1.0f / factor;
    return rc;
}

// Which layers slide under ES_SWA_PATTERN: the flags of
// attention.sliding_window_pattern (GGUF bool, uint8 or int32 elements, one
// per layer), or its period p (default 6).
static int swa_pattern(es_model * m, char * err, size_t err_cap) {
    char key[96];
    snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", m->arch->name);
    int32_t elem;
    uint64_t count;
    const void * data;
    if (es_gguf_get_arr(m->gguf, key, &elem, &count, &data)) {
        const size_t width = elem == 7 || elem == 0 || elem == 1 ? 1 : elem == 4 || elem == 5 ? 4 : 0;
        if (width == 0 || count != (uint64_t) m->n_layer) {
            es__set_err(err, err_cap, "metadata key %s: expected %d flags", key, (int) m->n_layer);
            return ES_ERR_FORMAT;
        }
        for (int32_t il = 0; il < m->n_layer; il++) {
            int32_t v = 0;
            memcpy(&v, (const uint8_t *) data + (size_t) il * width, width);
            m->layers[il].traits.swa = v != 0;
        }
        return ES_OK;
    }
    int32_t p = 6;
    const int rc = es__key_i32(m, "attention.sliding_window_pattern", false, &p, err, err_cap);
    for (int32_t il = 0; rc == ES_OK && il < m->n_layer; il++) {
        m->layers[il].traits.swa = p == 0 || il % p < p - 1;
    }
    return rc;
}

// m->arch's traits resolved by the file's keys (m's attention hyperparameters
// read): m->traits and every layer's (m->layers allocated).
static int resolve_traits(es_model * m, float rope_base, float rope_scale, char * err, size_t err_cap) {
    const es_arch_traits * a = &m->arch->traits;
    es_model_traits * t = &m->traits;
    *t = (es_model_traits) {
        .arch = *a, .n_layer = m->n_layer,
        .embd_scale = a->embd_scale ? sqrtf((float) m->n_embd) : 1.0f,
        .attn_scale = 1.0f / sqrtf((float) m->head_dim),
    };
    // Gemma 3 27B scales queries by 1/sqrt(n_embd / n_head) (llama.cpp tells
    // it by its 62 layers).
    if (a->attn_scale == ES_ATTN_SCALE_Q_GEMMA3 && m->n_layer == 62) {
        t->attn_scale = 1.0f / sqrtf((float) (m->n_embd / m->n_head));
    }
    m->layers = calloc((size_t) m->n_layer, sizeof *m->layers);
    if (!m->layers) return ES_ERR_NO_MEMORY;
    for (int32_t il = 0; il < m->n_layer; il++) {
        m->layers[il].traits = (es_layer_traits) {.rope_base = rope_base, .rope_scale = rope_scale};
    }
    int rc = ES_OK;
    float rope_base_swa = 10000.0f;
#define TRY(call) do { if (rc == ES_OK) rc = (call); } while (0)
    if (a->final_softcap) TRY(es__key_f32(m, "final_logit_softcapping", false, &t->final_softcap, err, err_cap));
    if (a->swa == ES_SWA_PATTERN) {
        TRY(es__key_i32(m, "attention.sliding_window", false, &t->n_swa, err, err_cap));
        TRY(es__key_f32(m, "rope.freq_base_swa", false, &rope_base_swa, err, err_cap));
        if (t->n_swa > 0) TRY(swa_pattern(m, err, err_cap));
    }
#undef TRY
    for (int32_t il = 0; rc == ES_OK && il < m->n_layer; il++) {
        es_layer_traits * L = &m->layers[il].traits;
        if (L->swa) *L = (es_layer_traits) {.swa = true, .rope_base = rope_base_swa, .rope_scale = 1.0f};
    }
    return rc;
}

// The attention hyperparameters every architecture here shares, read and
// checked once: widths, heads, head size (key = value = RoPE dimensions),
// training context, norm epsilon, RoPE base (default 10000) and linear
// scale; then the traits they resolve.
int es__load_decoder_hparams(es_model * m, char * err, size_t err_cap) {
    int rc = ES_OK;
    float rope_base = 10000.0f, rope_scale = 1.0f;
#define TRY(call) do { if (rc == ES_OK) rc = (call); } while (0)
    TRY(es__key_i32(m, "embedding_length", true, &m->n_embd, err, err_cap));
    TRY(es__key_i32(m, "block_count", true, &m->n_layer, err, err_cap));
    TRY(es__key_i32(m, "attention.head_count", true, &m->n_head, err, err_cap));
    TRY(es__key_i32(m, "attention.head_count_kv", false, &m->n_head_kv, err, err_cap));
    TRY(es__key_i32(m, "attention.key_length", false, &m->head_dim, err, err_cap));
    TRY(es__key_i32(m, "rope.dimension_count", false, &m->n_rot, err, err_cap));
    TRY(es__key_i32(m, "context_length", false, &m->n_ctx_train, err, err_cap));
    TRY(es__key_f32(m, "attention.layer_norm_rms_epsilon", true, &m->norm_eps, err, err_cap));
    TRY(es__key_f32(m, "rope.freq_base", false, &rope_base, err, err_cap));
    TRY(es__rope_freq_scale(m, &rope_scale, err, err_cap));
    if (rc != ES_OK) return rc;
    if (m->n_head <= 0 || m->n_embd <= 0 || m->n_layer <= 0 || m->n_layer > 4096) {
        es__set_err(err, err_cap, "bad hyperparameters: n_embd %d, n_layer %d, n_head %d",
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
        es__set_err(err, err_cap, "key length %d, value length %d and RoPE dimensions %d differ",
                (int) m->head_dim, (int) v_len, (int) m->n_rot);
        return ES_ERR_UNSUPPORTED;
    }
    return resolve_traits(m, rope_base, rope_scale, err, err_cap);
}

int es__load_dense(es_model * m, char * err, size_t err_cap) {
    int rc = es__load_decoder_hparams(m, err, err_cap);
    if (rc == ES_OK) rc = es__key_i32(m, "feed_forward_length", true, &m->n_ff, err, err_cap);
    if (rc == ES_OK) rc = es__bind_tensors(m, false, err, err_cap);
    return rc;
}
