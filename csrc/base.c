/*
 * base.c — status text and version, shared by both components.
 */
#include "es_base.h"

const char * es_status_str(int status) {
    switch (status) {
        case ES_OK:                   return "ok";
        case ES_ERR_INVALID_ARG:      return "invalid argument";
        case ES_ERR_NO_MEMORY:        return "out of memory";
        case ES_ERR_BUFFER_TOO_SMALL: return "buffer too small";
        case ES_ERR_EMPTY:            return "no token can be chosen (every logit is -inf or NaN)";
        case ES_ERR_IO:               return "file could not be opened, read or written";
        case ES_ERR_FORMAT:           return "file is not of the expected format or is damaged";
        case ES_ERR_UNSUPPORTED:      return "not supported by this build (architecture or weight type)";
        case ES_ERR_CONTEXT_FULL:     return "the KV cache has no room for the batch";
        default:                      return "unknown status";
    }
}

#ifndef ES_VERSION
#error "ES_VERSION: the build passes edgespec/__init__.py's __version__ (CMakeLists.txt, edgespec/capi/build.py)"
#endif
const char * es_version(void) { return ES_VERSION; }

