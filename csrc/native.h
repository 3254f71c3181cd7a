/*
 * native.h — the native engine's internal seams, not part of the public ABI.
 *
 *   gguf.c        GGUF v3 reader: mmap, strict validation, tensor and key lookup
 *   quants.c      weight types: row sizes, dequantization, dot products
 *                 (scalar, AVX2, NEON; chosen once at run time)
 *   threadpool.c  a small pool of spinning workers for one parallel loop at a time
 *   engine.c      es_model / es_context: loading, KV cache, shared blocks
 *                 (norms, RoPE, attention, matmul, FFN, MoE routing), es_decode
 *   arch_*.c      one file per architecture: hyperparameters, tensor binding,
 *                 the layer loop; found by name through es__archs[]
 */
#ifndef EDGESPEC_NATIVE_H
#define EDGESPEC_NATIVE_H

#include "edgespec.h"

/* ---- GGUF reader (gguf.c) ------------------------------------------------ */

// ggml's type ids, as stored in GGUF tensor infos.
enum es_type {
    ES_TYPE_F32  = 0,  ES_TYPE_F16  = 1,  ES_TYPE_Q4_0 = 2,  ES_TYPE_Q4_1 = 3,
    ES_TYPE_Q5_0 = 6,  ES_TYPE_Q5_1 = 7,  ES_TYPE_Q8_0 = 8,  ES_TYPE_Q8_1 = 9,
    ES_TYPE_Q2_K = 10, ES_TYPE_Q3_K = 11, ES_TYPE_Q4_K = 12, ES_TYPE_Q5_K = 13,
    ES_TYPE_Q6_K = 14, ES_TYPE_Q8_K = 15, ES_TYPE_BF16 = 30,
};

// Block geometry of every ggml type a GGUF may name, whether or not the
// kernels support it: the reader sizes tensors with it.
typedef struct es_type_traits {
    const char * name;         // "Q4_K", ...
    int32_t      block;        // elements per block (1 for plain types)
    int32_t      block_bytes;  // bytes per block
} es_type_traits;

// NULL for an id ggml does not define (or has retired).
const es_type_traits * es_type_info(int32_t type);

typedef struct es_gguf es_gguf;

typedef struct es_tensor {
    const char * name;    // NUL-terminated, owned by the es_gguf
    int32_t      type;    // enum es_type
    int32_t      n_dims;  // 1..4
    int64_t      ne[4];   // elements per dimension, ne[0] innermost (a row); unused dims 1
    const void * data;    // inside the mapping, aligned to general.alignment
    size_t       nbytes;  // checked against the file size
} es_tensor;

// Maps and validates a GGUF v3 file: every count, offset, size, string
// length, alignment and type id is checked against the file before use.
// err as for es_model_load.
int  es_gguf_open(const char * path, es_gguf ** out, char * err, size_t err_cap);
// The same over a caller's buffer, which must outlive the es_gguf (fuzzing, tests).
int  es_gguf_open_buffer(const void * data, size_t size, es_gguf ** out, char * err, size_t err_cap);
void es_gguf_close(es_gguf * g);

int64_t           es_gguf_n_tensors(const es_gguf * g);
const es_tensor * es_gguf_tensor_at(const es_gguf * g, int64_t i);
const es_tensor * es_gguf_find_tensor(const es_gguf * g, const char * name);  // NULL: absent

// Metadata keys in file order (dumps, the fuzz target); NULL out of range.
int64_t      es_gguf_n_kv(const es_gguf * g);
const char * es_gguf_key_at(const es_gguf * g, int64_t i);

// Metadata lookups; false when the key is absent or of another kind.
// Integers of any width convert when the value fits.
bool         es_gguf_get_i64(const es_gguf * g, const char * key, int64_t * out);
bool         es_gguf_get_f32(const es_gguf * g, const char * key, float * out);  // f32 or f64
bool         es_gguf_get_bool(const es_gguf * g, const char * key, bool * out);
const char * es_gguf_get_str(const es_gguf * g, const char * key);  // NUL-terminated, owned by g
// A numeric array: its element type (GGUF value type id), length and data
// (little-endian, inside the mapping). Per-layer hyperparameters use these.
bool es_gguf_get_arr(const es_gguf * g, const char * key, int32_t * elem_type, uint64_t * n,
                     const void ** data);

/* ---- weight types and kernels (quants.c) --------------------------------- */

// Elements per block (1 for float types); 0 for a type this build lacks.
int32_t es_type_block(int32_t type);
// Bytes of a row of n elements; 0 when unsupported or n is not a block multiple.
size_t  es_type_row_bytes(int32_t type, int64_t n);
const char * es_type_name(int32_t type);

void es_dequantize_row(int32_t type, const void * src, float * dst, int64_t n);

// A weight type's dot product reads activations in a companion format:
// F32 for F32/F16/BF16 weights, Q8_0 for Q4_0/Q4_1/Q5_0/Q8_0 (Q4_1 as ggml's
// Q8_1 with block sums), Q8_K for the K-quants — as llama.cpp does, which
// keeps logits within rounding of llama.cpp's.
int32_t es_act_type(int32_t weight_type);
// Converts one activation row x (n floats) into es_act_type(weight_type)
// blocks at dst (es_type_row_bytes(es_act_type(weight_type), n) bytes).
void es_quantize_act(int32_t weight_type, const float * x, void * dst, int64_t n);

// y[r - r0] = dot(row r of w, xq) for r in [r0, r1). w: rows of n elements,
// es_type_row_bytes(type, n) apart; xq from es_quantize_act. Each dot
// reduces in a fixed order, whatever r0, r1 or the thread running it.
void es_matvec(int32_t type, const void * w, const void * xq, int64_t n,
               int64_t r0, int64_t r1, float * y);

// Which kernels es_matvec uses: "avx2", "neon" or "scalar". The environment
// variable EDGESPEC_KERNELS=scalar forces the portable path (tests compare them).
const char * es_kernels_name(void);

/* ---- thread pool (threadpool.c) ------------------------------------------ */

typedef struct es_pool es_pool;

// fn(arg, ith, nth) runs once on each of nth threads (the caller is ith 0).
typedef void (*es_pool_fn)(void * arg, int32_t ith, int32_t nth);

int     es_pool_init(int32_t n_threads, es_pool ** out);
void    es_pool_free(es_pool * pool);
int32_t es_pool_size(const es_pool * pool);
// Runs fn on every thread and returns when all are done.
void    es_pool_run(es_pool * pool, es_pool_fn fn, void * arg);

/* ---- mixture of experts (moe.c) ----------------------------------------- */

// Most experts a layer may have (llama.cpp's LLAMA_MAX_EXPERTS).
#define ES_MOE_MAX_EXPERTS 1024

// The three matrices of one SwiGLU expert.
enum es_expert_matrix {
    ES_EXPERT_GATE = 0,  // (n_ff, n_embd)
    ES_EXPERT_UP   = 1,  // (n_ff, n_embd)
    ES_EXPERT_DOWN = 2,  // (n_embd, n_ff)
};

// One expert matrix as es_matvec reads it: rows of `type`,
// es_type_row_bytes(type, row length) apart.
typedef struct es_expert_view {
    const void * data;
    int32_t      type;   // enum es_type; need not be the file's
} es_expert_view;

// The per-expert access path: es_moe_ffn reaches expert weights through
// this alone. get() fills *out for (layer, expert, es_expert_matrix) and may
// produce the data on demand (a cache of experts: read from disk, or a
// low-precision copy); the view stays valid until put() is called with it.
// es_moe_ffn gets every matrix of the experts a batch routes to before it
// computes, on the calling thread, and puts them all back before it
// returns. get returns ES_OK or a status, which es_moe_ffn returns.
typedef struct es_expert_provider {
    void * self;
    int  (*get)(void * self, int32_t layer, int32_t expert, int32_t which, es_expert_view * out);
    void (*put)(void * self, int32_t layer, int32_t expert, int32_t which,
                const es_expert_view * view);
} es_expert_provider;

typedef struct es_moe_params {
    int32_t n_layer;        // every layer has experts
    int32_t n_expert;       // experts per layer, <= ES_MOE_MAX_EXPERTS
    int32_t n_expert_used;  // experts per token (top-k)
    int64_t n_embd;
    int64_t n_ff;           // one expert's hidden width
    // Gating is softmax over all experts, then the top k (Mixtral, Qwen
    // MoE); norm_w divides the k weights by their sum (llama.cpp's norm_w).
    bool    norm_w;
} es_moe_params;

// A model's experts: per layer blk.N.ffn_gate_inp (n_expert, n_embd) and
// blk.N.ffn_{gate,up,down}_exps, bound from g (which must outlive it) and
// checked against p: ES_ERR_FORMAT names a missing or misshapen tensor,
// ES_ERR_UNSUPPORTED a weight type the kernels lack. Expert matrices are
// served from the mapping, or with EDGESPEC_EXPERTS=f32 in the environment
// as F32 copies made on demand (the path an expert cache takes; tests).
typedef struct es_experts es_experts;
int  es_experts_init(const es_gguf * g, const es_moe_params * p, es_experts ** out,
                     char * err, size_t err_cap);
void es_experts_free(es_experts * ex);
const es_moe_params * es_experts_params(const es_experts * ex);

// One context's scratch for es_moe_ffn, for batches of up to n_batch tokens;
// ex must outlive it.
typedef struct es_moe es_moe;
int  es_moe_init(const es_experts * ex, int32_t n_batch, es_moe ** out);
void es_moe_free(es_moe * moe);

// The MoE feed-forward block of layer il: x (n_tokens, n_embd), the normed
// input, to out (n_tokens, n_embd) = sum over the token's top-k experts,
// best first, of weight * down(silu(gate(x)) * up(x)). Each token's row
// depends on that row alone (batch invariance). ES_ERR_INVALID_ARG: bad
// layer or n_tokens > n_batch; otherwise as the provider's get.
int  es_moe_ffn(es_moe * moe, es_pool * pool, int32_t il, const float * x, int32_t n_tokens,
                float * out);

#endif  // EDGESPEC_NATIVE_H
