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

#define ALWAYS_INLINE inline __attribute__((always_inline))

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

/* ---- Q8_0 rows against one activation row (attention's keys) -------------- */

// Lane r: the sum of p[r]'s 8 lanes (exact int32 sums).
static inline __m256i hsum8_i32x8(const __m256i p[8]) {
    const __m256i h01 = _mm256_hadd_epi32(p[0], p[1]), h23 = _mm256_hadd_epi32(p[2], p[3]);
    const __m256i h45 = _mm256_hadd_epi32(p[4], p[5]), h67 = _mm256_hadd_epi32(p[6], p[7]);
    // a: p0..p3's low 128-bit halves' sums, then their high halves'; b: p4..p7's
    const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// Rows 8 at a time, each in a lane: per block the 8 rows' exact sums
// reduced together, then each lane's float step of the per-token
// arithmetic (fma(d_w d_a, sumi, acc)), so every row is bit for bit
// dot_q8_0_SET's; the rows left over by it.
#define DOT_ROWS_Q8_0(SET)                                                                    \
    static void dot_rows_q8_0_##SET(int64_t n, const void * w, int64_t rows, const void * a, float * y) { \
        const block_q8_0 * x = w, * q = a;                                                  \
        const int64_t nb = n / QK;                                                          \
        int64_t r = 0;                                                                      \
        for (; r + 8 <= rows; r += 8, x += 8 * nb) {                                        \
            __m256 acc = _mm256_setzero_ps();                                               \
            for (int64_t i = 0; i < nb; i++) {                                              \
                __m256i p[8];                                                               \
                float d[8];  /* scalar loads: a gather costs more here */                   \
                for (int k = 0; k < 8; k++) {                                               \
                    p[k] = PROD_SIGNED(SET, unpack_q8_0(x + k * nb + i), q[i].qs);           \
                    d[k] = h2f(x[k * nb + i].d);                                            \
                }                                                                           \
                acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(d), _mm256_set1_ps(h2f(q[i].d))), \
                                      _mm256_cvtepi32_ps(hsum8_i32x8(p)), acc);             \
            }                                                                               \
            _mm256_storeu_ps(y + r, acc);                                                   \
        }                                                                                   \
        for (; r < rows; r++, x += nb) y[r] = dot_q8_0_##SET(n, x, a);                      \
    }

// Every quantized type's unpacked kernels of a set (its primitives defined
// before), for NT = 1..MAX_NT, with their tables; Q8_0's rows kernel.
#define UNPACKED_KERNELS(SET)                                                                 \
    EACH_NT2(DOT32, SET, q4_0) NT_TABLE_SET(q4_0, SET)                                        \
    EACH_NT2(DOT32, SET, q5_0) NT_TABLE_SET(q5_0, SET)                                        \
    EACH_NT2(DOT32, SET, q8_0) NT_TABLE_SET(q8_0, SET) DOT_ROWS_Q8_0(SET)                     \
    EACH_NT2(DOT32, SET, q4_1) NT_TABLE_SET(q4_1, SET)                                        \
    EACH_NT2(DOT32, SET, q5_1) NT_TABLE_SET(q5_1, SET)                                        \
    EACH_NT2(DOT_K4, SET, q4_K) NT_TABLE_SET(q4_K, SET)                                       \
    EACH_NT2(DOT_K4, SET, q5_K) NT_TABLE_SET(q5_K, SET)                                       \
    EACH_NT2(DOT_Q6K, SET, q6_K) NT_TABLE_SET(q6_K, SET)

#endif  // ES_X86_H
