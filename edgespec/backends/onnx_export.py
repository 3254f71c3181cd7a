"""Export a GGUF llama-architecture model as an ONNX decoder graph for ONNX Runtime.

    export(gguf_path, out_dir, weights="int4")         # model.onnx + edgespec-onnx.json
    cached_export(gguf_path, "int4")                   # the same, once, into the edgespec cache

The graph evaluates S new tokens against an explicit KV cache (batch 1):

    inputs   input_ids       int64   (1, S)
             position_ids    int64   (1, S)        RoPE position of each token
             attention_bias  float32 (1, 1, S, T)  0 where a token may attend, -inf elsewhere
             logits_rows     int64   (R,)          which of the S tokens get a logits row
             past.{i}.key / past.{i}.value  float16 (1, n_head_kv, P, head_dim), one pair per layer
    outputs  logits          float32 (1, R, n_vocab)
             present.{i}.key / present.{i}.value   (1, n_head_kv, T, head_dim)

with T = P + S in the dynamic graph (the present cache is the past one with
the S new entries appended). The mask is an input because a draft tree needs
more than causality: each node sees the cache, the prefix and its ancestors.
``--static-shapes`` fixes S and the cache length C instead, as NPU providers
need: past and present are (1, n_head_kv, C, head_dim), the new entries are
scattered into the slots given by an extra input ``cache_slots`` int64 (S,),
and attention runs over all C slots (T = C) under the mask.

Row invariance: a token's logits must not depend on how many tokens share its
call, or speculative greedy output would part from plain decoding (a plain step
evaluates one token, a verification step several). ONNX Runtime's CPU kernels
do not promise that: on AVX2, 4-bit MatMulNBits sends a one-row product to a
GEMV kernel that applies zero points inside the integer dot product and a
multi-row one to a GEMM kernel that corrects them afterwards with block sums,
and the two round differently (up to 0.7 in smollm2-135m's logits). So the
dynamic graph never multiplies a lone row: it appends a copy of its last token
(id, position, mask row) to every call, as row S, and drops that row's key and
value before they reach the cache; the output norm and head likewise see the R
requested rows plus a copy of the last, dropped from the logits. With S + 1 >= 2
rows, and the copy the only row that can be left over when MLAS splits rows
into tiles of 128 or pairs, every real row goes through the same kernels
whatever S is. A static graph's calls all have S rows already.

Operators (ONNX Runtime contrib ops, com.microsoft, where they help):
    MatMulNBits                       every linear layer in int4/int8 exports. GGUF Q4_0 and
                                      Q4_1 blocks of 32 map onto 4-bit blocks exactly: Q4_0's
                                      value d*(q-8) is the op's default zero point 8, Q4_1's
                                      d*q + m is (q - zp)*d with a float zero point -m/d.
                                      Q8_0 blocks map onto 8-bit blocks (zero point 128);
                                      other types are dequantized and requantized to 8 bits.
    RotaryEmbedding                   RoPE (llama: adjacent pairs, "interleaved")
    SkipSimplifiedLayerNormalization  RMS norm with the residual add fused, between blocks;
                                      the first and the final norm are ONNX's own
                                      RMSNormalization (opset 23): onnx.checker does not know
                                      ORT's SimplifiedLayerNormalization in the ONNX domain
    MatMul / Softmax                  attention itself: GroupQueryAttention masks causally by
                                      sequence index on its own and has no free-form mask for
                                      a tree's siblings on every provider, so attention is plain
                                      ops under the additive mask input.
The token embedding shares the output matrix's 8-bit blocks (tied weights):
Gather the rows, then scale them.
"""
from __future__ import annotations

import hashlib
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
from ..models.gguf import GGUFFile, GGUFTensor

FORMAT = "edgespec-onnx"
FORMAT_VERSION = 2             # 2: the dynamic graph pads every call with a copy of its last row
CONFIG_FILE = "edgespec-onnx.json"
MODEL_FILE = "model.onnx"
WEIGHTS = ("int4", "int8", "fp16", "fp32")
ARCHITECTURES = ("llama",)
BLOCK = 32                    # MatMulNBits block size = the GGUF block of Q4_0/Q4_1/Q8_0
STATIC_SEQ = 16               # --static-shapes: tokens per call (a verify width)
STATIC_CTX = 1024             # --static-shapes: cache slots
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
    rope_base: float
    rope_dim: int
    rms_eps: float
    tied_output: bool


def _field(reader: GGUFFile, key: str, default=None):
    value = reader.get(key)
    if value is None:
        if default is None:
            raise ModelFormatError(f"{reader.path}: GGUF metadata has no {key}")
        return default
    return value


def read_config(reader: GGUFFile) -> DecoderConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelFormatError(f"architecture '{arch}' cannot be exported to ONNX yet "
                               f"(supported: {', '.join(ARCHITECTURES)})")
    n_embd = int(_field(reader, f"{arch}.embedding_length"))
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    head_dim = n_embd // n_head
    names = {t.name for t in reader.tensors}
    n_vocab = int(next(t.shape[1] for t in reader.tensors if t.name == "token_embd.weight"))
    return DecoderConfig(
        arch=arch,
        n_layer=int(_field(reader, f"{arch}.block_count")),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=int(_field(reader, f"{arch}.attention.head_count_kv", n_head)),
        head_dim=head_dim,
        n_ff=int(_field(reader, f"{arch}.feed_forward_length")),
        n_vocab=n_vocab,
        n_ctx_train=int(_field(reader, f"{arch}.context_length")),
        rope_base=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_dim=int(_field(reader, f"{arch}.rope.dimension_count", head_dim)),
        rms_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        tied_output="output.weight" not in names,
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


def rope_cache(n_pos: int, rot_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """(n_pos, rot_dim / 2) cos and sin, computed like llama.cpp's CPU rope: the
    angle for pair i is pos * base^(-2i/d), accumulated in float32 (theta *= scale)."""
    scale = np.float32(base) ** np.float32(-2.0 / rot_dim)
    theta = np.arange(n_pos, dtype=np.float32)
    cols = []
    for _ in range(rot_dim // 2):
        cols.append(theta)
        theta = (theta * scale).astype(np.float32)
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

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs):
        from onnx import helper

        self._n += 1
        outs = [f"{op_type.lower()}_{self._n}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=f"{op_type}_{self._n}",
                                           domain=domain, **attrs))
        return outs[0] if n_out == 1 else outs

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
        self._q8_consts = False
        self._q8_shapes: set[int] = set()
        self._indices: set[str] = set()

    def tensor(self, name: str):
        t = self.tensors.get(name)
        if t is None:
            raise ModelFormatError(f"GGUF has no tensor {name}")
        self.progress(t.n_bytes)
        return t

    def vector(self, name: str) -> str:
        t = self.tensor(name)
        return self.g.const(name, t.dequantize().reshape(-1))

    def nbits_inputs(self, name: str, w: NBits) -> list[str]:
        g = self.g
        ins = [g.const(f"{name}.q", w.blocks), g.const(f"{name}.scales", w.scales)]
        if w.mins is not None:  # d*q blocks: zero point 0, two 4-bit zero points a byte
            n, nb = w.mins.shape
            ins.append(g.const(f"{name}.zp", np.zeros(n * ((nb + 1) // 2), np.uint8)))
        return ins

    def linear(self, x: str, names: list[str]) -> str:
        """x (1, S, K) @ W^T for the row-wise concatenation W of the named (N_i, K) matrices."""
        g = self.g
        key = names[0] if len(names) == 1 else names[0].rsplit(".", 2)[0] + ".fused_" + "_".join(
            n.split(".")[-2] for n in names)
        if self.weights in ("fp16", "fp32"):
            w = np.concatenate([dequantize(self.tensor(n)) for n in names], axis=0)
            dt = np.float16 if self.weights == "fp16" else np.float32
            wt = g.const(key, np.ascontiguousarray(w.T.astype(dt)))
            if self.weights == "fp16":
                wt = g.op("Cast", [wt], to=FLOAT)
            return g.op("MatMul", [x, wt])
        parts = [matrix_nbits(self.tensor(n), self.weights) for n in names]
        if len({(p.bits, p.mins is None) for p in parts}) > 1:  # mixed kinds: requantize all
            parts = [requantize8(dequantize(self.tensors[n])) for n in names]
        w = NBits(parts[0].bits, np.concatenate([p.blocks for p in parts]),
                  np.concatenate([p.scales for p in parts]),
                  None if parts[0].mins is None else np.concatenate([p.mins for p in parts]))
        return self.nbits_matmul(x, w, self.nbits_inputs(key, w), key)

    def q8_activations(self, x: str, k: int, want_sums: bool) -> tuple[str, str | None]:
        """x (1, S, K) rounded the way llama.cpp's CPU quantizes activations for
        its dot products (quantize_row_q8_1): per block of 32, d = amax / 127,
        q = round-half-even(x * 127 / amax), value f16(d) * q. Returns that
        value (1, S, K) and, if asked, the blocks' sums f16(d * sum(q)) (1, S, K / 32).
        MatMulNBits at accuracy_level 4 requantizes these values losslessly (the
        block's absmax is exactly 127 * f16(d)), so its int8 kernels compute the
        same integer dot products as llama.cpp."""
        g = self.g
        if not self._q8_consts:
            self._q8_consts = True
            g.const("q8.127", np.array(127, np.float32))
            g.const("q8.inv127", np.array(1 / 127, np.float32))
            g.const("q8.tiny", np.array(1e-30, np.float32))
            g.const("q8.last_axis", np.array([-1], np.int64))
        if k not in self._q8_shapes:
            self._q8_shapes.add(k)
            g.shape(f"q8.blocks{k}", [1, -1, k // BLOCK, BLOCK])
            g.shape(f"q8.flat{k}", [1, -1, k])
        blocks = g.op("Reshape", [x, f"q8.blocks{k}"])                                   # (1, S, nb, 32)
        amax = g.op("ReduceMax", [g.op("Abs", [blocks]), "q8.last_axis"], keepdims=1)
        d = g.op("Mul", [amax, "q8.inv127"])
        d16 = g.op("Cast", [g.op("Cast", [d], to=FLOAT16)], to=FLOAT)
        q = g.op("Round", [g.op("Mul", [blocks, g.op("Div", ["q8.127", g.op("Max", [amax, "q8.tiny"])])])])
        value = g.op("Reshape", [g.op("Mul", [q, d16]), f"q8.flat{k}"])
        if not want_sums:
            return value, None
        sums = g.op("Mul", [g.op("ReduceSum", [q, "q8.last_axis"], keepdims=0),
                            g.op("Squeeze", [d, "q8.last_axis"])])
        return value, g.op("Cast", [g.op("Cast", [sums], to=FLOAT16)], to=FLOAT)

    def nbits_matmul(self, x: str, w: NBits, inputs: list[str], key: str) -> str:
        """x (1, S, K) @ W^T through MatMulNBits on llama.cpp-rounded activations;
        Q4_1's minimums add blocksum(x) @ M^T, as ggml_vec_dot_q4_1_q8_1 does."""
        g = self.g
        n, k = w.shape
        x, sums = self.q8_activations(x, k, w.mins is not None)
        y = g.op("MatMulNBits", [x] + inputs, domain=MS_DOMAIN,
                 K=k, N=n, bits=w.bits, block_size=BLOCK, accuracy_level=4)
        if w.mins is None:
            return y
        return g.op("Add", [y, g.op("MatMul", [sums, g.const(f"{key}.mins", np.ascontiguousarray(w.mins.T))])])

    def embedding_and_head(self):
        """Token embedding (Gather) and the output matrix; with tied weights the
        8-bit blocks are stored once and serve both."""
        cfg, g = self.cfg, self.g
        emb_t = self.tensor("token_embd.weight")
        if self.weights in ("fp16", "fp32"):
            table = dequantize(emb_t).astype(np.float16 if self.weights == "fp16" else np.float32)
            name = g.const("token_embd.weight", table)
            if self.weights == "fp16":
                name = g.op("Cast", [name], to=FLOAT)
            embed = lambda ids: g.op("Gather", [name, ids])  # noqa: E731
            head_table = name if cfg.tied_output else None
        else:
            w = matrix_nbits(emb_t, "int8")  # Q8_0 exactly, else requantized: the rows must be 8-bit
            if w.bits != 8:
                w = requantize8(dequantize(emb_t))
            q, scales = self.nbits_inputs("token_embd", w)
            nb = cfg.n_embd // BLOCK

            def embed(ids):
                rows = g.op("Cast", [g.op("Gather", [q, ids])], to=FLOAT)          # (1, S, nb, 32)
                rows = g.op("Sub", [rows, g.const("emb.zp", np.array(128, np.float32))])
                sc = g.op("Gather", [g.op("Reshape", [scales, g.shape("emb.sc_shape", [-1, nb, 1])]), ids])
                return g.op("Reshape", [g.op("Mul", [rows, sc]), g.shape("emb.out_shape", [1, -1, cfg.n_embd])])
            head_table = (q, scales) if cfg.tied_output else None
            head_w = w

        def head(x):                                                          # (1, R, E) -> (1, R, V)
            if head_table is None:
                return self.linear(x, ["output.weight"])
            if isinstance(head_table, tuple):
                return self.nbits_matmul(x, head_w, list(head_table), "output")
            flat = g.op("Reshape", [x, g.shape("head.in_shape", [-1, cfg.n_embd])])
            y = g.op("Gemm", [flat, head_table], transB=1)
            return g.op("Reshape", [y, g.shape("head.out_shape", [1, -1, cfg.n_vocab])])
        return embed, head

    def attention_consts(self) -> None:
        """Shapes every layer's attention shares (G = query heads per KV head)."""
        cfg, g = self.cfg, self.g
        H, KV, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        G = H // KV
        g.shape("attn.kv_heads", [1, -1, KV, D])
        g.shape("attn.q_heads", [1, -1, KV, G, D])
        g.shape("attn.q_grouped", [1, KV, -1, D])
        g.shape("attn.scores_heads", [1, H, -1, 0])      # 0: keep T
        g.shape("attn.scores_grouped", [1, KV, -1, 0])
        g.shape("attn.out_heads", [1, KV, G, -1, D])
        g.shape("attn.out_shape", [1, -1, H * D])
        g.const("attn.scale", np.array(1.0 / np.sqrt(D), np.float32))

    def index(self, name: str, values: list[int]) -> str:
        """An int64 constant for Slice, written once."""
        if name not in self._indices:
            self._indices.add(name)
            self.g.const(name, np.array(values, np.int64))
        return name

    def repeat_last_row(self, x: str, axis: int) -> str:
        """x with its last entry along ``axis`` (the token axis) appended once more."""
        last = self.g.op("Slice", [x, self.index("pad.minus1", [-1]),
                                   self.index("pad.max", [np.iinfo(np.int64).max]),
                                   self.index(f"pad.axis{axis}", [axis])])
        return self.g.op("Concat", [x, last], axis=axis)

    def drop_last_row(self, x: str) -> str:
        """(1, S + 1, ...) -> (1, S, ...)"""
        return self.g.op("Slice", [x, self.index("pad.zero", [0]), self.index("pad.minus1", [-1]),
                                   self.index("pad.axis1", [1])])

    def attention(self, i: int, x: str, pos: str, bias: str, slots: str | None,
                  rope: tuple[str, str]) -> tuple[str, str, str]:
        """One attention block on normed x (1, S, E), S + 1 rows in the dynamic graph (the
        last a copy, kept out of the cache); returns (out, present_k, present_v)."""
        cfg, g = self.cfg, self.g
        p = f"blk.{i}."
        H, KV, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        qkv = self.linear(x, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"])
        q, k, v = g.op("Split", [qkv, g.const(f"{p}qkv_split", np.array([H * D, KV * D, KV * D], np.int64))],
                       n_out=3, axis=2)
        cos, sin = rope
        q = g.op("RotaryEmbedding", [q, pos, cos, sin], domain=MS_DOMAIN, interleaved=1, num_heads=H)
        k = g.op("RotaryEmbedding", [k, pos, cos, sin], domain=MS_DOMAIN, interleaved=1, num_heads=KV)
        if not self.static:  # build()'s copy of the last row does not enter the cache
            k, v = self.drop_last_row(k), self.drop_last_row(v)
        # (1, S, KV*D) -> (1, KV, S, D)
        k = g.op("Transpose", [g.op("Reshape", [k, "attn.kv_heads"])], perm=[0, 2, 1, 3])
        v = g.op("Transpose", [g.op("Reshape", [v, "attn.kv_heads"])], perm=[0, 2, 1, 3])
        # The cache holds float16, like llama.cpp's: half the memory and traffic.
        k, v = g.op("Cast", [k], to=FLOAT16), g.op("Cast", [v], to=FLOAT16)
        past_k, past_v = f"past.{i}.key", f"past.{i}.value"
        if slots is None:
            present_k = g.op("Concat", [past_k, k], axis=2)                   # (1, KV, P + S, D)
            present_v = g.op("Concat", [past_v, v], axis=2)
        else:
            present_k = g.op("ScatterElements", [past_k, slots, k], axis=2)   # (1, KV, C, D)
            present_v = g.op("ScatterElements", [past_v, slots, v], axis=2)
        # Grouped-query attention: query head h uses KV head h // G, so the G query
        # heads of a KV head are consecutive: (1, S, H*D) -> (1, KV, G*S, D).
        q = g.op("Transpose", [g.op("Reshape", [q, "attn.q_heads"])], perm=[0, 2, 3, 1, 4])  # (1, KV, G, S, D)
        q = g.op("Reshape", [g.op("Mul", [q, "attn.scale"]), "attn.q_grouped"])
        keys = g.op("Transpose", [g.op("Cast", [present_k], to=FLOAT)], perm=[0, 1, 3, 2])
        scores = g.op("MatMul", [q, keys])                                               # (1, KV, G*S, T)
        scores = g.op("Add", [g.op("Reshape", [scores, "attn.scores_heads"]), bias])      # (1, H, S, T)
        probs = g.op("Reshape", [g.op("Softmax", [scores], axis=-1), "attn.scores_grouped"])
        out = g.op("MatMul", [probs, g.op("Cast", [present_v], to=FLOAT)])              # (1, KV, G*S, D)
        out = g.op("Reshape", [out, "attn.out_heads"])                                     # (1, KV, G, S, D)
        out = g.op("Reshape", [g.op("Transpose", [out], perm=[0, 3, 1, 2, 4]), "attn.out_shape"])  # (1, S, H*D)
        return self.linear(out, [p + "attn_output.weight"]), present_k, present_v

    def ffn(self, i: int, x: str) -> str:
        p = f"blk.{i}."
        gate_up = self.linear(x, [p + "ffn_gate.weight", p + "ffn_up.weight"])
        gate, up = self.g.op("Split", [gate_up], n_out=2, axis=2, num_outputs=2)
        act = self.g.op("Mul", [gate, self.g.op("Sigmoid", [gate])])       # SiLU
        return self.linear(self.g.op("Mul", [act, up]), [p + "ffn_down.weight"])

    def build(self):
        from onnx import TensorProto, helper

        cfg, g = self.cfg, self.g
        KV, D = cfg.n_head_kv, cfg.head_dim
        if self.static:
            S, C = self.static
            seq, past_len, total = S, C, C
        else:
            seq, past_len, total = "S", "P", "T"
        inputs = [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, seq]),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, seq]),
            helper.make_tensor_value_info("attention_bias", TensorProto.FLOAT, [1, 1, seq, total]),
            helper.make_tensor_value_info("logits_rows", TensorProto.INT64, ["R"] if not self.static else [seq]),
        ]
        slots = None
        if self.static:
            inputs.append(helper.make_tensor_value_info("cache_slots", TensorProto.INT64, [seq]))
            # (S,) -> (1, KV, S, D): ScatterElements wants indices of the updates' shape
            slots = g.op("Expand", [g.op("Reshape", ["cache_slots", g.shape("slots.shape", [1, 1, -1, 1])]),
                                    g.shape("slots.expand", [1, KV, seq, D])])
        outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "R" if not self.static else seq, cfg.n_vocab])]
        cos, sin = rope_cache(self.static[1] if self.static else cfg.n_ctx_train, cfg.rope_dim, cfg.rope_base)
        rope = (g.const("rope.cos", cos), g.const("rope.sin", sin))
        embed, head = self.embedding_and_head()
        self.attention_consts()
        ids, pos, bias, rows = "input_ids", "position_ids", "attention_bias", "logits_rows"
        if not self.static:  # one row more, a copy of the last (see the module's docstring)
            ids, pos, bias, rows = (self.repeat_last_row(ids, 1), self.repeat_last_row(pos, 1),
                                    self.repeat_last_row(bias, 2), self.repeat_last_row(rows, 0))
        h = embed(ids)                                                        # (1, S (+ 1), E)
        eps = cfg.rms_eps
        x = g.op("RMSNormalization", [h, self.vector("blk.0.attn_norm.weight")],
                 axis=-1, epsilon=eps)
        for i in range(cfg.n_layer):
            for kind in ("key", "value"):
                inputs.append(helper.make_tensor_value_info(f"past.{i}.{kind}", TensorProto.FLOAT16,
                                                            [1, KV, past_len, D]))
            attn, pk, pv = self.attention(i, x, pos, bias, slots, rope)
            # residual + attention, normed for the FFN; the sum is the new residual
            x, _, _, h = g.op("SkipSimplifiedLayerNormalization",
                              [attn, h, self.vector(f"blk.{i}.ffn_norm.weight")], n_out=4,
                              domain=MS_DOMAIN, epsilon=eps)
            f = self.ffn(i, x)
            nxt = f"blk.{i + 1}.attn_norm.weight" if i + 1 < cfg.n_layer else "output_norm.weight"
            if i + 1 == cfg.n_layer:  # only the requested rows reach the output norm and head
                h = g.op("Add", [f, h])
                h = g.op("Gather", [h, rows], axis=1)
                x = g.op("RMSNormalization", [h, self.vector(nxt)], axis=-1, epsilon=eps)
            else:
                x, _, _, h = g.op("SkipSimplifiedLayerNormalization", [f, h, self.vector(nxt)], n_out=4,
                                  domain=MS_DOMAIN, epsilon=eps)
            for kind, name in (("key", pk), ("value", pv)):
                out = f"present.{i}.{kind}"
                g.nodes.append(helper.make_node("Identity", [name], [out], name=f"{out}.out"))
                outputs.append(helper.make_tensor_value_info(out, TensorProto.FLOAT16, [1, KV, total, D]))
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


# ---------------------------------------------------------------------------
# Export: a temporary folder renamed into place when complete
# ---------------------------------------------------------------------------


def check_weights(weights: str) -> str:
    if weights not in WEIGHTS:
        raise InvalidArgumentError(f"unknown --weights '{weights}' (available: {', '.join(WEIGHTS)})")
    return weights


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


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
           static_shapes: bool = False, model_ref: str | None = None, progress: bool = True) -> Path:
    """Write ``model.onnx`` and ``edgespec-onnx.json`` for ``gguf_path`` into
    ``out_dir`` (new or empty). Everything is written into a temporary folder
    next to it and renamed into place at the end: an interrupted export leaves
    nothing under ``out_dir``."""
    import onnx

    from ..models.registry import _Progress

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
    static = (STATIC_SEQ, STATIC_CTX) if static_shapes else None
    total = sum(int(t.n_bytes) for t in reader.tensors)
    bar = _Progress(f"export {gguf_path.name} ({weights})", total, enabled=progress)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".part", dir=out_dir.parent))
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
            "config": asdict(cfg),
            "source": {"gguf": str(gguf_path), "ref": model_ref or str(gguf_path),
                       "size": gguf_path.stat().st_size, "sha256": _file_digest(gguf_path)},
        }
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=1))
        os.chmod(tmp, 0o755)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        os.replace(tmp, out_dir)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise InvalidArgumentError(f"{out_dir}: cannot write the export ({e.strerror or e})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.done()
    return out_dir


def load_export(folder: str | os.PathLike) -> dict:
    """The config of an exported folder; ModelFormatError when it is not one."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise ModelFormatError(f"{folder} is not an edgespec ONNX export (no {CONFIG_FILE}; "
                               "make one with `edgespec export-onnx MODEL OUT_DIR`)") from None
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{folder / CONFIG_FILE}: unreadable ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ModelFormatError(f"{folder / CONFIG_FILE} is not an edgespec ONNX export config")
    if meta.get("version") != FORMAT_VERSION:
        raise ModelFormatError(f"{folder} was exported in format version {meta.get('version')}; "
                               f"this edgespec reads version {FORMAT_VERSION} (export it again)")
    if not (folder / meta.get("model", MODEL_FILE)).is_file():
        raise ModelFormatError(f"{folder} has no {meta.get('model', MODEL_FILE)}")
    return meta


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
