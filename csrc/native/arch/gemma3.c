/*
 * gemma3.c — Gemma 3 (text), as llama.cpp's models/gemma3.cpp:
 *
 *   x = embed(token) * sqrt(n_embd)
 *   q, k = rope(rmsnorm_head(wq · norm(x))), rope(rmsnorm_head(wk · norm(x)))
 *   x += post_norm(wo · attention(q / sqrt(head_dim), k, wv · norm(x)))
 *   x += post_ffw_norm(down(gelu(gate · norm(x)) * up · norm(x)))
 *
 * Layers alternate sliding-window and global attention: with the pattern p
 * (attention.sliding_window_pattern, default 6) layer il is global when
 * il % p == p - 1; the window layers use RoPE base rope.freq_base_swa
 * (default 10000) and no frequency scaling. RoPE in the NEOX layout. The
 * GGUF converter has already added Gemma's +1 to every norm weight.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "native/native_internal.h"

static int swa_pattern(es_model * m, char * err, size_t err_cap) {
    char key[96];
    snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", m->arch->name);
    int32_t elem;
    uint64_t count;
    const void * data;
    if (es_gguf_get_arr(m->gguf, key, &elem, &count, &data)) {
        // One flag per layer (GGUF bool, uint8 or int32 elements).
        const size_t width = elem == 7 || elem == 0 || elem == 1 ? 1 : elem == 4 || elem == 5 ? 4 : 0;
        if (width == 0 || count != (uint64_t) m->n_layer) {
            snprintf(err, err_cap, "metadata key %s: expected %d flags", key, (int) m->n_layer);
            return ES_ERR_FORMAT;
        }
        for (int32_t il = 0; il < m->n_layer; il++) {
            int32_t v = 0;
            memcpy(&v, (const uint8_t *) data + (size_t) il * width, width);
            m->layers[il].swa = v != 0;
        }
        return ES_OK;
    }
    int32_t p = 6;
    const int rc = es__key_i32(m, "attention.sliding_window_pattern", false, &p, err, err_cap);
    if (rc != ES_OK) return rc;
    for (int32_t il = 0; il < m->n_layer; il++) {
        m->layers[il].swa = p == 0 || il % p < p - 1;
    }
    return ES_OK;
}

static int load(es_model * m, char * err, size_t err_cap) {
    float rope_base, rope_base_swa = 10000.0f, scale;
    int rc = es__load_attention_hparams(m, &rope_base, &scale, err, err_cap);
#define TRY(call) do { if (rc == ES_OK) rc = (call); } while (0)
    TRY(es__key_i32(m, "feed_forward_length", true, &m->n_ff, err, err_cap));
    TRY(es__key_i32(m, "attention.sliding_window", false, &m->n_swa, err, err_cap));
    TRY(es__key_f32(m, "rope.freq_base_swa", false, &rope_base_swa, err, err_cap));
    TRY(es__key_f32(m, "final_logit_softcapping", false, &m->final_softcap, err, err_cap));
    m->rope_type = ES_ROPE_NEOX;
    m->embd_scale = sqrtf((float) m->n_embd);
    TRY(es__bind_embeddings(m, err, err_cap));
    if (rc != ES_OK) return rc;

    const int64_t D = m->n_embd, HD = m->head_dim, F = m->n_ff;
    if (m->n_swa > 0) TRY(swa_pattern(m, err, err_cap));
    for (int32_t il = 0; il < m->n_layer && rc == ES_OK; il++) {
        es_layer * L = &m->layers[il];
        L->rope_base = L->swa ? rope_base_swa : rope_base;
        L->rope_scale = L->swa ? 1.0f : scale;
        TRY(es__bind_attention(m, il, err, err_cap));
        TRY(es__bind(m, il, "attn_q_norm", HD, 1, true, &L->attn_q_norm, err, err_cap));
        TRY(es__bind(m, il, "attn_k_norm", HD, 1, true, &L->attn_k_norm, err, err_cap));
        TRY(es__bind(m, il, "post_attention_norm", D, 1, true, &L->attn_post_norm, err, err_cap));
        TRY(es__bind(m, il, "ffn_norm", D, 1, true, &L->ffn_norm, err, err_cap));
        TRY(es__bind(m, il, "ffn_gate", D, F, true, &L->ffn_gate, err, err_cap));
        TRY(es__bind(m, il, "ffn_up", D, F, true, &L->ffn_up, err, err_cap));
        TRY(es__bind(m, il, "ffn_down", F, D, true, &L->ffn_down, err, err_cap));
        TRY(es__bind(m, il, "post_ffw_norm", D, 1, true, &L->ffn_post_norm, err, err_cap));
    }
#undef TRY
    return rc;
}

static int layer(es_context * ctx, int32_t il) {
    const es_model * m = ctx->model;
    const es_layer * L = &m->layers[il];
    const int32_t n = ctx->n, hd = m->head_dim;
    const int64_t D = m->n_embd;

    // Attention, with per-head Q/K norms before RoPE and Q scaled after it
    // (llama.cpp scales Q and attends with scale 1; Gemma 3 27B would scale
    // by 1/sqrt(n_embd / n_head) instead — its 62 layers are told apart).
    int rc = es__attention_inputs(ctx, il);
    if (rc != ES_OK) return rc;
    es__rms_norm(ctx->q, &L->attn_q_norm, ctx->q, (int64_t) n * m->n_head, hd, m->norm_eps);
    es__rope(ctx, il, ctx->q, m->n_head);
    es__rms_norm(ctx->k, &L->attn_k_norm, ctx->k, (int64_t) n * m->n_head_kv, hd, m->norm_eps);
    es__rope(ctx, il, ctx->k, m->n_head_kv);
    const float q_scale = m->n_layer == 62 ? 1.0f / sqrtf((float) (m->n_embd / m->n_head))
                                           : 1.0f / sqrtf((float) hd);
    const int64_t nq = (int64_t) n * m->n_head * hd;
    for (int64_t i = 0; i < nq; i++) ctx->q[i] *= q_scale;
    es__attention(ctx, il, 1.0f);
    const es_weight * wo = &L->wo;
    rc = es__matmul(ctx, 1, &wo, ctx->att, &ctx->out, n);
    if (rc != ES_OK) return rc;
    es__rms_norm(ctx->out, &L->attn_post_norm, ctx->out, n, D, m->norm_eps);
    es__add(ctx->x, ctx->out, (int64_t) n * D);

    // Feed-forward (GELU-gated), post-normed.
    es__rms_norm(ctx->x, &L->ffn_norm, ctx->xn, n, D, m->norm_eps);
    rc = es__ffn(ctx, il, ES_FFN_GELU);
    if (rc != ES_OK) return rc;
    es__rms_norm(ctx->out, &L->ffn_post_norm, ctx->out, n, D, m->norm_eps);
    es__add(ctx->x, ctx->out, (int64_t) n * D);
    return ES_OK;
}

const es_arch es__arch_gemma3 = { .name = "gemma3", .load = load, .layer = layer };
