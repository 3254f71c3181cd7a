/*
 * quants.c — weight types: ggml's block layouts, row sizes, dequantization,
 * activation quantization and the dot products behind es_matvec.
 *
 * Every weight type's dot product reads the activation row in a companion
 * format (es_act_type): the weight's own type for float weights (activations
 * rounded to F16 / BF16 as ggml's vec_dot_type does), Q8_0 / Q8_1 for the
 * 32-element quants, Q8_K for the 256-element K-quants. The activation is quantized the
 * way ggml's x86 build does it, so our logits stay within rounding of
 * llama.cpp's.
 *
 * Three kernel sets share one table layout: portable scalar (always), AVX2 +
 * FMA + F16C (x86-64, compiled per function with a target attribute and
 * chosen with __builtin_cpu_supports, since the library is built without
 * -march) and NEON (aarch64, where it is baseline). The best set this CPU
 * runs is used unless es_kernels_select names another. Activation quantization and
 * dequantization are scalar in every set, so all sets see identical inputs.
 *
 * Batched kernels (AVX2, NEON): a verification batch or a prefill chunk
 * multiplies one weight row by up to MAX_NT = 8 activation rows in one call,
 * loading and unpacking each weight block once for all of them; es_matmat
 * walks the rows in blocks that stay in cache while groups of 8 tokens go
 * by. On AVX2 the K-quants sum several sub-blocks' products in int16 before
 * one widening multiply by the scales, since the integer multiplier is the
 * bottleneck once the weights are unpacked only once.
 *
 * Batch invariance: es_matvec computes each row with one function whose
 * reduction order depends only on n, never on the rows range or the thread;
 * a batched kernel gives every token exactly that function's result (the
 * integer sums are exact, the float steps per token the same for any NT).
 */
#define _POSIX_C_SOURCE 200809L  // pthread_once under -std=c11

#include "native/native_internal.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ES_HAVE_AVX2 1
#include <cpuid.h>
#include <immintrin.h>
#define ES_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif
#if defined(__ARM_NEON)
#include <arm_neon.h>
#endif

/* ---- block layouts (ggml's, byte for byte) ------------------------------- */

#define QK   32   // elements per block of the 32-element quants
#define QK_K 256  // elements per super-block of the K-quants

typedef uint16_t es_half;  // IEEE binary16 bits

typedef struct { es_half d; uint8_t qs[QK / 2]; } block_q4_0;                  // x = (q - 8) d
typedef struct { es_half d, m; uint8_t qs[QK / 2]; } block_q4_1;               // x = q d + m
typedef struct { es_half d; uint8_t qh[4]; uint8_t qs[QK / 2]; } block_q5_0;   // x = (q - 16) d
typedef struct { es_half d, m; uint8_t qh[4]; uint8_t qs[QK / 2]; } block_q5_1;// x = q d + m
typedef struct { es_half d; int8_t qs[QK]; } block_q8_0;                       // x = q d
typedef struct { es_half d, s; int8_t qs[QK]; } block_q8_1;                    // s = d sum(q)
// K-quants: 8 sub-blocks of 32 with 6-bit scales and mins packed in 12 bytes.
typedef struct { es_half d, dmin; uint8_t scales[12]; uint8_t qs[QK_K / 2]; } block_q4_K;
typedef struct {
    es_half d, dmin;
    uint8_t scales[12];
    uint8_t qh[QK_K / 8];  // fifth bits: bit 2j / 2j+1 of qh[l] for chunk j's low / high nibbles
    uint8_t qs[QK_K / 2];
} block_q5_K;
typedef struct {
    uint8_t ql[QK_K / 2];     // low 4 bits
    uint8_t qh[QK_K / 4];     // high 2 bits
    int8_t  scales[QK_K / 16];// one per 16 elements
    es_half d;
} block_q6_K;                 // x = d scale (q - 32)
// 2- and 3-bit K-quants (the low-precision expert copies): 16 sub-blocks of
// 16. Element 128 h + 32 j + l takes bits 2j, 2j+1 of qs[32 h + l]; its
// sub-block is 8 h + 2 j + (l >= 16).
typedef struct {
    uint8_t scales[QK_K / 16];  // per sub-block: scale (low nibble), min (high)
    uint8_t qs[QK_K / 4];
    es_half d, dmin;
} block_q2_K;                   // x = d scale q - dmin min, q in 0..3
typedef struct {
    uint8_t hmask[QK_K / 8];    // third bits: bit 4h + j of hmask[l]
    uint8_t qs[QK_K / 4];
    uint8_t scales[12];         // 16 6-bit scales, offset by 32 (unpack_scales_q3_K)
    es_half d;
} block_q3_K;                   // x = d (scale - 32) (q - 4), q in 0..7
typedef struct {
    float   d;
    int8_t  qs[QK_K];
    int16_t bsums[QK_K / 16];  // sums of qs in groups of 16 (for the K-quants' mins)
} block_q8_K;

_Static_assert(sizeof(block_q4_0) == 18, "q4_0 layout");
_Static_assert(sizeof(block_q4_1) == 20, "q4_1 layout");
_Static_assert(sizeof(block_q5_0) == 22, "q5_0 layout");
_Static_assert(sizeof(block_q5_1) == 24, "q5_1 layout");
_Static_assert(sizeof(block_q8_0) == 34, "q8_0 layout");
_Static_assert(sizeof(block_q8_1) == 36, "q8_1 layout");
_Static_assert(sizeof(block_q2_K) == 84, "q2_K layout");
_Static_assert(sizeof(block_q3_K) == 110, "q3_K layout");
_Static_assert(sizeof(block_q4_K) == 144, "q4_K layout");
_Static_assert(sizeof(block_q5_K) == 176, "q5_K layout");
_Static_assert(sizeof(block_q6_K) == 210, "q6_K layout");
_Static_assert(sizeof(block_q8_K) == 292, "q8_K layout");

/* ---- half and bfloat16 conversion ---------------------------------------- */

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float    bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float   half_to_f32(es_half h) { return es_half_to_f32(h); }
static inline es_half f32_to_half(float f) { return es_f32_to_half(f); }

static inline float bf16_to_f32(uint16_t b) { return bits_f32((uint32_t) b << 16); }

// binary32 -> bfloat16, round to nearest even; a nan stays a (quiet) nan.
static inline uint16_t f32_to_bf16(float f) {
    const uint32_t u = f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t) ((u >> 16) | 64);
    return (uint16_t) ((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}

// Round to nearest, ties to even, for |v| < 2^22 (ggml's nearest_int).
static inline int nearest_int(float v) {
    const float big = v + 12582912.f;  // 1.5 * 2^23: the integer lands in the low mantissa bits
    return (int) (f32_bits(big) & 0x007FFFFFu) - 0x00400000;
}

/* ---- type table ---------------------------------------------------------- */

// Sizes and names come from the one ggml type table, es_type_info (gguf.c);
// this section says which of those types the kernels implement.

// The activation format of each weight type es_matvec takes; -1 for none.
int32_t es_act_type(int32_t weight_type) {
    switch (weight_type) {
    case ES_TYPE_F32: case ES_TYPE_F16: case ES_TYPE_BF16:   return weight_type;
    case ES_TYPE_Q4_0: case ES_TYPE_Q5_0: case ES_TYPE_Q8_0: return ES_TYPE_Q8_0;
    case ES_TYPE_Q4_1: case ES_TYPE_Q5_1:                    return ES_TYPE_Q8_1;
    case ES_TYPE_Q4_K: case ES_TYPE_Q5_K: case ES_TYPE_Q6_K: return ES_TYPE_Q8_K;
    case ES_TYPE_Q2_K: case ES_TYPE_Q3_K:                    return ES_TYPE_Q8_K;
    default:                                                 return -1;
    }
}

// Weight types plus the activation-only formats (dequantized by tests).
static bool implemented(int32_t type) {
    return es_act_type(type) >= 0 || type == ES_TYPE_Q8_1 || type == ES_TYPE_Q8_K;
}

int32_t es_type_block(int32_t type) {
    return implemented(type) ? es_type_info(type)->block : 0;
}

size_t es_type_row_bytes(int32_t type, int64_t n) {
    if (!implemented(type) || n < 0) return 0;
    const es_type_traits * t = es_type_info(type);
    if (n % t->block) return 0;
    return (size_t) (n / t->block) * (size_t) t->block_bytes;
}

const char * es_type_name(int32_t type) {
    const es_type_traits * t = es_type_info(type);
    return t ? t->name : "unknown";
}

/* ---- dequantization (scalar, shared by every kernel set) ----------------- */

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block.
static inline void scale_min_k4(int j, const uint8_t * q, uint8_t * sc, uint8_t * m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m  = q[j + 4] & 63;
    } else {
        *sc = (uint8_t) ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m  = (uint8_t) ((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

// Q4_K / Q5_K scales and mins of one super-block, unpacked to 8 bytes each,
// four at a time: scale_min_k4 on 32-bit words.
static inline void unpack_scales_k4(const uint8_t * s, uint8_t sc[8], uint8_t m[8]) {
    uint32_t u[3];
    memcpy(u, s, 12);
    const uint32_t sc_lo = u[0] & 0x3F3F3F3Fu, m_lo = u[1] & 0x3F3F3F3Fu;
    const uint32_t sc_hi = (u[2] & 0x0F0F0F0Fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    const uint32_t m_hi  = ((u[2] >> 4) & 0x0F0F0F0Fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    memcpy(sc, &sc_lo, 4), memcpy(sc + 4, &sc_hi, 4);
    memcpy(m, &m_lo, 4), memcpy(m + 4, &m_hi, 4);
}

static void dequant_q4_0(const block_q4_0 * x, float * y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK) {
        const float d = half_to_f32(x[i].d);
        for (int j = 0; j < QK / 2; j++) {
            y[j]          = ((x[i].qs[j] & 0xF) - 8) * d;
            y[j + QK / 2] = ((x[i].qs[j] >> 4) - 8) * d;
        }
    }
}

static void dequant_q4_1(const block_q4_1 * x, float * y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK) {
        const float d = half_to_f32(x[i].d), m = half_to_f32(x[i].m);
        for (int j = 0; j < QK / 2; j++) {
            y[j]          = (x[i].qs[j] & 0xF) * d + m;
            y[j + QK / 2] = (x[i].qs[j] >> 4) * d + m;
        }
    }
}

// Element j's fifth bit (j in 0..31) as 0 or 16.
static inline int q5_high(uint32_t qh, int j) { return (int) ((qh >> j) & 1) << 4; }

static void dequant_q5_0(const block_q5_0 * x, float * y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK) {
        const float d = half_to_f32(x[i].d);
        uint32_t qh;
        memcpy(&qh, x[i].qh, 4);
        for (int j = 0; j < QK / 2; j++) {
            y[j]          = (((x[i].qs[j] & 0xF) | q5_high(qh, j)) - 16) * d;
            y[j + QK / 2] = (((x[i].qs[j] >> 4) | q5_high(qh, j + 16)) - 16) * d;
        }
    }
}

static void dequant_q5_1(const block_q5_1 * x, float * y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK) {
        const float d = half_to_f32(x[i].d), m = half_to_f32(x[i].m);
        uint32_t qh;
        memcpy(&qh, x[i].qh, 4);
        for (int j = 0; j < QK / 2; j++) {
            y[j]          = ((x[i].qs[j] & 0xF) | q5_high(qh, j)) * d + m;
            y[j + QK / 2] = ((x[i].qs[j] >> 4) | q5_high(qh, j + 16)) * d + m;
        }
    }
}

static void dequant_q8_0(const block_q8_0 * x, float * y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK) {
        const float d = half_to_f32(x[i].d);
        for (int j = 0; j < QK; j++) y[j] = x[i].qs[j] * d;
    }
}

static void dequant_q8_1(const block_q8_1 * x, float * y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK) {
        const float d = half_to_f32(x[i].d);
        for (int j = 0; j < QK; j++) y[j] = x[i].qs[j] * d;
    }
}

static void dequant_q4_K(const block_q4_K * x, float * y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        const float d = half_to_f32(x[i].d), dmin = half_to_f32(x[i].dmin);
        const uint8_t * q = x[i].qs;
        // Four chunks of 64: 32 bytes whose low nibbles are sub-block 2j, high 2j+1.
        for (int j = 0; j < 4; j++, q += 32) {
            uint8_t sc, m;
            scale_min_k4(2 * j, x[i].scales, &sc, &m);
            const float d1 = d * sc, m1 = dmin * m;
            scale_min_k4(2 * j + 1, x[i].scales, &sc, &m);
            const float d2 = d * sc, m2 = dmin * m;
            for (int l = 0; l < 32; l++) *y++ = d1 * (q[l] & 0xF) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * (q[l] >> 4) - m2;
        }
    }
}

static void dequant_q5_K(const block_q5_K * x, float * y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        const float d = half_to_f32(x[i].d), dmin = half_to_f32(x[i].dmin);
        const uint8_t * q = x[i].qs;
        for (int j = 0; j < 4; j++, q += 32) {
            uint8_t sc, m;
            scale_min_k4(2 * j, x[i].scales, &sc, &m);
            const float d1 = d * sc, m1 = dmin * m;
            scale_min_k4(2 * j + 1, x[i].scales, &sc, &m);
            const float d2 = d * sc, m2 = dmin * m;
            for (int l = 0; l < 32; l++)
                *y++ = d1 * ((q[l] & 0xF) + (((x[i].qh[l] >> (2 * j)) & 1) << 4)) - m1;
            for (int l = 0; l < 32; l++)
                *y++ = d2 * ((q[l] >> 4) + (((x[i].qh[l] >> (2 * j + 1)) & 1) << 4)) - m2;
        }
    }
}

// One 128-element half of a Q6_K super-block as values q - 32 (-32..31).
// Quarter k (elements 32k .. 32k+31) takes, for lane l, the low (k < 2)
// or high (k >= 2) nibble of ql[l + 32 (k & 1)] and bits 2k, 2k+1 of qh[l].
static inline void q6_half(const uint8_t * ql, const uint8_t * qh, int8_t out[128]) {
    for (int l = 0; l < 32; l++) {
        out[l]      = (int8_t) (((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
        out[l + 32] = (int8_t) (((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
        out[l + 64] = (int8_t) (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
        out[l + 96] = (int8_t) (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
    }
}

static void dequant_q6_K(const block_q6_K * x, float * y, int64_t nb) {
    int8_t q[128];
    for (int64_t i = 0; i < nb; i++) {
        const float d = half_to_f32(x[i].d);
        for (int h = 0; h < 2; h++) {  // halves of 128
            q6_half(x[i].ql + 64 * h, x[i].qh + 32 * h, q);
            const int8_t * sc = x[i].scales + 8 * h;
            for (int e = 0; e < 128; e++) *y++ = d * sc[e / 16] * q[e];
        }
    }
}

static void dequant_q8_K(const block_q8_K * x, float * y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++)
        for (int j = 0; j < QK_K; j++) *y++ = x[i].d * x[i].qs[j];
}

// Q2_K / Q3_K element values of chunk k (0..7: elements 32k .. 32k+31,
// sub-blocks 2k and 2k + 1) as u8: bits 2(k % 4) of qs[32 (k / 4) + l],
// and for Q3_K bit k of hmask[l] as bit 2.
static inline void k16_chunk(const uint8_t * qs, const uint8_t * hmask, int k, uint8_t out[32]) {
    const uint8_t * q = qs + 32 * (k / 4);
    const int shift = 2 * (k % 4);
    for (int l = 0; l < 32; l++) {
        out[l] = (uint8_t) ((q[l] >> shift) & 3);
        if (hmask) out[l] |= (uint8_t) (((hmask[l] >> k) & 1) << 2);
    }
}

// Q3_K's 16 scales, unpacked to -32..31: sub-block j's low nibble is in
// scales[j % 8] (low half for j < 8, high for j >= 8), its top two bits
// are bits 2 (j / 4) of scales[8 + j % 4].
static inline void unpack_scales_q3_K(const uint8_t s[12], int8_t out[16]) {
    for (int j = 0; j < 16; j++) {
        const int lo = j < 8 ? s[j] & 0xF : s[j - 8] >> 4;
        const int hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        out[j] = (int8_t) ((lo | (hi << 4)) - 32);
    }
}

// The 16 scales s and the factors m of the activation's group sums (Q2_K:
// its mins; Q3_K: 4 s, the offset), as int16.
static inline void k16_scales_q2_K(const block_q2_K * x, int16_t s[16], int16_t m[16]) {
    for (int j = 0; j < 16; j++) s[j] = (int16_t) (x->scales[j] & 0xF), m[j] = (int16_t) (x->scales[j] >> 4);
}
static inline void k16_scales_q3_K(const block_q3_K * x, int16_t s[16], int16_t m[16]) {
    int8_t sc[16];
    unpack_scales_q3_K(x->scales, sc);
    for (int j = 0; j < 16; j++) s[j] = sc[j], m[j] = (int16_t) (4 * sc[j]);
}

static void dequant_q2_K(const block_q2_K * x, float * y, int64_t nb) {
    uint8_t q[32];
    for (int64_t i = 0; i < nb; i++) {
        const float d = half_to_f32(x[i].d), dmin = half_to_f32(x[i].dmin);
        for (int k = 0; k < 8; k++) {
            k16_chunk(x[i].qs, NULL, k, q);
            for (int l = 0; l < 32; l++) {
                const uint8_t sc = x[i].scales[2 * k + l / 16];
                *y++ = d * (float) (sc & 0xF) * q[l] - dmin * (float) (sc >> 4);
            }
        }
    }
}

static void dequant_q3_K(const block_q3_K * x, float * y, int64_t nb) {
    uint8_t q[32];
    int8_t sc[16];
    for (int64_t i = 0; i < nb; i++) {
        const float d = half_to_f32(x[i].d);
        unpack_scales_q3_K(x[i].scales, sc);
        for (int k = 0; k < 8; k++) {
            k16_chunk(x[i].qs, x[i].hmask, k, q);
            for (int l = 0; l < 32; l++) *y++ = d * (float) sc[2 * k + l / 16] * (q[l] - 4);
        }
    }
}

int es_dequantize_row(int32_t type, const void * src, float * dst, int64_t n) {
    const int64_t blk = es_type_block(type);
    if (blk == 0) return ES_ERR_UNSUPPORTED;
    if (!src || !dst || n <= 0 || n % blk) return ES_ERR_INVALID_ARG;
    const int64_t nb = n / blk;
    switch (type) {
    case ES_TYPE_F32:  memcpy(dst, src, (size_t) n * sizeof(float)); break;
    case ES_TYPE_F16:  for (int64_t i = 0; i < n; i++) dst[i] = half_to_f32(((const es_half *) src)[i]); break;
    case ES_TYPE_BF16: for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(((const uint16_t *) src)[i]); break;
    case ES_TYPE_Q4_0: dequant_q4_0(src, dst, nb); break;
    case ES_TYPE_Q4_1: dequant_q4_1(src, dst, nb); break;
    case ES_TYPE_Q5_0: dequant_q5_0(src, dst, nb); break;
    case ES_TYPE_Q5_1: dequant_q5_1(src, dst, nb); break;
    case ES_TYPE_Q8_0: dequant_q8_0(src, dst, nb); break;
    case ES_TYPE_Q8_1: dequant_q8_1(src, dst, nb); break;
    case ES_TYPE_Q4_K: dequant_q4_K(src, dst, nb); break;
    case ES_TYPE_Q5_K: dequant_q5_K(src, dst, nb); break;
    case ES_TYPE_Q6_K: dequant_q6_K(src, dst, nb); break;
    case ES_TYPE_Q2_K: dequant_q2_K(src, dst, nb); break;
    case ES_TYPE_Q3_K: dequant_q3_K(src, dst, nb); break;
    case ES_TYPE_Q8_K: dequant_q8_K(src, dst, nb); break;
    default: break;
    }
    return ES_OK;
}

/* ---- activation quantization (scalar, shared by every kernel set) -------- */

// ggml's x86 quantize_row_q8_0 / q8_1: d = amax / 127 stored as half,
// q = round-half-even(x * 127 / amax); Q8_1 adds s = half(d * sum(q)).
static void quantize_q8_0(const float * x, block_q8_0 * y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK) {
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float id = amax != 0.0f ? 127.f / amax : 0.0f;
        y[i].d = f32_to_half(amax / 127.f);
        for (int j = 0; j < QK; j++) y[i].qs[j] = (int8_t) nearest_int(x[j] * id);
    }
}

static void quantize_q8_1(const float * x, block_q8_1 * y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK) {
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d  = amax / 127.f;
        const float id = amax != 0.0f ? 127.f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            y[i].qs[j] = (int8_t) nearest_int(x[j] * id);
            sum += y[i].qs[j];
        }
        y[i].d = f32_to_half(d);
        y[i].s = f32_to_half(d * (float) sum);
    }
}

// ggml's quantize_row_q8_K: the element of largest magnitude maps to -127
// (scale -127 / max), d = 1 / scale kept as float, plus sums of 16.
static void quantize_q8_K(const float * x, block_q8_K * y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QK_K; j++) {
            const float ax = fabsf(x[j]);
            if (ax > amax) { amax = ax; max = x[j]; }
        }
        if (amax == 0.0f) {
            memset(&y[i], 0, sizeof(y[i]));
            continue;
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < QK_K; j++) {
            const int v = nearest_int(iscale * x[j]);
            y[i].qs[j] = (int8_t) (v < 127 ? v : 127);
        }
        for (int g = 0; g < QK_K / 16; g++) {
            int sum = 0;
            for (int j = 0; j < 16; j++) sum += y[i].qs[16 * g + j];
            y[i].bsums[g] = (int16_t) sum;
        }
        y[i].d = 1.0f / iscale;
    }
}

void es_quantize_act(int32_t weight_type, const float * x, void * dst, int64_t n) {
    const int32_t act = es_act_type(weight_type);
    const int64_t blk = es_type_block(act);
    if (blk == 0 || n <= 0 || n % blk) return;
    switch (act) {
    case ES_TYPE_F32:  memcpy(dst, x, (size_t) n * sizeof(float)); break;
    case ES_TYPE_F16:  for (int64_t i = 0; i < n; i++) ((es_half *) dst)[i] = f32_to_half(x[i]); break;
    case ES_TYPE_BF16: for (int64_t i = 0; i < n; i++) ((uint16_t *) dst)[i] = f32_to_bf16(x[i]); break;
    case ES_TYPE_Q8_0: quantize_q8_0(x, dst, n / QK); break;
    case ES_TYPE_Q8_1: quantize_q8_1(x, dst, n / QK); break;
    case ES_TYPE_Q8_K: quantize_q8_K(x, dst, n / QK_K); break;
    default: break;
    }
}

/* ---- weight quantization: Q2_K and Q3_K (the low-precision expert copies) - */

// Each sub-block of 16 gets the float scale (and Q2_K min) that minimizes
// its squared error, searched over a few starting points each refined by
// least squares; then the 16 scales are quantized against one super-block
// scale, and every element requantized with the scale it will be read with.

// Q3_K sub-block: q in -4..3 for x / s; returns the best s (0 for zeros).
static float fit_q3_sub(const float * x) {
    float amax = 0.0f, xm = 0.0f;
    for (int l = 0; l < 16; l++) {
        if (fabsf(x[l]) > amax) { amax = fabsf(x[l]); xm = x[l]; }
    }
    if (amax == 0.0f) return 0.0f;
    float best_s = xm / -4.0f, best_err = INFINITY;
    for (int c = 0; c < 18; c++) {  // xm to -4 or to +3, scaled by 0.8 .. 1.2
        const float s0 = (c < 9 ? xm / -4.0f : xm / 3.0f) * (0.8f + 0.05f * (float) (c % 9));
        float sxq = 0.0f, sqq = 0.0f;
        int q[16];
        for (int l = 0; l < 16; l++) {
            const int v = nearest_int(x[l] / s0);
            q[l] = v < -4 ? -4 : v > 3 ? 3 : v;
            sxq += x[l] * (float) q[l], sqq += (float) (q[l] * q[l]);
        }
        const float s = sqq > 0.0f ? sxq / sqq : s0;
        float err = 0.0f;
        for (int l = 0; l < 16; l++) err += (x[l] - s * (float) q[l]) * (x[l] - s * (float) q[l]);
        if (err < best_err) { best_err = err; best_s = s; }
    }
    return best_s;
}

// Q2_K sub-block: x ~ s q - m, q in 0..3, s >= 0, m >= 0.
static void fit_q2_sub(const float * x, float * s_out, float * m_out) {
    float lo = 0.0f, hi = 0.0f;
    for (int l = 0; l < 16; l++) lo = fminf(lo, x[l]), hi = fmaxf(hi, x[l]);
    *s_out = *m_out = 0.0f;
    if (hi == lo) return;
    float best_err = INFINITY;
    for (int c = 0; c < 9; c++) {  // the range shrunk by 0 .. 20% at either end
        const float a = lo * (1.0f - 0.05f * (float) (c % 3)), b = hi * (1.0f - 0.05f * (float) (c / 3));
        float s = (b - a) / 3.0f, m = -a;
        for (int it = 0; it < 3 && s > 0.0f; it++) {
            // Least squares of x = s q - m over the current q; m clamped at 0.
            float sq = 0, sqq = 0, sx = 0, sxq = 0;
            for (int l = 0; l < 16; l++) {
                const int v = nearest_int((x[l] + m) / s);
                const float q = (float) (v < 0 ? 0 : v > 3 ? 3 : v);
                sq += q, sqq += q * q, sx += x[l], sxq += x[l] * q;
            }
            const float det = 16.0f * sqq - sq * sq;
            if (det <= 0.0f) break;
            float ns = (16.0f * sxq - sq * sx) / det, nm = (ns * sq - sx) / 16.0f;
            if (nm < 0.0f) nm = 0.0f, ns = sqq > 0.0f ? sxq / sqq : ns;
            if (!(ns > 0.0f)) break;
            s = ns, m = nm;
        }
        if (!(s > 0.0f)) continue;
        float err = 0.0f;
        for (int l = 0; l < 16; l++) {
            const int v = nearest_int((x[l] + m) / s);
            const float e = x[l] - (s * (float) (v < 0 ? 0 : v > 3 ? 3 : v) - m);
            err += e * e;
        }
        if (err < best_err) best_err = err, *s_out = s, *m_out = m;
    }
}

// n / 16 values v (>= 0) as 4-bit integers times a half scale; returns it.
static float quantize_scales4(const float * v, int n, uint8_t * out) {
    float vmax = 0.0f;
    for (int j = 0; j < n; j++) vmax = fmaxf(vmax, v[j]);
    const float d = half_to_f32(f32_to_half(vmax / 15.0f));
    for (int j = 0; j < n; j++) {
        const int q = d > 0.0f ? nearest_int(v[j] / d) : 0;
        out[j] = (uint8_t) (q > 15 ? 15 : q);
    }
    return d;
}

static void quantize_q2_K(const float * x, block_q2_K * y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        float s[16], m[16];
        uint8_t is[16], im[16];
        for (int j = 0; j < 16; j++) fit_q2_sub(x + 16 * j, &s[j], &m[j]);
        const float d = quantize_scales4(s, 16, is), dmin = quantize_scales4(m, 16, im);
        y[i].d = f32_to_half(d), y[i].dmin = f32_to_half(dmin);
        memset(y[i].qs, 0, sizeof y[i].qs);
        for (int j = 0; j < 16; j++) {
            y[i].scales[j] = (uint8_t) (is[j] | (im[j] << 4));
            const float dl = d * (float) is[j], ml = dmin * (float) im[j];
            for (int l = 0; l < 16; l++) {  // element 16 j + l = 128 h + 32 jj + ll
                const int e = 16 * j + l, h = e / 128, jj = (e % 128) / 32, ll = e % 32;
                const int v = dl > 0.0f ? nearest_int((x[e] + ml) / dl) : 0;
                y[i].qs[32 * h + ll] |= (uint8_t) ((v < 0 ? 0 : v > 3 ? 3 : v) << (2 * jj));
            }
        }
    }
}

static void quantize_q3_K(const float * x, block_q3_K * y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        float s[16], smax = 0.0f;
        for (int j = 0; j < 16; j++) {
            s[j] = fit_q3_sub(x + 16 * j);
            if (fabsf(s[j]) > fabsf(smax)) smax = s[j];
        }
        // The largest scale maps to -32 (the 6-bit range is -32..31).
        const float d = half_to_f32(f32_to_half(smax / -32.0f));
        memset(y[i].scales, 0, sizeof y[i].scales);
        memset(y[i].hmask, 0, sizeof y[i].hmask);
        memset(y[i].qs, 0, sizeof y[i].qs);
        y[i].d = f32_to_half(d);
        for (int j = 0; j < 16; j++) {
            int v = d != 0.0f ? nearest_int(s[j] / d) : 0;
            v = v < -32 ? -32 : v > 31 ? 31 : v;
            const int u = v + 32;
            y[i].scales[j % 8] |= (uint8_t) ((u & 0xF) << (j < 8 ? 0 : 4));
            y[i].scales[8 + j % 4] |= (uint8_t) ((u >> 4) << (2 * (j / 4)));
            const float dl = d * (float) v;
            for (int l = 0; l < 16; l++) {
                const int e = 16 * j + l, k = e / 32, ll = e % 32;
                int q = dl != 0.0f ? nearest_int(x[e] / dl) : 0;
                q = (q < -4 ? -4 : q > 3 ? 3 : q) + 4;
                y[i].qs[32 * (k / 4) + ll] |= (uint8_t) ((q & 3) << (2 * (k % 4)));
                y[i].hmask[ll] |= (uint8_t) ((q >> 2) << k);
            }
        }
    }
}

int es_quantize_row(int32_t type, const float * src, void * dst, int64_t n) {
    if (type != ES_TYPE_Q2_K && type != ES_TYPE_Q3_K) return ES_ERR_UNSUPPORTED;
    if (!src || !dst || n <= 0 || n % QK_K) return ES_ERR_INVALID_ARG;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(src[i]) || fabsf(src[i]) > 65504.0f) return ES_ERR_INVALID_ARG;
    }
    if (type == ES_TYPE_Q2_K) quantize_q2_K(src, dst, n / QK_K);
    else quantize_q3_K(src, dst, n / QK_K);
    return ES_OK;
}

/* ---- scalar dot products ------------------------------------------------- */

// Each returns dot(weight row w, activation row a) over n elements. Integer
// block sums are exact; floats accumulate block by block in order.
typedef float (*vec_dot_fn)(int64_t n, const void * w, const void * a);
// The same for NT activation rows a_stride bytes apart, into out[0..NT-1];
// bit for bit what vec_dot_fn gives for each. A kernel set may have them for
// NT = 1..MAX_NT.
#define MAX_NT 8
// A kernel set's batched functions come from one template per type,
// instantiated for each NT (EACH_NT) into a table indexed by NT - 1.
#define EACH_NT(M, P) M(P, 1) M(P, 2) M(P, 3) M(P, 4) M(P, 5) M(P, 6) M(P, 7) M(P, 8)
#define NT_NAME(P, NT) P##NT,
// The activation format each 32-element type's kernels read.
#define DOT32_ACT_q4_0 block_q8_0
#define DOT32_ACT_q5_0 block_q8_0
#define DOT32_ACT_q8_0 block_q8_0
#define DOT32_ACT_q4_1 block_q8_1
#define DOT32_ACT_q5_1 block_q8_1
typedef void (*vec_dotn_fn)(int64_t n, const void * w, const void * a, size_t a_stride, float * out);

static float dot_f32_scalar(int64_t n, const void * w, const void * a) {
    const float * x = w, * y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += x[i] * y[i];
    return sum;
}

// F16 and BF16 weights against activations of the same type; products and
// sums in F32, as ggml_vec_dot_f16 / _bf16.
static float dot_f16_scalar(int64_t n, const void * w, const void * a) {
    const es_half * x = w, * y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += half_to_f32(x[i]) * half_to_f32(y[i]);
    return sum;
}

static float dot_bf16_scalar(int64_t n, const void * w, const void * a) {
    const uint16_t * x = w, * y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += bf16_to_f32(x[i]) * bf16_to_f32(y[i]);
    return sum;
}

static void axpy_f16_scalar(int64_t n, float e, const uint16_t * v, float * acc) {
    for (int64_t i = 0; i < n; i++) acc[i] += e * half_to_f32(v[i]);
}

static float dot_q4_0_scalar(int64_t n, const void * w, const void * a) {
    const block_q4_0 * x = w;
    const block_q8_0 * y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK; i++) {
        int sumi = 0;
        for (int j = 0; j < QK / 2; j++)
            sumi += ((x[i].qs[j] & 0xF) - 8) * y[i].qs[j] + ((x[i].qs[j] >> 4) - 8) * y[i].qs[j + QK / 2];
        sum += (float) sumi * (half_to_f32(x[i].d) * half_to_f32(y[i].d));
    }
    return sum;
}

static float dot_q4_1_scalar(int64_t n, const void * w, const void * a) {
    const block_q4_1 * x = w;
    const block_q8_1 * y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK; i++) {
        int sumi = 0;
        for (int j = 0; j < QK / 2; j++)
            sumi += (x[i].qs[j] & 0xF) * y[i].qs[j] + (x[i].qs[j] >> 4) * y[i].qs[j + QK / 2];
        // sum((q d + m) y_d y_q) = d y_d sum(q y_q) + m s
        sum += (float) sumi * (half_to_f32(x[i].d) * half_to_f32(y[i].d)) +
               half_to_f32(x[i].m) * half_to_f32(y[i].s);
    }
    return sum;
}

static float dot_q5_0_scalar(int64_t n, const void * w, const void * a) {
    const block_q5_0 * x = w;
    const block_q8_0 * y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK; i++) {
        uint32_t qh;
        memcpy(&qh, x[i].qh, 4);
        int sumi = 0;
        for (int j = 0; j < QK / 2; j++)
            sumi += (((x[i].qs[j] & 0xF) | q5_high(qh, j)) - 16) * y[i].qs[j] +
                    (((x[i].qs[j] >> 4) | q5_high(qh, j + 16)) - 16) * y[i].qs[j + QK / 2];
        sum += (float) sumi * (half_to_f32(x[i].d) * half_to_f32(y[i].d));
    }
    return sum;
}

static float dot_q5_1_scalar(int64_t n, const void * w, const void * a) {
    const block_q5_1 * x = w;
    const block_q8_1 * y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK; i++) {
        uint32_t qh;
        memcpy(&qh, x[i].qh, 4);
        int sumi = 0;
        for (int j = 0; j < QK / 2; j++)
            sumi += ((x[i].qs[j] & 0xF) | q5_high(qh, j)) * y[i].qs[j] +
                    ((x[i].qs[j] >> 4) | q5_high(qh, j + 16)) * y[i].qs[j + QK / 2];
        sum += (float) sumi * (half_to_f32(x[i].d) * half_to_f32(y[i].d)) +
               half_to_f32(x[i].m) * half_to_f32(y[i].s);
    }
    return sum;
}

static float dot_q8_0_scalar(int64_t n, const void * w, const void * a) {
    const block_q8_0 * x = w;
    const block_q8_0 * y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK; i++) {
        int sumi = 0;
        for (int j = 0; j < QK; j++) sumi += x[i].qs[j] * y[i].qs[j];
        sum += (float) sumi * (half_to_f32(x[i].d) * half_to_f32(y[i].d));
    }
    return sum;
}

// A K-quant super-block's float part: d y_d sum(scale q y_q) - dmin y_d sum(min bsum).
static inline float k_block(float d, float dmin, float yd, int sumi, int summ) {
    return (d * yd) * (float) sumi - (dmin * yd) * (float) summ;
}

static float dot_q4_K_scalar(int64_t n, const void * w, const void * a) {
    const block_q4_K * x = w;
    const block_q8_K * y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const uint8_t * q  = x[i].qs;
        const int8_t *  q8 = y[i].qs;
        int sumi = 0, summ = 0;
        for (int j = 0; j < 4; j++, q += 32, q8 += 64) {
            uint8_t sc1, m1, sc2, m2;
            scale_min_k4(2 * j, x[i].scales, &sc1, &m1);
            scale_min_k4(2 * j + 1, x[i].scales, &sc2, &m2);
            int s1 = 0, s2 = 0;
            for (int l = 0; l < 32; l++) {
                s1 += (q[l] & 0xF) * q8[l];
                s2 += (q[l] >> 4) * q8[l + 32];
            }
            sumi += sc1 * s1 + sc2 * s2;
            summ += m1 * (y[i].bsums[4 * j] + y[i].bsums[4 * j + 1]) +
                    m2 * (y[i].bsums[4 * j + 2] + y[i].bsums[4 * j + 3]);
        }
        sum += k_block(half_to_f32(x[i].d), half_to_f32(x[i].dmin), y[i].d, sumi, summ);
    }
    return sum;
}

static float dot_q5_K_scalar(int64_t n, const void * w, const void * a) {
    const block_q5_K * x = w;
    const block_q8_K * y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const uint8_t * q  = x[i].qs;
        const int8_t *  q8 = y[i].qs;
        int sumi = 0, summ = 0;
        for (int j = 0; j < 4; j++, q += 32, q8 += 64) {
            uint8_t sc1, m1, sc2, m2;
            scale_min_k4(2 * j, x[i].scales, &sc1, &m1);
            scale_min_k4(2 * j + 1, x[i].scales, &sc2, &m2);
            int s1 = 0, s2 = 0;
            for (int l = 0; l < 32; l++) {
                s1 += ((q[l] & 0xF) | (((x[i].qh[l] >> (2 * j)) & 1) << 4)) * q8[l];
                s2 += ((q[l] >> 4) | (((x[i].qh[l] >> (2 * j + 1)) & 1) << 4)) * q8[l + 32];
            }
            sumi += sc1 * s1 + sc2 * s2;
            summ += m1 * (y[i].bsums[4 * j] + y[i].bsums[4 * j + 1]) +
                    m2 * (y[i].bsums[4 * j + 2] + y[i].bsums[4 * j + 3]);
        }
        sum += k_block(half_to_f32(x[i].d), half_to_f32(x[i].dmin), y[i].d, sumi, summ);
    }
    return sum;
}

static float dot_q6_K_scalar(int64_t n, const void * w, const void * a) {
    const block_q6_K * x = w;
    const block_q8_K * y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++) {
        int sumi = 0;
        int8_t q[128];
        for (int h = 0; h < 2; h++) {
            q6_half(x[i].ql + 64 * h, x[i].qh + 32 * h, q);
            const int8_t * q8 = y[i].qs + 128 * h;
            for (int g = 0; g < 8; g++) {  // groups of 16 sharing a scale
                int s = 0;
                for (int e = 16 * g; e < 16 * g + 16; e++) s += q[e] * q8[e];
                sumi += x[i].scales[8 * h + g] * s;
            }
        }
        sum += (half_to_f32(x[i].d) * y[i].d) * (float) sumi;
    }
    return sum;
}

// Q2_K / Q3_K: per sub-block j the exact sum S_j of q y; Q2_K's mins come
// from the activation's group sums (d y_d sum sc S - dmin y_d sum m bsum),
// Q3_K's offset of 4 too (sum s (S - 4 bsum)).
static float dot_q2_K_scalar(int64_t n, const void * w, const void * a) {
    const block_q2_K * x = w;
    const block_q8_K * y = a;
    float sum = 0.0f;
    uint8_t q[32];
    for (int64_t i = 0; i < n / QK_K; i++) {
        int sumi = 0, summ = 0;
        for (int k = 0; k < 8; k++) {
            k16_chunk(x[i].qs, NULL, k, q);
            for (int h = 0; h < 2; h++) {
                const int j = 2 * k + h;
                int s = 0;
                for (int l = 0; l < 16; l++) s += q[16 * h + l] * y[i].qs[16 * j + l];
                sumi += (x[i].scales[j] & 0xF) * s;
                summ += (x[i].scales[j] >> 4) * y[i].bsums[j];
            }
        }
        sum += k_block(half_to_f32(x[i].d), half_to_f32(x[i].dmin), y[i].d, sumi, summ);
    }
    return sum;
}

static float dot_q3_K_scalar(int64_t n, const void * w, const void * a) {
    const block_q3_K * x = w;
    const block_q8_K * y = a;
    float sum = 0.0f;
    uint8_t q[32];
    int8_t sc[16];
    for (int64_t i = 0; i < n / QK_K; i++) {
        unpack_scales_q3_K(x[i].scales, sc);
        int sumi = 0;
        for (int k = 0; k < 8; k++) {
            k16_chunk(x[i].qs, x[i].hmask, k, q);
            for (int h = 0; h < 2; h++) {
                const int j = 2 * k + h;
                int s = 0;
                for (int l = 0; l < 16; l++) s += q[16 * h + l] * y[i].qs[16 * j + l];
                sumi += sc[j] * (s - 4 * y[i].bsums[j]);
            }
        }
        sum += (half_to_f32(x[i].d) * y[i].d) * (float) sumi;
    }
    return sum;
}

/* ---- AVX2 dot products --------------------------------------------------- */

#if defined(ES_HAVE_AVX2)

// binary16 -> binary32 for every half, filled (from half_to_f32) before the
// AVX2 set is published. A lookup is one load, where vcvtph2ps would compete
// with the broadcasts for the shuffle port in the per-block scale products.
static float half_table[1 << 16];

static void init_half_table(void) {
    for (uint32_t h = 0; h < (1u << 16); h++) half_table[h] = half_to_f32((es_half) h);
}

static inline float h2f(es_half h) { return half_table[h]; }

static inline ES_AVX2 float hsum_f32x8(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

// 16 bytes of nibbles -> 32 bytes: low nibbles (elements 0..15), then high
// (16..31). A broadcast load and a blend instead of an insert, which would
// compete with the scale broadcasts for the shuffle port.
static inline ES_AVX2 __m256i unpack_nibbles(const uint8_t * p) {
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) p));
    const __m256i v = _mm256_blend_epi32(b, _mm256_srli_epi16(b, 4), 0xF0);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

// 32 bits -> 32 bytes, 0xFF where bit j of qh is set.
static inline ES_AVX2 __m256i expand_bits(const uint8_t * p) {
    uint32_t qh;
    memcpy(&qh, p, 4);
    // Byte j takes qh's byte j / 8, then tests bit j % 8 of it.
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int) qh),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x((int64_t) 0x8040201008040201ull);
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

// 8 lanes of pairwise-summed u8 x s8 products as int32 (4 products per lane).
static inline ES_AVX2 __m256i dot_u8s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// The same for s8 x s8, moving x's sign onto y (|x| <= 128 fits u8).
static inline ES_AVX2 __m256i dot_s8s8(__m256i x, __m256i y) {
    return dot_u8s8(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x));
}

static ES_AVX2 float dot_f32_avx2(int64_t n, const void * w, const void * a) {
    const float * x = w, * y = a;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int k = 0; k < 4; k++)
            acc[k] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8 * k), _mm256_loadu_ps(y + i + 8 * k), acc[k]);
    for (; i + 8 <= n; i += 8)
        acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), acc[0]);
    float sum = hsum_f32x8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    for (; i < n; i++) sum += x[i] * y[i];
    return sum;
}

static inline ES_AVX2 __m256 load_f16x8(const es_half * p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) p));
}

static inline ES_AVX2 __m256 load_bf16x8(const uint16_t * p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *) p)), 16));
}

static ES_AVX2 float dot_f16_avx2(int64_t n, const void * w, const void * a) {
    const es_half * x = w, * y = a;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int k = 0; k < 4; k++)
            acc[k] = _mm256_fmadd_ps(load_f16x8(x + i + 8 * k), load_f16x8(y + i + 8 * k), acc[k]);
    for (; i + 8 <= n; i += 8) acc[0] = _mm256_fmadd_ps(load_f16x8(x + i), load_f16x8(y + i), acc[0]);
    float sum = hsum_f32x8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    for (; i < n; i++) sum += half_to_f32(x[i]) * half_to_f32(y[i]);
    return sum;
}

static ES_AVX2 float dot_bf16_avx2(int64_t n, const void * w, const void * a) {
    const uint16_t * x = w, * y = a;
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int k = 0; k < 2; k++)
            acc[k] = _mm256_fmadd_ps(load_bf16x8(x + i + 8 * k), load_bf16x8(y + i + 8 * k), acc[k]);
    float sum = hsum_f32x8(_mm256_add_ps(acc[0], acc[1]));
    for (; i < n; i++) sum += bf16_to_f32(x[i]) * bf16_to_f32(y[i]);
    return sum;
}

static ES_AVX2 void axpy_f16_avx2(int64_t n, float e, const uint16_t * v, float * acc) {
    const __m256 ev = _mm256_set1_ps(e);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(ev, load_f16x8(v + i), _mm256_loadu_ps(acc + i)));
    for (; i < n; i++) acc[i] = fmaf(e, half_to_f32(v[i]), acc[i]);
}

// The batched kernels: NT activation rows (tokens) against one weight row,
// NT = 1..MAX_NT instantiated from one template per type. Each weight block
// is loaded and unpacked once and then used for every token, so a batch of
// NT tokens costs one pass over the weights plus NT passes of multiply-adds.
// Every token goes through the same sequence of float operations whatever
// NT is (the integer parts are exact), so es_matmat's rows equal
// es_matvec's bit for bit and the engine stays batch-invariant.
#define MAX_NT 8

// The 32-element quants. A block unpacks to `w8`: the signed types keep
// |q| (a u8 operand for maddubs) and q (whose sign moves onto the
// activation, so |q| y keeps q y's sign); the types with a min keep q >= 0.
typedef struct { __m256i mag, sgn; } w8;

static inline ES_AVX2 w8 signed_w8(__m256i q) { return (w8) {_mm256_sign_epi8(q, q), q}; }

static inline ES_AVX2 w8 unpack_q4_0(const block_q4_0 * x) {
    return signed_w8(_mm256_sub_epi8(unpack_nibbles(x->qs), _mm256_set1_epi8(8)));
}
static inline ES_AVX2 w8 unpack_q5_0(const block_q5_0 * x) {
    // q - 16 as a signed byte: the nibble where the fifth bit is set,
    // else the nibble with 0xF0 on top (nibble - 16 in two's complement).
    const __m256i hi = _mm256_andnot_si256(expand_bits(x->qh), _mm256_set1_epi8((char) 0xF0));
    return signed_w8(_mm256_or_si256(unpack_nibbles(x->qs), hi));
}
static inline ES_AVX2 w8 unpack_q8_0(const block_q8_0 * x) {
    return signed_w8(_mm256_loadu_si256((const __m256i *) x->qs));
}
static inline ES_AVX2 w8 unpack_q4_1(const block_q4_1 * x) { return (w8) {unpack_nibbles(x->qs), _mm256_setzero_si256()}; }
static inline ES_AVX2 w8 unpack_q5_1(const block_q5_1 * x) {
    const __m256i hi = _mm256_and_si256(expand_bits(x->qh), _mm256_set1_epi8(0x10));
    return (w8) {_mm256_or_si256(unpack_nibbles(x->qs), hi), _mm256_setzero_si256()};
}

// One token's block product: 8 int32 lanes of exact partial sums, as floats.
static inline ES_AVX2 __m256 prod_signed(w8 q, const int8_t * y) {
    const __m256i yv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *) y), q.sgn);
    return _mm256_cvtepi32_ps(dot_u8s8(q.mag, yv));
}
static inline ES_AVX2 __m256 prod_unsigned(w8 q, const int8_t * y) {
    return _mm256_cvtepi32_ps(dot_u8s8(q.mag, _mm256_loadu_si256((const __m256i *) y)));
}

// Per token, even blocks go to acc0 and odd ones to acc1 (two FMA chains);
// with a min (Q4_1, Q5_1), m_x s_y sums the same way in m0 / m1.
#define DOT32(NAME, NT, ATTR, block_t, act_t, UNPACK, PROD, MIN_TERM)                        \
    static ATTR void NAME(int64_t n, const void * w, const void * a, size_t a_stride,     \
                             float * out) {                                                 \
        const block_t * x = w;                                                              \
        const act_t *   y[NT];                                                              \
        __m256 acc0[NT], acc1[NT];                                                          \
        float  m0[NT], m1[NT];                                                              \
        for (int t = 0; t < NT; t++) {                                                      \
            y[t] = (const act_t *) ((const uint8_t *) a + (size_t) t * a_stride);           \
            acc0[t] = acc1[t] = _mm256_setzero_ps();                                        \
            m0[t] = m1[t] = 0.0f;                                                           \
        }                                                                                   \
        const int64_t nb = n / QK;                                                          \
        int64_t i = 0;                                                                      \
        for (; i + 1 < nb; i += 2) {                                                        \
            const w8 q0 = UNPACK(x + i), q1 = UNPACK(x + i + 1);                            \
            const float d0 = h2f(x[i].d), d1 = h2f(x[i + 1].d);                             \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                          \
                acc0[t] = _mm256_fmadd_ps(_mm256_set1_ps(d0 * h2f(y[t][i].d)),              \
                                          PROD(q0, y[t][i].qs), acc0[t]);                   \
                acc1[t] = _mm256_fmadd_ps(_mm256_set1_ps(d1 * h2f(y[t][i + 1].d)),          \
                                          PROD(q1, y[t][i + 1].qs), acc1[t]);               \
                m0[t] += MIN_TERM(x, y[t], i);                                              \
                m1[t] += MIN_TERM(x, y[t], i + 1);                                          \
            }                                                                               \
        }                                                                                   \
        if (i < nb) {                                                                       \
            const w8 q0 = UNPACK(x + i);                                                    \
            const float d0 = h2f(x[i].d);                                                   \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                          \
                acc0[t] = _mm256_fmadd_ps(_mm256_set1_ps(d0 * h2f(y[t][i].d)),              \
                                          PROD(q0, y[t][i].qs), acc0[t]);                   \
                m0[t] += MIN_TERM(x, y[t], i);                                              \
            }                                                                               \
        }                                                                                   \
        for (int t = 0; t < NT; t++)                                                        \
            out[t] = hsum_f32x8(_mm256_add_ps(acc0[t], acc1[t])) + (m0[t] + m1[t]);         \
    }

// Block i's m_x s_y: the types with a min (Q4_1, Q5_1 against Q8_1), or none
// (m0, m1 stay 0 and the final + 0 folds away).
#define WITH_MIN(x, y, i) (h2f((x)[i].m) * h2f((y)[i].s))
#define NO_MIN(x, y, i)   0.0f

static inline ES_AVX2 __m256i shuffle16(__m256i v, const uint8_t mask[32]) {
    return _mm256_shuffle_epi8(v, _mm256_loadu_si256((const __m256i *) mask));
}

// 8 bytes -> 8 int16 in both 128-bit lanes (zero- or sign-extended).
static inline ES_AVX2 __m256i u8x8_to_i16x2(const uint8_t * p) {
    return _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *) p)));
}
static inline ES_AVX2 __m256i s8x8_to_i16x2(const int8_t * p) {
    return _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *) p)));
}

// sum over sub-blocks of min[j] * (bsums[2j] + bsums[2j+1]), exact.
static inline ES_AVX2 int k4_mins(const uint8_t m[8], const int16_t * bsums) {
    const __m256i b = _mm256_loadu_si256((const __m256i *) bsums);  // 16 x int16
    const __m128i pairs = _mm_hadd_epi16(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *) m));
    __m128i p = _mm_madd_epi16(mins, pairs);  // 4 x int32
    p = _mm_add_epi32(p, _mm_shuffle_epi32(p, _MM_SHUFFLE(1, 0, 3, 2)));
    p = _mm_add_epi32(p, _mm_shuffle_epi32(p, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(p);
}

// Q4_K / Q5_K chunk j (64 elements: two sub-blocks of 32 sharing 32 bytes
// of nibbles) as u8 values: lo = sub-block 2j, hi = sub-block 2j + 1.
typedef struct { __m256i lo, hi; } k4_chunk;

static inline ES_AVX2 k4_chunk unpack_q4_K(const block_q4_K * x, int j, __m256i hbits) {
    (void) hbits;
    const __m256i bits = _mm256_loadu_si256((const __m256i *) (x->qs + 32 * j));
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    return (k4_chunk) {_mm256_and_si256(bits, m4), _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4)};
}
static inline ES_AVX2 k4_chunk unpack_q5_K(const block_q5_K * x, int j, __m256i hbits) {
    const __m256i bits = _mm256_loadu_si256((const __m256i *) (x->qs + 32 * j));
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    // Bit 2j (2j+1) of each qh byte, moved to bit 4; 16-bit shifts are fine
    // since the AND keeps only each byte's own bit.
    const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j), one), 4);
    const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j + 1), one), 4);
    return (k4_chunk) {_mm256_or_si256(_mm256_and_si256(bits, m4), h0),
                       _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4), h1)};
}
static inline ES_AVX2 __m256i qh_q4_K(const block_q4_K * x) { (void) x; return _mm256_setzero_si256(); }
static inline ES_AVX2 __m256i qh_q5_K(const block_q5_K * x) { return _mm256_loadu_si256((const __m256i *) x->qh); }

// A super-block's 8 sub-block products p[j] (maddubs: 16 int16, each two
// q y terms) weighted by the sub-block scales, as 8 int32. Two levels of
// pairwise adds in int16 first (8 terms of |q y| <= 31 * 128, Q5_K's worst,
// fit) leave two widening multiplies by the scales instead of eight, which
// matters where the multiplier is the scarce unit (one pipe on Zen 1).
static const uint8_t DUP16[2][32] = {  // int16 (0,0,1,1,2,2,3,3) and (4,4,..,7,7), both lanes
#define D(k) 2*k, 2*k+1, 2*k, 2*k+1
    {D(0), D(1), D(2), D(3), D(0), D(1), D(2), D(3)},
    {D(4), D(5), D(6), D(7), D(4), D(5), D(6), D(7)},
#undef D
};

static inline ES_AVX2 __m256i reduce_k4(const __m256i p[8], const __m256i s[2]) {
    // hadd per 128-bit lane: (a0+a1, .., a6+a7, b0+b1, .., b6+b7); after two
    // levels lanes (0,0,1,1,2,2,3,3) hold sub-blocks 0..3, then 4..7.
    const __m256i h01 = _mm256_hadd_epi16(p[0], p[1]), h23 = _mm256_hadd_epi16(p[2], p[3]);
    const __m256i h45 = _mm256_hadd_epi16(p[4], p[5]), h67 = _mm256_hadd_epi16(p[6], p[7]);
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_hadd_epi16(h01, h23), s[0]),
                            _mm256_madd_epi16(_mm256_hadd_epi16(h45, h67), s[1]));
}

// The K-quant kernels' per-set parts for one super-block: its scales,
// prepared once for all tokens in the layout the set's token step reads, and
// that step, into the token's float accumulator (acc) and, on AVX2, the sum of
// its min terms kept apart (summ).
typedef struct {
    __m256i s[8];   // AVX2: s[0..1] in DUP16 order; VNNI: sub-block k's scale in every int16
    __m256i mins;   // VNNI: (m0, m0, m1, m1, .., m7, m7) as int16, one per bsums group
    uint8_t m[8];   // AVX2: the mins as bytes (k4_mins)
} k4_scales;

static inline ES_AVX2 k4_scales k4_scales_avx2(const uint8_t sc[8], const uint8_t m[8]) {
    k4_scales k = {0};
    const __m256i sc16 = u8x8_to_i16x2(sc);
    k.s[0] = shuffle16(sc16, DUP16[0]), k.s[1] = shuffle16(sc16, DUP16[1]);
    memcpy(k.m, m, sizeof(k.m));
    return k;
}

// Q4_K / Q5_K on AVX2: one token's exact int32 sums of scale * q * y, then by
// FMA d y_d sumi, and dmin y_d sum(min bsum) summed apart.
static inline ES_AVX2 void k4_token_avx2(__m256 * acc, float * summ, const __m256i q[8], const k4_scales * k,
                                         const block_q8_K * y, float d, float dmin) {
    __m256i p[8];
    for (int j = 0; j < 8; j++) p[j] = _mm256_maddubs_epi16(q[j], _mm256_loadu_si256((const __m256i *) (y->qs + 32 * j)));
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(d * y->d), _mm256_cvtepi32_ps(reduce_k4(p, k->s)), *acc);
    *summ += (dmin * y->d) * (float) k4_mins(k->m, y->bsums);
}

// Q4_K / Q5_K for NT tokens, SET's scales and token step (the sub-blocks
// unpacked once for all tokens).
#define DOT_K4(NAME, NT, T, ATTR, SET)                                                        \
    static ATTR void NAME(int64_t n, const void * w, const void * a, size_t a_stride,        \
                          float * out) {                                                    \
        const block_##T *  x = w;                                                           \
        const block_q8_K * y[NT];                                                           \
        __m256 acc[NT];                                                                     \
        float  summ[NT];                                                                    \
        for (int t = 0; t < NT; t++) {                                                      \
            y[t] = (const block_q8_K *) ((const uint8_t *) a + (size_t) t * a_stride);      \
            acc[t] = _mm256_setzero_ps();                                                   \
            summ[t] = 0.0f;                                                                 \
        }                                                                                   \
        for (int64_t i = 0; i < n / QK_K; i++) {                                            \
            uint8_t sc[8], m[8];                                                            \
            unpack_scales_k4(x[i].scales, sc, m);                                           \
            const k4_scales k = k4_scales_##SET(sc, m);                                     \
            const __m256i hbits = qh_##T(x + i);                                            \
            __m256i q[8];  /* sub-blocks 0..7 as u8, unpacked once for all tokens */        \
            for (int j = 0; j < 4; j++) {                                                   \
                const k4_chunk c = unpack_##T(x + i, j, hbits);                             \
                q[2 * j] = c.lo, q[2 * j + 1] = c.hi;                                       \
            }                                                                               \
            const float d = h2f(x[i].d), dmin = h2f(x[i].dmin);                             \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++)                            \
                k4_token_##SET(&acc[t], &summ[t], q, &k, y[t] + i, d, dmin);                \
        }                                                                                   \
        for (int t = 0; t < NT; t++) out[t] = hsum_f32x8(acc[t]) - summ[t];                 \
    }

// Q6_K half h (128 elements) as u8 values 0..63, quarters k = 0..3.
typedef struct { __m256i q[4]; } q6_half_v;

static inline ES_AVX2 q6_half_v unpack_q6_K(const block_q6_K * x, int h) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    const uint8_t * ql = x->ql + 64 * h;
    const __m256i l0 = _mm256_loadu_si256((const __m256i *) ql);
    const __m256i l1 = _mm256_loadu_si256((const __m256i *) (ql + 32));
    const __m256i hb = _mm256_loadu_si256((const __m256i *) (x->qh + 32 * h));
    return (q6_half_v) {{
        _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m2), 4)),
        _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m2), 4)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m2), 4)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m2), 4)),
    }};
}

// Scales for one Q6_K half after one level of hadd (see reduce_q6_K):
// PAIRED16[k] puts int16 a in lanes 0..3 and b in 4..7 of the low 128 bits,
// a + 1 and b + 1 in the high ones, for (a, b) = (0, 2) and (4, 6).
static const uint8_t PAIRED16[2][32] = {
#define Q(k) 2*k, 2*k+1, 2*k, 2*k+1, 2*k, 2*k+1, 2*k, 2*k+1
    {Q(0), Q(2), Q(1), Q(3)},
    {Q(4), Q(6), Q(5), Q(7)},
#undef Q
};

// Q6_K: sum sc (q - 32) y = sum sc q y - 32 sum_g sc_g bsum_g, the offset
// once per super-block from the group sums. Quarter k's maddubs holds in
// lanes 0..7 elements 0..15 (scale 2k), in lanes 8..15 elements 16..31
// (scale 2k + 1); its terms (|q y| <= 63 * 128) take one level of pairwise
// adds in int16 before the widening multiply by the scales.
static inline ES_AVX2 __m256i reduce_q6_K(const __m256i p[4], const __m256i s[2]) {
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_hadd_epi16(p[0], p[1]), s[0]),
                            _mm256_madd_epi16(_mm256_hadd_epi16(p[2], p[3]), s[1]));
}

// One Q6_K half's scales in the layout its set's token step reads (AVX2:
// s[0..1], PAIRED16 order; VNNI: s[k], quarter k's low and high scales), and
// that step, into one token's two int32 sums (AVX2 uses the first).
typedef struct { __m256i s[4]; } q6_scales;

static inline ES_AVX2 q6_scales q6_scales_avx2(const block_q6_K * x, int h, __m256i sc16) {
    (void) sc16;
    const __m256i scales = s8x8_to_i16x2(x->scales + 8 * h);
    return (q6_scales) {{shuffle16(scales, PAIRED16[0]), shuffle16(scales, PAIRED16[1])}};
}

static inline ES_AVX2 void q6_token_avx2(__m256i sumi[2], const q6_half_v * q, const q6_scales * s,
                                         const int8_t * q8) {
    __m256i p[4];
    for (int k = 0; k < 4; k++) p[k] = _mm256_maddubs_epi16(q->q[k], _mm256_loadu_si256((const __m256i *) (q8 + 32 * k)));
    sumi[0] = _mm256_add_epi32(sumi[0], reduce_q6_K(p, s->s));
}

#define DOT_Q6K(NAME, NT, ATTR, SET)                                                          \
    static ATTR void NAME(int64_t n, const void * w, const void * a, size_t a_stride,        \
                          float * out) {                                                    \
        const block_q6_K * x = w;                                                           \
        const block_q8_K * y[NT];                                                           \
        __m256 acc[NT];                                                                     \
        for (int t = 0; t < NT; t++) {                                                      \
            y[t] = (const block_q8_K *) ((const uint8_t *) a + (size_t) t * a_stride);      \
            acc[t] = _mm256_setzero_ps();                                                   \
        }                                                                                   \
        for (int64_t i = 0; i < n / QK_K; i++) {                                            \
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) x[i].scales)); \
            __m256i sumi[NT][2];                                                            \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                          \
                const __m256i bsums = _mm256_loadu_si256((const __m256i *) y[t][i].bsums);  \
                sumi[t][0] = _mm256_sub_epi32(_mm256_setzero_si256(),                       \
                                              _mm256_slli_epi32(_mm256_madd_epi16(bsums, sc16), 5)); \
                sumi[t][1] = _mm256_setzero_si256();                                        \
            }                                                                               \
            for (int h = 0; h < 2; h++) {                                                   \
                const q6_half_v q = unpack_q6_K(x + i, h);                                  \
                const q6_scales s = q6_scales_##SET(x + i, h, sc16);                        \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++)                        \
                    q6_token_##SET(sumi[t], &q, &s, y[t][i].qs + 128 * h);                  \
            }                                                                               \
            const float d = h2f(x[i].d);                                                    \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++)                            \
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * y[t][i].d),                     \
                                         _mm256_cvtepi32_ps(_mm256_add_epi32(sumi[t][0], sumi[t][1])), acc[t]); \
        }                                                                                   \
        for (int t = 0; t < NT; t++) out[t] = hsum_f32x8(acc[t]);                           \
    }

// Every type's kernels for NT = 1..MAX_NT, the table es_matmat indexes
// (dotn_T_avx2[nt - 1]), and es_matvec's one-token function.
#define NT_TABLE(T) NT_TABLE_SET(T, avx2, ES_AVX2)
#define NT_TABLE_SET(T, SET, ATTR)                                                            \
    static const vec_dotn_fn dotn_##T##_##SET[MAX_NT] = {EACH_NT(NT_NAME, dot_##T##_##SET##_)}; \
    static ATTR float dot_##T##_##SET(int64_t n, const void * w, const void * a) {          \
        float r;                                                                            \
        dot_##T##_##SET##_1(n, w, a, 0, &r);                                                \
        return r;                                                                           \
    }

#define DOT32_NT(T, NT) DOT32(dot_##T##_avx2_##NT, NT, ES_AVX2, block_##T, DOT32_ACT_##T, unpack_##T, DOT32_PROD_##T, DOT32_MIN_##T)
#define DOT32_PROD_q4_0 prod_signed
#define DOT32_PROD_q5_0 prod_signed
#define DOT32_PROD_q8_0 prod_signed
#define DOT32_PROD_q4_1 prod_unsigned
#define DOT32_PROD_q5_1 prod_unsigned
#define DOT32_MIN_q4_0 NO_MIN
#define DOT32_MIN_q5_0 NO_MIN
#define DOT32_MIN_q8_0 NO_MIN
#define DOT32_MIN_q4_1 WITH_MIN
#define DOT32_MIN_q5_1 WITH_MIN
#define DOT_K4_NT(T, NT) DOT_K4(dot_##T##_avx2_##NT, NT, T, ES_AVX2, avx2)
#define DOT_Q6K_NT(T, NT) DOT_Q6K(dot_##T##_avx2_##NT, NT, ES_AVX2, avx2)

EACH_NT(DOT32_NT, q4_0) NT_TABLE(q4_0)
EACH_NT(DOT32_NT, q5_0) NT_TABLE(q5_0)
EACH_NT(DOT32_NT, q8_0) NT_TABLE(q8_0)
EACH_NT(DOT32_NT, q4_1) NT_TABLE(q4_1)
EACH_NT(DOT32_NT, q5_1) NT_TABLE(q5_1)
EACH_NT(DOT_K4_NT, q4_K) NT_TABLE(q4_K)
EACH_NT(DOT_K4_NT, q5_K) NT_TABLE(q5_K)
EACH_NT(DOT_Q6K_NT, q6_K) NT_TABLE(q6_K)

// Q2_K / Q3_K: chunk k (32 elements, sub-blocks 2k and 2k + 1) as u8
// values, unpacked once for all tokens; a token's maddubs against it holds
// sub-block 2k in the low 128 bits and 2k + 1 in the high, so one widening
// multiply by (scale 2k, scale 2k + 1) weights both. The part of the sum
// that does not depend on q comes from the activation's group sums: Q3_K's
// offset of 4 (in the exact int32 sum), Q2_K's mins (apart, times dmin).
static inline ES_AVX2 __m256i k16_bits(const uint8_t * qs, int k) {
    const __m256i b = _mm256_loadu_si256((const __m256i *) (qs + 32 * (k / 4)));
    return _mm256_and_si256(_mm256_srli_epi16(b, 2 * (k % 4)), _mm256_set1_epi8(3));
}
static inline ES_AVX2 __m256i unpack_k16_q2_K(const block_q2_K * x, int k, __m256i hm) {
    (void) hm;
    return k16_bits(x->qs, k);
}
static inline ES_AVX2 __m256i unpack_k16_q3_K(const block_q3_K * x, int k, __m256i hm) {
    // Bit k of each hmask byte to bit 2 (16-bit shifts: the AND keeps each byte's own bit).
    const __m256i h = _mm256_and_si256(_mm256_srli_epi16(hm, k), _mm256_set1_epi8(1));
    return _mm256_or_si256(k16_bits(x->qs, k), _mm256_slli_epi16(h, 2));
}
static inline ES_AVX2 __m256i hm_q2_K(const block_q2_K * x) { (void) x; return _mm256_setzero_si256(); }
static inline ES_AVX2 __m256i hm_q3_K(const block_q3_K * x) { return _mm256_loadu_si256((const __m256i *) x->hmask); }

static inline ES_AVX2 int hsum_i32x8(__m256i v) {
    __m128i r = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    r = _mm_add_epi32(r, _mm_shuffle_epi32(r, _MM_SHUFFLE(1, 0, 3, 2)));
    r = _mm_add_epi32(r, _mm_shuffle_epi32(r, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(r);
}

// Per token: the int32 sum starts at -(group sums . m) for Q3_K, at 0 for
// Q2_K, whose mins sum apart as an int times dmin y_d.
#define K16_INIT_q2_K(bs, m16) _mm256_setzero_si256()
#define K16_INIT_q3_K(bs, m16) _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_madd_epi16(bs, m16))
#define K16_MIN_q2_K(bs, m16)  hsum_i32x8(_mm256_madd_epi16(bs, m16))
#define K16_MIN_q3_K(bs, m16)  0
#define K16_DMIN_q2_K(x)       h2f((x).dmin)
#define K16_DMIN_q3_K(x)       0.0f

#define DOT_K16(NAME, NT, T)                                                                  \
    static ES_AVX2 void NAME(int64_t n, const void * w, const void * a, size_t a_stride,     \
                             float * out) {                                                 \
        const block_##T *  x = w;                                                           \
        const block_q8_K * y[NT];                                                           \
        __m256 acc[NT];                                                                     \
        float  summ[NT];                                                                    \
        for (int t = 0; t < NT; t++) {                                                      \
            y[t] = (const block_q8_K *) ((const uint8_t *) a + (size_t) t * a_stride);      \
            acc[t] = _mm256_setzero_ps();                                                   \
            summ[t] = 0.0f;                                                                 \
        }                                                                                   \
        for (int64_t i = 0; i < n / QK_K; i++) {                                            \
            int16_t s[16], m[16];                                                           \
            k16_scales_##T(x + i, s, m);                                                    \
            const __m256i m16 = _mm256_loadu_si256((const __m256i *) m);                    \
            const __m256i hm = hm_##T(x + i);                                               \
            __m256i q[8], sv[8];  /* chunks as u8, and their two scales per lane */         \
            for (int k = 0; k < 8; k++) {                                                   \
                q[k] = unpack_k16_##T(x + i, k, hm);                                        \
                sv[k] = _mm256_set_m128i(_mm_set1_epi16(s[2 * k + 1]), _mm_set1_epi16(s[2 * k])); \
            }                                                                               \
            const float d = h2f(x[i].d), dmin = K16_DMIN_##T(x[i]);                         \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                          \
                const __m256i bs = _mm256_loadu_si256((const __m256i *) y[t][i].bsums);     \
                __m256i sumi = K16_INIT_##T(bs, m16);                                       \
                for (int k = 0; k < 8; k++) {                                               \
                    const __m256i p = _mm256_maddubs_epi16(q[k], _mm256_loadu_si256((const __m256i *) (y[t][i].qs + 32 * k))); \
                    sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, sv[k]));             \
                }                                                                           \
                const float yd = y[t][i].d;                                                 \
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * yd), _mm256_cvtepi32_ps(sumi), acc[t]); \
                summ[t] += (dmin * yd) * (float) K16_MIN_##T(bs, m16);                      \
            }                                                                               \
        }                                                                                   \
        for (int t = 0; t < NT; t++) out[t] = hsum_f32x8(acc[t]) - summ[t];                 \
    }
#define DOT_K16_NT(T, NT) DOT_K16(dot_##T##_avx2_##NT, NT, T)

EACH_NT(DOT_K16_NT, q2_K) NT_TABLE(q2_K)
EACH_NT(DOT_K16_NT, q3_K) NT_TABLE(q3_K)

/* ---- AVX-512 VNNI (256-bit vectors) -------------------------------------- */

// The AVX2 kernels with AVX-512 VNNI's fused integer dot products, still on
// 256-bit vectors (32 registers with VL): vpdpbusd sums four u8 x s8
// products into an int32 lane in one instruction where AVX2 needs maddubs
// and madd, and vpdpwssd weights the K-quants' int16 pair sums by their
// sub-block scales as it accumulates, where AVX2 needs three levels of hadd
// (the shuffle port) and a madd. Verifying k tokens costs k times this
// per-token part and one unpack, so it is the part worth cutting.
// F32/F16/BF16 and Q2_K/Q3_K keep the AVX2 kernels.
#define ES_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

// The 32-element quants: the same int32 lanes as dot_u8s8's (four products
// each, no int16 stage to saturate), so these kernels equal the AVX2 ones
// bit for bit.
static inline ES_AVX512 __m256 prod_signed_vnni(w8 q, const int8_t * y) {
    const __m256i yv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *) y), q.sgn);
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), q.mag, yv));
}
static inline ES_AVX512 __m256 prod_unsigned_vnni(w8 q, const int8_t * y) {
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), q.mag,
                                                  _mm256_loadu_si256((const __m256i *) y)));
}

// Q4_K / Q5_K: sub-block k's maddubs (16 int16, pairs of q y, |.| <= 2 * 31
// * 128 for Q5_K) times its scale, summed into int32 lanes by vpdpwssd in
// two chains (even and odd sub-blocks); the mins as a vector of
// min[j] (bsums[2j] + bsums[2j+1]) taken off the same float accumulator.
static inline ES_AVX512 k4_scales k4_scales_vnni(const uint8_t sc[8], const uint8_t m[8]) {
    k4_scales k = {0};
    const __m256i sc16 = u8x8_to_i16x2(sc);
    for (int j = 0; j < 8; j++) k.s[j] = _mm256_permutexvar_epi16(_mm256_set1_epi16((short) j), sc16);
    const __m128i mv = _mm_loadl_epi64((const __m128i *) m);
    k.mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mv, mv));
    return k;
}

static inline ES_AVX512 void k4_token_vnni(__m256 * acc, float * summ, const __m256i q[8], const k4_scales * k,
                                           const block_q8_K * y, float d, float dmin) {
    (void) summ;  // the mins go into acc
    __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
    for (int j = 0; j < 8; j += 2) {
        const __m256i p0 = _mm256_maddubs_epi16(q[j], _mm256_loadu_si256((const __m256i *) (y->qs + 32 * j)));
        const __m256i p1 = _mm256_maddubs_epi16(q[j + 1], _mm256_loadu_si256((const __m256i *) (y->qs + 32 * j + 32)));
        even = _mm256_dpwssd_epi32(even, p0, k->s[j]);
        odd = _mm256_dpwssd_epi32(odd, p1, k->s[j + 1]);
    }
    const __m256i msum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *) y->bsums), k->mins);
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(d * y->d), _mm256_cvtepi32_ps(_mm256_add_epi32(even, odd)), *acc);
    *acc = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * y->d), _mm256_cvtepi32_ps(msum), *acc);
}

// Q6_K: quarter k of half h holds elements with scale 8h + 2k in its low
// 128 bits and 8h + 2k + 1 in its high ones (see reduce_q6_K), so each
// quarter's maddubs goes into the sum by one vpdpwssd with those scales, in
// two chains (even and odd quarters).
// From all 16 scales as int16: scale s in the low 128 bits, s + 1 in the high.
static inline ES_AVX512 __m256i q6_scale_pair(__m256i sc16, int s) {
    return _mm256_permutexvar_epi16(_mm256_inserti128_si256(_mm256_set1_epi16((short) s),
                                                            _mm_set1_epi16((short) (s + 1)), 1), sc16);
}

static inline ES_AVX512 q6_scales q6_scales_vnni(const block_q6_K * x, int h, __m256i sc16) {
    (void) x;
    q6_scales s;
    for (int k = 0; k < 4; k++) s.s[k] = q6_scale_pair(sc16, 8 * h + 2 * k);
    return s;
}

static inline ES_AVX512 void q6_token_vnni(__m256i sumi[2], const q6_half_v * q, const q6_scales * s,
                                           const int8_t * q8) {
    for (int k = 0; k < 4; k += 2) {
        sumi[0] = _mm256_dpwssd_epi32(sumi[0], _mm256_maddubs_epi16(q->q[k], _mm256_loadu_si256((const __m256i *) (q8 + 32 * k))), s->s[k]);
        sumi[1] = _mm256_dpwssd_epi32(sumi[1], _mm256_maddubs_epi16(q->q[k + 1], _mm256_loadu_si256((const __m256i *) (q8 + 32 * k + 32))), s->s[k + 1]);
    }
}

#define DOT32_VNNI_NT(T, NT) DOT32(dot_##T##_avx512_##NT, NT, ES_AVX512, block_##T, DOT32_ACT_##T, unpack_##T, \
                                   DOT32_PROD_##T##_vnni, DOT32_MIN_##T)
#define DOT32_PROD_q4_0_vnni prod_signed_vnni
#define DOT32_PROD_q5_0_vnni prod_signed_vnni
#define DOT32_PROD_q8_0_vnni prod_signed_vnni
#define DOT32_PROD_q4_1_vnni prod_unsigned_vnni
#define DOT32_PROD_q5_1_vnni prod_unsigned_vnni
#define DOT_K4_VNNI_NT(T, NT) DOT_K4(dot_##T##_avx512_##NT, NT, T, ES_AVX512, vnni)
#define DOT_Q6K_VNNI_NT(T, NT) DOT_Q6K(dot_##T##_avx512_##NT, NT, ES_AVX512, vnni)
#define NT_TABLE_VNNI(T) NT_TABLE_SET(T, avx512, ES_AVX512)

EACH_NT(DOT32_VNNI_NT, q4_0) NT_TABLE_VNNI(q4_0)
EACH_NT(DOT32_VNNI_NT, q5_0) NT_TABLE_VNNI(q5_0)
EACH_NT(DOT32_VNNI_NT, q8_0) NT_TABLE_VNNI(q8_0)
EACH_NT(DOT32_VNNI_NT, q4_1) NT_TABLE_VNNI(q4_1)
EACH_NT(DOT32_VNNI_NT, q5_1) NT_TABLE_VNNI(q5_1)
EACH_NT(DOT_K4_VNNI_NT, q4_K) NT_TABLE_VNNI(q4_K)
EACH_NT(DOT_K4_VNNI_NT, q5_K) NT_TABLE_VNNI(q5_K)
EACH_NT(DOT_Q6K_VNNI_NT, q6_K) NT_TABLE_VNNI(q6_K)
// Q2_K / Q3_K: the AVX2 kernels under this set's names.
#define dot_q2_K_avx512 dot_q2_K_avx2
#define dot_q3_K_avx512 dot_q3_K_avx2
#define dotn_q2_K_avx512 dotn_q2_K_avx2
#define dotn_q3_K_avx512 dotn_q3_K_avx2


#endif  // ES_HAVE_AVX2

/* ---- NEON dot products --------------------------------------------------- */

#if defined(__ARM_NEON) && defined(__aarch64__)

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

#define NEON_WITH_MIN(x, y, i) (half_to_f32((x)[i].m) * half_to_f32((y)[i].s))
#define NEON_NO_MIN(x, y, i)   0.0f

#define DOT32_NEON(NAME, NT, block_t, act_t, UNPACK, MIN_TERM)                                \
    static void NAME(int64_t n, const void * w, const void * a, size_t a_stride, float * out) { \
        const block_t * x = w;                                                              \
        const act_t *   y[NT];                                                              \
        float32x4_t acc[NT];                                                                \
        float summs[NT];                                                                    \
        for (int t = 0; t < NT; t++) {                                                      \
            y[t] = (const act_t *) ((const uint8_t *) a + (size_t) t * a_stride);           \
            acc[t] = vdupq_n_f32(0);                                                        \
            summs[t] = 0.0f;                                                                \
        }                                                                                   \
        for (int64_t i = 0; i < n / QK; i++) {                                              \
            const n8 q = UNPACK(x + i);                                                     \
            const float dx = half_to_f32(x[i].d);                                           \
            for (int t = 0; t < NT; t++) {                                                  \
                const int32x4_t s = vaddq_s32(dot_s8x16(q.lo, vld1q_s8(y[t][i].qs)),        \
                                              dot_s8x16(q.hi, vld1q_s8(y[t][i].qs + 16)));  \
                acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(s), dx * half_to_f32(y[t][i].d)); \
                summs[t] += MIN_TERM(x, y[t], i);                                           \
            }                                                                               \
        }                                                                                   \
        for (int t = 0; t < NT; t++) out[t] = vaddvq_f32(acc[t]) + summs[t];                \
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
        float sum[NT];                                                                      \
        for (int t = 0; t < NT; t++) {                                                      \
            y[t] = (const block_q8_K *) ((const uint8_t *) a + (size_t) t * a_stride);      \
            sum[t] = 0.0f;                                                                  \
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
                sum[t] += k_block(d, dmin, y[t][i].d, sumi[t], k4_mins_scalar(m, y[t][i].bsums)); \
        }                                                                                   \
        for (int t = 0; t < NT; t++) out[t] = sum[t];                                       \
    }

#define DOT_Q6K_NEON(NAME, NT)                                                                \
    static void NAME(int64_t n, const void * w, const void * a, size_t a_stride, float * out) { \
        const block_q6_K * x = w;                                                           \
        const block_q8_K * y[NT];                                                           \
        float sum[NT];                                                                      \
        for (int t = 0; t < NT; t++) {                                                      \
            y[t] = (const block_q8_K *) ((const uint8_t *) a + (size_t) t * a_stride);      \
            sum[t] = 0.0f;                                                                  \
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
            for (int t = 0; t < NT; t++) sum[t] += (d * y[t][i].d) * (float) sumi[t];       \
        }                                                                                   \
        for (int t = 0; t < NT; t++) out[t] = sum[t];                                       \
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
        float sum[NT], mins[NT];                                                            \
        for (int t = 0; t < NT; t++) {                                                      \
            y[t] = (const block_q8_K *) ((const uint8_t *) a + (size_t) t * a_stride);      \
            sum[t] = mins[t] = 0.0f;                                                        \
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
            const float d = half_to_f32(x[i].d), dmin = K16_DMIN_NEON_##T(x[i]);            \
            for (int t = 0; t < NT; t++) {                                                  \
                sum[t] += (d * y[t][i].d) * (float) (sumi[t] - K16_OFFSET_NEON_##T(summ[t])); \
                mins[t] += (dmin * y[t][i].d) * (float) (summ[t] - K16_OFFSET_NEON_##T(summ[t])); \
            }                                                                               \
        }                                                                                   \
        for (int t = 0; t < NT; t++) out[t] = sum[t] - mins[t];                             \
    }

// A super-block's float part: per token two sums of products (each
// contracted to the same FMA whatever NT; a difference of products would
// not be): Q2_K's scaled q sums and, apart, its mins times dmin; Q3_K's
// offset goes into the int sum, its mins term is 0.
#define K16_DMIN_NEON_q2_K(xb)  half_to_f32((xb).dmin)
#define K16_DMIN_NEON_q3_K(xb)  0.0f
#define K16_OFFSET_NEON_q2_K(summ) 0
#define K16_OFFSET_NEON_q3_K(summ) (summ)
#define DOT_K16_NEON_NT(T, NT) DOT_K16_NEON(dot_##T##_neon_##NT, NT, T)

EACH_NT(DOT_K16_NEON_NT, q2_K) NT_TABLE_NEON(q2_K)
EACH_NT(DOT_K16_NEON_NT, q3_K) NT_TABLE_NEON(q3_K)

#endif  // __ARM_NEON && __aarch64__

/* ---- dispatch ------------------------------------------------------------ */

#define N_TYPES (ES_TYPE_BF16 + 1)  // dot tables cover ids 0..BF16

typedef struct {
    const char * name;
    vec_dot_fn   dot[N_TYPES];   // NULL: not a weight type
    const vec_dotn_fn * dotn[N_TYPES];  // [nt - 1], nt = 1..MAX_NT; NULL: es_matmat calls dot per token
    void (*axpy_f16)(int64_t n, float e, const uint16_t * v, float * acc);
} kernel_set;

#define SCALAR_DOTS                                                            \
    [ES_TYPE_F32] = dot_f32_scalar, [ES_TYPE_F16] = dot_f16_scalar,            \
    [ES_TYPE_BF16] = dot_bf16_scalar, [ES_TYPE_Q4_0] = dot_q4_0_scalar,        \
    [ES_TYPE_Q4_1] = dot_q4_1_scalar, [ES_TYPE_Q5_0] = dot_q5_0_scalar,        \
    [ES_TYPE_Q5_1] = dot_q5_1_scalar, [ES_TYPE_Q8_0] = dot_q8_0_scalar,        \
    [ES_TYPE_Q4_K] = dot_q4_K_scalar, [ES_TYPE_Q5_K] = dot_q5_K_scalar,        \
    [ES_TYPE_Q6_K] = dot_q6_K_scalar, [ES_TYPE_Q2_K] = dot_q2_K_scalar,        \
    [ES_TYPE_Q3_K] = dot_q3_K_scalar

// A set's batched kernels for every quantized type (dotn_<type>_<set>).
#define BATCHED_DOTS(SET)                                                                     \
    [ES_TYPE_Q4_0] = dotn_q4_0_##SET, [ES_TYPE_Q4_1] = dotn_q4_1_##SET,                     \
    [ES_TYPE_Q5_0] = dotn_q5_0_##SET, [ES_TYPE_Q5_1] = dotn_q5_1_##SET,                     \
    [ES_TYPE_Q8_0] = dotn_q8_0_##SET, [ES_TYPE_Q4_K] = dotn_q4_K_##SET,                     \
    [ES_TYPE_Q5_K] = dotn_q5_K_##SET, [ES_TYPE_Q6_K] = dotn_q6_K_##SET,                     \
    [ES_TYPE_Q2_K] = dotn_q2_K_##SET, [ES_TYPE_Q3_K] = dotn_q3_K_##SET

static const kernel_set KERNELS_SCALAR = {.name = "scalar", .dot = {SCALAR_DOTS}, .axpy_f16 = axpy_f16_scalar};

// A set's one-token kernels: the float types' (FSET) and the quantized types' (QSET).
#define ONE_TOKEN_DOTS(FSET, QSET)                                                            \
    [ES_TYPE_F32] = dot_f32_##FSET, [ES_TYPE_F16] = dot_f16_##FSET, [ES_TYPE_BF16] = dot_bf16_##FSET, \
    [ES_TYPE_Q4_0] = dot_q4_0_##QSET, [ES_TYPE_Q4_1] = dot_q4_1_##QSET,                     \
    [ES_TYPE_Q5_0] = dot_q5_0_##QSET, [ES_TYPE_Q5_1] = dot_q5_1_##QSET,                     \
    [ES_TYPE_Q8_0] = dot_q8_0_##QSET, [ES_TYPE_Q4_K] = dot_q4_K_##QSET,                     \
    [ES_TYPE_Q5_K] = dot_q5_K_##QSET, [ES_TYPE_Q6_K] = dot_q6_K_##QSET,                     \
    [ES_TYPE_Q2_K] = dot_q2_K_##QSET, [ES_TYPE_Q3_K] = dot_q3_K_##QSET

#if defined(ES_HAVE_AVX2)
static const kernel_set KERNELS_AVX2 = {.name = "avx2", .dot = {ONE_TOKEN_DOTS(avx2, avx2)},
                                        .dotn = {BATCHED_DOTS(avx2)}, .axpy_f16 = axpy_f16_avx2};
static const kernel_set KERNELS_AVX512 = {.name = "avx512", .dot = {ONE_TOKEN_DOTS(avx2, avx512)},
                                          .dotn = {BATCHED_DOTS(avx512)}, .axpy_f16 = axpy_f16_avx2};
#endif

#if defined(__ARM_NEON) && defined(__aarch64__)
static const kernel_set KERNELS_NEON = {.name = "neon", .dot = {ONE_TOKEN_DOTS(neon, neon)},
                                        .dotn = {BATCHED_DOTS(neon)}, .axpy_f16 = axpy_f16_scalar};
#endif

// The sets this CPU runs, best first (scalar always last); found once.
static const kernel_set * g_available[4];
static int32_t            g_n_available;
// The set in use: the best until es_kernels_select changes it.
static const kernel_set * g_kernels;
static pthread_once_t     g_once = PTHREAD_ONCE_INIT;

// Runs once, from whichever thread first needs the kernels (the AVX2 set's
// half table is filled before any thread can use it).
static void find_kernels(void) {
#if defined(ES_HAVE_AVX2)
    // F16C through cpuid: not every compiler's __builtin_cpu_supports knows it.
    unsigned eax, ebx, ecx = 0, edx;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c) {
        init_half_table();
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
            g_available[g_n_available++] = &KERNELS_AVX512;
        g_available[g_n_available++] = &KERNELS_AVX2;
    }
#endif
#if defined(__ARM_NEON) && defined(__aarch64__)
    g_available[g_n_available++] = &KERNELS_NEON;
#endif
    g_available[g_n_available++] = &KERNELS_SCALAR;
    g_kernels = g_available[0];
}

static const kernel_set * kernels(void) {
    pthread_once(&g_once, find_kernels);
    return g_kernels;
}

int es_kernels_select(const char * name) {
    if (!name) return ES_ERR_INVALID_ARG;
    pthread_once(&g_once, find_kernels);
    const kernel_set * chosen = strcmp(name, "auto") == 0 ? g_available[0] : NULL;
    for (int32_t i = 0; i < g_n_available && !chosen; i++) {
        if (strcmp(name, g_available[i]->name) == 0) chosen = g_available[i];
    }
    if (!chosen) {
        const bool known = strcmp(name, "avx512") == 0 || strcmp(name, "avx2") == 0 || strcmp(name, "neon") == 0;
        return known ? ES_ERR_UNSUPPORTED : ES_ERR_INVALID_ARG;
    }
    // Written only on a change: selecting the set in use races with nothing.
    if (g_kernels != chosen) g_kernels = chosen;
    return ES_OK;
}

const char * es_kernels_name(void) { return kernels()->name; }

const char * es_kernels_available(int32_t i) {
    pthread_once(&g_once, find_kernels);
    return i >= 0 && i < g_n_available ? g_available[i]->name : NULL;
}

void es_matvec(int32_t type, const void * w, const void * xq, int64_t n, int64_t r0, int64_t r1, float * y) {
    const size_t row_bytes = es_type_row_bytes(type, n);
    const vec_dot_fn dot = type >= 0 && type < N_TYPES ? kernels()->dot[type] : NULL;
    if (!dot || row_bytes == 0) return;
    const uint8_t * row = (const uint8_t *) w + (size_t) r0 * row_bytes;
    for (int64_t r = r0; r < r1; r++, row += row_bytes) y[r - r0] = dot(n, row, xq);
}

void es_axpy_f16(int64_t n, float e, const uint16_t * v, float * acc) { kernels()->axpy_f16(n, e, v, acc); }

// Weight bytes es_matmat walks for one group of up to MAX_NT tokens before
// the next group: a group's activations stay in L1 while the block's rows
// stream by, from the last-level cache after the first group (a thread's
// share of it on current x86 and Arm parts). Measured on qwen2.5-coder-1.5b
// and smollm2-135m prefill (AVX2, 2 threads): blocks of 128 KB, whose rows
// stay in L2 but make every row re-read the activations from L2, ran
// 10-25% slower than blocks of 1-4 MB.
#define ROW_BLOCK_BYTES (2 * 1024 * 1024)

void es_matmat(int32_t type, const void * w, const void * xq, size_t xq_stride, int32_t n_tok, int64_t n,
               int64_t r0, int64_t r1, float * y, size_t y_stride) {
    const size_t row_bytes = es_type_row_bytes(type, n);
    const kernel_set * k = kernels();
    const vec_dot_fn    dot  = type >= 0 && type < N_TYPES ? k->dot[type] : NULL;
    const vec_dotn_fn * dotn = type >= 0 && type < N_TYPES ? k->dotn[type] : NULL;
    if (!dot || row_bytes == 0) return;
    // A tiled product: a block of rows is read from memory once and reused,
    // from the cache, by every group of up to MAX_NT tokens (each weight
    // block unpacked once per group); a decode-sized batch is one group.
    // Each (row, token) value is the same whatever the grouping, since the
    // kernels give every token es_matvec's result.
    const int64_t block = row_bytes >= ROW_BLOCK_BYTES ? 1 : (int64_t) (ROW_BLOCK_BYTES / row_bytes);
    for (int64_t rb = r0; rb < r1; rb += block) {
        const int64_t re = rb + block < r1 ? rb + block : r1;
        for (int32_t t = 0; t < n_tok; t += MAX_NT) {
            const int32_t nt = n_tok - t < MAX_NT ? n_tok - t : MAX_NT;
            const uint8_t * xt = (const uint8_t *) xq + (size_t) t * xq_stride;
            float * yt = y + (size_t) t * y_stride;  // (nt, y_stride), column r - r0 for row r
            const uint8_t * row = (const uint8_t *) w + (size_t) rb * row_bytes;
            for (int64_t r = rb; r < re; r++, row += row_bytes) {
                if (dotn) {
                    float out[MAX_NT];
                    dotn[nt - 1](n, row, xt, xq_stride, out);
                    for (int32_t j = 0; j < nt; j++) yt[(size_t) j * y_stride + (size_t) (r - r0)] = out[j];
                } else {
                    for (int32_t j = 0; j < nt; j++)
                        yt[(size_t) j * y_stride + (size_t) (r - r0)] = dot(n, row, xt + (size_t) j * xq_stride);
                }
            }
        }
    }
}
