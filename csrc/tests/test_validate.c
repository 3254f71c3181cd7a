/*
 * test_validate.c — es_gguf_validate (csrc/native/validate.c) against tiny
 * models built in memory:
 *
 *   - a valid llama, gemma3, qwen2, qwen3moe and Mixtral-style llama pass, and
 *     an architecture of no known rules passes on the generic ones;
 *   - each rule, broken once: the one-line reason names the key, tensor or
 *     token (hyperparameters, vocabulary, tensor types, shapes, layers);
 *   - es_model_load refuses a file the validator refuses, with its reason;
 *   - the valid image mutated at every byte: the reader and the validator
 *     fail cleanly or pass (under ASan/UBSan, any stray read is caught);
 *   - the real models in $EDGESPEC_TEST_MODELS_DIR (set by tests/test_c_core.py) pass.
 */
#define _POSIX_C_SOURCE 200809L

#include "native/native_internal.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "gguf_bytes.h"
#include "test_models.h"

/* ------------------------------------------------------------------------
 * A GGUF writer: metadata as a list of (key, type + value bytes), so that a
 * test can replace or drop any key; tensors zero-filled
 * ------------------------------------------------------------------------ */

static void put_f32(buf * b, float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    put_le(b, u, 4);
}

enum { GV_U32 = 4, GV_I32 = 5, GV_F32 = 6, GV_STRING = 8, GV_ARRAY = 9 };

#define MAX_KVS     48
#define MAX_TENSORS 64

typedef struct kv {
    char key[96];
    buf  value;  // the value type (u32), then the value
} kv;

typedef struct tensor {
    char     name[64];
    int32_t  type;
    int64_t  ne[3];  // trailing 1s dropped from n_dims
    uint32_t fill;   // every 4-byte word of the data (0: zeros)
} tensor;

typedef struct model {
    kv     kvs[MAX_KVS];
    int    n_kv;
    tensor tensors[MAX_TENSORS];
    int    n_tensors;
} model;

// The key's record, appended when absent (its value emptied).
static buf * kv_slot(model * m, const char * key) {
    for (int i = 0; i < m->n_kv; i++) {
        if (!strcmp(m->kvs[i].key, key)) {
            m->kvs[i].value.n = 0;
            return &m->kvs[i].value;
        }
    }
    if (m->n_kv == MAX_KVS) abort();
    kv * k = &m->kvs[m->n_kv++];
    snprintf(k->key, sizeof k->key, "%s", key);
    k->value = (buf) {0};
    return &k->value;
}

static void set_u32(model * m, const char * key, uint32_t v) {
    buf * b = kv_slot(m, key);
    put_le(b, GV_U32, 4);
    put_le(b, v, 4);
}

static void set_i32(model * m, const char * key, int32_t v) {
    buf * b = kv_slot(m, key);
    put_le(b, GV_I32, 4);
    put_le(b, (uint32_t) v, 4);
}

static void set_f32(model * m, const char * key, float v) {
    buf * b = kv_slot(m, key);
    put_le(b, GV_F32, 4);
    put_f32(b, v);
}

static void set_str(model * m, const char * key, const char * v) {
    buf * b = kv_slot(m, key);
    put_le(b, GV_STRING, 4);
    put_str(b, v);
}

// n strings; lens[i] bytes of v[i] (NULL: strlen), so a string may hold a NUL.
static void set_strs_n(model * m, const char * key, const char * const * v, const size_t * lens,
                       int n) {
    buf * b = kv_slot(m, key);
    put_le(b, GV_ARRAY, 4);
    put_le(b, GV_STRING, 4);
    put_le(b, (uint64_t) n, 8);
    for (int i = 0; i < n; i++) {
        const size_t len = lens ? lens[i] : strlen(v[i]);
        put_le(b, len, 8);
        put(b, v[i], len);
    }
}

static void set_strs(model * m, const char * key, const char * const * v, int n) {
    set_strs_n(m, key, v, NULL, n);
}

// An array of n 4-byte values of type elem (i32 or f32) from v.
static void set_arr4(model * m, const char * key, int32_t elem, const void * v, int n) {
    buf * b = kv_slot(m, key);
    put_le(b, GV_ARRAY, 4);
    put_le(b, (uint64_t) elem, 4);
    put_le(b, (uint64_t) n, 8);
    put(b, v, 4 * (size_t) n);
}

static void drop_kv(model * m, const char * key) {
    for (int i = 0; i < m->n_kv; i++) {
        if (!strcmp(m->kvs[i].key, key)) {
            free(m->kvs[i].value.p);
            m->kvs[i] = m->kvs[--m->n_kv];
            return;
        }
    }
    abort();  // a test dropping a key the model lacks is wrong
}

static void add_tensor(model * m, int32_t type, int64_t ne0, int64_t ne1, int64_t ne2,
                       const char * fmt, int il) {
    if (m->n_tensors == MAX_TENSORS) abort();
    tensor * t = &m->tensors[m->n_tensors++];
    snprintf(t->name, sizeof t->name, fmt, il);
    t->type = type;
    t->ne[0] = ne0;
    t->ne[1] = ne1;
    t->ne[2] = ne2;
}

static tensor * find(model * m, const char * name) {
    for (int i = 0; i < m->n_tensors; i++) {
        if (!strcmp(m->tensors[i].name, name)) return &m->tensors[i];
    }
    abort();
}

static void drop_tensor(model * m, const char * name) {
    tensor * t = find(m, name);
    *t = m->tensors[--m->n_tensors];
}

static void model_free(model * m) {
    for (int i = 0; i < m->n_kv; i++) free(m->kvs[i].value.p);
}

// The GGUF v3 image of m (alignment 32, tensors in order, zero data).
static buf serialize(const model * m) {
    buf b = {0};
    put(&b, "GGUF", 4);
    put_le(&b, 3, 4);
    put_le(&b, (uint64_t) m->n_tensors, 8);
    put_le(&b, (uint64_t) m->n_kv, 8);
    for (int i = 0; i < m->n_kv; i++) {
        put_str(&b, m->kvs[i].key);
        put(&b, m->kvs[i].value.p, m->kvs[i].value.n);
    }
    uint64_t offset = 0, offsets[MAX_TENSORS];
    for (int i = 0; i < m->n_tensors; i++) {
        const tensor * t = &m->tensors[i];
        const es_type_traits * ti = es_type_info(t->type);
        const uint32_t n_dims = t->ne[2] != 1 ? 3 : t->ne[1] != 1 ? 2 : 1;
        put_str(&b, t->name);
        put_le(&b, n_dims, 4);
        for (uint32_t d = 0; d < n_dims; d++) put_le(&b, (uint64_t) t->ne[d], 8);
        put_le(&b, (uint64_t) t->type, 4);
        put_le(&b, offset, 8);
        offsets[i] = offset;
        const uint64_t bytes = (uint64_t) (t->ne[0] * t->ne[1] * t->ne[2]) / ti->block * ti->block_bytes;
        offset += (bytes + 31) / 32 * 32;
    }
    while (b.n % 32) put_le(&b, 0, 1);
    const size_t start = b.n;
    for (int i = 0; i < m->n_tensors; i++) {   // each tensor's words, up to the next one
        const uint64_t end = i + 1 < m->n_tensors ? offsets[i + 1] : offset;
        while (b.n + 4 <= start + end) put_le(&b, m->tensors[i].fill, 4);
    }
    while (b.n < start + offset) put_le(&b, 0, 1);
    return b;
}

/* ------------------------------------------------------------------------
 * The standard models
 * ------------------------------------------------------------------------ */

enum { N_LAYER = 2, N_EMBD = 32, N_HEAD = 4, N_HEAD_KV = 2, N_FF = 64, N_VOCAB = 12,
       N_EXPERT = 4, N_EXPERT_USED = 2, N_FF_EXP = 16, GEMMA_HEAD = 16 };

static const char * const TOKENS[N_VOCAB] = {
    "<unk>", "<s>", "</s>", "a", "b", "c", "ab", "bc", "abc", " ", "\xc4\xa0", "ca",
};
static const char * const MERGES[] = {"a b", "b c", "ab c", "c a"};

// A tiny model of arch with a 12-token vocabulary. gemma3: head width 16
// (key_length, so n_head * head_dim != n_embd); qwen3moe and with moe set
// llama: every FFN a mixture of 4 experts, 2 used.
static void standard(model * m, const char * arch, bool moe) {
    char key[96];
    memset(m, 0, sizeof *m);
    const bool gemma = !strcmp(arch, "gemma3"), qwen3moe = !strcmp(arch, "qwen3moe");
    const bool qk_norm = gemma || qwen3moe;
    moe = moe || qwen3moe;
    const int64_t D = N_EMBD, HD = gemma ? GEMMA_HEAD : N_EMBD / N_HEAD;
    const int64_t Q = N_HEAD * HD, KV = N_HEAD_KV * HD;
#define ARCH_KEY(s) (snprintf(key, sizeof key, "%s.%s", arch, s), key)
    set_str(m, "general.architecture", arch);
    set_u32(m, ARCH_KEY("block_count"), N_LAYER);
    set_u32(m, ARCH_KEY("context_length"), 128);
    set_u32(m, ARCH_KEY("embedding_length"), N_EMBD);
    set_u32(m, ARCH_KEY("feed_forward_length"), moe && !qwen3moe ? N_FF_EXP : N_FF);
    set_u32(m, ARCH_KEY("attention.head_count"), N_HEAD);
    set_u32(m, ARCH_KEY("attention.head_count_kv"), N_HEAD_KV);
    set_f32(m, ARCH_KEY("attention.layer_norm_rms_epsilon"), 1e-5f);
    set_f32(m, ARCH_KEY("rope.freq_base"), 10000.0f);
    if (gemma) {
        set_u32(m, ARCH_KEY("attention.key_length"), GEMMA_HEAD);
        set_u32(m, ARCH_KEY("attention.value_length"), GEMMA_HEAD);
    }
    if (moe) {
        set_u32(m, ARCH_KEY("expert_count"), N_EXPERT);
        set_u32(m, ARCH_KEY("expert_used_count"), N_EXPERT_USED);
    }
    if (qwen3moe) set_u32(m, ARCH_KEY("expert_feed_forward_length"), N_FF_EXP);
#undef ARCH_KEY
    set_str(m, "tokenizer.ggml.model", "gpt2");
    set_strs(m, "tokenizer.ggml.tokens", TOKENS, N_VOCAB);
    int32_t types[N_VOCAB];
    float scores[N_VOCAB];
    for (int i = 0; i < N_VOCAB; i++) {
        types[i] = i < 3 ? 3 : 1;  // control, normal
        scores[i] = -(float) i;
    }
    set_arr4(m, "tokenizer.ggml.token_type", GV_I32, types, N_VOCAB);
    set_arr4(m, "tokenizer.ggml.scores", GV_F32, scores, N_VOCAB);
    set_strs(m, "tokenizer.ggml.merges", MERGES, N_ELEMS(MERGES));
    set_u32(m, "tokenizer.ggml.bos_token_id", 1);
    set_u32(m, "tokenizer.ggml.eos_token_id", 2);
    set_u32(m, "tokenizer.ggml.unknown_token_id", 0);

    add_tensor(m, ES_TYPE_F16, D, N_VOCAB, 1, "token_embd.weight", 0);
    add_tensor(m, ES_TYPE_F32, D, 1, 1, "output_norm.weight", 0);
    add_tensor(m, ES_TYPE_F16, D, N_VOCAB, 1, "output.weight", 0);
    for (int il = 0; il < N_LAYER; il++) {
        add_tensor(m, ES_TYPE_F32, D, 1, 1, "blk.%d.attn_norm.weight", il);
        add_tensor(m, ES_TYPE_F16, D, Q, 1, "blk.%d.attn_q.weight", il);
        add_tensor(m, ES_TYPE_F16, D, KV, 1, "blk.%d.attn_k.weight", il);
        add_tensor(m, ES_TYPE_F16, D, KV, 1, "blk.%d.attn_v.weight", il);
        add_tensor(m, ES_TYPE_F16, Q, D, 1, "blk.%d.attn_output.weight", il);
        if (!strcmp(arch, "qwen2")) {
            add_tensor(m, ES_TYPE_F32, Q, 1, 1, "blk.%d.attn_q.bias", il);
            add_tensor(m, ES_TYPE_F32, KV, 1, 1, "blk.%d.attn_k.bias", il);
            add_tensor(m, ES_TYPE_F32, KV, 1, 1, "blk.%d.attn_v.bias", il);
        }
        if (qk_norm) {
            add_tensor(m, ES_TYPE_F32, HD, 1, 1, "blk.%d.attn_q_norm.weight", il);
            add_tensor(m, ES_TYPE_F32, HD, 1, 1, "blk.%d.attn_k_norm.weight", il);
        }
        if (gemma) {
            add_tensor(m, ES_TYPE_F32, D, 1, 1, "blk.%d.post_attention_norm.weight", il);
            add_tensor(m, ES_TYPE_F32, D, 1, 1, "blk.%d.post_ffw_norm.weight", il);
        }
        add_tensor(m, ES_TYPE_F32, D, 1, 1, "blk.%d.ffn_norm.weight", il);
        if (moe) {
            add_tensor(m, ES_TYPE_F32, D, N_EXPERT, 1, "blk.%d.ffn_gate_inp.weight", il);
            add_tensor(m, ES_TYPE_F16, D, N_FF_EXP, N_EXPERT, "blk.%d.ffn_gate_exps.weight", il);
            add_tensor(m, ES_TYPE_F16, D, N_FF_EXP, N_EXPERT, "blk.%d.ffn_up_exps.weight", il);
            add_tensor(m, ES_TYPE_F16, N_FF_EXP, D, N_EXPERT, "blk.%d.ffn_down_exps.weight", il);
        } else {
            add_tensor(m, ES_TYPE_F16, D, N_FF, 1, "blk.%d.ffn_gate.weight", il);
            add_tensor(m, ES_TYPE_F16, D, N_FF, 1, "blk.%d.ffn_up.weight", il);
            add_tensor(m, ES_TYPE_F16, N_FF, D, 1, "blk.%d.ffn_down.weight", il);
        }
    }
}

/* ------------------------------------------------------------------------
 * Running the validator
 * ------------------------------------------------------------------------ */

// Validates m; err gets the reason (empty when valid). Returns the status.
static int validate(const model * m, char * err, size_t err_cap) {
    buf b = serialize(m);
    es_gguf * g = NULL;
    int rc = es_gguf_open_buffer(b.p, b.n, &g, err, err_cap);
    if (rc == ES_OK) rc = es_gguf_validate(g, err, err_cap);
    es_gguf_close(g);
    free(b.p);
    return rc;
}

// m is refused with ES_ERR_FORMAT and a one-line reason containing want;
// frees m.
static void expect_refused(model * m, const char * want, int line) {
    char err[256];
    const int rc = validate(m, err, sizeof err);
    if (rc != ES_ERR_FORMAT || !strstr(err, want) || strchr(err, '\n')) {
        fprintf(stderr, "%s:%d: expected a refusal naming '%s', got %d '%s'\n", __FILE__, line, want,
                rc, err);
        n_failed++;
    }
    model_free(m);
}

#define REFUSED(m, want) expect_refused(m, want, __LINE__)

static void expect_valid(model * m, int line) {
    char err[256];
    const int rc = validate(m, err, sizeof err);
    if (rc != ES_OK || err[0]) {
        fprintf(stderr, "%s:%d: expected a valid model, got %d '%s'\n", __FILE__, line, rc, err);
        n_failed++;
    }
    model_free(m);
}

#define VALID(m) expect_valid(m, __LINE__)

/* ------------------------------------------------------------------------
 * Tests
 * ------------------------------------------------------------------------ */

static void test_valid(void) {
    model m;
    const char * archs[] = {"llama", "gemma3", "qwen2", "qwen3moe"};
    for (int i = 0; i < N_ELEMS(archs); i++) {
        standard(&m, archs[i], false);
        VALID(&m);
    }
    standard(&m, "llama", true);  // Mixtral
    VALID(&m);
    // Tied embeddings: output.weight is optional.
    standard(&m, "llama", false);
    drop_tensor(&m, "output.weight");
    VALID(&m);
    // Per-layer head counts, as arrays.
    standard(&m, "llama", false);
    const int32_t heads[N_LAYER] = {N_HEAD, N_HEAD}, heads_kv[N_LAYER] = {N_HEAD_KV, N_HEAD_KV};
    set_arr4(&m, "llama.attention.head_count", GV_I32, heads, N_LAYER);
    set_arr4(&m, "llama.attention.head_count_kv", GV_I32, heads_kv, N_LAYER);
    VALID(&m);
    // Architectures without rules of their own: the generic ones only (no
    // tensor set is asked for; the attention layout may be anything).
    model p;
    memset(&p, 0, sizeof p);
    set_str(&p, "general.architecture", "phi3");
    set_u32(&p, "phi3.block_count", 1);
    set_u32(&p, "phi3.embedding_length", N_EMBD);
    set_str(&p, "tokenizer.ggml.model", "gpt2");
    set_strs(&p, "tokenizer.ggml.tokens", TOKENS, N_VOCAB);
    set_strs(&p, "tokenizer.ggml.merges", MERGES, N_ELEMS(MERGES));  // a BPE tokenizer's
    add_tensor(&p, ES_TYPE_F16, N_EMBD, N_VOCAB, 1, "token_embd.weight", 0);
    add_tensor(&p, ES_TYPE_F16, N_EMBD, 3 * N_EMBD, 1, "blk.%d.attn_qkv.weight", 0);
    VALID(&p);
}

static void test_hparams(void) {
    model m;
    // Types as llama.cpp reads hyperparameters: u32, f32, arrays of i32 or u32.
    standard(&m, "llama", false);
    set_u32(&m, "llama.context_length", 15);
    REFUSED(&m, "metadata key llama.context_length = 15 is out of range [16, 2147483647]");
    standard(&m, "llama", false);
    set_i32(&m, "llama.context_length", 128);
    REFUSED(&m, "metadata key llama.context_length is a i32; llama.cpp reads it as u32");
    standard(&m, "gemma3", false);
    set_i32(&m, "gemma3.attention.sliding_window", 8);   // a key the validator reads nothing else of
    REFUSED(&m, "metadata key gemma3.attention.sliding_window is a i32; llama.cpp reads it as u32");
    standard(&m, "gemma3", false);
    set_str(&m, "gemma3.attention.sliding_window", "8");
    REFUSED(&m, "metadata key gemma3.attention.sliding_window is not an integer");
    standard(&m, "llama", false);
    set_u32(&m, "llama.vocab_size", 0);
    REFUSED(&m, "metadata key llama.vocab_size = 0 is out of range");
    const uint32_t f32_bits[N_LAYER] = {0, 0};
    standard(&m, "llama", false);
    set_arr4(&m, "llama.attention.head_count", GV_F32, f32_bits, N_LAYER);
    REFUSED(&m, "metadata key llama.attention.head_count is not an integer array");
    standard(&m, "llama", false);
    set_u32(&m, "llama.block_count", 0);
    REFUSED(&m, "llama.block_count = 0 is out of range");
    standard(&m, "llama", false);
    set_u32(&m, "llama.block_count", 1000);
    REFUSED(&m, "llama.block_count = 1000 is out of range");
    standard(&m, "llama", false);
    drop_kv(&m, "llama.block_count");
    REFUSED(&m, "metadata key llama.block_count is missing");
    standard(&m, "llama", false);
    set_str(&m, "llama.block_count", "two");
    REFUSED(&m, "metadata key llama.block_count is not an integer");
    standard(&m, "qwen2", false);
    set_u32(&m, "qwen2.embedding_length", 0);
    REFUSED(&m, "qwen2.embedding_length = 0");
    standard(&m, "llama", false);
    set_u32(&m, "llama.context_length", 0);
    REFUSED(&m, "llama.context_length = 0");
    standard(&m, "llama", false);
    drop_kv(&m, "llama.context_length");
    REFUSED(&m, "llama.context_length is missing");
    // Heads: the width must split into them (without key_length), kv heads into heads.
    standard(&m, "llama", false);
    set_u32(&m, "llama.attention.head_count", 6);
    REFUSED(&m, "llama.embedding_length 32 does not divide into 6 heads");
    standard(&m, "llama", false);
    set_u32(&m, "llama.attention.head_count_kv", 3);
    REFUSED(&m, "head_count 4 is not a multiple of head_count_kv 3");
    standard(&m, "llama", false);
    set_u32(&m, "llama.attention.head_count", 0);
    REFUSED(&m, "llama.attention.head_count = 0 is out of range");
    standard(&m, "llama", false);
    const int32_t heads[3] = {N_HEAD, N_HEAD, N_HEAD};
    set_arr4(&m, "llama.attention.head_count", GV_I32, heads, 3);
    REFUSED(&m, "llama.attention.head_count holds 3 values for 2 layers");
    standard(&m, "llama", false);
    const int32_t heads_kv[N_LAYER] = {N_HEAD_KV, 3};
    set_arr4(&m, "llama.attention.head_count_kv", GV_I32, heads_kv, N_LAYER);
    REFUSED(&m, "(layer 1)");
    // gemma3's heads are key_length wide: the width need not divide into them.
    standard(&m, "gemma3", false);
    set_u32(&m, "gemma3.attention.key_length", 0);
    REFUSED(&m, "gemma3.attention.key_length = 0");
    standard(&m, "llama", false);
    set_u32(&m, "llama.rope.dimension_count", 7);
    REFUSED(&m, "llama.rope.dimension_count 7 is odd");
    // llama, qwen2, qwen3moe: value width = key width = RoPE dimensions.
    standard(&m, "llama", false);
    set_u32(&m, "llama.rope.dimension_count", 4);
    REFUSED(&m, "llama: key width 8, value width 8 and RoPE dimensions 4 differ");
    standard(&m, "qwen3moe", false);
    set_u32(&m, "qwen3moe.attention.value_length", 4);
    REFUSED(&m, "qwen3moe: key width 8, value width 4 and RoPE dimensions 8 differ");
    standard(&m, "gemma3", false);  // gemma3's graph has no such rule
    set_u32(&m, "gemma3.rope.dimension_count", 8);
    VALID(&m);
    standard(&m, "gemma3", false);
    set_u32(&m, "gemma3.rope.dimension_count", 0);
    REFUSED(&m, "gemma3.rope.dimension_count = 0 is out of range [1, 4096]");
    standard(&m, "llama", false);
    set_str(&m, "llama.rope.scaling.type", "cubic");
    REFUSED(&m, "llama.rope.scaling.type is not one of none, linear, yarn, longrope");
    standard(&m, "llama", false);
    set_str(&m, "llama.rope.scaling.type", "yarn");
    VALID(&m);
    // Floats: finite and positive.
    standard(&m, "llama", false);
    set_f32(&m, "llama.attention.layer_norm_rms_epsilon", 0.0f);
    REFUSED(&m, "llama.attention.layer_norm_rms_epsilon = 0 is not a finite positive number");
    standard(&m, "llama", false);
    set_f32(&m, "llama.attention.layer_norm_rms_epsilon", NAN);
    REFUSED(&m, "llama.attention.layer_norm_rms_epsilon = nan");
    standard(&m, "gemma3", false);
    drop_kv(&m, "gemma3.attention.layer_norm_rms_epsilon");
    REFUSED(&m, "gemma3.attention.layer_norm_rms_epsilon is missing");
    standard(&m, "llama", false);
    set_f32(&m, "llama.rope.freq_base", -1.0f);
    REFUSED(&m, "llama.rope.freq_base = -1");
    standard(&m, "llama", false);
    set_f32(&m, "llama.rope.freq_base", INFINITY);
    REFUSED(&m, "llama.rope.freq_base = inf");
    standard(&m, "llama", false);
    set_u32(&m, "llama.rope.freq_base", 10000);
    REFUSED(&m, "metadata key llama.rope.freq_base is not a float");
    // Experts.
    standard(&m, "qwen3moe", false);
    set_u32(&m, "qwen3moe.expert_used_count", 5);
    REFUSED(&m, "qwen3moe.expert_used_count 5 does not fit expert_count 4");
    standard(&m, "qwen3moe", false);
    set_u32(&m, "qwen3moe.expert_used_count", 0);
    REFUSED(&m, "qwen3moe.expert_used_count 0 does not fit");
    standard(&m, "qwen3moe", false);
    drop_kv(&m, "qwen3moe.expert_count");
    REFUSED(&m, "qwen3moe.expert_count is missing or 0");
    standard(&m, "llama", true);
    set_u32(&m, "llama.expert_count", 2000);
    REFUSED(&m, "llama.expert_count = 2000 is out of range [0, 1024]");
    standard(&m, "llama", false);
    set_u32(&m, "llama.expert_used_count", 2);
    REFUSED(&m, "llama.expert_used_count 2 does not fit expert_count 0");
    standard(&m, "qwen3moe", false);  // per layer: the largest counts
    const int32_t used[N_LAYER] = {N_EXPERT_USED, N_EXPERT + 1};
    set_arr4(&m, "qwen3moe.expert_used_count", GV_I32, used, N_LAYER);
    REFUSED(&m, "qwen3moe.expert_used_count 5 does not fit expert_count 4");
    standard(&m, "qwen3moe", false);
    set_u32(&m, "qwen3moe.expert_group_count", 3);
    set_u32(&m, "qwen3moe.expert_group_used_count", 1);
    REFUSED(&m, "qwen3moe.expert_group_count 3 (1 used) does not fit expert_count 4");
    standard(&m, "qwen3moe", false);
    set_u32(&m, "qwen3moe.expert_group_count", 2);
    set_u32(&m, "qwen3moe.expert_group_used_count", 1);
    VALID(&m);
    standard(&m, "llama", false);
    set_u32(&m, "llama.nextn_predict_layers", 3);
    REFUSED(&m, "llama.nextn_predict_layers = 3 is out of range [0, 2]");
    standard(&m, "llama", false);
    set_u32(&m, "llama.feed_forward_length", 0);
    REFUSED(&m, "llama.feed_forward_length = 0");
    // The architecture itself.
    standard(&m, "llama", false);
    drop_kv(&m, "general.architecture");
    REFUSED(&m, "general.architecture is missing");
    standard(&m, "llama", false);
    set_u32(&m, "general.architecture", 1);
    REFUSED(&m, "general.architecture is missing or not a string");
}

// A model of no known architecture (no tensors asked for) with an SPM vocabulary of n tokens.
static void spm_model(model * m, const char * const * tokens, int n) {
    memset(m, 0, sizeof *m);
    set_str(m, "general.architecture", "phi3");
    set_u32(m, "phi3.block_count", 1);
    set_u32(m, "phi3.embedding_length", N_EMBD);
    set_str(m, "tokenizer.ggml.model", "llama");
    set_strs(m, "tokenizer.ggml.tokens", tokens, n);
}

static void test_vocab(void) {
    model m;
    // Two identical tokens (one changed byte: "bc" -> "ab").
    const char * dup[N_VOCAB];
    memcpy(dup, TOKENS, sizeof dup);
    dup[7] = "ab";
    standard(&m, "llama", false);
    set_strs(&m, "tokenizer.ggml.tokens", dup, N_VOCAB);
    REFUSED(&m, "tokenizer.ggml.tokens: token 7 'ab' repeats token 6");
    // Duplicates are found however far apart, non-printable bytes escaped.
    dup[7] = TOKENS[7];
    dup[11] = "\xc4\xa0";
    standard(&m, "llama", false);
    set_strs(&m, "tokenizer.ggml.tokens", dup, N_VOCAB);
    REFUSED(&m, "token 11 '\\xc4\\xa0' repeats token 10");
    dup[11] = "";
    standard(&m, "llama", false);
    set_strs(&m, "tokenizer.ggml.tokens", dup, N_VOCAB);
    REFUSED(&m, "tokenizer.ggml.tokens: token 11 is empty");
    // Tokens as llama.cpp stores them, cut at a NUL byte: "ab\0x" repeats "ab",
    // "\0a" is empty; "ca\0" is "ca", which no other token is.
    size_t lens[N_VOCAB];
    for (int i = 0; i < N_VOCAB; i++) lens[i] = strlen(TOKENS[i]);
    memcpy(dup, TOKENS, sizeof dup);
    dup[7] = "ab\0x";
    lens[7] = 4;
    standard(&m, "llama", false);
    set_strs_n(&m, "tokenizer.ggml.tokens", dup, lens, N_VOCAB);
    REFUSED(&m, "token 7 'ab\\x00x' repeats token 6 up to its NUL byte");
    dup[7] = "\0a";
    lens[7] = 2;
    standard(&m, "llama", false);
    set_strs_n(&m, "tokenizer.ggml.tokens", dup, lens, N_VOCAB);
    REFUSED(&m, "token 7 '\\x00a' is empty up to its NUL byte");
    dup[7] = TOKENS[7];
    lens[7] = strlen(TOKENS[7]);
    dup[11] = "ca\0";
    lens[11] = 3;
    standard(&m, "llama", false);
    set_strs_n(&m, "tokenizer.ggml.tokens", dup, lens, N_VOCAB);
    VALID(&m);
    // An SPM ("llama") vocabulary needs a token for every byte, "<0xXX>" or
    // the byte itself: llama.cpp's byte fallback aborts on a missing one.
    standard(&m, "llama", false);
    set_str(&m, "tokenizer.ggml.model", "llama");
    REFUSED(&m, "no token <0x00> nor the byte itself, which the 'llama' tokenizer falls back to");
    char bytes_text[256][7];
    const char * spm[3 + 256];
    spm[0] = "<unk>", spm[1] = "<s>", spm[2] = "</s>";
    for (int b = 0; b < 256; b++) {
        snprintf(bytes_text[b], sizeof bytes_text[b], "<0x%02X>", b);
        spm[3 + b] = bytes_text[b];
    }
    spm_model(&m, spm, 3 + 256);
    VALID(&m);
    snprintf(bytes_text[0x41], sizeof bytes_text[0x41], "A");   // the byte itself will do
    spm_model(&m, spm, 3 + 256);
    VALID(&m);
    snprintf(bytes_text[0x41], sizeof bytes_text[0x41], "<0x4a>");   // lower case: not llama.cpp's spelling
    spm_model(&m, spm, 3 + 256);
    REFUSED(&m, "no token <0x41> nor the byte itself");
    // A model that says it has no vocabulary: llama.cpp aborts on its first token.
    standard(&m, "llama", false);
    set_str(&m, "tokenizer.ggml.model", "none");
    REFUSED(&m, "tokenizer.ggml.model is 'none': the file has no vocabulary");
    standard(&m, "llama", false);
    drop_kv(&m, "tokenizer.ggml.tokens");
    REFUSED(&m, "tokenizer.ggml.tokens is missing");
    standard(&m, "llama", false);
    set_u32(&m, "tokenizer.ggml.tokens", 3);
    REFUSED(&m, "tokenizer.ggml.tokens is not an array of strings");
    standard(&m, "llama", false);
    set_strs(&m, "tokenizer.ggml.tokens", TOKENS, 0);
    REFUSED(&m, "tokenizer.ggml.tokens holds 0 tokens");

    // token_type: i32, one per token, 0..6.
    int32_t types[N_VOCAB + 1] = {0};
    standard(&m, "llama", false);
    set_arr4(&m, "tokenizer.ggml.token_type", GV_I32, types, N_VOCAB - 1);
    REFUSED(&m, "tokenizer.ggml.token_type: expected 12 i32 values (one per token), found 11");
    standard(&m, "llama", false);
    set_arr4(&m, "tokenizer.ggml.token_type", GV_F32, types, N_VOCAB);
    REFUSED(&m, "tokenizer.ggml.token_type: expected 12 i32 values");
    types[5] = 7;
    standard(&m, "llama", false);
    set_arr4(&m, "tokenizer.ggml.token_type", GV_I32, types, N_VOCAB);
    REFUSED(&m, "tokenizer.ggml.token_type: token 5 has type 7, not 0..6");
    types[5] = -1;
    standard(&m, "llama", false);
    set_arr4(&m, "tokenizer.ggml.token_type", GV_I32, types, N_VOCAB);
    REFUSED(&m, "token 5 has type -1");
    // A byte token's text is its value, "<0xXX>".
    const char * bytes[N_VOCAB];
    memcpy(bytes, TOKENS, sizeof bytes);
    bytes[10] = "<0x0A>";
    types[5] = 1;
    types[10] = 6;
    standard(&m, "llama", false);
    set_strs(&m, "tokenizer.ggml.tokens", bytes, N_VOCAB);
    set_arr4(&m, "tokenizer.ggml.token_type", GV_I32, types, N_VOCAB);
    VALID(&m);
    types[9] = 6;
    standard(&m, "llama", false);
    set_strs(&m, "tokenizer.ggml.tokens", bytes, N_VOCAB);
    set_arr4(&m, "tokenizer.ggml.token_type", GV_I32, types, N_VOCAB);
    REFUSED(&m, "tokenizer.ggml.token_type: token 9 ' ' is of type byte but not of the form <0xXX>");
    standard(&m, "llama", false);
    set_strs(&m, "tokenizer.ggml.token_type", TOKENS, N_VOCAB);
    REFUSED(&m, "metadata key tokenizer.ggml.token_type is not an array of i32");

    // scores: f32, one per token.
    float scores[N_VOCAB + 1] = {0};
    standard(&m, "llama", false);
    set_arr4(&m, "tokenizer.ggml.scores", GV_F32, scores, N_VOCAB + 1);
    REFUSED(&m, "tokenizer.ggml.scores: expected 12 f32 values (one per token), found 13");
    standard(&m, "llama", false);
    set_arr4(&m, "tokenizer.ggml.scores", GV_I32, scores, N_VOCAB);
    REFUSED(&m, "tokenizer.ggml.scores: expected 12 f32 values");

    // merges: "left right".
    const char * bad_merges[][1] = {{"ab"}, {" ab"}, {"ab "}, {""}};
    const char * want[] = {"merge 1 'ab'", "merge 1 ' ab'", "merge 1 'ab '", "merge 1 ''"};
    for (int i = 0; i < N_ELEMS(want); i++) {
        const char * merges[] = {"a b", bad_merges[i][0], "ab c"};
        standard(&m, "llama", false);
        set_strs(&m, "tokenizer.ggml.merges", merges, 3);
        char w[96];
        snprintf(w, sizeof w, "tokenizer.ggml.merges: %s is not two tokens", want[i]);
        REFUSED(&m, w);
    }
    standard(&m, "llama", false);
    set_u32(&m, "tokenizer.ggml.merges", 1);
    REFUSED(&m, "tokenizer.ggml.merges is not an array of strings");
    // A BPE ('gpt2') tokenizer: merges there, each of tokens the vocabulary
    // has (both parts, and the token they make).
    standard(&m, "llama", false);
    set_strs(&m, "tokenizer.ggml.merges", MERGES, 0);
    REFUSED(&m, "tokenizer.ggml.merges is empty, which the BPE ('gpt2') tokenizer cannot be");
    standard(&m, "llama", false);
    drop_kv(&m, "tokenizer.ggml.merges");
    REFUSED(&m, "tokenizer.ggml.merges is missing, which the BPE ('gpt2') tokenizer needs");
    const char * unknown[] = {"x c", "a x", "b a", "\xc4\xa0 a"};
    const char * lacking[] = {"its left part", "its right part", "the two parts joined", "the two parts joined"};
    for (int i = 0; i < N_ELEMS(unknown); i++) {
        const char * merges[] = {"a b", "ab c", unknown[i]};
        standard(&m, "llama", false);
        set_strs(&m, "tokenizer.ggml.merges", merges, 3);
        char w[160];
        snprintf(w, sizeof w, "tokenizer.ggml.merges: merge 2 '%s' names a token the vocabulary lacks (%s)",
                 i == 3 ? "\\xc4\\xa0 a" : unknown[i], lacking[i]);
        REFUSED(&m, w);
    }
    // Another tokenizer's merges are not read by llama.cpp: only their form is checked.
    standard(&m, "llama", false);
    set_str(&m, "tokenizer.ggml.model", "bert");
    set_strs(&m, "tokenizer.ggml.merges", (const char * const[]) {"x y"}, 1);
    VALID(&m);
    standard(&m, "llama", false);
    set_str(&m, "tokenizer.ggml.model", "bert");
    set_strs(&m, "tokenizer.ggml.merges", MERGES, 0);
    VALID(&m);

    // Special ids: every *_token_id a token.
    standard(&m, "llama", false);
    set_u32(&m, "tokenizer.ggml.eos_token_id", N_VOCAB);
    REFUSED(&m, "tokenizer.ggml.eos_token_id = 12 is out of range [0, 11]");
    standard(&m, "llama", false);
    set_i32(&m, "tokenizer.ggml.padding_token_id", -1);
    REFUSED(&m, "tokenizer.ggml.padding_token_id = -1 is out of range");
    standard(&m, "llama", false);
    set_u32(&m, "tokenizer.ggml.seperator_token_id", 99);
    REFUSED(&m, "tokenizer.ggml.seperator_token_id = 99");
    standard(&m, "llama", false);
    set_str(&m, "tokenizer.ggml.bos_token_id", "<s>");
    REFUSED(&m, "tokenizer.ggml.bos_token_id is not an integer");
    standard(&m, "llama", false);
    set_u32(&m, "tokenizer.ggml.unknown_token_id", N_VOCAB - 1);  // the last token is fine
    VALID(&m);
}

static void test_tensors(void) {
    model m;
    // Norms and vectors F32.
    standard(&m, "llama", false);
    find(&m, "blk.1.ffn_norm.weight")->type = ES_TYPE_F16;
    REFUSED(&m, "tensor blk.1.ffn_norm.weight: expected F32 (a norm weight), found F16");
    standard(&m, "qwen2", false);
    find(&m, "blk.0.attn_k.bias")->type = ES_TYPE_BF16;
    REFUSED(&m, "tensor blk.0.attn_k.bias: expected F32 (a vector), found BF16");
    standard(&m, "phi3", false);  // the generic rule too
    find(&m, "output_norm.weight")->type = ES_TYPE_F16;
    REFUSED(&m, "tensor output_norm.weight: expected F32");
    // Layers past block_count.
    standard(&m, "llama", false);
    add_tensor(&m, ES_TYPE_F32, N_EMBD, 1, 1, "blk.%d.attn_norm.weight", N_LAYER);
    REFUSED(&m, "tensor blk.2.attn_norm.weight is not in a layer 0..1 (block_count 2)");
    standard(&m, "llama", false);
    add_tensor(&m, ES_TYPE_F32, N_EMBD, 1, 1, "blk.x.attn_norm.weight", 0);
    REFUSED(&m, "tensor blk.x.attn_norm.weight is not in a layer");
    // Embeddings: (n_embd, n_vocab).
    standard(&m, "llama", false);
    find(&m, "token_embd.weight")->ne[1] = N_VOCAB + 1;
    REFUSED(&m, "tensor token_embd.weight has shape (32, 13, 1, 1), expected (32, 12, 1, 1)");
    standard(&m, "phi3", false);
    find(&m, "token_embd.weight")->ne[0] = 64;
    REFUSED(&m, "tensor token_embd.weight has shape (64, 12, 1, 1)");
    standard(&m, "llama", false);
    find(&m, "output.weight")->ne[1] = N_VOCAB - 1;
    REFUSED(&m, "tensor output.weight has shape (32, 11, 1, 1)");
    standard(&m, "llama", false);
    drop_tensor(&m, "token_embd.weight");
    REFUSED(&m, "tensor token_embd.weight is missing");
    standard(&m, "gemma3", false);
    drop_tensor(&m, "output_norm.weight");
    REFUSED(&m, "tensor output_norm.weight is missing");
    // Attention and FFN shapes from the hyperparameters.
    standard(&m, "llama", false);
    find(&m, "blk.1.attn_k.weight")->ne[1] = 32;
    REFUSED(&m, "tensor blk.1.attn_k.weight has shape (32, 32, 1, 1), expected (32, 16, 1, 1)");
    standard(&m, "gemma3", false);
    find(&m, "blk.0.attn_output.weight")->ne[0] = N_EMBD;
    REFUSED(&m, "tensor blk.0.attn_output.weight has shape (32, 32, 1, 1), expected (64, 32, 1, 1)");
    standard(&m, "llama", false);
    find(&m, "blk.0.ffn_down.weight")->ne[0] = 32;
    REFUSED(&m, "tensor blk.0.ffn_down.weight has shape (32, 32, 1, 1), expected (64, 32, 1, 1)");
    standard(&m, "llama", false);
    drop_tensor(&m, "blk.1.ffn_up.weight");
    REFUSED(&m, "tensor blk.1.ffn_up.weight is missing");
    standard(&m, "gemma3", false);
    drop_tensor(&m, "blk.0.post_ffw_norm.weight");
    REFUSED(&m, "tensor blk.0.post_ffw_norm.weight is missing");
    standard(&m, "gemma3", false);
    find(&m, "blk.1.attn_q_norm.weight")->ne[0] = N_EMBD;
    REFUSED(&m, "tensor blk.1.attn_q_norm.weight has shape (32, 1, 1, 1), expected (16, 1, 1, 1)");
    standard(&m, "qwen2", false);
    find(&m, "blk.1.attn_v.bias")->ne[0] = N_EMBD;
    REFUSED(&m, "tensor blk.1.attn_v.bias has shape (32, 1, 1, 1), expected (16, 1, 1, 1)");
    standard(&m, "qwen2", false);  // qwen2's biases are optional
    drop_tensor(&m, "blk.0.attn_q.bias");
    VALID(&m);
    standard(&m, "qwen3moe", false);
    find(&m, "blk.0.ffn_up_exps.weight")->ne[2] = N_EXPERT - 1;
    REFUSED(&m, "tensor blk.0.ffn_up_exps.weight has shape (32, 16, 3, 1), expected (32, 16, 4, 1)");
    standard(&m, "qwen3moe", false);
    find(&m, "blk.1.ffn_gate_inp.weight")->ne[1] = 8;
    REFUSED(&m, "tensor blk.1.ffn_gate_inp.weight has shape (32, 8, 1, 1), expected (32, 4, 1, 1)");
    standard(&m, "qwen3moe", false);  // without expert_feed_forward_length: 64 / 2 = 32 wide
    drop_kv(&m, "qwen3moe.expert_feed_forward_length");
    REFUSED(&m, "tensor blk.0.ffn_gate_exps.weight has shape (32, 16, 4, 1), expected (32, 32, 4, 1)");
    standard(&m, "llama", true);
    drop_tensor(&m, "blk.1.ffn_down_exps.weight");
    REFUSED(&m, "tensor blk.1.ffn_down_exps.weight is missing");
    // Q, K and V fused in one matrix (llama.cpp takes either form).
    standard(&m, "llama", false);
    for (int il = 0; il < N_LAYER; il++) {
        char name[64];
        const char * kinds[] = {"attn_q", "attn_k", "attn_v"};
        for (int k = 0; k < 3; k++) {
            snprintf(name, sizeof name, "blk.%d.%s.weight", il, kinds[k]);
            drop_tensor(&m, name);
        }
        add_tensor(&m, ES_TYPE_F16, N_EMBD, 2 * N_EMBD, 1, "blk.%d.attn_qkv.weight", il);
    }
    VALID(&m);
    standard(&m, "llama", false);
    add_tensor(&m, ES_TYPE_F16, N_EMBD, N_EMBD, 1, "blk.%d.attn_qkv.weight", 1);
    REFUSED(&m, "tensor blk.1.attn_qkv.weight has shape (32, 32, 1, 1), expected (32, 64, 1, 1)");
    // A matrix of an integer type.
    standard(&m, "llama", false);
    find(&m, "blk.0.attn_q.weight")->type = 26;  // I32
    REFUSED(&m, "tensor blk.0.attn_q.weight: I32 is not a weight type");

    // Values: norms finite and within F16's range, vectors finite, quantized
    // blocks' scales finite (each filled with one 4-byte word).
    const float big = 1e30f, nan = NAN, inf = INFINITY, ok = 65504.0f;
    uint32_t w;
    memcpy(&w, &big, 4);
    standard(&m, "llama", false);
    find(&m, "blk.1.attn_norm.weight")->fill = w;
    REFUSED(&m, "tensor blk.1.attn_norm.weight: value 0 is 1e+30 (a norm weight beyond F16's range)");
    memcpy(&w, &ok, 4);
    standard(&m, "llama", false);
    find(&m, "blk.1.attn_norm.weight")->fill = w;
    VALID(&m);
    memcpy(&w, &nan, 4);
    standard(&m, "gemma3", false);
    find(&m, "blk.0.attn_k_norm.weight")->fill = w;
    REFUSED(&m, "tensor blk.0.attn_k_norm.weight: value 0 is nan (not finite)");
    memcpy(&w, &inf, 4);
    standard(&m, "qwen2", false);
    find(&m, "blk.1.attn_v.bias")->fill = w;
    REFUSED(&m, "tensor blk.1.attn_v.bias: value 0 is inf (not finite)");
    // A Q8_0 block: d (F16) then 32 quants; Q4_K: d, dmin first; Q6_K: d last.
    const int32_t quants[] = {ES_TYPE_Q8_0, ES_TYPE_Q4_K, ES_TYPE_Q6_K};
    for (int i = 0; i < N_ELEMS(quants); i++) {
        const int64_t cols = es_type_info(quants[i])->block;
        standard(&m, "phi3", false);   // the generic rules: any matrix shape
        add_tensor(&m, quants[i], cols, 2, 1, "blk.%d.extra.weight", 0);
        VALID(&m);
        standard(&m, "phi3", false);
        add_tensor(&m, quants[i], cols, 2, 1, "blk.%d.extra.weight", 0);
        find(&m, "blk.0.extra.weight")->fill = 0x7E007E00u;  // every F16 a NaN
        REFUSED(&m, "tensor blk.0.extra.weight: block 0 has an infinite or NaN scale");
    }
}

static void test_err_buffer(void) {
    model m;
    standard(&m, "llama", false);
    set_u32(&m, "llama.block_count", 0);
    buf b = serialize(&m);
    es_gguf * g = NULL;
    CHECK(es_gguf_open_buffer(b.p, b.n, &g, NULL, 0) == ES_OK);
    CHECK(es_gguf_validate(g, NULL, 0) == ES_ERR_FORMAT);  // no err buffer
    char small[8];
    CHECK(es_gguf_validate(g, small, sizeof small) == ES_ERR_FORMAT);
    CHECK(strlen(small) == sizeof small - 1);  // truncated, terminated
    CHECK(es_gguf_validate(NULL, small, sizeof small) == ES_ERR_INVALID_ARG);
    es_gguf_close(g);
    free(b.p);
    model_free(&m);
}

// es_model_load runs the validator: its reason, ES_ERR_FORMAT.
static void test_model_load(void) {
    char path[] = "/tmp/test_validate_XXXXXX";
    const int fd = mkstemp(path);
    CHECK(fd >= 0);
    if (fd < 0) return;
    model m;
    standard(&m, "llama", false);
    set_u32(&m, "tokenizer.ggml.bos_token_id", 40);
    buf b = serialize(&m);
    CHECK(write(fd, b.p, b.n) == (ssize_t) b.n);
    close(fd);
    es_model * model_out = NULL;
    char err[256];
    CHECK(es_model_load(path, NULL, &model_out, err, sizeof err) == ES_ERR_FORMAT);
    CHECK(model_out == NULL);
    CHECK(strstr(err, "tokenizer.ggml.bos_token_id = 40 is out of range") != NULL);
    free(b.p);
    model_free(&m);
    // The valid one loads.
    standard(&m, "llama", false);
    b = serialize(&m);
    FILE * f = fopen(path, "wb");
    CHECK(f && fwrite(b.p, 1, b.n, f) == b.n);
    if (f) fclose(f);
    CHECK(es_model_load(path, NULL, &model_out, err, sizeof err) == ES_OK);
    if (!model_out) fprintf(stderr, "  %s\n", err);
    es_model_free(model_out);
    free(b.p);
    model_free(&m);
    unlink(path);
}

// Every byte of a valid image changed (to x ^ 0xff and x + 1): the reader
// and the validator fail with a reason or pass, never read out of bounds.
static void test_every_byte(void) {
    model m;
    standard(&m, "qwen3moe", false);
    buf b = serialize(&m);
    model_free(&m);
    // Mutations past the metadata only change tensor data: stop there.
    size_t end = b.n;
    for (size_t i = 0; i + 19 <= b.n; i++) {
        if (!memcmp(b.p + i, "blk.1.ffn_down_exps", 19)) end = i + 64;
    }
    int n_refused = 0, n_passed = 0;
    uint8_t * copy = malloc(b.n);
    for (size_t i = 0; i < end && copy; i++) {
        for (int k = 0; k < 2; k++) {
            memcpy(copy, b.p, b.n);
            copy[i] = k ? (uint8_t) (copy[i] + 1) : (uint8_t) (copy[i] ^ 0xff);
            es_gguf * g = NULL;
            char err[256] = "";
            int rc = es_gguf_open_buffer(copy, b.n, &g, err, sizeof err);
            if (rc == ES_OK) {
                rc = es_gguf_validate(g, err, sizeof err);
                es_gguf_close(g);
            }
            CHECK(rc == ES_OK || (err[0] && !strchr(err, '\n')));
            if (rc == ES_OK) n_passed++;
            else n_refused++;
        }
    }
    free(copy);
    free(b.p);
    printf("  every byte: %d mutations refused, %d passed\n", n_refused, n_passed);
    CHECK(n_refused > 0 && n_passed > 0);
}

// A real model passes the reader and the validator.
static void validate_model(const char * path) {
    char err[256] = "";
    es_gguf * g = NULL;
    int rc = es_gguf_open(path, &g, err, sizeof err);
    if (rc == ES_OK) rc = es_gguf_validate(g, err, sizeof err);
    es_gguf_close(g);
    if (rc != ES_OK) fprintf(stderr, "  %s: %s\n", path, err);
    CHECK(rc == ES_OK);
}

int main(void) {
    test_valid();
    test_hparams();
    test_vocab();
    test_tensors();
    test_err_buffer();
    test_model_load();
    test_every_byte();
    for_each_test_model(validate_model);
    return check_report("test_validate");
}
