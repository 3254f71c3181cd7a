/*
 * test_gguf.c — the GGUF reader (csrc/gguf.c) against images built in memory.
 *
 *   - a valid image with every value type (scalars, arrays of numbers, of
 *     strings, of arrays) and tensors of several types: getters with their
 *     conversions, tensor lookup, data placement; the same through a file;
 *   - every rejection path: bad magic and version, counts and strings that do
 *     not fit, bad dimensions and shapes, unknown types, misaligned, outlying
 *     and overlapping tensors, duplicates, bad alignment;
 *   - the image truncated at every byte and mutated at every byte: each fails
 *     cleanly or opens (run under ASan/UBSan, any stray read is caught);
 *   - the real models in $EDGESPEC_TEST_MODELS_DIR (set by tests/test_c_core.py).
 */
#define _POSIX_C_SOURCE 200809L

#include "native/native_internal.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "gguf_bytes.h"
#include "test_models.h"

/* ------------------------------------------------------------------------
 * A GGUF writer
 * ------------------------------------------------------------------------ */

static void put_u32(buf * b, uint64_t v) { put_le(b, v, 4); }
static void put_u64(buf * b, uint64_t v) { put_le(b, v, 8); }

// One tensor info as written (any field may be wrong on purpose).
typedef struct tspec {
    const char * name;
    uint32_t     n_dims;
    uint64_t     ne[5];
    uint32_t     type;
    uint64_t     offset;
} tspec;

typedef struct spec {
    uint32_t      version;         // 3
    const tspec * tensors;
    int           n_tensors;
    int           alignment_type;  // -1: no general.alignment key; else its value type
    uint64_t      alignment;       // its value
    size_t        data_bytes;      // bytes written after the padded header
    const char *  extra_key;       // one more key written after the others (NULL: none)
    const uint8_t * extra_value;   // its raw type + value bytes
    size_t        extra_len;
} spec;

// Positions in the image, for the tests that patch it.
typedef struct layout {
    size_t n_tensors_at, n_kv_at;  // the two counts
    size_t first_key_at;           // the first key's length
    size_t data_start;
} layout;

// The standard image's tensors: F32 (4, 2), Q4_0 (64), F16 (3, 1, 1, 2), Q4_K (256, 2).
static const tspec TENSORS[] = {
    {"a", 2, {4, 2}, ES_TYPE_F32, 0},
    {"blk.0.b", 1, {64}, ES_TYPE_Q4_0, 32},
    {"c", 4, {3, 1, 1, 2}, ES_TYPE_F16, 96},
    {"d", 2, {256, 2}, ES_TYPE_Q4_K, 128},
};
#define DATA_BYTES (128 + 2 * 144)

static spec standard(void) {
    spec s = {3, TENSORS, N_ELEMS(TENSORS), 4, 32, DATA_BYTES, NULL, NULL, 0};
    return s;
}

// Writes the image for s: the keys of every value type, then the tensors.
static buf build(const spec * s, layout * lay) {
    buf b = {0};
    layout l;
    put(&b, "GGUF", 4);
    put_u32(&b, s->version);
    l.n_tensors_at = b.n;
    put_u64(&b, (uint64_t) s->n_tensors);
    l.n_kv_at = b.n;
    put_u64(&b, 15 + (s->alignment_type >= 0) + (s->extra_key != NULL));

    l.first_key_at = b.n;
    put_str(&b, "general.architecture"); put_u32(&b, 8); put_str(&b, "llama");
    put_str(&b, "k.u8");  put_u32(&b, 0);  put_le(&b, 200, 1);
    put_str(&b, "k.i8");  put_u32(&b, 1);  put_le(&b, (uint8_t) -5, 1);
    put_str(&b, "k.u16"); put_u32(&b, 2);  put_le(&b, 60000, 2);
    put_str(&b, "k.i16"); put_u32(&b, 3);  put_le(&b, (uint16_t) -300, 2);
    put_str(&b, "k.u32"); put_u32(&b, 4);  put_le(&b, 4000000000u, 4);
    put_str(&b, "k.i32"); put_u32(&b, 5);  put_le(&b, (uint32_t) -70000, 4);
    float f = 0.5f;
    uint32_t fb;
    memcpy(&fb, &f, 4);
    put_str(&b, "k.f32"); put_u32(&b, 6);  put_le(&b, fb, 4);
    put_str(&b, "k.bool"); put_u32(&b, 7); put_le(&b, 1, 1);
    put_str(&b, "k.u64"); put_u32(&b, 10); put_u64(&b, UINT64_MAX);
    put_str(&b, "k.i64"); put_u32(&b, 11); put_u64(&b, (uint64_t) INT64_MIN);
    double d = -1.25;
    uint64_t db;
    memcpy(&db, &d, 8);
    put_str(&b, "k.f64"); put_u32(&b, 12); put_u64(&b, db);
    put_str(&b, "k.arr_i32"); put_u32(&b, 9); put_u32(&b, 5); put_u64(&b, 3);
    for (uint32_t v = 1; v <= 3; v++) put_u32(&b, (uint32_t) -(int32_t) v);
    put_str(&b, "k.arr_str"); put_u32(&b, 9); put_u32(&b, 8); put_u64(&b, 2);
    put_str(&b, "tok"); put_str(&b, "");
    // An array of two arrays of u8: [[1, 2], [3]].
    put_str(&b, "k.arr_arr"); put_u32(&b, 9); put_u32(&b, 9); put_u64(&b, 2);
    put_u32(&b, 0); put_u64(&b, 2); put_le(&b, 1, 1); put_le(&b, 2, 1);
    put_u32(&b, 0); put_u64(&b, 1); put_le(&b, 3, 1);
    if (s->alignment_type >= 0) {
        static const int SIZE[13] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
        put_str(&b, "general.alignment");
        put_u32(&b, (uint32_t) s->alignment_type);
        if (s->alignment_type == 8) put_str(&b, "32");
        else put_le(&b, s->alignment, SIZE[s->alignment_type]);
    }
    if (s->extra_key) {
        put_str(&b, s->extra_key);
        put(&b, s->extra_value, s->extra_len);
    }

    for (int i = 0; i < s->n_tensors; i++) {
        const tspec * t = &s->tensors[i];
        put_str(&b, t->name);
        put_u32(&b, t->n_dims);
        for (uint32_t dim = 0; dim < t->n_dims; dim++) put_u64(&b, t->ne[dim]);
        put_u32(&b, t->type);
        put_u64(&b, t->offset);
    }
    uint64_t align = s->alignment_type == 4 && s->alignment && !(s->alignment & (s->alignment - 1))
                         ? s->alignment : 32;
    while (b.n % align) put_le(&b, 0, 1);
    l.data_start = b.n;
    for (size_t i = 0; i < s->data_bytes; i++) put_le(&b, (uint8_t) (i * 7 + 1), 1);
    if (lay) *lay = l;
    return b;
}

// Opens image bytes from an exact-size heap copy (ASan sees any overread).
static int open_copy(const uint8_t * p, size_t n, es_gguf ** g, char * err, size_t cap) {
    uint8_t * copy = malloc(n ? n : 1);
    memcpy(copy, p, n);
    int rc = es_gguf_open_buffer(copy, n, g, err, cap);
    CHECK((rc == ES_OK) == (*g != NULL));
    if (*g) {
        // The caller's buffer must outlive g: tests that keep g use the original.
        es_gguf_close(*g);
        *g = NULL;
    }
    free(copy);
    return rc;
}

// Opens s's image, expecting failure with status want and `needle` in the message.
static void expect_fail(const spec * s, int want, const char * needle) {
    buf b = build(s, NULL);
    es_gguf * g = (es_gguf *) 1;
    char err[256] = "";
    int rc = open_copy(b.p, b.n, &g, err, sizeof err);
    if (rc != want || !strstr(err, needle) || strchr(err, '\n')) {
        fprintf(stderr, "  expected %d with \"%s\", got %d: %s\n", want, needle, rc, err);
    }
    CHECK(rc == want);
    CHECK(strstr(err, needle) != NULL);
    CHECK(strchr(err, '\n') == NULL);
    free(b.p);
}

// Patches n little-endian bytes at pos of the standard image, expecting failure.
static void expect_patch_fail(size_t pos, uint64_t v, int n, const char * needle) {
    spec s = standard();
    buf b = build(&s, NULL);
    for (int i = 0; i < n; i++) b.p[pos + (size_t) i] = (uint8_t) (v >> (8 * i));
    es_gguf * g = NULL;
    char err[256] = "";
    int rc = open_copy(b.p, b.n, &g, err, sizeof err);
    if (rc != ES_ERR_FORMAT || !strstr(err, needle)) {
        fprintf(stderr, "  patch at %zu: expected \"%s\", got %d: %s\n", pos, needle, rc, err);
    }
    CHECK(rc == ES_ERR_FORMAT);
    CHECK(strstr(err, needle) != NULL);
    free(b.p);
}

/* ------------------------------------------------------------------------
 * A valid image
 * ------------------------------------------------------------------------ */

// Every key through es_gguf_value_at / es_gguf_array_elems, as the Python reader reads them.
static void check_values(const es_gguf * g) {
    CHECK(es_gguf_version(g) == 3 && es_gguf_alignment(g) == 32);
    CHECK(es_gguf_find_key(g, "k.u16") == 3 && es_gguf_find_key(g, "absent") == -1);
    CHECK(es_gguf_key_type(g, 3) == ES_GGUF_U16 && es_gguf_key_type(g, 99) == -1);
    es_gguf_value v, el[3], sub[2];
    CHECK(!es_gguf_value_at(g, 16, &v) && !es_gguf_value_at(g, -1, &v));
    CHECK(es_gguf_value_at(g, es_gguf_find_key(g, "k.u16"), &v));
    CHECK(v.type == ES_GGUF_U16 && v.n == 1 && v.elem_type == -1);
    CHECK(((const uint8_t *) v.data)[0] == (60000 & 0xff) && ((const uint8_t *) v.data)[1] == 60000 >> 8);
    CHECK(es_gguf_value_at(g, 0, &v));  // general.architecture
    CHECK(v.type == ES_GGUF_STRING && v.n == 5 && memcmp(v.data, "llama", 5) == 0);
    CHECK(es_gguf_array_elems(&v, el, 3) == ES_ERR_INVALID_ARG);  // not an array

    CHECK(es_gguf_value_at(g, es_gguf_find_key(g, "k.arr_str"), &v));
    CHECK(v.type == ES_GGUF_ARRAY && v.elem_type == ES_GGUF_STRING && v.n == 2);
    CHECK(es_gguf_array_elems(&v, el, 1) == ES_ERR_BUFFER_TOO_SMALL);
    CHECK(es_gguf_array_elems(&v, el, 3) == ES_OK);
    CHECK(el[0].type == ES_GGUF_STRING && el[0].n == 3 && memcmp(el[0].data, "tok", 3) == 0);
    CHECK(el[1].type == ES_GGUF_STRING && el[1].n == 0);

    CHECK(es_gguf_value_at(g, es_gguf_find_key(g, "k.arr_i32"), &v));
    CHECK(es_gguf_array_elems(&v, el, 3) == ES_OK);
    int32_t x;
    memcpy(&x, el[2].data, 4);
    CHECK(el[2].type == ES_GGUF_I32 && x == -3);

    // [[1, 2], [3]], and the key after it is where the walk says the array ends.
    CHECK(es_gguf_value_at(g, es_gguf_find_key(g, "k.arr_arr"), &v));
    CHECK(v.elem_type == ES_GGUF_ARRAY && v.n == 2);
    CHECK(es_gguf_array_elems(&v, el, 2) == ES_OK);
    CHECK(el[0].type == ES_GGUF_ARRAY && el[0].elem_type == ES_GGUF_U8 && el[0].n == 2);
    CHECK(el[1].elem_type == ES_GGUF_U8 && el[1].n == 1 && ((const uint8_t *) el[1].data)[0] == 3);
    CHECK(es_gguf_array_elems(&el[0], sub, 2) == ES_OK);
    CHECK(((const uint8_t *) sub[0].data)[0] == 1 && ((const uint8_t *) sub[1].data)[0] == 2);
}

static void check_valid(es_gguf * g, const uint8_t * base, size_t data_start) {
    CHECK(es_gguf_n_tensors(g) == N_ELEMS(TENSORS));
    CHECK(strcmp(es_gguf_get_str(g, "general.architecture"), "llama") == 0);
    CHECK(es_gguf_n_kv(g) == 16);  // 15 keys of every type, then general.alignment
    CHECK(strcmp(es_gguf_key_at(g, 0), "general.architecture") == 0);
    CHECK(strcmp(es_gguf_key_at(g, 15), "general.alignment") == 0);
    CHECK(es_gguf_key_at(g, 16) == NULL && es_gguf_key_at(g, -1) == NULL);

    int64_t i = 0;
    CHECK(es_gguf_get_i64(g, "k.u8", &i) && i == 200);
    CHECK(es_gguf_get_i64(g, "k.i8", &i) && i == -5);
    CHECK(es_gguf_get_i64(g, "k.u16", &i) && i == 60000);
    CHECK(es_gguf_get_i64(g, "k.i16", &i) && i == -300);
    CHECK(es_gguf_get_i64(g, "k.u32", &i) && i == 4000000000ll);
    CHECK(es_gguf_get_i64(g, "k.i32", &i) && i == -70000);
    CHECK(es_gguf_get_i64(g, "k.i64", &i) && i == INT64_MIN);
    CHECK(es_gguf_get_i64(g, "general.alignment", &i) && i == 32);
    CHECK(!es_gguf_get_i64(g, "k.u64", &i));   // UINT64_MAX does not fit
    CHECK(!es_gguf_get_i64(g, "k.f32", &i));   // floats are not integers
    CHECK(!es_gguf_get_i64(g, "k.bool", &i));
    CHECK(!es_gguf_get_i64(g, "absent", &i));

    float f = 0;
    CHECK(es_gguf_get_f32(g, "k.f32", &f) && f == 0.5f);
    CHECK(es_gguf_get_f32(g, "k.f64", &f) && f == -1.25f);
    CHECK(!es_gguf_get_f32(g, "k.i32", &f));
    bool b = false;
    CHECK(es_gguf_get_bool(g, "k.bool", &b) && b);
    CHECK(!es_gguf_get_bool(g, "k.u8", &b));
    CHECK(es_gguf_get_str(g, "k.u8") == NULL);
    CHECK(es_gguf_get_str(g, "absent") == NULL);

    int32_t et = -1;
    uint64_t n = 0;
    const void * data = NULL;
    CHECK(es_gguf_get_arr(g, "k.arr_i32", &et, &n, &data));
    CHECK(et == 5 && n == 3);
    int32_t v[3];
    memcpy(v, data, sizeof v);  // inside the mapping, not necessarily aligned
    CHECK(v[0] == -1 && v[1] == -2 && v[2] == -3);
    CHECK(!es_gguf_get_arr(g, "k.arr_str", &et, &n, &data));  // not numeric
    CHECK(!es_gguf_get_arr(g, "k.arr_arr", &et, &n, &data));
    CHECK(!es_gguf_get_arr(g, "k.u8", &et, &n, &data));
    check_values(g);

    static const size_t NBYTES[] = {32, 36, 12, 288};
    for (int t = 0; t < N_ELEMS(TENSORS); t++) {
        const es_tensor * ten = es_gguf_tensor_at(g, t);
        CHECK(ten != NULL && ten == es_gguf_find_tensor(g, TENSORS[t].name));
        if (!ten) continue;
        CHECK(strcmp(ten->name, TENSORS[t].name) == 0);
        CHECK(ten->type == (int32_t) TENSORS[t].type);
        CHECK(ten->n_dims == (int32_t) TENSORS[t].n_dims);
        for (int d = 0; d < 4; d++) {
            CHECK(ten->ne[d] == (d < ten->n_dims ? (int64_t) TENSORS[t].ne[d] : 1));
        }
        CHECK(ten->nbytes == NBYTES[t]);
        CHECK((const uint8_t *) ten->data == base + data_start + TENSORS[t].offset);
        CHECK(((const uint8_t *) ten->data - base) % 32 == 0);
    }
    CHECK(es_gguf_tensor_at(g, -1) == NULL);
    CHECK(es_gguf_tensor_at(g, N_ELEMS(TENSORS)) == NULL);
    CHECK(es_gguf_find_tensor(g, "blk.0") == NULL);
    CHECK(es_gguf_find_tensor(g, "") == NULL);
}

static void test_valid(void) {
    spec s = standard();
    layout lay;
    buf b = build(&s, &lay);
    es_gguf * g = NULL;
    char err[256] = "";
    CHECK(es_gguf_open_buffer(b.p, b.n, &g, err, sizeof err) == ES_OK);
    if (g) check_valid(g, b.p, lay.data_start);
    es_gguf_close(g);

    // The same bytes through a file: mmap'd.
    char path[] = "/tmp/test_gguf_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    if (fd >= 0) {
        CHECK(write(fd, b.p, b.n) == (ssize_t) b.n);
        close(fd);
        g = NULL;
        CHECK(es_gguf_open(path, &g, err, sizeof err) == ES_OK);
        if (g) check_valid(g, es_gguf_tensor_at(g, 0)->data, 0);
        es_gguf_close(g);
        unlink(path);
    }

    // Files that are missing or not files: I/O errors saying why (the caller names the path).
    g = (es_gguf *) 1;
    CHECK(es_gguf_open("/nonexistent/x.gguf", &g, err, sizeof err) == ES_ERR_IO);
    CHECK(g == NULL && strstr(err, "cannot open: ") && !strstr(err, "/nonexistent"));
    CHECK(es_gguf_open("/tmp", &g, err, sizeof err) == ES_ERR_IO);
    CHECK(strcmp(err, "not a regular file") == 0);
    CHECK(es_gguf_open(NULL, &g, err, sizeof err) == ES_ERR_INVALID_ARG);
    CHECK(es_gguf_open_buffer(NULL, 10, &g, err, sizeof err) == ES_ERR_INVALID_ARG);

    // No tensors and no keys but the standard ones; an alignment of 64; no error buffer.
    s.n_tensors = 0;
    s.data_bytes = 0;
    buf e = build(&s, NULL);
    CHECK(es_gguf_open_buffer(e.p, e.n, &g, NULL, 0) == ES_OK);
    CHECK(es_gguf_n_tensors(g) == 0 && es_gguf_tensor_at(g, 0) == NULL);
    es_gguf_close(g);
    free(e.p);
    static const tspec T64[] = {{"x", 1, {8}, ES_TYPE_F32, 0}, {"y", 1, {8}, ES_TYPE_F32, 64}};
    spec s64 = {2, T64, 2, 4, 64, 96, NULL, NULL, 0};  // version 2: the same layout
    buf b64 = build(&s64, &lay);
    CHECK(lay.data_start % 64 == 0);
    CHECK(es_gguf_open_buffer(b64.p, b64.n, &g, err, sizeof err) == ES_OK);
    CHECK(g && (const uint8_t *) es_gguf_find_tensor(g, "y")->data == b64.p + lay.data_start + 64);
    CHECK(es_gguf_version(g) == 2 && es_gguf_alignment(g) == 64);
    CHECK(es_gguf_data_offset(g) == (int64_t) lay.data_start);
    es_gguf_close(g);
    free(b64.p);
    es_gguf_close(NULL);
    free(b.p);
}

/* ------------------------------------------------------------------------
 * Rejections
 * ------------------------------------------------------------------------ */

static void test_header(void) {
    spec s = standard();
    layout lay;
    buf b = build(&s, &lay);
    free(b.p);
    expect_patch_fail(0, 'X', 1, "bad magic");
    s.version = 1;
    expect_fail(&s, ES_ERR_FORMAT, "unsupported GGUF version 1 (supported: 2, 3)");
    s.version = 4;
    expect_fail(&s, ES_ERR_FORMAT, "unsupported GGUF version 4");
    s.version = 0x03000000u;
    expect_fail(&s, ES_ERR_FORMAT, "big-endian");
    s.version = 0x02000000u;
    expect_fail(&s, ES_ERR_FORMAT, "big-endian");
    // Counts that cannot fit in the file.
    expect_patch_fail(lay.n_kv_at, 1ull << 40, 8, "keys cannot fit");
    expect_patch_fail(lay.n_kv_at, UINT64_MAX, 8, "keys cannot fit");
    expect_patch_fail(lay.n_tensors_at, 1ull << 40, 8, "tensors cannot fit");
    // One key too many: the next bytes (a tensor name) are read as a key, and so on.
    expect_patch_fail(lay.n_kv_at, 16 + 1, 8, "");
    // The first key's length past the end, and exactly one byte past it.
    expect_patch_fail(lay.first_key_at, UINT64_MAX, 8, "runs past the end of the file");
    expect_patch_fail(lay.first_key_at, b.n - lay.first_key_at - 8 + 1, 8, "runs past the end");
    expect_patch_fail(lay.first_key_at, 0, 8, "empty");
}

static void test_values(void) {
    spec s = standard();
    // Raw type + value bytes of one extra key.
    static const uint8_t BAD_TYPE[] = {13, 0, 0, 0, 0};
    static const uint8_t BAD_BOOL[] = {7, 0, 0, 0, 2};
    static const uint8_t BIG_ARRAY[] = {9, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0};
    static const uint8_t BAD_ELEM[] = {9, 0, 0, 0, 14, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    static const uint8_t BOOL_ARRAY[] = {9, 0, 0, 0, 7, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 1, 3};
    static const uint8_t STR_ARRAY[] = {9, 0, 0, 0, 8, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0,
                                        0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0};
    // [[[[]]]]: four levels of arrays.
    static const uint8_t DEEP[] = {9, 0, 0, 0, 9, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0,
                                   9, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0,
                                   9, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0,
                                   9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    struct { const uint8_t * v; size_t n; int rc; const char * needle; } cases[] = {
        {BAD_TYPE, sizeof BAD_TYPE, ES_ERR_FORMAT, "key k.extra: unknown value type 13"},
        {BAD_BOOL, sizeof BAD_BOOL, ES_ERR_FORMAT, "bool value 2"},
        {BIG_ARRAY, sizeof BIG_ARRAY, ES_ERR_FORMAT, "does not fit in the file"},
        {BAD_ELEM, sizeof BAD_ELEM, ES_ERR_FORMAT, "unknown array element type 14"},
        {BOOL_ARRAY, sizeof BOOL_ARRAY, ES_ERR_FORMAT, "bool value 3"},
        {STR_ARRAY, sizeof STR_ARRAY, ES_ERR_FORMAT, "runs past the end"},
        {DEEP, sizeof DEEP, ES_ERR_FORMAT, "nested deeper"},
    };
    for (int i = 0; i < N_ELEMS(cases); i++) {
        s.extra_key = "k.extra";
        s.extra_value = cases[i].v;
        s.extra_len = cases[i].n;
        expect_fail(&s, cases[i].rc, cases[i].needle);
    }
    // One level less is fine.
    static const uint8_t THREE[] = {9, 0, 0, 0, 9, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0,
                                    9, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0,
                                    9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    s.extra_value = THREE;
    s.extra_len = sizeof THREE;
    buf b = build(&s, NULL);
    es_gguf * g = NULL;
    CHECK(es_gguf_open_buffer(b.p, b.n, &g, NULL, 0) == ES_OK);
    es_gguf_close(g);
    free(b.p);

    // A key given twice.
    static const uint8_t U8[] = {0, 0, 0, 0, 1};
    s.extra_key = "k.u8";
    s.extra_value = U8;
    s.extra_len = sizeof U8;
    expect_fail(&s, ES_ERR_FORMAT, "key k.u8 appears twice");

    // general.alignment: not a power of two, zero, too large, not an integer.
    s = standard();
    s.alignment = 48;
    expect_fail(&s, ES_ERR_FORMAT, "general.alignment 48 is not a power of two");
    s.alignment = 0;
    expect_fail(&s, ES_ERR_FORMAT, "general.alignment 0");
    s.alignment_type = 10;
    s.alignment = 32;
    expect_fail(&s, ES_ERR_FORMAT, "general.alignment is a u64, not a u32");
    s.alignment_type = 8;
    expect_fail(&s, ES_ERR_FORMAT, "general.alignment is a string");
}

static void test_tensors(void) {
    struct { tspec t; int rc; const char * needle; } cases[] = {
        {{"x", 0, {4}, ES_TYPE_F32, 0}, ES_ERR_FORMAT, "tensor x: 0 dimensions"},
        {{"x", 5, {4, 1, 1, 1, 1}, ES_TYPE_F32, 0}, ES_ERR_FORMAT, "tensor x: 5 dimensions"},
        {{"x", 2, {4, 0}, ES_TYPE_F32, 0}, ES_ERR_FORMAT, "dimension 1 of 0 elements"},
        {{"x", 2, {1ull << 32, 1ull << 32}, ES_TYPE_F32, 0}, ES_ERR_FORMAT, "overflows"},
        {{"x", 1, {UINT64_MAX}, ES_TYPE_F32, 0}, ES_ERR_FORMAT, "overflows"},
        {{"x", 1, {1ull << 62}, ES_TYPE_F32, 0}, ES_ERR_FORMAT, "size overflows"},
        {{"x", 1, {4}, 4, 0}, ES_ERR_UNSUPPORTED, "tensor x: unknown type id 4"},
        {{"x", 1, {4}, 200, 0}, ES_ERR_UNSUPPORTED, "unknown type id 200"},
        {{"x", 1, {4}, UINT32_MAX, 0}, ES_ERR_UNSUPPORTED, "unknown type id"},
        {{"x", 1, {16}, ES_TYPE_Q4_0, 0}, ES_ERR_FORMAT, "not whole Q4_0 blocks of 32"},
        {{"x", 1, {4}, ES_TYPE_F32, 4}, ES_ERR_FORMAT, "offset 4 is not a multiple of the alignment 32"},
        {{"x", 1, {4}, ES_TYPE_F32, 1ull << 20}, ES_ERR_FORMAT, "past the end of the file"},
        {{"x", 1, {1ull << 40}, ES_TYPE_F32, 0}, ES_ERR_FORMAT, "data ends at byte"},
        {{"x", 1, {4}, ES_TYPE_F32, UINT64_MAX - 31}, ES_ERR_FORMAT, "past the end of the file"},
        {{"blk.0.b", 1, {4}, ES_TYPE_F32, 448}, ES_ERR_FORMAT, "tensor blk.0.b appears twice"},
        {{"", 1, {4}, ES_TYPE_F32, 448}, ES_ERR_FORMAT, "not 1..63 bytes"},
        {{"0123456789012345678901234567890123456789012345678901234567890123", 1, {4}, ES_TYPE_F32, 448},
         ES_ERR_FORMAT, "64 bytes"},
        // Overlaps: inside another tensor, and the same offset.
        {{"x", 1, {32}, ES_TYPE_F32, 96}, ES_ERR_FORMAT, "overlap"},
        {{"x", 1, {8}, ES_TYPE_F32, 0}, ES_ERR_FORMAT, "tensors a [0, 32) and x [0, 32) overlap"},
    };
    for (int i = 0; i < N_ELEMS(cases); i++) {
        tspec ts[N_ELEMS(TENSORS) + 1];
        memcpy(ts, TENSORS, sizeof TENSORS);
        ts[N_ELEMS(TENSORS)] = cases[i].t;
        spec s = standard();
        s.tensors = ts;
        s.n_tensors = N_ELEMS(ts);
        s.data_bytes = DATA_BYTES + 32;  // room for one more small tensor at 448
        expect_fail(&s, cases[i].rc, cases[i].needle);
    }
    // The same extra tensor, well placed, opens.
    tspec ts[N_ELEMS(TENSORS) + 1];
    memcpy(ts, TENSORS, sizeof TENSORS);
    ts[N_ELEMS(TENSORS)] = (tspec) {"x", 1, {8}, ES_TYPE_F32, 416};
    spec s = standard();
    s.tensors = ts;
    s.n_tensors = N_ELEMS(ts);
    s.data_bytes = DATA_BYTES + 32;
    buf b = build(&s, NULL);
    es_gguf * g = NULL;
    CHECK(es_gguf_open_buffer(b.p, b.n, &g, NULL, 0) == ES_OK);
    CHECK(g && es_gguf_find_tensor(g, "x")->nbytes == 32);
    es_gguf_close(g);
    free(b.p);
}

// A small error buffer gets a truncated, NUL-terminated message.
static void test_err_buffer(void) {
    spec s = standard();
    s.version = 4;
    buf b = build(&s, NULL);
    es_gguf * g = NULL;
    char err[8];
    memset(err, 'x', sizeof err);
    CHECK(es_gguf_open_buffer(b.p, b.n, &g, err, sizeof err) == ES_ERR_FORMAT);
    CHECK(err[sizeof err - 1] == '\0' && strlen(err) == sizeof err - 1);
    free(b.p);
}

/* ------------------------------------------------------------------------
 * Truncation and mutation at every byte
 * ------------------------------------------------------------------------ */

static void test_every_byte(void) {
    spec s = standard();
    buf b = build(&s, NULL);
    es_gguf * g = NULL;
    char err[256];
    // The last tensor ends at the end of the file: every proper prefix is damaged.
    int n_bad = 0;
    for (size_t n = 0; n < b.n; n++) {
        err[0] = '\0';
        int rc = open_copy(b.p, n, &g, err, sizeof err);
        if (rc != ES_ERR_FORMAT || !err[0]) {
            fprintf(stderr, "  truncated to %zu bytes: %d %s\n", n, rc, err);
            n_bad++;
        }
    }
    CHECK(n_bad == 0);
    CHECK(open_copy(b.p, b.n, &g, err, sizeof err) == ES_OK);

    // Every byte set to a few values: opens or fails with a status and a
    // message, never anything else (the sanitizers watch the reads).
    static const uint8_t VALUES[] = {0x00, 0x01, 0x07, 0x20, 0x7f, 0x80, 0xff};
    n_bad = 0;
    for (size_t pos = 0; pos < b.n; pos++) {
        uint8_t keep = b.p[pos];
        for (int v = 0; v < N_ELEMS(VALUES); v++) {
            b.p[pos] = VALUES[v];
            err[0] = '\0';
            int rc = open_copy(b.p, b.n, &g, err, sizeof err);
            if (!(rc == ES_OK || ((rc == ES_ERR_FORMAT || rc == ES_ERR_UNSUPPORTED) && err[0]))) n_bad++;
        }
        b.p[pos] = keep;
    }
    CHECK(n_bad == 0);
    free(b.p);
}

/* ------------------------------------------------------------------------
 * Real models
 * ------------------------------------------------------------------------ */

// Checks one real GGUF: every block has its tensors, shapes agree with the
// hyperparameters, and the tensor data fits the file.
static void check_model(const char * path) {
    es_gguf * g = NULL;
    char err[256] = "";
    int rc = es_gguf_open(path, &g, err, sizeof err);
    if (rc) fprintf(stderr, "  %s: %s\n", path, err);
    CHECK(rc == ES_OK);
    if (!g) return;
    const char * arch = es_gguf_get_str(g, "general.architecture");
    CHECK(arch != NULL);
    char key[128];
    int64_t n_layer = 0, n_embd = 0;
    snprintf(key, sizeof key, "%s.block_count", arch ? arch : "");
    CHECK(es_gguf_get_i64(g, key, &n_layer) && n_layer > 0);
    snprintf(key, sizeof key, "%s.embedding_length", arch ? arch : "");
    CHECK(es_gguf_get_i64(g, key, &n_embd) && n_embd > 0);

    const es_tensor * emb = es_gguf_find_tensor(g, "token_embd.weight");
    CHECK(emb && emb->n_dims == 2 && emb->ne[0] == n_embd);
    int32_t et;
    uint64_t n;
    const void * data;
    CHECK(!es_gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &n, &data));  // strings
    CHECK(es_gguf_get_arr(g, "tokenizer.ggml.token_type", &et, &n, &data));
    CHECK(emb && (int64_t) n == emb->ne[1]);  // one token type per embedding row

    uint64_t total = 0;
    int64_t n_blk = 0;
    for (int64_t l = 0; l < n_layer; l++) {
        snprintf(key, sizeof key, "blk.%lld.attn_norm.weight", (long long) l);
        const es_tensor * t = es_gguf_find_tensor(g, key);
        CHECK(t && t->n_dims == 1 && t->ne[0] == n_embd && t->type == ES_TYPE_F32);
    }
    for (int64_t i = 0; i < es_gguf_n_tensors(g); i++) {
        const es_tensor * t = es_gguf_tensor_at(g, i);
        long long l = -1;
        if (sscanf(t->name, "blk.%lld.", &l) == 1) {
            CHECK(l >= 0 && l < n_layer);
            n_blk++;
        }
        CHECK(es_type_info(t->type) != NULL);
        total += t->nbytes;
    }
    CHECK(n_blk > 0 && n_blk % n_layer == 0);  // the same tensors in every block
    const es_tensor * first = es_gguf_tensor_at(g, 0);
    CHECK(first && (uintptr_t) first->data % 32 == 0);
    printf("  %s: %s, %lld layers, %lld tensors, %.1f MB of weights\n", path, arch,
           (long long) n_layer, (long long) es_gguf_n_tensors(g), total / 1e6);
    es_gguf_close(g);
}


int main(void) {
    test_valid();
    test_header();
    test_values();
    test_tensors();
    test_err_buffer();
    test_every_byte();
    for_each_test_model(check_model);
    return check_report("test_gguf");
}
