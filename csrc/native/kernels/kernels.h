/*
 * kernels.h — what the kernel files share (internal to csrc/native/kernels/):
 * ggml's block layouts, the repacked layouts, scalar helpers every set uses
 * to unpack scales, and the kernel-set table each instruction-set file fills.
 *
 *   quants.c    type table, dequantization, activation and Q2_K/Q3_K quantization
 *   scalar.c    the portable reference kernels (every platform)
 *   x86.h       what the two x86 sets share: unpacking, the unpacked kernels' templates
 *   x86_tiles.h the tile kernels' templates, over each set's vector primitives
 *   avx2.c      AVX2 + FMA + F16C (compiled with -mavx2 -mfma -mf16c)
 *   avx512.c    AVX-512 VNNI on 256-bit vectors (adds -mavx512{f,bw,vl,vnni})
 *   neon.c      aarch64 NEON (baseline there; the dot-product extension when built with it)
 *   repack.c    weights repacked at load for the tile kernels (layouts below)
 *   dispatch.c  the sets this CPU runs, es_kernels_select, es_matvec / es_matmat
 */
#ifndef ES_KERNELS_H
#define ES_KERNELS_H

#include "native/native_internal.h"

#include <math.h>
#include <string.h>

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


/* ---- repacked layouts (repack.c writes them, the tile kernels read them) -- */

// A weight's rows in groups of ES_GROUP_ROWS, block by block: block i of a
// group holds block i of each of its rows, interleaved so that one 32-byte
// load gives four consecutive elements of each of the 8 rows (one int32
// lane per row: a broadcast of four activation bytes serves all 8 rows),
// with the K-quants' 6-bit scales and mins unpacked to bytes. A group's
// blocks follow one another; groups follow one another (ES_GROUP_ROWS:
// native_internal.h).

typedef struct {
    es_half d[8], dmin[8];   // per row
    uint8_t scales[8][8];    // [sub-block j][row]
    uint8_t mins[4][8][2];   // [k][row]: the mins of sub-blocks 2k and 2k + 1
    uint8_t qs[4][8][8][4];  // [chunk c][g][row]: the row's qs[32 c + 4 g .. + 3]: low
                             // nibbles sub-block 2c, high 2c + 1, elements 4g .. 4g + 3
} block_q4_Kx8;
_Static_assert(sizeof(block_q4_Kx8) == 1184, "q4_Kx8 layout");

// Q5_K: Q4_K's layout, then the fifth bits.
typedef struct {
    block_q4_Kx8 k4;
    uint8_t      qh[8][8][4];  // [g][row]: the row's qh[4 g .. + 3]: bit 2c (2c + 1) the
                               // fifth bit of sub-block 2c (2c + 1)
} block_q5_Kx8;
_Static_assert(sizeof(block_q5_Kx8) == 1440, "q5_Kx8 layout");

// The 32-element quants: qs[g][row] holds the row's four bytes 4g .. 4g + 3:
// Q4 / Q5 nibbles (low: elements 4g .. 4g + 3, high: 16 + 4g .. 16 + 4g + 3),
// Q8_0 values plus 128 (so all are u8: x = (qs - 128) d). qh[row] is the
// row's 32 fifth bits (bit j: element j), as in the GGUF.
typedef struct { es_half d[8]; uint8_t qs[4][8][4]; } block_q4_0x8;
typedef struct { es_half d[8], m[8]; uint8_t qs[4][8][4]; } block_q4_1x8;
typedef struct { es_half d[8]; uint8_t qh[8][4]; uint8_t qs[4][8][4]; } block_q5_0x8;
typedef struct { es_half d[8], m[8]; uint8_t qh[8][4]; uint8_t qs[4][8][4]; } block_q5_1x8;
typedef struct { es_half d[8]; uint8_t qs[8][8][4]; } block_q8_0x8;
_Static_assert(sizeof(block_q4_0x8) == 8 * sizeof(block_q4_0), "q4_0x8 layout");
_Static_assert(sizeof(block_q4_1x8) == 8 * sizeof(block_q4_1), "q4_1x8 layout");
_Static_assert(sizeof(block_q5_0x8) == 8 * sizeof(block_q5_0), "q5_0x8 layout");
_Static_assert(sizeof(block_q5_1x8) == 8 * sizeof(block_q5_1), "q5_1x8 layout");
_Static_assert(sizeof(block_q8_0x8) == 8 * sizeof(block_q8_0), "q8_0x8 layout");

// Q6_K: element 128 h + 32 k + l (quarter k, lane l) takes the low (k < 2)
// or high nibble of ql[64 h + 32 (k & 1) + l] and bits 2k, 2k+1 of
// qh[32 h + l]; its scale is sub-block 8 h + 2 k + l / 16.
typedef struct {
    es_half d[8];
    int8_t  scales[16][8];     // [sub-block j][row]
    uint8_t ql[2][2][8][8][4]; // [h][k & 1][g][row]: the row's ql[64 h + 32 (k & 1) + 4 g .. + 3]
    uint8_t qh[2][8][8][4];    // [h][g][row]: the row's qh[32 h + 4 g .. + 3]
} block_q6_Kx8;
_Static_assert(sizeof(block_q6_Kx8) == 8 * sizeof(block_q6_K), "q6_Kx8 layout");

/* ---- scalar helpers ------------------------------------------------------ */

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

// Element j's fifth bit (j in 0..31) as 0 or 16.
static inline int q5_high(uint32_t qh, int j) { return (int) ((qh >> j) & 1) << 4; }

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

/* ---- the per-token arithmetic ---------------------------------------------- */

// Every kernel of every set, packed weights or not, one token or a batch,
// computes a quantized row's dot product the same way, so a token's result
// is bit-identical whatever kernel, batch or thread computed it:
//   acc = 0; then for each block (super-block) in order:
//     acc = fma(d_w * d_a, (float) sumi, acc)       sumi: the block's exact integer
//                                                   sum of q y (K-quants: of scale q y)
//     acc = fma(-(dmin_w * d_a), (float) summ, acc)  K-quants with mins: summ = the
//                                                   exact sum of min times activation
//                                                   group sums
//     acc = fma(m_w, s_a, acc)                      Q4_1 / Q5_1: min times the
//                                                   activation block's sum
// Integer sums are exact in any order; only these float steps round, one
// fused multiply-add each (fmaf: an instruction on every SIMD set and on
// aarch64, a correctly rounded libm call in the x86 scalar set).
static inline float k_step(float acc, float d, float dmin, float yd, int32_t sumi, int32_t summ) {
    acc = fmaf(d * yd, (float) sumi, acc);
    return fmaf(-(dmin * yd), (float) summ, acc);
}

/* ---- kernel sets --------------------------------------------------------- */

// Each returns dot(weight row w, activation row a) over n elements. Integer
// block sums are exact; floats accumulate block by block in order.
typedef float (*vec_dot_fn)(int64_t n, const void * w, const void * a);
// The same for NT activation rows a_stride bytes apart, into out[0..NT-1];
// bit for bit what vec_dot_fn gives for each. A kernel set may have them for
// NT = 1..MAX_NT.
#define MAX_NT 8
typedef void (*vec_dotn_fn)(int64_t n, const void * w, const void * a, size_t a_stride, float * out);
// A kernel set's batched functions come from one template per type,
// instantiated for each NT (EACH_NT) into a table indexed by NT - 1.
#define EACH_NT(M, P) M(P, 1) M(P, 2) M(P, 3) M(P, 4) M(P, 5) M(P, 6) M(P, 7) M(P, 8)
#define EACH_NT2(M, A, B) M(A, B, 1) M(A, B, 2) M(A, B, 3) M(A, B, 4) M(A, B, 5) M(A, B, 6) M(A, B, 7) M(A, B, 8)
#define NT_NAME(P, NT) P##NT,
// The activation format each 32-element type's kernels read.
#define DOT32_ACT_q4_0 block_q8_0
#define DOT32_ACT_q5_0 block_q8_0
#define DOT32_ACT_q8_0 block_q8_0
#define DOT32_ACT_q4_1 block_q8_1
#define DOT32_ACT_q5_1 block_q8_1

#define N_TYPES (ES_TYPE_BF16 + 1)  // dot tables cover ids 0..BF16

// The tile kernels: n_groups groups of 8 rows of a repacked weight (wp: the
// first group; es_repack_bytes(type, n, 8) apart) times nt >= 1 tokens
// (activation rows a_stride bytes apart), into y[t * y_stride + 8 g + r].
// Each (row, token) value is bit for bit what vec_dot_fn gives.
typedef void (*tile_fn)(int64_t n, const void * wp, int64_t n_groups, const void * a, size_t a_stride,
                        int32_t nt, float * y, size_t y_stride);
// One activation row a against `rows` consecutive rows of w (n elements
// each), into y[0..rows-1]: es_matvec's product where a set reduces several
// rows' block sums together (attention's thousands of short key rows). Each
// value is bit for bit what vec_dot_fn gives.
typedef void (*dot_rows_fn)(int64_t n, const void * w, int64_t rows, const void * a, float * y);

typedef struct es_kernel_set {
    const char * name;
    vec_dot_fn   dot[N_TYPES];          // NULL: not a weight type
    const vec_dotn_fn * dotn[N_TYPES];  // [nt - 1], nt = 1..MAX_NT; NULL: es_matmat calls dot per token
    tile_fn      tile[N_TYPES];         // repacked weights; NULL: the set reads the unpacked rows
    // One token's product over the repacked weights (decode), where another
    // set's tile does it faster; NULL: tile. Every set computes the same
    // per-token arithmetic, so the choice leaves results bit-identical.
    tile_fn      tile_one[N_TYPES];
    dot_rows_fn  dot_rows[N_TYPES];     // NULL: es_matvec calls dot per row
    void (*axpy_f16)(int64_t n, float e, const uint16_t * v, float * acc);
    // es_axpy_q8_0 (native_internal.h): per row r and block, s = e[r] d, then
    // acc[i] = fmaf(s, q[i], acc[i]) in row order (rows with e[r] == 0 add
    // nothing and are skipped): the same bits in every set.
    void (*axpy_q8_0)(int64_t n, int64_t rows, const float * e, const void * v, float * acc);
    // The set's integer step in its tightest loop, iterations times over
    // independent registers; returns the int8 multiply-accumulates done
    // (the result goes to *sink, so nothing is optimized away).
    int64_t (*int8_loop)(int64_t iterations, int32_t * sink);
} es_kernel_set;

// A set's kernels for every quantized type: P##_<type>_##SET (dot: one
// token; dotn: the tables of NT = 1..MAX_NT).
#define QUANTIZED_KERNELS(P, SET)                                                             \
    [ES_TYPE_Q4_0] = P##_q4_0_##SET, [ES_TYPE_Q4_1] = P##_q4_1_##SET,                       \
    [ES_TYPE_Q5_0] = P##_q5_0_##SET, [ES_TYPE_Q5_1] = P##_q5_1_##SET,                       \
    [ES_TYPE_Q8_0] = P##_q8_0_##SET, [ES_TYPE_Q4_K] = P##_q4_K_##SET,                       \
    [ES_TYPE_Q5_K] = P##_q5_K_##SET, [ES_TYPE_Q6_K] = P##_q6_K_##SET,                       \
    [ES_TYPE_Q2_K] = P##_q2_K_##SET, [ES_TYPE_Q3_K] = P##_q3_K_##SET

// Each instruction-set file's set, or NULL where this build lacks it (the
// file compiled without its flags, or for another architecture). Called
// once, from dispatch.c's pthread_once, and only on a CPU that has the
// set's instructions: the files compiled with ISA flags run nothing before.
const es_kernel_set * es__kernels_scalar(void);
const es_kernel_set * es__kernels_avx2(void);
const es_kernel_set * es__kernels_avx512(void);
const es_kernel_set * es__kernels_neon(void);

#endif  // ES_KERNELS_H
