/*
 * quants.c — weight types: ggml's block layouts (kernels.h), row sizes,
 * dequantization, activation quantization and the Q2_K / Q3_K weight
 * quantization of the low-precision expert copies. The dot products are in
 * the kernel sets' files (kernels.h lists them).
 *
 * Every weight type's dot product reads the activation row in a companion
 * format (es_act_type): the weight's own type for float weights (activations
 * rounded to F16 / BF16 as ggml's vec_dot_type does), Q8_0 / Q8_1 for the
 * 32-element quants, Q8_K for the 256-element K-quants. The activation is
 * quantized the way ggml's x86 build does it, so our logits stay within
 * rounding of llama.cpp's. Activation quantization and dequantization are
 * scalar, shared by every kernel set, so all sets see identical inputs.
 */
#include "kernels.h"

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
