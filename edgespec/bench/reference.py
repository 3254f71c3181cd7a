"""A slow, exact forward pass: the yardstick of faithfulness.

Every weight of the GGUF file dequantized (the quantized values exactly as
stored, widened to float64) and every step in float64 numpy: no activation
rounding, no F16 cache. An engine's logits are then judged by how far they
are from these (KL divergence, top-1 agreement), not by how far they are from
another engine's.

    Reference(path)                   the file's hyperparameters; weights are
                                      dequantized layer by layer as needed
      .hidden(tokens)                 final-normed hidden states (n, n_embd) of
                                      tokens at positions 0, 1, ... (causal)
      .logits(hidden)                 (m, n_vocab) logits of hidden-state rows
    forward_reference(path, tokens)   both: the logits (n, n_vocab)

Architectures: every dense one the native engine reads, computed as its
traits say (GGUFFile.arch_traits: RoPE layout, head norms, post-norms,
activation, scales, sliding window; the same description the native layer
reads), as llama.cpp's models/<arch>.cpp build them. A whole sequence is
evaluated at once per layer (one matmul per weight over all positions,
attention as a masked (n, n) matmul), so 1,000 positions of a 1.5B model take
minutes. Memory: one layer's weights in float64 at a time, the output matrix
in float32 (widened a slice of the vocabulary at a time).
"""
from __future__ import annotations

import os

import numpy as np

from ..errors import UnsupportedModelError
from ..models.gguf import GGUFFile

VOCAB_SLICE = 16384   # output rows widened to float64 at a time


def _rope(x: np.ndarray, pos: np.ndarray, base: float, scale: float, neox: bool) -> np.ndarray:
    """x (n_tokens, n_heads, head_dim) rotated by angle scale * pos * base^(-2i/head_dim)."""
    hd = x.shape[-1]
    theta = scale * pos[:, None] * base ** (-2.0 * np.arange(hd // 2) / hd)   # (n_tokens, hd/2)
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    a, b = (x[..., :hd // 2], x[..., hd // 2:]) if neox else (x[..., 0::2], x[..., 1::2])
    out = np.empty_like(x)
    ra, rb = a * c - b * s, a * s + b * c
    if neox:
        out[..., :hd // 2], out[..., hd // 2:] = ra, rb
    else:
        out[..., 0::2], out[..., 1::2] = ra, rb
    return out


def _gelu(x: np.ndarray) -> np.ndarray:
    """GELU in its tanh form, as ggml computes it."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * x * (1.0 + 0.044715 * x * x)))


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


ACTIVATIONS = {"silu": _silu, "gelu_tanh": _gelu}


class Reference:
    """The float64 forward pass of one GGUF file (see the module's doc)."""

    def __init__(self, path: str | os.PathLike):
        self.path = path
        with GGUFFile(path) as f:
            self.arch = arch = f.get("general.architecture")
            if f.get(f"{arch}.expert_count", 0):
                raise UnsupportedModelError(f"{path}: no float64 reference for architecture {arch!r} "
                                            "with experts (dense models only)")

            def key(name, default=None):
                return f.get(f"{arch}.{name}", default)

            # Widths from the engine's own tensor table and the traits its
            # layer computes, resolved for this file (UnsupportedModelError
            # for an architecture the native engine does not read).
            shapes = f.arch_shapes()
            self.traits = f.arch_traits()
            self.n_layer, self.n_head = key("block_count"), key("attention.head_count")
            self.n_head_kv = key("attention.head_count_kv", self.n_head)
            self.n_embd = shapes["token_embd.weight"][0]
            self.head_dim = shapes["blk.0.attn_k.weight"][1] // self.n_head_kv
            self.eps = key("attention.layer_norm_rms_epsilon")
            self.out_name = "output.weight" if f.tensor("output.weight") else "token_embd.weight"  # tied
            self.n_vocab = shapes["token_embd.weight"][1]
        self._out32: np.ndarray | None = None

    # -- weights ---------------------------------------------------------------

    @staticmethod
    def _weights(f: GGUFFile, prefix: str) -> dict[str, np.ndarray]:
        """Every tensor named ``prefix``.*, float64, numpy shape (rows, cols) or (n,)."""
        return {t.name[len(prefix):]: t.dequantize().astype(np.float64)
                for t in f.tensors if t.name.startswith(prefix)}

    def _output(self) -> np.ndarray:
        """The output matrix (n_vocab, n_embd), float32, kept once read."""
        if self._out32 is None:
            with GGUFFile(self.path) as f:
                self._out32 = f.tensor(self.out_name).dequantize()
        return self._out32

    # -- the forward pass ----------------------------------------------------------

    def _norm(self, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + self.eps) * g

    def _attention(self, w: dict, h: np.ndarray, pos: np.ndarray, il: int) -> np.ndarray:
        """One layer's attention over all n positions: (n, n_head * head_dim)."""
        n, hd, t = len(h), self.head_dim, self.traits

        def linear(x, name):
            y = x @ w[f"{name}.weight"].T
            return y + w[f"{name}.bias"] if f"{name}.bias" in w else y

        q = linear(h, "attn_q").reshape(n, self.n_head, hd)
        k = linear(h, "attn_k").reshape(n, self.n_head_kv, hd)
        v = linear(h, "attn_v").reshape(n, self.n_head_kv, hd)
        layer = t.layers[il]
        if t.arch.qk_norm:
            q, k = self._norm(q, w["attn_q_norm.weight"]), self._norm(k, w["attn_k_norm.weight"])
        q = _rope(q, pos, layer.rope_base, layer.rope_scale, t.arch.rope_neox)
        k = _rope(k, pos, layer.rope_base, layer.rope_scale, t.arch.rope_neox)
        group = self.n_head // self.n_head_kv
        q = (q * t.attn_scale).transpose(1, 0, 2)                            # (n_head, n, hd)
        k = np.repeat(k, group, axis=1).transpose(1, 2, 0)                   # (n_head, hd, n)
        v = np.repeat(v, group, axis=1).transpose(1, 0, 2)                   # (n_head, n, hd)
        scores = q @ k                                                       # (n_head, n, n)
        t, s = np.arange(n)[:, None], np.arange(n)[None, :]
        allowed = (s <= t) & ((t - s < self.traits.n_swa) if layer.swa else True)
        scores = np.where(allowed, scores, -np.inf)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        return (p @ v).transpose(1, 0, 2).reshape(n, self.n_head * hd)

    def hidden(self, tokens: list[int]) -> np.ndarray:
        """Final-normed hidden states (n, n_embd), float64, of ``tokens`` at
        positions 0..n-1 under causal attention."""
        n, t = len(tokens), self.traits
        pos = np.arange(n, dtype=np.float64)
        act = ACTIVATIONS[t.arch.activation]
        with GGUFFile(self.path) as f:
            x = f.tensor("token_embd.weight").dequantize()[tokens].astype(np.float64)   # (n, n_embd)
            x *= t.embd_scale
            for il in range(self.n_layer):
                w = self._weights(f, f"blk.{il}.")
                att = self._attention(w, self._norm(x, w["attn_norm.weight"]), pos, il)
                out = att @ w["attn_output.weight"].T
                x = x + (self._norm(out, w["post_attention_norm.weight"]) if t.arch.post_norms else out)
                h = self._norm(x, w["ffn_norm.weight"])
                g, u = h @ w["ffn_gate.weight"].T, h @ w["ffn_up.weight"].T
                out = (act(g) * u) @ w["ffn_down.weight"].T
                x = x + (self._norm(out, w["post_ffw_norm.weight"]) if t.arch.post_norms else out)
            return self._norm(x, f.tensor("output_norm.weight").dequantize().astype(np.float64))

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """(m, n_vocab) float64 logits of hidden-state rows (from ``hidden``)."""
        out = self._output()
        logits = np.empty((len(hidden), self.n_vocab))
        for a in range(0, self.n_vocab, VOCAB_SLICE):
            logits[:, a:a + VOCAB_SLICE] = hidden @ out[a:a + VOCAB_SLICE].astype(np.float64).T
        c = self.traits.final_softcap
        if c:
            logits = np.tanh(logits / c) * c
        return logits


def forward_reference(path: str | os.PathLike, tokens: list[int]) -> np.ndarray:
    """Logits (n_tokens, n_vocab), float64, of ``tokens`` at positions 0, 1, ..."""
    ref = Reference(path)
    return ref.logits(ref.hidden(tokens))


# ---------------------------------------------------------------------------
# Distances from the reference
# ---------------------------------------------------------------------------


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_rows(reference: np.ndarray, other: np.ndarray) -> np.ndarray:
    """KL(softmax(reference) || softmax(other)) per row, in nats, float64."""
    lp, lq = _log_softmax(reference.astype(np.float64)), _log_softmax(other.astype(np.float64))
    return (np.exp(lp) * (lp - lq)).sum(axis=-1)
