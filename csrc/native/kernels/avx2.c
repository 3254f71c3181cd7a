/*
 * avx2.c — the AVX2 + FMA + F16C set (x86-64), compiled with -mavx2 -mfma
 * -mf16c (CMakeLists.txt, edgespec/capi/build.py); without those flags this
 * file is empty and the library lacks the set. dispatch.c offers it only
 * on a CPU that has the instructions.
 *
 * Integer products are maddubs (u8 x s8 pairs into int16) and madd (int16
 * pairs into int32, by ones or by the K-quants' scales), several int16
 * stages added before each widening multiply where the terms allow, since
 * the multiplier is the scarce unit on the CPUs this set is for.
 */
#include "kernels.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ES_BUILD_AVX2 1
#endif

#if defined(ES_BUILD_AVX2)

#include "x86.h"

float es__half_table[1 << 16];

/* ---- float weights --------------------------------------------------------- */

static float dot_f32_avx2(int64_t n, const void * w, const void * a) {
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

static inline __m256 load_f16x8(const es_half * p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) p));
}

static inline __m256 load_bf16x8(const uint16_t * p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *) p)), 16));
}

static float dot_f16_avx2(int64_t n, const void * w, const void * a) {
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

static float dot_bf16_avx2(int64_t n, const void * w, const void * a) {
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

static void axpy_f16_avx2(int64_t n, float e, const uint16_t * v, float * acc) {
    const __m256 ev = _mm256_set1_ps(e);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(ev, load_f16x8(v + i), _mm256_loadu_ps(acc + i)));
    for (; i < n; i++) acc[i] = fmaf(e, half_to_f32(v[i]), acc[i]);
}

// es_axpy_q8_0 for nb = 1 or 2 blocks of each row (the columns of acc in
// registers across all rows), rows `row` bytes apart.
static ALWAYS_INLINE void axpy_q8_0_blocks(int nb, int64_t rows, const float * e, const block_q8_0 * x,
                                           size_t row, float * acc) {
    __m256 a[8];
    for (int k = 0; k < 4 * nb; k++) a[k] = _mm256_loadu_ps(acc + 8 * k);
    for (int64_t r = 0; r < rows; r++, x = (const block_q8_0 *) ((const uint8_t *) x + row)) {
        if (e[r] == 0.0f) continue;
        for (int i = 0; i < nb; i++) {
            const __m256 s = _mm256_set1_ps(e[r] * h2f(x[i].d));
            for (int k = 0; k < 4; k++) {
                const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (x[i].qs + 8 * k))));
                a[4 * i + k] = _mm256_fmadd_ps(s, q, a[4 * i + k]);
            }
        }
    }
    for (int k = 0; k < 4 * nb; k++) _mm256_storeu_ps(acc + 8 * k, a[k]);
}

static void axpy_q8_0_avx2(int64_t n, int64_t rows, const float * e, const void * v, float * acc) {
    const block_q8_0 * x = v;
    const int64_t nb = n / QK;
    const size_t row = (size_t) nb * sizeof *x;
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) axpy_q8_0_blocks(2, rows, e, x + i, row, acc + QK * i);
    if (i < nb) axpy_q8_0_blocks(1, rows, e, x + i, row, acc + QK * i);
}

/* ---- the set's integer products (x86.h's templates call them) -------------- */

// 8 lanes of pairwise-summed u8 x s8 products as int32 (4 products per lane).
static inline __m256i avx2_dot_u8s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// Q4_K / Q5_K: a super-block's 8 sub-block products p[j] (maddubs: 16
// int16, each two q y terms) weighted by the sub-block scales, as 8 int32.
// Two levels of pairwise adds in int16 first (8 terms of |q y| <= 31 * 128,
// Q5_K's worst, fit) leave two widening multiplies by the scales instead of
// eight, which matters where the multiplier is the scarce unit (one pipe on
// Zen 1).
static const uint8_t DUP16[2][32] = {  // int16 (0,0,1,1,2,2,3,3) and (4,4,..,7,7), both lanes
#define D(k) 2*k, 2*k+1, 2*k, 2*k+1
    {D(0), D(1), D(2), D(3), D(0), D(1), D(2), D(3)},
    {D(4), D(5), D(6), D(7), D(4), D(5), D(6), D(7)},
#undef D
};

static inline k4_scales avx2_k4_scales(const uint8_t sc[8], const uint8_t m[8]) {
    k4_scales k = {0};
    const __m256i sc16 = u8x8_to_i16x2(sc);
    k.s[0] = shuffle16(sc16, DUP16[0]), k.s[1] = shuffle16(sc16, DUP16[1]);
    const __m128i mv = _mm_loadl_epi64((const __m128i *) m);
    k.mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mv, mv));
    return k;
}

static inline __m256i avx2_k4_token(const __m256i q[8], const k4_scales * k, const block_q8_K * y) {
    __m256i p[8];
    for (int j = 0; j < 8; j++) p[j] = _mm256_maddubs_epi16(q[j], load256(y->qs + 32 * j));
    // hadd per 128-bit lane: (a0+a1, .., a6+a7, b0+b1, .., b6+b7); after two
    // levels lanes (0,0,1,1,2,2,3,3) hold sub-blocks 0..3, then 4..7.
    const __m256i h01 = _mm256_hadd_epi16(p[0], p[1]), h23 = _mm256_hadd_epi16(p[2], p[3]);
    const __m256i h45 = _mm256_hadd_epi16(p[4], p[5]), h67 = _mm256_hadd_epi16(p[6], p[7]);
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_hadd_epi16(h01, h23), k->s[0]),
                            _mm256_madd_epi16(_mm256_hadd_epi16(h45, h67), k->s[1]));
}

// Q6_K: quarter k's maddubs holds in lanes 0..7 elements 0..15 (scale 2k),
// in lanes 8..15 elements 16..31 (scale 2k + 1); its terms (|q y| <= 63 *
// 128) take one level of pairwise adds in int16 before the widening
// multiply by the scales. PAIRED16[k] puts int16 a in lanes 0..3 and b in
// 4..7 of the low 128 bits, a + 1 and b + 1 in the high ones, for (a, b) =
// (0, 2) and (4, 6): the scales after that one level of hadd.
static const uint8_t PAIRED16[2][32] = {
#define Q(k) 2*k, 2*k+1, 2*k, 2*k+1, 2*k, 2*k+1, 2*k, 2*k+1
    {Q(0), Q(2), Q(1), Q(3)},
    {Q(4), Q(6), Q(5), Q(7)},
#undef Q
};

static inline q6_scales avx2_q6_scales(const block_q6_K * x, int h, __m256i sc16) {
    (void) sc16;
    const __m256i scales = s8x8_to_i16x2(x->scales + 8 * h);
    return (q6_scales) {{shuffle16(scales, PAIRED16[0]), shuffle16(scales, PAIRED16[1])}};
}

static inline void avx2_q6_token(__m256i sumi[2], const q6_half_v * q, const q6_scales * s, const int8_t * q8) {
    __m256i p[4];
    for (int k = 0; k < 4; k++) p[k] = _mm256_maddubs_epi16(q->q[k], load256(q8 + 32 * k));
    sumi[0] = _mm256_add_epi32(sumi[0], _mm256_add_epi32(_mm256_madd_epi16(_mm256_hadd_epi16(p[0], p[1]), s->s[0]),
                                                         _mm256_madd_epi16(_mm256_hadd_epi16(p[2], p[3]), s->s[1])));
}

UNPACKED_KERNELS(avx2)

/* ---- Q2_K, Q3_K ------------------------------------------------------------ */

// Chunk k (32 elements, sub-blocks 2k and 2k + 1) as u8 values, unpacked
// once for all tokens; a token's maddubs against it holds sub-block 2k in
// the low 128 bits and 2k + 1 in the high, so one widening multiply by
// (scale 2k, scale 2k + 1) weights both. The part of the sum that does not
// depend on q comes from the activation's group sums: Q3_K's offset of 4
// (in the exact sum), Q2_K's mins (summ, times dmin). The avx512 set uses
// these kernels too.
static inline __m256i k16_bits(const uint8_t * qs, int k) {
    const __m256i b = load256(qs + 32 * (k / 4));
    return _mm256_and_si256(_mm256_srli_epi16(b, 2 * (k % 4)), _mm256_set1_epi8(3));
}
static inline __m256i unpack_k16_q2_K(const block_q2_K * x, int k, __m256i hm) {
    (void) hm;
    return k16_bits(x->qs, k);
}
static inline __m256i unpack_k16_q3_K(const block_q3_K * x, int k, __m256i hm) {
    // Bit k of each hmask byte to bit 2 (16-bit shifts: the AND keeps each byte's own bit).
    const __m256i h = _mm256_and_si256(_mm256_srli_epi16(hm, k), _mm256_set1_epi8(1));
    return _mm256_or_si256(k16_bits(x->qs, k), _mm256_slli_epi16(h, 2));
}
static inline __m256i hm_q2_K(const block_q2_K * x) { (void) x; return _mm256_setzero_si256(); }
static inline __m256i hm_q3_K(const block_q3_K * x) { return load256(x->hmask); }

// Per token: sumi starts at -(group sums . m) for Q3_K (its offset), at 0
// for Q2_K, whose mins are summ (K16_STEP: the float steps).
#define K16_INIT_q2_K(bs, m16) _mm256_setzero_si256()
#define K16_INIT_q3_K(bs, m16) _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_madd_epi16(bs, m16))
#define K16_STEP_q2_K(acc, x, yd, sumi, bs, m16) \
    k_step(acc, h2f((x).d), h2f((x).dmin), yd, sumi, hsum_i32x8(_mm256_madd_epi16(bs, m16)))
#define K16_STEP_q3_K(acc, x, yd, sumi, bs, m16) fmaf(h2f((x).d) * (yd), (float) (sumi), acc)

#define DOT_K16(SET, T, NT)                                                                   \
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
            int16_t s[16], m[16];                                                           \
            k16_scales_##T(x + i, s, m);                                                    \
            const __m256i m16 = load256(m);                                                 \
            const __m256i hm = hm_##T(x + i);                                               \
            __m256i q[8], sv[8];  /* chunks as u8, and their two scales per lane */         \
            for (int k = 0; k < 8; k++) {                                                   \
                q[k] = unpack_k16_##T(x + i, k, hm);                                        \
                sv[k] = _mm256_set_m128i(_mm_set1_epi16(s[2 * k + 1]), _mm_set1_epi16(s[2 * k])); \
            }                                                                               \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                          \
                const __m256i bs = load256(y[t][i].bsums);                                  \
                __m256i sumi = K16_INIT_##T(bs, m16);                                       \
                for (int k = 0; k < 8; k++) {                                               \
                    const __m256i p = _mm256_maddubs_epi16(q[k], load256(y[t][i].qs + 32 * k)); \
                    sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, sv[k]));             \
                }                                                                           \
                acc[t] = K16_STEP_##T(acc[t], x[i], y[t][i].d, hsum_i32x8(sumi), bs, m16);  \
            }                                                                               \
        }                                                                                   \
        for (int t = 0; t < NT; t++) out[t] = acc[t];                                       \
    }

EACH_NT2(DOT_K16, avx2, q2_K) NT_TABLE_SET(q2_K, avx2)
EACH_NT2(DOT_K16, avx2, q3_K) NT_TABLE_SET(q3_K, avx2)

/* ---- tile kernels ------------------------------------------------------------ */

// One group of 8 rows per vector. A sub-block's groups summed in int16 by
// maddubs (pairs of u8 x s8) and adds (Q4_K: 16 terms of at most 15 * 127
// per lane, Q5_K 8, Q6_K 4), then one madd by the rows' scales as int16
// pairs. Four tokens fill the 16 registers (per token: the sub-block's int16
// sums, the super-block's int32 sums, the float accumulator); more take the
// wide tiles below, one pass over the weights for up to 16. Q8_0 has no
// tile kernel: its values plus 128 would overflow maddubs' int16 pairs.
typedef __m256i vi;
typedef __m256  vf;
#define VGROUPS 1
#define TILE_T 4
#define EACH_TILE_T(M, TYPE) M(TYPE, 1) M(TYPE, 2) M(TYPE, 3) M(TYPE, 4)
#define K4_STAGE_q4_K 8
#define K4_STAGE_q5_K 4
#define Q6_STAGE 2
// The wide tiles (x86_tiles.h): two groups per activation broadcast (a
// broadcast takes a vector pipe on Zen), from 5 tokens (Q5_K from 9: its
// fifth bits' unpacking spills, and 8 tokens ran 10% slower than on two
// 4-token tiles; measured on Zen 4, benchmarks/bench_kernels.c).
#define WIDE_T 16
#define WIDE_NG 2
#define WIDE_FROM_q4_K 5
#define WIDE_FROM_q5_K 9
#define WIDE_FROM_q6_K 5

static inline vi vi_load(const void * p, size_t gs) { (void) gs; return load256(p); }
static inline vi vi_zero(void) { return _mm256_setzero_si256(); }
static inline vi vi_set8(char c) { return _mm256_set1_epi8(c); }
static inline vi vi_and(vi a, vi b) { return _mm256_and_si256(a, b); }
static inline vi vi_or(vi a, vi b) { return _mm256_or_si256(a, b); }
static inline vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
static inline vi vi_sub(vi a, vi b) { return _mm256_sub_epi32(a, b); }
static inline vi vi_sll16(vi v, int n) { return _mm256_slli_epi16(v, n); }
static inline vi vi_srl16(vi v, int n) { return _mm256_srli_epi16(v, n); }
static inline vi vi_sll32(vi v, int n) { return _mm256_slli_epi32(v, n); }
static inline vi vi_bcast32(const void * p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
// Each step's sum pinned in a register: GCC otherwise reassociates a
// super-block's int16 adds into a tree and spills nearly every maddubs
// result to the stack (256 spills in the 4-token Q4_K tile, which ran 25%
// slower).
static inline vi sb_step_b(vi acc, vi w, vi b) {
    vi sum = _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, b));
    __asm__("" : "+x"(sum));
    return sum;
}
static inline vi sb_step(vi acc, vi w, const int8_t * p) { return sb_step_b(acc, w, vi_bcast32(p)); }
static inline vi sb_scale(vi acc, vi s) { return _mm256_madd_epi16(acc, s); }
static inline vi sb_widen(vi acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
static inline vi scales_u8(const uint8_t * p, size_t gs) {  // (sc_r, sc_r) per row
    (void) gs;
    const __m128i v = _mm_loadl_epi64((const __m128i *) p);
    return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v));
}
static inline vi scales_s8(const int8_t * p, size_t gs) {
    (void) gs;
    const __m128i v = _mm_loadl_epi64((const __m128i *) p);
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(v, v));
}
static inline vi mins16(const uint8_t * p, size_t gs) { (void) gs; return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *) p)); }
static inline vi pairs16(const int8_t * a, const int8_t * b, size_t gs) {
    (void) gs;
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *) a), _mm_loadl_epi64((const __m128i *) b)));
}
static inline vi mins_step(vi acc, vi m16, const void * p) { return _mm256_add_epi32(acc, _mm256_madd_epi16(m16, vi_bcast32(p))); }
static inline vi q5_fifth(vi qh, int byte, int g) {  // byte `byte` of each row's qh in all its lane's bytes, tested
    const vi lanes = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
                                      0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
    const vi rep = _mm256_shuffle_epi8(qh, _mm256_add_epi8(lanes, _mm256_set1_epi8((char) byte)));
    const vi bits = _mm256_set1_epi32(g % 2 ? (int) 0x80402010 : 0x08040201);  // byte b: bit b (+ 4)
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(rep, bits), bits), _mm256_set1_epi8(0x10));
}
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_halves(const es_half * p, size_t gs) { (void) gs; return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) p)); }
static inline vf vf_load(const float * p, int rows) { (void) rows; return _mm256_loadu_ps(p); }
static inline void vf_store(float * p, vf v, int rows) { (void) rows; _mm256_storeu_ps(p, v); }
static inline vf vf_fma(vf acc, vf d, float yd, vi sumi) {
    return _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(yd)), _mm256_cvtepi32_ps(sumi), acc);
}
static inline vf vf_fnma(vf acc, vf d, float yd, vi summ) {
    return _mm256_fnmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(yd)), _mm256_cvtepi32_ps(summ), acc);
}
static inline vf vf_fma_bcast(vf acc, vf m, float s) { return _mm256_fmadd_ps(m, _mm256_set1_ps(s), acc); }

#include "x86_tiles.h"

K4_TILE(q4_K)
TILE_KERNEL(q4_K, block_q4_Kx8)
WIDE_TILE(q4_K)
K4_TILE(q5_K)
TILE_KERNEL(q5_K, block_q5_Kx8)
WIDE_TILE(q5_K)
Q6_TILE()
TILE_KERNEL(q6_K, block_q6_Kx8)
WIDE_TILE(q6_K)
Q32_TILE(q4_0)
Q32_TILE(q4_1)
Q32_TILE(q5_0)
Q32_TILE(q5_1)

// The int8 peak: vpmaddubsw (32 multiply-accumulates, pairs summed into
// int16) and the int16 add the tile kernels follow it with, on 8
// independent accumulators.
static int64_t int8_loop_avx2(int64_t iterations, int32_t * sink) {
    __m256i acc[8], w0 = _mm256_set1_epi8(3), w1 = _mm256_set1_epi8(4), y = _mm256_set1_epi8(5);
    for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_si256();
    for (int64_t i = 0; i < iterations; i++) {
        for (int k = 0; k < 8; k += 2) {  // two distinct products: none computed once for all
            acc[k] = _mm256_add_epi16(acc[k], _mm256_maddubs_epi16(w0, y));
            acc[k + 1] = _mm256_add_epi16(acc[k + 1], _mm256_maddubs_epi16(w1, y));
            __asm__ volatile("" : "+x"(w0), "+x"(w1));  // operands of every step's own
        }
    }
    __m256i s = acc[0];
    for (int k = 1; k < 8; k++) s = _mm256_add_epi16(s, acc[k]);
    *sink = hsum_i32x8(s);
    return iterations * 8 * 32;
}

/* ---- the set ---------------------------------------------------------------- */

static es_kernel_set KERNELS_AVX2 = {
    .name = "avx2",
    .dot = {
        [ES_TYPE_F32] = dot_f32_avx2, [ES_TYPE_F16] = dot_f16_avx2, [ES_TYPE_BF16] = dot_bf16_avx2,
        QUANTIZED_KERNELS(dot, avx2),
    },
    .dotn = {QUANTIZED_KERNELS(dotn, avx2)},
    .dot_rows = {[ES_TYPE_Q8_0] = dot_rows_q8_0_avx2},
    .tile = {
        [ES_TYPE_Q4_0] = tile_q4_0, [ES_TYPE_Q4_1] = tile_q4_1, [ES_TYPE_Q5_0] = tile_q5_0,
        [ES_TYPE_Q5_1] = tile_q5_1, [ES_TYPE_Q4_K] = tile_q4_K_wide, [ES_TYPE_Q5_K] = tile_q5_K_wide,
        [ES_TYPE_Q6_K] = tile_q6_K_wide,
    },
    .axpy_f16 = axpy_f16_avx2,
    .axpy_q8_0 = axpy_q8_0_avx2,
    .int8_loop = int8_loop_avx2,
};

const es_kernel_set * es__kernels_avx2(void) {
    // The half table is filled before the set is published (dispatch.c's pthread_once).
    for (uint32_t h = 0; h < (1u << 16); h++) es__half_table[h] = half_to_f32((es_half) h);
    return &KERNELS_AVX2;
}

#else

const es_kernel_set * es__kernels_avx2(void) { return NULL; }

#endif  // ES_BUILD_AVX2
