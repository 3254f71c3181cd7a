"""References edgespec must reproduce.

    greedy_reference(path, prompt, n)   greedy decoding straight on llama.cpp:
                                        llama_decode one token at a time, numpy argmax

The float64 forward pass of a llama, qwen2 or gemma3 GGUF lives in
edgespec.bench.reference (the faithfulness benchmark uses it too).
"""
from __future__ import annotations

import numpy as np
import llama_cpp.llama_cpp as lc

from edgespec.backends.llama_vocab import model_params


def greedy_reference(path, prompt: str, n_tokens: int, n_ctx: int = 1024) -> list[int]:
    model = lc.llama_model_load_from_file(str(path).encode(), model_params())
    vocab = lc.llama_model_get_vocab(model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    cp = lc.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_threads = cp.n_threads_batch = 2
    ctx = lc.llama_init_from_model(model, cp)
    try:
        data = prompt.encode()
        buf = (lc.llama_token * (len(data) + 8))()
        n = lc.llama_tokenize(vocab, data, len(data), buf, len(buf), True, False)
        lc.llama_decode(ctx, lc.llama_batch_get_one(buf, n))
        out: list[int] = []
        one = (lc.llama_token * 1)()
        while len(out) < n_tokens:
            row = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            tok = int(row.argmax())
            if lc.llama_vocab_is_eog(vocab, tok):
                break
            out.append(tok)
            one[0] = tok
            lc.llama_decode(ctx, lc.llama_batch_get_one(one, 1))
        return out
    finally:
        lc.llama_free(ctx)
        lc.llama_model_free(model)
