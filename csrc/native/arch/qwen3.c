/*
 * qwen3.c — Qwen3 dense decoders (Qwen3-0.6B ... 32B), as llama.cpp's
 * models/qwen3.cpp: qwen3moe's attention and a dense SwiGLU FFN,
 *
 *   h = norm(x)
 *   x += wo · attention(rope(qnorm(wq · h)), rope(knorm(wk · h)), wv · h)
 *   x += down(silu(gate · norm(x)) * up · norm(x))
 *
 * qnorm/knorm: RMSNorm of every head before RoPE, in the NEOX layout. A
 * head's width is attention.key_length, so n_head * head_dim need not be
 * n_embd (Qwen3-0.6B: 16 heads of 128 on 1024).
 */
#include "native/native_internal.h"

static const es_arch_row TENSORS[] = {
    ES_TENSORS_EMBEDDINGS,
    ES_TENSORS_ATTENTION(ES_DIM_Q),
    {{"attn_q_norm.weight", {ES_DIM_HEAD}, ES_L | ES_R}, ES_LAYER_W(attn_q_norm)},
    {{"attn_k_norm.weight", {ES_DIM_HEAD}, ES_L | ES_R}, ES_LAYER_W(attn_k_norm)},
    ES_TENSORS_FFN_DENSE(0),
};

const es_arch es__arch_qwen3 = {
    .name = "qwen3", ES_TABLE(TENSORS), .ffn = ES_FFN_DENSE, .full_rope = true,
    .traits = {.rope_type = ES_ROPE_NEOX, .activation = ES_ACT_SILU, .qk_norm = true},
    .load = es__load_dense, .layer = es__decoder_layer,
};
