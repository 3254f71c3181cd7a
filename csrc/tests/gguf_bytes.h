/*
 * gguf_bytes.h — a growing byte buffer and the little-endian writes the GGUF
 * tests build their images with (test_gguf.c, test_validate.c).
 */
#ifndef ES_TESTS_GGUF_BYTES_H
#define ES_TESTS_GGUF_BYTES_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct buf {
    uint8_t * p;
    size_t    n, cap;
} buf;

static inline void put(buf * b, const void * src, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        if (!b->p) abort();
    }
    if (n) memcpy(b->p + b->n, src, n);
    b->n += n;
}

// The low n bytes of v, little-endian.
static inline void put_le(buf * b, uint64_t v, int n) {
    uint8_t bytes[8];
    for (int i = 0; i < n; i++) bytes[i] = (uint8_t) (v >> (8 * i));
    put(b, bytes, (size_t) n);
}

// A GGUF string: u64 length, then the bytes.
static inline void put_str(buf * b, const char * s) {
    put_le(b, strlen(s), 8);
    put(b, s, strlen(s));
}

#endif  // ES_TESTS_GGUF_BYTES_H
