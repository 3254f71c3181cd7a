/*
 * scalar.c — the portable reference kernels: every weight type's dot
 * product in plain C, one token at a time, and the tile kernels over the
 * repacked layouts. Every platform has this set; the others are held
 * against it (csrc/tests/test_quants.c).
 */
#include "kernels.h"

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

static void axpy_q8_0_scalar(int64_t n, int64_t rows, const float * e, const void * v, float * acc) {
    const block_q8_0 * x = v;
    for (int64_t r = 0; r < rows; r++, x += n / QK) {
        if (e[r] == 0.0f) continue;
        for (int64_t i = 0; i < n / QK; i++) {
            const float s = e[r] * half_to_f32(x[i].d);
            for (int j = 0; j < QK; j++) acc[QK * i + j] = fmaf(s, (float) x[i].qs[j], acc[QK * i + j]);
        }
    }
}

static float dot_q4_0_scalar(int64_t n, const void * w, const void * a) {
    const block_q4_0 * x = w;
    const block_q8_0 * y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK; i++) {
        int sumi = 0;
        for (int j = 0; j < QK / 2; j++)
            sumi += ((x[i].qs[j] & 0xF) - 8) * y[i].qs[j] + ((x[i].qs[j] >> 4) - 8) * y[i].qs[j + QK / 2];
        sum = fmaf(half_to_f32(x[i].d) * half_to_f32(y[i].d), (float) sumi, sum);
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
        sum = fmaf(half_to_f32(x[i].d) * half_to_f32(y[i].d), (float) sumi, sum);
        sum = fmaf(half_to_f32(x[i].m), half_to_f32(y[i].s), sum);
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
        sum = fmaf(half_to_f32(x[i].d) * half_to_f32(y[i].d), (float) sumi, sum);
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
        sum = fmaf(half_to_f32(x[i].d) * half_to_f32(y[i].d), (float) sumi, sum);
        sum = fmaf(half_to_f32(x[i].m), half_to_f32(y[i].s), sum);
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
        sum = fmaf(half_to_f32(x[i].d) * half_to_f32(y[i].d), (float) sumi, sum);
    }
    return sum;
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
        sum = k_step(sum, half_to_f32(x[i].d), half_to_f32(x[i].dmin), y[i].d, sumi, summ);
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
        sum = k_step(sum, half_to_f32(x[i].d), half_to_f32(x[i].dmin), y[i].d, sumi, summ);
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
        sum = fmaf(half_to_f32(x[i].d) * y[i].d, (float) sumi, sum);
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
        sum = k_step(sum, half_to_f32(x[i].d), half_to_f32(x[i].dmin), y[i].d, sumi, summ);
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
        sum = fmaf(half_to_f32(x[i].d) * y[i].d, (float) sumi, sum);
    }
    return sum;
}

/* ---- repacked weights (the reference for every set's tile kernels) -------- */

// The 32-element quants, each (row, token) the way their dot_*_scalar
// compute it. Element e's value in the packed block, from its nibble (or
// byte) and fifth bit; the activation's min term for Q4_1 / Q5_1.
static int q32_value(int32_t type, const uint8_t * blk, int r, int e) {
    const int g = (e % 16) / 4, b = e % 4;
    switch (type) {
    case ES_TYPE_Q8_0: return ((const block_q8_0x8 *) blk)->qs[e / 4][r][b] - 128;
    case ES_TYPE_Q4_0: return ((((const block_q4_0x8 *) blk)->qs[g][r][b] >> (e / 16 * 4)) & 0xF) - 8;
    case ES_TYPE_Q4_1: return (((const block_q4_1x8 *) blk)->qs[g][r][b] >> (e / 16 * 4)) & 0xF;
    case ES_TYPE_Q5_0: {
        const block_q5_0x8 * x = (const block_q5_0x8 *) blk;
        return (((x->qs[g][r][b] >> (e / 16 * 4)) & 0xF) | (((x->qh[r][e / 8] >> (e % 8)) & 1) << 4)) - 16;
    }
    default: {  // Q5_1
        const block_q5_1x8 * x = (const block_q5_1x8 *) blk;
        return ((x->qs[g][r][b] >> (e / 16 * 4)) & 0xF) | (((x->qh[r][e / 8] >> (e % 8)) & 1) << 4);
    }
    }
}

static void tile_q32_scalar(int32_t type, int64_t n, const void * wp, int64_t n_groups, const void * a,
                            size_t a_stride, int32_t nt, float * y, size_t y_stride) {
    const int64_t nb = n / QK;
    const size_t bsize = es_repack_bytes(type, QK, ES_GROUP_ROWS);
    const bool with_min = type == ES_TYPE_Q4_1 || type == ES_TYPE_Q5_1;
    for (int64_t g = 0; g < n_groups; g++) {
        for (int32_t t = 0; t < nt; t++) {
            const uint8_t * yt = (const uint8_t *) a + (size_t) t * a_stride;
            for (int r = 0; r < ES_GROUP_ROWS; r++) {
                float acc = 0.0f;
                for (int64_t i = 0; i < nb; i++) {
                    const uint8_t * blk = (const uint8_t *) wp + (size_t) (g * nb + i) * bsize;
                    // d (then m) lead every layout; Q8_0 / Q8_1 activations alike
                    const es_half * dm = (const es_half *) blk;
                    const block_q8_1 * y1 = (const block_q8_1 *) yt + i;
                    const block_q8_0 * y0 = (const block_q8_0 *) yt + i;
                    const int8_t * q8 = with_min ? y1->qs : y0->qs;
                    int sumi = 0;
                    for (int e = 0; e < QK; e++) sumi += q32_value(type, blk, r, e) * q8[e];
                    acc = fmaf(half_to_f32(dm[r]) * half_to_f32(with_min ? y1->d : y0->d), (float) sumi, acc);
                    if (with_min) acc = fmaf(half_to_f32(dm[8 + r]), half_to_f32(y1->s), acc);
                }
                y[(size_t) t * y_stride + (size_t) (ES_GROUP_ROWS * g + r)] = acc;
            }
        }
    }
}

#define TILE32_SCALAR(T, TYPE)                                                                  \
    static void tile_##T##_scalar(int64_t n, const void * wp, int64_t n_groups, const void * a, \
                                  size_t a_stride, int32_t nt, float * y, size_t y_stride) {   \
        tile_q32_scalar(TYPE, n, wp, n_groups, a, a_stride, nt, y, y_stride);                  \
    }
TILE32_SCALAR(q4_0, ES_TYPE_Q4_0)
TILE32_SCALAR(q4_1, ES_TYPE_Q4_1)
TILE32_SCALAR(q5_0, ES_TYPE_Q5_0)
TILE32_SCALAR(q5_1, ES_TYPE_Q5_1)
TILE32_SCALAR(q8_0, ES_TYPE_Q8_0)

// Each (row, token) the way dot_q4_K_scalar / dot_q5_K_scalar compute it,
// from the layout of kernels.h (bsize: the type's block bytes; Q5_K's fifth
// bits after the Q4_K part): the integer sums are the same sums, in another order.
static void tile_k4_scalar(int64_t n, const void * wp, size_t bsize, bool q5, int64_t n_groups, const void * a,
                           size_t a_stride, int32_t nt, float * y, size_t y_stride) {
    const int64_t nb = n / QK_K;
    for (int64_t g = 0; g < n_groups; g++) {
        for (int32_t t = 0; t < nt; t++) {
            const block_q8_K * yb = (const block_q8_K *) ((const uint8_t *) a + (size_t) t * a_stride);
            for (int r = 0; r < ES_GROUP_ROWS; r++) {
                float acc = 0.0f;
                for (int64_t i = 0; i < nb; i++) {
                    const uint8_t * blk = (const uint8_t *) wp + (size_t) (g * nb + i) * bsize;
                    const block_q4_Kx8 * x = (const block_q4_Kx8 *) blk;
                    const block_q5_Kx8 * x5 = (const block_q5_Kx8 *) blk;
                    int sumi = 0, summ = 0;
                    for (int c = 0; c < 4; c++) {
                        int lo = 0, hi = 0;
                        for (int k = 0; k < 32; k++) {
                            const uint8_t q = x->qs[c][k / 4][r][k % 4];
                            const uint8_t h = q5 ? x5->qh[k / 4][r][k % 4] : 0;
                            lo += ((q & 0xF) | (((h >> (2 * c)) & 1) << 4)) * yb[i].qs[64 * c + k];
                            hi += ((q >> 4) | (((h >> (2 * c + 1)) & 1) << 4)) * yb[i].qs[64 * c + 32 + k];
                        }
                        sumi += x->scales[2 * c][r] * lo + x->scales[2 * c + 1][r] * hi;
                    }
                    for (int j = 0; j < 8; j++)
                        summ += x->mins[j / 2][r][j % 2] * (yb[i].bsums[2 * j] + yb[i].bsums[2 * j + 1]);
                    acc = k_step(acc, half_to_f32(x->d[r]), half_to_f32(x->dmin[r]), yb[i].d, sumi, summ);
                }
                y[(size_t) t * y_stride + (size_t) (ES_GROUP_ROWS * g + r)] = acc;
            }
        }
    }
}

static void tile_q4_K_scalar(int64_t n, const void * wp, int64_t n_groups, const void * a, size_t a_stride,
                             int32_t nt, float * y, size_t y_stride) {
    tile_k4_scalar(n, wp, sizeof(block_q4_Kx8), false, n_groups, a, a_stride, nt, y, y_stride);
}

static void tile_q5_K_scalar(int64_t n, const void * wp, int64_t n_groups, const void * a, size_t a_stride,
                             int32_t nt, float * y, size_t y_stride) {
    tile_k4_scalar(n, wp, sizeof(block_q5_Kx8), true, n_groups, a, a_stride, nt, y, y_stride);
}

// Each (row, token) the way dot_q6_K_scalar computes it.
static void tile_q6_K_scalar(int64_t n, const void * wp, int64_t n_groups, const void * a, size_t a_stride,
                             int32_t nt, float * y, size_t y_stride) {
    const int64_t nb = n / QK_K;
    for (int64_t g = 0; g < n_groups; g++) {
        const block_q6_Kx8 * x = (const block_q6_Kx8 *) wp + g * nb;
        for (int32_t t = 0; t < nt; t++) {
            const block_q8_K * yb = (const block_q8_K *) ((const uint8_t *) a + (size_t) t * a_stride);
            for (int r = 0; r < ES_GROUP_ROWS; r++) {
                float acc = 0.0f;
                for (int64_t i = 0; i < nb; i++) {
                    int sumi = 0;
                    for (int e = 0; e < QK_K; e++) {  // e = 128 h + 32 k + 4 g + b
                        const int h = e / 128, k = (e / 32) % 4, g = (e / 4) % 8, b = e % 4;
                        const int lo = (x[i].ql[h][k & 1][g][r][b] >> (4 * (k / 2))) & 0xF;
                        const int hi = (x[i].qh[h][g][r][b] >> (2 * k)) & 3;
                        sumi += x[i].scales[e / 16][r] * ((lo | (hi << 4)) - 32) * yb[i].qs[e];
                    }
                    acc = fmaf(half_to_f32(x[i].d[r]) * yb[i].d, (float) sumi, acc);
                }
                y[(size_t) t * y_stride + (size_t) (ES_GROUP_ROWS * g + r)] = acc;
            }
        }
    }
}

// The int8 peak of plain C: 8 independent int multiply-adds of int8 operands.
static int64_t int8_loop_scalar(int64_t iterations, int32_t * sink) {
    int32_t acc[8] = {0}, w0 = 3, w1 = 4;
    for (int64_t i = 0; i < iterations; i++) {
        for (int k = 0; k < 8; k += 2) {
            acc[k] += (int8_t) w0 * (int8_t) 5;
            acc[k + 1] += (int8_t) w1 * (int8_t) 7;
            __asm__ volatile("" : "+r"(w0), "+r"(w1));  // operands of every step's own
        }
    }
    int32_t s = 0;
    for (int k = 0; k < 8; k++) s += acc[k];
    *sink = s;
    return iterations * 8;
}

static const es_kernel_set KERNELS_SCALAR = {
    .name = "scalar",
    .dot = {
        [ES_TYPE_F32] = dot_f32_scalar, [ES_TYPE_F16] = dot_f16_scalar,
        [ES_TYPE_BF16] = dot_bf16_scalar, [ES_TYPE_Q4_0] = dot_q4_0_scalar,
        [ES_TYPE_Q4_1] = dot_q4_1_scalar, [ES_TYPE_Q5_0] = dot_q5_0_scalar,
        [ES_TYPE_Q5_1] = dot_q5_1_scalar, [ES_TYPE_Q8_0] = dot_q8_0_scalar,
        [ES_TYPE_Q4_K] = dot_q4_K_scalar, [ES_TYPE_Q5_K] = dot_q5_K_scalar,
        [ES_TYPE_Q6_K] = dot_q6_K_scalar, [ES_TYPE_Q2_K] = dot_q2_K_scalar,
        [ES_TYPE_Q3_K] = dot_q3_K_scalar,
    },
    .tile = {
        [ES_TYPE_Q4_0] = tile_q4_0_scalar, [ES_TYPE_Q4_1] = tile_q4_1_scalar,
        [ES_TYPE_Q5_0] = tile_q5_0_scalar, [ES_TYPE_Q5_1] = tile_q5_1_scalar,
        [ES_TYPE_Q8_0] = tile_q8_0_scalar, [ES_TYPE_Q4_K] = tile_q4_K_scalar,
        [ES_TYPE_Q5_K] = tile_q5_K_scalar, [ES_TYPE_Q6_K] = tile_q6_K_scalar,
    },
    .axpy_f16 = axpy_f16_scalar,
    .axpy_q8_0 = axpy_q8_0_scalar,
    .int8_loop = int8_loop_scalar,
};

const es_kernel_set * es__kernels_scalar(void) { return &KERNELS_SCALAR; }
