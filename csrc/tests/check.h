/*
 * check.h — the C tests' tiny harness: CHECK records a failure and goes on,
 * check_report() turns the count into the exit status.
 */
#ifndef EDGESPEC_TESTS_CHECK_H
#define EDGESPEC_TESTS_CHECK_H

#include <math.h>
#include <stdio.h>

static int n_failed = 0;

#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            n_failed++;                                                              \
        }                                                                            \
    } while (0)

#define CHECK_NEAR(a, b, tol) CHECK(fabs((double) (a) - (double) (b)) <= (tol))

#define N_ELEMS(a) ((int32_t) (sizeof(a) / sizeof((a)[0])))

// Prints the verdict of test program `name`; returns its exit status.
static int check_report(const char * name) {
    if (n_failed) {
        fprintf(stderr, "%s: %d check(s) failed\n", name, n_failed);
        return 1;
    }
    printf("%s: all checks passed\n", name);
    return 0;
}

#endif  // EDGESPEC_TESTS_CHECK_H
