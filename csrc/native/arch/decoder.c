/*
 * decoder.c — the decoder layer every architecture here is, computed as its
 * traits (es_arch_traits, resolved for the file in m->traits) say:
 *
 *   q, k, v = wq · norm(x) (+ bq), wk · norm(x) (+ bk), wv · norm(x) (+ bv)
 *   q, k    = rope(qnorm(q)), rope(knorm(k))       qnorm, knorm: qk_norm only
 *   x      += post_norm(wo · attention(q, k, v))   post_norm: post_norms only
 *   x      += post_ffw_norm(ffn(norm(x)))          ffn: down(act(gate) * up), or the experts
 *
 * RoPE in the traits' layout with each layer's base and scale; attention
 * scaled by attn_scale, on the scores or (ES_ATTN_SCALE_Q_GEMMA3, as
 * llama.cpp's gemma3) on Q before the cache's F16 rounding; sliding layers
 * see the last n_swa positions. The branches are per layer, not per token.
 */
#include "native/native_internal.h"

int es__decoder_layer(es_context * ctx, int32_t il) {
    const es_model * m = ctx->model;
    const es_model_traits * t = &m->traits;
    const es_layer * L = &m->layers[il];
    const int32_t n = ctx->n, hd = m->head_dim;
    const int64_t D = m->n_embd;

    // Attention.
    int rc = es__attention_inputs(ctx, il);
    if (rc != ES_OK) return rc;
    if (t->arch.qk_norm) {
        es__rms_norm(ctx->q, &L->attn_q_norm, ctx->q, (int64_t) n * m->n_head, hd, m->norm_eps);
        es__rms_norm(ctx->k, &L->attn_k_norm, ctx->k, (int64_t) n * m->n_head_kv, hd, m->norm_eps);
    }
    es__rope(ctx, il, ctx->q, m->n_head);
    es__rope(ctx, il, ctx->k, m->n_head_kv);
    float kq_scale = t->attn_scale;
    if (t->arch.attn_scale == ES_ATTN_SCALE_Q_GEMMA3) {
        const int64_t nq = (int64_t) n * m->n_head * hd;
        for (int64_t i = 0; i < nq; i++) ctx->q[i] *= t->attn_scale;
        kq_scale = 1.0f;
    }
    es__attention(ctx, il, kq_scale);
    const es_weight * wo = &L->wo;
    rc = es__matmul(ctx, 1, &wo, ctx->att, &ctx->out, n);
    if (rc != ES_OK) return rc;
    if (t->arch.post_norms) es__rms_norm(ctx->out, &L->attn_post_norm, ctx->out, n, D, m->norm_eps);
    es__add(ctx->x, ctx->out, (int64_t) n * D);

    // Feed-forward: dense, or the experts.
    es__rms_norm(ctx->x, &L->ffn_norm, ctx->xn, n, D, m->norm_eps);
    rc = ctx->moe ? es_moe_ffn(ctx->moe, ctx->pool, il, ctx->xn, n, ctx->out)
                  : es__ffn(ctx, il, t->arch.activation);
    if (rc != ES_OK) return rc;
    if (t->arch.post_norms) es__rms_norm(ctx->out, &L->ffn_post_norm, ctx->out, n, D, m->norm_eps);
    es__add(ctx->x, ctx->out, (int64_t) n * D);
    return ES_OK;
}
