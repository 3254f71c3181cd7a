/*
 * avx512.c — the AVX-512 VNNI set (x86-64), compiled with the AVX2 set's
 * flags plus -mavx512f -mavx512bw -mavx512vl -mavx512vnni; without them this
 * file is empty and the library lacks the set.
 *
 * The AVX2 set's kernels with VNNI's fused integer dot products, still on
 * 256-bit vectors (32 registers with VL; Zen 4 runs 512-bit ones as two
 * halves): vpdpbusd sums four u8 x s8 products into an int32 lane in one
 * instruction where AVX2 needs maddubs and madd, and vpdpwssd weights the
 * K-quants' int16 pair sums by their sub-block scales as it accumulates,
 * where AVX2 needs levels of hadd (the shuffle port) and a madd. F32/F16/BF16
 * and Q2_K/Q3_K keep the AVX2 set's kernels.
 */
#include "kernels.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && \
    defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define ES_BUILD_AVX512 1
#endif

#if defined(ES_BUILD_AVX512)

#include "x86.h"

/* ---- the set's integer products (x86.h's templates call them) -------------- */

// The same int32 lanes as avx2_dot_u8s8's (four products each, no int16
// stage to saturate).
static inline __m256i avx512_dot_u8s8(__m256i u, __m256i s) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}

// Q4_K / Q5_K: sub-block k's maddubs (16 int16, pairs of q y, |.| <= 2 * 31
// * 128 for Q5_K) times its scale, summed into int32 lanes by vpdpwssd in
// two chains (even and odd sub-blocks).
static inline k4_scales avx512_k4_scales(const uint8_t sc[8], const uint8_t m[8]) {
    k4_scales k = {0};
    const __m256i sc16 = u8x8_to_i16x2(sc);
    for (int j = 0; j < 8; j++) k.s[j] = _mm256_permutexvar_epi16(_mm256_set1_epi16((short) j), sc16);
    const __m128i mv = _mm_loadl_epi64((const __m128i *) m);
    k.mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mv, mv));
    return k;
}

static inline __m256i avx512_k4_token(const __m256i q[8], const k4_scales * k, const block_q8_K * y) {
    __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
    for (int j = 0; j < 8; j += 2) {
        even = _mm256_dpwssd_epi32(even, _mm256_maddubs_epi16(q[j], load256(y->qs + 32 * j)), k->s[j]);
        odd = _mm256_dpwssd_epi32(odd, _mm256_maddubs_epi16(q[j + 1], load256(y->qs + 32 * j + 32)), k->s[j + 1]);
    }
    return _mm256_add_epi32(even, odd);
}

// Q6_K: quarter k of half h holds elements with scale 8h + 2k in its low
// 128 bits and 8h + 2k + 1 in its high ones, so each quarter's maddubs goes
// into the sum by one vpdpwssd with those scales, in two chains (even and
// odd quarters).
static inline q6_scales avx512_q6_scales(const block_q6_K * x, int h, __m256i sc16) {
    (void) x;
    q6_scales s;
    for (int k = 0; k < 4; k++) {  // all 16 scales as int16: 8h + 2k in the low 128 bits, + 1 in the high
        const int a = 8 * h + 2 * k;
        s.s[k] = _mm256_permutexvar_epi16(_mm256_inserti128_si256(_mm256_set1_epi16((short) a),
                                                                  _mm_set1_epi16((short) (a + 1)), 1), sc16);
    }
    return s;
}

static inline void avx512_q6_token(__m256i sumi[2], const q6_half_v * q, const q6_scales * s, const int8_t * q8) {
    for (int k = 0; k < 4; k += 2) {
        sumi[0] = _mm256_dpwssd_epi32(sumi[0], _mm256_maddubs_epi16(q->q[k], load256(q8 + 32 * k)), s->s[k]);
        sumi[1] = _mm256_dpwssd_epi32(sumi[1], _mm256_maddubs_epi16(q->q[k + 1], load256(q8 + 32 * k + 32)), s->s[k + 1]);
    }
}

UNPACKED_KERNELS(avx512)

/* ---- tile kernels ------------------------------------------------------------ */

// One vpdpbusd per four elements of the 8 rows per token, into int32
// lanes; one vpmulld by the rows' scales per sub-block. Eight tokens fit
// the 32 registers (per token: the sub-block's sums, the super-block's, the
// float accumulator).
#define avx512_TILE_T 8
#define EACH_TILE_T_avx512(M, SET, TYPE) M(SET, TYPE, 1) M(SET, TYPE, 2) M(SET, TYPE, 3) M(SET, TYPE, 4) \
                                         M(SET, TYPE, 5) M(SET, TYPE, 6) M(SET, TYPE, 7) M(SET, TYPE, 8)

// The broadcast of the activation bytes folded into vpdpbusd's memory
// operand ({1to8}): compilers emit a separate vpbroadcastd, which takes a
// vector pipe on Zen 4 (measured: 4.9 against 6.9 vpdpbusd per ns).
static ALWAYS_INLINE __m256i avx512_sb_step(__m256i acc, __m256i w, const int8_t * p) {
    __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *) p));
    return acc;
}
static ALWAYS_INLINE __m256i avx512_sb_scales(const uint8_t sc[8]) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) sc));
}
static ALWAYS_INLINE __m256i avx512_sb_scale(__m256i acc, __m256i s) { return _mm256_mullo_epi32(acc, s); }
static ALWAYS_INLINE __m256i avx512_mins(__m256i summ, __m256i m16, __m256i bp) {
    return _mm256_dpwssd_epi32(summ, m16, bp);
}

static ALWAYS_INLINE __m256i avx512_sb_scales_s8(const int8_t sc[8]) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) sc));
}
static ALWAYS_INLINE __m256i avx512_sb_widen(__m256i acc) { return acc; }
#define avx512_Q6_STAGE 4

#define avx512_K4_STAGE_q4_K 8
#define avx512_K4_STAGE_q5_K 8

K4_TILE(avx512, q4_K)
TILE_KERNEL(avx512, q4_K, block_q4_Kx8)
K4_TILE(avx512, q5_K)
TILE_KERNEL(avx512, q5_K, block_q5_Kx8)
Q6_TILE(avx512)
TILE_KERNEL(avx512, q6_K, block_q6_Kx8)
Q32_TILE(avx512, q4_0)
Q32_TILE(avx512, q4_1)
Q32_TILE(avx512, q5_0)
Q32_TILE(avx512, q5_1)
Q32_TILE(avx512, q8_0)

// The int8 peak: vpdpbusd on 12 independent accumulators (its latency
// times its two pipes), 32 multiply-accumulates each.
static int64_t int8_loop_avx512(int64_t iterations, int32_t * sink) {
    __m256i acc[12], w = _mm256_set1_epi8(3), y = _mm256_set1_epi8(5);
    for (int k = 0; k < 12; k++) acc[k] = _mm256_setzero_si256();
    for (int64_t i = 0; i < iterations; i++) {
        for (int k = 0; k < 12; k++) acc[k] = _mm256_dpbusd_epi32(acc[k], w, y);
        __asm__ volatile("" : "+x"(w), "+x"(y));  // operands of every iteration's own
    }
    __m256i s = acc[0];
    for (int k = 1; k < 12; k++) s = _mm256_add_epi32(s, acc[k]);
    *sink = hsum_i32x8(s);
    return iterations * 12 * 32;
}

/* ---- the set ---------------------------------------------------------------- */

static es_kernel_set KERNELS_AVX512;

const es_kernel_set * es__kernels_avx512(void) {
    const es_kernel_set * avx2 = es__kernels_avx2();  // fills the half table too
    if (!avx2) return NULL;
    KERNELS_AVX512 = *avx2;
    KERNELS_AVX512.name = "avx512";
    KERNELS_AVX512.int8_loop = int8_loop_avx512;
    // This set's own kernels; the rest (float types, Q2_K, Q3_K) are the AVX2 set's.
#define OWN(T, ID) {ID, dot_##T##_avx512, dotn_##T##_avx512, avx512_tile_##T}
    static const struct { int32_t type; vec_dot_fn dot; const vec_dotn_fn * dotn; tile_fn tile; } own[] = {
        OWN(q4_0, ES_TYPE_Q4_0), OWN(q4_1, ES_TYPE_Q4_1), OWN(q5_0, ES_TYPE_Q5_0), OWN(q5_1, ES_TYPE_Q5_1),
        OWN(q8_0, ES_TYPE_Q8_0), OWN(q4_K, ES_TYPE_Q4_K), OWN(q5_K, ES_TYPE_Q5_K), OWN(q6_K, ES_TYPE_Q6_K),
    };
#undef OWN
    for (size_t i = 0; i < sizeof own / sizeof own[0]; i++) {
        KERNELS_AVX512.dot[own[i].type] = own[i].dot;
        KERNELS_AVX512.dotn[own[i].type] = own[i].dotn;
        KERNELS_AVX512.tile[own[i].type] = own[i].tile;
    }
    return &KERNELS_AVX512;
}

#else

const es_kernel_set * es__kernels_avx512(void) { return NULL; }

#endif  // ES_BUILD_AVX512
