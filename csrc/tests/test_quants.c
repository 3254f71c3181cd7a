/*
 * test_quants.c — weight types, activation quantization, es_matvec and the
 * thread pool.
 *
 *  - dequantization of hand-built blocks (every scale, min and bit chosen, so
 *    the expected values follow from ggml's format definitions exactly);
 *  - activation quantization: round half to even, half rounding of d, Q8_1's
 *    block sums, Q8_K's sign convention and group sums;
 *  - es_matvec on random rows of every weight type against a double-precision
 *    dot of the dequantized weight and activation rows (relative 1e-5 of the
 *    sum of |terms|; Q4_1 / Q5_1 also allow for Q8_1's sum s stored as half);
 *  - every kernel set this CPU runs against the scalar one (es_kernels_select):
 *    bit-identical for the quantized types (one per-token arithmetic,
 *    kernels.h), within the same 1e-5 relative bound for the float types
 *    (their sums group differently per set); the selection's refusals;
 *  - within one kernel set, bit-identical rows for any split of the rows range;
 *  - es_axpy_q8_0 against a double-precision sum, every set bit for bit the scalar one;
 *  - weight quantization (Q2_K, Q3_K): error bounds, a grid reproduced, refusals;
 *  - the thread pool: every thread runs once per call, nth as asked, many
 *    calls, repeated init/free.
 */
#define _POSIX_C_SOURCE 200809L

#include "native/native_internal.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* ---- helpers ------------------------------------------------------------- */

// binary16 bits -> double, from the definition (independent of quants.c).
static double half_value(uint16_t h) {
    const int e = (h >> 10) & 31, m = h & 1023;
    const double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return h & 0x8000 ? -v : v;
}

static void put_half(uint8_t * p, uint16_t h) { p[0] = (uint8_t) h, p[1] = (uint8_t) (h >> 8); }

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static uint32_t next_u32(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t) (rng >> 16);
}
static float next_float(void) { return (float) (next_u32() % 2000001) / 1000000.f - 1.f; }

// Checks es_dequantize_row(type) of the n-element row src against want exactly.
static void check_dequant(int32_t type, const void * src, const float * want, int n) {
    float got[256];
    CHECK(es_dequantize_row(type, src, got, n) == ES_OK);
    int bad = 0;
    for (int i = 0; i < n; i++) bad += got[i] != want[i];
    if (bad) fprintf(stderr, "%s: %d of %d values differ\n", es_type_name(type), bad, n);
    CHECK(bad == 0);
}

/* ---- type table ---------------------------------------------------------- */

static void test_type_table(void) {
    CHECK(es_type_block(ES_TYPE_F32) == 1 && es_type_block(ES_TYPE_Q4_1) == 32);
    CHECK(es_type_block(ES_TYPE_Q6_K) == 256);
    CHECK(es_type_block(ES_TYPE_Q2_K) == 256 && es_type_block(ES_TYPE_Q3_K) == 256);
    CHECK(es_type_block(ES_TYPE_Q8_K + 1) == 0);                                    // not implemented
    CHECK(es_type_block(-1) == 0 && es_type_block(1000) == 0);
    CHECK(es_type_row_bytes(ES_TYPE_Q4_1, 576) == 18 * 20);
    CHECK(es_type_row_bytes(ES_TYPE_Q6_K, 2048) == 8 * 210);
    CHECK(es_type_row_bytes(ES_TYPE_F16, 7) == 14);
    CHECK(es_type_row_bytes(ES_TYPE_Q4_0, 33) == 0);      // not whole blocks
    CHECK(es_type_row_bytes(ES_TYPE_Q4_K, 640) == 0);
    CHECK(es_type_row_bytes(ES_TYPE_Q2_K, 512) == 2 * 84 && es_type_row_bytes(ES_TYPE_Q3_K, 256) == 110);
    CHECK(es_type_row_bytes(ES_TYPE_Q3_K, 576) == 0);
    CHECK(es_act_type(ES_TYPE_F32) == ES_TYPE_F32 && es_act_type(ES_TYPE_F16) == ES_TYPE_F16);
    CHECK(es_act_type(ES_TYPE_BF16) == ES_TYPE_BF16 && es_act_type(ES_TYPE_Q5_0) == ES_TYPE_Q8_0);
    CHECK(es_act_type(ES_TYPE_Q4_1) == ES_TYPE_Q8_1 && es_act_type(ES_TYPE_Q5_K) == ES_TYPE_Q8_K);
    CHECK(es_act_type(ES_TYPE_Q8_K) == -1 && es_act_type(ES_TYPE_Q3_K) == ES_TYPE_Q8_K);
    CHECK(es_act_type(ES_TYPE_Q2_K) == ES_TYPE_Q8_K && es_act_type(ES_TYPE_Q8_K + 1) == -1);
    CHECK(strcmp(es_type_name(ES_TYPE_Q5_0), "Q5_0") == 0);
    CHECK(strcmp(es_type_name(99), "unknown") == 0);
    float f[32];
    const uint8_t zeros[34] = {0};
    CHECK(es_dequantize_row(ES_TYPE_Q8_K + 1, zeros, f, 256) == ES_ERR_UNSUPPORTED);  // not implemented
    CHECK(es_dequantize_row(ES_TYPE_Q8_0, zeros, f, 16) == ES_ERR_INVALID_ARG);   // not a whole block
    CHECK(es_dequantize_row(ES_TYPE_Q8_0, zeros, f, 0) == ES_ERR_INVALID_ARG);
    const char * k = es_kernels_name();
    CHECK(strcmp(k, "avx512") == 0 || strcmp(k, "avx2") == 0 || strcmp(k, "neon") == 0 ||
          strcmp(k, "scalar") == 0);
}

/* ---- half conversion ------------------------------------------------------ */

// Every half converts exactly; every half's value and the midpoints between
// neighbours (ties to the even one) convert back as IEEE says.
static void test_half_conversion(void) {
    int bad_to = 0, bad_back = 0, bad_tie = 0;
    for (uint32_t h = 0; h < 0x10000; h++) {
        const double v = half_value((uint16_t) h);
        const float f = es_half_to_f32((uint16_t) h);
        if (isnan(v)) {
            bad_to += !isnan(f);
            bad_back += (es_f32_to_half(f) & 0x7E00) != 0x7E00;  // still a nan
            continue;
        }
        bad_to += (double) f != v || !signbit(f) != !signbit(v);
        bad_back += es_f32_to_half(f) != h;
        if ((h & 0x7FFF) < 0x7BFF) {  // finite with a finite neighbour above
            const double mid = (v + half_value((uint16_t) (h + 1))) / 2;  // exact in float
            const uint16_t even = (h & 1) ? (uint16_t) (h + 1) : (uint16_t) h;
            bad_tie += es_f32_to_half((float) mid) != even;
        }
    }
    CHECK(bad_to == 0 && bad_back == 0 && bad_tie == 0);
    CHECK(es_f32_to_half(65520.f) == 0x7C00 && es_f32_to_half(-1e6f) == 0xFC00);  // overflow: inf
    CHECK(es_f32_to_half(1e-9f) == 0x0000);                                       // underflow: 0
}

/* ---- dequantization of hand-built blocks --------------------------------- */

static void test_dequant_float_types(void) {
    const uint16_t h[8] = {0x3C00, 0xC000, 0x0001, 0x7BFF, 0x8000, 0x3555, 0x0400, 0x03FF};
    float want[8];
    for (int i = 0; i < 8; i++) want[i] = (float) half_value(h[i]);
    check_dequant(ES_TYPE_F16, h, want, 8);

    const uint16_t b[4] = {0x3F80, 0xC0A0, 0x0000, 0x4049};
    const float wb[4] = {1.0f, -5.0f, 0.0f, 3.140625f};
    check_dequant(ES_TYPE_BF16, b, wb, 4);

    const float f[3] = {1.5f, -0.0f, 1e-30f};
    check_dequant(ES_TYPE_F32, f, f, 3);
}

static void test_dequant_q4_q5_q8(void) {
    uint8_t blk[36];
    float want[32];

    // Q4_0: d = 0.5; element j < 16 is the low nibble of qs[j], j + 16 the high.
    put_half(blk, 0x3800);
    for (int j = 0; j < 16; j++) blk[2 + j] = (uint8_t) (j | ((15 - j) << 4));
    for (int j = 0; j < 16; j++) want[j] = (j - 8) * 0.5f, want[j + 16] = (15 - j - 8) * 0.5f;
    check_dequant(ES_TYPE_Q4_0, blk, want, 32);

    // Q4_1: d = 0.25, m = -1.
    put_half(blk, 0x3400), put_half(blk + 2, 0xBC00);
    for (int j = 0; j < 16; j++) blk[4 + j] = (uint8_t) (((3 * j) & 15) | (j << 4));
    for (int j = 0; j < 16; j++) want[j] = ((3 * j) & 15) * 0.25f - 1, want[j + 16] = j * 0.25f - 1;
    check_dequant(ES_TYPE_Q4_1, blk, want, 32);

    // Q5_0: d = 1; bit j of the little-endian qh is element j's fifth bit.
    const uint32_t qh = 0xA5C3F00Fu;
    put_half(blk, 0x3C00);
    for (int i = 0; i < 4; i++) blk[2 + i] = (uint8_t) (qh >> (8 * i));
    for (int j = 0; j < 16; j++) blk[6 + j] = (uint8_t) (j | ((15 - j) << 4));
    for (int j = 0; j < 16; j++) {
        want[j]      = (float) ((j | (int) ((qh >> j) & 1) << 4) - 16);
        want[j + 16] = (float) (((15 - j) | (int) ((qh >> (j + 16)) & 1) << 4) - 16);
    }
    check_dequant(ES_TYPE_Q5_0, blk, want, 32);

    // Q5_1: d = 2, m = 0.5, same bits.
    put_half(blk, 0x4000), put_half(blk + 2, 0x3800);
    for (int i = 0; i < 4; i++) blk[4 + i] = (uint8_t) (qh >> (8 * i));
    for (int j = 0; j < 16; j++) blk[8 + j] = (uint8_t) (j | ((15 - j) << 4));
    for (int j = 0; j < 16; j++) {
        want[j]      = (float) (j | (((qh >> j) & 1) << 4)) * 2 + 0.5f;
        want[j + 16] = (float) ((15 - j) | (((qh >> (j + 16)) & 1) << 4)) * 2 + 0.5f;
    }
    check_dequant(ES_TYPE_Q5_1, blk, want, 32);

    // Q8_0: d = 0.125, quants -128..120.
    put_half(blk, 0x3000);
    for (int j = 0; j < 32; j++) blk[2 + j] = (uint8_t) (int8_t) (8 * j - 128), want[j] = (8 * j - 128) * 0.125f;
    check_dequant(ES_TYPE_Q8_0, blk, want, 32);
}

// Packs eight 6-bit (scale, min) pairs the way Q4_K / Q5_K store them.
static void pack_scales_k4(const int sc[8], const int m[8], uint8_t out[12]) {
    for (int j = 0; j < 4; j++) {
        out[j]     = (uint8_t) ((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
        out[j + 4] = (uint8_t) ((m[j] & 63) | ((m[j + 4] >> 4) << 6));
        out[j + 8] = (uint8_t) ((sc[j + 4] & 15) | ((m[j + 4] & 15) << 4));
    }
}

static void test_dequant_k_quants(void) {
    static const int sc[8] = {1, 63, 17, 40, 33, 50, 62, 5};
    static const int mn[8] = {0, 7, 63, 20, 48, 1, 31, 60};
    uint8_t blk[292];
    float want[256];

    // Q4_K: d = 1, dmin = 0.5; sub-block s = e / 32 lives in chunk s / 2,
    // low nibbles for even s, high for odd, of qs[32 (s / 2) + e % 32].
    memset(blk, 0, sizeof(blk));
    put_half(blk, 0x3C00), put_half(blk + 2, 0x3800);
    pack_scales_k4(sc, mn, blk + 4);
    for (int e = 0; e < 256; e++) {
        const int s = e / 32, q = (7 * e + 3) % 16;
        blk[16 + 32 * (s / 2) + e % 32] |= (uint8_t) (q << (4 * (s & 1)));
        want[e] = (float) (sc[s] * q) - 0.5f * (float) mn[s];
    }
    check_dequant(ES_TYPE_Q4_K, blk, want, 256);

    // Q5_K: d = 0.5, dmin = 2; the fifth bit of sub-block s is bit s of qh[e % 32].
    memset(blk, 0, sizeof(blk));
    put_half(blk, 0x3800), put_half(blk + 2, 0x4000);
    pack_scales_k4(sc, mn, blk + 4);
    for (int e = 0; e < 256; e++) {
        const int s = e / 32, q = (11 * e + 5) % 32;
        blk[48 + 32 * (s / 2) + e % 32] |= (uint8_t) ((q & 15) << (4 * (s & 1)));
        blk[16 + e % 32] |= (uint8_t) ((q >> 4) << s);
        want[e] = 0.5f * (float) (sc[s] * q) - 2.0f * (float) mn[s];
    }
    check_dequant(ES_TYPE_Q5_K, blk, want, 256);

    // Q6_K: d = 0.25, int8 scales per 16; in half h, quarter k, lane l:
    // low 4 bits in ql[64 h + l + 32 (k & 1)] (high nibble for k >= 2),
    // high 2 bits at bit 2k of qh[32 h + l]; value q - 32.
    memset(blk, 0, sizeof(blk));
    for (int g = 0; g < 16; g++) blk[192 + g] = (uint8_t) (int8_t) ((g * 37) % 256 - 128);
    put_half(blk + 208, 0x3400);
    for (int e = 0; e < 256; e++) {
        const int h = e / 128, k = (e % 128) / 32, l = e % 32, q = (5 * e + 1) % 64;
        blk[64 * h + l + 32 * (k & 1)] |= (uint8_t) ((q & 15) << (4 * (k >> 1)));
        blk[128 + 32 * h + l] |= (uint8_t) ((q >> 4) << (2 * k));
        want[e] = 0.25f * (float) ((int8_t) blk[192 + e / 16] * (q - 32));
    }
    check_dequant(ES_TYPE_Q6_K, blk, want, 256);

    // Q2_K: d = 0.5, dmin = 0.25; per sub-block of 16 scale (low nibble) and
    // min (high) in scales[e / 16]; 2-bit q at bits 2 ((e % 128) / 32) of
    // qs[32 (e / 128) + e % 32]. Layout: scales[16] qs[64] d dmin.
    memset(blk, 0, sizeof(blk));
    for (int j = 0; j < 16; j++) blk[j] = (uint8_t) (((3 * j + 1) % 16) | (((5 * j) % 16) << 4));
    put_half(blk + 80, 0x3800), put_half(blk + 82, 0x3400);
    for (int e = 0; e < 256; e++) {
        const int q = (7 * e + 2) % 4;
        blk[16 + 32 * (e / 128) + e % 32] |= (uint8_t) (q << (2 * ((e % 128) / 32)));
        want[e] = 0.5f * (float) (blk[e / 16] & 15) * (float) q - 0.25f * (float) (blk[e / 16] >> 4);
    }
    check_dequant(ES_TYPE_Q2_K, blk, want, 256);

    // Q3_K: d = 0.25; 6-bit scales u_j (value u_j - 32): low nibble of
    // scales[j % 8] (high half for j >= 8), top bits at 2 (j / 4) of
    // scales[8 + j % 4]; q = 2 bits as Q2_K's plus bit (e % 256) / 32 of
    // hmask[e % 32] as bit 2, value q - 4. Layout: hmask[32] qs[64] scales[12] d.
    memset(blk, 0, sizeof(blk));
    int u[16];
    for (int j = 0; j < 16; j++) {
        u[j] = (13 * j + 7) % 64;
        blk[96 + j % 8] |= (uint8_t) ((u[j] & 15) << (j < 8 ? 0 : 4));
        blk[96 + 8 + j % 4] |= (uint8_t) ((u[j] >> 4) << (2 * (j / 4)));
    }
    put_half(blk + 108, 0x3400);
    for (int e = 0; e < 256; e++) {
        const int q = (5 * e + 3) % 8;
        blk[32 + 32 * (e / 128) + e % 32] |= (uint8_t) ((q & 3) << (2 * ((e % 128) / 32)));
        blk[e % 32] |= (uint8_t) ((q >> 2) << (e / 32));
        want[e] = 0.25f * (float) (u[e / 16] - 32) * (float) (q - 4);
    }
    check_dequant(ES_TYPE_Q3_K, blk, want, 256);
}

// es_quantize_row: Q2_K and Q3_K of smooth and heavy-tailed rows come back
// within a bound on the relative RMS error (2 and 3 bits: about 1/4 and
// 1/7 of the RMS) and an outlier kept near its value; a
// row already on a Q3_K grid is reproduced; bad arguments are refused.
static void test_quantize_weights(void) {
    enum { N = 1024 };
    static float x[N], back[N];
    static uint8_t q[N];  // >= 110 * N / 256
    const struct { int32_t type; double rms_bound; } cases[] = {{ES_TYPE_Q2_K, 0.40}, {ES_TYPE_Q3_K, 0.20}};
    for (int c = 0; c < 2; c++) {
        for (int dist = 0; dist < 2; dist++) {
            for (int i = 0; i < N; i++) {
                const float u = next_float();
                x[i] = dist ? u * u * u * 4.f : u;  // uniform, or heavy-tailed
            }
            x[17] = 9.f;  // an outlier
            CHECK(es_quantize_row(cases[c].type, x, q, N) == ES_OK);
            CHECK(es_dequantize_row(cases[c].type, q, back, N) == ES_OK);
            double se = 0, sx = 0;
            for (int i = 0; i < N; i++) se += (back[i] - x[i]) * (double) (back[i] - x[i]), sx += (double) x[i] * x[i];
            const double rel = sqrt(se / sx);
            printf("  quantize %s (%s): relative RMS error %.3f\n", es_type_name(cases[c].type),
                   dist ? "heavy-tailed" : "uniform", rel);
            CHECK(rel < cases[c].rms_bound && rel > 0.0);
            CHECK(fabsf(back[17] - 9.f) < 9.f / 4);  // the outlier survives (least squares may trim it)
        }
    }
    // Values on a Q3_K grid (scale 1/8 everywhere, q in -4..3) come back exactly.
    for (int i = 0; i < N; i++) x[i] = (float) ((int) (next_u32() % 8) - 4) / 8.f;
    for (int b = 0; b < N / 16; b++) x[16 * b] = -0.5f;  // every sub-block reaches -4
    CHECK(es_quantize_row(ES_TYPE_Q3_K, x, q, N) == ES_OK);
    CHECK(es_dequantize_row(ES_TYPE_Q3_K, q, back, N) == ES_OK);
    int off = 0;
    for (int i = 0; i < N; i++) off += back[i] != x[i];
    CHECK(off == 0);
    // Zeros stay zeros; refusals.
    memset(x, 0, sizeof x);
    CHECK(es_quantize_row(ES_TYPE_Q2_K, x, q, 256) == ES_OK && es_dequantize_row(ES_TYPE_Q2_K, q, back, 256) == ES_OK);
    int nz = 0;
    for (int i = 0; i < 256; i++) nz += back[i] != 0.0f;
    CHECK(nz == 0);
    CHECK(es_quantize_row(ES_TYPE_Q4_0, x, q, 256) == ES_ERR_UNSUPPORTED);
    CHECK(es_quantize_row(ES_TYPE_Q3_K, x, q, 250) == ES_ERR_INVALID_ARG);
    CHECK(es_quantize_row(ES_TYPE_Q3_K, NULL, q, 256) == ES_ERR_INVALID_ARG);
    x[3] = NAN;
    CHECK(es_quantize_row(ES_TYPE_Q2_K, x, q, 256) == ES_ERR_INVALID_ARG);
}

/* ---- activation quantization --------------------------------------------- */

static void test_quantize_act(void) {
    // Q8_0: amax 127 makes d = 1 and q = x rounded half to even.
    float x[256];
    for (int j = 0; j < 32; j++) x[j] = (float) (j - 16) + 0.5f;  // ties: -15.5 .. 15.5
    x[0] = 127.f;
    uint8_t q[292];
    es_quantize_act(ES_TYPE_Q8_0, x, q, 32);
    CHECK(q[0] == 0x00 && q[1] == 0x3C);  // d = 1.0
    int bad = 0;
    for (int j = 1; j < 32; j++) {
        bad += (int8_t) q[2 + j] != (int) rint(x[j]);  // the default rounding: half to even
    }
    CHECK(bad == 0);
    CHECK((int8_t) q[2] == 127);

    // d is rounded to half, ties to even: 1 + 2^-11 -> 1, 1 + 3 2^-11 -> 1 + 2^-9.
    for (int j = 0; j < 32; j++) x[j] = 0.f;
    x[5] = -127.f * (1.f + 0x1p-11f);
    es_quantize_act(ES_TYPE_Q8_0, x, q, 32);
    CHECK(q[0] == 0x00 && q[1] == 0x3C && (int8_t) q[2 + 5] == -127);
    x[5] = 127.f * (1.f + 3 * 0x1p-11f);
    es_quantize_act(ES_TYPE_Q8_0, x, q, 32);
    CHECK(q[0] == 0x02 && q[1] == 0x3C);

    // An all-zero block: d = 0, quants 0.
    for (int j = 0; j < 32; j++) x[j] = 0.f;
    memset(q, 0x55, sizeof(q));
    es_quantize_act(ES_TYPE_Q8_0, x, q, 32);
    bad = 0;
    for (int j = 0; j < 34; j++) bad += q[j] != 0;
    CHECK(bad == 0);

    // F16 / BF16 weights read activations rounded to their own type, ties to even.
    const float xf[4] = {1.f + 0x1p-11f, 1.f + 3 * 0x1p-11f, 1.f + 0x1p-8f, 1.f + 3 * 0x1p-8f};
    uint16_t hf[4];
    es_quantize_act(ES_TYPE_F16, xf, hf, 4);
    CHECK(hf[0] == 0x3C00 && hf[1] == 0x3C02);
    es_quantize_act(ES_TYPE_BF16, xf + 2, hf, 2);
    CHECK(hf[0] == 0x3F80 && hf[1] == 0x3F82);

    // Q8_1 (Q4_1's companion): s = half(d sum(q)); with d = 1 that is sum(q).
    for (int j = 0; j < 32; j++) x[j] = (float) (j % 5);
    x[31] = -127.f;
    es_quantize_act(ES_TYPE_Q4_1, x, q, 32);
    int sum = 0;
    for (int j = 0; j < 32; j++) sum += (int8_t) q[4 + j];
    CHECK(q[0] == 0x00 && q[1] == 0x3C);
    CHECK(half_value((uint16_t) (q[2] | (q[3] << 8))) == (double) sum);

    // Q8_K (K-quants' companion): the largest magnitude maps to -127, so d
    // has the opposite sign of that element; bsums are sums of 16.
    for (int j = 0; j < 256; j++) x[j] = (float) ((j * 29) % 61 - 30) / 8.f;
    x[77] = 12.7f;
    es_quantize_act(ES_TYPE_Q4_K, x, q, 256);
    float d;
    memcpy(&d, q, 4);
    CHECK(d < 0 && fabsf(d + 0.1f) < 1e-7f);
    CHECK((int8_t) q[4 + 77] == -127);
    bad = 0;
    for (int g = 0; g < 16; g++) {
        int s = 0;
        for (int j = 0; j < 16; j++) s += (int8_t) q[4 + 16 * g + j];
        int16_t bs;
        memcpy(&bs, q + 4 + 256 + 2 * g, 2);
        bad += bs != s;
    }
    CHECK(bad == 0);
    float back[256];
    es_dequantize_row(ES_TYPE_Q8_K, q, back, 256);
    int far = 0;
    for (int j = 0; j < 256; j++) far += fabsf(back[j] - x[j]) > 0.0500001f;  // half a step of 0.1
    CHECK(far == 0);
}

/* ---- es_matvec ----------------------------------------------------------- */

static const int32_t WEIGHT_TYPES[] = {
    ES_TYPE_F32,  ES_TYPE_F16,  ES_TYPE_BF16, ES_TYPE_Q4_0, ES_TYPE_Q4_1, ES_TYPE_Q5_0,
    ES_TYPE_Q5_1, ES_TYPE_Q8_0, ES_TYPE_Q4_K, ES_TYPE_Q5_K, ES_TYPE_Q6_K, ES_TYPE_Q2_K,
    ES_TYPE_Q3_K,
};
#define N_WT N_ELEMS(WEIGHT_TYPES)
#define MV_N    512
#define MV_ROWS 13  // odd on purpose

// Where a block's scale d (then its min, has_min) lies.
static size_t half_at(int32_t type) {
    return type == ES_TYPE_Q6_K ? 208 : type == ES_TYPE_Q2_K ? 80 : type == ES_TYPE_Q3_K ? 108 : 0;
}
static bool has_min(int32_t type) {
    return type == ES_TYPE_Q4_1 || type == ES_TYPE_Q5_1 || type == ES_TYPE_Q4_K || type == ES_TYPE_Q5_K ||
           type == ES_TYPE_Q2_K;
}

// Random rows of a type whose half fields are finite (exponent kept small).
static void random_rows(int32_t type, uint8_t * w, size_t bytes) {
    for (size_t i = 0; i < bytes; i++) w[i] = (uint8_t) next_u32();
    const int32_t blk = es_type_block(type);
    if (type == ES_TYPE_F32) {
        for (size_t i = 0; i < bytes / 4; i++) ((float *) w)[i] = next_float();
    } else if (type == ES_TYPE_F16 || type == ES_TYPE_BF16) {
        for (size_t i = 0; i < bytes / 2; i++) w[2 * i + 1] = (uint8_t) ((w[2 * i + 1] & 0x83) | (type == ES_TYPE_F16 ? 0x34 : 0x3C));
    } else {
        const size_t bb = es_type_row_bytes(type, blk), nb = bytes / bb;
        for (size_t b = 0; b < nb; b++) {
            uint8_t * p = w + b * bb;
            const size_t d = half_at(type);
            p[d + 1] = (uint8_t) ((p[d + 1] & 0x83) | 0x20);
            if (has_min(type)) p[d + 3] = (uint8_t) ((p[d + 3] & 0x83) | 0x20);
        }
    }
}

typedef struct {
    float  y[N_WT][MV_ROWS];    // es_matvec over all rows at once
    double mag[N_WT][MV_ROWS];  // sum of |w_i x_i| of the dequantized rows
} mv_results;

// Runs every weight type on fixed random data (the same in parent and child).
static void run_matvecs(mv_results * out, bool check_ref) {
    rng = 0x9E3779B97F4A7C15ull;
    float x[MV_N], xd[MV_N], wd[MV_N];
    for (int i = 0; i < MV_N; i++) x[i] = 3.f * next_float();
    x[7] = 25.f;  // an outlier, as real activations have
    for (int t = 0; t < N_WT; t++) {
        const int32_t type = WEIGHT_TYPES[t], act = es_act_type(type);
        const size_t rb = es_type_row_bytes(type, MV_N);
        uint8_t * w = malloc(rb * MV_ROWS);
        uint8_t * xq = malloc(es_type_row_bytes(act, MV_N));
        random_rows(type, w, rb * MV_ROWS);
        es_quantize_act(type, x, xq, MV_N);
        es_dequantize_row(act, xq, xd, MV_N);
        es_matvec(type, w, xq, MV_N, 0, MV_ROWS, out->y[t]);

        // Any split of the rows range gives bit-identical rows.
        float part[MV_ROWS];
        for (int k = 0; k <= MV_ROWS; k += 4) {
            es_matvec(type, w, xq, MV_N, 0, k, part);
            es_matvec(type, w, xq, MV_N, k, MV_ROWS, part + k);
            CHECK(memcmp(part, out->y[t], sizeof(part)) == 0);
        }
        float one;
        es_matvec(type, w, xq, MV_N, MV_ROWS - 1, MV_ROWS, &one);
        CHECK(memcmp(&one, &out->y[t][MV_ROWS - 1], sizeof(one)) == 0);

        double sum_ref = 0, sum_mag = 0;
        for (int r = 0; check_ref && r < MV_ROWS; r++) {
            es_dequantize_row(type, w + r * rb, wd, MV_N);
            double ref = 0, mag = 0, s_err = 0;
            for (int i = 0; i < MV_N; i++) ref += (double) wd[i] * xd[i], mag += fabs((double) wd[i] * xd[i]);
            if (act == ES_TYPE_Q8_1)  // m s uses s = half(d sum q): half a half-ulp per block
                for (int b = 0; b < MV_N / 32; b++) {
                    const uint8_t * wb = w + r * rb + b * (rb / (MV_N / 32));
                    const uint8_t * ab = xq + b * 36;
                    s_err += fabs(half_value((uint16_t) (wb[2] | (wb[3] << 8))) *
                                  half_value((uint16_t) (ab[2] | (ab[3] << 8)))) * 0x1p-11;
                }
            const double err = fabs(out->y[t][r] - ref), tol = 1e-5 * mag + s_err + 1e-30;
            if (err > tol)
                fprintf(stderr, "%s row %d: %.9g vs %.9g (tol %.3g)\n", es_type_name(type), r, out->y[t][r], ref, tol);
            CHECK(err <= tol);
            sum_ref += fabs(ref), sum_mag += mag;
            out->mag[t][r] = mag;
        }
        CHECK(!check_ref || sum_ref > 1e-2 * sum_mag);  // the data is not degenerate

        // es_matmat over every batch of 1..17 activation rows (one and more
        // groups of MAX_NT, and every remainder) equals es_matvec on each
        // row, bit for bit, for the full and a partial rows range.
        {
            enum { NT = 17 };
            const size_t ab = es_type_row_bytes(act, MV_N);
            uint8_t * xs = malloc(ab * NT);
            static float want[NT][MV_ROWS], got[NT][MV_ROWS];
            float xt[MV_N];
            for (int t = 0; t < NT; t++) {
                for (int i = 0; i < MV_N; i++) xt[i] = x[i] * (float) (t + 1) - (float) t * next_float();
                es_quantize_act(type, xt, xs + t * ab, MV_N);
                es_matvec(type, w, xs + t * ab, MV_N, 0, MV_ROWS, want[t]);
            }
            for (int nt = 1; nt <= NT; nt++) {
                memset(got, 0, sizeof(got));
                es_matmat(type, w, NULL, xs, ab, nt, MV_N, 0, MV_ROWS, &got[0][0], MV_ROWS);
                if (memcmp(got, want, (size_t) nt * sizeof(want[0])) != 0) fprintf(stderr, "%s nt=%d: batched differs\n", es_type_name(type), nt);
                CHECK(memcmp(got, want, (size_t) nt * sizeof(want[0])) == 0);
                memset(got, 0, sizeof(got));
                es_matmat(type, w, NULL, xs, ab, nt, MV_N, 5, 11, &got[0][0], MV_ROWS);
                int bad = 0;
                for (int t = 0; t < nt; t++) bad += memcmp(got[t], &want[t][5], 6 * sizeof(float)) != 0;
                CHECK(bad == 0);
            }
            free(xs);
        }

        // A range of nothing and an unsupported type write nothing.
        float sentinel = 42.f;
        es_matvec(type, w, xq, MV_N, 3, 3, &sentinel);
        CHECK(sentinel == 42.f);
        es_matvec(ES_TYPE_Q8_K, w, xq, MV_N, 0, 1, &sentinel);
        es_matvec(ES_TYPE_Q8_K + 1, w, xq, MV_N, 0, 1, &sentinel);
        CHECK(sentinel == 42.f);
        free(xq);
        free(w);
    }
}

static void test_matvec(void) {
    mv_results * scalar = calloc(1, sizeof(mv_results));
    mv_results * fast   = calloc(1, sizeof(mv_results));
    CHECK(es_kernels_select("scalar") == ES_OK && strcmp(es_kernels_name(), "scalar") == 0);
    run_matvecs(scalar, true);
    CHECK(es_kernels_select("auto") == ES_OK);
    printf("kernels: %s\n", es_kernels_name());
    for (int32_t k = 0; es_kernels_available(k); k++) {  // every set, the batched kernels included
        CHECK(es_kernels_select(es_kernels_available(k)) == ES_OK);
        run_matvecs(fast, true);
        for (int t = 0; t < N_WT; t++) {
            // Quantized types: every set computes kernels.h's per-token
            // arithmetic, so its rows are the scalar set's bit for bit.
            // Float types: each set sums in its own order; both are within
            // 1e-5 sum|terms| of the reference, so within 2e-5 of each other.
            const bool quantized = es_type_block(WEIGHT_TYPES[t]) > 1;  // Q8_0 is its own activation type
            double worst = 0;
            for (int r = 0; r < MV_ROWS; r++) {
                const double d = fabs((double) fast->y[t][r] - scalar->y[t][r]) / fast->mag[t][r];
                worst = fmax(worst, d);
                CHECK(d <= 2e-5);
            }
            if (quantized) CHECK(memcmp(fast->y[t], scalar->y[t], sizeof(fast->y[t])) == 0);
            printf("  %-5s %s vs scalar: max difference %.2g of sum|terms|%s\n", es_type_name(WEIGHT_TYPES[t]),
                   es_kernels_name(), worst, quantized ? " (bit-identical)" : "");
        }
    }
    CHECK(es_kernels_select("auto") == ES_OK);
    free(fast);
    free(scalar);
}

// Repacked weights (es_repack): es_matmat over the copy equals es_matvec
// over the rows bit for bit in every set, for 1..17 tokens (several tiles
// of tokens and every remainder) and row ranges that start or end inside a
// group, hold no whole group, or hold all of them; rows outside whole
// groups (and past the last) come from the unpacked rows.
static void test_repacked(void) {
    enum { ROWS = 29, NT = 17 };  // three groups of 8 and five rows more
    static const int64_t ranges[][2] = {{0, ROWS}, {3, 27}, {8, 16}, {9, 15}, {16, ROWS}, {0, 8}, {27, 28}};
    static float want[NT][ROWS], got[NT][ROWS];
    int32_t n_layouts = 0;
    for (int ti = 0; ti < (int) N_WT; ti++) {
        const int32_t type = WEIGHT_TYPES[ti], act = es_act_type(type);
        const size_t pb = es_repack_bytes(type, MV_N, ROWS);
        if (pb == 0) continue;
        n_layouts++;
        CHECK(pb == 3 * es_repack_bytes(type, MV_N, 8) && es_repack_bytes(type, MV_N, 7) == 0);
        CHECK(es_repack_bytes(type, MV_N + es_type_block(type) / 2, ROWS) == 0 || es_type_block(type) < 256);
        const size_t rb = es_type_row_bytes(type, MV_N), ab = es_type_row_bytes(act, MV_N);
        uint8_t * w = malloc(rb * ROWS), * packed = malloc(pb), * xs = malloc(ab * NT);
        random_rows(type, w, rb * ROWS);
        es_repack(type, w, MV_N, ROWS, packed);
        float x[MV_N];
        for (int t = 0; t < NT; t++) {
            for (int i = 0; i < MV_N; i++) x[i] = 2.f * next_float() * (float) (t + 1);
            es_quantize_act(type, x, xs + t * ab, MV_N);
        }
        for (int32_t k = 0; es_kernels_available(k); k++) {
            CHECK(es_kernels_select(es_kernels_available(k)) == ES_OK);
            for (int t = 0; t < NT; t++) es_matvec(type, w, xs + t * ab, MV_N, 0, ROWS, want[t]);
            for (size_t q = 0; q < N_ELEMS(ranges); q++) {
                const int64_t r0 = ranges[q][0], r1 = ranges[q][1];
                for (int nt = 1; nt <= NT; nt++) {
                    memset(got, 0, sizeof got);
                    es_matmat(type, w, packed, xs, ab, nt, MV_N, r0, r1, &got[0][0], ROWS);
                    int bad = 0;
                    for (int t = 0; t < nt; t++)
                        bad += memcmp(got[t], &want[t][r0], (size_t) (r1 - r0) * sizeof(float)) != 0;
                    if (bad)
                        fprintf(stderr, "%s %s rows [%d, %d) nt=%d: repacked differs\n", es_type_name(type),
                                es_kernels_name(), (int) r0, (int) r1, nt);
                    CHECK(bad == 0);
                }
            }
        }
        free(xs);
        free(packed);
        free(w);
    }
    CHECK(n_layouts > 0);
    CHECK(es_repack_bytes(ES_TYPE_F32, MV_N, ROWS) == 0 && es_repack_bytes(ES_TYPE_Q4_K, 0, ROWS) == 0);
    CHECK(es_kernels_select("auto") == ES_OK);
}

// The largest integer sums a block can have: every quant at its maximum
// (all bits set) against activations that all round to -128 or +127 (a
// constant row). Integer partial sums that wrap in some kernel's 16-bit
// stage would show here as a result other than the scalar kernels'.
static void test_extreme_sums(void) {
    enum { ROWS = 8 };  // one group of the repacked layouts, every row the same
    static float x[MV_N], want[2];
    for (int t = 0; t < (int) N_WT; t++) {
        const int32_t type = WEIGHT_TYPES[t];
        if (type == ES_TYPE_F32 || type == ES_TYPE_F16 || type == ES_TYPE_BF16) continue;
        const size_t rb = es_type_row_bytes(type, MV_N), bb = es_type_row_bytes(type, es_type_block(type));
        uint8_t * w = malloc(rb * ROWS);
        memset(w, 0xFF, rb);
        for (size_t b = 0; b < rb / bb; b++) {  // scales 1.0 (and mins 1.0)
            uint8_t * p = w + b * bb;
            put_half(p + half_at(type), 0x3C00);
            if (has_min(type)) put_half(p + half_at(type) + 2, 0x3C00);
        }
        for (int r = 1; r < ROWS; r++) memcpy(w + r * rb, w, rb);
        const size_t pb = es_repack_bytes(type, MV_N, ROWS);
        uint8_t * packed = pb ? malloc(pb) : NULL;
        if (packed) es_repack(type, w, MV_N, ROWS, packed);
        uint8_t * xq = malloc(es_type_row_bytes(es_act_type(type), MV_N));
        for (int sign = 0; sign < 2; sign++) {
            for (int i = 0; i < MV_N; i++) x[i] = sign ? -0.75f : 0.75f;
            es_quantize_act(type, x, xq, MV_N);
            CHECK(es_kernels_select("scalar") == ES_OK);
            es_matvec(type, w, xq, MV_N, 0, 1, &want[sign]);
            for (int32_t k = 0; es_kernels_available(k); k++) {
                CHECK(es_kernels_select(es_kernels_available(k)) == ES_OK);
                float rows[ROWS];  // es_matvec over a group of rows (a set's rows kernel)
                es_matvec(type, w, xq, MV_N, 0, ROWS, rows);
                for (int r = 0; r < ROWS; r++) CHECK(memcmp(&rows[r], &want[sign], sizeof(float)) == 0);
                for (int nt = 1; nt <= 9; nt++) {  // one activation row repeated: every batched kernel
                    for (int how = 0; how < (packed ? 2 : 1); how++) {  // rows as they are, repacked
                        float ys[9][ROWS];
                        es_matmat(type, w, how ? packed : NULL, xq, 0, nt, MV_N, 0, ROWS, &ys[0][0], ROWS);
                        int bad = 0;
                        for (int j = 0; j < nt; j++)
                            for (int r = 0; r < ROWS; r++) bad += memcmp(&ys[j][r], &want[sign], sizeof(float)) != 0;
                        if (bad)
                            fprintf(stderr, "%s %s nt=%d%s: %.9g vs %.9g\n", es_type_name(type),
                                    es_kernels_available(k), nt, how ? " repacked" : "", ys[nt - 1][ROWS - 1], want[sign]);
                        CHECK(bad == 0);
                    }
                }
            }
        }
        CHECK(want[0] != 0.0f);
        free(xq);
        free(packed);
        free(w);
    }
    CHECK(es_kernels_select("auto") == ES_OK);
}

// es_axpy_q8_0 (attention's weighted sum of Q8_0 value rows) for rows of
// 1 to 4 blocks: within 1e-5 of sum|terms| of a double-precision sum onto
// the starting acc, and every set's bit for bit the scalar set's. Rows of
// weight 0 are skipped: one with an infinite scale leaves no NaN.
static void test_axpy_q8_0(void) {
    enum { ROWS = 13, MAX_N = 128 };
    static uint8_t v[ROWS * MAX_N / 32 * 34];
    float e[ROWS], start[MAX_N], want[MAX_N], got[MAX_N];
    rng = 0x853C49E6748FEA9Bull;
    for (int n = 32; n <= MAX_N; n += 32) {
        const size_t rb = es_type_row_bytes(ES_TYPE_Q8_0, n);
        random_rows(ES_TYPE_Q8_0, v, rb * ROWS);
        for (int r = 0; r < ROWS; r++) e[r] = r % 5 == 2 ? 0.0f : next_float() * 0.5f + 0.5f;
        put_half(v + 2 * rb, 0x7C00);  // row 2 (weight 0): scale +inf
        for (int i = 0; i < n; i++) start[i] = next_float();
        CHECK(es_kernels_select("scalar") == ES_OK);
        memcpy(want, start, sizeof start);
        es_axpy_q8_0(n, ROWS, e, v, want);
        for (int i = 0; i < n; i++) {
            double ref = start[i], mag = fabs(start[i]);
            for (int r = 0; r < ROWS; r++) {
                if (e[r] == 0.0f) continue;
                const uint8_t * b = v + r * rb + i / 32 * 34;
                const double term = e[r] * half_value((uint16_t) (b[0] | (b[1] << 8))) * (int8_t) b[2 + i % 32];
                ref += term, mag += fabs(term);
            }
            CHECK(fabs(want[i] - ref) <= 1e-5 * mag);
        }
        for (int32_t k = 0; es_kernels_available(k); k++) {
            CHECK(es_kernels_select(es_kernels_available(k)) == ES_OK);
            memcpy(got, start, sizeof start);
            es_axpy_q8_0(n, ROWS, e, v, got);
            if (memcmp(got, want, (size_t) n * sizeof(float)) != 0)
                fprintf(stderr, "es_axpy_q8_0 n=%d: %s differs from scalar\n", n, es_kernels_available(k));
            CHECK(memcmp(got, want, (size_t) n * sizeof(float)) == 0);
        }
    }
    CHECK(es_kernels_select("auto") == ES_OK);
}

/* ---- thread pool ---------------------------------------------------------- */

typedef struct {
    _Atomic int32_t count[8];     // calls per thread
    int32_t         nth_seen[8];
    const int64_t * data;         // summed in nth slices
    _Atomic int64_t sum;
} pool_job;

#define POOL_DATA 1000

static void pool_fn(void * arg, int32_t ith, int32_t nth) {
    pool_job * j = arg;
    atomic_fetch_add(&j->count[ith], 1);
    j->nth_seen[ith] = nth;
    int64_t s = 0;
    for (int64_t i = POOL_DATA * ith / nth; i < POOL_DATA * (ith + 1) / nth; i++) s += j->data[i];
    atomic_fetch_add(&j->sum, s);
}

static void test_pool(void) {
    es_pool * pool = NULL;
    CHECK(es_pool_init(0, &pool) == ES_ERR_INVALID_ARG && pool == NULL);
    CHECK(es_pool_init(2, NULL) == ES_ERR_INVALID_ARG);
    int64_t data[POOL_DATA], total = 0;
    for (int i = 0; i < POOL_DATA; i++) data[i] = next_u32(), total += data[i];
    for (int32_t n = 1; n <= 4; n++) {
        for (int rep = 0; rep < 3; rep++) {  // repeated init / free
            CHECK(es_pool_init(n, &pool) == ES_OK);
            CHECK(es_pool_size(pool) == n);
            pool_job job = {.data = data};
            const int runs = 300;
            for (int r = 0; r < runs; r++) es_pool_run(pool, pool_fn, &job);
            CHECK(atomic_load(&job.sum) == total * runs);
            for (int i = 0; i < n; i++) CHECK(atomic_load(&job.count[i]) == runs && job.nth_seen[i] == n);
            es_pool_free(pool);
        }
    }
    es_pool_free(NULL);
}

// The sets this CPU runs end with scalar; a set it lacks and an unknown name
// are refused, leaving the choice as it was.
static void test_kernel_selection(void) {
    int32_t n = 0;
    while (es_kernels_available(n)) n++;
    CHECK(n >= 1 && strcmp(es_kernels_available(n - 1), "scalar") == 0);
    CHECK(es_kernels_available(-1) == NULL);
    bool has_avx512 = false, has_avx2 = false, has_neon = false;
    for (int32_t i = 0; i < n; i++) {
        has_avx512 |= strcmp(es_kernels_available(i), "avx512") == 0;
        has_avx2 |= strcmp(es_kernels_available(i), "avx2") == 0;
        has_neon |= strcmp(es_kernels_available(i), "neon") == 0;
    }
    CHECK(!(has_avx2 && has_neon));
    CHECK(!has_avx512 || (has_avx2 && strcmp(es_kernels_available(0), "avx512") == 0));  // best first
    CHECK(es_kernels_select(has_avx2 ? "neon" : "avx2") == ES_ERR_UNSUPPORTED);
    if (!has_avx512) CHECK(es_kernels_select("avx512") == ES_ERR_UNSUPPORTED);
    CHECK(es_kernels_select("sse9") == ES_ERR_INVALID_ARG);
    CHECK(es_kernels_select(NULL) == ES_ERR_INVALID_ARG);
    CHECK(strcmp(es_kernels_name(), es_kernels_available(0)) == 0);
    for (int32_t i = 0; i < n; i++) {
        CHECK(es_kernels_select(es_kernels_available(i)) == ES_OK);
        CHECK(strcmp(es_kernels_name(), es_kernels_available(i)) == 0);
    }
    CHECK(es_kernels_select("auto") == ES_OK);
}

int main(void) {
    test_kernel_selection();
    test_matvec();
    test_repacked();
    test_extreme_sums();
    test_axpy_q8_0();
    test_type_table();
    test_half_conversion();
    test_dequant_float_types();
    test_dequant_q4_q5_q8();
    test_dequant_k_quants();
    test_quantize_weights();
    test_quantize_act();
    test_pool();
    return check_report("test_quants");
}
