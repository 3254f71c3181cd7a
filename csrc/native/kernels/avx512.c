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
 * and Q2_K/Q3_K keep the AVX2 set's kernels, as do attention's (es_axpy_f16,
 * es_axpy_q8_0).
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

// Two groups of 8 rows per 512-bit vector (one group alone at an odd end):
// Zen 4 runs a 512-bit operation as two 256-bit halves, so the multiplies
// cost the same, but every other instruction (loads, unpacking, broadcasts,
// scales, float steps) serves twice the rows; measured on Zen 4, the
// unpack-and-vpdpbusd loop of an 8-token tile ran at 185 GMAC/s on 256-bit
// vectors and 236 (the vpdpbusd peak) on 512. One vpdpbusd per four
// elements of the rows per token, the activation broadcast in its memory
// operand ({1to16}: compilers emit a separate vpbroadcastd, which takes a
// vector pipe on Zen 4); one vpmulld by the rows' scales per sub-block.
// Eight tokens fill the 32 registers.
typedef __m512i vi;
typedef __m512  vf;
#define VGROUPS 2
#define TILE_T 8
#define EACH_TILE_T(M, TYPE) M(TYPE, 1) M(TYPE, 2) M(TYPE, 3) M(TYPE, 4) M(TYPE, 5) M(TYPE, 6) M(TYPE, 7) M(TYPE, 8)
#define K4_STAGE_q4_K 8
#define K4_STAGE_q5_K 8
#define Q6_STAGE 4

// The two groups' halves of a 512-bit vector: p's and p + gs's.
static inline __m256i two128(const void * p, size_t gs) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *) p)),
                                   _mm_loadu_si128((const __m128i *) ((const uint8_t *) p + gs)), 1);
}
static inline __m128i two64(const void * p, size_t gs) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *) p), _mm_loadl_epi64((const __m128i *) ((const uint8_t *) p + gs)));
}
static inline vi vi_load(const void * p, size_t gs) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(load256(p)), load256((const uint8_t *) p + gs), 1);
}
static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline vi vi_set8(char c) { return _mm512_set1_epi8(c); }
static inline vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
static inline vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
static inline vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vi vi_sub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
static inline vi vi_sll16(vi v, int n) { return _mm512_slli_epi16(v, (unsigned) n); }
static inline vi vi_srl16(vi v, int n) { return _mm512_srli_epi16(v, (unsigned) n); }
static inline vi vi_sll32(vi v, int n) { return _mm512_slli_epi32(v, (unsigned) n); }
static inline vi vi_bcast32(const void * p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
static inline vi sb_step(vi acc, vi w, const int8_t * p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *) p));
    return acc;
}
static inline vi sb_scale(vi acc, vi s) { return _mm512_mullo_epi32(acc, s); }
static inline vi sb_widen(vi acc) { return acc; }
static inline vi scales_u8(const uint8_t * p, size_t gs) { return _mm512_cvtepu8_epi32(two64(p, gs)); }
static inline vi scales_s8(const int8_t * p, size_t gs) { return _mm512_cvtepi8_epi32(two64(p, gs)); }
static inline vi mins16(const uint8_t * p, size_t gs) { return _mm512_cvtepu8_epi16(two128(p, gs)); }
static inline vi pairs16(const int8_t * a, const int8_t * b, size_t gs) {
    const __m128i lo = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *) a), _mm_loadl_epi64((const __m128i *) b));
    const __m128i hi = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *) (a + gs)), _mm_loadl_epi64((const __m128i *) (b + gs)));
    return _mm512_cvtepi8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}
static inline vi mins_step(vi acc, vi m16, const void * p) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(m16), "m"(*(const int32_t *) p));
    return acc;
}
static inline vi q5_fifth(vi qh, int byte, int g) {  // byte `byte` of each row's qh in all its lane's bytes, tested
    const vi lanes = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12));
    const vi rep = _mm512_shuffle_epi8(qh, _mm512_add_epi8(lanes, _mm512_set1_epi8((char) byte)));
    const __mmask64 set = _mm512_test_epi8_mask(rep, _mm512_set1_epi32(g % 2 ? (int) 0x80402010 : 0x08040201));
    return _mm512_maskz_mov_epi8(set, _mm512_set1_epi8(0x10));
}
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_halves(const es_half * p, size_t gs) { return _mm512_cvtph_ps(two128(p, gs)); }
static inline vf vf_load(const float * p, int rows) {
    return rows > ES_GROUP_ROWS ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(0x00FF, p);
}
static inline void vf_store(float * p, vf v, int rows) {
    if (rows > ES_GROUP_ROWS) _mm512_storeu_ps(p, v);
    else _mm512_mask_storeu_ps(p, 0x00FF, v);
}
static inline vf vf_fma(vf acc, vf d, float yd, vi sumi) {
    return _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(yd)), _mm512_cvtepi32_ps(sumi), acc);
}
static inline vf vf_fnma(vf acc, vf d, float yd, vi summ) {
    return _mm512_fnmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(yd)), _mm512_cvtepi32_ps(summ), acc);
}
static inline vf vf_fma_bcast(vf acc, vf m, float s) { return _mm512_fmadd_ps(m, _mm512_set1_ps(s), acc); }

#include "x86_tiles.h"

K4_TILE(q4_K)
TILE_KERNEL(q4_K, block_q4_Kx8)
K4_TILE(q5_K)
TILE_KERNEL(q5_K, block_q5_Kx8)
Q6_TILE()
TILE_KERNEL(q6_K, block_q6_Kx8)
Q32_TILE(q4_0)
Q32_TILE(q4_1)
Q32_TILE(q5_0)
Q32_TILE(q5_1)
Q32_TILE(q8_0)

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
    KERNELS_AVX512.dot_rows[ES_TYPE_Q8_0] = dot_rows_q8_0_avx512;
    // This set's own kernels; the rest (float types, Q2_K, Q3_K) are the AVX2 set's.
#define OWN(T, ID) {ID, dot_##T##_avx512, dotn_##T##_avx512, tile_##T}
    static const struct { int32_t type; vec_dot_fn dot; const vec_dotn_fn * dotn; tile_fn tile; } own[] = {
        OWN(q4_0, ES_TYPE_Q4_0), OWN(q4_1, ES_TYPE_Q4_1), OWN(q5_0, ES_TYPE_Q5_0), OWN(q5_1, ES_TYPE_Q5_1),
        OWN(q8_0, ES_TYPE_Q8_0), OWN(q4_K, ES_TYPE_Q4_K), OWN(q5_K, ES_TYPE_Q5_K), OWN(q6_K, ES_TYPE_Q6_K),
    };
#undef OWN
    for (size_t i = 0; i < sizeof own / sizeof own[0]; i++) {
        KERNELS_AVX512.dot[own[i].type] = own[i].dot;
        KERNELS_AVX512.dotn[own[i].type] = own[i].dotn;
        KERNELS_AVX512.tile[own[i].type] = own[i].tile;
        // A one-token tile has no tokens to share a weight unpack with:
        // each 512-bit vector of two groups' rows then costs an extra insert
        // and, on Zen 4, the two 256-bit halves' time all the same; AVX2's
        // tile decoded qwen2.5-coder-1.5b in 0.66-0.75x the time (Zen 4,
        // 2 threads, interleaved runs).
        KERNELS_AVX512.tile_one[own[i].type] = avx2->tile[own[i].type];
    }
    return &KERNELS_AVX512;
}

#else

const es_kernel_set * es__kernels_avx512(void) { return NULL; }

#endif  // ES_BUILD_AVX512
