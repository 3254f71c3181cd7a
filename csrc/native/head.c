/*
 * head.c — draft heads (EAGLE-1): one decoder layer over the target's own
 * hidden states, drafting for it (es_native.h, "Draft heads").
 *
 * A head is a one-layer es_model of its own: its layer bound from the head
 * file by the target architecture's tensor table (es__bind_layers) and
 * computed by the target's layer code (arch->layer, es__decoder_layer), its
 * traits the target's, its token embeddings and output layer the target's
 * (borrowed: views into the target's mapping and repacked copy). An
 * es_context over it holds the head's KV cache (one layer) and batch
 * buffers; a decode is
 *
 *   e  = embed(t) (* the target's embedding scale)      (n, n_embd)
 *   x  = fc_feature · f + fc_token · e (+ fc.bias)       (n, n_embd)
 *   x  = layer(x)                                        the target's decoder layer
 *   logits = output · x  (the kept rows; soft-capped)    es__output_logits
 *
 * Every step is per row (blocks.c's batch invariance), so a row's results do
 * not depend on the batch it came in.
 */
#define _POSIX_C_SOURCE 200809L

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "native/native_internal.h"

#define HEAD_ARCH "eagle"
#define DIGEST_ROWS 64   // token embedding rows a target's digest samples

struct es_head {
    es_model   * target;      // borrowed
    es_model   * model;       // owned: the head as a one-layer model (its gguf, layer, kept output rows)
    es_arch      arch;        // the target's architecture, named HEAD_ARCH (keys read as eagle.*)
    es_context * ctx;         // owned: the head's KV cache, batch buffers, pool, logits
    es_weight    fc_feature;  // (n_embd, n_embd) over the target feature
    es_weight    fc_token;    // (n_embd, n_embd) over the next token's embedding
    es_weight    fc_bias;     // (n_embd) F32; data NULL: none
    float      * hidden;      // (n_batch, n_embd) the last decode's kept layer outputs
    int32_t      n_hidden;    // rows of hidden in use
};

es_head_params es_head_default_params(void) {
    return (es_head_params) { .n_ctx = 4096, .n_batch = 512, .n_threads = 0 };
}

uint64_t es_head_digest(uint64_t h, const char * name, const void * data, size_t n) {
    if (h == 0) h = ES_FNV_OFFSET;
    h = es__fnv1a(h, name, strlen(name) + 1);
    return es__fnv1a(h, data, n);
}

int es_head_target_digest(const es_gguf * g, uint64_t * out) {
    if (!g || !out) return ES_ERR_INVALID_ARG;
    const es_tensor * embd = es_gguf_find_tensor(g, "token_embd.weight");
    if (!embd) return ES_ERR_FORMAT;
    const char * arch = es_gguf_get_str(g, "general.architecture");
    char key[96];
    snprintf(key, sizeof key, "%s.block_count", arch ? arch : "");
    int64_t n_layer = 0;
    es_gguf_get_i64(g, key, &n_layer);
    const int64_t shape[4] = { embd->type, embd->ne[0], embd->ne[1], n_layer };
    uint64_t h = es__fnv1a(ES_FNV_OFFSET, shape, sizeof shape);
    // Rows spread over the vocabulary, whole (a row is a whole number of blocks).
    const size_t row = embd->nbytes / (size_t) embd->ne[1];
    for (int64_t i = 0; i < DIGEST_ROWS; i++) {
        const int64_t r = i * (embd->ne[1] - 1) / (DIGEST_ROWS - 1);
        h = es__fnv1a(h, (const uint8_t *) embd->data + (size_t) r * row, row);
    }
    // The token texts: each (u64 length, bytes), as the file holds them.
    uint64_t n = 0;
    const void * tokens = NULL;
    if (es_gguf_get_str_arr(g, "tokenizer.ggml.tokens", &n, &tokens)) {
        const uint8_t * p = tokens;
        for (uint64_t i = 0; i < n; i++) {
            uint64_t len;
            memcpy(&len, p, sizeof len);
            p += sizeof len + len;
        }
        h = es__fnv1a(h, tokens, (size_t) (p - (const uint8_t *) tokens));
    }
    *out = h;
    return ES_OK;
}

/* ---- loading ---------------------------------------------------------------- */

// "'name' (arch: n_vocab tokens, n_embd wide, n_layer layers)" of a target
// as the head file records it, or as the target is.
static void describe(char * buf, size_t cap, const char * name, const char * arch, int64_t n_vocab,
                     int64_t n_embd, int64_t n_layer) {
    snprintf(buf, cap, "'%.80s' (%.32s: %lld tokens, %lld wide, %lld layers)", name, arch,
             (long long) n_vocab, (long long) n_embd, (long long) n_layer);
}

// A u64 key's value; false when absent or of another type.
static bool get_u64(const es_gguf * g, const char * key, uint64_t * out) {
    es_gguf_value v;
    if (!es_gguf_value_at(g, es_gguf_find_key(g, key), &v) || v.type != ES_GGUF_U64) return false;
    memcpy(out, v.data, sizeof *out);
    return true;
}

// The head file's target against this one: every recorded field and the digest.
static int check_target(const es_head * h, char * err, size_t err_cap) {
    const es_gguf * g = h->model->gguf;
    const es_model * t = h->target;
    const char * name = es_gguf_get_str(g, HEAD_ARCH ".target.name");
    const char * arch = es_gguf_get_str(g, HEAD_ARCH ".target.architecture");
    int64_t n_vocab = -1, n_layer = -1;
    uint64_t digest = 0, target_digest = 0;
    if (!name || !arch || !es_gguf_get_i64(g, HEAD_ARCH ".target.vocab_size", &n_vocab) ||
        !es_gguf_get_i64(g, HEAD_ARCH ".target.block_count", &n_layer) ||
        !get_u64(g, HEAD_ARCH ".target.digest", &digest)) {
        es__set_err(err, err_cap, "not a draft head: the eagle.target.* keys naming its target are missing");
        return ES_ERR_FORMAT;
    }
    const int rc = es_head_target_digest(t->gguf, &target_digest);
    if (rc != ES_OK) return rc;
    const bool same_shape = strcmp(arch, t->arch->name) == 0 && n_vocab == t->n_vocab &&
                            h->model->n_embd == t->n_embd && n_layer == t->n_layer;
    if (!same_shape || digest != target_digest) {
        const char * tname = es_gguf_get_str(t->gguf, "general.name");
        char made[192], here[192];
        describe(made, sizeof made, name, arch, n_vocab, h->model->n_embd, n_layer);
        describe(here, sizeof here, tname ? tname : "(unnamed)", t->arch->name, t->n_vocab, t->n_embd,
                 t->n_layer);
        es__set_err(err, err_cap, "a draft head made for %s, not for the target %s%s", made, here,
                    same_shape ? ": their token embeddings or tokenizers differ" : "");
        return ES_ERR_INVALID_ARG;
    }
    return ES_OK;
}

// eagle.digest against the tensors' own (a file damaged in its data).
static int check_digest(const es_gguf * g, char * err, size_t err_cap) {
    uint64_t want, h = 0;
    if (!get_u64(g, HEAD_ARCH ".digest", &want)) {
        es__set_err(err, err_cap, "eagle.digest (u64) is missing");
        return ES_ERR_FORMAT;
    }
    for (int64_t i = 0; i < es_gguf_n_tensors(g); i++) {
        const es_tensor * t = es_gguf_tensor_at(g, i);
        h = es_head_digest(h, t->name, t->data, t->nbytes);
    }
    if (h != want) {
        es__set_err(err, err_cap, "the tensors do not match eagle.digest (a damaged file)");
        return ES_ERR_FORMAT;
    }
    return ES_OK;
}

// Binds fc_*, refuses a tensor the head does not read, and a weight type or
// activation row the context's buffers do not hold.
static int bind_fc(es_head * h, char * err, size_t err_cap) {
    const es_gguf * g = h->model->gguf;
    const int64_t D = h->model->n_embd;
    struct { const char * name; es_weight * w; int64_t n_out; bool required; } fc[] = {
        {"fc_feature.weight", &h->fc_feature, D, true},
        {"fc_token.weight", &h->fc_token, D, true},
        {"fc.bias", &h->fc_bias, 1, false},
    };
    for (size_t i = 0; i < sizeof fc / sizeof fc[0]; i++) {
        const es_tensor * t = es_gguf_find_tensor(g, fc[i].name);
        if (!t) {
            if (!fc[i].required) continue;
            es__set_err(err, err_cap, "tensor %s is missing", fc[i].name);
            return ES_ERR_FORMAT;
        }
        if (t->ne[0] != D || t->ne[1] != fc[i].n_out || t->ne[2] != 1 || t->ne[3] != 1) {
            es__set_err(err, err_cap, "tensor %s has shape (%lld, %lld), expected (%lld, %lld)", fc[i].name,
                        (long long) t->ne[0], (long long) t->ne[1], (long long) D, (long long) fc[i].n_out);
            return ES_ERR_FORMAT;
        }
        if (es_act_type(t->type) < 0 || (fc[i].n_out == 1 && t->type != ES_TYPE_F32)) {
            es__set_err(err, err_cap, "tensor %s: weight type %s is not supported", fc[i].name,
                        es_type_name(t->type));
            return ES_ERR_UNSUPPORTED;
        }
        *fc[i].w = (es_weight) { .data = t->data, .type = t->type, .n_in = D, .n_out = fc[i].n_out };
    }
    // Every tensor of the file is read: fc_*, or a row the layer bound.
    for (int64_t i = 0; i < es_gguf_n_tensors(g); i++) {
        const es_tensor * t = es_gguf_tensor_at(g, i);
        bool used = t->data == h->fc_feature.data || t->data == h->fc_token.data || t->data == h->fc_bias.data;
        for (int32_t r = 0; !used && r < h->arch.n_tensors; r++) {
            const es_arch_row * row = &h->arch.tensors[r];
            if (row->field == ES_UNBOUND || !(row->spec.flags & ES_TENSOR_LAYER)) continue;
            used = ((const es_weight *) ((const char *) &h->model->layers[0] + row->field))->data == t->data;
        }
        if (!used) {
            es__set_err(err, err_cap, "tensor %s is not read by a draft head", t->name);
            return ES_ERR_FORMAT;
        }
    }
    return ES_OK;
}

// The head file's hyperparameters and layer, as a one-layer model of the
// target's architecture whose embeddings and output are the target's.
static int load_layer(es_head * h, char * err, size_t err_cap) {
    es_model * m = h->model, * t = h->target;
    h->arch = *t->arch;
    h->arch.name = HEAD_ARCH;
    h->arch.traits.swa = ES_SWA_NONE;   // the head attends to its whole cache
    m->arch = &h->arch;
    int rc = es__load_decoder_hparams(m, err, err_cap);
    if (rc == ES_OK) rc = es__key_i32(m, "feed_forward_length", true, &m->n_ff, err, err_cap);
    if (rc != ES_OK) return rc;
    if (m->n_layer != 1 || m->n_head % m->n_head_kv != 0 || m->head_dim % 2 != 0 || m->n_ff <= 0 ||
        (int64_t) m->n_head * m->head_dim != m->n_embd) {
        es__set_err(err, err_cap, "bad head hyperparameters: block_count %d (must be 1), %d heads, %d kv "
                    "heads of %d (n_head x head width must be the width), feed_forward_length %d", (int) m->n_layer, (int) m->n_head,
                    (int) m->n_head_kv, (int) m->head_dim, (int) m->n_ff);
        return ES_ERR_FORMAT;
    }
    m->n_vocab = t->n_vocab;
    m->n_ctx_train = t->n_ctx_train;
    m->traits.final_softcap = t->traits.final_softcap;
    m->traits.embd_scale = t->traits.embd_scale;
    m->tok_embd = t->tok_embd;
    m->output = t->output;
    return es__bind_layers(m, err, err_cap);
}

int es_head_init(es_model * target, const char * path, const es_head_params * params, es_head ** out,
                 char * err, size_t err_cap) {
    if (err && err_cap) err[0] = '\0';
    if (out) *out = NULL;
    if (!target || !path || !out) {
        es__set_err(err, err_cap, "no target or path given");
        return ES_ERR_INVALID_ARG;
    }
    if (target->experts) {
        es__set_err(err, err_cap, "draft heads for mixture-of-experts targets are not supported");
        return ES_ERR_UNSUPPORTED;
    }
    const es_head_params p = params ? *params : es_head_default_params();
    es_head * h = calloc(1, sizeof *h);
    if (!h || !(h->model = calloc(1, sizeof *h->model))) {
        free(h);
        return ES_ERR_NO_MEMORY;
    }
    h->target = target;
    int rc = es_gguf_open(path, &h->model->gguf, err, err_cap);
    const char * arch = rc == ES_OK ? es_gguf_get_str(h->model->gguf, "general.architecture") : NULL;
    if (rc == ES_OK && (!arch || strcmp(arch, HEAD_ARCH) != 0)) {
        es__set_err(err, err_cap, "not a draft head: general.architecture is '%.64s', not '" HEAD_ARCH "'",
                    arch ? arch : "(none)");
        rc = ES_ERR_FORMAT;
    }
    if (rc == ES_OK) rc = check_digest(h->model->gguf, err, err_cap);
    if (rc == ES_OK) rc = load_layer(h, err, err_cap);
    if (rc == ES_OK) rc = check_target(h, err, err_cap);
    if (rc == ES_OK) rc = bind_fc(h, err, err_cap);
    es_context_params cp = es_context_default_params();
    cp.n_ctx = p.n_ctx;
    cp.n_batch = p.n_batch;
    cp.n_threads = p.n_threads;
    if (rc == ES_OK) rc = es_context_init(h->model, &cp, &h->ctx);
    if (rc == ES_OK) {
        // The context's activation rows hold the layer's and the output's
        // inputs; the fc matrices may read a wider format (F16 over Q8_0).
        size_t need = h->ctx->act_row;
        const es_weight * fc[2] = { &h->fc_feature, &h->fc_token };
        for (int i = 0; i < 2; i++) {
            const size_t r = es_type_row_bytes(es_act_type(fc[i]->type), fc[i]->n_in);
            need = r > need ? r : need;
        }
        if (need > h->ctx->act_row) {
            uint8_t * act = malloc(3 * (size_t) h->ctx->n_batch * need);
            if (act) {
                free(h->ctx->act);
                h->ctx->act = act;
                h->ctx->act_row = need;
            } else {
                rc = ES_ERR_NO_MEMORY;
            }
        }
    }
    if (rc == ES_OK) {
        h->hidden = malloc((size_t) h->ctx->n_batch * (size_t) h->model->n_embd * sizeof *h->hidden);
        if (!h->hidden) rc = ES_ERR_NO_MEMORY;
    }
    if (rc != ES_OK) {
        if (rc == ES_ERR_NO_MEMORY && err && !err[0]) es__set_err(err, err_cap, "out of memory");
        es_head_free(h);
        return rc;
    }
    *out = h;
    return ES_OK;
}

void es_head_free(es_head * h) {
    if (!h) return;
    free(h->hidden);
    es_context_free(h->ctx);
    es_model_free(h->model);   // its gguf, layers and kept output rows; the borrowed views stay the target's
    free(h);
}

int32_t es_head_n_ctx(const es_head * h) { return h ? h->ctx->n_ctx : 0; }
int32_t es_head_n_batch(const es_head * h) { return h ? h->ctx->n_batch : 0; }
int32_t es_head_n_past(const es_head * h) { return h ? h->ctx->n_past : 0; }
const float * es_head_logits(const es_head * h) { return h && h->n_hidden > 0 ? h->ctx->logits : NULL; }
const float * es_head_hidden(const es_head * h) { return h && h->n_hidden > 0 ? h->hidden : NULL; }

int es_head_truncate(es_head * h, int32_t n_keep) {
    return h ? es_context_truncate(h->ctx, n_keep) : ES_ERR_INVALID_ARG;
}

int es_head_set_output_rows(es_head * h, const es_token * ids, int32_t n) {
    return h ? es_model_set_output_rows(h->model, ids, n) : ES_ERR_INVALID_ARG;
}

/* ---- decoding ---------------------------------------------------------------- */

int es_head_decode(es_head * h, const float * features, const es_token * tokens, int32_t n,
                   int32_t logits_from) {
    if (!h || !features || !tokens || n <= 0 || n > h->ctx->n_batch || logits_from < 0 || logits_from > n) {
        return ES_ERR_INVALID_ARG;
    }
    es_context * c = h->ctx;
    const es_model * m = h->model;
    const int64_t D = m->n_embd;
    for (int32_t i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= m->n_vocab) return ES_ERR_INVALID_ARG;
    }
    if (c->n_past + n > c->n_ctx) return ES_ERR_CONTEXT_FULL;
    h->n_hidden = 0;

    // One chain after the cache: row i at the next position, seeing the
    // cache and the rows up to itself.
    c->seqs[0] = (es_seq_rows) { .kv = c, .tokens = tokens, .r0 = 0, .n = n, .keep_from = logits_from };
    c->n_seqs = 1;
    const int32_t base = c->n_past > 0 ? c->cell_pos[c->n_past - 1] + 1 : 0;
    for (int32_t i = 0; i < n; i++) {
        uint8_t * sees = c->sees + (size_t) i * (size_t) c->n_batch;   // (n) columns
        for (int32_t j = 0; j < n; j++) sees[j] = j <= i;
        c->row_seq[i] = 0;
        c->pos[i] = c->cell_pos[c->n_past + i] = base + i;
    }
    c->n = n;

    // x = fc_feature · f + fc_token · embed(t) (+ bias): the embeddings in xn, their product in out.
    const size_t emb_row = es_type_row_bytes(m->tok_embd.type, D);
    for (int32_t i = 0; i < n; i++) {
        float * e = c->xn + (size_t) i * D;
        es_dequantize_row(m->tok_embd.type, (const uint8_t *) m->tok_embd.data + (size_t) tokens[i] * emb_row, e, D);
        if (m->traits.embd_scale != 1.0f) for (int64_t k = 0; k < D; k++) e[k] *= m->traits.embd_scale;
    }
    const es_weight * fc_f = &h->fc_feature, * fc_t = &h->fc_token;
    int rc = es__matmul(c, 1, &fc_t, c->xn, &c->out, n);
    if (rc == ES_OK) rc = es__matmul(c, 1, &fc_f, features, &c->x, n);
    if (rc == ES_OK) {
        es__add(c->x, c->out, (int64_t) n * D);
        for (int32_t i = 0; h->fc_bias.data && i < n; i++) es__add(c->x + (size_t) i * D, h->fc_bias.data, D);
        rc = m->arch->layer(c, 0);
    }
    // The kept rows' outputs: the guessed features, and the output layer's input.
    const int32_t rows = n - logits_from;
    if (rc == ES_OK) {
        memcpy(c->xn, c->x + (size_t) logits_from * D, (size_t) rows * D * sizeof *c->xn);
        rc = es__output_logits(c, rows);
    }
    c->n = 0;
    if (rc != ES_OK) return rc;
    memcpy(h->hidden, c->xn, (size_t) rows * D * sizeof *h->hidden);
    h->n_hidden = rows;
    c->n_past += n;
    return ES_OK;
}
