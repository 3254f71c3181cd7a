/*
 * repack.c — a weight's rows rewritten once, at load, into the interleaved
 * layouts of kernels.h for the tile kernels: groups of 8 rows block by
 * block, four bytes of each row at a time, the K-quants' 6-bit scales and
 * mins unpacked to bytes. The values are the GGUF's, only moved: a tile
 * kernel's results are bit for bit the unpacked kernels'.
 */
#include "kernels.h"

// Bytes of one group's blocks for a type with a repacked layout; 0: none.
static size_t group_bytes(int32_t type, int64_t n) {
    switch (type) {
    case ES_TYPE_Q4_0: return n % QK ? 0 : (size_t) (n / QK) * sizeof(block_q4_0x8);
    case ES_TYPE_Q4_1: return n % QK ? 0 : (size_t) (n / QK) * sizeof(block_q4_1x8);
    case ES_TYPE_Q5_0: return n % QK ? 0 : (size_t) (n / QK) * sizeof(block_q5_0x8);
    case ES_TYPE_Q5_1: return n % QK ? 0 : (size_t) (n / QK) * sizeof(block_q5_1x8);
    case ES_TYPE_Q8_0: return n % QK ? 0 : (size_t) (n / QK) * sizeof(block_q8_0x8);
    case ES_TYPE_Q4_K: return n % QK_K ? 0 : (size_t) (n / QK_K) * sizeof(block_q4_Kx8);
    case ES_TYPE_Q5_K: return n % QK_K ? 0 : (size_t) (n / QK_K) * sizeof(block_q5_Kx8);
    case ES_TYPE_Q6_K: return n % QK_K ? 0 : (size_t) (n / QK_K) * sizeof(block_q6_Kx8);
    default:           return 0;
    }
}

size_t es_repack_bytes(int32_t type, int64_t n, int64_t n_rows) {
    if (n <= 0 || n_rows < ES_GROUP_ROWS) return 0;
    return group_bytes(type, n) * (size_t) (n_rows / ES_GROUP_ROWS);
}

// The 32-element quants: d (and m) per row, four bytes of qs per row and
// group, the fifth bits as they are; Q8_0's values moved to u8.
#define REPACK32(T, HAS_M, HAS_QH)                                                              \
    static void repack_##T(const block_##T * const row[8], int64_t nb, block_##T##x8 * out) {  \
        for (int64_t i = 0; i < nb; i++, out++)                                                 \
            for (int r = 0; r < 8; r++) {                                                       \
                const block_##T * x = row[r] + i;                                               \
                out->d[r] = x->d;                                                               \
                HAS_M(out->m[r] = x->m);                                                        \
                HAS_QH(memcpy(out->qh[r], x->qh, 4));                                           \
                for (int g = 0; g < 4; g++) memcpy(out->qs[g][r], x->qs + 4 * g, 4);            \
            }                                                                                   \
    }
#define WITH(x) x;
#define WITHOUT(x)
REPACK32(q4_0, WITHOUT, WITHOUT)
REPACK32(q4_1, WITH, WITHOUT)
REPACK32(q5_0, WITHOUT, WITH)
REPACK32(q5_1, WITH, WITH)

static void repack_q8_0(const block_q8_0 * const row[8], int64_t nb, block_q8_0x8 * out) {
    for (int64_t i = 0; i < nb; i++, out++)
        for (int r = 0; r < 8; r++) {
            out->d[r] = row[r][i].d;
            for (int e = 0; e < QK; e++) out->qs[e / 4][r][e % 4] = (uint8_t) (row[r][i].qs[e] + 128);
        }
}

// Row r of a Q4_K / Q5_K group's block (both lay d, dmin, scales and qs out alike).
static void repack_k4(es_half d, es_half dmin, const uint8_t scales[12], const uint8_t qs[QK_K / 2], int r,
                      block_q4_Kx8 * out) {
    uint8_t sc[8], m[8];
    unpack_scales_k4(scales, sc, m);
    out->d[r] = d, out->dmin[r] = dmin;
    for (int j = 0; j < 8; j++) out->scales[j][r] = sc[j];
    for (int k = 0; k < 4; k++) out->mins[k][r][0] = m[2 * k], out->mins[k][r][1] = m[2 * k + 1];
    for (int c = 0; c < 4; c++)
        for (int g = 0; g < 8; g++) memcpy(out->qs[c][g][r], qs + 32 * c + 4 * g, 4);
}

static void repack_q4_K(const block_q4_K * const row[8], int64_t nb, block_q4_Kx8 * out) {
    for (int64_t i = 0; i < nb; i++, out++)
        for (int r = 0; r < 8; r++) repack_k4(row[r][i].d, row[r][i].dmin, row[r][i].scales, row[r][i].qs, r, out);
}

static void repack_q5_K(const block_q5_K * const row[8], int64_t nb, block_q5_Kx8 * out) {
    for (int64_t i = 0; i < nb; i++, out++)
        for (int r = 0; r < 8; r++) {
            const block_q5_K * x = row[r] + i;
            repack_k4(x->d, x->dmin, x->scales, x->qs, r, &out->k4);
            for (int g = 0; g < 8; g++) memcpy(out->qh[g][r], x->qh + 4 * g, 4);
        }
}

static void repack_q6_K(const block_q6_K * const row[8], int64_t nb, block_q6_Kx8 * out) {
    for (int64_t i = 0; i < nb; i++, out++) {
        for (int r = 0; r < 8; r++) {
            const block_q6_K * x = row[r] + i;
            out->d[r] = x->d;
            for (int j = 0; j < 16; j++) out->scales[j][r] = x->scales[j];
            for (int h = 0; h < 2; h++)
                for (int g = 0; g < 8; g++) {
                    for (int p = 0; p < 2; p++) memcpy(out->ql[h][p][g][r], x->ql + 64 * h + 32 * p + 4 * g, 4);
                    memcpy(out->qh[h][g][r], x->qh + 32 * h + 4 * g, 4);
                }
        }
    }
}

void es_repack(int32_t type, const void * rows, int64_t n, int64_t n_rows, void * dst) {
    const size_t row_bytes = es_type_row_bytes(type, n), gb = group_bytes(type, n);
    if (row_bytes == 0 || gb == 0) return;
    for (int64_t g = 0; g < n_rows / ES_GROUP_ROWS; g++) {
        const void * row[ES_GROUP_ROWS];
        for (int r = 0; r < ES_GROUP_ROWS; r++)
            row[r] = (const uint8_t *) rows + (size_t) (ES_GROUP_ROWS * g + r) * row_bytes;
        void * out = (uint8_t *) dst + (size_t) g * gb;
        switch (type) {
        case ES_TYPE_Q4_0: repack_q4_0((const block_q4_0 * const *) row, n / QK, out); break;
        case ES_TYPE_Q4_1: repack_q4_1((const block_q4_1 * const *) row, n / QK, out); break;
        case ES_TYPE_Q5_0: repack_q5_0((const block_q5_0 * const *) row, n / QK, out); break;
        case ES_TYPE_Q5_1: repack_q5_1((const block_q5_1 * const *) row, n / QK, out); break;
        case ES_TYPE_Q8_0: repack_q8_0((const block_q8_0 * const *) row, n / QK, out); break;
        case ES_TYPE_Q4_K: repack_q4_K((const block_q4_K * const *) row, n / QK_K, out); break;
        case ES_TYPE_Q5_K: repack_q5_K((const block_q5_K * const *) row, n / QK_K, out); break;
        case ES_TYPE_Q6_K: repack_q6_K((const block_q6_K * const *) row, n / QK_K, out); break;
        default: break;
        }
    }
}
