/*
 * test_models.h — runs a check on every .gguf in $EDGESPEC_TEST_MODELS_DIR
 * (tests/test_c_core.py links the built-in and tiny models there), and
 * loads one. Include
 * after check.h, in a file that defines _POSIX_C_SOURCE (opendir).
 */
#ifndef ES_TESTS_TEST_MODELS_H
#define ES_TESTS_TEST_MODELS_H

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "native/es_native.h"

// Calls check(path) for each model; CHECKs that there was at least one when
// the variable is set (the wrapper sets it only where models are).
static void for_each_test_model(void (*check)(const char * path)) {
    const char * dir = getenv("EDGESPEC_TEST_MODELS_DIR");
    if (!dir || !*dir) {
        printf("  EDGESPEC_TEST_MODELS_DIR not set: no real models checked\n");
        return;
    }
    DIR * d = opendir(dir);
    CHECK(d != NULL);
    if (!d) return;
    int n_models = 0;
    for (struct dirent * e; (e = readdir(d));) {
        const size_t len = strlen(e->d_name);
        if (len < 5 || strcmp(e->d_name + len - 5, ".gguf") != 0) continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        printf("  %s\n", e->d_name);
        check(path);
        n_models++;
    }
    closedir(d);
    CHECK(n_models > 0);
}

// The model at path with the default params, or NULL (a failed CHECK, the
// reason on stderr).
static inline es_model * load_test_model(const char * path) {
    char err[256];
    es_model * m = NULL;
    const int rc = es_model_load(path, NULL, &m, err, sizeof err);
    if (rc != ES_OK) fprintf(stderr, "%s: %s (%s)\n", path, err, es_status_str(rc));
    CHECK(rc == ES_OK);
    return m;
}

#endif  // ES_TESTS_TEST_MODELS_H
