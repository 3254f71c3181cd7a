/*
 * es_base.h — what the two C components of edgespec share: token ids, status
 * codes and the version.
 *
 * The two components, each with its own public header over this one:
 *   speculative/es_spec.h  the speculative core: sampler, verification, drafters' data
 *   native/es_native.h     the inference engine: GGUF reader, kernels, forward pass
 *
 * Neither prints, exits or aborts, nor reads the environment: every fallible
 * function returns an es_status (0 on success, negative on failure) that
 * es_status_str() turns into text, and every switch is a params field.
 *
 * Ownership: an object made by es_X_init() belongs to the caller, who frees
 * it with es_X_free() (NULL is accepted and ignored). Pointers passed in are
 * borrowed for the duration of the call unless stated otherwise.
 */
#ifndef ES_BASE_H
#define ES_BASE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef int32_t es_token;  // a token id, as llama.cpp's llama_token

typedef enum es_status {
    ES_OK                  =  0,
    ES_ERR_INVALID_ARG     = -1,  // a NULL pointer, a size <= 0, a value out of range
    ES_ERR_NO_MEMORY       = -2,  // an allocation failed
    ES_ERR_BUFFER_TOO_SMALL = -3, // a caller-provided buffer is too small
    ES_ERR_EMPTY           = -4,  // nothing left to choose from (every logit -inf)
    ES_ERR_IO              = -5,  // a file could not be opened, read or written
    ES_ERR_FORMAT          = -6,  // a file is not of the expected format, or damaged
    ES_ERR_UNSUPPORTED     = -7,  // a valid input this build cannot handle (architecture, weight type)
    ES_ERR_CONTEXT_FULL    = -8,  // the KV cache has no room for the batch
} es_status;

// Text for a status code; a static string, never NULL.
const char * es_status_str(int status);

// The library's version string: edgespec/__init__.py's __version__, which
// every build passes as ES_VERSION (CMakeLists.txt, edgespec/capi/build.py).
const char * es_version(void);

#ifdef __cplusplus
}
#endif

#endif  // ES_BASE_H
