/*
 * x86.h — what the two x86 sets share (included by avx2.c and avx512.c, each
 * compiled with its own flags): loads and unpacking of every quantized block
 * layout, and the templates of the unpacked kernels, which take their
 * integer products from the set that includes them (SET##_...): AVX2's
 * maddubs + madd, or AVX-512 VNNI's vpdpbusd / vpdpwssd.
 *
 * The unpacked kernels multiply one weight row by NT = 1..MAX_NT tokens,
 * each block unpacked once for all of them; each token's result takes the
 * per-token arithmetic of kernels.h (an exact integer sum per block, then
 * its float steps), so it equals what every other kernel gives that token.
 */
#ifndef ES_X86_H
#define ES_X86_H

#include "kernels.h"

#include <immintrin.h>

// binary16 -> binary32 through es__half_table (avx2.c): one load, where
// vcvtph2ps would compete with the broadcasts for the shuffle port.
extern float es__half_table[1 << 16];
static inline float h2f(es_half h) { return es__half_table[h]; }

static inline float hsum_f32x8(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

static inline int32_t hsum_i32x8(__m256i v) {
    __m128i r = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    r = _mm_add_epi32(r, _mm_shuffle_epi32(r, _MM_SHUFFLE(1, 0, 3, 2)));
    r = _mm_add_epi32(r, _mm_shuffle_epi32(r, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(r);
}

static inline __m256i load256(const void * p) { return _mm256_loadu_si256((const __m256i *) p); }

// 16 bytes of nibbles -> 32 bytes: low nibbles (elements 0..15), then high
// (16..31). A broadcast load and a blend instead of an insert, which would
// compete with the scale broadcasts for the shuffle port.
static inline __m256i unpack_nibbles(const uint8_t * p) {
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) p));
    const __m256i v = _mm256_blend_epi32(b, _mm256_srli_epi16(b, 4), 0xF0);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

// 32 bits -> 32 bytes, 0xFF where bit j of qh is set.
static inline __m256i expand_bits(const uint8_t * p) {
    uint32_t qh;
    memcpy(&qh, p, 4);
    // Byte j takes qh's byte j / 8, then tests bit j % 8 of it.
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int) qh),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x((int64_t) 0x8040201008040201ull);
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

static inline __m256i shuffle16(__m256i v, const uint8_t mask[32]) {
    return _mm256_shuffle_epi8(v, load256(mask));
}

// 8 bytes -> 8 int16 in both 128-bit lanes (zero- or sign-extended).
static inline __m256i u8x8_to_i16x2(const uint8_t * p) {
    return _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *) p)));
}
static inline __m256i s8x8_to_i16x2(const int8_t * p) {
    return _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *) p)));
}

// Both kernel families of a set come from these templates: NT_TABLE_SET
// makes the table es_matmat indexes (dotn_T_SET[nt - 1]) and es_matvec's
// one-token function from the NT = 1..MAX_NT instances.
#define NT_TABLE_SET(T, SET)                                                                  \
    static const vec_dotn_fn dotn_##T##_##SET[MAX_NT] = {EACH_NT(NT_NAME, dot_##T##_##SET##_)}; \
    static float dot_##T##_##SET(int64_t n, const void * w, const void * a) {               \
        float r;                                                                            \
        dot_##T##_##SET##_1(n, w, a, 0, &r);                                                \
        return r;                                                                           \
    }

/* ---- the 32-element quants ----------------------------------------------- */

// A block unpacks to `w8`: the signed types keep |q| (a u8 operand) and q
// (whose sign moves onto the activation, so |q| y keeps q y's sign); the
// types with a min keep q >= 0.
typedef struct { __m256i mag, sgn; } w8;

static inline w8 signed_w8(__m256i q) { return (w8) {_mm256_sign_epi8(q, q), q}; }

static inline w8 unpack_q4_0(const block_q4_0 * x) {
    return signed_w8(_mm256_sub_epi8(unpack_nibbles(x->qs), _mm256_set1_epi8(8)));
}
static inline w8 unpack_q5_0(const block_q5_0 * x) {
    // q - 16 as a signed byte: the nibble where the fifth bit is set,
    // else the nibble with 0xF0 on top (nibble - 16 in two's complement).
    const __m256i hi = _mm256_andnot_si256(expand_bits(x->qh), _mm256_set1_epi8((char) 0xF0));
    return signed_w8(_mm256_or_si256(unpack_nibbles(x->qs), hi));
}
static inline w8 unpack_q8_0(const block_q8_0 * x) { return signed_w8(load256(x->qs)); }
static inline w8 unpack_q4_1(const block_q4_1 * x) { return (w8) {unpack_nibbles(x->qs), _mm256_setzero_si256()}; }
static inline w8 unpack_q5_1(const block_q5_1 * x) {
    const __m256i hi = _mm256_and_si256(expand_bits(x->qh), _mm256_set1_epi8(0x10));
    return (w8) {_mm256_or_si256(unpack_nibbles(x->qs), hi), _mm256_setzero_si256()};
}

// One token's block sum: the set's 8 int32 lanes of u8 x s8 products
// (SET##_dot_u8s8), the sign of q moved onto y for the signed types.
#define PROD_SIGNED(SET, q, y)   SET##_dot_u8s8((q).mag, _mm256_sign_epi8(load256(y), (q).sgn))
#define PROD_UNSIGNED(SET, q, y) SET##_dot_u8s8((q).mag, load256(y))
#define DOT32_PROD_q4_0 PROD_SIGNED
#define DOT32_PROD_q5_0 PROD_SIGNED
#define DOT32_PROD_q8_0 PROD_SIGNED
#define DOT32_PROD_q4_1 PROD_UNSIGNED
#define DOT32_PROD_q5_1 PROD_UNSIGNED

// Block i's min step (Q4_1, Q5_1 against Q8_1: m_x s_y), or none.
#define DOT32_MIN_q4_0(acc, x, y, i) (acc)
#define DOT32_MIN_q5_0(acc, x, y, i) (acc)
#define DOT32_MIN_q8_0(acc, x, y, i) (acc)
#define DOT32_MIN_q4_1(acc, x, y, i) fmaf(h2f((x)[i].m), h2f((y)[i].s), acc)
#define DOT32_MIN_q5_1(acc, x, y, i) fmaf(h2f((x)[i].m), h2f((y)[i].s), acc)

// Two blocks' exact sums (of 8 int32 lanes each) with one reduction.
static inline void hsum2_i32x8(__m256i a, __m256i b, int32_t * sa, int32_t * sb) {
    const __m256i h = _mm256_hadd_epi32(a, b);  // a01 a23 b01 b23 | a45 a67 b45 b67
    __m128i r = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    r = _mm_hadd_epi32(r, r);                   // a b a b
    *sa = _mm_cvtsi128_si32(r), *sb = _mm_extract_epi32(r, 1);
}

// Blocks two at a time, their sums reduced together; each token's float
// steps block by block in order.
#define DOT32(SET, T, NT)                                                                     \
    static void dot_##T##_##SET##_##NT(int64_t n, const void * w, const void * a,             \
                                       size_t a_stride, float * out) {                      \
        const block_##T * x = w;                                                            \
        const DOT32_ACT_##T * y[NT];                                                        \
        float acc[NT];                                                                      \
        for (int t = 0; t < NT; t++) {                                                      \
            y[t] = (const DOT32_ACT_##T *) ((const uint8_t *) a + (size_t) t * a_stride);   \
            acc[t] = 0.0f;                                                                  \
        }                                                                                   \
        const int64_t nb = n / QK;                                                          \
        int64_t i = 0;                                                                      \
        for (; i + 1 < nb; i += 2) {                                                        \
            const w8 q0 = unpack_##T(x + i), q1 = unpack_##T(x + i + 1);                    \
            const float d0 = h2f(x[i].d), d1 = h2f(x[i + 1].d);                             \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                          \
                int32_t s0, s1;                                                             \
                hsum2_i32x8(DOT32_PROD_##T(SET, q0, y[t][i].qs), DOT32_PROD_##T(SET, q1, y[t][i + 1].qs), &s0, &s1); \
                acc[t] = fmaf(d0 * h2f(y[t][i].d), (float) s0, acc[t]);                     \
                acc[t] = DOT32_MIN_##T(acc[t], x, y[t], i);                                 \
                acc[t] = fmaf(d1 * h2f(y[t][i + 1].d), (float) s1, acc[t]);                 \
                acc[t] = DOT32_MIN_##T(acc[t], x, y[t], i + 1);                             \
            }                                                                               \
        }                                                                                   \
        if (i < nb) {                                                                       \
            const w8 q = unpack_##T(x + i);                                                 \
            const float d = h2f(x[i].d);                                                    \
            for (int t = 0; t < NT; t++) {                                                  \
                const int32_t s = hsum_i32x8(DOT32_PROD_##T(SET, q, y[t][i].qs));           \
                acc[t] = fmaf(d * h2f(y[t][i].d), (float) s, acc[t]);                       \
                acc[t] = DOT32_MIN_##T(acc[t], x, y[t], i);                                 \
            }                                                                               \
        }                                                                                   \
        for (int t = 0; t < NT; t++) out[t] = acc[t];                                       \
    }

/* ---- Q4_K, Q5_K ----------------------------------------------------------- */

// Chunk j (64 elements: two sub-blocks of 32 sharing 32 bytes of nibbles)
// as u8 values: lo = sub-block 2j, hi = sub-block 2j + 1.
typedef struct { __m256i lo, hi; } k4_chunk;

static inline k4_chunk unpack_q4_K(const block_q4_K * x, int j, __m256i hbits) {
    (void) hbits;
    const __m256i bits = load256(x->qs + 32 * j);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    return (k4_chunk) {_mm256_and_si256(bits, m4), _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4)};
}
static inline k4_chunk unpack_q5_K(const block_q5_K * x, int j, __m256i hbits) {
    const __m256i bits = load256(x->qs + 32 * j);
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    // Bit 2j (2j+1) of each qh byte, moved to bit 4; 16-bit shifts are fine
    // since the AND keeps only each byte's own bit.
    const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j), one), 4);
    const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j + 1), one), 4);
    return (k4_chunk) {_mm256_or_si256(_mm256_and_si256(bits, m4), h0),
                       _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4), h1)};
}
static inline __m256i qh_q4_K(const block_q4_K * x) { (void) x; return _mm256_setzero_si256(); }
static inline __m256i qh_q5_K(const block_q5_K * x) { return load256(x->qh); }

// A super-block's scales, prepared once for all tokens in the layout the
// set's token step (SET##_k4_token) reads.
typedef struct {
    __m256i s[8];   // AVX2: s[0..1] in DUP16 order; VNNI: sub-block k's scale in every int16
    __m256i mins;   // (m0, m0, m1, m1, .., m7, m7) as int16, one per bsums group
} k4_scales;

// Q4_K / Q5_K for NT tokens: per super-block the set's exact sums of scale
// q y (sumi) and of min times the group sums (summ), then the float steps.
#define DOT_K4(SET, T, NT)                                                                    \
    static void dot_##T##_##SET##_##NT(int64_t n, const void * w, const void * a,             \
                                       size_t a_stride, float * out) {                      \
        const block_##T *  x = w;                                                           \
        const block_q8_K * y[NT];                                                           \
        float acc[NT];                                                                      \
        for (int t = 0; t < NT; t++) {                                                      \
            y[t] = (const block_q8_K *) ((const uint8_t *) a + (size_t) t * a_stride);      \
            acc[t] = 0.0f;                                                                  \
        }                                                                                   \
        for (int64_t i = 0; i < n / QK_K; i++) {                                            \
            uint8_t sc[8], m[8];                                                            \
            unpack_scales_k4(x[i].scales, sc, m);                                           \
            const k4_scales k = SET##_k4_scales(sc, m);                                     \
            const __m256i hbits = qh_##T(x + i);                                            \
            __m256i q[8];  /* sub-blocks 0..7 as u8, unpacked once for all tokens */        \
            for (int j = 0; j < 4; j++) {                                                   \
                const k4_chunk c = unpack_##T(x + i, j, hbits);                             \
                q[2 * j] = c.lo, q[2 * j + 1] = c.hi;                                       \
            }                                                                               \
            const float d = h2f(x[i].d), dmin = h2f(x[i].dmin);                             \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                          \
                const __m256i mins = _mm256_madd_epi16(load256(y[t][i].bsums), k.mins);     \
                acc[t] = k_step(acc[t], d, dmin, y[t][i].d, hsum_i32x8(SET##_k4_token(q, &k, y[t] + i)), \
                                hsum_i32x8(mins));                                          \
            }                                                                               \
        }                                                                                   \
        for (int t = 0; t < NT; t++) out[t] = acc[t];                                       \
    }

/* ---- Q6_K ------------------------------------------------------------------ */

// Half h (128 elements) as u8 values 0..63, quarters k = 0..3.
typedef struct { __m256i q[4]; } q6_half_v;

static inline q6_half_v unpack_q6_K(const block_q6_K * x, int h) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    const uint8_t * ql = x->ql + 64 * h;
    const __m256i l0 = load256(ql), l1 = load256(ql + 32), hb = load256(x->qh + 32 * h);
    return (q6_half_v) {{
        _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m2), 4)),
        _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m2), 4)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m2), 4)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m2), 4)),
    }};
}

// One half's scales in the layout its set's token step reads.
typedef struct { __m256i s[4]; } q6_scales;

// Q6_K: sum sc (q - 32) y = sum sc q y - 32 sum_g sc_g bsum_g, the offset
// once per super-block from the group sums, all in one exact int32 sum.
#define DOT_Q6K(SET, T, NT)                                                                   \
    static void dot_q6_K_##SET##_##NT(int64_t n, const void * w, const void * a,              \
                                      size_t a_stride, float * out) {                       \
        const block_q6_K * x = w;                                                           \
        const block_q8_K * y[NT];                                                           \
        float acc[NT];                                                                      \
        for (int t = 0; t < NT; t++) {                                                      \
            y[t] = (const block_q8_K *) ((const uint8_t *) a + (size_t) t * a_stride);      \
            acc[t] = 0.0f;                                                                  \
        }                                                                                   \
        for (int64_t i = 0; i < n / QK_K; i++) {                                            \
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) x[i].scales)); \
            __m256i sumi[NT][2];                                                            \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                          \
                const __m256i bsums = load256(y[t][i].bsums);                               \
                sumi[t][0] = _mm256_sub_epi32(_mm256_setzero_si256(),                       \
                                              _mm256_slli_epi32(_mm256_madd_epi16(bsums, sc16), 5)); \
                sumi[t][1] = _mm256_setzero_si256();                                        \
            }                                                                               \
            for (int h = 0; h < 2; h++) {                                                   \
                const q6_half_v q = unpack_q6_K(x + i, h);                                  \
                const q6_scales s = SET##_q6_scales(x + i, h, sc16);                        \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++)                        \
                    SET##_q6_token(sumi[t], &q, &s, y[t][i].qs + 128 * h);                  \
            }                                                                               \
            const float d = h2f(x[i].d);                                                    \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++)                            \
                acc[t] = fmaf(d * y[t][i].d, (float) hsum_i32x8(_mm256_add_epi32(sumi[t][0], sumi[t][1])), acc[t]); \
        }                                                                                   \
        for (int t = 0; t < NT; t++) out[t] = acc[t];                                       \
    }

// Every quantized type's unpacked kernels of a set (its primitives defined
// before), for NT = 1..MAX_NT, with their tables.
#define UNPACKED_KERNELS(SET)                                                                 \
    EACH_NT2(DOT32, SET, q4_0) NT_TABLE_SET(q4_0, SET)                                        \
    EACH_NT2(DOT32, SET, q5_0) NT_TABLE_SET(q5_0, SET)                                        \
    EACH_NT2(DOT32, SET, q8_0) NT_TABLE_SET(q8_0, SET)                                        \
    EACH_NT2(DOT32, SET, q4_1) NT_TABLE_SET(q4_1, SET)                                        \
    EACH_NT2(DOT32, SET, q5_1) NT_TABLE_SET(q5_1, SET)                                        \
    EACH_NT2(DOT_K4, SET, q4_K) NT_TABLE_SET(q4_K, SET)                                       \
    EACH_NT2(DOT_K4, SET, q5_K) NT_TABLE_SET(q5_K, SET)                                       \
    EACH_NT2(DOT_Q6K, SET, q6_K) NT_TABLE_SET(q6_K, SET)

/* ---- tile kernels over the repacked layouts -------------------------------- */

// A tile is one group of 8 rows times T tokens (T <= the set's TILE_T,
// a compile-time constant once the body is inlined into its T-specific
// function): per super-block, for each sub-block, the set's integer step
// (SET##_sb_step: four elements of all 8 rows against one broadcast of the
// four activation bytes at p, one int32 lane per row) over its 8 groups of four,
// then its scale (SET##_sb_scale, once per sub-block); the mins from the
// activation's group sums (SET##_mins); then kernels.h's float steps with
// each lane one row's accumulator. A weight vector serves T tokens, an
// activation broadcast 8 rows.
#define ALWAYS_INLINE inline __attribute__((always_inline))

static ALWAYS_INLINE __m256i bcast4(const int8_t * p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// Weights stream from memory while a tile computes: each super-block's
// tile prefetches into L2 the block PREFETCH_AHEAD bytes further on (the
// next group's, past a group's end); a 32-element block the next group's
// same block (the groups take turns over Q32_CHUNK blocks). Measured
// single-threaded on Zen 4, weights in memory, against the hardware
// prefetchers alone: Q5_K's and Q6_K's 1-token tiles (two interleaved
// streams: qs and qh, ql and qh) took half as long, Q4_K's and the 32-element
// types' 8-token tiles 20-50% less; into L1 it cost Q4_K's 1-token tiles
// 60%, and the 32-element types' 1- and 2-token tiles lose a little.
#define PREFETCH_AHEAD 16384
static ALWAYS_INLINE void prefetch_block(const void * p, size_t bytes) {
    for (size_t at = 0; at < bytes; at += 64) _mm_prefetch((const char *) p + at, _MM_HINT_T1);
}

// The per-token float steps of a super-block for 8 rows at once.
static ALWAYS_INLINE __m256 k_step8(__m256 acc, __m256 d, __m256 dmin, float yd, __m256i sumi, __m256i summ) {
    const __m256 ydv = _mm256_set1_ps(yd);
    acc = _mm256_fmadd_ps(_mm256_mul_ps(d, ydv), _mm256_cvtepi32_ps(sumi), acc);
    return _mm256_fnmadd_ps(_mm256_mul_ps(dmin, ydv), _mm256_cvtepi32_ps(summ), acc);
}

// Q4_K / Q5_K mins: sum over sub-blocks of min * (its two group sums), per
// row: m16[k] holds rows' (m_2k, m_2k+1) as int16 pairs.
static ALWAYS_INLINE __m128i pair_sums(const int16_t * bsums) {
    const __m256i b = load256(bsums);
    return _mm_hadd_epi16(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
}

// Q4_K / Q5_K: chunk c's sub-blocks 2c (low nibbles) and 2c + 1 (high)
// side by side, 2 T independent chains of integer steps, scaled in stages
// of SET##_K4_STAGE_##TYPE groups (AVX2's int16 sums hold 16 terms of Q4_K,
// 8 of Q5_K). Q5_K's fifth bits: bit b of each qh byte moved to bit 4 (a
// shift of at most 4 within 16-bit lanes keeps each byte's own bit).
static ALWAYS_INLINE __m256i bit_to_4(__m256i v, int b) {
    const __m256i m = _mm256_set1_epi8(0x10);
    return _mm256_and_si256(b <= 4 ? _mm256_slli_epi16(v, 4 - b) : _mm256_srli_epi16(v, b - 4), m);
}
#define K4_PART_q4_K(b) (b)
#define K4_PART_q5_K(b) (&(b)->k4)
#define K4_FIFTH_q4_K(b, c, g, wl, wh) (void) 0
#define K4_FIFTH_q5_K(b, c, g, wl, wh)                                                          \
    do {                                                                                        \
        const __m256i qh = load256((b)->qh[g]);                                                 \
        wl = _mm256_or_si256(wl, bit_to_4(qh, 2 * (c)));                                        \
        wh = _mm256_or_si256(wh, bit_to_4(qh, 2 * (c) + 1));                                    \
    } while (0)

#define K4_TILE(SET, TYPE)                                                                      \
    static ALWAYS_INLINE void SET##_tile_##TYPE##_body(int64_t nb, const block_##TYPE##x8 * x,  \
                                                       const block_q8_K * const * y, float * out, \
                                                       size_t out_stride, const int T) {       \
        const __m256i m4 = _mm256_set1_epi8(0x0F);                                            \
        __m256 acc[SET##_TILE_T];                                                             \
        for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();                             \
        for (int64_t i = 0; i < nb; i++) {                                                    \
            const block_q4_Kx8 * b = K4_PART_##TYPE(x + i);                                   \
            prefetch_block(x + i + PREFETCH_AHEAD / sizeof *x, sizeof *x);                    \
            __m256i sumi[SET##_TILE_T];                                                       \
            for (int t = 0; t < T; t++) sumi[t] = _mm256_setzero_si256();                     \
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {                             \
                const __m256i sl = SET##_sb_scales(b->scales[2 * c]);                         \
                const __m256i sh = SET##_sb_scales(b->scales[2 * c + 1]);                     \
                _Pragma("GCC unroll 8") for (int g0 = 0; g0 < 8; g0 += SET##_K4_STAGE_##TYPE) { \
                    __m256i lo[SET##_TILE_T], hi[SET##_TILE_T];                               \
                    for (int t = 0; t < T; t++) lo[t] = hi[t] = _mm256_setzero_si256();       \
                    _Pragma("GCC unroll 8") for (int g = g0; g < g0 + SET##_K4_STAGE_##TYPE; g++) { \
                        const __m256i raw = load256(b->qs[c][g]);                             \
                        __m256i wl = _mm256_and_si256(raw, m4);                               \
                        __m256i wh = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);         \
                        K4_FIFTH_##TYPE(x + i, c, g, wl, wh);                                 \
                        for (int t = 0; t < T; t++) {                                         \
                            lo[t] = SET##_sb_step(lo[t], wl, y[t][i].qs + 64 * c + 4 * g);        \
                            hi[t] = SET##_sb_step(hi[t], wh, y[t][i].qs + 64 * c + 32 + 4 * g);        \
                        }                                                                     \
                    }                                                                         \
                    for (int t = 0; t < T; t++)                                               \
                        sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(SET##_sb_scale(lo[t], sl), \
                                                                             SET##_sb_scale(hi[t], sh))); \
                }                                                                             \
            }                                                                                 \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) b->d));        \
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) b->dmin));  \
            __m256i m16[4];                                                                   \
            for (int k = 0; k < 4; k++) m16[k] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *) b->mins[k])); \
            for (int t = 0; t < T; t++) {                                                     \
                const __m128i bp = pair_sums(y[t][i].bsums);                                  \
                __m256i summ = _mm256_setzero_si256();                                        \
                summ = SET##_mins(summ, m16[0], _mm256_broadcastd_epi32(bp));                 \
                summ = SET##_mins(summ, m16[1], _mm256_broadcastd_epi32(_mm_srli_si128(bp, 4))); \
                summ = SET##_mins(summ, m16[2], _mm256_broadcastd_epi32(_mm_srli_si128(bp, 8))); \
                summ = SET##_mins(summ, m16[3], _mm256_broadcastd_epi32(_mm_srli_si128(bp, 12))); \
                acc[t] = k_step8(acc[t], d, dmin, y[t][i].d, sumi[t], summ);                  \
            }                                                                                 \
        }                                                                                     \
        for (int t = 0; t < T; t++) _mm256_storeu_ps(out + (size_t) t * out_stride, acc[t]);  \
    }

// Q6_K: quarter k of half h is sub-blocks 8h + 2k (groups 0..3) and
// 8h + 2k + 1 (groups 4..7) of 16 elements; its values 0..63 take the
// nibble of ql and two bits of qh moved to bits 4..5 (left shifts of at
// most 4 and a right one of 2 within 16-bit lanes keep each byte's own
// bits). A sub-block's groups are scaled in stages of SET##_Q6_STAGE
// (AVX2's int16 sums hold two groups of 63 * 127 terms). The offset of 32
// comes off the exact sum as 32 * sum of scale times group sum (scales as
// int16 pairs of sub-blocks 2m, 2m + 1 against the pair of group sums).
static ALWAYS_INLINE __m256i q6_high_bits(__m256i qh, int k) {
    const __m256i m = _mm256_set1_epi8(0x30);
    switch (k) {
    case 0:  return _mm256_and_si256(_mm256_slli_epi16(qh, 4), m);
    case 1:  return _mm256_and_si256(_mm256_slli_epi16(qh, 2), m);
    case 2:  return _mm256_and_si256(qh, m);
    default: return _mm256_and_si256(_mm256_srli_epi16(qh, 2), m);
    }
}

// Group g of quarter k of half h, values 0..63 for the 8 rows.
static ALWAYS_INLINE __m256i q6_weights(const block_q6_Kx8 * b, int h, int k, int g, __m256i m4) {
    const __m256i lq = load256(b->ql[h][k & 1][g]);
    const __m256i lo = _mm256_and_si256(k < 2 ? lq : _mm256_srli_epi16(lq, 4), m4);
    return _mm256_or_si256(lo, q6_high_bits(load256(b->qh[h][g]), k));
}

#define Q6_TILE(SET)                                                                            \
    static ALWAYS_INLINE void SET##_tile_q6_K_body(int64_t nb, const block_q6_Kx8 * x,          \
                                                   const block_q8_K * const * y, float * out,  \
                                                   size_t out_stride, const int T) {           \
        const __m256i m4 = _mm256_set1_epi8(0x0F);                                            \
        __m256 acc[SET##_TILE_T];                                                             \
        for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();                             \
        for (int64_t i = 0; i < nb; i++) {                                                    \
            const block_q6_Kx8 * b = x + i;                                                   \
            prefetch_block(x + i + PREFETCH_AHEAD / sizeof *x, sizeof *x);                    \
            __m256i sumi[SET##_TILE_T];                                                       \
            for (int t = 0; t < T; t++) sumi[t] = _mm256_setzero_si256();                     \
            /* Quarter q = 4 h + k: sub-blocks 2q (groups 0..3) and 2q + 1 (4..7) side by    \
               side, in stages of SET##_Q6_STAGE groups. */                                   \
            _Pragma("GCC unroll 8") for (int q = 0; q < 8; q++) {                             \
                const int h = q / 4, k = q % 4;                                               \
                const __m256i sa = SET##_sb_scales_s8(b->scales[2 * q]);                      \
                const __m256i sz = SET##_sb_scales_s8(b->scales[2 * q + 1]);                  \
                _Pragma("GCC unroll 4") for (int g0 = 0; g0 < 4; g0 += SET##_Q6_STAGE) {      \
                    __m256i ea[SET##_TILE_T], ez[SET##_TILE_T];                               \
                    for (int t = 0; t < T; t++) ea[t] = ez[t] = _mm256_setzero_si256();       \
                    _Pragma("GCC unroll 4") for (int g = g0; g < g0 + SET##_Q6_STAGE; g++) {  \
                        const __m256i wa = q6_weights(b, h, k, g, m4), wz = q6_weights(b, h, k, g + 4, m4); \
                        for (int t = 0; t < T; t++) {                                         \
                            ea[t] = SET##_sb_step(ea[t], wa, y[t][i].qs + 32 * q + 4 * g);        \
                            ez[t] = SET##_sb_step(ez[t], wz, y[t][i].qs + 32 * q + 16 + 4 * g);        \
                        }                                                                     \
                    }                                                                         \
                    for (int t = 0; t < T; t++)                                               \
                        sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(SET##_sb_scale(ea[t], sa), \
                                                                             SET##_sb_scale(ez[t], sz))); \
                }                                                                             \
            }                                                                                 \
            __m256i sp[8];  /* rows' (scale 2m, scale 2m + 1) as int16 pairs */               \
            for (int m = 0; m < 8; m++) {                                                     \
                const __m128i pair = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *) b->scales[2 * m]), \
                                                       _mm_loadl_epi64((const __m128i *) b->scales[2 * m + 1])); \
                sp[m] = _mm256_cvtepi8_epi16(pair);                                           \
            }                                                                                 \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) b->d));        \
            for (int t = 0; t < T; t++) {                                                     \
                __m256i off = _mm256_setzero_si256();                                         \
                for (int m = 0; m < 8; m++) {                                                 \
                    int32_t bs;                                                               \
                    memcpy(&bs, y[t][i].bsums + 2 * m, 4);                                    \
                    off = SET##_mins(off, sp[m], _mm256_set1_epi32(bs));                      \
                }                                                                             \
                const __m256i exact = _mm256_sub_epi32(sumi[t], _mm256_slli_epi32(off, 5));   \
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(y[t][i].d)),          \
                                         _mm256_cvtepi32_ps(exact), acc[t]);                  \
            }                                                                                 \
        }                                                                                     \
        for (int t = 0; t < T; t++) _mm256_storeu_ps(out + (size_t) t * out_stride, acc[t]);  \
    }

// The 32-element quants: per block, four groups of the 8 rows' elements
// 0..15 (lo) and 16..31 (hi) side by side, both chains widened to int32
// (SET##_sb_widen) and added to the block's offset: the activation block's
// exact sum times -8 (Q4_0), -16 (Q5_0) or -128 (Q8_0, stored plus 128), so
// the unsigned weights give the signed types' exact sums. Per token and
// block the offset and the activation's d (and Q8_1's s) are prepared once
// per call for Q32_CHUNK blocks at a time, for all the groups.
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
#define Q32_MIN_q4_0(acc, b, sy) (acc)
#define Q32_MIN_q5_0(acc, b, sy) (acc)
#define Q32_MIN_q8_0(acc, b, sy) (acc)
#define Q32_MIN_q4_1(acc, b, sy) _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (b)->m)), _mm256_set1_ps(sy), acc)
#define Q32_MIN_q5_1(acc, b, sy) Q32_MIN_q4_1(acc, b, sy)

// Sum of 32 signed bytes, exact.
static ALWAYS_INLINE int32_t sum_i8x32(const int8_t * p) {
    const __m256i u = _mm256_xor_si256(load256(p), _mm256_set1_epi8((char) 0x80));  // q + 128
    const __m256i s = _mm256_sad_epu8(u, _mm256_setzero_si256());
    const __m128i h = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    return (int32_t) (_mm_cvtsi128_si64(h) + _mm_extract_epi64(h, 1)) - 32 * 128;
}

// Group g's weights, elements 4g .. 4g + 3 (lo) and 16 + 4g .. (hi), as u8.
static ALWAYS_INLINE void q32_nibbles(const uint8_t qs[8][4], __m256i * lo, __m256i * hi) {
    const __m256i raw = load256(qs), m4 = _mm256_set1_epi8(0x0F);
    *lo = _mm256_and_si256(raw, m4), *hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
}
// Fifth bits of the rows' elements 4g + b .. (bits 4g + b of each row's
// 32-bit qh, byte g / 2 (+ 2 for hi)) moved to bit 4 of byte b.
static ALWAYS_INLINE __m256i q5_fifth(__m256i qh, int byte, int g) {
    const __m256i lanes = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
                                           0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
    const __m256i rep = _mm256_shuffle_epi8(qh, _mm256_add_epi8(lanes, _mm256_set1_epi8((char) byte)));
    const __m256i bits = _mm256_set1_epi32(g % 2 ? (int) 0x80402010 : 0x08040201);  // byte b: bit b (+ 4)
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(rep, bits), bits), _mm256_set1_epi8(0x10));
}
#define Q32_UNPACK_q4_0(b, g, lo, hi) q32_nibbles((b)->qs[g], &lo, &hi)
#define Q32_UNPACK_q4_1(b, g, lo, hi) q32_nibbles((b)->qs[g], &lo, &hi)
#define Q32_UNPACK_q5_0(b, g, lo, hi)                                                           \
    do {                                                                                        \
        const __m256i qh = load256((b)->qh);                                                    \
        q32_nibbles((b)->qs[g], &lo, &hi);                                                      \
        lo = _mm256_or_si256(lo, q5_fifth(qh, (g) / 2, g));                                     \
        hi = _mm256_or_si256(hi, q5_fifth(qh, 2 + (g) / 2, g));                                 \
    } while (0)
#define Q32_UNPACK_q5_1(b, g, lo, hi) Q32_UNPACK_q5_0(b, g, lo, hi)
#define Q32_UNPACK_q8_0(b, g, lo, hi) (lo = load256((b)->qs[g]), hi = load256((b)->qs[(g) + 4]))

#define Q32_TILE(SET, TYPE)                                                                     \
    static ALWAYS_INLINE void SET##_tile_##TYPE##_body(int64_t nb, int64_t i0, int64_t i1, const block_##TYPE##x8 * x, \
                                                       const DOT32_ACT_##TYPE * const * y,      \
                                                       const q32_prep (*prep)[Q32_CHUNK], float * out, \
                                                       size_t out_stride, const int T) {       \
        __m256 acc[SET##_TILE_T];                                                             \
        for (int t = 0; t < T; t++)                                                           \
            acc[t] = i0 ? _mm256_loadu_ps(out + (size_t) t * out_stride) : _mm256_setzero_ps(); \
        for (int64_t i = i0; i < i1; i++) {                                                   \
            const block_##TYPE##x8 * b = x + i;                                               \
            if (T > 2) prefetch_block(x + nb + i, sizeof *x);  /* the next group's (Q32_CHUNK) */ \
            __m256i lo[SET##_TILE_T], hi[SET##_TILE_T];                                       \
            for (int t = 0; t < T; t++) lo[t] = hi[t] = _mm256_setzero_si256();               \
            _Pragma("GCC unroll 4") for (int g = 0; g < 4; g++) {                             \
                __m256i wl, wh;                                                               \
                Q32_UNPACK_##TYPE(b, g, wl, wh);                                              \
                for (int t = 0; t < T; t++) {                                                 \
                    lo[t] = SET##_sb_step(lo[t], wl, y[t][i].qs + 4 * g);                    \
                    hi[t] = SET##_sb_step(hi[t], wh, y[t][i].qs + 16 + 4 * g);               \
                }                                                                             \
            }                                                                                 \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) b->d));        \
            for (int t = 0; t < T; t++) {                                                     \
                const q32_prep * p = &prep[t][i - i0];                                        \
                const __m256i sumi = _mm256_add_epi32(_mm256_set1_epi32(p->off),              \
                                                      _mm256_add_epi32(SET##_sb_widen(lo[t]), SET##_sb_widen(hi[t]))); \
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(p->dy)), _mm256_cvtepi32_ps(sumi), acc[t]); \
                acc[t] = Q32_MIN_##TYPE(acc[t], b, p->sy);                                    \
            }                                                                                 \
        }                                                                                     \
        for (int t = 0; t < T; t++) _mm256_storeu_ps(out + (size_t) t * out_stride, acc[t]);  \
    }                                                                                         \
    EACH_TILE_T_##SET(Q32_T_FN, SET, TYPE)                                                    \
    static void SET##_tile_##TYPE(int64_t n, const void * wp, int64_t n_groups, const void * a, \
                                  size_t a_stride, int32_t nt, float * y, size_t y_stride) {   \
        static void (*const by_t[SET##_TILE_T])(int64_t, int64_t, int64_t, const block_##TYPE##x8 *, \
                                                const DOT32_ACT_##TYPE * const *,              \
                                                const q32_prep (*)[Q32_CHUNK], float *, size_t) = { \
            EACH_TILE_T_##SET(TILE_T_NAME, SET, TYPE)};                                       \
        const int64_t nb = n / QK;                                                            \
        q32_prep prep[SET##_TILE_T][Q32_CHUNK];                                               \
        for (int32_t t0 = 0; t0 < nt; t0 += SET##_TILE_T) {                                   \
            const int32_t tn = nt - t0 < SET##_TILE_T ? nt - t0 : SET##_TILE_T;               \
            const DOT32_ACT_##TYPE * yt[SET##_TILE_T];                                        \
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
                for (int64_t g = 0; g < n_groups; g++)                                        \
                    by_t[tn - 1](nb, i0, i1, (const block_##TYPE##x8 *) wp + g * nb, yt, prep, \
                                 y + (size_t) t0 * y_stride + (size_t) (ES_GROUP_ROWS * g), y_stride); \
            }                                                                                 \
        }                                                                                     \
    }
#define Q32_T_FN(SET, TYPE, T)                                                                  \
    static void SET##_tile_##TYPE##_##T(int64_t nb, int64_t i0, int64_t i1, const block_##TYPE##x8 * x, \
                                        const DOT32_ACT_##TYPE * const * y,                     \
                                        const q32_prep (*prep)[Q32_CHUNK], float * out, size_t out_stride) { \
        SET##_tile_##TYPE##_body(nb, i0, i1, x, y, prep, out, out_stride, T);                   \
    }

// A type's tile_fn from its body: groups in turn, each with its tokens in
// tiles of TILE_T (and the remainder), the body specialized for each T.
#define TILE_T_FN(SET, TYPE, T)                                                                 \
    static void SET##_tile_##TYPE##_##T(int64_t nb, const void * x, const block_q8_K * const * y, \
                                        float * out, size_t out_stride) {                       \
        SET##_tile_##TYPE##_body(nb, x, y, out, out_stride, T);                                 \
    }
#define TILE_KERNEL(SET, TYPE, BLOCK)                                                           \
    EACH_TILE_T_##SET(TILE_T_FN, SET, TYPE)                                                     \
    static void SET##_tile_##TYPE(int64_t n, const void * wp, int64_t n_groups, const void * a,  \
                                  size_t a_stride, int32_t nt, float * y, size_t y_stride) {    \
        static void (*const by_t[SET##_TILE_T])(int64_t, const void *, const block_q8_K * const *, \
                                                float *, size_t) = {                            \
            EACH_TILE_T_##SET(TILE_T_NAME, SET, TYPE)};                                         \
        const int64_t nb = n / QK_K;                                                            \
        for (int64_t g = 0; g < n_groups; g++) {                                                \
            const BLOCK * x = (const BLOCK *) wp + g * nb;                                      \
            for (int32_t t0 = 0; t0 < nt; t0 += SET##_TILE_T) {                                 \
                const int32_t tn = nt - t0 < SET##_TILE_T ? nt - t0 : SET##_TILE_T;             \
                const block_q8_K * yt[SET##_TILE_T];                                            \
                for (int32_t t = 0; t < tn; t++)                                                \
                    yt[t] = (const block_q8_K *) ((const uint8_t *) a + (size_t) (t0 + t) * a_stride); \
                by_t[tn - 1](nb, x, yt, y + (size_t) t0 * y_stride + (size_t) (ES_GROUP_ROWS * g), y_stride); \
            }                                                                                   \
        }                                                                                       \
    }
#define TILE_T_NAME(SET, TYPE, T) SET##_tile_##TYPE##_##T,

#endif  // ES_X86_H
