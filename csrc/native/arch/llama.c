/*
 * llama.c — the llama architecture (SmolLM2, Llama 2/3 without RoPE
 * factors, Mixtral-style Mixture of Experts), as llama.cpp's models/llama.cpp:
 *
 *   x += wo · attention(rope(wq · norm(x)), rope(wk · norm(x)), wv · norm(x))
 *   x += ffn(norm(x))   ffn: down(silu(gate) * up), or the MoE block when
 *                       llama.expert_count > 0 (router + ffn_*_exps)
 *
 * RoPE in llama.cpp's NORM layout (adjacent pairs). qwen2 (arch/qwen2.c)
 * shares the layer.
 */
#include <math.h>
#include <string.h>

#include "native/native_internal.h"

// The attention biases: an upcycled Qwen2.5 has them (edgespec moe upcycle).
static const es_arch_row TENSORS[] = {
    ES_TENSORS_EMBEDDINGS,
    ES_TENSORS_ATTENTION(ES_DIM_Q),
    ES_TENSORS_ATTENTION_BIASES,
    ES_TENSORS_FFN_DENSE(ES_TENSOR_DENSE),
    ES_TENSORS_FFN_EXPERTS,
};

static int load(es_model * m, char * err, size_t err_cap) {
    float rope_base, scale;
    int32_t n_expert = 0, n_expert_used = 0;
    int rc = es__load_attention_hparams(m, &rope_base, &scale, err, err_cap);
#define TRY(call) do { if (rc == ES_OK) rc = (call); } while (0)
    TRY(es__key_i32(m, "feed_forward_length", true, &m->n_ff, err, err_cap));
    TRY(es__key_i32(m, "expert_count", false, &n_expert, err, err_cap));
    TRY(es__key_i32(m, "expert_used_count", false, &n_expert_used, err, err_cap));
    m->rope_type = ES_ROPE_NORM;
    m->embd_scale = 1.0f;
    TRY(es__bind_tensors(m, n_expert > 0, err, err_cap));
    if (rc != ES_OK) return rc;
    for (int32_t il = 0; il < m->n_layer; il++) {
        m->layers[il].rope_base = rope_base;
        m->layers[il].rope_scale = scale;
    }
    if (n_expert > 0) {
        // Mixtral: softmax gating, the top-k weights renormalised (llama.cpp: norm_w).
        const es_moe_params mp = {
            .n_layer = m->n_layer, .n_expert = n_expert, .n_expert_used = n_expert_used,
            .n_embd = m->n_embd, .n_ff = m->n_ff, .experts = m->params.experts, .norm_w = true,
        };
        rc = es_experts_init(m->gguf, &mp, &m->experts, err, err_cap);
        m->n_ff = 0;  // no dense FFN
    }
#undef TRY
    return rc;
}

int es__llama_layer(es_context * ctx, int32_t il) {
    const es_model * m = ctx->model;
    const es_layer * L = &m->layers[il];
    const int32_t n = ctx->n;
    const int64_t D = m->n_embd;

    // Attention.
    int rc = es__attention_inputs(ctx, il);
    if (rc != ES_OK) return rc;
    es__rope(ctx, il, ctx->q, m->n_head);
    es__rope(ctx, il, ctx->k, m->n_head_kv);
    es__attention(ctx, il, 1.0f / sqrtf((float) m->head_dim));
    const es_weight * wo = &L->wo;
    rc = es__matmul(ctx, 1, &wo, ctx->att, &ctx->out, n);
    if (rc != ES_OK) return rc;
    es__add(ctx->x, ctx->out, (int64_t) n * D);

    // Feed-forward: dense, or the experts.
    es__rms_norm(ctx->x, &L->ffn_norm, ctx->xn, n, D, m->norm_eps);
    rc = ctx->moe ? es_moe_ffn(ctx->moe, ctx->pool, il, ctx->xn, n, ctx->out)
                  : es__ffn(ctx, il, ES_FFN_SILU);
    if (rc != ES_OK) return rc;
    es__add(ctx->x, ctx->out, (int64_t) n * D);
    return ES_OK;
}

const es_arch es__arch_llama = {
    .name = "llama", ES_TABLE(TENSORS), .ffn = ES_FFN_BY_EXPERT_COUNT, .full_rope = true,
    .load = load, .layer = es__llama_layer,
};
