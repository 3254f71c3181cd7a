/*
 * qwen2.c — Qwen2 and Qwen2.5 decoders (Qwen2.5-Coder), as llama.cpp's
 * models/qwen2.cpp: the llama layer with two differences,
 *
 *   q, k, v = wq · norm(x) + bq, wk · norm(x) + bk, wv · norm(x) + bv
 *   RoPE in the NEOX layout (the halves of each head), not llama's NORM
 *
 * and a dense SwiGLU FFN in every layer. The output projection is tied to
 * the token embeddings when the file has no output.weight (the small models).
 */
#include <stdio.h>

#include "native/native_internal.h"

// llama.cpp reads qwen2's query and output projections as (n_embd, n_embd)
// whatever the heads; this engine computes n_head * head_dim of them, the
// same in every Qwen2 model (load refuses a file where they differ).
static const es_arch_row TENSORS[] = {
    ES_TENSORS_EMBEDDINGS,
    ES_TENSORS_ATTENTION(ES_DIM_EMBD),
    ES_TENSORS_ATTENTION_BIASES,
    ES_TENSORS_FFN_DENSE(0),
};

static int load(es_model * m, char * err, size_t err_cap) {
    int rc = es__load_decoder_hparams(m, err, err_cap);
    if (rc == ES_OK) rc = es__key_i32(m, "feed_forward_length", true, &m->n_ff, err, err_cap);
    if (rc != ES_OK) return rc;
    if ((int64_t) m->n_head * m->head_dim != m->n_embd) {
        snprintf(err, err_cap, "qwen2 with %d heads of %d is not %d wide: not read by the native engine",
                 (int) m->n_head, (int) m->head_dim, (int) m->n_embd);
        return ES_ERR_UNSUPPORTED;
    }
    return es__bind_tensors(m, false, err, err_cap);
}

const es_arch es__arch_qwen2 = {
    .name = "qwen2", ES_TABLE(TENSORS), .ffn = ES_FFN_DENSE, .full_rope = true,
    .traits = {.rope_type = ES_ROPE_NEOX, .activation = ES_ACT_SILU},
    .load = load, .layer = es__decoder_layer,
};
