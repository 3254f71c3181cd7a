/*
 * registry.c — the architectures the native engine reads, by
 * general.architecture: adding one is its file (arch/<name>.c: tensor table,
 * traits, load; the layer is es__decoder_layer's unless it computes what no
 * trait says) and one line here. The loader (model.c) and the validator
 * (validate.c) both find a file's architecture here, and es_gguf_arch_traits
 * resolves its traits for a file as the loader does.
 */
#include <stdlib.h>
#include <string.h>

#include "native/native_internal.h"

extern const es_arch es__arch_llama;
extern const es_arch es__arch_gemma3;
extern const es_arch es__arch_qwen2;
extern const es_arch es__arch_qwen3;
extern const es_arch es__arch_qwen3moe;

const es_arch * const es__archs[] = {
    &es__arch_llama,
    &es__arch_gemma3,
    &es__arch_qwen2,
    &es__arch_qwen3,
    &es__arch_qwen3moe,
    NULL,
};

const es_arch * es__arch(const char * name) {
    for (int32_t i = 0; name && es__archs[i]; i++) {
        if (strcmp(es__archs[i]->name, name) == 0) return es__archs[i];
    }
    return NULL;
}

const char * es_arch_name(int32_t i) {
    const int32_t n = (int32_t) (sizeof es__archs / sizeof es__archs[0]) - 1;
    return i >= 0 && i < n ? es__archs[i]->name : NULL;
}

bool es_arch_tensor(const char * arch, int32_t i, es_tensor_spec * out) {
    const es_arch * a = es__arch(arch);
    if (!a || !out || i < 0 || i >= a->n_tensors) return false;
    *out = a->tensors[i].spec;
    return true;
}

bool es_arch_get_traits(const char * arch, es_arch_traits * out) {
    const es_arch * a = es__arch(arch);
    if (!a || !out) return false;
    *out = a->traits;
    return true;
}

int es_gguf_arch_traits(const es_gguf * g, es_model_traits * out, es_layer_traits * layers, int32_t cap,
                        char * err, size_t err_cap) {
    if (err && err_cap) err[0] = '\0';
    if (!g || !out || cap < 0 || (cap > 0 && !layers)) return ES_ERR_INVALID_ARG;
    const char * name = es_gguf_get_str(g, "general.architecture");
    // The loader's own reading, on a model of its keys alone (g is only read).
    es_model m = {.gguf = (es_gguf *) g, .arch = es__arch(name)};
    if (!m.arch) {
        es__set_err(err, err_cap, "architecture %.64s is not one the native engine reads", name ? name : "(none)");
        return ES_ERR_UNSUPPORTED;
    }
    const int rc = es__load_decoder_hparams(&m, err, err_cap);
    if (rc == ES_OK) {
        *out = m.traits;
        for (int32_t il = 0; il < m.n_layer && il < cap; il++) layers[il] = m.layers[il].traits;
    }
    free(m.layers);
    return rc;
}
