/*
 * neon.c — the aarch64 NEON set (baseline there; the dot-product
 * extension's sdot when built with it, e.g. -march=armv8.2-a+dotprod). On
 * other architectures this file is empty.
 *
 * Quantized types are batched as on x86: NT activation rows against one
 * weight row for NT = 1..MAX_NT, each weight block unpacked once for all
 * tokens, and each token's result by kernels.h's per-token arithmetic.
 */
#include "kernels.h"

#if defined(__ARM_NEON) && defined(__aarch64__)

#include <arm_neon.h>
#include <stddef.h>

// sum of x[k] * y[k] over 16 signed bytes, as 4 int32 lanes.
static inline int32x4_t dot_s8x16(int8x16_t x, int8x16_t y) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(vdupq_n_s32(0), x, y);
#else
    const int16x8_t lo = vmull_s8(vget_low_s8(x), vget_low_s8(y));
    const int16x8_t hi = vmull_high_s8(x, y);
    return vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi));
#endif
}

static float dot_f32_neon(int64_t n, const void * w, const void * a) {
    const float * x = w, * y = a;
    float32x4_t acc[4] = {vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0)};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int k = 0; k < 4; k++) acc[k] = vfmaq_f32(acc[k], vld1q_f32(x + i + 4 * k), vld1q_f32(y + i + 4 * k));
    float sum = vaddvq_f32(vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3])));
    for (; i < n; i++) sum += x[i] * y[i];
    return sum;
}

static float dot_f16_neon(int64_t n, const void * w, const void * a) {
    const es_half * x = w, * y = a;
    float32x4_t acc[2] = {vdupq_n_f32(0), vdupq_n_f32(0)};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(x + i));
        const float16x8_t g = vreinterpretq_f16_u16(vld1q_u16(y + i));
        acc[0] = vfmaq_f32(acc[0], vcvt_f32_f16(vget_low_f16(h)), vcvt_f32_f16(vget_low_f16(g)));
        acc[1] = vfmaq_f32(acc[1], vcvt_high_f32_f16(h), vcvt_high_f32_f16(g));
    }
    float sum = vaddvq_f32(vaddq_f32(acc[0], acc[1]));
    for (; i < n; i++) sum += half_to_f32(x[i]) * half_to_f32(y[i]);
    return sum;
}

static float dot_bf16_neon(int64_t n, const void * w, const void * a) {
    const uint16_t * x = w, * y = a;
    float32x4_t acc[2] = {vdupq_n_f32(0), vdupq_n_f32(0)};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const uint16x8_t h = vld1q_u16(x + i), g = vld1q_u16(y + i);
        acc[0] = vfmaq_f32(acc[0], vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16)),
                           vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(g), 16)));
        acc[1] = vfmaq_f32(acc[1], vreinterpretq_f32_u32(vshll_high_n_u16(h, 16)),
                           vreinterpretq_f32_u32(vshll_high_n_u16(g, 16)));
    }
    float sum = vaddvq_f32(vaddq_f32(acc[0], acc[1]));
    for (; i < n; i++) sum += bf16_to_f32(x[i]) * bf16_to_f32(y[i]);
    return sum;
}

// The quantized types, batched as on AVX2: NT activation rows against one
// weight row for NT = 1..MAX_NT, each weight block unpacked once for all
// tokens. The integer sums are exact and each token's float operations run
// in the same order whatever NT is, so es_matmat's rows equal es_matvec's.

// A 32-element block as signed bytes: elements 0..15 and 16..31.
typedef struct { int8x16_t lo, hi; } n8;

// 16 bytes of nibbles -> low nibbles (elements 0..15), high (16..31).
static inline n8 nibbles_neon(const uint8_t * p) {
    const uint8x16_t b = vld1q_u8(p);
    return (n8) {vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(0x0F))), vreinterpretq_s8_u8(vshrq_n_u8(b, 4))};
}

// 16 bits of qh starting at bit `from` -> 16 bytes of 0x10 where set.
static inline int8x16_t q5_bits_neon(uint32_t qh, int from) {
    static const uint8_t mask[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x8_t b0 = vdup_n_u8((uint8_t) (qh >> from)), b1 = vdup_n_u8((uint8_t) (qh >> (from + 8)));
    const uint8x16_t set = vtstq_u8(vcombine_u8(b0, b1), vld1q_u8(mask));
    return vreinterpretq_s8_u8(vandq_u8(set, vdupq_n_u8(0x10)));
}

static inline n8 with_q5_bits_neon(n8 q, const uint8_t * qh_bytes) {
    uint32_t qh;
    memcpy(&qh, qh_bytes, 4);
    return (n8) {vorrq_s8(q.lo, q5_bits_neon(qh, 0)), vorrq_s8(q.hi, q5_bits_neon(qh, 16))};
}

static inline n8 minus_neon(n8 q, int8_t v) { return (n8) {vsubq_s8(q.lo, vdupq_n_s8(v)), vsubq_s8(q.hi, vdupq_n_s8(v))}; }

static inline n8 unpack_q4_0_neon(const block_q4_0 * x) { return minus_neon(nibbles_neon(x->qs), 8); }
static inline n8 unpack_q4_1_neon(const block_q4_1 * x) { return nibbles_neon(x->qs); }
static inline n8 unpack_q5_0_neon(const block_q5_0 * x) { return minus_neon(with_q5_bits_neon(nibbles_neon(x->qs), x->qh), 16); }
static inline n8 unpack_q5_1_neon(const block_q5_1 * x) { return with_q5_bits_neon(nibbles_neon(x->qs), x->qh); }
static inline n8 unpack_q8_0_neon(const block_q8_0 * x) { return (n8) {vld1q_s8(x->qs), vld1q_s8(x->qs + 16)}; }

// Block i's min step (Q4_1, Q5_1 against Q8_1: m_x s_y), or none.
#define NEON_WITH_MIN(acc, x, y, i) fmaf(half_to_f32((x)[i].m), half_to_f32((y)[i].s), acc)
#define NEON_NO_MIN(acc, x, y, i)   (acc)

#define DOT32_NEON(NAME, NT, block_t, act_t, UNPACK, MIN_STEP)                                \
    static void NAME(int64_t n, const void * w, const void * a, size_t a_stride, float * out) { \
        const block_t * x = w;                                                              \
        const act_t *   y[NT];                                                              \
        float acc[NT];                                                                      \
        for (int t = 0; t < NT; t++) {                                                      \
            y[t] = (const act_t *) ((const uint8_t *) a + (size_t) t * a_stride);           \
            acc[t] = 0.0f;                                                                  \
        }                                                                                   \
        for (int64_t i = 0; i < n / QK; i++) {                                              \
            const n8 q = UNPACK(x + i);                                                     \
            const float dx = half_to_f32(x[i].d);                                           \
            for (int t = 0; t < NT; t++) {                                                  \
                const int32_t s = vaddvq_s32(vaddq_s32(dot_s8x16(q.lo, vld1q_s8(y[t][i].qs)), \
                                                       dot_s8x16(q.hi, vld1q_s8(y[t][i].qs + 16)))); \
                acc[t] = fmaf(dx * half_to_f32(y[t][i].d), (float) s, acc[t]);              \
                acc[t] = MIN_STEP(acc[t], x, y[t], i);                                      \
            }                                                                               \
        }                                                                                   \
        for (int t = 0; t < NT; t++) out[t] = acc[t];                                       \
    }

// sum of 32 u8 weights (0..31, in two vectors) times 32 int8 activations.
static inline int32_t dot32_neon(uint8x16_t w0, uint8x16_t w1, const int8_t * q8) {
    return vaddvq_s32(vaddq_s32(dot_s8x16(vreinterpretq_s8_u8(w0), vld1q_s8(q8)),
                                dot_s8x16(vreinterpretq_s8_u8(w1), vld1q_s8(q8 + 16))));
}

static inline int k4_mins_scalar(const uint8_t m[8], const int16_t * bsums) {
    int summ = 0;
    for (int j = 0; j < 8; j++) summ += m[j] * (bsums[2 * j] + bsums[2 * j + 1]);
    return summ;
}

// Q4_K / Q5_K chunk j: sub-blocks 2j (lo) and 2j + 1 (hi), 16 bytes apiece.
typedef struct { uint8x16_t lo0, lo1, hi0, hi1; } k4_chunk_neon;

static inline k4_chunk_neon nibbles_k4_neon(const uint8_t * qs, int j) {
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    const uint8x16_t b0 = vld1q_u8(qs + 32 * j), b1 = vld1q_u8(qs + 32 * j + 16);
    return (k4_chunk_neon) {vandq_u8(b0, m4), vandq_u8(b1, m4), vshrq_n_u8(b0, 4), vshrq_n_u8(b1, 4)};
}
static inline k4_chunk_neon unpack_q4_K_neon(const block_q4_K * x, int j) { return nibbles_k4_neon(x->qs, j); }
static inline k4_chunk_neon unpack_q5_K_neon(const block_q5_K * x, int j) {
    const uint8x16_t b4 = vdupq_n_u8(0x10), h0 = vld1q_u8(x->qh), h1 = vld1q_u8(x->qh + 16);
    // Fifth bits: bit 2j of qh[l] for the low nibbles, 2j + 1 for the high.
    const uint8x16_t bl = vdupq_n_u8((uint8_t) (1u << (2 * j))), bh = vdupq_n_u8((uint8_t) (2u << (2 * j)));
    const k4_chunk_neon c = nibbles_k4_neon(x->qs, j);
    return (k4_chunk_neon) {vorrq_u8(c.lo0, vandq_u8(vtstq_u8(h0, bl), b4)), vorrq_u8(c.lo1, vandq_u8(vtstq_u8(h1, bl), b4)),
                            vorrq_u8(c.hi0, vandq_u8(vtstq_u8(h0, bh), b4)), vorrq_u8(c.hi1, vandq_u8(vtstq_u8(h1, bh), b4))};
}

#define DOT_K4_NEON(NAME, NT, T)                                                              \
    static void NAME(int64_t n, const void * w, const void * a, size_t a_stride, float * out) { \
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
            int sumi[NT];                                                                   \
            for (int t = 0; t < NT; t++) sumi[t] = 0;                                       \
            for (int j = 0; j < 4; j++) {                                                   \
                const k4_chunk_neon c = unpack_##T##_neon(x + i, j);                        \
                for (int t = 0; t < NT; t++) {                                              \
                    const int8_t * q8 = y[t][i].qs + 64 * j;                                \
                    sumi[t] += sc[2 * j] * dot32_neon(c.lo0, c.lo1, q8);                    \
                    sumi[t] += sc[2 * j + 1] * dot32_neon(c.hi0, c.hi1, q8 + 32);           \
                }                                                                           \
            }                                                                               \
            const float d = half_to_f32(x[i].d), dmin = half_to_f32(x[i].dmin);             \
            for (int t = 0; t < NT; t++)                                                    \
                acc[t] = k_step(acc[t], d, dmin, y[t][i].d, sumi[t], k4_mins_scalar(m, y[t][i].bsums)); \
        }                                                                                   \
        for (int t = 0; t < NT; t++) out[t] = acc[t];                                       \
    }

#define DOT_Q6K_NEON(NAME, NT)                                                                \
    static void NAME(int64_t n, const void * w, const void * a, size_t a_stride, float * out) { \
        const block_q6_K * x = w;                                                           \
        const block_q8_K * y[NT];                                                           \
        float acc[NT];                                                                      \
        for (int t = 0; t < NT; t++) {                                                      \
            y[t] = (const block_q8_K *) ((const uint8_t *) a + (size_t) t * a_stride);      \
            acc[t] = 0.0f;                                                                  \
        }                                                                                   \
        const uint8x16_t m4 = vdupq_n_u8(0x0F), m2 = vdupq_n_u8(3);                         \
        const int8x16_t  o32 = vdupq_n_s8(32);                                              \
        for (int64_t i = 0; i < n / QK_K; i++) {                                            \
            int sumi[NT];                                                                   \
            for (int t = 0; t < NT; t++) sumi[t] = 0;                                       \
            for (int h = 0; h < 2; h++) {                                                   \
                const uint8_t * ql = x[i].ql + 64 * h;                                      \
                const uint8_t * qh = x[i].qh + 32 * h;                                      \
                const int8_t *  sc = x[i].scales + 8 * h;                                   \
                for (int l = 0; l < 32; l += 16) { /* groups of 16: scale 2k + l / 16 */    \
                    const uint8x16_t a0 = vld1q_u8(ql + l), a1 = vld1q_u8(ql + 32 + l), hb = vld1q_u8(qh + l); \
                    const int8x16_t v[4] = {                                                \
                        vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(vandq_u8(a0, m4), vshlq_n_u8(vandq_u8(hb, m2), 4))), o32), \
                        vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(vandq_u8(a1, m4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 2), m2), 4))), o32), \
                        vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(a0, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 4), m2), 4))), o32), \
                        vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(a1, 4), vshlq_n_u8(vshrq_n_u8(hb, 6), 4))), o32), \
                    };                                                                      \
                    for (int t = 0; t < NT; t++) {                                          \
                        const int8_t * q8 = y[t][i].qs + 128 * h;                           \
                        for (int k = 0; k < 4; k++)                                         \
                            sumi[t] += sc[2 * k + l / 16] * vaddvq_s32(dot_s8x16(v[k], vld1q_s8(q8 + 32 * k + l))); \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
            const float d = half_to_f32(x[i].d);                                            \
            for (int t = 0; t < NT; t++) acc[t] = fmaf(d * y[t][i].d, (float) sumi[t], acc[t]); \
        }                                                                                   \
        for (int t = 0; t < NT; t++) out[t] = acc[t];                                       \
    }

#define NT_TABLE_NEON(T)                                                                      \
    static const vec_dotn_fn dotn_##T##_neon[MAX_NT] = {EACH_NT(NT_NAME, dot_##T##_neon_)};   \
    static float dot_##T##_neon(int64_t n, const void * w, const void * a) {                \
        float r;                                                                            \
        dot_##T##_neon_1(n, w, a, 0, &r);                                                   \
        return r;                                                                           \
    }
#define DOT32_NEON_NT(T, NT) DOT32_NEON(dot_##T##_neon_##NT, NT, block_##T, DOT32_ACT_##T, unpack_##T##_neon, NEON_MIN_##T)
#define NEON_MIN_q4_0 NEON_NO_MIN
#define NEON_MIN_q5_0 NEON_NO_MIN
#define NEON_MIN_q8_0 NEON_NO_MIN
#define NEON_MIN_q4_1 NEON_WITH_MIN
#define NEON_MIN_q5_1 NEON_WITH_MIN
#define DOT_K4_NEON_NT(T, NT) DOT_K4_NEON(dot_##T##_neon_##NT, NT, T)
#define DOT_Q6K_NEON_NT(T, NT) DOT_Q6K_NEON(dot_##T##_neon_##NT, NT)

EACH_NT(DOT32_NEON_NT, q4_0) NT_TABLE_NEON(q4_0)
EACH_NT(DOT32_NEON_NT, q5_0) NT_TABLE_NEON(q5_0)
EACH_NT(DOT32_NEON_NT, q8_0) NT_TABLE_NEON(q8_0)
EACH_NT(DOT32_NEON_NT, q4_1) NT_TABLE_NEON(q4_1)
EACH_NT(DOT32_NEON_NT, q5_1) NT_TABLE_NEON(q5_1)
EACH_NT(DOT_K4_NEON_NT, q4_K) NT_TABLE_NEON(q4_K)
EACH_NT(DOT_K4_NEON_NT, q5_K) NT_TABLE_NEON(q5_K)
EACH_NT(DOT_Q6K_NEON_NT, q6_K) NT_TABLE_NEON(q6_K)

// Q8_0 rows against one activation row (attention's keys): 4 rows at a
// time, each in a lane: per block the 4 rows' exact sums reduced together
// (pairwise adds), then each lane's float step of the per-token arithmetic,
// so every row is bit for bit dot_q8_0_neon's; the rows left over by it.
static void dot_rows_q8_0_neon(int64_t n, const void * w, int64_t rows, const void * a, float * y) {
    const block_q8_0 * x = w, * q = a;
    const int64_t nb = n / QK;
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4, x += 4 * nb) {
        float32x4_t acc = vdupq_n_f32(0);
        for (int64_t i = 0; i < nb; i++) {
            const int8x16_t q0 = vld1q_s8(q[i].qs), q1 = vld1q_s8(q[i].qs + 16);
            int32x4_t p[4];
            float d[4];
            for (int k = 0; k < 4; k++) {
                const block_q8_0 * b = x + k * nb + i;
                p[k] = vaddq_s32(dot_s8x16(vld1q_s8(b->qs), q0), dot_s8x16(vld1q_s8(b->qs + 16), q1));
                d[k] = half_to_f32(b->d);
            }
            const int32x4_t sums = vpaddq_s32(vpaddq_s32(p[0], p[1]), vpaddq_s32(p[2], p[3]));
            acc = vfmaq_f32(acc, vmulq_n_f32(vld1q_f32(d), half_to_f32(q[i].d)), vcvtq_f32_s32(sums));
        }
        vst1q_f32(y + r, acc);
    }
    for (; r < rows; r++, x += nb) y[r] = dot_q8_0_neon(n, x, a);
}

// es_axpy_q8_0: two blocks of columns at a time, held in registers across all rows.
static void axpy_q8_0_neon(int64_t n, int64_t rows, const float * e, const void * v, float * acc) {
    const int64_t nb = n / QK;
    for (int64_t i = 0; i < nb; i += 2) {
        const int w = nb - i < 2 ? 1 : 2;  // blocks in this group of columns
        float32x4_t col[16];  // acc[32 i .. 32 (i + w)), 4 values a register
        for (int k = 0; k < 8 * w; k++) col[k] = vld1q_f32(acc + QK * i + 4 * k);
        const block_q8_0 * x = (const block_q8_0 *) v + i;
        for (int64_t r = 0; r < rows; r++, x += nb) {
            if (e[r] == 0.0f) continue;
            for (int j = 0; j < w; j++) {
                const float s = e[r] * half_to_f32(x[j].d);
                for (int h = 0; h < 2; h++) {
                    const int8x16_t b = vld1q_s8(x[j].qs + 16 * h);
                    const int16x8_t lo = vmovl_s8(vget_low_s8(b)), hi = vmovl_high_s8(b);
                    const int32x4_t q[4] = {vmovl_s16(vget_low_s16(lo)), vmovl_high_s16(lo),
                                            vmovl_s16(vget_low_s16(hi)), vmovl_high_s16(hi)};
                    for (int k = 0; k < 4; k++) {
                        float32x4_t * t = &col[8 * j + 4 * h + k];
                        *t = vfmaq_n_f32(*t, vcvtq_f32_s32(q[k]), s);
                    }
                }
            }
        }
        for (int k = 0; k < 8 * w; k++) vst1q_f32(acc + QK * i + 4 * k, col[k]);
    }
}

// Q2_K / Q3_K chunk k as u8 values 0..7 (elements 0..15 and 16..31: sub-blocks
// 2k and 2k + 1), unpacked once for all tokens; per token the exact int sums
// as in the scalar kernels.
static inline n8 k16_chunk_neon(const uint8_t * qs, const uint8_t * hmask, int k) {
    const uint8_t * q = qs + 32 * (k / 4);
    const int8x16_t shift = vdupq_n_s8((int8_t) (-2 * (k % 4)));
    const uint8x16_t m3 = vdupq_n_u8(3);
    uint8x16_t lo = vandq_u8(vshlq_u8(vld1q_u8(q), shift), m3);
    uint8x16_t hi = vandq_u8(vshlq_u8(vld1q_u8(q + 16), shift), m3);
    if (hmask) {
        const uint8x16_t bit = vdupq_n_u8((uint8_t) (1u << k)), four = vdupq_n_u8(4);
        lo = vorrq_u8(lo, vandq_u8(vtstq_u8(vld1q_u8(hmask), bit), four));
        hi = vorrq_u8(hi, vandq_u8(vtstq_u8(vld1q_u8(hmask + 16), bit), four));
    }
    return (n8) {vreinterpretq_s8_u8(lo), vreinterpretq_s8_u8(hi)};
}

#define K16_HMASK_q2_K(x) NULL
#define K16_HMASK_q3_K(x) ((x).hmask)

#define DOT_K16_NEON(NAME, NT, T)                                                             \
    static void NAME(int64_t n, const void * w, const void * a, size_t a_stride, float * out) { \
        const block_##T *  x = w;                                                           \
        const block_q8_K * y[NT];                                                           \
        float acc[NT];                                                                      \
        for (int t = 0; t < NT; t++) {                                                      \
            y[t] = (const block_q8_K *) ((const uint8_t *) a + (size_t) t * a_stride);      \
            acc[t] = 0.0f;                                                                  \
        }                                                                                   \
        for (int64_t i = 0; i < n / QK_K; i++) {                                            \
            int16_t s[16], m[16];                                                           \
            k16_scales_##T(x + i, s, m);                                               \
            int sumi[NT], summ[NT];                                                         \
            for (int t = 0; t < NT; t++) {                                                  \
                sumi[t] = summ[t] = 0;                                                      \
                for (int j = 0; j < 16; j++) summ[t] += m[j] * y[t][i].bsums[j];            \
            }                                                                               \
            for (int k = 0; k < 8; k++) {                                                   \
                const n8 c = k16_chunk_neon(x[i].qs, K16_HMASK_##T(x[i]), k);               \
                for (int t = 0; t < NT; t++) {                                              \
                    const int8_t * q8 = y[t][i].qs + 32 * k;                                \
                    sumi[t] += s[2 * k] * vaddvq_s32(dot_s8x16(c.lo, vld1q_s8(q8)));        \
                    sumi[t] += s[2 * k + 1] * vaddvq_s32(dot_s8x16(c.hi, vld1q_s8(q8 + 16))); \
                }                                                                           \
            }                                                                               \
            for (int t = 0; t < NT; t++)                                                    \
                acc[t] = K16_STEP_NEON_##T(acc[t], x[i], y[t][i].d, sumi[t], summ[t]);      \
        }                                                                                   \
        for (int t = 0; t < NT; t++) out[t] = acc[t];                                       \
    }

// The float steps: Q2_K's mins are summ, times dmin; Q3_K's offset goes
// into sumi.
#define K16_STEP_NEON_q2_K(acc, xb, yd, sumi, summ) \
    k_step(acc, half_to_f32((xb).d), half_to_f32((xb).dmin), yd, sumi, summ)
#define K16_STEP_NEON_q3_K(acc, xb, yd, sumi, summ) fmaf(half_to_f32((xb).d) * (yd), (float) ((sumi) - (summ)), acc)
#define DOT_K16_NEON_NT(T, NT) DOT_K16_NEON(dot_##T##_neon_##NT, NT, T)

EACH_NT(DOT_K16_NEON_NT, q2_K) NT_TABLE_NEON(q2_K)
EACH_NT(DOT_K16_NEON_NT, q3_K) NT_TABLE_NEON(q3_K)

/* ---- tile kernels (the dot-product extension) --------------------------------- */

#if defined(__ARM_FEATURE_DOTPROD)

// As on x86 (x86.h): a tile is one group of 8 rows (two int32x4: rows 0-3,
// 4-7) times T tokens. sdot by element takes four activation bytes from a
// lane of a loaded vector for all four rows of a half, so one load of 16
// activation bytes serves four groups; sdot multiplies signed bytes, so the
// signed types need no offset. Each row's float steps are kernels.h's.
#define NEON_TILE_T 4
#define ALWAYS_INLINE inline __attribute__((always_inline))

typedef struct { int32x4_t a, b; } i32x8;  // rows 0-3, 4-7

static ALWAYS_INLINE i32x8 zero8(void) { return (i32x8) {vdupq_n_s32(0), vdupq_n_s32(0)}; }

// The four groups of 16 activation bytes y (lanes 0..3) against the rows'
// weights w[g] (two halves each), into acc.
#define DOT4_LANES(acc, w, y)                                                                   \
    do {                                                                                        \
        acc.a = vdotq_laneq_s32(acc.a, (w)[0][0], y, 0), acc.b = vdotq_laneq_s32(acc.b, (w)[0][1], y, 0); \
        acc.a = vdotq_laneq_s32(acc.a, (w)[1][0], y, 1), acc.b = vdotq_laneq_s32(acc.b, (w)[1][1], y, 1); \
        acc.a = vdotq_laneq_s32(acc.a, (w)[2][0], y, 2), acc.b = vdotq_laneq_s32(acc.b, (w)[2][1], y, 2); \
        acc.a = vdotq_laneq_s32(acc.a, (w)[3][0], y, 3), acc.b = vdotq_laneq_s32(acc.b, (w)[3][1], y, 3); \
    } while (0)

static ALWAYS_INLINE i32x8 scale8(i32x8 sum, i32x8 acc, const int8_t sc[8], bool is_signed) {
    const int16x8_t s16 = is_signed ? vmovl_s8(vld1_s8(sc)) : vreinterpretq_s16_u16(vmovl_u8(vld1_u8((const uint8_t *) sc)));
    return (i32x8) {vmlaq_s32(sum.a, acc.a, vmovl_s16(vget_low_s16(s16))),
                    vmlaq_s32(sum.b, acc.b, vmovl_high_s16(s16))};
}

// fma(d yd, sumi, acc), then with mins fma(-(dmin yd), summ, acc), per row.
static ALWAYS_INLINE void k_step8_neon(float32x4_t acc[2], const es_half d[8], const es_half * dmin, float yd,
                                       i32x8 sumi, i32x8 summ) {
    const float16x8_t dh = vreinterpretq_f16_u16(vld1q_u16(d));
    acc[0] = vfmaq_f32(acc[0], vmulq_n_f32(vcvt_f32_f16(vget_low_f16(dh)), yd), vcvtq_f32_s32(sumi.a));
    acc[1] = vfmaq_f32(acc[1], vmulq_n_f32(vcvt_high_f32_f16(dh), yd), vcvtq_f32_s32(sumi.b));
    if (dmin) {
        const float16x8_t mh = vreinterpretq_f16_u16(vld1q_u16(dmin));
        acc[0] = vfmsq_f32(acc[0], vmulq_n_f32(vcvt_f32_f16(vget_low_f16(mh)), yd), vcvtq_f32_s32(summ.a));
        acc[1] = vfmsq_f32(acc[1], vmulq_n_f32(vcvt_high_f32_f16(mh), yd), vcvtq_f32_s32(summ.b));
    }
}

// Each row's 32 fifth bits (qh[r], 8 rows) as 0x10 in the bytes of elements
// 4g .. 4g + 3 (+ 16 for hi), each row's four bytes in its int32 lane.
static ALWAYS_INLINE int8x16_t fifth_bits(uint8x16_t qh, int byte, int g) {
    static const uint8_t pick[4][16] = {
        {0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12}, {1, 1, 1, 1, 5, 5, 5, 5, 9, 9, 9, 9, 13, 13, 13, 13},
        {2, 2, 2, 2, 6, 6, 6, 6, 10, 10, 10, 10, 14, 14, 14, 14}, {3, 3, 3, 3, 7, 7, 7, 7, 11, 11, 11, 11, 15, 15, 15, 15},
    };
    static const uint8_t bits[2][16] = {{1, 2, 4, 8, 1, 2, 4, 8, 1, 2, 4, 8, 1, 2, 4, 8},
                                        {16, 32, 64, 128, 16, 32, 64, 128, 16, 32, 64, 128, 16, 32, 64, 128}};
    const uint8x16_t rep = vqtbl1q_u8(qh, vld1q_u8(pick[byte]));
    return vreinterpretq_s8_u8(vandq_u8(vtstq_u8(rep, vld1q_u8(bits[g % 2])), vdupq_n_u8(0x10)));
}

// Q4_K / Q5_K (q5: the fifth bits after the Q4_K part).
static ALWAYS_INLINE void tile_k4_neon_body(int64_t nb, const uint8_t * x, size_t bsize, bool q5,
                                            const block_q8_K * const * y, float * out, size_t os, const int T) {
    float32x4_t acc[NEON_TILE_T][2];
    for (int t = 0; t < T; t++) acc[t][0] = acc[t][1] = vdupq_n_f32(0);
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    for (int64_t i = 0; i < nb; i++) {
        const block_q4_Kx8 * b = (const block_q4_Kx8 *) (x + (size_t) i * bsize);
        const block_q5_Kx8 * b5 = (const block_q5_Kx8 *) b;
        i32x8 sumi[NEON_TILE_T];
        for (int t = 0; t < T; t++) sumi[t] = zero8();
        for (int c = 0; c < 4; c++) {
            i32x8 lo[NEON_TILE_T], hi[NEON_TILE_T];
            for (int t = 0; t < T; t++) lo[t] = hi[t] = zero8();
            for (int g4 = 0; g4 < 8; g4 += 4) {
                int8x16_t wl[4][2], wh[4][2];
                for (int l = 0; l < 4; l++)
                    for (int h = 0; h < 2; h++) {
                        const uint8x16_t raw = vld1q_u8(b->qs[c][g4 + l][4 * h]);
                        wl[l][h] = vreinterpretq_s8_u8(vandq_u8(raw, m4));
                        wh[l][h] = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));
                        if (q5) {  // bit 2c (2c + 1) of each qh byte to bit 4
                            const uint8x16_t qh = vld1q_u8(b5->qh[g4 + l][4 * h]);
                            const uint8x16_t m = vdupq_n_u8(0x10);
                            wl[l][h] = vorrq_s8(wl[l][h], vreinterpretq_s8_u8(vandq_u8(vshlq_u8(qh, vdupq_n_s8((int8_t) (4 - 2 * c))), m)));
                            wh[l][h] = vorrq_s8(wh[l][h], vreinterpretq_s8_u8(vandq_u8(vshlq_u8(qh, vdupq_n_s8((int8_t) (3 - 2 * c))), m)));
                        }
                    }
                for (int t = 0; t < T; t++) {
                    const int8x16_t yl = vld1q_s8(y[t][i].qs + 64 * c + 4 * g4);
                    const int8x16_t yh = vld1q_s8(y[t][i].qs + 64 * c + 32 + 4 * g4);
                    DOT4_LANES(lo[t], wl, yl);
                    DOT4_LANES(hi[t], wh, yh);
                }
            }
            for (int t = 0; t < T; t++) {
                sumi[t] = scale8(sumi[t], lo[t], (const int8_t *) b->scales[2 * c], false);
                sumi[t] = scale8(sumi[t], hi[t], (const int8_t *) b->scales[2 * c + 1], false);
            }
        }
        int16x8_t m16[8];  // sub-block j's min for the 8 rows
        for (int k = 0; k < 4; k++) {
            const uint8x8x2_t mm = vld2_u8(b->mins[k][0]);
            m16[2 * k] = vreinterpretq_s16_u16(vmovl_u8(mm.val[0]));
            m16[2 * k + 1] = vreinterpretq_s16_u16(vmovl_u8(mm.val[1]));
        }
        for (int t = 0; t < T; t++) {
            i32x8 summ = zero8();
            for (int j = 0; j < 8; j++) {
                const int16_t bp = (int16_t) (y[t][i].bsums[2 * j] + y[t][i].bsums[2 * j + 1]);
                summ.a = vmlal_n_s16(summ.a, vget_low_s16(m16[j]), bp);
                summ.b = vmlal_high_n_s16(summ.b, m16[j], bp);
            }
            k_step8_neon(acc[t], b->d, b->dmin, y[t][i].d, sumi[t], summ);
        }
    }
    for (int t = 0; t < T; t++) vst1q_f32(out + (size_t) t * os, acc[t][0]), vst1q_f32(out + (size_t) t * os + 4, acc[t][1]);
}

// Q6_K: quarter q = 4h + k, sub-blocks 2q (groups 0..3) and 2q + 1 (4..7);
// values q - 32 as signed bytes.
static ALWAYS_INLINE void tile_q6_K_neon_body(int64_t nb, const uint8_t * x, size_t bsize, bool q5,
                                              const block_q8_K * const * y, float * out, size_t os, const int T) {
    (void) bsize, (void) q5;
    float32x4_t acc[NEON_TILE_T][2];
    for (int t = 0; t < T; t++) acc[t][0] = acc[t][1] = vdupq_n_f32(0);
    const uint8x16_t m4 = vdupq_n_u8(0x0F), m2 = vdupq_n_u8(3);
    for (int64_t i = 0; i < nb; i++) {
        const block_q6_Kx8 * b = (const block_q6_Kx8 *) x + i;
        i32x8 sumi[NEON_TILE_T];
        for (int t = 0; t < T; t++) sumi[t] = zero8();
        for (int q = 0; q < 8; q++) {
            const int h = q / 4, k = q % 4;
            for (int half = 0; half < 2; half++) {  // sub-block 2q + half: groups 4 half .. + 3
                int8x16_t w[4][2];
                for (int l = 0; l < 4; l++)
                    for (int r = 0; r < 2; r++) {
                        const int g = 4 * half + l;
                        const uint8x16_t lq = vld1q_u8(b->ql[h][k & 1][g][4 * r]), hq = vld1q_u8(b->qh[h][g][4 * r]);
                        const uint8x16_t lo = vandq_u8(k < 2 ? lq : vshrq_n_u8(lq, 4), m4);
                        const uint8x16_t hi = vshlq_n_u8(vandq_u8(vshlq_u8(hq, vdupq_n_s8((int8_t) (-2 * k))), m2), 4);
                        w[l][r] = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(lo, hi)), vdupq_n_s8(32));
                    }
                for (int t = 0; t < T; t++) {
                    i32x8 e = zero8();
                    DOT4_LANES(e, w, vld1q_s8(y[t][i].qs + 32 * q + 16 * half));
                    sumi[t] = scale8(sumi[t], e, b->scales[2 * q + half], true);
                }
            }
        }
        for (int t = 0; t < T; t++) k_step8_neon(acc[t], b->d, NULL, y[t][i].d, sumi[t], zero8());
    }
    for (int t = 0; t < T; t++) vst1q_f32(out + (size_t) t * os, acc[t][0]), vst1q_f32(out + (size_t) t * os + 4, acc[t][1]);
}

// The 32-element quants: per block four groups, elements 4g (lo) and 16 + 4g
// (hi) as signed values (Q8_0's stored plus 128 back to q), against one load
// of the activation's 16 lo and 16 hi bytes.
static ALWAYS_INLINE void q32_weights_neon(int32_t type, const uint8_t * blk, int g, int8x16_t wl[2], int8x16_t wh[2]) {
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    for (int r = 0; r < 2; r++) {
        if (type == ES_TYPE_Q8_0) {
            const block_q8_0x8 * b = (const block_q8_0x8 *) blk;
            wl[r] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(b->qs[g][4 * r]), vdupq_n_u8(0x80)));
            wh[r] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(b->qs[g + 4][4 * r]), vdupq_n_u8(0x80)));
            continue;
        }
        const size_t qs_at = type == ES_TYPE_Q4_0 ? offsetof(block_q4_0x8, qs) : type == ES_TYPE_Q4_1 ? offsetof(block_q4_1x8, qs)
                           : type == ES_TYPE_Q5_0 ? offsetof(block_q5_0x8, qs) : offsetof(block_q5_1x8, qs);
        const uint8x16_t raw = vld1q_u8(blk + qs_at + 32 * g + 16 * r);
        uint8x16_t lo = vandq_u8(raw, m4), hi = vshrq_n_u8(raw, 4);
        if (type == ES_TYPE_Q5_0 || type == ES_TYPE_Q5_1) {
            const size_t qh_at = type == ES_TYPE_Q5_0 ? offsetof(block_q5_0x8, qh) : offsetof(block_q5_1x8, qh);
            const uint8x16_t qh = vld1q_u8(blk + qh_at + 16 * r);
            lo = vorrq_u8(lo, vreinterpretq_u8_s8(fifth_bits(qh, g / 2, g)));
            hi = vorrq_u8(hi, vreinterpretq_u8_s8(fifth_bits(qh, 2 + g / 2, g)));
        }
        const int8_t off = type == ES_TYPE_Q4_0 ? 8 : type == ES_TYPE_Q5_0 ? 16 : 0;
        wl[r] = vsubq_s8(vreinterpretq_s8_u8(lo), vdupq_n_s8(off));
        wh[r] = vsubq_s8(vreinterpretq_s8_u8(hi), vdupq_n_s8(off));
    }
}

static ALWAYS_INLINE void tile_q32_neon_body(int32_t type, int64_t nb, const uint8_t * x, size_t bsize,
                                             const uint8_t * const * y, size_t ybytes, float * out, size_t os,
                                             const int T) {
    const bool with_min = type == ES_TYPE_Q4_1 || type == ES_TYPE_Q5_1;
    float32x4_t acc[NEON_TILE_T][2];
    for (int t = 0; t < T; t++) acc[t][0] = acc[t][1] = vdupq_n_f32(0);
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t * blk = x + (size_t) i * bsize;
        int8x16_t wl[4][2], wh[4][2];
        for (int g = 0; g < 4; g++) q32_weights_neon(type, blk, g, wl[g], wh[g]);
        for (int t = 0; t < T; t++) {
            const uint8_t * yb = y[t] + (size_t) i * ybytes;  // d (then s), then the 32 qs
            const int8_t * q8 = (const int8_t *) yb + (with_min ? 4 : 2);
            i32x8 s = zero8();
            DOT4_LANES(s, wl, vld1q_s8(q8));
            DOT4_LANES(s, wh, vld1q_s8(q8 + 16));
            es_half yd, ys;
            memcpy(&yd, yb, 2), memcpy(&ys, yb + 2, 2);
            k_step8_neon(acc[t], (const es_half *) blk, NULL, half_to_f32(yd), s, zero8());
            if (with_min) {  // fma(m, s_y, acc) per row
                const float16x8_t mh = vreinterpretq_f16_u16(vld1q_u16((const uint16_t *) blk + 8));
                acc[t][0] = vfmaq_n_f32(acc[t][0], vcvt_f32_f16(vget_low_f16(mh)), half_to_f32(ys));
                acc[t][1] = vfmaq_n_f32(acc[t][1], vcvt_high_f32_f16(mh), half_to_f32(ys));
            }
        }
    }
    for (int t = 0; t < T; t++) vst1q_f32(out + (size_t) t * os, acc[t][0]), vst1q_f32(out + (size_t) t * os + 4, acc[t][1]);
}

// A type's tile_fn: groups in turn, tokens NEON_TILE_T at a time, the body
// specialized for each T.
#define NEON_K_TILE(NAME, BODY, BLOCK, Q5)                                                      \
    static void NAME##_t(int64_t nb, const uint8_t * x, const block_q8_K * const * y, float * out, size_t os, int T) { \
        switch (T) {                                                                            \
        case 1: BODY(nb, x, sizeof(BLOCK), Q5, y, out, os, 1); break;                           \
        case 2: BODY(nb, x, sizeof(BLOCK), Q5, y, out, os, 2); break;                           \
        case 3: BODY(nb, x, sizeof(BLOCK), Q5, y, out, os, 3); break;                           \
        default: BODY(nb, x, sizeof(BLOCK), Q5, y, out, os, 4); break;                          \
        }                                                                                       \
    }                                                                                           \
    static void NAME(int64_t n, const void * wp, int64_t n_groups, const void * a, size_t a_stride, \
                     int32_t nt, float * y, size_t y_stride) {                                  \
        const int64_t nb = n / QK_K;                                                            \
        for (int64_t g = 0; g < n_groups; g++)                                                  \
            for (int32_t t0 = 0; t0 < nt; t0 += NEON_TILE_T) {                                  \
                const int32_t tn = nt - t0 < NEON_TILE_T ? nt - t0 : NEON_TILE_T;               \
                const block_q8_K * yt[NEON_TILE_T];                                             \
                for (int32_t t = 0; t < tn; t++)                                                \
                    yt[t] = (const block_q8_K *) ((const uint8_t *) a + (size_t) (t0 + t) * a_stride); \
                NAME##_t(nb, (const uint8_t *) wp + (size_t) (g * nb) * sizeof(BLOCK), yt,     \
                         y + (size_t) t0 * y_stride + (size_t) (ES_GROUP_ROWS * g), y_stride, tn); \
            }                                                                                   \
    }
NEON_K_TILE(tile_q4_K_neon, tile_k4_neon_body, block_q4_Kx8, false)
NEON_K_TILE(tile_q5_K_neon, tile_k4_neon_body, block_q5_Kx8, true)
NEON_K_TILE(tile_q6_K_neon, tile_q6_K_neon_body, block_q6_Kx8, false)

#define NEON_Q32_TILE(T_, TYPE)                                                                 \
    static void tile_##T_##_neon_t(int64_t nb, const uint8_t * x, const uint8_t * const * y, float * out, size_t os, int T) { \
        const size_t bsize = sizeof(block_##T_##x8), ybytes = sizeof(DOT32_ACT_##T_);           \
        switch (T) {                                                                            \
        case 1: tile_q32_neon_body(TYPE, nb, x, bsize, y, ybytes, out, os, 1); break;           \
        case 2: tile_q32_neon_body(TYPE, nb, x, bsize, y, ybytes, out, os, 2); break;           \
        case 3: tile_q32_neon_body(TYPE, nb, x, bsize, y, ybytes, out, os, 3); break;           \
        default: tile_q32_neon_body(TYPE, nb, x, bsize, y, ybytes, out, os, 4); break;          \
        }                                                                                       \
    }                                                                                           \
    static void tile_##T_##_neon(int64_t n, const void * wp, int64_t n_groups, const void * a, size_t a_stride, \
                                 int32_t nt, float * y, size_t y_stride) {                      \
        const int64_t nb = n / QK;                                                              \
        for (int64_t g = 0; g < n_groups; g++)                                                  \
            for (int32_t t0 = 0; t0 < nt; t0 += NEON_TILE_T) {                                  \
                const int32_t tn = nt - t0 < NEON_TILE_T ? nt - t0 : NEON_TILE_T;               \
                const uint8_t * yt[NEON_TILE_T];                                                \
                for (int32_t t = 0; t < tn; t++) yt[t] = (const uint8_t *) a + (size_t) (t0 + t) * a_stride; \
                tile_##T_##_neon_t(nb, (const uint8_t *) wp + (size_t) (g * nb) * sizeof(block_##T_##x8), yt, \
                                   y + (size_t) t0 * y_stride + (size_t) (ES_GROUP_ROWS * g), y_stride, tn); \
            }                                                                                   \
    }
NEON_Q32_TILE(q4_0, ES_TYPE_Q4_0)
NEON_Q32_TILE(q4_1, ES_TYPE_Q4_1)
NEON_Q32_TILE(q5_0, ES_TYPE_Q5_0)
NEON_Q32_TILE(q5_1, ES_TYPE_Q5_1)
NEON_Q32_TILE(q8_0, ES_TYPE_Q8_0)

#define NEON_TILES                                                                              \
    .tile = {                                                                                   \
        [ES_TYPE_Q4_0] = tile_q4_0_neon, [ES_TYPE_Q4_1] = tile_q4_1_neon,                       \
        [ES_TYPE_Q5_0] = tile_q5_0_neon, [ES_TYPE_Q5_1] = tile_q5_1_neon,                       \
        [ES_TYPE_Q8_0] = tile_q8_0_neon, [ES_TYPE_Q4_K] = tile_q4_K_neon,                       \
        [ES_TYPE_Q5_K] = tile_q5_K_neon, [ES_TYPE_Q6_K] = tile_q6_K_neon,                       \
    },
#else
#define NEON_TILES  // without the dot-product extension: the unpacked kernels only
#endif  // __ARM_FEATURE_DOTPROD

// The int8 peak: sdot (16 multiply-accumulates into int32) with the
// dot-product extension, else smlal (8 into int16), on 8 independent
// accumulators.
static int64_t int8_loop_neon(int64_t iterations, int32_t * sink) {
    int8x16_t w = vdupq_n_s8(3), y = vdupq_n_s8(5);
#if defined(__ARM_FEATURE_DOTPROD)
    int32x4_t acc[8];
    for (int k = 0; k < 8; k++) acc[k] = vdupq_n_s32(0);
    for (int64_t i = 0; i < iterations; i++) {
        for (int k = 0; k < 8; k++) acc[k] = vdotq_s32(acc[k], w, y);
        __asm__ volatile("" : "+w"(w), "+w"(y));  // operands of every iteration's own
    }
    int32x4_t s = acc[0];
    for (int k = 1; k < 8; k++) s = vaddq_s32(s, acc[k]);
    *sink = vaddvq_s32(s);
    return iterations * 8 * 16;
#else
    int16x8_t acc[8];
    for (int k = 0; k < 8; k++) acc[k] = vdupq_n_s16(0);
    for (int64_t i = 0; i < iterations; i++) {
        for (int k = 0; k < 8; k++) acc[k] = vmlal_s8(acc[k], vget_low_s8(w), vget_low_s8(y));
        __asm__ volatile("" : "+w"(w), "+w"(y));
    }
    int16x8_t s = acc[0];
    for (int k = 1; k < 8; k++) s = vaddq_s16(s, acc[k]);
    *sink = vaddvq_s16(s);
    return iterations * 8 * 8;
#endif
}

/* ---- the set ---------------------------------------------------------------- */

static es_kernel_set KERNELS_NEON = {
    .name = "neon",
    .dot = {
        [ES_TYPE_F32] = dot_f32_neon, [ES_TYPE_F16] = dot_f16_neon, [ES_TYPE_BF16] = dot_bf16_neon,
        QUANTIZED_KERNELS(dot, neon),
    },
    .dotn = {QUANTIZED_KERNELS(dotn, neon)},
    .dot_rows = {[ES_TYPE_Q8_0] = dot_rows_q8_0_neon},
    NEON_TILES
    .axpy_q8_0 = axpy_q8_0_neon,
    .int8_loop = int8_loop_neon,
};

const es_kernel_set * es__kernels_neon(void) {
    KERNELS_NEON.axpy_f16 = es__kernels_scalar()->axpy_f16;
    return &KERNELS_NEON;
}

#else

const es_kernel_set * es__kernels_neon(void) { return NULL; }

#endif  // __ARM_NEON && __aarch64__
