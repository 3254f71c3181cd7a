/*
 * qwen2.c — Qwen2 and Qwen2.5 decoders (Qwen2.5-Coder), as llama.cpp's
 * models/qwen2.cpp: the llama layer (arch/llama.c) with two differences,
 *
 *   q, k, v = wq · norm(x) + bq, wk · norm(x) + bk, wv · norm(x) + bv
 *   RoPE in the NEOX layout (the halves of each head), not llama's NORM
 *
 * and a dense SwiGLU FFN in every layer. The output projection is tied to
 * the token embeddings when the file has no output.weight (the small models).
 */
#include "native/native_internal.h"

static int load(es_model * m, char * err, size_t err_cap) {
    float rope_base, scale;
    int rc = es__load_attention_hparams(m, &rope_base, &scale, err, err_cap);
#define TRY(call) do { if (rc == ES_OK) rc = (call); } while (0)
    TRY(es__key_i32(m, "feed_forward_length", true, &m->n_ff, err, err_cap));
    m->rope_type = ES_ROPE_NEOX;
    m->embd_scale = 1.0f;
    TRY(es__bind_embeddings(m, err, err_cap));
    if (rc != ES_OK) return rc;

    const int64_t D = m->n_embd, F = m->n_ff;
    const int64_t Q = (int64_t) m->n_head * m->head_dim, KV = (int64_t) m->n_head_kv * m->head_dim;
    for (int32_t il = 0; il < m->n_layer && rc == ES_OK; il++) {
        es_layer * L = &m->layers[il];
        L->rope_base = rope_base;
        L->rope_scale = scale;
        TRY(es__bind_attention(m, il, err, err_cap));
        TRY(es__bind_bias(m, il, "attn_q", Q, true, &L->bq, err, err_cap));
        TRY(es__bind_bias(m, il, "attn_k", KV, true, &L->bk, err, err_cap));
        TRY(es__bind_bias(m, il, "attn_v", KV, true, &L->bv, err, err_cap));
        TRY(es__bind(m, il, "ffn_norm", D, 1, true, &L->ffn_norm, err, err_cap));
        TRY(es__bind(m, il, "ffn_gate", D, F, true, &L->ffn_gate, err, err_cap));
        TRY(es__bind(m, il, "ffn_up", D, F, true, &L->ffn_up, err, err_cap));
        TRY(es__bind(m, il, "ffn_down", F, D, true, &L->ffn_down, err, err_cap));
    }
#undef TRY
    return rc;
}

const es_arch es__arch_qwen2 = { .name = "qwen2", .load = load, .layer = es__llama_layer };
