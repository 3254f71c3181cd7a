/*
 * llama.c — the llama architecture (SmolLM2, Llama 2/3 without RoPE
 * factors, Mixtral-style Mixture of Experts), as llama.cpp's models/llama.cpp:
 *
 *   x += wo · attention(rope(wq · norm(x)), rope(wk · norm(x)), wv · norm(x))
 *   x += ffn(norm(x))   ffn: down(silu(gate) * up), or the MoE block when
 *                       llama.expert_count > 0 (router + ffn_*_exps)
 *
 * RoPE in llama.cpp's NORM layout (adjacent pairs).
 */
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
    int32_t n_expert = 0, n_expert_used = 0;
    int rc = es__load_decoder_hparams(m, err, err_cap);
#define TRY(call) do { if (rc == ES_OK) rc = (call); } while (0)
    TRY(es__key_i32(m, "feed_forward_length", true, &m->n_ff, err, err_cap));
    TRY(es__key_i32(m, "expert_count", false, &n_expert, err, err_cap));
    TRY(es__key_i32(m, "expert_used_count", false, &n_expert_used, err, err_cap));
    TRY(es__bind_tensors(m, n_expert > 0, err, err_cap));
    if (rc != ES_OK) return rc;
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

const es_arch es__arch_llama = {
    .name = "llama", ES_TABLE(TENSORS), .ffn = ES_FFN_BY_EXPERT_COUNT, .full_rope = true,
    .traits = {.rope_type = ES_ROPE_NORM, .activation = ES_ACT_SILU},
    .load = load, .layer = es__decoder_layer,
};
