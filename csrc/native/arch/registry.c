/*
 * registry.c — the architectures the native engine reads, by
 * general.architecture: adding one is its file (arch/<name>.c: tensor table,
 * load, layer) and one line here. The loader (model.c) and the validator
 * (validate.c) both find a file's architecture here.
 */
#include <string.h>

#include "native/native_internal.h"

extern const es_arch es__arch_llama;
extern const es_arch es__arch_gemma3;
extern const es_arch es__arch_qwen2;
extern const es_arch es__arch_qwen3moe;

const es_arch * const es__archs[] = {
    &es__arch_llama,
    &es__arch_gemma3,
    &es__arch_qwen2,
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
