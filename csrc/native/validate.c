/*
 * validate.c — one validation pass over an open GGUF before any engine
 * loads it (es_gguf_validate; the rules are listed in es_native.h).
 *
 * The reader (gguf.c) has checked the container: every count, string, array
 * and tensor lies inside the file. This pass checks what the engines read out
 * of it: llama.cpp asserts (aborts the process) on some damaged files — two
 * identical tokens, a block count past its layer limit, a norm stored as
 * F16 — and reads past the end of a scores or token_type array shorter than
 * the vocabulary. Every failure is one line naming the key, tensor or token.
 *
 *   checker      the state of one pass: the file, the architecture, err
 *   keys         integer, per-layer and float keys read with their range
 *   hparams      the architecture's hyperparameters
 *   vocabulary   tokens, token types, scores, merges, special ids
 *   tensors      every 1-D and norm tensor F32, layer indices, the shapes
 *                each architecture's loader expects, values neither engine
 *                can compute with (non-finite vectors and scales)
 */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "native/native_internal.h"

/* ========================================================================
 * Limits and the architectures
 * ======================================================================== */

#define MAX_LAYERS   512          // llama.cpp's LLAMA_MAX_LAYERS
#define MIN_CTX      16           // the smallest context edgespec makes (backends/base.py
                                  // MIN_CTX): smaller caches trip llama.cpp's asserts
#define MAX_EMBD     (1 << 17)    // widths: 16384 is the largest in use
#define MAX_HEADS    4096
#define MAX_HEAD_DIM 4096
#define MAX_FF       (1 << 20)
#define MAX_EXPERTS  ES_MOE_MAX_EXPERTS  // llama.cpp asserts n_expert <= its LLAMA_MAX_EXPERTS (1024)
#define MAX_VOCAB    (1 << 24)
#define N_TOKEN_TYPES 7           // llama.cpp's token types: undefined, normal, unknown,
                                  // control, user-defined, unused, byte
#define TOKEN_TYPE_BYTE 6

// GGUF metadata value types (the format's numbering).
enum { GV_U8 = 0, GV_I8 = 1, GV_U16 = 2, GV_I16 = 3, GV_U32 = 4, GV_I32 = 5, GV_F32 = 6,
       GV_BOOL = 7, GV_U64 = 10, GV_I64 = 11 };

/* ========================================================================
 * The checker
 * ======================================================================== */

typedef struct checker {
    const es_gguf    * g;
    const char       * arch;   // general.architecture, owned by g
    const es_arch    * rules;  // the architecture's table; NULL: one checked by the generic rules only
    char             * err;
    size_t             err_cap;
    // Hyperparameters (0: absent, for the generic rules).
    int64_t  n_layer, n_embd, n_vocab;   // n_vocab: tokens in the vocabulary, 0 when none
    int64_t  head_k, head_v;             // per-head key and value widths
    int64_t  n_expert, n_ff_exp;
    int64_t  n_head[MAX_LAYERS], n_head_kv[MAX_LAYERS], n_ff[MAX_LAYERS];
    int64_t  n_expert_used[MAX_LAYERS];
    // Bytes with a token (bit b of [b / 8]): "<0xXX>" (upper-case hex, as
    // llama.cpp spells it), and the byte itself as a one-byte token.
    uint8_t  byte_hex[32], byte_plain[32];
} checker;

static int fail(checker * c, const char * fmt, ...) {
    if (c->err && c->err_cap) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->err, c->err_cap, fmt, ap);
        va_end(ap);
    }
    return ES_ERR_FORMAT;
}

// n bytes from the file made safe for a one-line message: quotes and
// backslashes escaped, control and non-ASCII bytes as \xNN, cut after
// QUOTED_MAX bytes with "...".
#define QUOTED_MAX 64
#define QUOTED_CAP (QUOTED_MAX * 4 + 4)
static const char * quoted(const void * s, size_t n, char buf[QUOTED_CAP]) {
    const unsigned char * p = s;
    size_t o = 0;
    for (size_t i = 0; i < n && i < QUOTED_MAX; i++) {
        if (p[i] < 0x20 || p[i] >= 0x7f || p[i] == '\'' || p[i] == '\\') {
            o += (size_t) snprintf(buf + o, 5, "\\x%02x", p[i]);
        } else {
            buf[o++] = (char) p[i];
        }
    }
    if (n > QUOTED_MAX) {
        memcpy(buf + o, "...", 3);
        o += 3;
    }
    buf[o] = '\0';
    return buf;
}

static uint64_t load_le(const uint8_t * p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static bool has_key(const es_gguf * g, const char * key) {
    for (int64_t i = 0; i < es_gguf_n_kv(g); i++) {
        if (strcmp(es_gguf_key_at(g, i), key) == 0) return true;
    }
    return false;
}

/* ========================================================================
 * Keys
 * ======================================================================== */

// Element i of an integer array (GGUF value type elem); false for another type.
static bool arr_int(int32_t elem, const void * data, uint64_t i, int64_t * out) {
    const uint8_t * p = data;
    switch (elem) {
        case GV_U8:  *out = p[i]; return true;
        case GV_I8:  *out = (int8_t) p[i]; return true;
        case GV_U16: *out = (int64_t) load_le(p + 2 * i, 2); return true;
        case GV_I16: *out = (int16_t) load_le(p + 2 * i, 2); return true;
        case GV_U32: *out = (int64_t) load_le(p + 4 * i, 4); return true;
        case GV_I32: *out = (int32_t) load_le(p + 4 * i, 4); return true;
        case GV_U64: {
            const uint64_t u = load_le(p + 8 * i, 8);
            *out = u > INT64_MAX ? INT64_MAX : (int64_t) u;
            return true;
        }
        case GV_I64: *out = (int64_t) load_le(p + 8 * i, 8); return true;
        case GV_BOOL: *out = p[i] != 0; return true;
        default:     return false;
    }
}

// "<arch>.<suffix>" into key.
static const char * arch_key(const checker * c, const char * suffix, char key[160]) {
    snprintf(key, 160, "%s.%s", c->arch, suffix);
    return key;
}

// An integer key in [lo, hi]. Absent: *out unchanged, an error when required.
static int key_int(checker * c, const char * key, bool required, int64_t lo, int64_t hi,
                   int64_t * out) {
    char buf[QUOTED_CAP];
    int64_t v;
    if (!es_gguf_get_i64(c->g, key, &v)) {
        const char * name = quoted(key, strlen(key), buf);
        if (has_key(c->g, key)) return fail(c, "metadata key %s is not an integer", name);
        if (required) return fail(c, "metadata key %s is missing", name);
        return ES_OK;
    }
    if (v < lo || v > hi) {
        return fail(c, "metadata key %s = %lld is out of range [%lld, %lld]",
                    quoted(key, strlen(key), buf), (long long) v, (long long) lo, (long long) hi);
    }
    es_gguf_value value;
    es_gguf_value_at(c->g, es_gguf_find_key(c->g, key), &value);
    if (value.type != ES_GGUF_U32) {   // a bool or another width (check_key_types: the others)
        return fail(c, "metadata key %s is not a u32, as llama.cpp reads it", quoted(key, strlen(key), buf));
    }
    *out = v;
    return ES_OK;
}

// A per-layer integer (llama.cpp reads head counts and FFN widths either as
// one value or as an array of one per layer) into out[0 .. n_layer), each in
// [lo, hi]. Absent: out unchanged, an error when required.
static int key_per_layer(checker * c, const char * suffix, bool required, int64_t lo, int64_t hi,
                         int64_t * out) {
    char key[160], buf[QUOTED_CAP];
    arch_key(c, suffix, key);
    int32_t elem;
    uint64_t n;
    const void * data;
    if (!es_gguf_get_arr(c->g, key, &elem, &n, &data)) {  // one value, or absent
        const bool present = has_key(c->g, key);
        int64_t v = 0;
        const int rc = key_int(c, key, required, lo, hi, &v);
        for (int64_t il = 0; rc == ES_OK && present && il < c->n_layer; il++) out[il] = v;
        return rc;
    }
    if (n != (uint64_t) c->n_layer) {
        return fail(c, "metadata key %s holds %llu values for %lld layers",
                    quoted(key, strlen(key), buf), (unsigned long long) n, (long long) c->n_layer);
    }
    for (uint64_t il = 0; il < n; il++) {
        int64_t v;
        if (!arr_int(elem, data, il, &v)) {
            return fail(c, "metadata key %s is not an integer array", quoted(key, strlen(key), buf));
        }
        if (v < lo || v > hi) {
            return fail(c, "metadata key %s: layer %llu's value %lld is out of range [%lld, %lld]",
                        quoted(key, strlen(key), buf), (unsigned long long) il, (long long) v,
                        (long long) lo, (long long) hi);
        }
        out[il] = v;
    }
    return ES_OK;
}

// "<arch>.<suffix>", a finite float > 0 (>= 0 with zero_ok), when present or required.
static int key_float(checker * c, const char * suffix, bool required, bool zero_ok) {
    char key[160], buf[QUOTED_CAP];
    arch_key(c, suffix, key);
    float v;
    if (!es_gguf_get_f32(c->g, key, &v)) {
        const char * name = quoted(key, strlen(key), buf);
        if (has_key(c->g, key)) return fail(c, "metadata key %s is not a float", name);
        if (required) return fail(c, "metadata key %s is missing", name);
        return ES_OK;
    }
    if (!isfinite(v) || v < 0 || (v == 0 && !zero_ok)) {
        return fail(c, "metadata key %s = %g is not a finite %s number", quoted(key, strlen(key), buf),
                    (double) v, zero_ok ? "non-negative" : "positive");
    }
    return ES_OK;
}

// A RoPE base below 1 turns the frequencies up with the dimension: the
// angles overflow within the first positions, and the engines disagree on
// what NaN and infinity make of a rotation (native refuses its logits,
// llama.cpp answers). Every base trained has been in the thousands or more.
static int rope_base_at_least_1(checker * c, const char * suffix) {
    char key[160], buf[QUOTED_CAP];
    arch_key(c, suffix, key);
    float v;
    if (es_gguf_get_f32(c->g, key, &v) && v < 1.0f) {
        return fail(c, "metadata key %s = %g is below 1 (a RoPE base: its rotations would overflow)",
                    quoted(key, strlen(key), buf), (double) v);
    }
    return ES_OK;
}

/* ========================================================================
 * Hyperparameters
 * ======================================================================== */

// Head counts of every layer: n_head_kv divides n_head (grouped-query
// attention). Known architectures need at least one head per layer and,
// without key_length, heads that divide the width.
static int check_heads(checker * c, bool known, bool have_key_length) {
    for (int64_t il = 0; il < c->n_layer; il++) {
        const int64_t h = c->n_head[il], hkv = c->n_head_kv[il];
        if (known && h < 1) {
            return fail(c, "%s.attention.head_count is 0 at layer %lld", c->arch, (long long) il);
        }
        if (h > 0 && hkv > 0 && h % hkv) {
            return fail(c, "%s.attention.head_count %lld is not a multiple of head_count_kv %lld "
                        "(layer %lld)", c->arch, (long long) h, (long long) hkv, (long long) il);
        }
        if (h > 0 && !have_key_length && c->n_embd % h) {
            return fail(c, "%s.embedding_length %lld does not divide into %lld heads", c->arch,
                        (long long) c->n_embd, (long long) h);
        }
    }
    return ES_OK;
}

// Every "<arch>." key as llama.cpp reads its hyperparameters: a scalar
// integer as a u32, a float as an f32, an integer array of i32 or u32 (per
// layer); it refuses a file holding another type where it expects these.
static int check_key_types(checker * c) {
    static const char * const names[] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool",
                                         "string", "array", "u64", "i64", "f64"};
    char buf[QUOTED_CAP];
    const size_t n_arch = strlen(c->arch);
    for (int64_t i = 0; i < es_gguf_n_kv(c->g); i++) {
        const char * key = es_gguf_key_at(c->g, i);
        es_gguf_value v;
        if (strncmp(key, c->arch, n_arch) || key[n_arch] != '.' || !es_gguf_value_at(c->g, i, &v)) continue;
        const bool array = v.type == ES_GGUF_ARRAY;
        const int32_t t = array ? v.elem_type : v.type;
        const bool integer = t <= ES_GGUF_I32 || t == ES_GGUF_U64 || t == ES_GGUF_I64;
        const bool floating = t == ES_GGUF_F32 || t == ES_GGUF_F64;
        const char * want = !integer && !floating ? NULL
                          : floating ? (t == ES_GGUF_F32 ? NULL : "f32")
                          : array ? (t == ES_GGUF_I32 || t == ES_GGUF_U32 ? NULL : "i32 or u32")
                          : (t == ES_GGUF_U32 ? NULL : "u32");
        if (want) {
            return fail(c, "metadata key %s is %s %s; llama.cpp reads it as %s",
                        quoted(key, strlen(key), buf), array ? "an array of" : "a", names[t], want);
        }
    }
    return ES_OK;
}

static int check_hparams(checker * c) {
    const bool known = c->rules != NULL;
    char key[160];
    int rc = check_key_types(c);
    if (rc != ES_OK) return rc;
#define TRY(call) do { if (rc == ES_OK) rc = (call); } while (0)
    TRY(key_int(c, arch_key(c, "block_count", key), true, 1, MAX_LAYERS, &c->n_layer));
    TRY(key_int(c, arch_key(c, "embedding_length", key), true, 1, MAX_EMBD, &c->n_embd));
    int64_t n_ctx = 0;
    TRY(key_int(c, arch_key(c, "context_length", key), known, MIN_CTX, INT32_MAX, &n_ctx));
    if (rc != ES_OK) return rc;

    // Heads: head_count_kv defaults to head_count, the head width to n_embd / n_head.
    const int64_t min_heads = known ? 1 : 0;  // also the least RoPE dimensions
    TRY(key_per_layer(c, "attention.head_count", known, min_heads, MAX_HEADS, c->n_head));
    memcpy(c->n_head_kv, c->n_head, sizeof c->n_head);
    TRY(key_per_layer(c, "attention.head_count_kv", false, min_heads, MAX_HEADS, c->n_head_kv));
    const bool have_key_length = has_key(c->g, arch_key(c, "attention.key_length", key));
    TRY(key_int(c, key, false, 1, MAX_HEAD_DIM, &c->head_k));
    TRY(check_heads(c, known, have_key_length));
    if (rc != ES_OK) return rc;
    // Without key_length / value_length, a head is n_embd / n_head wide.
    const int64_t head = c->n_head[0] > 0 ? c->n_embd / c->n_head[0] : 0;
    if (!have_key_length) c->head_k = head;
    c->head_v = head;
    TRY(key_int(c, arch_key(c, "attention.value_length", key), false, 1, MAX_HEAD_DIM, &c->head_v));
    int64_t n_rot = c->head_k;
    TRY(key_int(c, arch_key(c, "rope.dimension_count", key), false, min_heads, MAX_HEAD_DIM, &n_rot));
    if (rc == ES_OK && known && (n_rot % 2 || n_rot > c->head_k)) {
        rc = fail(c, "%s.rope.dimension_count %lld is odd or wider than a head (%lld)", c->arch,
                  (long long) n_rot, (long long) c->head_k);
    }
    if (rc == ES_OK && known && c->rules->full_rope && (c->head_v != c->head_k || n_rot != c->head_k)) {
        rc = fail(c, "%s: key width %lld, value width %lld and RoPE dimensions %lld differ (the "
                  "%s graph needs them equal)", c->arch, (long long) c->head_k,
                  (long long) c->head_v, (long long) n_rot, c->arch);
    }
    const char * scaling = es_gguf_get_str(c->g, arch_key(c, "rope.scaling.type", key));
    if (rc == ES_OK && (scaling || has_key(c->g, key)) &&
        (!scaling || (strcmp(scaling, "none") && strcmp(scaling, "linear") &&
                      strcmp(scaling, "yarn") && strcmp(scaling, "longrope")))) {
        rc = fail(c, "%s.rope.scaling.type is not one of none, linear, yarn, longrope", c->arch);
    }

    // Sliding-window layers (gemma3): a period, or a flag per layer; the window.
    int64_t swa[MAX_LAYERS], window = 0, vocab_size = 0;
    TRY(key_per_layer(c, "attention.sliding_window_pattern", false, 0, INT32_MAX, swa));
    TRY(key_int(c, arch_key(c, "attention.sliding_window", key), false, 0, INT32_MAX, &window));
    // Read by llama.cpp as a u32 when present (the vocabulary gives the count).
    TRY(key_int(c, arch_key(c, "vocab_size", key), false, 1, MAX_VOCAB, &vocab_size));

    // Norm epsilon, RoPE frequencies, soft-capping.
    TRY(key_float(c, "attention.layer_norm_rms_epsilon", known, false));
    TRY(key_float(c, "attention.layer_norm_epsilon", false, false));
    TRY(key_float(c, "rope.freq_base", false, false));
    TRY(key_float(c, "rope.freq_base_swa", false, false));
    TRY(rope_base_at_least_1(c, "rope.freq_base"));
    TRY(rope_base_at_least_1(c, "rope.freq_base_swa"));
    TRY(key_float(c, "rope.scaling.factor", false, true));
    TRY(key_float(c, "rope.scale_linear", false, false));
    TRY(key_float(c, "final_logit_softcapping", false, true));
    TRY(key_float(c, "attn_logit_softcapping", false, true));

    // Experts (llama.cpp asserts each): none, or 0 < used <= count in every
    // layer; groups fewer than the experts, dividing them, some used.
    int64_t n_groups = 0, n_groups_used = 0, n_nextn = 0;
    TRY(key_int(c, arch_key(c, "expert_count", key), false, 0, MAX_EXPERTS, &c->n_expert));
    TRY(key_per_layer(c, "expert_used_count", false, 0, MAX_EXPERTS, c->n_expert_used));
    TRY(key_int(c, arch_key(c, "expert_group_count", key), false, 0, MAX_EXPERTS, &n_groups));
    TRY(key_int(c, arch_key(c, "expert_group_used_count", key), false, 0, MAX_EXPERTS, &n_groups_used));
    TRY(key_int(c, arch_key(c, "nextn_predict_layers", key), false, 0, c->n_layer, &n_nextn));
    if (rc != ES_OK) return rc;
    if (c->rules && c->rules->ffn == ES_FFN_MOE && c->n_expert == 0) {
        return fail(c, "%s.expert_count is missing or 0 (every %s layer is a mixture of experts)",
                    c->arch, c->arch);
    }
    int64_t used_max = 0;
    for (int64_t il = 0; il < c->n_layer; il++) {
        used_max = c->n_expert_used[il] > used_max ? c->n_expert_used[il] : used_max;
    }
    if (c->n_expert > 0 ? used_max < 1 || used_max > c->n_expert : used_max != 0) {
        return fail(c, "%s.expert_used_count %lld does not fit expert_count %lld", c->arch,
                    (long long) used_max, (long long) c->n_expert);
    }
    if (c->n_expert > 0 ? n_groups >= c->n_expert ||
                          (n_groups > 1 && (c->n_expert % n_groups || n_groups_used < 1 ||
                                            n_groups_used >= n_groups))
                        : n_groups != 0) {
        return fail(c, "%s.expert_group_count %lld (%lld used) does not fit expert_count %lld",
                    c->arch, (long long) n_groups, (long long) n_groups_used, (long long) c->n_expert);
    }

    // FFN widths: per layer for dense blocks; one expert's width for MoE
    // blocks (llama: feed_forward_length; qwen3moe: expert_feed_forward_length,
    // else the width of the experts used together).
    const bool moe = c->n_expert > 0;
    TRY(key_per_layer(c, "feed_forward_length", known && !moe, known && !moe ? 1 : 0, MAX_FF, c->n_ff));
    c->n_ff_exp = c->n_ff[0];
    if (moe && c->rules && c->rules->ffn == ES_FFN_MOE) {
        c->n_ff_exp = c->n_expert_used[0] ? c->n_ff[0] / c->n_expert_used[0] : 0;
        TRY(key_int(c, arch_key(c, "expert_feed_forward_length", key), false, 1, MAX_FF, &c->n_ff_exp));
    }
    if (rc == ES_OK && known && moe && c->n_ff_exp < 1) {
        rc = fail(c, "%s: the experts' width (expert_feed_forward_length) is missing or 0", c->arch);
    }
#undef TRY
    return rc;
}

/* ========================================================================
 * Vocabulary
 * ======================================================================== */

static uint64_t hash_bytes(const uint8_t * s, uint64_t n) {
    uint64_t h = 1469598103934665603ull;  // FNV-1a
    for (uint64_t i = 0; i < n; i++) h = (h ^ s[i]) * 1099511628211ull;
    return h;
}

// The byte of a token "<0xXX>" with upper-case hex digits; -1 for any other.
static int32_t byte_value(const uint8_t * s, uint64_t len) {
    static const char hex[] = "0123456789ABCDEF";
    if (len != 6 || memcmp(s, "<0x", 3) || s[5] != '>') return -1;
    const char * hi = memchr(hex, s[3], 16), * lo = memchr(hex, s[4], 16);
    return hi && lo ? (int32_t) ((hi - hex) * 16 + (lo - hex)) : -1;
}

// A token as llama.cpp stores it: a C string, cut at its first NUL byte.
static uint64_t stored_len(const uint8_t * s, uint64_t len) {
    const uint8_t * nul = memchr(s, 0, (size_t) len);
    return nul ? (uint64_t) (nul - s) : len;
}

// The vocabulary hashed once, for tokens looked up by text (a repeat, a
// merge's parts): open addressing over token indices.
typedef struct vocab_index {
    uint32_t       * slots;   // (cap) token index + 1; 0: empty
    const uint8_t ** starts;  // (n) each token's length field in the file
    size_t           cap;     // a power of two, at least twice the tokens
} vocab_index;

static void vocab_index_free(vocab_index * v) {
    free(v->slots);
    free(v->starts);
    *v = (vocab_index) { 0 };
}

// The slot that holds the token of text s (len bytes, as llama.cpp stores
// it), or the empty slot where it would go.
static size_t vocab_slot(const vocab_index * v, const uint8_t * s, uint64_t len) {
    size_t h = (size_t) hash_bytes(s, len) & (v->cap - 1);
    for (; v->slots[h] != 0; h = (h + 1) & (v->cap - 1)) {
        const uint8_t * o = v->starts[v->slots[h] - 1];
        if (stored_len(o + 8, load_le(o, 8)) == len && memcmp(o + 8, s, (size_t) len) == 0) break;
    }
    return h;
}

static bool vocab_has(const vocab_index * v, const uint8_t * s, uint64_t len) {
    return v->slots[vocab_slot(v, s, len)] != 0;
}

// tokenizer.ggml.tokens: every token non-empty and seen once as llama.cpp
// stores it (cut at a NUL, so "a\0b" repeats "a"): llama.cpp asserts its
// token -> id map is as large as the vocabulary. Sets n_vocab, and *v (the
// caller frees it) on ES_OK.
static int check_tokens(checker * c, const uint8_t * data, uint64_t n, vocab_index * v) {
    char buf[QUOTED_CAP];
    if (n == 0 || n > MAX_VOCAB) {
        return fail(c, "tokenizer.ggml.tokens holds %llu tokens, not 1..%d", (unsigned long long) n,
                    MAX_VOCAB);
    }
    v->cap = 16;
    while (v->cap < 2 * (size_t) n) v->cap *= 2;
    v->slots = calloc(v->cap, sizeof *v->slots);
    v->starts = malloc((size_t) n * sizeof *v->starts);
    if (!v->slots || !v->starts) {
        vocab_index_free(v);
        return ES_ERR_NO_MEMORY;
    }
    int rc = ES_OK;
    const uint8_t * p = data;
    for (uint64_t i = 0; i < n && rc == ES_OK; i++) {
        v->starts[i] = p;
        const uint64_t full = load_le(p, 8);
        const uint8_t * s = p + 8;
        const uint64_t len = stored_len(s, full);
        p = s + full;
        int32_t b = byte_value(s, len);
        if (b >= 0) c->byte_hex[b >> 3] |= (uint8_t) (1u << (b & 7));
        if (len == 1) c->byte_plain[s[0] >> 3] |= (uint8_t) (1u << (s[0] & 7));
        if (len == 0) {
            rc = full ? fail(c, "tokenizer.ggml.tokens: token %llu '%s' is empty up to its NUL byte "
                             "(where llama.cpp cuts it)", (unsigned long long) i,
                             quoted(s, (size_t) full, buf))
                      : fail(c, "tokenizer.ggml.tokens: token %llu is empty", (unsigned long long) i);
            break;
        }
        const size_t h = vocab_slot(v, s, len);
        if (v->slots[h] != 0) {
            rc = fail(c, "tokenizer.ggml.tokens: token %llu '%s' repeats token %u%s",
                      (unsigned long long) i, quoted(s, (size_t) full, buf), v->slots[h] - 1,
                      len < full ? " up to its NUL byte (where llama.cpp cuts it)" : "");
            break;
        }
        v->slots[h] = (uint32_t) i + 1;
    }
    if (rc != ES_OK) vocab_index_free(v);
    c->n_vocab = (int64_t) n;
    return rc;
}

// A numeric array that llama.cpp reads as one element per token of type elem.
static int check_per_token(checker * c, const char * key, int32_t elem, const char * elem_name,
                           const void ** data) {
    int32_t type;
    uint64_t n;
    *data = NULL;
    if (!es_gguf_get_arr(c->g, key, &type, &n, data)) {
        if (has_key(c->g, key)) {
            return fail(c, "metadata key %s is not an array of %s", key, elem_name);
        }
        return ES_OK;
    }
    if (type != elem || n != (uint64_t) c->n_vocab) {
        return fail(c, "metadata key %s: expected %lld %s values (one per token), found %llu of "
                    "another type or count", key, (long long) c->n_vocab, elem_name,
                    (unsigned long long) n);
    }
    return ES_OK;
}

static bool is_hex(uint8_t ch) {
    return (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f') || (ch >= 'A' && ch <= 'F');
}

// "<0xXX>", the text of a byte token.
static bool byte_token(const uint8_t * s, uint64_t len) {
    return len == 6 && !memcmp(s, "<0x", 3) && is_hex(s[3]) && is_hex(s[4]) && s[5] == '>';
}

// tokenizer.ggml.merges: each "left right", both parts non-empty; for a
// byte-level BPE tokenizer (model "gpt2", which llama.cpp reads the merges
// of) at least one merge, and each merge's parts and their concatenation
// tokens of v (llama.cpp splits at the first space after the first byte).
// Without merges such a tokenizer spells every word byte by byte, and its
// model answers nonsense.
static int check_merges(checker * c, const char * model, const vocab_index * v) {
    char buf[QUOTED_CAP];
    const bool bpe = model && !strcmp(model, "gpt2");
    uint64_t n;
    const void * data;
    if (!es_gguf_get_str_arr(c->g, "tokenizer.ggml.merges", &n, &data)) {
        if (has_key(c->g, "tokenizer.ggml.merges")) {
            return fail(c, "tokenizer.ggml.merges is not an array of strings");
        }
        return bpe ? fail(c, "tokenizer.ggml.merges is missing, which the BPE ('gpt2') tokenizer needs") : ES_OK;
    }
    if (bpe && n == 0) return fail(c, "tokenizer.ggml.merges is empty, which the BPE ('gpt2') tokenizer cannot be");
    uint8_t * joined = NULL;   // a merge's parts concatenated, for the lookup
    size_t joined_cap = 0;
    int rc = ES_OK;
    const uint8_t * p = data;
    for (uint64_t i = 0; i < n && rc == ES_OK; i++) {
        const uint64_t len = load_le(p, 8);
        const uint8_t * s = p + 8;
        p = s + len;
        const uint8_t * sp = len > 1 ? memchr(s + 1, ' ', (size_t) len - 1) : NULL;
        if (!sp || sp == s + len - 1) {
            rc = fail(c, "tokenizer.ggml.merges: merge %llu '%s' is not two tokens separated by "
                      "a space", (unsigned long long) i, quoted(s, (size_t) len, buf));
            break;
        }
        if (!bpe) continue;
        const uint64_t left = (uint64_t) (sp - s), right = len - left - 1;
        if (len > joined_cap) {
            uint8_t * grown = realloc(joined, (size_t) len);
            if (!grown) {
                rc = ES_ERR_NO_MEMORY;
                break;
            }
            joined = grown, joined_cap = (size_t) len;
        }
        memcpy(joined, s, (size_t) left);
        memcpy(joined + left, sp + 1, (size_t) right);
        const char * missing = !vocab_has(v, s, left)                ? "its left part"
                             : !vocab_has(v, sp + 1, right)          ? "its right part"
                             : !vocab_has(v, joined, left + right)   ? "the two parts joined"
                                                                     : NULL;
        if (missing) {
            rc = fail(c, "tokenizer.ggml.merges: merge %llu '%s' names a token the vocabulary lacks (%s)",
                      (unsigned long long) i, quoted(s, (size_t) len, buf), missing);
        }
    }
    free(joined);
    return rc;
}

// Every tokenizer.ggml.*_token_id (bos, eos, unknown, padding, seperator,
// eot, fim_*, ...) names a token.
static int check_special_ids(checker * c) {
    static const char prefix[] = "tokenizer.ggml.", suffix[] = "_token_id";
    for (int64_t i = 0; i < es_gguf_n_kv(c->g); i++) {
        const char * key = es_gguf_key_at(c->g, i);
        const size_t n = strlen(key);
        if (strncmp(key, prefix, sizeof prefix - 1) || n < sizeof prefix - 1 + sizeof suffix - 1 ||
            strcmp(key + n - (sizeof suffix - 1), suffix)) {
            continue;
        }
        int64_t id = 0;
        const int rc = key_int(c, key, true, 0, c->n_vocab - 1, &id);
        if (rc != ES_OK) return rc;
    }
    return ES_OK;
}

// A tokenizer that falls back to byte tokens for text its vocabulary lacks
// (llama.cpp's "llama" (SPM) and "t5" (UGM): "<0xXX>", else the byte itself;
// "plamo2": "<0xXX>") looks each up unchecked and aborts on a missing one:
// every byte needs its token.
static int check_byte_tokens(checker * c, const char * model) {
    const bool spm = model && (!strcmp(model, "llama") || !strcmp(model, "t5"));
    if (!spm && !(model && !strcmp(model, "plamo2"))) return ES_OK;
    for (int b = 0; b < 256; b++) {
        const bool hex = c->byte_hex[b >> 3] >> (b & 7) & 1, plain = c->byte_plain[b >> 3] >> (b & 7) & 1;
        if (!hex && !(spm && plain)) {
            return fail(c, "tokenizer.ggml.tokens: no token <0x%02X>%s, which the '%s' tokenizer falls "
                        "back to (llama.cpp aborts on a byte without its token)", b,
                        spm ? " nor the byte itself" : "", model);
        }
    }
    return ES_OK;
}

// tokenizer.ggml.token_type: one of llama.cpp's types per token, and a
// byte token's text "<0xXX>".
static int check_token_types(checker * c, const uint8_t * tokens) {
    const void * types;
    int rc;
    if ((rc = check_per_token(c, "tokenizer.ggml.token_type", GV_I32, "i32", &types))) return rc;
    const uint8_t * p = tokens;
    for (int64_t i = 0; types && i < c->n_vocab; i++) {
        const int32_t t = (int32_t) load_le((const uint8_t *) types + 4 * i, 4);
        const uint64_t len = load_le(p, 8);
        const uint8_t * s = p + 8;
        p = s + len;
        if (t < 0 || t >= N_TOKEN_TYPES) {
            return fail(c, "tokenizer.ggml.token_type: token %lld has type %d, not 0..%d",
                        (long long) i, (int) t, N_TOKEN_TYPES - 1);
        }
        // llama.cpp reads a byte token's value from its text, "<0xXX>".
        if (t == TOKEN_TYPE_BYTE && !byte_token(s, len)) {
            char buf[QUOTED_CAP];
            return fail(c, "tokenizer.ggml.token_type: token %lld '%s' is of type byte but not "
                        "of the form <0xXX>", (long long) i, quoted(s, (size_t) len, buf));
        }
    }
    return ES_OK;
}

static int check_vocab(checker * c) {
    const char * model = es_gguf_get_str(c->g, "tokenizer.ggml.model");
    uint64_t n;
    const void * tokens;
    // llama.cpp reads a model that says it has no vocabulary, then asserts
    // (aborts) on the first token it is asked to read or write.
    if (model && (!strcmp(model, "none") || !strcmp(model, "no_vocab"))) {
        return fail(c, "tokenizer.ggml.model is '%s': the file has no vocabulary, which prompts "
                    "and replies are read and written with", model);
    }
    // RWKV's tokenizer reads every token as an escaped byte string, and
    // llama.cpp runs out of memory (an abort) on another tokenizer's texts.
    if (model && !strcmp(model, "rwkv") && strncmp(c->arch, "rwkv", 4) != 0) {
        return fail(c, "tokenizer.ggml.model is 'rwkv', RWKV's tokenizer, in a %s model", c->arch);
    }
    if (!es_gguf_get_str_arr(c->g, "tokenizer.ggml.tokens", &n, &tokens)) {
        if (has_key(c->g, "tokenizer.ggml.tokens")) {
            return fail(c, "tokenizer.ggml.tokens is not an array of strings");
        }
        return fail(c, "tokenizer.ggml.tokens is missing (the file has no vocabulary)");
    }
    vocab_index v = { 0 };
    int rc = check_tokens(c, tokens, n, &v);
    if (rc != ES_OK) return rc;
    rc = check_byte_tokens(c, model);
    if (rc == ES_OK) rc = check_token_types(c, tokens);
    if (rc == ES_OK) {
        const void * scores;
        rc = check_per_token(c, "tokenizer.ggml.scores", GV_F32, "f32", &scores);
    }
    if (rc == ES_OK) rc = check_merges(c, model, &v);
    vocab_index_free(&v);
    return rc == ES_OK ? check_special_ids(c) : rc;
}

/* ========================================================================
 * Tensors
 * ======================================================================== */

static bool is_norm(const char * name) {
    static const char norm_suffix[] = "_norm.weight";
    const size_t n = strlen(name);
    return n >= sizeof norm_suffix - 1 && !strcmp(name + n - (sizeof norm_suffix - 1), norm_suffix);
}

// Every tensor: vectors (1-D) and norm weights F32, as converters store them
// and llama.cpp's kernels read them; blk.N only for N < block_count.
static int check_all_tensors(checker * c) {
    char buf[QUOTED_CAP];
    for (int64_t i = 0; i < es_gguf_n_tensors(c->g); i++) {
        const es_tensor * t = es_gguf_tensor_at(c->g, i);
        const size_t n = strlen(t->name);
        const bool norm = is_norm(t->name);
        if ((t->n_dims == 1 || norm) && t->type != ES_TYPE_F32) {
            return fail(c, "tensor %s: expected F32 (a %s), found %s", quoted(t->name, n, buf),
                        norm ? "norm weight" : "vector", es_type_info(t->type)->name);
        }
        if (!strncmp(t->name, "blk.", 4)) {
            char * end;
            const long il = strtol(t->name + 4, &end, 10);
            if (end == t->name + 4 || *end != '.' || il < 0 || il >= c->n_layer) {
                return fail(c, "tensor %s is not in a layer 0..%lld (block_count %lld)",
                            quoted(t->name, n, buf), (long long) c->n_layer - 1, (long long) c->n_layer);
            }
        }
    }
    return ES_OK;
}

#define F16_MAX 65504.0f   // the largest finite F16

// Values neither engine can compute with (checked after check_all_tensors:
// vectors and norms are F32). A NaN or infinity in a vector, a norm weight
// beyond F16's range (it overflows the F16 KV cache and activation scales)
// or a quantized block's infinite or NaN scale makes llama.cpp's logits NaN,
// while this engine's activation rounding would turn the same NaN into
// finite, fluent nonsense: both refuse the file here instead. Vectors and
// norms are small; a block's scales are 2-4 of its 18-292 bytes. Expert
// stacks (3-D) are left out: an expert cache reads them from disk on demand,
// for models larger than memory, which scanning them would read whole.
static bool scale_finite(const uint8_t * p, int32_t bytes) {
    if (bytes == 2) return (load_le(p, 2) & 0x7C00) != 0x7C00;  // F16: exponent all ones
    float v;
    memcpy(&v, p, 4);
    return isfinite(v);
}

static int check_values(checker * c) {
    char buf[QUOTED_CAP];
    for (int64_t i = 0; i < es_gguf_n_tensors(c->g); i++) {
        const es_tensor * t = es_gguf_tensor_at(c->g, i);
        const es_type_traits * ti = es_type_info(t->type);
        const uint8_t * data = t->data;
        if (t->type == ES_TYPE_F32 && (t->n_dims == 1 || is_norm(t->name))) {
            const float limit = is_norm(t->name) ? F16_MAX : INFINITY;
            for (size_t k = 0; k < t->nbytes / 4; k++) {
                float v;
                memcpy(&v, data + 4 * k, 4);  // the data may sit at any alignment
                if (!isfinite(v) || fabsf(v) > limit) {
                    return fail(c, "tensor %s: value %zu is %g (%s): the weights are damaged",
                                quoted(t->name, strlen(t->name), buf), k, (double) v,
                                isfinite(v) ? "a norm weight beyond F16's range" : "not finite");
                }
            }
        } else if (ti->scale_bytes && t->ne[2] == 1) {
            const size_t n_blocks = t->nbytes / (size_t) ti->block_bytes;
            for (size_t b = 0; b < n_blocks; b++) {
                const uint8_t * block = data + b * (size_t) ti->block_bytes;
                for (int k = 0; k < 2 && ti->scales[k] >= 0; k++) {
                    if (!scale_finite(block + ti->scales[k], ti->scale_bytes)) {
                        return fail(c, "tensor %s: block %zu has an infinite or NaN scale: the weights "
                                    "are damaged", quoted(t->name, strlen(t->name), buf), b);
                    }
                }
            }
        }
    }
    return ES_OK;
}

// A matrix's type must be a weight type: not one of ggml's integer types or F64.
static bool weight_type(int32_t type) {
    return type != 24 && type != 25 && type != 26 && type != 27 && type != 28;  // I8..I64, F64
}

// Tensor <kind> (il < 0) or blk.<il>.<kind> of shape (ne0, ne1, ne2); ne1 < 0: any.
static int want(checker * c, int32_t il, const char * kind, int64_t ne0, int64_t ne1, int64_t ne2,
                bool required) {
    char name[96];
    if (il < 0) snprintf(name, sizeof name, "%s", kind);
    else snprintf(name, sizeof name, "blk.%d.%s", (int) il, kind);
    const es_tensor * t = es_gguf_find_tensor(c->g, name);
    if (!t) return required ? fail(c, "tensor %s is missing", name) : ES_OK;
    if (ne1 < 0) ne1 = t->ne[1];
    if (t->ne[0] != ne0 || t->ne[1] != ne1 || t->ne[2] != ne2 || t->ne[3] != 1) {
        return fail(c, "tensor %s has shape (%lld, %lld, %lld, %lld), expected (%lld, %lld, %lld, 1)",
                    name, (long long) t->ne[0], (long long) t->ne[1], (long long) t->ne[2],
                    (long long) t->ne[3], (long long) ne0, (long long) ne1, (long long) ne2);
    }
    if (!weight_type(t->type)) {
        return fail(c, "tensor %s: %s is not a weight type", name, es_type_info(t->type)->name);
    }
    return ES_OK;
}

// token_embd (n_embd, n_vocab) and output likewise, when present: what an
// architecture the engine does not read is still held to.
static int check_embeddings(checker * c) {
    const int64_t V = c->n_vocab ? c->n_vocab : -1;
    int rc = want(c, -1, "token_embd.weight", c->n_embd, V, 1, false);
    if (rc == ES_OK) rc = want(c, -1, "output.weight", c->n_embd, V, 1, false);
    return rc;
}

// The sizes the es_dim symbols stand for in layer il (0 for the global rows).
static void layer_dims(const checker * c, int32_t il, int64_t size[ES_DIM_COUNT]) {
    const int64_t Q = c->n_head[il] * c->head_k, K = c->n_head_kv[il] * c->head_k;
    const int64_t V = c->n_head_kv[il] * c->head_v;
    size[ES_DIM_ONE] = 1;
    size[ES_DIM_EMBD] = c->n_embd;
    size[ES_DIM_VOCAB] = c->n_vocab ? c->n_vocab : -1;   // a file without a vocabulary: any
    size[ES_DIM_FF] = c->n_ff[il];
    size[ES_DIM_Q] = Q;
    size[ES_DIM_K] = K;
    size[ES_DIM_V] = V;
    size[ES_DIM_HEAD] = c->head_k;
    size[ES_DIM_QKV] = Q + K + V;
    size[ES_DIM_EXPERT] = c->n_expert;
    size[ES_DIM_FF_EXP] = c->n_ff_exp;
}

// Calls fn for every row of the architecture's table that applies to this
// file, in every layer it is in, with its full name, resolved shape and
// whether the file must have it. Stops at the first status that is not ES_OK.
typedef int (*row_fn)(checker * c, const char * name, const int64_t ne[3], int32_t flags, bool required,
                      void * arg);

static int each_row(checker * c, row_fn fn, void * arg) {
    const bool moe = c->n_expert > 0;
    int rc = ES_OK;
    for (int32_t r = 0; rc == ES_OK && r < c->rules->n_tensors; r++) {
        const es_tensor_spec * sp = &c->rules->tensors[r].spec;
        if (((sp->flags & ES_TENSOR_DENSE) && moe) || ((sp->flags & ES_TENSOR_EXPERTS) && !moe)) continue;
        const bool per_layer = sp->flags & ES_TENSOR_LAYER;
        for (int32_t il = 0; rc == ES_OK && il < (per_layer ? c->n_layer : 1); il++) {
            int64_t size[ES_DIM_COUNT];
            layer_dims(c, il, size);
            char name[80];
            if (per_layer) snprintf(name, sizeof name, "blk.%d.%s", (int) il, sp->name);
            else snprintf(name, sizeof name, "%s", sp->name);
            bool required = sp->flags & ES_TENSOR_REQUIRED;
            if (sp->flags & ES_TENSOR_UNFUSED) {   // Q, K, V: required unless in one matrix
                char fused[80];
                snprintf(fused, sizeof fused, "blk.%d.attn_qkv.weight", (int) il);
                required = es_gguf_find_tensor(c->g, fused) == NULL;
            }
            const int64_t ne[3] = {size[sp->ne[0]], size[sp->ne[1]], size[sp->ne[2]]};
            rc = fn(c, name, ne, sp->flags, required, arg);
        }
    }
    return rc;
}

// Every tensor the architecture reads, in the shape its table gives.
static int want_row(checker * c, const char * name, const int64_t ne[3], int32_t flags, bool required,
                    void * arg) {
    (void) flags;
    (void) arg;
    return want(c, -1, name, ne[0], ne[1], ne[2], required);
}

/* ========================================================================
 * The pass
 * ======================================================================== */

// What both passes do first: the architecture named, its hyperparameters and
// vocabulary read and checked into c.
// known: only an architecture the engine reads (ES_ERR_UNSUPPORTED otherwise).
static int read_model(checker * c, bool known) {
    char buf[QUOTED_CAP];
    c->arch = es_gguf_get_str(c->g, "general.architecture");
    if (!c->arch) return fail(c, "metadata key general.architecture is missing or not a string");
    if (strlen(c->arch) == 0 || strlen(c->arch) > 64) {
        return fail(c, "general.architecture '%s' is not a name of 1..64 bytes",
                    quoted(c->arch, strlen(c->arch), buf));
    }
    c->rules = es__arch(c->arch);
    if (known && !c->rules) {
        fail(c, "architecture %s is not one the native engine reads", quoted(c->arch, strlen(c->arch), buf));
        return ES_ERR_UNSUPPORTED;
    }
    int rc = check_hparams(c);
    if (rc == ES_OK) rc = check_vocab(c);
    return rc;
}

int es_gguf_validate(const es_gguf * g, char * err, size_t err_cap) {
    if (err && err_cap) err[0] = '\0';
    if (!g) return ES_ERR_INVALID_ARG;
    checker * c = calloc(1, sizeof *c);
    if (!c) return ES_ERR_NO_MEMORY;
    *c = (checker) {.g = g, .err = err, .err_cap = err_cap};
    int rc = read_model(c, false);
    if (rc == ES_OK) rc = check_all_tensors(c);
    if (rc == ES_OK) rc = c->rules ? each_row(c, want_row, NULL) : check_embeddings(c);
    if (rc == ES_OK) rc = check_values(c);
    if (rc == ES_ERR_NO_MEMORY) fail(c, "out of memory validating the GGUF file");
    free(c);
    return rc;
}

typedef struct shapes_out {
    es_tensor_shape * out;
    int32_t cap, n;
} shapes_out;

static int add_shape(checker * c, const char * name, const int64_t ne[3], int32_t flags, bool required,
                     void * arg) {
    (void) c;
    (void) required;
    shapes_out * s = arg;
    if (s->n < s->cap) {
        es_tensor_shape * t = &s->out[s->n];
        snprintf(t->name, sizeof t->name, "%s", name);
        memcpy(t->ne, ne, sizeof t->ne);
        t->flags = flags;
    }
    s->n++;
    return ES_OK;
}

int es_gguf_arch_shapes(const es_gguf * g, es_tensor_shape * out, int32_t cap, int32_t * n,
                        char * err, size_t err_cap) {
    if (err && err_cap) err[0] = '\0';
    if (!g || !n || cap < 0 || (cap > 0 && !out)) return ES_ERR_INVALID_ARG;
    checker * c = calloc(1, sizeof *c);
    if (!c) return ES_ERR_NO_MEMORY;
    *c = (checker) {.g = g, .err = err, .err_cap = err_cap};
    int rc = read_model(c, true);
    shapes_out s = {.out = out, .cap = cap};
    if (rc == ES_OK) rc = each_row(c, add_shape, &s);
    if (rc == ES_OK) *n = s.n;
    free(c);
    return rc;
}
