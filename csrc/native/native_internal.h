/*
 * native_internal.h — the native engine's internal seams, not part of the
 * public ABI (the GGUF reader, weight-type names and the kernel choice are
 * public: es_native.h).
 *
 *   gguf.c            GGUF v2/v3 reader: mmap, strict validation, tensor and key lookup
 *   kernels/          weight types (quants.c: row sizes, dequantization) and the
 *                     dot products, one file per kernel set (scalar, AVX2,
 *                     AVX-512, NEON; dispatch.c picks one: es_kernels_select)
 *   threadpool.c      a small pool of spinning workers for one parallel loop at a time
 *   moe.c             experts: binding, the per-expert access path, routing and
 *                     the MoE feed-forward block
 *   expert_cache.c    experts read from disk into a budgeted cache (I/O thread,
 *                     low-precision substitutes, prefetch, eviction policy)
 *   model.c           es_model / es_context: loading, repacking, KV cache and
 *                     its state, es_decode
 *   binding.c         tensor tables bound into es_weight views, keys read
 *   blocks.c          the shared blocks (norms, matmul, RoPE, attention, dense FFN)
 *   arch/<name>.c     one file per architecture: tensor table, traits, hyperparameters;
 *                     found by name through es__archs[] (arch/registry.c)
 *   arch/decoder.c    the decoder layer, as an architecture's traits say
 *   head.c            draft heads (EAGLE): one layer over the target's features, a
 *                     one-layer es_model borrowing the target's embeddings and output
 */
#ifndef EDGESPEC_NATIVE_H
#define EDGESPEC_NATIVE_H

#include "es_common.h"
#include "native/es_native.h"

#include <stddef.h>
#include <string.h>

/* ---- weight types and kernels (kernels/) ----------------------------------- */

// IEEE binary16 <-> binary32, exact and table-free (inline: KV cache and
// attention use them per element). es_f32_to_half rounds to nearest even,
// as F16C's vcvtps2ph and ggml's converters do; overflow gives inf.
static inline float es_half_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t) h << 16, sign = w & 0x80000000u, two_w = w + w;
    uint32_t u;
    float f;
    // Normals: exponent and mantissa moved into place, rebiased by a scale.
    u = (two_w >> 4) + (0xE0u << 23);
    memcpy(&f, &u, 4);
    const float normal = f * 0x1.0p-112f;
    // Subnormals: the mantissa as the low bits of 0.5's significand, minus 0.5.
    u = (two_w >> 17) | (126u << 23);
    memcpy(&f, &u, 4);
    const float subnormal = f - 0.5f;
    memcpy(&u, two_w < (1u << 27) ? &subnormal : &normal, 4);
    u |= sign;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t es_f32_to_half(float x) {
    // Scaling up then down rounds the mantissa to half precision in float.
    float base = (x < 0 ? -x : x) * 0x1.0p+112f * 0x1.0p-110f;
    uint32_t w, bits;
    memcpy(&w, &x, 4);
    const uint32_t shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    bias = (bias >> 1) + 0x07800000u;
    float fb;
    memcpy(&fb, &bias, 4);
    base = fb + base;
    memcpy(&bits, &base, 4);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t) ((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// Elements per block (1 for float types); 0 for a type this build lacks.
int32_t es_type_block(int32_t type);
// Bytes of a row of n elements; 0 when unsupported or n is not a block multiple.
size_t  es_type_row_bytes(int32_t type, int64_t n);

// A weight type's dot product reads activations in a companion format:
// the weight's own type for F32/F16/BF16 (activations rounded to F16 / BF16),
// Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 (Q8_0 plus block sums) for Q4_1/Q5_1, Q8_K
// for the K-quants — ggml's vec_dot_type for each, which keeps logits within
// rounding of llama.cpp's. -1 for a type es_matvec does not take.
int32_t es_act_type(int32_t weight_type);
// Converts one activation row x (n floats) into es_act_type(weight_type)
// blocks at dst (es_type_row_bytes(es_act_type(weight_type), n) bytes).
void es_quantize_act(int32_t weight_type, const float * x, void * dst, int64_t n);

// y[r - r0] = dot(row r of w, xq) for r in [r0, r1). w: rows of n elements,
// es_type_row_bytes(type, n) apart; xq from es_quantize_act. Each dot
// reduces in a fixed order, whatever r0, r1 or the thread running it (the
// quantized types: kernels/kernels.h's per-token arithmetic).
void es_matvec(int32_t type, const void * w, const void * xq, int64_t n,
               int64_t r0, int64_t r1, float * y);
// es_matvec for n_tok activation rows at once (a verification batch, a
// prefill chunk): row t of xq at xq + t * xq_stride bytes, its results
// y[t * y_stride + r - r0] (floats). Bit for bit n_tok es_matvec calls,
// faster where the kernels unpack each weight block once for several
// tokens, and fastest over packed (w's es_repack copy, or NULL: none), whose
// tile kernels also share each activation load between 8 rows.
void es_matmat(int32_t type, const void * w, const void * packed, const void * xq, size_t xq_stride,
               int32_t n_tok, int64_t n, int64_t r0, int64_t r1, float * y, size_t y_stride);

// Repacking (kernels/repack.c): rows in groups of ES_GROUP_ROWS, interleaved
// block by block for the tile kernels.
#define ES_GROUP_ROWS 8
// Bytes of the copy of n_rows rows of n elements of type: its whole groups
// (a remainder of rows stays unpacked); 0 for a type without a repacked
// layout or fewer than ES_GROUP_ROWS rows.
size_t es_repack_bytes(int32_t type, int64_t n, int64_t n_rows);
// Writes that copy of rows (n_rows rows, es_type_row_bytes(type, n) apart)
// to dst (es_repack_bytes(type, n, n_rows) bytes).
void   es_repack(int32_t type, const void * rows, int64_t n, int64_t n_rows, void * dst);
// Whether the kernel set in use has tile kernels for type (without, es_matmat
// reads the unpacked rows even where it is given a repacked copy).
bool   es_kernels_tile(int32_t type);
// The kernel set in use's integer step in its tightest loop (the int8 peak,
// es_measure_int8_peak): the multiply-accumulates done; *sink its result.
int64_t es_int8_loop(int64_t iterations, int32_t * sink);
// acc[i] += e * v[i] for n binary16 values v (attention's weighted sum of
// V rows): the same arithmetic on every call within one kernel set.
void es_axpy_f16(int64_t n, float e, const uint16_t * v, float * acc);
// acc[i] += sum over r of e[r] v_r[i] for `rows` consecutive rows v_r of n
// Q8_0 values (whole blocks; attention's weighted sum of a Q8_0 cache's V
// rows): each block's weight folded into its scale, so no row is
// dequantized into memory; the same bits in every kernel set and batch.
void es_axpy_q8_0(int64_t n, int64_t rows, const float * e, const void * v, float * acc);

/* ---- thread pool (threadpool.c) ------------------------------------------ */

typedef struct es_pool es_pool;

// fn(arg, ith, nth) runs once for each share ith = 0..nth-1, nth = the pool
// size. Shares run concurrently on the pool's threads, but a thread may run
// several one after another (the caller takes over the shares of workers
// that are slow to start), so fn must never wait for another share.
typedef void (*es_pool_fn)(void * arg, int32_t ith, int32_t nth);

// n_threads >= 1 (the caller plus n_threads - 1 workers). ES_OK,
// ES_ERR_INVALID_ARG, ES_ERR_NO_MEMORY (also when a thread cannot start).
int     es_pool_init(int32_t n_threads, es_pool ** out);
void    es_pool_free(es_pool * pool);  // NULL is a no-op
int32_t es_pool_size(const es_pool * pool);
// Runs all nth shares of fn and returns when they are done. One run at a
// time: not to be called concurrently or from inside fn.
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
// returns. get returns ES_OK or a status, which es_moe_ffn returns; a view
// of a type es_matvec does not take makes es_moe_ffn fail with ES_ERR_UNSUPPORTED.
//
// A cache of experts adds hooks (NULL in the mapped and F32 providers):
// begin() comes before the gets of one layer's batch, with the n experts
// (ascending) it will get and each one's importance (the largest routing
// weight a token of the batch gives it), so misses are read together and
// every expert named stays held until end(). At most max_held experts are
// named between begin and end (0: no limit): es_moe_ffn computes a batch
// whose experts are more in groups of that many. prefetch() names experts
// predicted for a later layer (by that layer's router on this layer's
// input), to be read early; prefetch_depth() says how many layers ahead to
// predict now.
typedef struct es_expert_provider {
    void * self;
    int  (*get)(void * self, int32_t layer, int32_t expert, int32_t which, es_expert_view * out);
    void (*put)(void * self, int32_t layer, int32_t expert, int32_t which,
                const es_expert_view * view);
    int  (*begin)(void * self, int32_t layer, int32_t n_tokens, int32_t n,
                  const int32_t * experts, const float * importance);
    void (*end)(void * self, int32_t layer);
    void (*prefetch)(void * self, int32_t layer, int32_t n, const int32_t * experts,
                     const float * importance);
    int32_t (*prefetch_depth)(void * self);
    int32_t max_held;
} es_expert_provider;

typedef struct es_moe_params {
    int32_t n_layer;        // every layer has experts
    int32_t n_expert;       // experts per layer, <= ES_MOE_MAX_EXPERTS
    int32_t n_expert_used;  // experts per token (top-k)
    int64_t n_embd;
    int64_t n_ff;           // one expert's hidden width
    int32_t experts;        // enum es_experts_mode: how the default provider serves matrices
    // Gating is softmax over all experts, then the top k (Mixtral, Qwen
    // MoE); norm_w divides the k weights by their sum (llama.cpp's norm_w).
    bool    norm_w;
} es_moe_params;

// A model's experts: per layer blk.N.ffn_gate_inp (n_expert, n_embd) and
// blk.N.ffn_{gate,up,down}_exps, bound from g (which must outlive it) and
// checked against p: ES_ERR_FORMAT names a missing or misshapen tensor,
// ES_ERR_UNSUPPORTED a weight type the kernels lack, ES_ERR_INVALID_ARG an
// unknown p->experts. Expert matrices are served as p->experts says: from
// the mapping, or as F32 copies made on demand.
typedef struct es_experts es_experts;
int  es_experts_init(const es_gguf * g, const es_moe_params * p, es_experts ** out,
                     char * err, size_t err_cap);
void es_experts_free(es_experts * ex);
const es_moe_params * es_experts_params(const es_experts * ex);
// The provider es_moe_ffn reads experts through, and its replacement: an
// expert cache wraps the default one (it serves any es_type per expert, so
// experts may be mixed-precision copies), tests inject failures. The struct
// is copied; its self must outlive the es_experts' use.
const es_expert_provider * es_experts_provider(const es_experts * ex);
void es_experts_set_provider(es_experts * ex, const es_expert_provider * provider);

// Layer il's expert stack `which` (enum es_expert_matrix) as bound from the GGUF.
const es_tensor * es_experts_tensor(const es_experts * ex, int32_t il, int32_t which);

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

/* ---- expert cache (expert_cache.c) --------------------------------------- */

// Byte offset of tensor t's data in g's file.
int64_t es_gguf_tensor_offset(const es_gguf * g, const es_tensor * t);
// The whole pages of [p, p + n) of g's mapping leave this process's resident
// memory (they stay in the page cache and come back from it when read
// again); nothing where the file was read into memory instead of mapped.
void es_gguf_release(const es_gguf * g, const void * p, size_t n);
// The whole file's bytes (*size of them), header and tensor data.
const uint8_t * es__gguf_bytes(const es_gguf * g, size_t * size);

// A budgeted cache of expert weights read from the model file at `path`
// (and its low-precision sidecar, p->expert_sidecar) with pread on an I/O
// thread; its provider replaces ex's (es_experts_set_provider). ex and g
// must outlive it. ES_ERR_INVALID_ARG: a budget below one layer's active
// experts (err names the minimum), a precision other than EXACT without a
// sidecar; ES_ERR_FORMAT: a sidecar that does not match the model (err
// says why); ES_ERR_IO: a file that cannot be read. The cache serves one
// es_moe_ffn at a time (one context decoding).
typedef struct es_expert_cache es_expert_cache;
int  es_expert_cache_init(const es_gguf * g, const char * path, const es_experts * ex,
                          const es_model_params * p, es_expert_cache ** out, char * err,
                          size_t err_cap);
void es_expert_cache_free(es_expert_cache * c);  // NULL is a no-op; joins the I/O thread
const es_expert_provider * es_expert_cache_provider(es_expert_cache * c);
void es_expert_cache_stats(es_expert_cache * c, es_expert_stats * out);
void es_expert_cache_stats_reset(es_expert_cache * c);
const char * es_expert_cache_error(es_expert_cache * c);  // "" when none

/* ---- repacked weights kept in a file (packed_file.c) ---------------------- */

// What a file of repacked weights was written for: the GGUF file and the
// layout; a file whose key differs in any field is not used.
typedef struct es_packed_key {
    uint64_t source;  // es__packed_source of the GGUF
    uint64_t layout;  // every weight's type, shape and repacked bytes, the block layouts, the version
    uint64_t bytes;   // of the repacked weights
} es_packed_key;

// The GGUF at path as it is now: its size, times (the ctime too) and inode,
// its header, and samples of its tensor data; 0 when path no longer holds
// the file g maps.
uint64_t es__packed_source(const es_gguf * g, const char * path);
// es__packed_file_map's answer for a path that holds something other than a
// regular file of this user's that no group or other user may write (a
// symlink, a FIFO, another owner's file): neither read nor replaced.
#define ES_PACKED_FILE_FOREIGN 1
// Maps path read-only when it holds key->bytes of repacked weights written
// for key, whole (their digest, keyed with secret's ES_REPACK_SECRET_BYTES,
// checked): *out the weights, *map and *map_size the mapping to munmap.
// ES_ERR_IO: absent or unreadable; ES_ERR_FORMAT: written for another key or
// secret, cut short or damaged; ES_PACKED_FILE_FOREIGN.
int es__packed_file_map(const char * path, const es_packed_key * key, const uint8_t * secret, const void ** out,
                        void ** map, size_t * map_size);
// A file being written beside path: its name, descriptor and mapping.
typedef struct es_packed_writer {
    char   part[4096];
    int    fd;
    void * map;     // (size) read-write, shared with the file
    size_t size;
} es_packed_writer;

// Creates a file of the writer's own beside path with room for `bytes` of
// weights, mapped: *weights is where the repack writes them. ES_ERR_IO
// (nothing left behind): it could not be made, or the disk has no room.
int  es__packed_file_begin(const char * path, size_t bytes, es_packed_writer * w, uint8_t ** weights);
// Writes the header (key, the weights' digest keyed with secret) and renames
// the file over path. The mapping stays (the caller munmaps w->map, w->size)
// whether or not it could be renamed; ES_ERR_IO: not renamed (the file is removed).
int  es__packed_file_commit(es_packed_writer * w, const char * path, const es_packed_key * key,
                            const uint8_t * secret);
// Unmaps and removes a file begun but not committed.
void es__packed_file_abandon(es_packed_writer * w);

/* ---- engine (model.c, arch/<name>.c, arch/registry.c) -------------------------- */

// A bound weight as es_matvec reads it: n_out rows of n_in elements of type,
// es_type_row_bytes(type, n_in) apart (ggml's (ne0, ne1) = (n_in, n_out)).
// Norm and bias vectors are one F32 row. data NULL: the model has no such tensor.
typedef struct es_weight {
    const void * data;    // inside the GGUF mapping
    const void * packed;  // its whole groups of 8 rows repacked (es_repack), in the model's
                          // memory; NULL: none (repacking off, a type without a layout)
    int32_t      type;    // enum es_type
    int64_t      n_in;    // elements per row
    int64_t      n_out;   // rows
} es_weight;

typedef struct es_layer {
    es_weight attn_norm;       // (n_embd)
    es_weight wq;              // (n_head * head_dim, n_embd)
    es_weight wk, wv;          // (n_head_kv * head_dim, n_embd)
    es_weight wo;              // (n_embd, n_head * head_dim)
    es_weight bq;              // (n_head * head_dim) F32 bias added to wq's output; qwen2
    es_weight bk, bv;          // (n_head_kv * head_dim) the same for wk, wv
    es_weight attn_q_norm;     // (head_dim) per-head RMSNorm of Q before RoPE; gemma3, qwen3moe
    es_weight attn_k_norm;     // (head_dim) the same for K
    es_weight attn_post_norm;  // (n_embd) on the attention output; gemma3
    es_weight ffn_norm;        // (n_embd)
    es_weight ffn_gate;        // (n_ff, n_embd); absent in MoE layers (model->experts)
    es_weight ffn_up;          // (n_ff, n_embd)
    es_weight ffn_down;        // (n_embd, n_ff)
    es_weight ffn_post_norm;   // (n_embd) on the FFN output; gemma3
    es_layer_traits traits;    // sliding window or not, RoPE base and scale
} es_layer;

typedef struct es_context es_context;
typedef struct es_arch es_arch;

struct es_model {
    es_gguf       * gguf;          // owned: every es_weight points into it
    const es_arch * arch;
    es_model_params params;        // as es_model_load got them
    // Hyperparameters, filled by arch->load.
    int32_t n_vocab, n_ctx_train;
    int32_t n_embd, n_layer;
    int32_t n_head, n_head_kv, head_dim;  // head_dim: key and value length alike
    int32_t n_ff;                         // dense FFN width (0 in an all-MoE model)
    int32_t n_rot;                        // rotated dimensions of a head (<= head_dim)
    float   norm_eps;                     // RMSNorm epsilon
    es_model_traits traits;               // the architecture's traits resolved for the file
    es_weight    tok_embd;                // (n_vocab, n_embd)
    es_weight    output_norm;             // (n_embd)
    es_weight    output;                  // (n_vocab, n_embd); tok_embd when tied
    // es_model_set_output_rows: the output layer's rows kept, and their ids.
    es_weight    output_rows;             // (n_output_rows, n_embd), data owned; unset: every row
    es_token   * output_ids;              // (n_output_rows) owned
    int32_t      n_output_rows;
    es_layer   * layers;                  // (n_layer), owned
    es_experts * experts;                 // owned; NULL for a dense model
    es_expert_cache * expert_cache;       // owned; NULL: experts served as params.experts says
    void       * packed;                  // owned: every es_weight's packed copy; NULL: none
    void       * packed_map;              // or the repack cache file mapped (munmap), holding it
    size_t       packed_map_size;
    int32_t      packed_from;             // enum es_packed_from
    char       * packed_file;             // owned: the repack cache file of this layout; NULL: none
};

// One architecture, found by general.architecture in es__archs.
// One row of an architecture's tensor table: the public spec, and the
// es_weight the loader binds it to.
typedef struct es_arch_row {
    es_tensor_spec spec;
    int32_t        field;  // offset of the es_weight in es_layer (per-layer rows) or in
                           // es_model (global ones); ES_UNBOUND: read elsewhere (the
                           // expert stacks: moe.c) or not by this engine (a fused attn_qkv)
} es_arch_row;

#define ES_UNBOUND (-1)
#define ES_LAYER_W(f) ((int32_t) offsetof(es_layer, f))
#define ES_MODEL_W(f) ((int32_t) offsetof(es_model, f))
#define ES_L  ES_TENSOR_LAYER
#define ES_R  ES_TENSOR_REQUIRED

// The rows every decoder here shares, for the tables to start from.
#define ES_TENSORS_EMBEDDINGS                                                                   \
    {{"token_embd.weight",  {ES_DIM_EMBD, ES_DIM_VOCAB}, ES_R}, ES_MODEL_W(tok_embd)},          \
    {{"output_norm.weight", {ES_DIM_EMBD},               ES_R}, ES_MODEL_W(output_norm)},       \
    {{"output.weight",      {ES_DIM_EMBD, ES_DIM_VOCAB}, 0},    ES_MODEL_W(output)}  // absent: tied
// Pre-norm attention; q_rows: the query projection's outputs (ES_DIM_Q, or
// ES_DIM_EMBD where llama.cpp reads it so whatever the heads).
#define ES_TENSORS_ATTENTION(q_rows)                                                            \
    {{"attn_norm.weight",   {ES_DIM_EMBD},              ES_L | ES_R}, ES_LAYER_W(attn_norm)},   \
    {{"attn_qkv.weight",    {ES_DIM_EMBD, ES_DIM_QKV},  ES_L},        ES_UNBOUND},              \
    {{"attn_q.weight",      {ES_DIM_EMBD, q_rows},      ES_L | ES_TENSOR_UNFUSED}, ES_LAYER_W(wq)}, \
    {{"attn_k.weight",      {ES_DIM_EMBD, ES_DIM_K},    ES_L | ES_TENSOR_UNFUSED}, ES_LAYER_W(wk)}, \
    {{"attn_v.weight",      {ES_DIM_EMBD, ES_DIM_V},    ES_L | ES_TENSOR_UNFUSED}, ES_LAYER_W(wv)}, \
    {{"attn_output.weight", {q_rows, ES_DIM_EMBD},      ES_L | ES_R}, ES_LAYER_W(wo)}
// Optional query, key and value biases (an absent one adds nothing), as
// llama.cpp reads them for llama and qwen2.
#define ES_TENSORS_ATTENTION_BIASES                                                             \
    {{"attn_q.bias", {ES_DIM_Q}, ES_L}, ES_LAYER_W(bq)},                                        \
    {{"attn_k.bias", {ES_DIM_K}, ES_L}, ES_LAYER_W(bk)},                                        \
    {{"attn_v.bias", {ES_DIM_V}, ES_L}, ES_LAYER_W(bv)}
#define ES_TENSORS_FFN_DENSE(flags)                                                             \
    {{"ffn_norm.weight", {ES_DIM_EMBD},              ES_L | ES_R},         ES_LAYER_W(ffn_norm)}, \
    {{"ffn_gate.weight", {ES_DIM_EMBD, ES_DIM_FF},   ES_L | ES_R | (flags)}, ES_LAYER_W(ffn_gate)}, \
    {{"ffn_up.weight",   {ES_DIM_EMBD, ES_DIM_FF},   ES_L | ES_R | (flags)}, ES_LAYER_W(ffn_up)},  \
    {{"ffn_down.weight", {ES_DIM_FF, ES_DIM_EMBD},   ES_L | ES_R | (flags)}, ES_LAYER_W(ffn_down)}
// The router and the three expert stacks (moe.c reads them).
#define ES_TENSORS_FFN_EXPERTS                                                                  \
    {{"ffn_gate_inp.weight",  {ES_DIM_EMBD, ES_DIM_EXPERT},                 ES_L | ES_R | ES_TENSOR_EXPERTS}, ES_UNBOUND}, \
    {{"ffn_gate_exps.weight", {ES_DIM_EMBD, ES_DIM_FF_EXP, ES_DIM_EXPERT},  ES_L | ES_R | ES_TENSOR_EXPERTS}, ES_UNBOUND}, \
    {{"ffn_up_exps.weight",   {ES_DIM_EMBD, ES_DIM_FF_EXP, ES_DIM_EXPERT},  ES_L | ES_R | ES_TENSOR_EXPERTS}, ES_UNBOUND}, \
    {{"ffn_down_exps.weight", {ES_DIM_FF_EXP, ES_DIM_EMBD, ES_DIM_EXPERT},  ES_L | ES_R | ES_TENSOR_EXPERTS}, ES_UNBOUND}

// How an architecture's layers compute their FFN (what validation requires of expert_count).
enum es_ffn_kind {
    ES_FFN_DENSE,            // ffn_gate, ffn_up, ffn_down in every layer
    ES_FFN_MOE,              // the router and the three expert stacks
    ES_FFN_BY_EXPERT_COUNT,  // MoE when <arch>.expert_count > 0 (llama: Mixtral)
};

struct es_arch {
    const char * name;
    const es_arch_row * tensors;  // (n_tensors) the tensor table
    int32_t      n_tensors;
    int32_t      ffn;                // enum es_ffn_kind
    bool         full_rope;          // value width = key width = RoPE dimensions (its graph asserts it)
    es_arch_traits traits;           // what its layers compute (es__decoder_layer reads them)
    // Reads the hyperparameters (m->gguf is open: es__load_decoder_hparams,
    // then its own keys) and binds every tensor (es__bind_tensors);
    // ES_ERR_FORMAT / ES_ERR_UNSUPPORTED with a one-line err. es__load_dense
    // is the whole load of a dense decoder.
    int (*load)(es_model * m, char * err, size_t err_cap);
    // One decoder layer over the batch: ctx->x (ctx->n, n_embd) in place;
    // es__decoder_layer computes every architecture here from its traits.
    int (*layer)(es_context * ctx, int32_t il);
};

#define ES_TABLE(t) (t), (int32_t) (sizeof (t) / sizeof (t)[0])

// The architecture called name, or NULL.
const es_arch * es__arch(const char * name);

extern const es_arch * const es__archs[];  // NULL-terminated

// One sequence of the batch being evaluated: rows [r0, r0 + n) of the
// batch buffers, whose K and V go to kv's cache after its n_past cells.
// A context's own es_decode has one (kv: the context itself); a group's
// es_decode_group one per member.
typedef struct es_seq_rows {
    es_context     * kv;         // its KV cache, n_past, cell_pos
    const es_token * tokens;     // (n)
    int32_t          r0, n;
    int32_t          keep_from;  // its rows [keep_from, n) give logits (or hidden states)
} es_seq_rows;

// What the shared blocks and the architectures' layers work on. Batch
// buffers hold up to n_batch token rows; ctx->n rows are in use, split into
// ctx->n_seqs sequences. A group's work context (es_group) has no KV cache
// of its own: k_cache, v_cache and cell_pos are NULL there.
struct es_context {
    es_model * model;
    es_pool  * pool;       // owned
    es_moe   * moe;        // owned; NULL for a dense model
    int32_t    n_ctx, n_batch, n_threads;
    int32_t    n_past;     // cells in use in the KV cache
    bool       embeddings; // es_decode stops at the final norm: xn holds the output rows
    bool       features;   // es_context_keep_features: xn's output rows kept beside the logits
    int32_t    n_embd_rows;// rows of xn holding the last decode's final-normed output rows
    int32_t    type_k, type_v; // the cache's types (es_context_params): ES_TYPE_F16 or ES_TYPE_Q8_0
    size_t     k_row, v_row;   // bytes of one cell's head_dim keys (values) in those types
    uint8_t  * k_cache;    // (n_layer, n_head_kv, n_ctx) rows of k_row bytes: keys after RoPE
                           // (Q8_0: rotated first, blocks.c)
    uint8_t  * v_cache;    // (n_layer, n_head_kv, n_ctx) rows of v_row bytes: values
    int32_t  * cell_pos;   // (n_ctx) position of the token in each cell
    // The batch being evaluated.
    int32_t    n;          // tokens, all sequences'
    es_seq_rows * seqs;    // (n_batch) the batch's sequences; row t's cell in seqs[s].kv is
                           // its n_past + t - seqs[s].r0, s = row_seq[t]
    int32_t    n_seqs;
    int32_t  * row_seq;    // (n_batch) the sequence of each row
    int32_t  * pos;        // (n_batch) positions
    uint8_t  * sees;       // (n_batch, n_batch) sees[i * n_batch + j]: token i attends to token j
                           // of its own sequence (j counted from the sequence's first row)
    float    * x;          // (n_batch, n_embd) residual stream
    float    * xn;         // (n_batch, n_embd) a block's normed input; after a decode with
                           // embeddings or features: the (n_embd_rows, n_embd) final-normed
                           // output rows
    float    * q;          // (n_batch, n_head * head_dim)
    float    * k;          // (n_batch, n_head_kv * head_dim)
    float    * v;          // (n_batch, n_head_kv * head_dim)
    float    * att;        // (n_batch, n_head * head_dim) attention output, per head
    float    * ff_gate;    // (n_batch, n_ff)
    float    * ff_up;      // (n_batch, n_ff)
    float    * out;        // (n_batch, n_embd) a block's output, before the residual add
    uint8_t  * act;        // (n_batch, act_row) matmul inputs in es_act_type format
    size_t     act_row;    // bytes: the widest activation row any weight needs
    float    * scratch;    // (n_threads, n_ctx + 3 * head_dim) per thread: attention scores
                           // (n_ctx), the query rotated (Q8_0 keys) and in the keys' dot
                           // format, and an accumulator (3 * head_dim); RoPE's (n_rot) cos, sin
                           // pairs use the calling thread's slice
    float    * logits;     // (rows, n_vocab) rows [logits_from, n) of the last es_decode
    size_t     logits_cap; // floats allocated at logits; grows on demand
    float    * kept;       // (rows, n_output_rows) the kept rows' logits before they are spread out
    size_t     kept_cap;
};

/* ---- binding (binding.c): what arch/<name>.c loaders bind with ------------- */

// Writes printf-style text to err (err_cap bytes, truncated; nothing where err is NULL).
void es__set_err(char * err, size_t err_cap, const char * fmt, ...);
// Binds every row of m->arch's tensor table that applies to m (dense rows
// without experts, expert rows with them) into its es_weight, in the shape
// m's hyperparameters give (m->layers allocated: es__load_decoder_hparams):
// sets n_vocab from token_embd, ties output to token_embd when the file has none.
// ES_UNBOUND rows are left to whoever reads them (the experts: moe.c); a
// layer with a fused attn_qkv instead of attn_q/k/v is ES_ERR_UNSUPPORTED.
// Errors name the tensor.
int es__bind_tensors(es_model * m, bool experts, char * err, size_t err_cap);
// Binds the per-layer rows of m->arch's table alone, dense rows only (a
// draft head: one layer of its target's architecture, without the target's
// embeddings).
int es__bind_layers(es_model * m, char * err, size_t err_cap);
// Reads <arch>.<key> (an integer or float) into *out; absent and not
// required: *out unchanged. Errors name the key.
int es__key_i32(const es_model * m, const char * key, bool required, int32_t * out,
                char * err, size_t err_cap);
int es__key_f32(const es_model * m, const char * key, bool required, float * out,
                char * err, size_t err_cap);
// RoPE frequency scale as llama.cpp derives it: 1 / rope.scaling.factor (or
// rope.scale_linear) unless rope.scaling.type is "none"; YaRN and LongRoPE
// are ES_ERR_UNSUPPORTED.
int es__rope_freq_scale(const es_model * m, float * scale, char * err, size_t err_cap);
// Reads and checks the attention hyperparameters all architectures share
// (n_embd, n_layer, n_head, n_head_kv, head_dim = value length = n_rot,
// n_ctx_train, norm_eps) and resolves m->arch's traits for the file:
// m->traits, and m->layers allocated (zeroed) with each layer's traits (RoPE
// base, default 10000, and linear scale; the sliding window).
int es__load_decoder_hparams(es_model * m, char * err, size_t err_cap);
// The load of a dense decoder: es__load_decoder_hparams,
// feed_forward_length, every tensor of the table bound.
int es__load_dense(es_model * m, char * err, size_t err_cap);
// The decoder layer (arch/decoder.c) as m->traits say: pre-norm attention
// (biases as es__attention_inputs adds them, per-head Q/K norms, RoPE,
// scaling, the sliding window), post-norms, and the FFN (dense with the
// traits' activation, or the experts).
int es__decoder_layer(es_context * ctx, int32_t il);
// The vocabulary projection of ctx->xn's first rows rows (model.c) into
// ctx->logits (grown as needed): the output layer or its kept rows
// (es_model_set_output_rows, the others -infinity), soft-capped where the
// model's traits say.
int es__output_logits(es_context * ctx, int32_t rows);

/* ---- blocks (blocks.c), over ctx->n token rows --------------------------------
 * Each row is computed the same way whatever the batch, so results are batch
 * invariant. */

// y = x / rms(x) * w, for n_rows rows of dim (w: (dim) F32, or data NULL: no weight).
// x and y may be the same.
void es__rms_norm(const float * x, const es_weight * w, float * y, int64_t n_rows, int64_t dim,
                  float eps);
// y (n, w->n_out) = x (n, w->n_in) times w^T, for up to three weights reading
// the same x; parallel over output rows.
int  es__matmul(es_context * ctx, int32_t n_w, const es_weight * const * w, const float * x,
                float * const * y, int32_t n);
// ctx->xn = layer il's attn_norm(ctx->x); ctx->q, k, v = xn times wq, wk, wv,
// plus bq, bk, bv where the layer has them.
int  es__attention_inputs(es_context * ctx, int32_t il);
// RoPE in place on x (ctx->n, n_heads * head_dim), at ctx->pos, with layer il's base/scale.
void es__rope(es_context * ctx, int32_t il, float * x, int32_t n_heads);
// Attention of layer il: stores ctx->k, ctx->v (after RoPE) in each row's
// sequence's cache, then ctx->att = softmax(q k^T * kq_scale) v over the
// cells each token sees (its sequence's cache, its ancestors and itself).
void es__attention(es_context * ctx, int32_t il, float kq_scale);
// ctx->out = down(act(gate(xn)) * up(xn)) for layer il's dense FFN (act: enum es_activation).
int  es__ffn(es_context * ctx, int32_t il, int32_t act);
// x += y over n floats.
void es__add(float * x, const float * y, int64_t n);
// g = silu(g) * u over n floats (the SwiGLU of dense FFNs and experts alike).
void es__swiglu(float * g, const float * u, int64_t n);

#endif  // EDGESPEC_NATIVE_H
