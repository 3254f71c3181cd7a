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
#include "native/native_internal.h"

static const es_arch_row TENSORS[] = {
    ES_TENSORS_EMBEDDINGS,
    ES_TENSORS_ATTENTION(ES_DIM_Q),
    {{"attn_q_norm.weight", {ES_DIM_HEAD}, ES_L | ES_R}, ES_LAYER_W(attn_q_norm)},
    {{"attn_k_norm.weight", {ES_DIM_HEAD}, ES_L | ES_R}, ES_LAYER_W(attn_k_norm)},
    {{"ffn_norm.weight",    {ES_DIM_EMBD}, ES_L | ES_R}, ES_LAYER_W(ffn_norm)},
    ES_TENSORS_FFN_EXPERTS,
};

static int load(es_model * m, char * err, size_t err_cap) {
    int32_t n_expert = 0, n_expert_used = 0, n_ff_exp = 0, n_ff = 0;
    int rc = es__load_decoder_hparams(m, err, err_cap);
#define TRY(call) do { if (rc == ES_OK) rc = (call); } while (0)
    TRY(es__key_i32(m, "expert_count", true, &n_expert, err, err_cap));
    TRY(es__key_i32(m, "expert_used_count", true, &n_expert_used, err, err_cap));
    TRY(es__key_i32(m, "expert_feed_forward_length", false, &n_ff_exp, err, err_cap));
    TRY(es__key_i32(m, "feed_forward_length", false, &n_ff, err, err_cap));
    // One expert's width; files without the key give the width of the
    // n_expert_used experts together (llama.cpp's fallback).
    if (n_ff_exp == 0 && n_expert_used > 0) n_ff_exp = n_ff / n_expert_used;
    m->n_ff = 0;  // no dense FFN
    TRY(es__bind_tensors(m, true, err, err_cap));
    if (rc != ES_OK) return rc;
    // llama.cpp renormalises the top-k weights of qwen3moe whatever the file's
    // expert_weights_norm says (Qwen3's norm_topk_prob is true).
    const es_moe_params mp = {
        .n_layer = m->n_layer, .n_expert = n_expert, .n_expert_used = n_expert_used,
        .n_embd = m->n_embd, .n_ff = n_ff_exp, .experts = m->params.experts, .norm_w = true,
    };
    TRY(es_experts_init(m->gguf, &mp, &m->experts, err, err_cap));
#undef TRY
    return rc;
}

const es_arch es__arch_qwen3moe = {
    .name = "qwen3moe", ES_TABLE(TENSORS), .ffn = ES_FFN_MOE, .full_rope = true,
    .traits = {.rope_type = ES_ROPE_NEOX, .activation = ES_ACT_SILU, .qk_norm = true},
    .load = load, .layer = es__decoder_layer,
};
