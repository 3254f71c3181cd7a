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
 * GGUF reader
 *
 * A GGUF file (v2 or v3, little-endian) mapped read-only and validated
 * before anything is handed out: every count, offset, size, string length,
 * alignment and type id is checked against the file, so a damaged or hostile
 * file ends in ES_ERR_FORMAT / ES_ERR_UNSUPPORTED with a one-line reason.
 * Keys, tensor names and string values are NUL-terminated copies owned by the
 * es_gguf; tensor data, arrays and es_gguf_value data point into the mapping.
 * Everything a getter returns is valid until es_gguf_close.
 * ======================================================================== */

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
    const char * name;         // "Q4_K", ...; static
    int32_t      block;        // elements per block (1 for plain types)
    int32_t      block_bytes;  // bytes per block
    int16_t      scale_bytes;  // a block's float scales: 2 (F16), 4 (F32, Q8_K); 0: none known
    int16_t      scales[2];    // their byte offsets in the block (d, then dmin or sum); -1: none
} es_type_traits;

// NULL for an id ggml does not define (or has retired); static storage.
const es_type_traits * es_type_info(int32_t type);
// es_type_info(type)->name, or "unknown"; static.
const char * es_type_name(int32_t type);

// GGUF metadata value types, as stored in the file.
enum es_gguf_type {
    ES_GGUF_U8 = 0,  ES_GGUF_I8 = 1,   ES_GGUF_U16 = 2,    ES_GGUF_I16 = 3,   ES_GGUF_U32 = 4,
    ES_GGUF_I32 = 5, ES_GGUF_F32 = 6,  ES_GGUF_BOOL = 7,   ES_GGUF_STRING = 8, ES_GGUF_ARRAY = 9,
    ES_GGUF_U64 = 10, ES_GGUF_I64 = 11, ES_GGUF_F64 = 12,
};

typedef struct es_gguf es_gguf;

typedef struct es_tensor {
    const char * name;    // NUL-terminated, owned by the es_gguf
    int32_t      type;    // enum es_type
    int32_t      n_dims;  // 1..4
    int64_t      ne[4];   // elements per dimension, ne[0] innermost (a row); unused dims 1
    const void * data;    // (nbytes) inside the mapping, aligned to general.alignment
    size_t       nbytes;  // checked against the file size
} es_tensor;

// Maps and validates a GGUF file. On failure *out stays NULL and, when err
// is not NULL, err holds a NUL-terminated one-line reason (truncated to
// err_cap bytes) that does not repeat the path. ES_ERR_IO: missing,
// unreadable or not a regular file; ES_ERR_FORMAT: damaged, not GGUF, or a
// version other than 2 and 3; ES_ERR_UNSUPPORTED: a tensor type id ggml
// does not define; ES_ERR_INVALID_ARG: a NULL path or out.
int  es_gguf_open(const char * path, es_gguf ** out, char * err, size_t err_cap);
// The same over a caller's buffer, which must outlive the es_gguf (fuzzing, tests).
int  es_gguf_open_buffer(const void * data, size_t size, es_gguf ** out, char * err, size_t err_cap);
void es_gguf_close(es_gguf * g);  // NULL is a no-op

int32_t es_gguf_version(const es_gguf * g);    // 2 or 3
int64_t es_gguf_alignment(const es_gguf * g);  // general.alignment, or its default 32
// Byte offset of the tensor data section in the file (a multiple of the alignment).
int64_t es_gguf_data_offset(const es_gguf * g);

int64_t           es_gguf_n_tensors(const es_gguf * g);
const es_tensor * es_gguf_tensor_at(const es_gguf * g, int64_t i);           // NULL out of range
const es_tensor * es_gguf_find_tensor(const es_gguf * g, const char * name);  // NULL: absent

// Metadata keys in file order; NULL / -1 out of range or absent.
int64_t      es_gguf_n_kv(const es_gguf * g);
const char * es_gguf_key_at(const es_gguf * g, int64_t i);
int64_t      es_gguf_find_key(const es_gguf * g, const char * key);
int32_t      es_gguf_key_type(const es_gguf * g, int64_t i);  // enum es_gguf_type

// Metadata lookups by key; false when the key is absent or of another kind.
// Integers of any width convert when the value fits.
bool         es_gguf_get_i64(const es_gguf * g, const char * key, int64_t * out);
bool         es_gguf_get_f32(const es_gguf * g, const char * key, float * out);  // f32 or f64
bool         es_gguf_get_bool(const es_gguf * g, const char * key, bool * out);
const char * es_gguf_get_str(const es_gguf * g, const char * key);  // NUL-terminated, owned by g
// A numeric array: its element type (enum es_gguf_type), length and data
// (little-endian, inside the mapping). Per-layer hyperparameters use these.
bool es_gguf_get_arr(const es_gguf * g, const char * key, int32_t * elem_type, uint64_t * n,
                     const void ** data);

// Any value, as it lies in the file (dumps, the Python reader).
typedef struct es_gguf_value {
    int32_t      type;       // enum es_gguf_type
    int32_t      elem_type;  // ES_GGUF_ARRAY: the elements' type; otherwise -1
    uint64_t     n;          // ES_GGUF_STRING: bytes; ES_GGUF_ARRAY: elements; scalars: 1
    const void * data;       // inside the mapping: a scalar's little-endian bytes, a string's
                             // bytes (no NUL), an array's first element
} es_gguf_value;

// The value of key i; false out of range.
bool es_gguf_value_at(const es_gguf * g, int64_t i, es_gguf_value * out);
// The elements of arr (an ES_GGUF_ARRAY value from es_gguf_value_at or from
// this function) into out[0 .. arr->n): strings and nested arrays have no
// fixed size, so they are found by walking the array. ES_ERR_INVALID_ARG:
// arr is not an array; ES_ERR_BUFFER_TOO_SMALL: cap < arr->n.
int  es_gguf_array_elems(const es_gguf_value * arr, es_gguf_value * out, uint64_t cap);

/* ========================================================================
 * Weight types and kernels
 * ======================================================================== */

// Converts n elements (whole blocks) of a weight type to floats.
// ES_ERR_UNSUPPORTED: a type the kernels lack; ES_ERR_INVALID_ARG: n <= 0
// or not a multiple of the type's block.
int es_dequantize_row(int32_t type, const void * src, float * dst, int64_t n);
// Quantizes n floats (whole blocks) to Q2_K or Q3_K, GGUF's layouts (the
// expert sidecar's low-precision copies): per sub-block of 16 the scale
// (and Q2_K min) of least squared error. ES_ERR_UNSUPPORTED: another type;
// ES_ERR_INVALID_ARG: n <= 0 or not a multiple of 256, or a value not
// finite or beyond half precision's range.
int es_quantize_row(int32_t type, const float * src, void * dst, int64_t n);

// The kernel set the dot products run on, for the whole process: "avx512"
// (AVX-512 VNNI), "avx2", "neon" or "scalar" ("auto": the best this CPU
// runs; the default). For the quantized weight types every set gives
// bit-identical results (one per-token arithmetic); for F32/F16/BF16 each
// set sums in its own order.
// ES_ERR_UNSUPPORTED: a set this CPU (or build) lacks; ES_ERR_INVALID_ARG: an
// unknown name. Not to be called while any es_decode runs.
int          es_kernels_select(const char * name);
const char * es_kernels_name(void);                 // the set in use; static
const char * es_kernels_available(int32_t i);      // i-th set this CPU runs, best first; NULL past the end

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

// How es_model_load serves experts' weights (MoE models).
enum es_experts_mode {
    ES_EXPERTS_MAPPED = 0,  // straight from the mapping
    ES_EXPERTS_F32    = 1,  // F32 copies made on demand (the path an expert cache takes; tests)
};

// What a cache miss of an expert that matters little to a token is served
// from (expert cache): the full-precision weights always (EXACT: output
// bit-identical to the unlimited engine), or the low-precision copy of the
// sidecar when the expert's routing weight is below half the mean weight
// of the top k, 0.5 / k (BALANCED; 0.25 for top 2), or on every miss (FAST).
enum es_expert_precision {
    ES_PRECISION_EXACT = 0, ES_PRECISION_BALANCED = 1, ES_PRECISION_FAST = 2,
};

// Which cached expert makes room: ADAPTIVE weighs how often an expert was
// used lately (decaying frequency) against how many layers away its next
// use is; LRU takes the least recently used (the benchmark's baseline).
enum es_expert_policy { ES_POLICY_ADAPTIVE = 0, ES_POLICY_LRU = 1 };

typedef struct es_model_params {
    int32_t experts;  // enum es_experts_mode; default ES_EXPERTS_MAPPED
    // > 0: expert weights are not read through the mapping but with pread
    // into a cache of at most this many bytes, on an I/O thread (MoE
    // models; ignored by dense ones). Default 0: no cache.
    int64_t expert_cache_bytes;
    int32_t expert_precision;     // enum es_expert_precision; default EXACT
    int32_t expert_policy;        // enum es_expert_policy; default ADAPTIVE
    int32_t prefetch_depth;       // most layers ahead whose experts are predicted and
                                  // loaded early (at most ES_PREFETCH_DEPTHS; the depth
                                  // adapts to the stall per token measured at each and
                                  // how many prefetches are used); 0: none; default 3
    const char * expert_sidecar;  // low-precision copies (es_expert_sidecar_*); NULL: none;
                                  // required by BALANCED and FAST; read at load only
    // Most bytes the repacked weights (repack) may take; <= 0: the memory the
    // system says is available at load (Linux: MemAvailable); default 0.
    int64_t repack_max_bytes;
    // Weight matrices rewritten at load, once, into the engine's own memory in
    // groups of 8 rows interleaved block by block (the tile kernels' layout;
    // about the matrices' size again, the GGUF untouched), for the types the
    // kernel set in use (es_kernels_select) has tile kernels for: a batch of k
    // tokens then costs far less than k single tokens. Results are
    // bit-identical either way. Default true.
    bool repack;
    // With repack: where a file keeps the repacked weights between loads
    // (the caller's cache folder and a name's start; NULL: none). The file
    // is this followed by the 16 hex digits of the packed layout and
    // ".pack" (es_model_packed_file), so kernel sets that lay the weights out
    // alike share one. A file written for this GGUF (its size, times, ctime,
    // header and sampled data) and this layout, whose digest matches under
    // repack_secret, is mapped instead of repacking (page-cache pages:
    // nothing to copy or zero, shared between processes, no
    // repack_max_bytes check); otherwise the weights are repacked and
    // written there (beside it, then renamed), so a file a crash left
    // damaged is written again. Only a regular file of this user's that no
    // group or other user may write is read (opened without following a
    // symlink or waiting on a FIFO); anything else is left as it is and the
    // weights are repacked in memory (ES_PACKED_FOREIGN). A file that cannot
    // be written costs nothing but the next load's repack. Read at load only.
    const char * repack_cache;
    // With repack_cache: ES_REPACK_SECRET_BYTES bytes of the cache's secret
    // that the weights' digest is keyed with (a file whose weights were
    // altered and its digest recomputed without it is refused); NULL: the
    // cache is not used. Read at load only.
    const uint8_t * repack_secret;
} es_model_params;

// Where a loaded model's repacked weights came from.
enum es_packed_from {
    ES_PACKED_NONE    = 0,  // not repacked (repack off, or no type with a repacked layout)
    ES_PACKED_REPACKED = 1, // repacked at load (no repack_cache, or it could not be written)
    ES_PACKED_WRITTEN = 2,  // repacked at load and written to repack_cache
    ES_PACKED_MAPPED  = 3,  // mapped from repack_cache
    ES_PACKED_FOREIGN = 4,  // repacked at load: the repack cache file was not a regular file of this
                            // user's that no one else may write (left as it was)
};

enum { ES_REPACK_SECRET_BYTES = 32 };  // of es_model_params.repack_secret

es_model_params es_model_default_params(void);

// Loads and fully validates a GGUF file (params NULL: the defaults). On
// failure *out stays NULL and err is as for es_gguf_open. ES_ERR_IO,
// ES_ERR_FORMAT: as es_gguf_open, refused by es_gguf_validate (below), or
// tensors and keys the architecture needs missing or misshapen; ES_ERR_UNSUPPORTED: an architecture or weight
// type this build lacks; ES_ERR_INVALID_ARG: a NULL path or out, a bad params field;
// ES_ERR_NO_MEMORY: the repacked weights would not fit repack_max_bytes (err
// gives both sizes; nothing was allocated for them), or memory ran out.
int  es_model_load(const char * path, const es_model_params * params, es_model ** out,
                   char * err, size_t err_cap);
void es_model_free(es_model * model);

const char * es_model_arch(const es_model * model);  // "llama", "gemma3", ...; owned by model
int32_t es_model_n_vocab(const es_model * model);

// Restricts the output layer to the rows of the n token ids in ids (a draft
// model's head trimmed to the target's most frequent tokens: its cost per
// token falls with the rows it skips): es_decode then computes those logits
// only and sets every other one to -infinity, so rows stay n_vocab wide.
// The rows are copied once, here; n = 0 (ids NULL) computes every row again.
// Call it between decodes, with no context decoding. ES_ERR_INVALID_ARG: an
// id outside the vocabulary, or twice; ES_ERR_NO_MEMORY.
int es_model_set_output_rows(es_model * model, const es_token * ids, int32_t n);
int32_t es_model_n_embd(const es_model * model);     // width of a hidden state
int32_t es_model_packed_from(const es_model * model);  // enum es_packed_from
// The repack cache file of the model's layout (repack_cache, the layout's 16
// hex digits, ".pack"); "" without repack_cache. Owned by model.
const char * es_model_packed_file(const es_model * model);
int32_t es_model_n_ctx_train(const es_model * model);

typedef struct es_context_params {
    int32_t n_ctx;      // KV cache capacity in tokens; <= 0: the model's training context; default 4096
    int32_t n_batch;    // most tokens one es_decode takes (at most n_ctx: larger is cut); default 512
    int32_t n_threads;  // worker threads; <= 0: one per online CPU; default 0
    // The KV cache's key and value types: ES_TYPE_F16 (default; llama.cpp's)
    // or ES_TYPE_Q8_0 (blocks of 32: an F16 scale and 32 int8, ggml's
    // block_q8_0; 1.0625 bytes a value instead of 2; head_dim a multiple of
    // 32). Q8_0 keys are stored rotated (a Hadamard transform of each head
    // row where head_dim is a power of two, as llama.cpp's quantized keys)
    // and meet the query, rotated alike and rounded to Q8_0, in an int8 dot
    // product (ggml's vec_dot_type for Q8_0); Q8_0 values are read block by block.
    int32_t type_k, type_v;
    bool    embeddings; // es_decode keeps the hidden states after the final norm of rows
                        // [logits_from, n) (es_context_embeddings) instead of logits, and
                        // skips the vocabulary projection; default false
} es_context_params;

es_context_params es_context_default_params(void);

// Makes a context on model, which must outlive it. *out is set on ES_OK only.
// ES_ERR_INVALID_ARG: a cache type other than F16 and Q8_0; ES_ERR_UNSUPPORTED:
// Q8_0 for a model whose head_dim is not a multiple of 32.
int  es_context_init(es_model * model, const es_context_params * params, es_context ** out);
void es_context_free(es_context * ctx);

int32_t es_context_n_ctx(const es_context * ctx);
int32_t es_context_n_batch(const es_context * ctx);
int32_t es_context_n_past(const es_context * ctx);  // tokens held in the KV cache
// Bytes one cell of the KV cache takes: every layer's keys and values of one
// token in the context's cache types (the cache is n_ctx such cells).
size_t  es_context_kv_cell_bytes(const es_context * ctx);

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

// The (n - logits_from, n_vocab) logits of the last es_decode (or
// es_decode_group ctx was a member of); owned by ctx, valid until the next
// one or es_context_free. NULL with embeddings.
const float * es_context_logits(const es_context * ctx);

// With es_context_params.embeddings, or with features kept
// (es_context_keep_features): the (n - logits_from, n_embd) hidden states
// after the final norm of the last es_decode (or es_decode_group ctx was a
// member of), the input of the vocabulary projection: what embeddings pool,
// and the target feature a draft head reads (EAGLE's), one row per logits
// row. Owned by ctx, valid until the next decode or es_context_free. NULL
// without either, before a decode, or when it kept no rows.
const float * es_context_embeddings(const es_context * ctx);

// Whether es_decode keeps the hidden states of the rows whose logits it
// keeps (es_context_embeddings) beside them; off when a context is made.
// They cost nothing: the vocabulary projection reads them from the context's
// own buffer, so they are only left there (a group decode copies each
// member's rows into it). From the next decode on; on an embeddings context
// it changes nothing.
void es_context_keep_features(es_context * ctx, bool on);

// Keeps the first n_keep cells of the KV cache (rollback); n_keep in [0, n_past].
int es_context_truncate(es_context * ctx, int32_t n_keep);

// The KV cache's state, to save a conversation and restore it later into a
// context of the same model and cache types (any n_ctx that holds it): the
// cache's types (int32 type_k, type_v: its first 8 bytes), then the keys,
// values and positions of its n_past cells. es_context_state_size: the bytes
// es_context_state_get writes (ES_ERR_INVALID_ARG when cap is smaller, or
// on an embeddings context). es_context_state_set replaces the cache with
// such a state of n_past cells; ES_ERR_INVALID_ARG when its types are not the
// context's, size is not n_past cells' for this model, n_past exceeds n_ctx
// or a position is impossible (the cache is then unchanged).
size_t es_context_state_size(const es_context * ctx);
int    es_context_state_get(es_context * ctx, void * buf, size_t cap);
int    es_context_state_set(es_context * ctx, const void * buf, size_t size, int32_t n_past);

/* ---- groups: several sequences in one batch ------------------------------- */

// An es_group evaluates several contexts' batches at once (continuous
// batching: one request per context): the weight products run over all
// members' rows stacked, so each weight is read once for the group, while
// attention and the KV writes stay each member's own. Every row's result is
// what its own es_decode would give, bit for bit (batch invariance). The
// group owns the batch buffers, the thread pool and the logits of its
// decodes; the members' own pools and buffers stay idle meanwhile.
typedef struct es_group es_group;

typedef struct es_group_params {
    int32_t n_batch;    // most tokens of all members together in one es_decode_group; default 64
    int32_t n_ctx;      // the largest member context (attention scratch); <= 0: the model's
                        // training context; default 4096
    int32_t n_threads;  // worker threads; <= 0: one per online CPU; default 0
} es_group_params;

es_group_params es_group_default_params(void);

// Makes a group for model, which must outlive it. *out is set on ES_OK only.
// ES_ERR_INVALID_ARG: NULL model or out, n_batch <= 0; ES_ERR_NO_MEMORY.
int  es_group_init(es_model * model, const es_group_params * params, es_group ** out);
void es_group_free(es_group * group);
int32_t es_group_n_batch(const es_group * group);

// One member of a group decode: what es_decode(ctx, tokens, parents, n,
// logits_from) would evaluate. The arrays are the caller's, read during the call.
typedef struct es_group_seq {
    es_context     * ctx;          // its KV cache; a context of the group's model, without embeddings
    const es_token * tokens;       // (n)
    const int32_t  * parents;      // (n) as es_decode's (within the member's own tokens); NULL: a chain
    int32_t          n;
    int32_t          logits_from;  // the member's logits rows: tokens [logits_from, n)
} es_group_seq;

// Evaluates n_seqs members in one batch, each appended to its own context's
// cache. ES_ERR_INVALID_ARG: a member of another model, an embeddings
// context, one whose n_ctx exceeds the group's, a context given twice, bad
// tokens, parents or logits_from, a context keeping features given more
// logits rows than its n_batch, or more than es_group_n_batch tokens in
// all; ES_ERR_CONTEXT_FULL: a member's cache would overflow; ES_ERR_IO: an
// expert read failed; ES_ERR_NO_MEMORY. On error every member's cache is as
// before. On success each member's logits (and features, when it keeps
// them) are its context's (es_context_logits, es_context_embeddings), as
// after its own es_decode.
int es_decode_group(es_group * group, const es_group_seq * seqs, int32_t n_seqs);

/* ---- expert cache (expert_cache.c) ---------------------------------------- */

// Depths (layers ahead) whose prefetches the expert cache counts apart, and
// the deepest it prefetches.
enum { ES_PREFETCH_DEPTHS = 8 };

// Counters of a model's expert cache since load (or the last reset).
typedef struct es_expert_stats {
    int64_t budget_bytes;    // expert_cache_bytes as given
    int64_t cache_bytes;     // bytes of the cache's slots: never above budget_bytes
    int32_t n_slots;         // experts it holds at once
    int32_t prefetch_depth;  // layers ahead prefetched now
    int64_t tokens;          // tokens through the first MoE layer
    int64_t lookups;         // experts asked for (per layer and batch)
    int64_t hits;            // found cached (or on their way: prefetched)
    int64_t loads;           // reads from disk queued (misses and prefetches), so that
                             // loads = lookups - hits + prefetches at any time
    int64_t bytes_read;      // bytes of those reads finished (some may be in flight)
    int64_t substitutions;   // lookups served by a low-precision copy
    int64_t prefetches;      // loads queued by prefetch (one cancelled unread is none)
    int64_t prefetch_used;   // of those, used before being evicted
    int64_t prefetches_at[ES_PREFETCH_DEPTHS];     // prefetches by depth: [d - 1] d layers
    int64_t prefetch_used_at[ES_PREFETCH_DEPTHS];  // ahead; and of those, used
    int64_t evictions;
    int64_t stall_ns;        // time decoding waited for reads
} es_expert_stats;

// ES_ERR_INVALID_ARG: no model, or a model without an expert cache.
int es_model_expert_stats(const es_model * model, es_expert_stats * out);
void es_model_expert_stats_reset(es_model * model);
// The one-line reason of the last failed read (file changed on disk, short
// read, sidecar checksum); "" when none. Owned by model.
const char * es_model_expert_error(const es_model * model);

// The low-precision sidecar (edgespec moe prepare): a header that ties it to
// one model file (its size, and a checksum of its metadata and routers),
// then per layer and expert one low-precision copy of gate, up and down
// (Q2_K or Q3_K; Q4_0 for rows that are not whole super-blocks), each with
// its checksum (layout: expert_cache.c).
#define ES_SIDECAR_MAGIC "ESMOELP1"
// The checksum the sidecar uses, over n bytes (n a multiple of 8): the sum
// of each little-endian 64-bit word times (2i + 1), modulo 2^64.
uint64_t es_sidecar_checksum(const void * data, size_t n);

/* ========================================================================
 * Draft heads (head.c)
 *
 * A draft head (EAGLE-1) drafts from its target's own hidden states: one
 * decoder layer of the target's width, computed by the target's layer code
 * (its architecture's traits), over
 *
 *   x = fc_feature · f + fc_token · embed(t) (+ fc.bias)
 *
 * where f is the target's hidden state after its final norm at a position
 * (es_context_keep_features) and t the token that follows it: the single
 * (2 n_embd -> n_embd) fc of EAGLE over [f, embed(t)], stored as its two
 * halves. The layer's output is the head's guess of the target's next
 * feature: it goes straight into the target's output layer (as EAGLE-1,
 * no final norm; the target's soft-cap applies) and, while drafting a chain,
 * back in as the next row's f. The head has its own small KV cache of
 * (f, t) rows; it borrows the target's token embeddings and output layer,
 * so the target must outlive it. Its output may be restricted to a subset
 * of the vocabulary (es_head_set_output_rows: FR-Spec).
 *
 * The file: a GGUF with general.architecture "eagle"; keys eagle.* as a
 * decoder's (embedding_length = the target's, block_count = 1,
 * attention.head_count[_kv], attention.key_length, feed_forward_length,
 * attention.layer_norm_rms_epsilon, rope.freq_base), the tensors
 * fc_feature.weight, fc_token.weight (n_embd, n_embd), fc.bias (n_embd,
 * optional) and blk.0.* as one layer of the target's architecture; the
 * target it was made for (eagle.target.name, .architecture, .vocab_size,
 * .block_count, .digest = es_head_target_digest of the target) and
 * eagle.digest, es_head_digest over every tensor in file order.
 * ======================================================================== */

typedef struct es_head es_head;

typedef struct es_head_params {
    int32_t n_ctx;      // the head's KV cache, in rows; <= 0: the target's training context; default 4096
    int32_t n_batch;    // most rows one es_head_decode takes (at most n_ctx); default 512
    int32_t n_threads;  // worker threads; <= 0: one per online CPU; default 0
} es_head_params;

es_head_params es_head_default_params(void);

// What identifies a target for its heads: its vocabulary size, width and
// layer count, its token embedding's type, shape and 64 rows spread over it,
// and its token texts (tokenizer.ggml.tokens): cheap (no pass over the
// weights) and different for another model, tokenizer or width.
// ES_ERR_INVALID_ARG: g or out NULL; ES_ERR_FORMAT: g has no token_embd.weight.
int es_head_target_digest(const es_gguf * g, uint64_t * out);

// Folds one tensor (its name, then its n bytes of data) into a head's
// content digest h (0 to start): eagle.digest is every tensor's, in file
// order (FNV-1a).
uint64_t es_head_digest(uint64_t h, const char * name, const void * data, size_t n);

// Loads the head file at path for target (borrowed: it must outlive the
// head). On failure *out stays NULL and err holds a one-line reason that
// does not repeat the path. ES_ERR_IO: missing or unreadable; ES_ERR_FORMAT:
// damaged, cut short, eagle.digest not the tensors', a key or tensor
// missing or misshapen, a tensor the head does not read; ES_ERR_INVALID_ARG:
// NULL arguments, or a head made for another target (another vocabulary,
// tokenizer, width or layer count: err names both); ES_ERR_UNSUPPORTED: a
// weight type the kernels lack, a mixture-of-experts target;
// ES_ERR_NO_MEMORY.
int  es_head_init(es_model * target, const char * path, const es_head_params * params, es_head ** out,
                  char * err, size_t err_cap);
void es_head_free(es_head * head);  // NULL is a no-op

int32_t es_head_n_ctx(const es_head * head);
int32_t es_head_n_batch(const es_head * head);
int32_t es_head_n_past(const es_head * head);  // rows held in the head's cache

// Appends n rows to the head's cache: row i reads features[i] (n_embd
// floats: a target feature, or the head's own output of the row before
// while drafting) and tokens[i] (the token after that feature's position).
// Rows [logits_from, n) keep their logits (es_head_logits) and outputs
// (es_head_hidden). Each row's results are the same whatever the batch.
// ES_ERR_CONTEXT_FULL: n_past + n > n_ctx; ES_ERR_INVALID_ARG: n outside
// [1, n_batch], a token outside the vocabulary, bad logits_from. On error
// the cache is as before.
int es_head_decode(es_head * head, const float * features, const es_token * tokens, int32_t n,
                   int32_t logits_from);

// The last es_head_decode's (n - logits_from, n_vocab) logits (-infinity
// outside a restricted output) and (n - logits_from, n_embd) layer outputs
// (the guessed next features); owned by head, valid until its next decode.
const float * es_head_logits(const es_head * head);
const float * es_head_hidden(const es_head * head);

// Keeps the first n_keep rows of the head's cache; n_keep in [0, n_past].
int es_head_truncate(es_head * head, int32_t n_keep);

// Computes the logits of the n tokens ids only (the others -infinity), as
// es_model_set_output_rows does for a model; n = 0 (ids NULL): every row.
// ES_ERR_INVALID_ARG: an id outside the vocabulary, or twice; ES_ERR_NO_MEMORY.
int es_head_set_output_rows(es_head * head, const es_token * ids, int32_t n);

/* ========================================================================
 * Architectures (arch/<name>.c)
 *
 * Each architecture the engine reads is one file holding its tensor table:
 * every tensor it reads, its shape written in hyperparameters, whether it is
 * required, per layer or global. The loader binds the weights by the table,
 * es_gguf_validate checks a file against it, and the Python layer reads it
 * (es_arch_tensor; es_gguf_arch_shapes resolves it for a file) instead of
 * deriving shapes again. Its traits (es_arch_traits: RoPE layout, norms,
 * activation, scales, sliding window) are described once the same way
 * (es_arch_get_traits; es_gguf_arch_traits resolves them for a file).
 * ======================================================================== */

// The hyperparameter an axis of a tensor's shape is.
enum es_dim {
    ES_DIM_ONE = 0,   // an axis of size 1 (a vector's second axis, a matrix's third)
    ES_DIM_EMBD,      // <arch>.embedding_length
    ES_DIM_VOCAB,     // the vocabulary's token count
    ES_DIM_FF,        // <arch>.feed_forward_length
    ES_DIM_Q,         // head_count * key length: the query projection's outputs
    ES_DIM_K,         // head_count_kv * key length
    ES_DIM_V,         // head_count_kv * value length
    ES_DIM_HEAD,      // key length (a per-head norm)
    ES_DIM_QKV,       // Q + K + V: the three projections in one matrix
    ES_DIM_EXPERT,    // <arch>.expert_count
    ES_DIM_FF_EXP,    // <arch>.expert_feed_forward_length
    ES_DIM_COUNT
};

enum es_tensor_flags {
    ES_TENSOR_LAYER    = 1,   // one per layer, named "blk.<il>." + name; else one, named name
    ES_TENSOR_REQUIRED = 2,   // a file without it is refused
    ES_TENSOR_DENSE    = 4,   // only in a model without experts (expert_count 0)
    ES_TENSOR_EXPERTS  = 8,   // only in a model with experts
    ES_TENSOR_UNFUSED  = 16,  // required unless the layer has attn_qkv (Q, K, V in one matrix)
};

typedef struct es_tensor_spec {
    const char * name;   // "attn_q.weight", "token_embd.weight"
    int32_t      ne[3];  // enum es_dim of each axis, ggml order: ne[0] is the input width
    int32_t      flags;  // enum es_tensor_flags
} es_tensor_spec;

// The architectures the engine reads ("llama", ...), by index from 0; NULL past the last.
const char * es_arch_name(int32_t i);
// The i-th row (from 0) of architecture arch's tensor table into *out
// (strings owned by the library). False past the last row, or for an
// architecture the engine does not read.
bool es_arch_tensor(const char * arch, int32_t i, es_tensor_spec * out);

// One table row resolved for a file: its full name and shape.
typedef struct es_tensor_shape {
    char    name[80];    // "blk.3.attn_q.weight"
    int64_t ne[3];       // ggml order; -1: any (the vocabulary of a file without one)
    int32_t flags;       // the row's es_tensor_flags
} es_tensor_shape;

// The tensors file g's architecture reads, each layer's and the global
// ones, with the shapes g's hyperparameters give, in table order; rows that
// do not apply to g (dense rows in a file with experts, and so on) left out.
// Sets *n to their count and fills out[0 .. min(*n, cap)). ES_OK;
// ES_ERR_UNSUPPORTED for an architecture the engine does not read;
// ES_ERR_FORMAT (err as for es_gguf_validate) when g's hyperparameters are
// refused; ES_ERR_INVALID_ARG for a NULL g or n.
int es_gguf_arch_shapes(const es_gguf * g, es_tensor_shape * out, int32_t cap, int32_t * n,
                        char * err, size_t err_cap);

// An architecture's traits: what its layers compute besides the tensors,
// one description that the native layer (arch/decoder.c), the ONNX exporter,
// the float64 reference and the training network all read.

// RoPE layouts, as llama.cpp names them: NORM rotates adjacent pairs
// (x[2i], x[2i+1]) (llama); NEOX rotates (x[i], x[i + n_rot/2]) (gemma3, qwen2, qwen3moe).
enum es_rope_type { ES_ROPE_NORM = 0, ES_ROPE_NEOX = 2 };
// The FFN's gate: down(act(gate(x)) * up(x)).
enum es_activation {
    ES_ACT_SILU      = 0,  // x * sigmoid(x) (SwiGLU; every expert's too)
    ES_ACT_GELU_TANH = 1,  // GELU in its tanh form (GeGLU)
};
// How attention scores are scaled.
enum es_attn_scale {
    ES_ATTN_SCALE_SCORES = 0,  // q.k / sqrt(head_dim)
    ES_ATTN_SCALE_Q_GEMMA3 = 1,// Q times 1/sqrt(head_dim) before attention (as llama.cpp, before
                               // its F16 rounding); 62-layer models (Gemma 3 27B) 1/sqrt(n_embd / n_head)
};
// Which layers attend through a sliding window.
enum es_swa_rule {
    ES_SWA_NONE    = 0,
    // gemma3: with <arch>.attention.sliding_window > 0, the layers that
    // attention.sliding_window_pattern flags (one per layer) or, for a period
    // p (default 6), every layer but each p-th (il % p == p - 1: global; p 0:
    // all slide). Sliding layers use RoPE base rope.freq_base_swa (default
    // 10000) unscaled.
    ES_SWA_PATTERN = 1,
};

typedef struct es_arch_traits {
    int32_t rope_type;      // enum es_rope_type
    int32_t activation;     // enum es_activation
    bool    qk_norm;        // attn_q_norm, attn_k_norm: RMSNorm of each head of Q and K before RoPE
    bool    post_norms;     // post_attention_norm, post_ffw_norm: RMSNorm of each block's output
                            // before its residual add
    bool    embd_scale;     // token embeddings times sqrt(n_embd)
    bool    final_softcap;  // logits soft-capped by <arch>.final_logit_softcapping (when > 0)
    int32_t attn_scale;     // enum es_attn_scale
    int32_t swa;            // enum es_swa_rule
} es_arch_traits;

// Architecture arch's traits into *out; false for one the engine does not read.
bool es_arch_get_traits(const char * arch, es_arch_traits * out);

// The traits resolved for a file: the numbers its keys give.
typedef struct es_model_traits {
    es_arch_traits arch;
    int32_t n_layer;
    float   embd_scale;     // token embeddings are multiplied by it (1: none)
    float   final_softcap;  // logits = c * tanh(logits / c); 0: off
    float   attn_scale;     // attention scores = q.k * attn_scale (where it is applied: arch.attn_scale)
    int32_t n_swa;          // sliding window: a sliding layer's token at p sees keys at p - n_swa < q <= p; 0: none
} es_model_traits;

// One layer's traits resolved for a file.
typedef struct es_layer_traits {
    bool  swa;         // attends through the sliding window
    float rope_base;   // RoPE frequency base
    float rope_scale;  // and linear frequency scale (1: none)
} es_layer_traits;

// File g's architecture's traits, resolved by its keys, as es_model_load
// resolves them: *out, and layers[0 .. min(out->n_layer, cap)) one per
// layer (layers NULL with cap 0: *out alone). ES_OK; ES_ERR_UNSUPPORTED for an
// architecture the engine does not read, or a RoPE scaling it does not;
// ES_ERR_FORMAT (a one-line err) for a key out of range, or a sliding-window
// pattern whose flags are not one per layer; ES_ERR_INVALID_ARG for a NULL g
// or out.
int es_gguf_arch_traits(const es_gguf * g, es_model_traits * out, es_layer_traits * layers, int32_t cap,
                        char * err, size_t err_cap);

/* ========================================================================
 * Memory bandwidth and int8 peak (bandwidth.c)
 *
 * The read bandwidth a decode step can draw on: threads of the engine's pool
 * stream through a buffer far larger than the last-level cache, each its own
 * contiguous slice, summing it so that no load can be skipped. The buffer is
 * first written by the thread that reads each slice (pages local to it).
 * ======================================================================== */

typedef struct es_bandwidth_params {
    int64_t n_bytes;    // buffer read per pass; <= 0: 512 MiB; default 512 MiB
    int32_t n_threads;  // readers; <= 0: one per online CPU; default 0
    int32_t n_passes;   // timed passes, the fastest kept; <= 0: 5; default 5
} es_bandwidth_params;

es_bandwidth_params es_bandwidth_default_params(void);

// Measures read bandwidth: *bytes_per_s is n_bytes over the fastest pass's
// wall time (params NULL: the defaults). ES_ERR_NO_MEMORY: the buffer or the
// pool could not be made; ES_ERR_INVALID_ARG: bytes_per_s NULL.
int es_measure_bandwidth(const es_bandwidth_params * params, double * bytes_per_s);

// The other ceiling, of a batch of many tokens: int8 multiply-accumulates
// per second, each thread of the pool running the kernel set in use's
// tightest loop of its integer step (avx512: vpdpbusd, avx2: vpmaddubsw,
// neon: sdot or smlal, scalar: int multiply-adds) on independent registers.
typedef struct es_int8_peak_params {
    int32_t n_threads;   // <= 0: one per online CPU; default 0
    int32_t n_passes;    // timed passes, the fastest kept; <= 0: 5; default 5
    int64_t iterations;  // of the loop per thread and pass; <= 0: 2^20; default 2^20
} es_int8_peak_params;

es_int8_peak_params es_int8_peak_default_params(void);

// *macs_per_s: all threads' multiply-accumulates over the fastest pass's
// wall time (params NULL: the defaults). ES_ERR_NO_MEMORY: the pool could not
// be made; ES_ERR_INVALID_ARG: macs_per_s NULL.
int es_measure_int8_peak(const es_int8_peak_params * params, double * macs_per_s);

/* ========================================================================
 * GGUF validation (validate.c)
 *
 * One pass over an open GGUF file before any engine reads it: what llama.cpp
 * and this engine would otherwise assert on or misread. For the
 * architectures both read (llama, gemma3, qwen2, qwen3moe):
 *   - hyperparameters present and in range (block_count 1..512, widths, head
 *     counts that divide the width and each other, context length (>= 16), finite
 *     positive epsilon and RoPE base, expert counts);
 *   - every tensor the architecture reads present, with the shape its
 *     tensor table (arch/<name>.c) gives for the hyperparameters, and a
 *     weight type.
 * For every architecture:
 *   - the vocabulary: tokenizer.ggml.tokens non-empty and unique strings,
 *     token_type (i32, one per token, 0..6) and scores (f32, one per token),
 *     merges of the form "a b", every tokenizer.ggml.*_token_id a token;
 *   - block_count, embedding_length and any head counts, epsilon or RoPE keys
 *     present in range; token_embd of (embedding_length, n_vocab);
 *   - vectors and *_norm tensors F32, no blk.N tensor past block_count;
 *   - values the engines cannot compute with: a vector that is not finite, a
 *     norm weight beyond +-65504 (F16's range, which the F16 KV cache and
 *     activation scales hold), a quantized block whose float scale (d, dmin)
 *     is infinite or NaN (expert stacks left out: they may exceed memory).
 * ======================================================================== */

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
