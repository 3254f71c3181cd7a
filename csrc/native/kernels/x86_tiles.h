/*
 * x86_tiles.h — the tile kernels' templates the two x86 sets share, over
 * the repacked layouts (kernels.h). Included by avx2.c and avx512.c after
 * x86.h and after the set's vector primitives (listed below): the same
 * templates then make AVX2's tiles of one group of 8 rows per 256-bit
 * vector and AVX-512's of two groups per 512-bit vector.
 */
#ifndef ES_X86_TILES_H
#define ES_X86_TILES_H

#include "x86.h"

// A tile is VGROUPS groups of 8 rows (one vector: an int32 lane per row)
// times T tokens (T <= TILE_T, a compile-time constant once the body is
// inlined into its T-specific function). Per super-block and sub-block, the
// set's integer step (sb_step: four elements of every row against one
// broadcast of the four activation bytes at p) over its groups of four, then
// its scale (sb_scale, once per sub-block); the mins or offset from the
// activation's group sums (mins_step); then kernels.h's float steps with
// each lane one row's accumulator. A weight vector serves T tokens, an
// activation broadcast every row of the vector.
//
// The including set defines first (its vectors vi / vf of VGROUPS groups'
// rows; gs: the bytes from a group's block to the next group's same block,
// 0 to read one group into every half):
//   vi vi_load(p, gs)              32 bytes of each group
//   vi vi_zero(), vi_set8(c), vi_and, vi_or, vi_add (int32), vi_sub, vi_sll16(v, n), vi_srl16(v, n)
//   vi sb_step(acc, w, p), sb_scale(acc, s), sb_widen(acc)
//   vi scales_u8(p, gs), scales_s8(p, gs)    8 bytes of each group, as sb_scale reads them
//   vi mins16(p, gs)               16 bytes of each group as int16 (pairs of sub-blocks)
//   vi pairs16(a, b, gs)           8 bytes of a and of b, interleaved, as int16
//   vi mins_step(acc, m16, p)      acc + m16 . (the int16 pair at p) per int32 lane
//   vi q5_fifth(qh, byte, g)       0x10 where element 4g (16 + 4g: byte 2 + g / 2) has its fifth bit
//   vf vf_zero(), vf_halves(p, gs), vf_load(p, rows), vf_store(p, v, rows)
//   vf vf_fma(acc, d, yd, sumi), vf_fnma(acc, d, yd, summ)   acc +- d * yd * (float) sums
//   vf vf_fma_bcast(acc, m, s)     acc + m * s
// Weights stream from memory while a tile computes: each super-block's
// tile prefetches into L2 the blocks PREFETCH_AHEAD bytes further on (past
// a group's end, the next group's); a 32-element block the next group's
// same block (the groups take turns over Q32_CHUNK blocks). Measured
// single-threaded on Zen 4, weights in memory, against the hardware
// prefetchers alone: Q5_K's and Q6_K's 1-token tiles (two interleaved
// streams: qs and qh, ql and qh) took half as long, Q4_K's and the 32-element
// types' 8-token tiles 20-50% less; into L1 it cost Q4_K's 1-token tiles
// 60%, and the 32-element types' 1- and 2-token tiles lose a little.
#define PREFETCH_AHEAD 16384
static ALWAYS_INLINE void prefetch_block(const void * p, size_t bytes, size_t gs) {
    for (size_t at = 0; at < bytes; at += 64) {
        _mm_prefetch((const char *) p + at, _MM_HINT_T1);
        if (VGROUPS > 1 && gs) _mm_prefetch((const char *) p + gs + at, _MM_HINT_T1);
    }
}

// Bit b of each byte moved to bit 4 (a shift of at most 4 within 16-bit
// lanes keeps each byte's own bit).
static ALWAYS_INLINE vi bit_to_4(vi v, int b) {
    return vi_and(b <= 4 ? vi_sll16(v, 4 - b) : vi_srl16(v, b - 4), vi_set8(0x10));
}

// Q4_K / Q5_K: sub-block j (chunk j / 2's low nibbles for even j, high
// for odd), in stages of K4_STAGE_##TYPE groups (AVX2's int16 sums hold 16
// terms of Q4_K, 8 of Q5_K); side by side, the two sub-blocks of a chunk
// took more registers than there are and ran no faster. Q5_K's fifth bit of
// sub-block j is bit j of its qh bytes. The mins: per token and super-block
// the pairs of group sums once, against the rows' (min 2k, min 2k + 1) as
// int16 pairs.
#define K4_PART_q4_K(b) (b)
#define K4_PART_q5_K(b) (&(b)->k4)
#define K4_FIFTH_q4_K(b, j, g, gs, w) (void) 0
#define K4_FIFTH_q5_K(b, j, g, gs, w) (w = vi_or(w, bit_to_4(vi_load((b)->qh[g], gs), j)))

static ALWAYS_INLINE void pair_sums(const int16_t * bsums, int16_t out[8]) {
    const __m256i b = load256(bsums);
    _mm_storeu_si128((__m128i *) out, _mm_hadd_epi16(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

// Sub-block j's group g (elements 4g .. 4g + 3 of every row) as u8.
#define K4_WEIGHT(TYPE)                                                                         \
    static ALWAYS_INLINE vi k4_weight_##TYPE(const block_##TYPE##x8 * x, int j, int g, size_t gs, vi m4) { \
        const vi raw = vi_load(K4_PART_##TYPE(x)->qs[j / 2][g], gs);                          \
        vi w = vi_and(j % 2 ? vi_srl16(raw, 4) : raw, m4);                                    \
        K4_FIFTH_##TYPE(x, j, g, gs, w);                                                      \
        return w;                                                                             \
    }
K4_WEIGHT(q4_K)
K4_WEIGHT(q5_K)

// A super-block's float steps for one token: the scaled sums, less the
// mins; what the rows give, read once for all tokens (k4_rows).
typedef struct { vf d, dmin; vi m16[4]; } k4_rows_t;
static ALWAYS_INLINE k4_rows_t k4_rows(const block_q4_Kx8 * b, size_t gs) {
    k4_rows_t r = {vf_halves(b->d, gs), vf_halves(b->dmin, gs), {vi_zero()}};
    for (int k = 0; k < 4; k++) r.m16[k] = mins16(b->mins[k][0], gs);
    return r;
}
static ALWAYS_INLINE vf k4_finish(vf acc, const k4_rows_t * r, const block_q8_K * y, vi sumi) {
    int16_t bp[8];
    pair_sums(y->bsums, bp);
    vi summ = vi_zero();
    for (int k = 0; k < 4; k++) summ = mins_step(summ, r->m16[k], bp + 2 * k);
    return vf_fnma(vf_fma(acc, r->d, y->d, sumi), r->dmin, y->d, summ);
}

#define K4_TILE(TYPE)                                                                           \
    static ALWAYS_INLINE void tile_##TYPE##_body(int64_t nb, const block_##TYPE##x8 * x, size_t gs, \
                                                 const block_q8_K * const * y, float * out,     \
                                                 size_t out_stride, int rows, const int T) {    \
        const vi m4 = vi_set8(0x0F);                                                          \
        vf acc[TILE_T];                                                                       \
        for (int t = 0; t < T; t++) acc[t] = vf_zero();                                       \
        for (int64_t i = 0; i < nb; i++) {                                                    \
            const block_q4_Kx8 * b = K4_PART_##TYPE(x + i);                                   \
            prefetch_block(x + i + PREFETCH_AHEAD / sizeof *x, sizeof *x, gs);                \
            vi sumi[TILE_T];                                                                  \
            for (int t = 0; t < T; t++) sumi[t] = vi_zero();                                  \
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {                             \
                const vi sc = scales_u8(b->scales[j], gs);                                    \
                _Pragma("GCC unroll 8") for (int g0 = 0; g0 < 8; g0 += K4_STAGE_##TYPE) {     \
                    vi e[TILE_T];                                                             \
                    for (int t = 0; t < T; t++) e[t] = vi_zero();                             \
                    _Pragma("GCC unroll 8") for (int g = g0; g < g0 + K4_STAGE_##TYPE; g++) { \
                        const vi w = k4_weight_##TYPE(x + i, j, g, gs, m4);                   \
                        for (int t = 0; t < T; t++) e[t] = sb_step(e[t], w, y[t][i].qs + 32 * j + 4 * g); \
                    }                                                                         \
                    for (int t = 0; t < T; t++) sumi[t] = vi_add(sumi[t], sb_scale(e[t], sc)); \
                }                                                                             \
            }                                                                                 \
            const k4_rows_t r = k4_rows(b, gs);                                               \
            for (int t = 0; t < T; t++) acc[t] = k4_finish(acc[t], &r, &y[t][i], sumi[t]);    \
        }                                                                                     \
        for (int t = 0; t < T; t++) vf_store(out + (size_t) t * out_stride, acc[t], rows);    \
    }

// Q6_K: quarter q = 4h + k is sub-blocks 2q (groups 0..3) and 2q + 1
// (4..7) of 16 elements, one after the other (side by side, their chains
// took more registers than there are), in stages of Q6_STAGE groups (AVX2's
// int16 sums hold two groups of 63 * 127 terms); its values 0..63 take the
// nibble of ql and two bits of qh moved to bits 4..5 (left shifts of at
// most 4 and a right one of 2 within 16-bit lanes keep each byte's own
// bits). The offset of 32 comes off the exact sum as 32 * sum of scale
// times group sum (scales as int16 pairs of sub-blocks 2m, 2m + 1 against
// the pair of group sums).
static ALWAYS_INLINE vi q6_weights(const block_q6_Kx8 * b, size_t gs, int h, int k, int g, vi m4) {
    const vi lq = vi_load(b->ql[h][k & 1][g], gs), qh = vi_load(b->qh[h][g], gs), m = vi_set8(0x30);
    const vi hi = k == 0 ? vi_sll16(qh, 4) : k == 1 ? vi_sll16(qh, 2) : k == 2 ? qh : vi_srl16(qh, 2);
    return vi_or(vi_and(k < 2 ? lq : vi_srl16(lq, 4), m4), vi_and(hi, m));
}

// A super-block's float step for one token: the scaled sums less 32 times
// the scaled group sums; what the rows give, read once (q6_rows).
typedef struct { vf d; vi sp[8]; } q6_rows_t;
static ALWAYS_INLINE q6_rows_t q6_rows(const block_q6_Kx8 * b, size_t gs) {
    q6_rows_t r = {vf_halves(b->d, gs), {vi_zero()}};
    for (int m = 0; m < 8; m++) r.sp[m] = pairs16(b->scales[2 * m], b->scales[2 * m + 1], gs);
    return r;
}
static ALWAYS_INLINE vf q6_finish(vf acc, const q6_rows_t * r, const block_q8_K * y, vi sumi) {
    vi off = vi_zero();
    for (int m = 0; m < 8; m++) off = mins_step(off, r->sp[m], y->bsums + 2 * m);
    return vf_fma(acc, r->d, y->d, vi_sub(sumi, vi_sll32(off, 5)));
}

#define Q6_TILE()                                                                               \
    static ALWAYS_INLINE void tile_q6_K_body(int64_t nb, const block_q6_Kx8 * x, size_t gs,     \
                                             const block_q8_K * const * y, float * out,         \
                                             size_t out_stride, int rows, const int T) {        \
        const vi m4 = vi_set8(0x0F);                                                          \
        vf acc[TILE_T];                                                                       \
        for (int t = 0; t < T; t++) acc[t] = vf_zero();                                       \
        for (int64_t i = 0; i < nb; i++) {                                                    \
            const block_q6_Kx8 * b = x + i;                                                   \
            prefetch_block(x + i + PREFETCH_AHEAD / sizeof *x, sizeof *x, gs);                \
            vi sumi[TILE_T];                                                                  \
            for (int t = 0; t < T; t++) sumi[t] = vi_zero();                                  \
            _Pragma("GCC unroll 16") for (int j = 0; j < 16; j++) {                           \
                const int q = j / 2, h = q / 4, k = q % 4, g1 = 4 * (j % 2);                  \
                const vi sc = scales_s8(b->scales[j], gs);                                    \
                _Pragma("GCC unroll 4") for (int g0 = g1; g0 < g1 + 4; g0 += Q6_STAGE) {      \
                    vi e[TILE_T];                                                             \
                    for (int t = 0; t < T; t++) e[t] = vi_zero();                             \
                    _Pragma("GCC unroll 4") for (int g = g0; g < g0 + Q6_STAGE; g++) {        \
                        const vi w = q6_weights(b, gs, h, k, g, m4);                          \
                        for (int t = 0; t < T; t++) e[t] = sb_step(e[t], w, y[t][i].qs + 32 * q + 4 * g); \
                    }                                                                         \
                    for (int t = 0; t < T; t++) sumi[t] = vi_add(sumi[t], sb_scale(e[t], sc)); \
                }                                                                             \
            }                                                                                 \
            const q6_rows_t r = q6_rows(b, gs);                                               \
            for (int t = 0; t < T; t++) acc[t] = q6_finish(acc[t], &r, &y[t][i], sumi[t]);    \
        }                                                                                     \
        for (int t = 0; t < T; t++) vf_store(out + (size_t) t * out_stride, acc[t], rows);    \
    }

// The wide tiles: up to WIDE_T tokens in one pass over the weights, for a
// set whose registers hold too few tokens' sums (AVX2's 16: TILE_T = 4, so
// 16 tokens took four passes, each unpacking every weight again and
// spending a broadcast of the activation on one vector of rows). A pass
// takes a chunk of four groups (16 elements of every row) of WIDE_NG
// vectors of rows at a time, unpacks them once into WIDE_NG x 4 registers,
// then runs every token against them: one broadcast of four activation
// bytes serves WIDE_NG vectors. A token's int16 sums live in WIDE_NG
// registers over a chunk; its int32 and float sums, touched once per chunk and
// super-block, in memory (L1). A stage of 8 groups (Q4_K) spans two chunks:
// its int16 sums wait in memory between them. Same integer sums, same
// float steps in the same order: the same bits as the tiles above.
//
// For a set of one group per vector (VGROUPS 1), which defines WIDE_T (at
// most TILE_TOKENS: dispatch.c's calls), WIDE_FROM_##TYPE (the fewest
// tokens the wide tile takes), WIDE_NG and, beyond the tiles' list:
//   vi vi_bcast32(p)             the 4 bytes at p in every lane
//   vi sb_step_b(acc, w, b)      sb_step against a broadcast b
// A type defines its chunk (c = 0..15 of a super-block): WEIGHT_##TYPE(x,
// c, g, gs, m4) group g = 0..3's weights (activation bytes CHUNK_ACT(c) +
// 4g of the super-block); SCALES_##TYPE(x, c, gs) the sub-block's scales;
// STAGE_##TYPE the groups summed in int16; ROWS_##TYPE and FINISH_##TYPE
// the float steps.
#define WEIGHT_q4_K(x, c, g, gs, m4) k4_weight_q4_K(x, (c) / 2, 4 * ((c) % 2) + (g), gs, m4)
#define WEIGHT_q5_K(x, c, g, gs, m4) k4_weight_q5_K(x, (c) / 2, 4 * ((c) % 2) + (g), gs, m4)
#define WEIGHT_q6_K(x, c, g, gs, m4) q6_weights(x, gs, (c) / 8, ((c) / 2) % 4, 4 * ((c) % 2) + (g), m4)
#define CHUNK_ACT(c) (32 * ((c) / 2) + 16 * ((c) % 2))  // sub-block c / 2's half c % 2 (Q6_K: sub-block c)
#define SCALES_q4_K(x, c, gs) scales_u8(K4_PART_q4_K(x)->scales[(c) / 2], gs)
#define SCALES_q5_K(x, c, gs) scales_u8(K4_PART_q5_K(x)->scales[(c) / 2], gs)
#define SCALES_q6_K(x, c, gs) scales_s8((x)->scales[c], gs)
#define STAGE_q4_K K4_STAGE_q4_K
#define STAGE_q5_K K4_STAGE_q5_K
#define STAGE_q6_K Q6_STAGE
#define ROWS_q4_K(x, gs) k4_rows(x, gs)
#define ROWS_q5_K(x, gs) k4_rows(K4_PART_q5_K(x), gs)
#define ROWS_q6_K(x, gs) q6_rows(x, gs)
#define FINISH_q4_K k4_finish
#define FINISH_q5_K k4_finish
#define FINISH_q6_K q6_finish

#define WIDE_TILE(TYPE)                                                                         \
    static ALWAYS_INLINE void tile_##TYPE##_wide_body(int64_t nb, const block_##TYPE##x8 * x,    \
                                                      const block_q8_K * const * y, int T, float * out, \
                                                      size_t out_stride, const int NG) {         \
        const size_t gs = 0;  /* one group a vector */                                        \
        _Static_assert(VGROUPS == 1 && (STAGE_##TYPE <= 4 || STAGE_##TYPE == 8), "one group a vector, a stage within a chunk or two"); \
        const vi m4 = vi_set8(0x0F);                                                          \
        vf acc[WIDE_T][WIDE_NG];                                                              \
        vi sumi[WIDE_T][WIDE_NG], carry[WIDE_T][WIDE_NG];                                     \
        for (int t = 0; t < T; t++)                                                           \
            for (int k = 0; k < NG; k++) acc[t][k] = vf_zero();                               \
        for (int64_t i = 0; i < nb; i++) {                                                    \
            const block_##TYPE##x8 * b[WIDE_NG];  /* vector k's super-block i */              \
            for (int k = 0; k < NG; k++) {                                                    \
                b[k] = x + (int64_t) k * nb + i;                                              \
                prefetch_block(b[k] + PREFETCH_AHEAD / sizeof *x, sizeof *x, gs);             \
            }                                                                                 \
            for (int t = 0; t < T; t++)                                                       \
                for (int k = 0; k < NG; k++) sumi[t][k] = vi_zero();                          \
            _Pragma("GCC unroll 16") for (int c = 0; c < 16; c++) {                           \
                vi w[WIDE_NG][4], sc[WIDE_NG];                                                \
                for (int k = 0; k < NG; k++) {                                                \
                    sc[k] = SCALES_##TYPE(b[k], c, gs);                                       \
                    for (int g = 0; g < 4; g++) w[k][g] = WEIGHT_##TYPE(b[k], c, g, gs, m4);  \
                }                                                                             \
                const bool opens = STAGE_##TYPE < 8 || c % 2 == 0, closes = STAGE_##TYPE < 8 || c % 2; \
                _Pragma("GCC unroll 1") for (int t = 0; t < T; t++) {                         \
                    const int8_t * a = y[t][i].qs + CHUNK_ACT(c);                            \
                    vi e[WIDE_NG], s[WIDE_NG];                                                \
                    for (int k = 0; k < NG; k++) e[k] = opens ? vi_zero() : carry[t][k], s[k] = vi_zero(); \
                    for (int g = 0; g < 4; g++) {                                             \
                        const vi bc = vi_bcast32(a + 4 * g);                                  \
                        for (int k = 0; k < NG; k++) e[k] = sb_step_b(e[k], w[k][g], bc);     \
                        if (STAGE_##TYPE < 8 && (g + 1) % STAGE_##TYPE == 0)                  \
                            for (int k = 0; k < NG; k++) s[k] = vi_add(s[k], sb_scale(e[k], sc[k])), e[k] = vi_zero(); \
                    }                                                                         \
                    for (int k = 0; k < NG; k++) {                                            \
                        if (closes) sumi[t][k] = vi_add(sumi[t][k], STAGE_##TYPE < 8 ? s[k] : sb_scale(e[k], sc[k])); \
                        else carry[t][k] = e[k];                                              \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
            for (int k = 0; k < NG; k++) {                                                    \
                const __typeof__(ROWS_##TYPE(b[k], gs)) r = ROWS_##TYPE(b[k], gs);            \
                for (int t = 0; t < T; t++) acc[t][k] = FINISH_##TYPE(acc[t][k], &r, &y[t][i], sumi[t][k]); \
            }                                                                                 \
        }                                                                                     \
        for (int t = 0; t < T; t++)                                                           \
            for (int k = 0; k < NG; k++)                                                      \
                vf_store(out + (size_t) t * out_stride + (size_t) (k * ES_GROUP_ROWS), acc[t][k], ES_GROUP_ROWS); \
    }                                                                                         \
    /* The type's tile_fn: fewer than WIDE_FROM_TYPE tokens on the register tiles, more */  \
    /* WIDE_T at a time, each one pass over the groups, WIDE_NG at a time. */                \
    static void tile_##TYPE##_wide(int64_t n, const void * wp, int64_t n_groups, const void * a, \
                                   size_t a_stride, int32_t nt, float * y, size_t y_stride) { \
        if (nt < WIDE_FROM_##TYPE) {                                                          \
            tile_##TYPE(n, wp, n_groups, a, a_stride, nt, y, y_stride);                       \
            return;                                                                           \
        }                                                                                     \
        const int64_t nb = n / QK_K;                                                          \
        const block_##TYPE##x8 * x = wp;                                                      \
        for (int32_t t0 = 0; t0 < nt; t0 += WIDE_T) {                                         \
            const int32_t tn = nt - t0 < WIDE_T ? nt - t0 : WIDE_T;                           \
            const block_q8_K * yt[WIDE_T];                                                    \
            for (int32_t t = 0; t < tn; t++)                                                  \
                yt[t] = (const block_q8_K *) ((const uint8_t *) a + (size_t) (t0 + t) * a_stride); \
            float * out = y + (size_t) t0 * y_stride;                                         \
            int64_t g = 0;                                                                    \
            for (; g + WIDE_NG <= n_groups; g += WIDE_NG)                                     \
                tile_##TYPE##_wide_body(nb, x + g * nb, yt, tn, out + ES_GROUP_ROWS * g, y_stride, WIDE_NG); \
            for (; g < n_groups; g++)                                                         \
                tile_##TYPE##_wide_body(nb, x + g * nb, yt, tn, out + ES_GROUP_ROWS * g, y_stride, 1); \
        }                                                                                     \
    }

// A K-quant's tile_fn: VGROUPS groups at a time (one alone at an odd end),
// each with its tokens in tiles of TILE_T (and the remainder), the body
// specialized for each T.
#define TILE_T_FN(TYPE, T)                                                                      \
    static void tile_##TYPE##_##T(int64_t nb, const void * x, size_t gs, const block_q8_K * const * y, \
                                  float * out, size_t out_stride, int rows) {                   \
        tile_##TYPE##_body(nb, x, gs, y, out, out_stride, rows, T);                             \
    }
#define TILE_T_NAME(TYPE, T) tile_##TYPE##_##T,
#define TILE_KERNEL(TYPE, BLOCK)                                                                \
    EACH_TILE_T(TILE_T_FN, TYPE)                                                                \
    static void tile_##TYPE(int64_t n, const void * wp, int64_t n_groups, const void * a,       \
                            size_t a_stride, int32_t nt, float * y, size_t y_stride) {          \
        static void (*const by_t[TILE_T])(int64_t, const void *, size_t, const block_q8_K * const *, \
                                          float *, size_t, int) = {EACH_TILE_T(TILE_T_NAME, TYPE)}; \
        const int64_t nb = n / QK_K;                                                            \
        const size_t gs = (size_t) nb * sizeof(BLOCK);                                          \
        for (int64_t g = 0; g < n_groups; g += VGROUPS) {                                       \
            const int rows = ES_GROUP_ROWS * (int) (n_groups - g < VGROUPS ? n_groups - g : VGROUPS); \
            for (int32_t t0 = 0; t0 < nt; t0 += TILE_T) {                                       \
                const int32_t tn = nt - t0 < TILE_T ? nt - t0 : TILE_T;                         \
                const block_q8_K * yt[TILE_T];                                                  \
                for (int32_t t = 0; t < tn; t++)                                                \
                    yt[t] = (const block_q8_K *) ((const uint8_t *) a + (size_t) (t0 + t) * a_stride); \
                by_t[tn - 1](nb, (const uint8_t *) wp + (size_t) g * gs, rows > ES_GROUP_ROWS ? gs : 0, yt, \
                             y + (size_t) t0 * y_stride + (size_t) (ES_GROUP_ROWS * g), y_stride, rows); \
            }                                                                                   \
        }                                                                                       \
    }

// The 32-element quants: per block, four groups of the rows' elements 0..15
// (lo) and 16..31 (hi) side by side, both chains widened to int32
// (sb_widen) and added to the block's offset: the activation block's exact
// sum times -8 (Q4_0), -16 (Q5_0) or -128 (Q8_0, stored plus 128), so the
// unsigned weights give the signed types' exact sums. Per token and block
// the offset and the activation's d (and Q8_1's s) are prepared once per
// call for Q32_CHUNK blocks at a time, for all the groups.
#define Q32_CHUNK 64
typedef struct { int32_t off; float dy, sy; } q32_prep;

#define Q32_OFFSET_q4_0 8
#define Q32_OFFSET_q5_0 16
#define Q32_OFFSET_q8_0 128
#define Q32_OFFSET_q4_1 0
#define Q32_OFFSET_q5_1 0
#define Q32_S_q4_0(yb) 0.0f
#define Q32_S_q5_0(yb) 0.0f
#define Q32_S_q8_0(yb) 0.0f
#define Q32_S_q4_1(yb) h2f((yb)->s)
#define Q32_S_q5_1(yb) h2f((yb)->s)
// The min step of Q4_1 / Q5_1 (m_x s_y per row), or none.
#define Q32_MIN_q4_0(acc, b, gs, sy) (acc)
#define Q32_MIN_q5_0(acc, b, gs, sy) (acc)
#define Q32_MIN_q8_0(acc, b, gs, sy) (acc)
#define Q32_MIN_q4_1(acc, b, gs, sy) vf_fma_bcast(acc, vf_halves((b)->m, gs), sy)
#define Q32_MIN_q5_1(acc, b, gs, sy) vf_fma_bcast(acc, vf_halves((b)->m, gs), sy)

// Sum of 32 signed bytes, exact.
static ALWAYS_INLINE int32_t sum_i8x32(const int8_t * p) {
    const __m256i u = _mm256_xor_si256(load256(p), _mm256_set1_epi8((char) 0x80));  // q + 128
    const __m256i s = _mm256_sad_epu8(u, _mm256_setzero_si256());
    const __m128i h = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    return (int32_t) (_mm_cvtsi128_si64(h) + _mm_extract_epi64(h, 1)) - 32 * 128;
}

// Group g's weights, elements 4g .. 4g + 3 (lo) and 16 + 4g .. (hi), as u8.
static ALWAYS_INLINE void q32_nibbles(const uint8_t qs[8][4], size_t gs, vi * lo, vi * hi) {
    const vi raw = vi_load(qs, gs), m4 = vi_set8(0x0F);
    *lo = vi_and(raw, m4), *hi = vi_and(vi_srl16(raw, 4), m4);
}
#define Q32_UNPACK_q4_0(b, g, gs, lo, hi) q32_nibbles((b)->qs[g], gs, &lo, &hi)
#define Q32_UNPACK_q4_1(b, g, gs, lo, hi) q32_nibbles((b)->qs[g], gs, &lo, &hi)
#define Q32_UNPACK_q5_0(b, g, gs, lo, hi)                                                       \
    do {                                                                                        \
        const vi qh = vi_load((b)->qh, gs);                                                     \
        q32_nibbles((b)->qs[g], gs, &lo, &hi);                                                  \
        lo = vi_or(lo, q5_fifth(qh, (g) / 2, g));                                               \
        hi = vi_or(hi, q5_fifth(qh, 2 + (g) / 2, g));                                           \
    } while (0)
#define Q32_UNPACK_q5_1(b, g, gs, lo, hi) Q32_UNPACK_q5_0(b, g, gs, lo, hi)
#define Q32_UNPACK_q8_0(b, g, gs, lo, hi) (lo = vi_load((b)->qs[g], gs), hi = vi_load((b)->qs[(g) + 4], gs))

#define Q32_TILE(TYPE)                                                                          \
    static ALWAYS_INLINE void tile_##TYPE##_body(int64_t nb, int64_t i0, int64_t i1, const block_##TYPE##x8 * x, \
                                                 size_t gs, const DOT32_ACT_##TYPE * const * y, \
                                                 const q32_prep (*prep)[Q32_CHUNK], float * out, \
                                                 size_t out_stride, int rows, const int T) {    \
        vf acc[TILE_T];                                                                       \
        for (int t = 0; t < T; t++) acc[t] = i0 ? vf_load(out + (size_t) t * out_stride, rows) : vf_zero(); \
        for (int64_t i = i0; i < i1; i++) {                                                   \
            const block_##TYPE##x8 * b = x + i;                                               \
            if (T > 2) prefetch_block(x + nb * VGROUPS + i, sizeof *x, gs);  /* the next groups' */ \
            vi lo[TILE_T], hi[TILE_T];                                                        \
            for (int t = 0; t < T; t++) lo[t] = hi[t] = vi_zero();                            \
            _Pragma("GCC unroll 4") for (int g = 0; g < 4; g++) {                             \
                vi wl, wh;                                                                    \
                Q32_UNPACK_##TYPE(b, g, gs, wl, wh);                                          \
                for (int t = 0; t < T; t++) {                                                 \
                    lo[t] = sb_step(lo[t], wl, y[t][i].qs + 4 * g);                           \
                    hi[t] = sb_step(hi[t], wh, y[t][i].qs + 16 + 4 * g);                      \
                }                                                                             \
            }                                                                                 \
            const vf d = vf_halves(b->d, gs);                                                 \
            for (int t = 0; t < T; t++) {                                                     \
                const q32_prep * p = &prep[t][i - i0];                                        \
                const vi sumi = vi_add(vi_bcast32(&p->off), vi_add(sb_widen(lo[t]), sb_widen(hi[t]))); \
                acc[t] = Q32_MIN_##TYPE(vf_fma(acc[t], d, p->dy, sumi), b, gs, p->sy);        \
            }                                                                                 \
        }                                                                                     \
        for (int t = 0; t < T; t++) vf_store(out + (size_t) t * out_stride, acc[t], rows);    \
    }                                                                                         \
    EACH_TILE_T(Q32_T_FN, TYPE)                                                               \
    static void tile_##TYPE(int64_t n, const void * wp, int64_t n_groups, const void * a,     \
                            size_t a_stride, int32_t nt, float * y, size_t y_stride) {        \
        static void (*const by_t[TILE_T])(int64_t, int64_t, int64_t, const block_##TYPE##x8 *, size_t, \
                                          const DOT32_ACT_##TYPE * const *,                   \
                                          const q32_prep (*)[Q32_CHUNK], float *, size_t, int) = { \
            EACH_TILE_T(TILE_T_NAME, TYPE)};                                                  \
        const int64_t nb = n / QK;                                                            \
        const size_t gs = (size_t) nb * sizeof(block_##TYPE##x8);                             \
        q32_prep prep[TILE_T][Q32_CHUNK];                                                     \
        for (int32_t t0 = 0; t0 < nt; t0 += TILE_T) {                                         \
            const int32_t tn = nt - t0 < TILE_T ? nt - t0 : TILE_T;                           \
            const DOT32_ACT_##TYPE * yt[TILE_T];                                              \
            for (int32_t t = 0; t < tn; t++)                                                  \
                yt[t] = (const DOT32_ACT_##TYPE *) ((const uint8_t *) a + (size_t) (t0 + t) * a_stride); \
            for (int64_t i0 = 0; i0 < nb; i0 += Q32_CHUNK) {                                  \
                const int64_t i1 = i0 + Q32_CHUNK < nb ? i0 + Q32_CHUNK : nb;                 \
                for (int32_t t = 0; t < tn; t++)                                              \
                    for (int64_t i = i0; i < i1; i++) {                                       \
                        const DOT32_ACT_##TYPE * yb = yt[t] + i;                              \
                        prep[t][i - i0] = (q32_prep) {                                        \
                            .off = Q32_OFFSET_##TYPE ? -Q32_OFFSET_##TYPE * sum_i8x32(yb->qs) : 0, \
                            .dy = h2f(yb->d), .sy = Q32_S_##TYPE(yb)};                         \
                    }                                                                         \
                for (int64_t g = 0; g < n_groups; g += VGROUPS) {                             \
                    const int rows = ES_GROUP_ROWS * (int) (n_groups - g < VGROUPS ? n_groups - g : VGROUPS); \
                    by_t[tn - 1](nb, i0, i1, (const block_##TYPE##x8 *) wp + g * nb, rows > ES_GROUP_ROWS ? gs : 0, \
                                 yt, prep, y + (size_t) t0 * y_stride + (size_t) (ES_GROUP_ROWS * g), y_stride, rows); \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }
#define Q32_T_FN(TYPE, T)                                                                       \
    static void tile_##TYPE##_##T(int64_t nb, int64_t i0, int64_t i1, const block_##TYPE##x8 * x, size_t gs, \
                                  const DOT32_ACT_##TYPE * const * y, const q32_prep (*prep)[Q32_CHUNK], \
                                  float * out, size_t out_stride, int rows) {                   \
        tile_##TYPE##_body(nb, i0, i1, x, gs, y, prep, out, out_stride, rows, T);               \
    }

#endif  // ES_X86_TILES_H
