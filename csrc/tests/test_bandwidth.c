/*
 * test_bandwidth.c — es_measure_bandwidth: a positive figure for one and
 * several threads and a buffer size that is no multiple of their slices;
 * NULL params mean the defaults; a NULL output is refused.
 */
#include "native/es_native.h"

#include "check.h"

int main(void) {
    es_bandwidth_params p = es_bandwidth_default_params();
    CHECK(p.n_bytes > 0 && p.n_threads == 0 && p.n_passes > 0);
    p.n_bytes = (4 << 20) + 12345;  // rounded up to whole slices
    p.n_passes = 2;
    for (int32_t nth = 1; nth <= 3; nth++) {
        p.n_threads = nth;
        double bw = 0.0;
        CHECK(es_measure_bandwidth(&p, &bw) == ES_OK);
        CHECK(bw > 1e7);  // 10 MB/s: any machine, however busy
    }
    CHECK(es_measure_bandwidth(&p, NULL) == ES_ERR_INVALID_ARG);
    double bw = 0.0;
    CHECK(es_measure_bandwidth(NULL, &bw) == ES_OK && bw > 1e7);  // the defaults: 512 MiB
    return check_report("test_bandwidth");
}
