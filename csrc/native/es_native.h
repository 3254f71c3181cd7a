/*
 * es_native.h — edgespec's own inference engine: GGUF models evaluated on the
 * CPU, batch-invariant so speculative verification is bit-exact.
 */
#ifndef ES_NATIVE_H
#define ES_NATIVE_H

#include "es_base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ========================================================================
 * Native inference engine
 *
 * edgespec's own forward pass over a GGUF file (mmap'd, validated before
 * use): llama-family dense models and Mixture-of-Experts decoders. One
 * es_model holds the weights; each es_context holds one KV cache, its
 * scratch buffers and the logits of the last es_decode.
 *
 * Every matrix-vector product reduces in the same order whatever the batch,
 * so a token's logits do not depend on how many tokens were evaluated with it
 * (what makes speculative verification bit-identical to plain decoding).
 * ======================================================================== */

typedef struct es_model   es_model;
typedef struct es_context es_context;

// Loads a GGUF file. On failure *out stays NULL and, when err is not NULL,
// err holds a NUL-terminated one-line reason (truncated to err_cap bytes).
// ES_ERR_IO: unreadable; ES_ERR_FORMAT: damaged, not GGUF v3, or refused by
// es_gguf_validate (below);
// ES_ERR_UNSUPPORTED: an architecture or weight type this build lacks.
int  es_model_load(const char * path, es_model ** out, char * err, size_t err_cap);
void es_model_free(es_model * model);

const char * es_model_arch(const es_model * model);  // "llama", "gemma3", ...; owned by model
int32_t es_model_n_vocab(const es_model * model);
int32_t es_model_n_ctx_train(const es_model * model);

typedef struct es_context_params {
    int32_t n_ctx;      // KV cache capacity in tokens; <= 0: the model's training context; default 4096
    int32_t n_batch;    // most tokens one es_decode takes; default 512
    int32_t n_threads;  // worker threads; <= 0: one per online CPU; default 0
} es_context_params;

es_context_params es_context_default_params(void);

// Makes a context on model, which must outlive it. *out is set on ES_OK only.
int  es_context_init(es_model * model, const es_context_params * params, es_context ** out);
void es_context_free(es_context * ctx);

int32_t es_context_n_ctx(const es_context * ctx);
int32_t es_context_n_batch(const es_context * ctx);
int32_t es_context_n_past(const es_context * ctx);  // tokens held in the KV cache

// Evaluates n tokens, appended to the KV cache after its es_context_n_past()
// cells. parents == NULL: a chain (token i follows token i-1, the first
// follows the cache). Otherwise parents[i] in [-1, i) names the batch token
// that token i follows (-1: the cache's last token), which draws a tree:
// token i attends to the whole cache, its ancestors in the batch and itself,
// at position (its parent's position + 1). Logits rows are kept for tokens
// [logits_from, n). ES_ERR_CONTEXT_FULL: n_past + n > n_ctx; n > n_batch or
// a bad parent: ES_ERR_INVALID_ARG. On error the cache is as before.
int es_decode(es_context * ctx, const es_token * tokens, const int32_t * parents,
              int32_t n, int32_t logits_from);

// The (n - logits_from, n_vocab) logits of the last es_decode; owned by ctx,
// valid until the next es_decode or es_context_free.
const float * es_context_logits(const es_context * ctx);

// Keeps the first n_keep cells of the KV cache (rollback); n_keep in [0, n_past].
int es_context_truncate(es_context * ctx, int32_t n_keep);

/* ========================================================================
 * GGUF validation (validate.c)
 *
 * One pass over an open GGUF file before any engine reads it: what llama.cpp
 * and this engine would otherwise assert on or misread. For the
 * architectures both read (llama, gemma3, qwen2, qwen3moe):
 *   - hyperparameters present and in range (block_count 1..512, widths, head
 *     counts that divide the width and each other, context length, finite
 *     positive epsilon and RoPE base, expert counts);
 *   - every tensor the architecture reads present, with the shape the
 *     hyperparameters give and a weight type.
 * For every architecture:
 *   - the vocabulary: tokenizer.ggml.tokens non-empty and unique strings,
 *     token_type (i32, one per token, 0..6) and scores (f32, one per token),
 *     merges of the form "a b", every tokenizer.ggml.*_token_id a token;
 *   - block_count, embedding_length and any head counts, epsilon or RoPE keys
 *     present in range; token_embd of (embedding_length, n_vocab);
 *   - vectors and *_norm tensors F32, no blk.N tensor past block_count.
 * ======================================================================== */

// Declared here for the Python side (edgespec/models/validate.py) until the
// GGUF reader's declarations move into this header; native_internal.h
// documents them.
typedef struct es_gguf es_gguf;
int  es_gguf_open(const char * path, es_gguf ** out, char * err, size_t err_cap);
void es_gguf_close(es_gguf * g);
// A string array: its element count and first element, inside the mapping.
// Elements follow one another as (u64 little-endian length, bytes), checked
// by es_gguf_open to lie inside the file. False when absent or not strings.
bool es_gguf_get_str_arr(const es_gguf * g, const char * key, uint64_t * n, const void ** data);

// ES_OK, or ES_ERR_FORMAT with a one-line reason in err naming the key,
// tensor or token (err as for es_model_load); ES_ERR_NO_MEMORY;
// ES_ERR_INVALID_ARG when g is NULL. g is only read.
int es_gguf_validate(const es_gguf * g, char * err, size_t err_cap);

#ifdef __cplusplus
}
#endif

#endif  // ES_NATIVE_H
