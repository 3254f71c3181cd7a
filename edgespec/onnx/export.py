"""Export a GGUF model (any dense architecture the native engine reads) as an ONNX
decoder graph for ONNX Runtime, computed as the architecture's traits say
(GGUFFile.arch_traits: RoPE layout and bases, head norms, post-norms,
activation, scales, sliding window).

    export(gguf_path, out_dir, weights="int4")         # model.onnx + edgespec-onnx.json
    cached_export(gguf_path, "int4")                   # the same, once, into the edgespec cache

The graph evaluates S new tokens against a KV cache the caller owns (batch 1):

    inputs   input_ids       int64   (1, S)
             position_ids    int64   (1, S)        RoPE position of each token
             attention_bias  float32 (1, 1, S, T)  0 where a token may attend, -inf elsewhere
             attention_bias_local                  the same for sliding-window layers (gemma3's)
             logits_rows     int64   (R,)          which of the S tokens get a logits row
             past.{i}.key / past.{i}.value         (1, n_head_kv, C, head_dim), one pair per layer
    outputs  logits          float32 (1, R, n_vocab)
             present.{i}.key / present.{i}.value   (1, n_head_kv, C, head_dim)

The mask is an input because a draft tree needs more than causality: each node
sees the cache, the prefix and its ancestors. The backend binds past and
present to one buffer per layer (IO binding), so a call writes only its own
rows into the cache, in place, and a rollback moves nothing.

Dynamic graph (CPU, GPU): S and C free, the cache float32, C the context plus
one slot. T = P + S + 1 for a call after P cached tokens. Attention is
GroupQueryAttention (RoPE, the write of the new rows at slots P..., scores under
the mask, softmax, weighted sum: one operator per layer).

``--static-shapes`` (NPU compilers): S = ``--call-size`` (16 unless given) and
C = ``--cache-len`` fixed, the
cache float16, T = C; the new rows are scattered into the slots given by an
extra input ``cache_slots`` int64 (S,), attention runs over all C slots under
the mask, and everything is plain ONNX operators plus MatMulNBits (all inside
OpenVINO's supported set: ``edgespec onnx-placement``).

``--weights qdq`` (NPU providers that compile integer graphs, e.g. QNN): the
static graph with float weights and no contrib ops (RMSNormalization and Add
for the fused norms, an untied head), then calibrated and quantized into QDQ
form by edgespec.onnx.qdq.

Row invariance: a token's logits must not depend on how many tokens share its
call, or speculative greedy output would part from plain decoding (a plain step
evaluates one token, a verification step several). ONNX Runtime's CPU kernels
do not promise that: on AVX2, 4-bit MatMulNBits sends a one-row product to a
GEMV kernel that applies zero points inside the integer dot product and a
multi-row one to a GEMM kernel that corrects them afterwards with block sums,
and the two round differently (up to 0.7 in smollm2-135m's logits). So the
dynamic graph never multiplies a lone row: it appends a copy of its last token
(id, position, mask row) to every call, as row S; that row's key and value land
in the slot after the call, which the next call overwrites, and its logits are
dropped. With S + 1 >= 2 rows, and the copy the only row that can be left over
when MLAS splits rows into tiles of 128 or pairs, every real row goes through
the same kernels whatever S is. A static graph's calls all have S rows already,
so one call size serves plain steps, verification and prefill chunks (a
verification of more than S - 1 drafted tokens takes two calls). Draft trees
are not invariant (see OnnxBackend.exact_trees): the engine verifies a tree's
first path as a chain, so a static graph needs no second call size for trees.

Operators (ONNX Runtime contrib ops, com.microsoft, where they help):
    MatMulNBits                       every linear layer in int4/int8 exports, on activations
                                      quantized per block of 32 (accuracy_level 4). GGUF Q4_0
                                      and Q4_1 blocks of 32 map onto 4-bit blocks exactly:
                                      Q4_0's value d*(q-8) is the op's default zero point 8;
                                      Q4_1's d*q + m is d*q (zero point 0) plus
                                      blocksum(x) . m, a small MatMul beside it. Q8_0 blocks
                                      map onto 8-bit blocks (zero point 128); other types
                                      (K-quants, Q5_0) are dequantized and requantized to 8 bits.
                                      qwen2's Q/K/V biases are the op's bias input.
    GroupQueryAttention               the dynamic graph's attention (above)
    SkipSimplifiedLayerNormalization  RMS norm with the residual add fused, between blocks;
                                      other RMS norms (the first, the final, per-head Q/K norms,
                                      post-attention and post-FFN norms) are ONNX's own
                                      RMSNormalization (opset 23) in the dynamic graph and
                                      plain operators in a static one
The token embedding shares the output matrix's 8-bit blocks (tied weights):
Gather the rows, then scale them (and by the traits' embedding scale: gemma3's sqrt(n_embd)).
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..capi import lib
from ..errors import InvalidArgumentError, ModelFormatError
from ..files import sha256_file
from ..backends.onnx import CONFIG_FILE, FORMAT, FORMAT_VERSION, MODEL_FILE, load_export
from ..models.gguf import GGUFFile, GGUFTensor, architectures
from ..progress import ByteProgress

WEIGHTS = ("int4", "int8", "fp16", "fp32", "qdq")  # qdq: see edgespec.onnx.qdq (static shapes)
BLOCK = 32                    # MatMulNBits block size = the GGUF block of Q4_0/Q4_1/Q8_0
STATIC_SEQ = 16               # --static-shapes: tokens per call unless --call-size says
MAX_CALL_SIZE = 64            # --call-size: at most (a wider call wastes an NPU's time per step)
STATIC_CTX = 1024             # --static-shapes: cache slots (--cache-len)
MAX_POSITIONS = 8192          # the dynamic graph's RoPE tables
OPSET = 23                    # RMSNormalization
MS_DOMAIN = "com.microsoft"
FLOAT, FLOAT16 = 1, 10        # onnx.TensorProto element types


# ---------------------------------------------------------------------------
# Model configuration from GGUF metadata
# ---------------------------------------------------------------------------


@dataclass
class DecoderConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    tied_output: bool
    attn_scale: float                # attention scores = q.k * attn_scale
    rope: list[tuple[float, float]]  # each layer's RoPE (base, linear scale)
    rope_neox: bool = False          # RoPE on the two halves of a head, not adjacent pairs
    qkv_bias: bool = False           # biases on the Q, K and V projections (qwen2)
    qk_norm: bool = False            # per-head RMS norms of Q and K before RoPE
    post_norms: bool = False         # RMS norms of the attention and FFN outputs
    activation: str = "silu"         # the FFN's gate: silu, gelu_tanh
    embd_scale: float = 1.0          # embeddings times it
    n_swa: int = 0                   # sliding window (0: none): a token sees positions p - n_swa < q <= p
    swa_layers: list[bool] | None = None
    softcap: float = 0.0             # final logit soft-capping: tanh(x / c) * c


def _field(reader: GGUFFile, key: str, default=None):
    value = reader.get(key)
    if value is None:
        if default is None:
            raise ModelFormatError(f"{reader.path}: GGUF metadata has no {key}")
        return default
    return value


def read_config(reader: GGUFFile) -> DecoderConfig:
    arch = _field(reader, "general.architecture")
    if arch not in architectures():
        raise ModelFormatError(f"architecture '{arch}' cannot be exported to ONNX yet "
                               f"(supported: {', '.join(architectures())})")
    if reader.get(f"{arch}.expert_count"):
        raise ModelFormatError("Mixture-of-Experts models cannot be exported to ONNX yet")
    # Widths from the engine's own tensor table and what its layer computes,
    # resolved for this file (the shapes and traits the native engine reads).
    shapes = reader.arch_shapes()
    traits = reader.arch_traits()
    n_embd, n_vocab = shapes["token_embd.weight"]
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    n_head_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))
    head_dim = shapes["blk.0.attn_k.weight"][1] // n_head_kv
    names = {t.name for t in reader.tensors}
    n_layer = len(traits.layers)
    swa_layers = [layer.swa for layer in traits.layers]
    return DecoderConfig(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=shapes["blk.0.ffn_up.weight"][1],
        n_vocab=n_vocab,
        n_ctx_train=int(_field(reader, f"{arch}.context_length")),
        rms_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        tied_output="output.weight" not in names,
        attn_scale=traits.attn_scale,
        rope=[(layer.rope_base, layer.rope_scale) for layer in traits.layers],
        rope_neox=traits.arch.rope_neox,
        qkv_bias="blk.0.attn_q.bias" in shapes and "blk.0.attn_q.bias" in names,   # a table row, and in the file
        qk_norm=traits.arch.qk_norm,
        post_norms=traits.arch.post_norms,
        activation=traits.arch.activation,
        embd_scale=traits.embd_scale,
        n_swa=traits.n_swa,
        swa_layers=swa_layers if traits.n_swa > 0 and any(swa_layers) else None,
        softcap=traits.final_softcap,
    )


# ---------------------------------------------------------------------------
# Weights: GGUF blocks -> MatMulNBits blocks
# ---------------------------------------------------------------------------


@dataclass
class NBits:
    """A (N, K) matrix in MatMulNBits layout, plus Q4_1's block minimums."""

    bits: int
    blocks: np.ndarray                   # (N, K / 32, 32 * bits / 8) uint8
    scales: np.ndarray                   # (N * K / 32) float32
    mins: np.ndarray | None = None       # (N, K / 32) float32 added per block: W = scale*q + min

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.blocks.shape[1] * BLOCK


def _f16(raw: np.ndarray) -> np.ndarray:
    """(..., 2) bytes -> (...) float32 of the little-endian float16 they hold."""
    return np.ascontiguousarray(raw).view("<f2")[..., 0].astype(np.float32)


def _pack4(q: np.ndarray) -> np.ndarray:
    """(N, nb, 32) values in [0, 16) -> (N, nb, 16) bytes: element 2i in the low nibble of byte i."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def _ggml_nibbles(qs: np.ndarray) -> np.ndarray:
    """(N, nb, 16) ggml nibble bytes -> (N, nb, 32) values: element j < 16 is the low
    nibble of byte j, element j + 16 its high nibble."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def q4_0_blocks(data: np.ndarray, n: int, k: int) -> NBits:
    """Q4_0 block: f16 d, 16 nibble bytes; value = d * (q - 8): the op's default zero point 8."""
    raw = data.reshape(n, k // BLOCK, 18)
    return NBits(4, _pack4(_ggml_nibbles(raw[..., 2:])), _f16(raw[..., 0:2]).reshape(-1))


def q4_1_blocks(data: np.ndarray, n: int, k: int) -> NBits:
    """Q4_1 block: f16 d, f16 m, 16 nibble bytes; value = d*q + m. The blocks
    become d*q (zero point 0) and m a per-block minimum, so that x.W =
    MatMulNBits(x) + blocksum(x).M: llama.cpp's own split of this dot product,
    and one that keeps ONNX Runtime's int8 kernels usable (a float zero point
    -m/d would force its float path)."""
    raw = data.reshape(n, k // BLOCK, 20)
    return NBits(4, _pack4(_ggml_nibbles(raw[..., 4:])), _f16(raw[..., 0:2]).reshape(-1),
                 _f16(raw[..., 2:4]))


def q8_0_blocks(data: np.ndarray, n: int, k: int) -> NBits:
    """Q8_0 block: f16 d, 32 int8; value = d * q = d * ((q + 128) - 128), zero point 128."""
    raw = data.reshape(n, k // BLOCK, 34)
    d = _f16(raw[..., 0:2])
    q = (raw[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return NBits(8, q, d.reshape(-1))


def requantize8(w: np.ndarray) -> NBits:
    """(N, K) float -> symmetric 8-bit blocks of 32 (zero point 128)."""
    n, k = w.shape
    blocks = w.reshape(n, k // BLOCK, BLOCK).astype(np.float32)
    d = np.abs(blocks).max(axis=-1) / 127
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.rint(blocks * inv[..., None]), -127, 127).astype(np.int16) + 128
    return NBits(8, q.astype(np.uint8), d.astype(np.float32).reshape(-1))


def dequantize(tensor: GGUFTensor) -> np.ndarray:
    """A GGUF tensor as (rows, cols) float32 = numpy's view of GGUF's (ne0, ne1) reversed."""
    return tensor.dequantize().reshape(int(tensor.shape[-1]), int(tensor.shape[0]))


def matrix_nbits(tensor: GGUFTensor, weights: str) -> NBits:
    """A GGUF matrix as MatMulNBits blocks: 4-bit blocks map exactly under int4,
    Q8_0 maps exactly, anything else is requantized to 8 bits."""
    k, n = int(tensor.shape[0]), int(tensor.shape[1])
    if k % BLOCK:
        raise ModelFormatError(f"{tensor.name}: rows of {k} values do not split into blocks of {BLOCK}")
    if weights == "int4" and tensor.ggml_type == lib.ES_TYPE_Q4_0:
        return q4_0_blocks(tensor.data, n, k)
    if weights == "int4" and tensor.ggml_type == lib.ES_TYPE_Q4_1:
        return q4_1_blocks(tensor.data, n, k)
    if tensor.ggml_type == lib.ES_TYPE_Q8_0:
        return q8_0_blocks(tensor.data, n, k)
    return requantize8(dequantize(tensor))


# ---------------------------------------------------------------------------
# Graph building
# ---------------------------------------------------------------------------


def rope_cache(n_pos: int, rot_dim: int, base: float, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(n_pos, rot_dim / 2) cos and sin, computed like llama.cpp's CPU rope: the
    angle for pair i is scale * pos * base^(-2i/d), accumulated in float32 (theta *= step)."""
    step = np.float32(base) ** np.float32(-2.0 / rot_dim)
    theta = np.arange(n_pos, dtype=np.float32)
    cols = []
    for _ in range(rot_dim // 2):
        cols.append((theta * np.float32(scale)).astype(np.float32))
        theta = (theta * step).astype(np.float32)
    angles = np.stack(cols, axis=1).astype(np.float64)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class _Graph:
    """Nodes and initializers with unique names."""

    def __init__(self):
        self.nodes, self.inits = [], []
        self._n = 0

    def const(self, name: str, array: np.ndarray) -> str:
        from onnx import numpy_helper

        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "",
           outputs: list[str] | None = None, **attrs):
        from onnx import helper

        self._n += 1
        outs = outputs or [f"{op_type.lower()}_{self._n}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=f"{op_type}_{self._n}",
                                           domain=domain, **attrs))
        return outs[0] if len(outs) == 1 else outs

    def shape(self, name: str, dims: list[int]) -> str:
        return self.const(name, np.array(dims, dtype=np.int64))


class _Builder:
    """Writes one decoder graph; each GGUF tensor is read once and dropped."""

    def __init__(self, reader: GGUFFile, cfg: DecoderConfig, weights: str,
                 static: tuple[int, int] | None, progress):
        self.r, self.cfg, self.weights, self.static = reader, cfg, weights, static
        self.tensors = {t.name: t for t in reader.tensors}
        self.g = _Graph()
        self.progress = progress
        self._consts: set[str] = set()

    def tensor(self, name: str):
        t = self.tensors.get(name)
        if t is None:
            raise ModelFormatError(f"GGUF has no tensor {name}")
        self.progress(t.n_bytes)
        return t

    def vector(self, name: str) -> str:
        t = self.tensor(name)
        return self.g.const(name, t.dequantize().reshape(-1))

    def shared(self, name: str, array) -> str:
        """A constant several nodes use, written once."""
        if name not in self._consts:
            self._consts.add(name)
            self.g.const(name, np.asarray(array))
        return name

    def nbits_inputs(self, name: str, w: NBits) -> list[str]:
        g = self.g
        ins = [g.const(f"{name}.q", w.blocks), g.const(f"{name}.scales", w.scales)]
        if w.mins is not None:  # d*q blocks: zero point 0, two 4-bit zero points a byte
            n, nb = w.mins.shape
            ins.append(g.const(f"{name}.zp", np.zeros(n * ((nb + 1) // 2), np.uint8)))
        return ins

    def linear(self, x: str, names: list[str], bias: bool = False) -> str:
        """x (1, S, K) @ W^T (+ b) for the row-wise concatenation W of the named
        (N_i, K) matrices (and b of their biases)."""
        g = self.g
        key = names[0] if len(names) == 1 else names[0].rsplit(".", 2)[0] + ".fused_" + "_".join(
            n.split(".")[-2] for n in names)
        b = None
        if bias:
            b = g.const(f"{key}.bias", np.concatenate(
                [self.tensor(n.rsplit(".", 1)[0] + ".bias").dequantize().reshape(-1) for n in names]))
        if self.weights in ("fp16", "fp32", "qdq"):
            w = np.concatenate([dequantize(self.tensor(n)) for n in names], axis=0)
            dt = np.float16 if self.weights == "fp16" else np.float32  # qdq: quantized later
            wt = g.const(key, np.ascontiguousarray(w.T.astype(dt)))
            if self.weights == "fp16":
                wt = g.op("Cast", [wt], to=FLOAT)
            y = g.op("MatMul", [x, wt])
            return y if b is None else g.op("Add", [y, b])
        parts = [matrix_nbits(self.tensor(n), self.weights) for n in names]
        if len({(p.bits, p.mins is None) for p in parts}) > 1:  # mixed kinds: requantize all
            parts = [requantize8(dequantize(self.tensors[n])) for n in names]
        w = NBits(parts[0].bits, np.concatenate([p.blocks for p in parts]),
                  np.concatenate([p.scales for p in parts]),
                  None if parts[0].mins is None else np.concatenate([p.mins for p in parts]))
        return self.nbits_matmul(x, w, self.nbits_inputs(key, w), key, b)

    def nbits_matmul(self, x: str, w: NBits, inputs: list[str], key: str, bias: str | None = None) -> str:
        """x (1, S, K) @ W^T through MatMulNBits, its int8 kernels (accuracy_level 4:
        activations quantized per block of 32, as llama.cpp's CPU does); Q4_1's
        minimums add blocksum(x) @ M^T, as ggml_vec_dot_q4_1_q8_1 does."""
        g = self.g
        n, k = w.shape
        if bias is not None:
            inputs = inputs + [""] * (4 - len(inputs)) + [bias]  # after B, scales, zero_points, g_idx
        y = g.op("MatMulNBits", [x] + inputs, domain=MS_DOMAIN,
                 K=k, N=n, bits=w.bits, block_size=BLOCK, accuracy_level=4)
        if w.mins is None:
            return y
        blocks = g.op("Reshape", [x, self.shared(f"blocks{k}", np.array([1, -1, k // BLOCK, BLOCK], np.int64))])
        sums = g.op("ReduceSum", [blocks, self.shared("axis.last", np.array([-1], np.int64))], keepdims=0)
        return g.op("Add", [y, g.op("MatMul", [sums, g.const(f"{key}.mins", np.ascontiguousarray(w.mins.T))])])

    def embedding_and_head(self):
        """Token embedding (Gather, scaled by embd_scale) and the output matrix;
        with tied weights the 8-bit blocks are stored once and serve both."""
        cfg, g = self.cfg, self.g
        emb_t = self.tensor("token_embd.weight")
        if self.weights in ("fp16", "fp32", "qdq"):
            table = dequantize(emb_t).astype(np.float16 if self.weights == "fp16" else np.float32)
            name = g.const("token_embd.weight", table)
            if self.weights == "fp16":
                name = g.op("Cast", [name], to=FLOAT)
            lookup = lambda ids: g.op("Gather", [name, ids])  # noqa: E731
            head_table = name if cfg.tied_output else None
            if cfg.tied_output and self.weights == "qdq":
                # a copy of its own for the head: quantized per output channel (per
                # token), while the embedding table's rows share one scale, which
                # the rows Gather takes keep
                head_table = g.const("output.weight", np.ascontiguousarray(table.T))
        else:
            w = matrix_nbits(emb_t, "int8")  # Q8_0 exactly, else requantized: the rows must be 8-bit
            if w.bits != 8:
                w = requantize8(dequantize(emb_t))
            q, scales = self.nbits_inputs("token_embd", w)
            nb = cfg.n_embd // BLOCK

            def lookup(ids):
                rows = g.op("Cast", [g.op("Gather", [q, ids])], to=FLOAT)          # (1, S, nb, 32)
                rows = g.op("Sub", [rows, g.const("emb.zp", np.array(128, np.float32))])
                sc = g.op("Gather", [g.op("Reshape", [scales, g.shape("emb.sc_shape", [-1, nb, 1])]), ids])
                return g.op("Reshape", [g.op("Mul", [rows, sc]), g.shape("emb.out_shape", [1, -1, cfg.n_embd])])
            head_table = (q, scales) if cfg.tied_output else None
            head_w = w

        def embed(ids):                                                       # (1, S) -> (1, S, E)
            x = lookup(ids)
            if cfg.embd_scale != 1.0:
                x = g.op("Mul", [x, g.const("emb.scale", np.array(cfg.embd_scale, np.float32))])
            return x

        def head(x):                                                          # (1, R, E) -> (1, R, V)
            if head_table is None:
                y = self.linear(x, ["output.weight"])
            elif isinstance(head_table, tuple):
                y = self.nbits_matmul(x, head_w, list(head_table), "output")
            elif self.weights == "qdq":
                y = g.op("MatMul", [x, head_table])
            else:
                flat = g.op("Reshape", [x, g.shape("head.in_shape", [-1, cfg.n_embd])])
                y = g.op("Reshape", [g.op("Gemm", [flat, head_table], transB=1),
                                     g.shape("head.out_shape", [1, -1, cfg.n_vocab])])
            if cfg.softcap > 0:
                c = cfg.softcap
                y = g.op("Mul", [g.op("Tanh", [g.op("Mul", [y, g.const("softcap.inv", np.array(1 / c, np.float32))])]),
                                 g.const("softcap.c", np.array(c, np.float32))])
            return y
        return embed, head

    def rms_norm(self, x: str, weight: str) -> str:
        """RMS norm over the last axis: ONNX's RMSNormalization, or in a static
        graph the plain operators NPU compilers know (OpenVINO's provider
        leaves RMSNormalization to the CPU)."""
        g = self.g
        if not self.static or self.weights == "qdq":  # QDQ: x*x in 16 bits would lose the small rows
            return g.op("RMSNormalization", [x, weight], axis=-1, epsilon=self.cfg.rms_eps)
        mean = g.op("ReduceMean", [g.op("Mul", [x, x]), self.shared("axis.last", np.array([-1], np.int64))])
        eps = self.shared("rms.eps", np.array(self.cfg.rms_eps, np.float32))
        inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [mean, eps])])])
        return g.op("Mul", [g.op("Mul", [x, inv]), weight])

    def skip_norm(self, x: str, residual: str, weight: str) -> tuple[str, str]:
        """(rms_norm(x + residual), x + residual): one SkipSimplifiedLayerNormalization,
        or in the QDQ form plain operators (NPU providers and onnx's shape
        inference, which the quantizer needs, know no contrib ops)."""
        if self.weights == "qdq":
            h = self.g.op("Add", [x, residual])
            return self.rms_norm(h, weight), h
        x, _, _, h = self.g.op("SkipSimplifiedLayerNormalization", [x, residual, weight], n_out=4,
                               domain=MS_DOMAIN, epsilon=self.cfg.rms_eps)
        return x, h

    def rope(self, x: str, n_heads: int, cos_sin: tuple[str, str], pos: str) -> str:
        """RoPE in plain operators on x (1, S, n_heads * D) at positions pos (1, S):
        the table rows of each position, then each pair (x1, x2) -> (x1 c - x2 s,
        x1 s + x2 c); a pair is two adjacent dimensions (llama) or dimension i and
        i + D/2 (NEOX)."""
        g, D = self.g, self.cfg.head_dim
        if self.cfg.rope_neox:   # (1, S, H, 2, D/2): the halves
            split, table = [1, -1, n_heads, 2, D // 2], [1, -1, 1, 1, D // 2]
            axis = 3
        else:                    # (1, S, H, D/2, 2): adjacent pairs
            split, table = [1, -1, n_heads, D // 2, 2], [1, -1, 1, D // 2, 1]
            axis = 4
        pairs = g.op("Reshape", [x, self.shared(f"rope.split{n_heads}", np.array(split, np.int64))])
        x1, x2 = g.op("Split", [pairs], n_out=2, axis=axis, num_outputs=2)
        shape = self.shared("rope.table_shape", np.array(table, np.int64))
        c = g.op("Reshape", [g.op("Gather", [cos_sin[0], pos]), shape])
        s = g.op("Reshape", [g.op("Gather", [cos_sin[1], pos]), shape])
        r1 = g.op("Sub", [g.op("Mul", [x1, c]), g.op("Mul", [x2, s])])
        r2 = g.op("Add", [g.op("Mul", [x1, s]), g.op("Mul", [x2, c])])
        return g.op("Reshape", [g.op("Concat", [r1, r2], axis=axis),
                                self.shared(f"flat{n_heads}", np.array([1, -1, n_heads * D], np.int64))])

    def head_norm(self, x: str, weight: str, n_heads: int) -> str:
        """RMS norm of each head of x (1, S, n_heads * D) (qk_norm)."""
        D = self.cfg.head_dim
        heads = self.g.op("Reshape", [x, self.shared(f"heads{n_heads}", np.array([1, -1, n_heads, D], np.int64))])
        return self.g.op("Reshape", [self.rms_norm(heads, weight),
                                     self.shared(f"flat{n_heads}", np.array([1, -1, n_heads * D], np.int64))])

    def repeat_last_row(self, x: str, axis: int) -> str:
        """x with its last entry along ``axis`` (the token axis) appended once more."""
        last = self.g.op("Slice", [x, self.shared("pad.minus1", np.array([-1], np.int64)),
                                   self.shared("pad.max", np.array([np.iinfo(np.int64).max], np.int64)),
                                   self.shared(f"pad.axis{axis}", np.array([axis], np.int64))])
        return self.g.op("Concat", [x, last], axis=axis)

    def drop_last_row(self, x: str) -> str:
        """(1, S + 1, ...) -> (1, S, ...)"""
        return self.g.op("Slice", [x, self.shared("pad.zero", np.array([0], np.int64)),
                                   self.shared("pad.minus1", np.array([-1], np.int64)),
                                   self.shared("pad.axis1", np.array([1], np.int64))])

    def qkv(self, i: int, x: str) -> tuple[str, str, str]:
        """The projections of normed x (1, S, E): q (1, S, H*D), k and v (1, S, KV*D),
        with the biases and per-head norms (before RoPE) the model has. Where
        GroupQueryAttention takes them packed (the dynamic graph, no head
        norms): (1, S, (H + 2 KV) * D) and two empty names."""
        cfg, g = self.cfg, self.g
        p = f"blk.{i}."
        H, KV, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        qkv = self.linear(x, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], bias=cfg.qkv_bias)
        if not self.static and not cfg.qk_norm:
            return qkv, "", ""
        q, k, v = g.op("Split", [qkv, self.shared("qkv_split", np.array([H * D, KV * D, KV * D], np.int64))],
                       n_out=3, axis=2)
        if cfg.qk_norm:
            q = self.head_norm(q, self.vector(p + "attn_q_norm.weight"), H)
            k = self.head_norm(k, self.vector(p + "attn_k_norm.weight"), KV)
        return q, k, v

    def attention_gqa(self, i: int, q: str, k: str, v: str, pos: str, bias: str, seqlens: tuple[str, str],
                      rope: tuple[str, str]) -> str:
        """The dynamic graph's attention: one GroupQueryAttention on the packed QKV
        projection where there are no head norms (k and v empty: no Split node, 4%
        of a smollm2 decode step), on q, k and v otherwise (RoPE, the write of
        the new keys and values into the cache at slots P..., scores under the
        additive mask, softmax, weighted sum). The past and present caches are one
        buffer (IO binding), so a call writes only its rows; the last row (build()'s
        copy) lands in the slot after the call, which the next call overwrites."""
        cfg = self.cfg
        out, _, _ = self.g.op("GroupQueryAttention",
                        [q, k, v, f"past.{i}.key", f"past.{i}.value", seqlens[0], seqlens[1], rope[0], rope[1],
                         pos, bias],
                        outputs=[f"attn_{i}", f"present.{i}.key", f"present.{i}.value"], domain=MS_DOMAIN,
                        num_heads=cfg.n_head, kv_num_heads=cfg.n_head_kv, do_rotary=1,
                        rotary_interleaved=0 if cfg.rope_neox else 1, scale=cfg.attn_scale)
        return out

    def attention_ops(self, i: int, q: str, k: str, v: str, pos: str, bias: str, slots: str,
                      rope: tuple[str, str]) -> str:
        """The static graph's attention in plain operators (what NPU compilers take,
        every one inside OpenVINO's set): RoPE, the new keys and values scattered into the float16 cache at
        ``cache_slots``, scores over all C slots under the mask."""
        cfg, g = self.cfg, self.g
        H, KV, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        G = H // KV
        q, k = self.rope(q, H, rope, pos), self.rope(k, KV, rope, pos)
        # (1, S, KV*D) -> (1, KV, S, D), float16 like llama.cpp's cache
        shape = lambda name, dims: self.shared(f"attn.{name}", np.array(dims, np.int64))  # noqa: E731
        k = g.op("Transpose", [g.op("Reshape", [k, shape("kv_heads", [1, -1, KV, D])])], perm=[0, 2, 1, 3])
        v = g.op("Transpose", [g.op("Reshape", [v, shape("kv_heads", [1, -1, KV, D])])], perm=[0, 2, 1, 3])
        k, v = g.op("Cast", [k], to=FLOAT16), g.op("Cast", [v], to=FLOAT16)
        present_k = g.op("ScatterElements", [f"past.{i}.key", slots, k], axis=2, outputs=[f"present.{i}.key"])
        present_v = g.op("ScatterElements", [f"past.{i}.value", slots, v], axis=2, outputs=[f"present.{i}.value"])
        # Grouped-query attention: query head h uses KV head h // G, so the G query
        # heads of a KV head are consecutive: (1, S, H*D) -> (1, KV, G*S, D).
        q = g.op("Transpose", [g.op("Reshape", [q, shape("q_heads", [1, -1, KV, G, D])])], perm=[0, 2, 3, 1, 4])
        q = g.op("Reshape", [g.op("Mul", [q, self.shared("attn.scale", np.array(cfg.attn_scale, np.float32))]),
                             shape("q_grouped", [1, KV, -1, D])])
        keys = g.op("Transpose", [g.op("Cast", [present_k], to=FLOAT)], perm=[0, 1, 3, 2])
        scores = g.op("MatMul", [q, keys])                                                 # (1, KV, G*S, C)
        scores = g.op("Add", [g.op("Reshape", [scores, shape("scores_heads", [1, H, -1, 0])]), bias])
        probs = g.op("Reshape", [g.op("Softmax", [scores], axis=-1), shape("scores_grouped", [1, KV, -1, 0])])
        out = g.op("MatMul", [probs, g.op("Cast", [present_v], to=FLOAT)])                # (1, KV, G*S, D)
        out = g.op("Reshape", [out, shape("out_heads", [1, KV, G, -1, D])])                  # (1, KV, G, S, D)
        return g.op("Reshape", [g.op("Transpose", [out], perm=[0, 3, 1, 2, 4]), shape("out_shape", [1, -1, H * D])])

    def ffn(self, i: int, x: str) -> str:
        p = f"blk.{i}."
        gate_up = self.linear(x, [p + "ffn_gate.weight", p + "ffn_up.weight"])
        gate, up = self.g.op("Split", [gate_up], n_out=2, axis=2, num_outputs=2)
        if self.cfg.activation == "gelu_tanh":
            act = self.g.op("Gelu", [gate], approximate="tanh")
        else:
            act = self.g.op("Mul", [gate, self.g.op("Sigmoid", [gate])])       # SiLU
        return self.linear(self.g.op("Mul", [act, up]), [p + "ffn_down.weight"])

    def build(self):
        from onnx import TensorProto, helper

        cfg, g = self.cfg, self.g
        KV, D = cfg.n_head_kv, cfg.head_dim
        if self.static:
            S, C = self.static
            seq, cache, total, cache_type = S, C, C, TensorProto.FLOAT16
        else:
            seq, cache, total, cache_type = "S", "C", "T", TensorProto.FLOAT
        windowed = cfg.swa_layers is not None and any(cfg.swa_layers)
        inputs = [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, seq]),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, seq]),
            helper.make_tensor_value_info("attention_bias", TensorProto.FLOAT, [1, 1, seq, total]),
        ]
        if windowed:
            inputs.append(helper.make_tensor_value_info("attention_bias_local", TensorProto.FLOAT, [1, 1, seq, total]))
        inputs.append(helper.make_tensor_value_info("logits_rows", TensorProto.INT64, ["R"] if not self.static else [seq]))
        outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                                 [1, "R" if not self.static else seq, cfg.n_vocab])]
        n_pos = self.static[1] if self.static else positions_limit(cfg)
        # One cos, sin table pair per distinct (base, scale) of the layers (gemma3: global and local).
        ropes = {}
        for base, scale in cfg.rope:
            if (base, scale) not in ropes:
                ropes[base, scale] = tuple(g.const(f"rope{len(ropes) or ''}.{n}", a) for n, a in zip(
                    ("cos", "sin"), rope_cache(n_pos, cfg.head_dim, base, scale)))
        embed, head = self.embedding_and_head()
        ids, pos, rows = "input_ids", "position_ids", "logits_rows"
        biases = {False: "attention_bias", True: "attention_bias_local" if windowed else None}
        slots = seqlens = None
        if self.static:
            inputs.append(helper.make_tensor_value_info("cache_slots", TensorProto.INT64, [seq]))
            # (S,) -> (1, KV, S, D): ScatterElements wants indices of the updates' shape
            slots = g.op("Expand", [g.op("Reshape", ["cache_slots", g.shape("slots.shape", [1, 1, -1, 1])]),
                                    g.shape("slots.expand", [1, KV, seq, D])])
        else:  # one row more, a copy of the last (see the module's docstring)
            ids, pos, rows = self.repeat_last_row(ids, 1), self.repeat_last_row(pos, 1), self.repeat_last_row(rows, 0)
            biases = {w: b and self.repeat_last_row(b, 2) for w, b in biases.items()}
            # GroupQueryAttention's lengths from the mask: T = P + S + 1 keys after the call
            t64 = g.op("Shape", ["attention_bias"], start=3, end=4)
            t32 = g.op("Cast", [t64], to=TensorProto.INT32)
            seqlens = (g.op("Sub", [t32, g.const("gqa.one", np.array([1], np.int32))]),
                       g.op("Squeeze", [t32, g.const("gqa.axis0", np.array([0], np.int64))]))
        h = embed(ids)                                                        # (1, S (+ 1), E)
        x = self.rms_norm(h, self.vector("blk.0.attn_norm.weight"))
        for i in range(cfg.n_layer):
            for kind in ("key", "value"):
                inputs.append(helper.make_tensor_value_info(f"past.{i}.{kind}", cache_type, [1, KV, cache, D]))
                outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", cache_type, [1, KV, cache, D]))
            local = bool(cfg.swa_layers and cfg.swa_layers[i])
            q, k, v = self.qkv(i, x)
            if self.static:
                attn = self.attention_ops(i, q, k, v, pos, biases[local], slots, ropes[cfg.rope[i]])
            else:
                attn = self.attention_gqa(i, q, k, v, pos, biases[local], seqlens, ropes[cfg.rope[i]])
            attn = self.linear(attn, [f"blk.{i}.attn_output.weight"])
            if cfg.post_norms:
                attn = self.rms_norm(attn, self.vector(f"blk.{i}.post_attention_norm.weight"))
            # residual + attention, normed for the FFN; the sum is the new residual
            x, h = self.skip_norm(attn, h, self.vector(f"blk.{i}.ffn_norm.weight"))
            f = self.ffn(i, x)
            if cfg.post_norms:
                f = self.rms_norm(f, self.vector(f"blk.{i}.post_ffw_norm.weight"))
            nxt = f"blk.{i + 1}.attn_norm.weight" if i + 1 < cfg.n_layer else "output_norm.weight"
            if i + 1 == cfg.n_layer:  # only the requested rows reach the output norm and head
                h = g.op("Gather", [g.op("Add", [f, h]), rows], axis=1)
                x = self.rms_norm(h, self.vector(nxt))
            else:
                x, h = self.skip_norm(f, h, self.vector(nxt))
        logits = head(x)
        if not self.static:
            logits = self.drop_last_row(logits)
        g.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="logits.out"))
        graph = helper.make_graph(g.nodes, f"edgespec-{cfg.arch}", inputs, outputs, g.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                        helper.make_opsetid(MS_DOMAIN, 1)],
                                  producer_name="edgespec")
        model.ir_version = 10
        return model


def positions_limit(cfg: DecoderConfig) -> int:
    """Positions the dynamic graph's RoPE tables cover: the training context, at
    most MAX_POSITIONS (tables of a 32k-context model would outweigh a small one)."""
    return min(cfg.n_ctx_train, MAX_POSITIONS) if cfg.n_ctx_train > 0 else MAX_POSITIONS


# ---------------------------------------------------------------------------
# Export: a temporary folder renamed into place when complete
# ---------------------------------------------------------------------------

EXPORT_LOCK = ".edgespec-export.lock"   # flock'ed in a .part folder while its export runs


def check_weights(weights: str) -> str:
    if weights not in WEIGHTS:
        raise InvalidArgumentError(f"unknown --weights '{weights}' (available: {', '.join(WEIGHTS)})")
    return weights


def check_call_size(call_size: int) -> int:
    """Tokens per call of a static graph: at least 2, since on some providers
    a one-row product rounds differently from a multi-row one (see the module's
    docstring), and a plain step and a verification must share the shape."""
    if not 2 <= call_size <= MAX_CALL_SIZE:
        raise InvalidArgumentError(f"--call-size must be 2 to {MAX_CALL_SIZE}, got {call_size}")
    return call_size


def check_cache_len(cache_len: int, call_size: int = STATIC_SEQ) -> int:
    if not call_size * 2 <= cache_len <= MAX_POSITIONS:
        raise InvalidArgumentError(f"--cache-len must be {call_size * 2} to {MAX_POSITIONS} "
                                   f"(twice --call-size at least), got {cache_len}")
    return cache_len


def check_out_dir(out_dir: str | os.PathLike) -> None:
    """OUT_DIR must be new or an empty folder, in a writable folder."""
    out_dir = Path(out_dir).expanduser().absolute()
    if out_dir.exists():
        if not out_dir.is_dir():
            raise InvalidArgumentError(f"{out_dir} exists and is not a folder")
        if any(out_dir.iterdir()):
            raise InvalidArgumentError(f"{out_dir} is not empty; give a new or empty folder")
    parent = out_dir.parent
    if not parent.is_dir():
        raise InvalidArgumentError(f"{parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InvalidArgumentError(f"{parent} is not writable")


def export(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, weights: str = "int4",
           static_shapes: bool = False, cache_len: int = STATIC_CTX, call_size: int = STATIC_SEQ,
           model_ref: str | None = None, progress: bool = True) -> Path:
    """Write ``model.onnx`` and ``edgespec-onnx.json`` for ``gguf_path`` into
    ``out_dir`` (new or empty). Everything is written into a temporary folder
    next to it and renamed into place at the end: an interrupted export leaves
    nothing under ``out_dir``, and the next export into the same folder's
    parent removes what a killed one left beside it."""
    import onnx

    check_weights(weights)
    gguf_path = Path(gguf_path).resolve()
    out_dir = Path(out_dir).expanduser().absolute()
    check_out_dir(out_dir)
    reader = GGUFFile(gguf_path)  # validated; closed when the graph is built
    try:
        cfg = read_config(reader)
    except BaseException:
        reader.close()
        raise
    static_shapes = static_shapes or weights == "qdq"  # NPU graphs: fixed shapes
    if static_shapes:
        check_cache_len(cache_len, check_call_size(call_size))
    static = (call_size, cache_len) if static_shapes else None
    total = sum(int(t.n_bytes) for t in reader.tensors)
    bar = ByteProgress(f"export {gguf_path.name} ({weights})", total, enabled=progress)
    remove_killed_exports(out_dir.parent)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".part", dir=out_dir.parent))
        lock = _hold_lock(tmp / EXPORT_LOCK)
    except OSError as e:
        reader.close()
        raise InvalidArgumentError(f"{out_dir}: cannot write the export there ({e.strerror or e})") from None
    try:
        with reader:
            model = _Builder(reader, cfg, weights, static, bar.update).build()
        bar.note("writing and checking the graph")
        onnx.save_model(model, str(tmp / MODEL_FILE))
        del model
        onnx.checker.check_model(str(tmp / MODEL_FILE))
        meta = {
            "format": FORMAT, "version": FORMAT_VERSION, "model": MODEL_FILE, "weights": weights,
            "static": {"seq": static[0], "ctx": static[1]} if static else None,
            "positions": static[1] if static else positions_limit(cfg),
            "config": asdict(cfg),
            "source": {"gguf": str(gguf_path), "ref": model_ref or str(gguf_path),
                       "size": gguf_path.stat().st_size, "sha256": sha256_file(gguf_path)},
        }
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=1))
        if weights == "qdq":  # the float graph written above, calibrated through the backend
            from . import qdq

            bar.note("calibrating and quantizing (QDQ)")
            qdq.quantize_export(tmp, MODEL_FILE)
            onnx.checker.check_model(str(tmp / MODEL_FILE))
        os.chmod(tmp, 0o755)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        (tmp / EXPORT_LOCK).unlink()   # still held (by its descriptor) until the rename
        os.replace(tmp, out_dir)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise InvalidArgumentError(f"{out_dir}: cannot write the export ({e.strerror or e})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(lock)
        bar.done()
    return out_dir


def _hold_lock(path: Path) -> int:
    """Create ``path`` and flock it: the descriptor holding the lock."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def remove_killed_exports(folder: Path) -> None:
    """Remove the temporary folders that killed exports left in ``folder``:
    a ``.NAME.*.part`` folder holding an EXPORT_LOCK that no export holds (a
    running one keeps its lock; a folder without one is not an export's)."""
    for part in folder.glob(".*.part"):
        try:
            fd = os.open(part / EXPORT_LOCK, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue
        else:
            shutil.rmtree(part, ignore_errors=True)
        finally:
            os.close(fd)


def cache_dir() -> Path:
    from ..models.registry import home

    return home() / "onnx"


def cached_export(gguf_path: Path, weights: str = "int4", *, model_ref: str | None = None,
                  progress: bool = True) -> Path:
    """The cached export of ``gguf_path`` (``<cache>/onnx/<stem>-<weights>``),
    exporting it on first use. A cached export of a different file under the
    same name (size differs) is exported again."""
    gguf_path = Path(gguf_path).resolve()
    folder = cache_dir() / f"{gguf_path.stem}-{weights}"
    if folder.is_dir():
        try:
            meta = load_export(folder)
            if meta["source"]["size"] == gguf_path.stat().st_size and meta["weights"] == weights:
                return folder
        except ModelFormatError:
            pass
        shutil.rmtree(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"exporting {gguf_path.name} to ONNX ({weights}) into {folder} (first use)", file=sys.stderr)
    return export(gguf_path, folder, weights=weights, model_ref=model_ref, progress=progress)
