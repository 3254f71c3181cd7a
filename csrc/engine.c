/*
 * engine.c — es_model / es_context: loading, KV cache, shared blocks, es_decode.
 * (Placeholder: every function answers ES_ERR_UNSUPPORTED until the engine lands.)
 */
#include <stdio.h>

#include "native.h"

int es_model_load(const char * path, es_model ** out, char * err, size_t err_cap) {
    (void) path;
    if (out) *out = NULL;
    if (err && err_cap) snprintf(err, err_cap, "the native engine is not built yet");
    return ES_ERR_UNSUPPORTED;
}
void es_model_free(es_model * model) { (void) model; }
const char * es_model_arch(const es_model * model) { (void) model; return ""; }
int32_t es_model_n_vocab(const es_model * model) { (void) model; return 0; }
int32_t es_model_n_ctx_train(const es_model * model) { (void) model; return 0; }

es_context_params es_context_default_params(void) {
    es_context_params p = { .n_ctx = 4096, .n_batch = 512, .n_threads = 0 };
    return p;
}
int es_context_init(es_model * model, const es_context_params * params, es_context ** out) {
    (void) model; (void) params;
    if (out) *out = NULL;
    return ES_ERR_UNSUPPORTED;
}
void es_context_free(es_context * ctx) { (void) ctx; }
int32_t es_context_n_ctx(const es_context * ctx) { (void) ctx; return 0; }
int32_t es_context_n_batch(const es_context * ctx) { (void) ctx; return 0; }
int32_t es_context_n_past(const es_context * ctx) { (void) ctx; return 0; }
int es_decode(es_context * ctx, const es_token * tokens, const int32_t * parents,
              int32_t n, int32_t logits_from) {
    (void) ctx; (void) tokens; (void) parents; (void) n; (void) logits_from;
    return ES_ERR_UNSUPPORTED;
}
const float * es_context_logits(const es_context * ctx) { (void) ctx; return NULL; }
int es_context_truncate(es_context * ctx, int32_t n_keep) {
    (void) ctx; (void) n_keep;
    return ES_ERR_UNSUPPORTED;
}
