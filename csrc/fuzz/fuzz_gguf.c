/*
 * fuzz_gguf.c — libFuzzer target for the GGUF reader (csrc/native/gguf.c) and
 * the validation pass over it (csrc/native/validate.c).
 *
 *   cmake -S . -B build-fuzz -DEDGESPEC_FUZZ=ON -DCMAKE_C_COMPILER=clang
 *   cmake --build build-fuzz --target fuzz_gguf
 *   build-fuzz/fuzz_gguf -max_total_time=60 CORPUS_DIR SEED_DIR
 *
 * Each input is opened with es_gguf_open_buffer. A failure must come with a
 * one-line message; a success must describe only bytes of the input: every
 * tensor lies inside it, is found by its name and is read end to end, and
 * every key is read through every getter, and through es_gguf_value_at and
 * es_gguf_array_elems (arrays element by element, nested ones too); then
 * es_gguf_validate passes it or refuses it with a one-line message. The
 * sanitizers turn any stray read into a crash; a broken promise traps.
 */
#include "native/native_internal.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// Bytes of one element of each numeric GGUF value type (0: string, array).
static const size_t ELEM_SIZE[13] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};

#define REQUIRE(cond) \
    do {                \
        if (!(cond)) __builtin_trap(); \
    } while (0)

static volatile uint8_t sink;  // keeps the reads below from being optimised away

static void touch(const void * p, size_t n) {
    uint8_t acc = 0;
    for (size_t i = 0; i < n; i++) acc ^= ((const uint8_t *) p)[i];
    sink = acc;
}

// v's bytes lie inside the input; arrays' elements, recursively, too.
static void walk_value(const es_gguf_value * v, const uint8_t * data, size_t size, int depth) {
    REQUIRE(depth < 8 && v->type >= 0 && v->type < 13);
    const uint8_t * p = v->data;
    REQUIRE(p >= data && p <= data + size);
    const size_t room = size - (size_t) (p - data);
    if (v->type == ES_GGUF_STRING) {
        REQUIRE(v->n <= room);
        touch(p, (size_t) v->n);
        return;
    }
    if (v->type != ES_GGUF_ARRAY) {
        REQUIRE(v->n == 1 && ELEM_SIZE[v->type] <= room);
        touch(p, ELEM_SIZE[v->type]);
        return;
    }
    REQUIRE(v->elem_type >= 0 && v->elem_type < 13);
    REQUIRE(es_gguf_array_elems(v, NULL, 0) == (v->n ? ES_ERR_BUFFER_TOO_SMALL : ES_OK));
    if (v->n == 0) return;
    REQUIRE(v->n <= room);  // every element takes at least a byte
    es_gguf_value * elems = malloc((size_t) v->n * sizeof *elems);
    if (!elems) return;
    REQUIRE(es_gguf_array_elems(v, elems, v->n) == ES_OK);
    for (uint64_t i = 0; i < v->n; i++) {
        REQUIRE(elems[i].type == v->elem_type);
        walk_value(&elems[i], data, size, depth + 1);
    }
    free(elems);
}

static void walk(const es_gguf * g, const uint8_t * data, size_t size) {
    for (int64_t i = 0; i < es_gguf_n_tensors(g); i++) {
        const es_tensor * t = es_gguf_tensor_at(g, i);
        REQUIRE(t && es_gguf_find_tensor(g, t->name) == t);
        REQUIRE(t->n_dims >= 1 && t->n_dims <= 4);
        const es_type_traits * ti = es_type_info(t->type);
        REQUIRE(ti && t->ne[0] % ti->block == 0);
        const uint8_t * p = t->data;
        REQUIRE(p >= data && t->nbytes > 0 && t->nbytes <= size - (size_t) (p - data));
        touch(p, t->nbytes);
    }
    REQUIRE(es_gguf_tensor_at(g, es_gguf_n_tensors(g)) == NULL);

    for (int64_t i = 0; i < es_gguf_n_kv(g); i++) {
        const char * key = es_gguf_key_at(g, i);
        REQUIRE(key != NULL);
        es_gguf_value v;
        REQUIRE(es_gguf_value_at(g, i, &v) && v.type == es_gguf_key_type(g, i));
        REQUIRE(es_gguf_find_key(g, key) == i);
        walk_value(&v, data, size, 0);
        int64_t iv;
        float fv;
        bool bv;
        int32_t type;
        uint64_t n;
        const void * arr;
        int kinds = es_gguf_get_i64(g, key, &iv) + es_gguf_get_f32(g, key, &fv) +
                    es_gguf_get_bool(g, key, &bv) + (es_gguf_get_str(g, key) != NULL);
        REQUIRE(kinds <= 1);
        if (es_gguf_get_str(g, key)) touch(es_gguf_get_str(g, key), strlen(es_gguf_get_str(g, key)));
        if (es_gguf_get_arr(g, key, &type, &n, &arr)) {
            REQUIRE(type >= 0 && type < 13 && ELEM_SIZE[type]);
            const uint8_t * p = arr;
            REQUIRE(p >= data && n <= (size - (size_t) (p - data)) / ELEM_SIZE[type]);
            touch(p, (size_t) n * ELEM_SIZE[type]);
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    es_gguf * g = NULL;
    char err[256];
    err[0] = '\0';
    int rc = es_gguf_open_buffer(data, size, &g, err, sizeof err);
    if (rc == ES_OK) {
        REQUIRE(g != NULL);
        walk(g, data, size);
        rc = es_gguf_validate(g, err, sizeof err);
        REQUIRE(rc == ES_OK ? err[0] == '\0' : rc == ES_ERR_FORMAT && err[0] != '\0' &&
                                                 strchr(err, '\n') == NULL);
        es_gguf_close(g);
    } else {
        REQUIRE(g == NULL);
        REQUIRE(rc == ES_ERR_FORMAT || rc == ES_ERR_UNSUPPORTED);
        REQUIRE(err[0] != '\0' && strchr(err, '\n') == NULL);
    }
    return 0;
}
