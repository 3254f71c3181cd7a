"""References edgespec must reproduce.

    greedy_reference(path, prompt, n)   greedy decoding straight on llama.cpp:
                                        llama_decode one token at a time, numpy argmax
    forward_reference(path, tokens)     the logits of a llama or qwen2 GGUF in float64
                                        numpy, read from the file's own weights
"""
from __future__ import annotations

import gguf
import numpy as np
import llama_cpp.llama_cpp as lc

from edgespec.models.gguf import GGUFFile


def greedy_reference(path, prompt: str, n_tokens: int, n_ctx: int = 1024) -> list[int]:
    model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
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


# What sets the dense architectures apart here, as llama.cpp's models/llama.cpp
# and qwen2.cpp build them: the RoPE layout (NORM: adjacent pairs (2i, 2i+1);
# NEOX: (i, i + head_dim/2)). Q/K/V biases are added wherever the file has them.
_NEOX = {"llama": False, "qwen2": True}


def _rope(x: np.ndarray, pos: np.ndarray, base: float, neox: bool) -> np.ndarray:
    """x (n_tokens, n_heads, head_dim) rotated by angle pos * base^(-2i/head_dim)."""
    hd = x.shape[-1]
    theta = pos[:, None] * base ** (-2.0 * np.arange(hd // 2) / hd)   # (n_tokens, hd/2)
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    a, b = (x[..., :hd // 2], x[..., hd // 2:]) if neox else (x[..., 0::2], x[..., 1::2])
    out = np.empty_like(x)
    ra, rb = a * c - b * s, a * s + b * c
    if neox:
        out[..., :hd // 2], out[..., hd // 2:] = ra, rb
    else:
        out[..., 0::2], out[..., 1::2] = ra, rb
    return out


def forward_reference(path, tokens: list[int]) -> np.ndarray:
    """Logits (n_tokens, n_vocab), float64, of `tokens` at positions 0, 1, ...
    under causal attention, for a llama (dense) or qwen2 GGUF: every weight
    dequantized and every step in float64, no F16 cache, no rounding."""
    with GGUFFile(path) as f:
        arch = f.get("general.architecture")
        if arch not in _NEOX:
            raise ValueError(f"no reference for architecture {arch!r}")
        hparams = {k: f.get(k) for k in f.keys() if k.startswith(f"{arch}.")}
        # name -> (rows, cols) = (ne1, ne0), or (n,) for vectors; dequantized by
        # gguf-py, not by the engine under test
        w = {t.name: gguf.quants.dequantize(np.array(t.data), t.ggml_type)
             .astype(np.float64).reshape(tuple(reversed(t.shape))) for t in f.tensors}

    def key(name, default=None):
        return hparams.get(f"{arch}.{name}", default)

    n_head, n_layer = key("attention.head_count"), key("block_count")
    n_head_kv = key("attention.head_count_kv", n_head)
    eps, base = key("attention.layer_norm_rms_epsilon"), key("rope.freq_base", 10000.0)
    n_embd = w["token_embd.weight"].shape[1]
    hd, group = n_embd // n_head, n_head // n_head_kv

    def rms_norm(x, g):
        return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * g

    def linear(x, name):
        y = x @ w[f"{name}.weight"].T
        return y + w[f"{name}.bias"] if f"{name}.bias" in w else y

    n = len(tokens)
    pos = np.arange(n, dtype=np.float64)
    causal = np.tril(np.ones((n, n), dtype=bool))
    x = w["token_embd.weight"][tokens]                                # (n, n_embd)
    for il in range(n_layer):
        blk = f"blk.{il}"
        h = rms_norm(x, w[f"{blk}.attn_norm.weight"])
        q = _rope(linear(h, f"{blk}.attn_q").reshape(n, n_head, hd), pos, base, _NEOX[arch])
        k = _rope(linear(h, f"{blk}.attn_k").reshape(n, n_head_kv, hd), pos, base, _NEOX[arch])
        v = linear(h, f"{blk}.attn_v").reshape(n, n_head_kv, hd)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # (n, n_head, hd)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)           # (n_head, n, n)
        scores = np.where(causal, scores, -np.inf)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        att = np.einsum("hts,shd->thd", p, v).reshape(n, n_head * hd)
        x = x + linear(att, f"{blk}.attn_output")
        h = rms_norm(x, w[f"{blk}.ffn_norm.weight"])
        g = linear(h, f"{blk}.ffn_gate")
        x = x + linear(g / (1.0 + np.exp(-g)) * linear(h, f"{blk}.ffn_up"), f"{blk}.ffn_down")
    out = w.get("output.weight", w["token_embd.weight"])              # tied when absent
    return rms_norm(x, w["output_norm.weight"]) @ out.T
