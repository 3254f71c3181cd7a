/*
 * es_common.h — small helpers both components' sources share; not part of
 * the ABI (the Python build reads the public headers only).
 */
#ifndef ES_COMMON_H
#define ES_COMMON_H

#include <stddef.h>
#include <stdint.h>

#define ES_FNV_OFFSET 0xcbf29ce484222325ULL  // FNV-1a's offset basis: where every hash starts
#define ES_FNV_PRIME  0x100000001b3ULL

// FNV-1a of n bytes, continuing from h (ES_FNV_OFFSET to start): file
// checksums and cache keys, where byte order must not matter to the reader.
static inline uint64_t es__fnv1a(uint64_t h, const void * data, size_t n) {
    const uint8_t * p = data;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * ES_FNV_PRIME;
    return h;
}

#endif  // ES_COMMON_H
