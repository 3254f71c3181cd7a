/*
 * gemma3.c — Gemma 3 (text), as llama.cpp's models/gemma3.cpp:
 *
 *   x = embed(token) * sqrt(n_embd)
 *   q, k = rope(rmsnorm_head(wq · norm(x))), rope(rmsnorm_head(wk · norm(x)))
 *   x += post_norm(wo · attention(q / sqrt(head_dim), k, wv · norm(x)))
 *   x += post_ffw_norm(down(gelu(gate · norm(x)) * up · norm(x)))
 *
 * Layers alternate sliding-window and global attention (ES_SWA_PATTERN);
 * optional final logit soft-capping. RoPE in the NEOX layout. The GGUF
 * converter has already added Gemma's +1 to every norm weight.
 */
#include "native/native_internal.h"

static const es_arch_row TENSORS[] = {
    ES_TENSORS_EMBEDDINGS,
    ES_TENSORS_ATTENTION(ES_DIM_Q),
    {{"attn_q_norm.weight",         {ES_DIM_HEAD}, ES_L | ES_R}, ES_LAYER_W(attn_q_norm)},
    {{"attn_k_norm.weight",         {ES_DIM_HEAD}, ES_L | ES_R}, ES_LAYER_W(attn_k_norm)},
    {{"post_attention_norm.weight", {ES_DIM_EMBD}, ES_L | ES_R}, ES_LAYER_W(attn_post_norm)},
    ES_TENSORS_FFN_DENSE(0),
    {{"post_ffw_norm.weight",       {ES_DIM_EMBD}, ES_L | ES_R}, ES_LAYER_W(ffn_post_norm)},
};

const es_arch es__arch_gemma3 = {
    .name = "gemma3", ES_TABLE(TENSORS), .ffn = ES_FFN_DENSE, .full_rope = false,
    .traits = {
        .rope_type = ES_ROPE_NEOX, .activation = ES_ACT_GELU_TANH, .qk_norm = true, .post_norms = true,
        .embd_scale = true, .final_softcap = true, .attn_scale = ES_ATTN_SCALE_Q_GEMMA3,
        .swa = ES_SWA_PATTERN,
    },
    .load = es__load_dense, .layer = es__decoder_layer,
};
