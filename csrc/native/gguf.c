/*
 * gguf.c — a strict GGUF reader (versions 2 and 3: the same layout).
 *
 * A GGUF file is: header (magic "GGUF", version, tensor count, key count),
 * key/value metadata, tensor infos (name, dims, type, offset), padding to
 * general.alignment, then the tensor data. Everything is little-endian.
 *
 * The file is mapped read-only (or read into memory where mmap fails) and
 * parsed through one bounds-checked cursor: every count, length and offset is
 * checked against the bytes left before it is used, so a damaged or hostile
 * file ends in ES_ERR_FORMAT / ES_ERR_UNSUPPORTED with a one-line reason,
 * never in a read out of bounds. Keys, tensor names and string values are
 * copied into NUL-terminated storage owned by the es_gguf; tensor data and
 * numeric arrays stay inside the mapping.
 */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE  // madvise's MADV_DONTNEED (glibc: not POSIX)

#include "native/native_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ========================================================================
 * ggml type table
 * ======================================================================== */

// Every ggml type a GGUF may name, supported by the kernels or not: the
// reader sizes and bounds-checks tensors of any of them. Gaps are ids ggml
// retired (4, 5, 31-33, 36-38). Scales as ggml-common.h's block structs lay
// them out (IQ1_M packs its scale into other fields, MXFP4 and NVFP4 have
// 8-bit ones: none listed).
static const es_type_traits TYPE_TRAITS[] = {
    [0]  = {"F32", 1, 4},                    [1]  = {"F16", 1, 2},
    [2]  = {"Q4_0", 32, 18, 2, {0, -1}},     [3]  = {"Q4_1", 32, 20, 2, {0, 2}},
    [6]  = {"Q5_0", 32, 22, 2, {0, -1}},     [7]  = {"Q5_1", 32, 24, 2, {0, 2}},
    [8]  = {"Q8_0", 32, 34, 2, {0, -1}},     [9]  = {"Q8_1", 32, 36, 2, {0, 2}},
    [10] = {"Q2_K", 256, 84, 2, {80, 82}},   [11] = {"Q3_K", 256, 110, 2, {108, -1}},
    [12] = {"Q4_K", 256, 144, 2, {0, 2}},    [13] = {"Q5_K", 256, 176, 2, {0, 2}},
    [14] = {"Q6_K", 256, 210, 2, {208, -1}}, [15] = {"Q8_K", 256, 292, 4, {0, -1}},
    [16] = {"IQ2_XXS", 256, 66, 2, {0, -1}}, [17] = {"IQ2_XS", 256, 74, 2, {0, -1}},
    [18] = {"IQ3_XXS", 256, 98, 2, {0, -1}}, [19] = {"IQ1_S", 256, 50, 2, {0, -1}},
    [20] = {"IQ4_NL", 32, 18, 2, {0, -1}},   [21] = {"IQ3_S", 256, 110, 2, {0, -1}},
    [22] = {"IQ2_S", 256, 82, 2, {0, -1}},   [23] = {"IQ4_XS", 256, 136, 2, {0, -1}},
    [24] = {"I8", 1, 1},                     [25] = {"I16", 1, 2},
    [26] = {"I32", 1, 4},                    [27] = {"I64", 1, 8},
    [28] = {"F64", 1, 8},                    [29] = {"IQ1_M", 256, 56},
    [30] = {"BF16", 1, 2},                   [34] = {"TQ1_0", 256, 54, 2, {52, -1}},
    [35] = {"TQ2_0", 256, 66, 2, {64, -1}},  [39] = {"MXFP4", 32, 17},
    [40] = {"NVFP4", 64, 36},                [41] = {"Q1_0", 128, 18, 2, {0, -1}},
    [42] = {"Q2_0", 64, 18, 2, {0, -1}},
};

const es_type_traits * es_type_info(int32_t type) {
    if (type < 0 || type >= (int32_t) (sizeof(TYPE_TRAITS) / sizeof(TYPE_TRAITS[0]))) return NULL;
    return TYPE_TRAITS[type].name ? &TYPE_TRAITS[type] : NULL;
}

/* ========================================================================
 * The reader's state
 * ======================================================================== */

#define GV_COUNT 13  // enum es_gguf_type's values are 0 .. GV_COUNT - 1

// Bytes of one scalar of each value type; 0 for string and array.
static const uint8_t GV_SIZE[GV_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
static const char * const GV_NAME[GV_COUNT] = {
    "u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64",
};

#define DEFAULT_ALIGNMENT 32
#define MAX_ALIGNMENT (1 << 20)  // general.alignment above it is refused (see read_alignment)
#define MAX_ARRAY_DEPTH   4   // arrays of arrays of ... nested deeper are rejected
#define MAX_NAME_BYTES    63  // as ggml's GGML_MAX_NAME (64) with its NUL
#define MIN_KV_BYTES      13  // key length (8), type (4), one byte of value
#define MIN_TENSOR_BYTES  32  // name length (8), n_dims (4), ne[0] (8), type (4), offset (8)

typedef struct es_kv {
    char *    key;       // owned, NUL-terminated
    int32_t   type;      // enum es_gguf_type
    const uint8_t * raw; // the value's bytes inside the mapping (a string's after its length)
    union {              // scalars: integers widened by sign, floats to double
        uint64_t u;
        int64_t  i;
        double   f;
    } num;
    char *    str;       // ES_GGUF_STRING: owned copy of the value
    int32_t   arr_type;  // ES_GGUF_ARRAY: element type
    uint64_t  arr_n;     // ES_GGUF_ARRAY: element count; ES_GGUF_STRING: bytes
    const uint8_t * arr_data;  // ES_GGUF_ARRAY: first element, inside the mapping
} es_kv;

struct es_gguf {
    const uint8_t * data;    // (size) the whole file
    size_t          size;
    void *          map;     // the mmap'd file (munmap on close), or NULL
    void *          heap;    // the file read into memory (free on close), or NULL
    int32_t         version;     // 2 or 3
    uint64_t        alignment;   // general.alignment or DEFAULT_ALIGNMENT
    uint64_t        data_start;  // byte offset of the tensor data section
    es_kv *         kvs;     // (n_kv)
    int64_t         n_kv;
    es_tensor *     tensors; // (n_tensors), in file order
    int64_t         n_tensors;
    int64_t *       kv_hash;      // (hash_cap) open-addressed key -> kv index, -1 empty
    int64_t *       tensor_hash;  // (hash_cap) name -> tensor index, -1 empty
    size_t          kv_hash_cap;  // powers of two, at least twice the entries
    size_t          tensor_hash_cap;
};

/* ========================================================================
 * Errors
 * ======================================================================== */

static int fail(char * err, size_t err_cap, int status, const char * fmt, ...) {
    if (err && err_cap) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, err_cap, fmt, ap);
        va_end(ap);
    }
    return status;
}

// A name from the file made safe for a one-line message: control and
// non-ASCII bytes become '?', long names are cut with "...".
static const char * printable(const char * s, char buf[72]) {
    size_t i = 0;
    for (; s[i] && i < 64; i++) {
        unsigned char c = (unsigned char) s[i];
        buf[i] = (c < 0x20 || c >= 0x7f) ? '?' : (char) c;
    }
    if (s[i]) {
        memcpy(buf + i, "...", 3);
        i += 3;
    }
    buf[i] = '\0';
    return buf;
}

/* ========================================================================
 * Bounds-checked cursor
 * ======================================================================== */

typedef struct cursor {
    const uint8_t * p;
    size_t          size;
    size_t          pos;   // next byte to read, <= size
    char *          err;
    size_t          err_cap;
} cursor;

static size_t left(const cursor * c) { return c->size - c->pos; }

static uint64_t load_le(const uint8_t * p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

// Reads an n-byte little-endian integer; `what` names it in the error.
static int read_uint(cursor * c, int n, uint64_t * out, const char * what) {
    *out = 0;
    if (left(c) < (size_t) n) {
        return fail(c->err, c->err_cap, ES_ERR_FORMAT,
                    "file ends at byte %zu inside %s (truncated)", c->size, what);
    }
    *out = load_le(c->p + c->pos, n);
    c->pos += (size_t) n;
    return ES_OK;
}

// Reads a string (u64 length, bytes) without copying: *s points into the file.
static int read_str(cursor * c, const uint8_t ** s, uint64_t * len, const char * what) {
    *s = NULL;
    int rc = read_uint(c, 8, len, what);
    if (rc) return rc;
    if (*len > left(c)) {
        return fail(c->err, c->err_cap, ES_ERR_FORMAT,
                    "%s: string of %llu bytes at byte %zu runs past the end of the file (%zu bytes)",
                    what, (unsigned long long) *len, c->pos, c->size);
    }
    *s = c->p + c->pos;
    c->pos += (size_t) *len;
    return ES_OK;
}

// A NUL-terminated copy of n bytes; NULL when out of memory.
static char * copy_str(const uint8_t * s, uint64_t n) {
    char * out = malloc((size_t) n + 1);
    if (!out) return NULL;
    memcpy(out, s, (size_t) n);
    out[n] = '\0';
    return out;
}

/* ========================================================================
 * Name hash (FNV-1a, open addressing)
 * ======================================================================== */

static uint64_t hash_name(const char * s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char) *s) * 1099511628211ull;
    return h;
}

typedef const char * (*name_at_fn)(const es_gguf * g, int64_t i);

static const char * kv_name(const es_gguf * g, int64_t i) { return g->kvs[i].key; }
static const char * tensor_name(const es_gguf * g, int64_t i) { return g->tensors[i].name; }

// Index of `name` in the table, or -1. With insert >= 0, stores it in the
// empty slot and returns -1 if absent, or the earlier index if present.
static int64_t hash_probe(const es_gguf * g, int64_t * slots, size_t cap, name_at_fn name_at,
                          const char * name, int64_t insert) {
    if (!cap) return -1;
    for (size_t h = (size_t) hash_name(name) & (cap - 1);; h = (h + 1) & (cap - 1)) {
        if (slots[h] < 0) {
            if (insert >= 0) slots[h] = insert;
            return -1;
        }
        if (strcmp(name_at(g, slots[h]), name) == 0) return slots[h];
    }
}

// Allocates a table for n entries, all empty.
static int64_t * hash_alloc(int64_t n, size_t * cap) {
    size_t c = 16;
    while (c < (size_t) n * 2) c *= 2;
    int64_t * slots = malloc(c * sizeof(int64_t));
    if (!slots) return NULL;
    memset(slots, 0xff, c * sizeof(int64_t));  // every slot -1
    *cap = c;
    return slots;
}

/* ========================================================================
 * Metadata
 * ======================================================================== */

// Skips (and checks) one array's body of n elements of elem_type, at depth.
static int parse_array_body(cursor * c, int32_t elem_type, uint64_t n, int depth, const char * key);

// Checks a scalar that has rules of its own (bools are 0 or 1).
static int check_scalar(cursor * c, int32_t type, const uint8_t * p, const char * key) {
    char buf[72];
    if (type == ES_GGUF_BOOL && p[0] > 1) {
        return fail(c->err, c->err_cap, ES_ERR_FORMAT, "key %s: bool value %u is neither 0 nor 1",
                    printable(key, buf), p[0]);
    }
    return ES_OK;
}

// Reads an array header (element type, count) and skips its body.
static int parse_array(cursor * c, int depth, const char * key, int32_t * elem_type,
                       uint64_t * n, const uint8_t ** body) {
    char buf[72];
    uint64_t t;
    int rc = read_uint(c, 4, &t, "an array header");
    if (rc) return rc;
    if (t >= GV_COUNT) {
        return fail(c->err, c->err_cap, ES_ERR_FORMAT, "key %s: unknown array element type %llu",
                    printable(key, buf), (unsigned long long) t);
    }
    if (t == ES_GGUF_ARRAY && depth + 1 >= MAX_ARRAY_DEPTH) {
        return fail(c->err, c->err_cap, ES_ERR_FORMAT, "key %s: arrays nested deeper than %d",
                    printable(key, buf), MAX_ARRAY_DEPTH);
    }
    if ((rc = read_uint(c, 8, n, "an array length"))) return rc;
    *elem_type = (int32_t) t;
    *body = c->p + c->pos;
    return parse_array_body(c, *elem_type, *n, depth + 1, key);
}

static int parse_array_body(cursor * c, int32_t elem_type, uint64_t n, int depth, const char * key) {
    char buf[72];
    // The smallest an element can be bounds n before any loop runs.
    size_t min = GV_SIZE[elem_type] ? GV_SIZE[elem_type] : elem_type == ES_GGUF_STRING ? 8 : 12;
    if (n > left(c) / min) {
        return fail(c->err, c->err_cap, ES_ERR_FORMAT,
                    "key %s: array of %llu %s values at byte %zu does not fit in the file (%zu bytes)",
                    printable(key, buf), (unsigned long long) n, GV_NAME[elem_type], c->pos, c->size);
    }
    if (elem_type == ES_GGUF_BOOL) {
        for (uint64_t i = 0; i < n; i++) {
            int rc = check_scalar(c, ES_GGUF_BOOL, c->p + c->pos + i, key);
            if (rc) return rc;
        }
    }
    if (GV_SIZE[elem_type]) {
        c->pos += (size_t) n * min;
        return ES_OK;
    }
    for (uint64_t i = 0; i < n; i++) {
        int rc;
        if (elem_type == ES_GGUF_STRING) {
            const uint8_t * s;
            uint64_t len;
            rc = read_str(c, &s, &len, "an array string");
        } else {
            int32_t sub_type;
            uint64_t sub_n;
            const uint8_t * body;
            rc = parse_array(c, depth, key, &sub_type, &sub_n, &body);
        }
        if (rc) return rc;
    }
    return ES_OK;
}

// Reads one key/value pair into kv (its key already read and stored).
static int parse_value(cursor * c, es_kv * kv) {
    char buf[72];
    uint64_t t;
    int rc = read_uint(c, 4, &t, "a value type");
    if (rc) return rc;
    if (t >= GV_COUNT) {
        return fail(c->err, c->err_cap, ES_ERR_FORMAT, "key %s: unknown value type %llu",
                    printable(kv->key, buf), (unsigned long long) t);
    }
    kv->type = (int32_t) t;
    kv->raw = c->p + c->pos;
    if (t == ES_GGUF_STRING) {
        const uint8_t * s;
        uint64_t len;
        if ((rc = read_str(c, &s, &len, "a string value"))) return rc;
        kv->raw = s;
        kv->arr_n = len;
        if (!(kv->str = copy_str(s, len))) return ES_ERR_NO_MEMORY;
        return ES_OK;
    }
    if (t == ES_GGUF_ARRAY) return parse_array(c, 0, kv->key, &kv->arr_type, &kv->arr_n, &kv->arr_data);

    int n = GV_SIZE[t];
    if (left(c) < (size_t) n) return read_uint(c, n, &kv->num.u, "a value");  // the error
    const uint8_t * p = c->p + c->pos;
    if ((rc = check_scalar(c, kv->type, p, kv->key))) return rc;
    uint64_t u = load_le(p, n);
    c->pos += (size_t) n;
    switch (t) {
        case ES_GGUF_I8:  kv->num.i = (int8_t) u; break;
        case ES_GGUF_I16: kv->num.i = (int16_t) u; break;
        case ES_GGUF_I32: kv->num.i = (int32_t) u; break;
        case ES_GGUF_I64: kv->num.i = (int64_t) u; break;
        case ES_GGUF_F32: { uint32_t b = (uint32_t) u; float f; memcpy(&f, &b, 4); kv->num.f = f; break; }
        case ES_GGUF_F64: memcpy(&kv->num.f, &u, 8); break;
        default:     kv->num.u = u; break;  // unsigned integers and bool
    }
    return ES_OK;
}

// Where a validated array's body (v: an ES_GGUF_ARRAY value) ends.
static const uint8_t * nested_end(const es_gguf_value * v) {
    const uint8_t * p = v->data;
    if (GV_SIZE[v->elem_type]) return p + v->n * GV_SIZE[v->elem_type];
    for (uint64_t i = 0; i < v->n; i++) {
        if (v->elem_type == ES_GGUF_STRING) {
            p += 8 + load_le(p, 8);
        } else {
            const es_gguf_value sub = {ES_GGUF_ARRAY, (int32_t) load_le(p, 4), load_le(p + 4, 8), p + 12};
            p = nested_end(&sub);
        }
    }
    return p;
}

static const es_kv * find_kv(const es_gguf * g, const char * key) {
    if (!g || !key) return NULL;
    int64_t i = hash_probe(g, g->kv_hash, g->kv_hash_cap, kv_name, key, -1);
    return i < 0 ? NULL : &g->kvs[i];
}

static bool is_signed(int32_t t) { return t == ES_GGUF_I8 || t == ES_GGUF_I16 || t == ES_GGUF_I32 || t == ES_GGUF_I64; }
static bool is_unsigned(int32_t t) { return t == ES_GGUF_U8 || t == ES_GGUF_U16 || t == ES_GGUF_U32 || t == ES_GGUF_U64; }

int64_t es_gguf_n_kv(const es_gguf * g) { return g ? g->n_kv : 0; }

const char * es_gguf_key_at(const es_gguf * g, int64_t i) {
    return g && i >= 0 && i < g->n_kv ? g->kvs[i].key : NULL;
}

int64_t es_gguf_find_key(const es_gguf * g, const char * key) {
    const es_kv * kv = find_kv(g, key);
    return kv ? kv - g->kvs : -1;
}

int32_t es_gguf_key_type(const es_gguf * g, int64_t i) {
    return g && i >= 0 && i < g->n_kv ? g->kvs[i].type : -1;
}

bool es_gguf_value_at(const es_gguf * g, int64_t i, es_gguf_value * out) {
    if (!g || !out || i < 0 || i >= g->n_kv) return false;
    const es_kv * kv = &g->kvs[i];
    *out = (es_gguf_value) {kv->type, -1, 1, kv->raw};
    if (kv->type == ES_GGUF_STRING) out->n = kv->arr_n;
    if (kv->type == ES_GGUF_ARRAY) *out = (es_gguf_value) {kv->type, kv->arr_type, kv->arr_n, kv->arr_data};
    return true;
}

int es_gguf_array_elems(const es_gguf_value * arr, es_gguf_value * out, uint64_t cap) {
    if (!arr || arr->type != ES_GGUF_ARRAY || arr->elem_type < 0 || arr->elem_type >= GV_COUNT) {
        return ES_ERR_INVALID_ARG;
    }
    if (cap < arr->n) return ES_ERR_BUFFER_TOO_SMALL;
    if (arr->n && !out) return ES_ERR_INVALID_ARG;
    // The array was bounds-checked when the file was opened: walk it.
    const uint8_t * p = arr->data;
    for (uint64_t i = 0; i < arr->n; i++) {
        es_gguf_value * v = &out[i];
        v->type = arr->elem_type;
        v->elem_type = -1;
        v->n = 1;
        if (GV_SIZE[arr->elem_type]) {
            v->data = p;
            p += GV_SIZE[arr->elem_type];
        } else if (arr->elem_type == ES_GGUF_STRING) {
            v->n = load_le(p, 8);
            v->data = p + 8;
            p += 8 + v->n;
        } else {  // a nested array: element type, count, then its elements
            v->elem_type = (int32_t) load_le(p, 4);
            v->n = load_le(p + 4, 8);
            v->data = p + 12;
            p = nested_end(v);
        }
    }
    return ES_OK;
}

bool es_gguf_get_i64(const es_gguf * g, const char * key, int64_t * out) {
    const es_kv * kv = find_kv(g, key);
    if (!kv) return false;
    if (is_signed(kv->type)) {
        *out = kv->num.i;
        return true;
    }
    if (is_unsigned(kv->type) && kv->num.u <= (uint64_t) INT64_MAX) {
        *out = (int64_t) kv->num.u;
        return true;
    }
    return false;
}

bool es_gguf_get_f32(const es_gguf * g, const char * key, float * out) {
    const es_kv * kv = find_kv(g, key);
    if (!kv || (kv->type != ES_GGUF_F32 && kv->type != ES_GGUF_F64)) return false;
    *out = (float) kv->num.f;
    return true;
}

bool es_gguf_get_bool(const es_gguf * g, const char * key, bool * out) {
    const es_kv * kv = find_kv(g, key);
    if (!kv || kv->type != ES_GGUF_BOOL) return false;
    *out = kv->num.u != 0;
    return true;
}

const char * es_gguf_get_str(const es_gguf * g, const char * key) {
    const es_kv * kv = find_kv(g, key);
    return kv && kv->type == ES_GGUF_STRING ? kv->str : NULL;
}

bool es_gguf_get_arr(const es_gguf * g, const char * key, int32_t * elem_type, uint64_t * n,
                     const void ** data) {
    const es_kv * kv = find_kv(g, key);
    if (!kv || kv->type != ES_GGUF_ARRAY || !GV_SIZE[kv->arr_type]) return false;
    *elem_type = kv->arr_type;
    *n = kv->arr_n;
    *data = kv->arr_data;
    return true;
}

bool es_gguf_get_str_arr(const es_gguf * g, const char * key, uint64_t * n, const void ** data) {
    const es_kv * kv = find_kv(g, key);
    if (!kv || kv->type != ES_GGUF_ARRAY || kv->arr_type != ES_GGUF_STRING) return false;
    *n = kv->arr_n;
    *data = kv->arr_data;
    return true;
}

/* ========================================================================
 * Tensors
 * ======================================================================== */

int32_t es_gguf_version(const es_gguf * g) { return g ? g->version : 0; }
int64_t es_gguf_alignment(const es_gguf * g) { return g ? (int64_t) g->alignment : 0; }
int64_t es_gguf_data_offset(const es_gguf * g) { return g ? (int64_t) g->data_start : 0; }

int64_t es_gguf_tensor_offset(const es_gguf * g, const es_tensor * t) {
    return (int64_t) ((const uint8_t *) t->data - g->data);
}

const uint8_t * es__gguf_bytes(const es_gguf * g, size_t * size) {
    *size = g->size;
    return g->data;
}

void es_gguf_release(const es_gguf * g, const void * p, size_t n) {
#if defined(MADV_DONTNEED)
    if (!g || !g->map) return;  // a file read into memory holds its only copy
    const long page = sysconf(_SC_PAGESIZE);
    if (page <= 0) return;
    const uintptr_t b = (uintptr_t) p, e = b + n, mb = (uintptr_t) g->map, me = mb + g->size;
    const uintptr_t pb = (b + (uintptr_t) page - 1) / (uintptr_t) page * (uintptr_t) page;
    const uintptr_t pe = e / (uintptr_t) page * (uintptr_t) page;
    if (b < mb || e > me || pb >= pe) return;
    madvise((void *) pb, pe - pb, MADV_DONTNEED);
#else
    (void) g, (void) p, (void) n;
#endif
}

int64_t es_gguf_n_tensors(const es_gguf * g) { return g ? g->n_tensors : 0; }

const es_tensor * es_gguf_tensor_at(const es_gguf * g, int64_t i) {
    return g && i >= 0 && i < g->n_tensors ? &g->tensors[i] : NULL;
}

const es_tensor * es_gguf_find_tensor(const es_gguf * g, const char * name) {
    if (!g || !name) return NULL;
    int64_t i = hash_probe(g, g->tensor_hash, g->tensor_hash_cap, tensor_name, name, -1);
    return i < 0 ? NULL : &g->tensors[i];
}

// Reads one tensor info into t; its offset (relative to the data section)
// goes to *offset, checked against the data section later.
static int parse_tensor_info(cursor * c, es_tensor * t, uint64_t alignment, uint64_t * offset) {
    char buf[72];
    const uint8_t * s;
    uint64_t len, v;
    int rc = read_str(c, &s, &len, "a tensor name");
    if (rc) return rc;
    if (len == 0 || len > MAX_NAME_BYTES || memchr(s, 0, (size_t) len)) {
        return fail(c->err, c->err_cap, ES_ERR_FORMAT,
                    "tensor name at byte %zu: %llu bytes, not 1..%d bytes without NUL",
                    c->pos - (size_t) len, (unsigned long long) len, MAX_NAME_BYTES);
    }
    char * name = copy_str(s, len);
    if (!name) return ES_ERR_NO_MEMORY;
    t->name = name;  // owned by the es_gguf from here, freed with it
    const char * pn = printable(name, buf);

    if ((rc = read_uint(c, 4, &v, "a tensor's dimension count"))) return rc;
    if (v < 1 || v > 4) {
        return fail(c->err, c->err_cap, ES_ERR_FORMAT, "tensor %s: %llu dimensions, not 1..4", pn,
                    (unsigned long long) v);
    }
    t->n_dims = (int32_t) v;
    int64_t n_elems = 1;
    for (int d = 0; d < 4; d++) {
        t->ne[d] = 1;
        if (d >= t->n_dims) continue;
        if ((rc = read_uint(c, 8, &v, "a tensor's shape"))) return rc;
        if (v == 0 || v > (uint64_t) INT64_MAX || (int64_t) v > INT64_MAX / n_elems) {
            return fail(c->err, c->err_cap, ES_ERR_FORMAT,
                        "tensor %s: dimension %d of %llu elements is empty or overflows", pn, d,
                        (unsigned long long) v);
        }
        t->ne[d] = (int64_t) v;
        n_elems *= (int64_t) v;
    }

    if ((rc = read_uint(c, 4, &v, "a tensor's type"))) return rc;
    const es_type_traits * ti = v <= INT32_MAX ? es_type_info((int32_t) v) : NULL;
    if (!ti) {
        return fail(c->err, c->err_cap, ES_ERR_UNSUPPORTED, "tensor %s: unknown type id %llu", pn,
                    (unsigned long long) v);
    }
    t->type = (int32_t) v;
    if (t->ne[0] % ti->block) {
        return fail(c->err, c->err_cap, ES_ERR_FORMAT,
                    "tensor %s: rows of %lld elements are not whole %s blocks of %d", pn,
                    (long long) t->ne[0], ti->name, ti->block);
    }
    // n_elems <= INT64_MAX, so the block count times <= 292 bytes needs a check.
    uint64_t n_blocks = (uint64_t) (n_elems / ti->block);
    if (n_blocks > SIZE_MAX / (uint64_t) ti->block_bytes) {
        return fail(c->err, c->err_cap, ES_ERR_FORMAT, "tensor %s: size overflows", pn);
    }
    t->nbytes = (size_t) (n_blocks * (uint64_t) ti->block_bytes);

    if ((rc = read_uint(c, 8, offset, "a tensor's offset"))) return rc;
    if (*offset % alignment) {
        return fail(c->err, c->err_cap, ES_ERR_FORMAT,
                    "tensor %s: offset %llu is not a multiple of the alignment %llu", pn,
                    (unsigned long long) *offset, (unsigned long long) alignment);
    }
    return ES_OK;
}

// Sorting tensors by offset, for the overlap check.
typedef struct span {
    uint64_t begin, end;  // [begin, end) inside the data section
    int64_t  index;
} span;

static int cmp_span(const void * a, const void * b) {
    const span * x = a;
    const span * y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->index < y->index ? -1 : x->index > y->index;  // file order, for the message
}

// Places every tensor inside the data section [data_start, size) and checks
// that none runs past the end of the file and no two overlap.
static int place_tensors(es_gguf * g, const uint64_t * offsets, uint64_t data_start, char * err,
                         size_t err_cap) {
    char buf[72], buf2[72];
    if (g->n_tensors == 0) return ES_OK;
    if (data_start > g->size) {
        return fail(err, err_cap, ES_ERR_FORMAT,
                    "tensor data would start at byte %llu, past the end of the file (%zu bytes): truncated",
                    (unsigned long long) data_start, g->size);
    }
    uint64_t room = g->size - data_start;
    span * spans = malloc((size_t) g->n_tensors * sizeof(span));
    if (!spans) return ES_ERR_NO_MEMORY;
    for (int64_t i = 0; i < g->n_tensors; i++) {
        es_tensor * t = &g->tensors[i];
        if (offsets[i] > room || t->nbytes > room - offsets[i]) {
            uint64_t start = data_start + (offsets[i] < room ? offsets[i] : room);
            free(spans);
            if (offsets[i] > room || t->nbytes > UINT64_MAX - start) {
                return fail(err, err_cap, ES_ERR_FORMAT,
                            "tensor %s: data at offset %llu (%zu bytes) lies past the end of the file (%zu bytes)",
                            printable(t->name, buf), (unsigned long long) offsets[i], t->nbytes, g->size);
            }
            return fail(err, err_cap, ES_ERR_FORMAT,
                        "tensor %s: data ends at byte %llu, past the end of the file (%zu bytes): truncated",
                        printable(t->name, buf), (unsigned long long) (start + t->nbytes), g->size);
        }
        t->data = g->data + data_start + offsets[i];
        spans[i] = (span) {offsets[i], offsets[i] + t->nbytes, i};
    }
    qsort(spans, (size_t) g->n_tensors, sizeof(span), cmp_span);
    for (int64_t i = 1; i < g->n_tensors; i++) {
        if (spans[i].begin < spans[i - 1].end) {
            const es_tensor * a = &g->tensors[spans[i - 1].index];
            const es_tensor * b = &g->tensors[spans[i].index];
            uint64_t a0 = spans[i - 1].begin, a1 = spans[i - 1].end;
            uint64_t b0 = spans[i].begin, b1 = spans[i].end;
            free(spans);
            return fail(err, err_cap, ES_ERR_FORMAT,
                        "tensors %s [%llu, %llu) and %s [%llu, %llu) overlap in the data section",
                        printable(a->name, buf), (unsigned long long) a0, (unsigned long long) a1,
                        printable(b->name, buf2), (unsigned long long) b0, (unsigned long long) b1);
        }
    }
    free(spans);
    return ES_OK;
}

/* ========================================================================
 * Parsing the file
 * ======================================================================== */

// The value of general.alignment, or the default when absent.
static int read_alignment(const es_gguf * g, uint64_t * out, char * err, size_t err_cap) {
    const es_kv * kv = find_kv(g, "general.alignment");
    *out = DEFAULT_ALIGNMENT;
    if (!kv) return ES_OK;
    // The format says u32; llama.cpp asserts (aborts) on any other type.
    if (kv->type != ES_GGUF_U32) {
        return fail(err, err_cap, ES_ERR_FORMAT, "general.alignment is a %s, not a u32",
                    GV_NAME[kv->type]);
    }
    const uint64_t a = kv->num.u;
    if (a == 0 || (a & (a - 1))) {
        return fail(err, err_cap, ES_ERR_FORMAT, "general.alignment %llu is not a power of two",
                    (unsigned long long) a);
    }
    // Every tensor may start that far apart: with an alignment of 2^31 a
    // 0.5B model's file is hundreds of GB of holes, which llama.cpp's loader
    // walked for minutes (a hang to the user). Writers use 32 to 4096.
    if (a > MAX_ALIGNMENT) {
        return fail(err, err_cap, ES_ERR_FORMAT, "general.alignment %llu is above %d",
                    (unsigned long long) a, MAX_ALIGNMENT);
    }
    *out = a;
    return ES_OK;
}

static int parse(es_gguf * g, char * err, size_t err_cap) {
    cursor c = {g->data, g->size, 0, err, err_cap};
    char buf[72];
    uint64_t magic, version, n_tensors, n_kv;
    int rc;
    if ((rc = read_uint(&c, 4, &magic, "the magic"))) return rc;
    if (magic != 0x46554747u) {  // "GGUF"
        return fail(err, err_cap, ES_ERR_FORMAT, "not a GGUF file (bad magic)");
    }
    if ((rc = read_uint(&c, 4, &version, "the version"))) return rc;
    // Version 2 differs from 3 only in that 3 may be big-endian, which is refused here.
    if (version != 2 && version != 3) {
        return fail(err, err_cap, ES_ERR_FORMAT, "unsupported GGUF version %llu (supported: 2, 3)%s",
                    (unsigned long long) version,
                    version == 0x02000000u || version == 0x03000000u ? ": a big-endian file" : "");
    }
    g->version = (int32_t) version;
    if ((rc = read_uint(&c, 8, &n_tensors, "the tensor count"))) return rc;
    if ((rc = read_uint(&c, 8, &n_kv, "the key count"))) return rc;
    if (n_kv > left(&c) / MIN_KV_BYTES) {
        return fail(err, err_cap, ES_ERR_FORMAT,
                    "%llu keys cannot fit in the file (%zu bytes)", (unsigned long long) n_kv, c.size);
    }

    // Metadata.
    g->kvs = calloc(n_kv ? (size_t) n_kv : 1, sizeof(es_kv));
    if (!g->kvs || !(g->kv_hash = hash_alloc((int64_t) n_kv, &g->kv_hash_cap))) return ES_ERR_NO_MEMORY;
    for (uint64_t i = 0; i < n_kv; i++) {
        es_kv * kv = &g->kvs[i];
        const uint8_t * s;
        uint64_t len;
        if ((rc = read_str(&c, &s, &len, "a key"))) return rc;
        if (len == 0 || memchr(s, 0, (size_t) len)) {
            return fail(err, err_cap, ES_ERR_FORMAT, "key %llu at byte %zu is empty or holds a NUL byte",
                        (unsigned long long) i, c.pos - (size_t) len);
        }
        if (!(kv->key = copy_str(s, len))) return ES_ERR_NO_MEMORY;
        g->n_kv = (int64_t) i + 1;  // kv->key is freed with g from here
        if (hash_probe(g, g->kv_hash, g->kv_hash_cap, kv_name, kv->key, (int64_t) i) >= 0) {
            return fail(err, err_cap, ES_ERR_FORMAT, "key %s appears twice", printable(kv->key, buf));
        }
        if ((rc = parse_value(&c, kv))) return rc;
    }
    uint64_t alignment;
    if ((rc = read_alignment(g, &alignment, err, err_cap))) return rc;
    g->alignment = alignment;

    // Tensor infos.
    if (n_tensors > left(&c) / MIN_TENSOR_BYTES) {
        return fail(err, err_cap, ES_ERR_FORMAT, "%llu tensors cannot fit in the file (%zu bytes)",
                    (unsigned long long) n_tensors, c.size);
    }
    g->tensors = calloc(n_tensors ? (size_t) n_tensors : 1, sizeof(es_tensor));
    uint64_t * offsets = malloc((n_tensors ? (size_t) n_tensors : 1) * sizeof(uint64_t));
    g->tensor_hash = hash_alloc((int64_t) n_tensors, &g->tensor_hash_cap);
    if (!g->tensors || !offsets || !g->tensor_hash) {
        free(offsets);
        return ES_ERR_NO_MEMORY;
    }
    for (uint64_t i = 0; i < n_tensors; i++) {
        es_tensor * t = &g->tensors[i];
        g->n_tensors = (int64_t) i + 1;  // t->name, once set, is freed with g
        if ((rc = parse_tensor_info(&c, t, alignment, &offsets[i]))) break;
        if (hash_probe(g, g->tensor_hash, g->tensor_hash_cap, tensor_name, t->name, (int64_t) i) >= 0) {
            rc = fail(err, err_cap, ES_ERR_FORMAT, "tensor %s appears twice", printable(t->name, buf));
            break;
        }
    }
    // The data section starts at the next multiple of the alignment.
    uint64_t data_start = c.pos + (alignment - c.pos % alignment) % alignment;
    g->data_start = data_start;
    if (!rc) rc = place_tensors(g, offsets, data_start, err, err_cap);
    free(offsets);
    return rc;
}

/* ========================================================================
 * Opening and closing
 * ======================================================================== */

void es_gguf_close(es_gguf * g) {
    if (!g) return;
    for (int64_t i = 0; i < g->n_kv; i++) {
        free(g->kvs[i].key);
        free(g->kvs[i].str);
    }
    for (int64_t i = 0; i < g->n_tensors; i++) free((char *) g->tensors[i].name);
    free(g->kvs);
    free(g->tensors);
    free(g->kv_hash);
    free(g->tensor_hash);
    if (g->map) munmap(g->map, g->size);
    free(g->heap);
    free(g);
}

// Parses g (data and size set); frees it and sets *out = NULL on failure.
static int finish_open(es_gguf * g, es_gguf ** out, char * err, size_t err_cap) {
    int rc = parse(g, err, err_cap);
    if (rc == ES_ERR_NO_MEMORY) fail(err, err_cap, rc, "out of memory reading the GGUF file");
    if (rc) {
        es_gguf_close(g);
        return rc;
    }
    *out = g;
    return ES_OK;
}

int es_gguf_open_buffer(const void * data, size_t size, es_gguf ** out, char * err, size_t err_cap) {
    if (out) *out = NULL;
    if (!out || (!data && size)) return fail(err, err_cap, ES_ERR_INVALID_ARG, "invalid argument");
    es_gguf * g = calloc(1, sizeof(es_gguf));
    if (!g) return fail(err, err_cap, ES_ERR_NO_MEMORY, "out of memory");
    g->data = data;
    g->size = size;
    return finish_open(g, out, err, err_cap);
}

// Reads a whole file into page-aligned memory, for where mmap fails.
static void * read_all(int fd, size_t size) {
    void * buf = NULL;
    if (posix_memalign(&buf, 4096, size ? size : 1)) return NULL;
    for (size_t done = 0; done < size;) {
        ssize_t n = pread(fd, (char *) buf + done, size - done, (off_t) done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            free(buf);
            return NULL;
        }
        done += (size_t) n;
    }
    return buf;
}

int es_gguf_open(const char * path, es_gguf ** out, char * err, size_t err_cap) {
    if (out) *out = NULL;
    if (!path || !out) return fail(err, err_cap, ES_ERR_INVALID_ARG, "invalid argument");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return fail(err, err_cap, ES_ERR_IO, "cannot open: %s", strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return fail(err, err_cap, ES_ERR_IO, "not a regular file");
    }
    if ((uint64_t) st.st_size > SIZE_MAX) {
        close(fd);
        return fail(err, err_cap, ES_ERR_IO, "too large to map");
    }
    es_gguf * g = calloc(1, sizeof(es_gguf));
    if (!g) {
        close(fd);
        return fail(err, err_cap, ES_ERR_NO_MEMORY, "out of memory");
    }
    g->size = (size_t) st.st_size;
    if (g->size) {
        void * map = mmap(NULL, g->size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map != MAP_FAILED) {
            g->map = map;
            g->data = map;
        } else if ((g->heap = read_all(fd, g->size))) {
            g->data = g->heap;
        } else {
            int e = errno;
            close(fd);
            free(g);
            return fail(err, err_cap, ES_ERR_IO, "cannot read: %s", strerror(e));
        }
    }
    close(fd);  // the mapping stays valid without the descriptor
    return finish_open(g, out, err, err_cap);
}
