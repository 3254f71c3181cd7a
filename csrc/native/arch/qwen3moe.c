/*
 * qwen3moe.c — Qwen3 mixture-of-experts decoders (Qwen3-30B-A3B,
 * Qwen3-235B-A22B), as llama.cpp's models/qwen3moe.cpp:
 *
 *   h = norm(x)
 *   x += wo · attention(rope(qnorm(wq · h)), rope(knorm(wk · h)), wv · h)
 *   x += moe(norm(x))    softmax router, top k, weights renormalised (moe.c)
 *
 * qnorm/knorm: RMSNorm of every head before RoPE. RoPE in the NEOX layout.
 * A head's width is attention.key_length, so n_head * head_dim need not be
 * n_embd. Every layer's FFN is a mixture of experts.
 */
#include <math.h>

#include "native/native_internal.h"

static int load(es_model * m, char * err, size_t err_cap) {
    float rope_base, scale;
    int32_t n_expert = 0, n_expert_used = 0, n_ff_exp = 0, n_ff = 0;
    int rc = es__load_attention_hparams(m, &rope_base, &scale, err, err_cap);
#define TRY(call) do { if (rc == ES_OK) rc = (call); } while (0)
    TRY(es__key_i32(m, "expert_count", true, &n_expert, err, err_cap));
    TRY(es__key_i32(m, "expert_used_count", true, &n_expert_used, err, err_cap));
    TRY(es__key_i32(m, "expert_feed_forward_length", false, &n_ff_exp, err, err_cap));
    TRY(es__key_i32(m, "feed_forward_length", false, &n_ff, err, err_cap));
    // One expert's width; files without the key give the width of the
    // n_expert_used experts together (llama.cpp's fallback).
    if (n_ff_exp == 0 && n_expert_used > 0) n_ff_exp = n_ff / n_expert_used;
    m->n_ff = 0;  // no dense FFN
    m->rope_type = ES_ROPE_NEOX;
    m->embd_scale = 1.0f;
    TRY(es__bind_embeddings(m, err, err_cap));
    if (rc != ES_OK) return rc;

    const int64_t D = m->n_embd, HD = m->head_dim;
    for (int32_t il = 0; il < m->n_layer && rc == ES_OK; il++) {
        es_layer * L = &m->layers[il];
        L->rope_base = rope_base;
        L->rope_scale = scale;
        TRY(es__bind_attention(m, il, err, err_cap));
        TRY(es__bind(m, il, "attn_q_norm", HD, 1, true, &L->attn_q_norm, err, err_cap));
        TRY(es__bind(m, il, "attn_k_norm", HD, 1, true, &L->attn_k_norm, err, err_cap));
        TRY(es__bind(m, il, "ffn_norm", D, 1, true, &L->ffn_norm, err, err_cap));
    }
    // llama.cpp renormalises the top-k weights of qwen3moe whatever the file's
    // expert_weights_norm says (Qwen3's norm_topk_prob is true).
    const es_moe_params mp = {
        .n_layer = m->n_layer, .n_expert = n_expert, .n_expert_used = n_expert_used,
        .n_embd = D, .n_ff = n_ff_exp, .experts = m->params.experts, .norm_w = true,
    };
    TRY(es_experts_init(m->gguf, &mp, &m->experts, err, err_cap));
#undef TRY
    return rc;
}

static int layer(es_context * ctx, int32_t il) {
    const es_model * m = ctx->model;
    const es_layer * L = &m->layers[il];
    const int32_t n = ctx->n;
    const int64_t D = m->n_embd;

    // Attention, with every head of Q and K RMS-normed before RoPE.
    int rc = es__attention_inputs(ctx, il);
    if (rc != ES_OK) return rc;
    es__rms_norm(ctx->q, &L->attn_q_norm, ctx->q, (int64_t) n * m->n_head, m->head_dim,
                 m->norm_eps);
    es__rms_norm(ctx->k, &L->attn_k_norm, ctx->k, (int64_t) n * m->n_head_kv, m->head_dim,
                 m->norm_eps);
    es__rope(ctx, il, ctx->q, m->n_head);
    es__rope(ctx, il, ctx->k, m->n_head_kv);
    es__attention(ctx, il, 1.0f / sqrtf((float) m->head_dim));
    const es_weight * wo = &L->wo;
    rc = es__matmul(ctx, 1, &wo, ctx->att, &ctx->out, n);
    if (rc != ES_OK) return rc;
    es__add(ctx->x, ctx->out, (int64_t) n * D);

    // The experts.
    es__rms_norm(ctx->x, &L->ffn_norm, ctx->xn, n, D, m->norm_eps);
    rc = es_moe_ffn(ctx->moe, ctx->pool, il, ctx->xn, n, ctx->out);
    if (rc != ES_OK) return rc;
    es__add(ctx->x, ctx->out, (int64_t) n * D);
    return ES_OK;
}

const es_arch es__arch_qwen3moe = { .name = "qwen3moe", .load = load, .layer = layer };
