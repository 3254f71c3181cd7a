"""Offline tools for the expert cache's files (``edgespec moe``); the
settings the engine runs with are edgespec.moe.

- ``prepare``: the low-precision sidecar beside a MoE GGUF (Q2_K or Q3_K
  copies of every expert, requantized from the file's weights by the C
  kernels' es_quantize_row; Q4_0 for rows that are not whole 256-value
  super-blocks; ``moe.sidecar_path``), which ``balanced`` and ``fast``
  precision serve cache misses from.
- ``upcycle``: a MoE built from a dense llama or qwen2 GGUF, every expert a
  copy of its layer's FFN and a router of random projections, so with exact
  experts its output is the dense model's whatever the routing.
- ``synth``: a random MoE of any shape, for speed, in the tensor layout of
  Mixtral-style llama or Qwen3-MoE (``SYNTH_ARCHS``).

Every file is written beside its destination and renamed into place.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from ..capi import lib
from ..errors import InvalidArgumentError, ModelFormatError, ModelNotFoundError, UnsupportedModelError
from ..models.gguf_write import (copy_keys, gguf_module, gguf_output, quantize, raw_tensor, read_gguf,
                                 row_bytes, write_gguf)
from ..moe import SIDECAR_MAGIC, sidecar_path
from ..progress import ByteProgress

LOW_TYPES = ("q2_k", "q3_k")                  # what `moe prepare --type` writes
_SIDECAR_VERSION = 2
_SIDECAR_HEADER = 88
_ALIGN_COPY = 64      # bytes: each expert's copy padded to this
_ALIGN_DATA = 4096    # the copies start at a page


# ---- the low-precision sidecar --------------------------------------------------------------

def checksum(data: bytes | np.ndarray) -> int:
    """es_sidecar_checksum: the sum of the little-endian 64-bit words times
    (2i + 1), modulo 2^64 (len(data) a multiple of 8)."""
    words = np.frombuffer(data, dtype="<u8")
    weights = np.arange(1, 2 * len(words), 2, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return int(np.sum(words * weights, dtype=np.uint64))


def _expert_stacks(reader) -> tuple[int, list[tuple]]:
    """(n_layer, per layer its (gate, up, down) stack tensors); a model without
    experts is an UnsupportedModelError."""
    by_name = {t.name: t for t in reader.tensors}
    layers = []
    while f"blk.{len(layers)}.ffn_gate_exps.weight" in by_name:
        il = len(layers)
        layers.append(tuple(by_name.get(f"blk.{il}.ffn_{k}_exps.weight") for k in ("gate", "up", "down")))
        if None in layers[-1]:
            raise ModelFormatError(f"layer {il} lacks one of ffn_gate_exps, ffn_up_exps, ffn_down_exps")
    if not layers:
        raise UnsupportedModelError("the model has no experts (blk.N.ffn_gate_exps): not a MoE model")
    return len(layers), layers


def _low_copy(w: np.ndarray, qtype: int) -> bytes:
    """Floats (rows, n) as ``qtype``: Q2_K / Q3_K by the C kernels, Q4_0 by gguf-py."""
    gguf = gguf_module()
    if qtype == gguf.GGMLQuantizationType.Q4_0:
        return gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), qtype).tobytes()
    from ..capi import ffi
    w = np.ascontiguousarray(w, dtype=np.float32)
    out = bytearray(w.shape[0] * row_bytes(qtype, w.shape[1]))
    status = lib.es_quantize_row(qtype, ffi.from_buffer("float[]", w), ffi.from_buffer(out), w.size)
    if status != lib.ES_OK:
        raise ModelFormatError("an expert's weights are not finite or exceed half precision's range: "
                               "no low-precision copy can hold them")
    return bytes(out)


def low_types(n_embd: int, n_ff: int, qtype: str = "q3_k") -> tuple[int, int]:
    """The sidecar's ggml types of (gate and up, down): ``qtype`` for rows
    of whole 256-value super-blocks, else Q4_0 (rows of 32-value blocks)."""
    gguf = gguf_module()
    if qtype not in LOW_TYPES:
        raise InvalidArgumentError(f"--type must be one of {', '.join(LOW_TYPES)}, got {qtype!r}"[:200])
    k = int(getattr(gguf.GGMLQuantizationType, qtype.upper()))
    q4 = int(gguf.GGMLQuantizationType.Q4_0)
    for name, n in (("embedding width", n_embd), ("expert width", n_ff)):
        if n % 32:
            raise UnsupportedModelError(f"the {name} {n} is not a multiple of 32: no low-precision type fits")
    return (k if n_embd % 256 == 0 else q4), (k if n_ff % 256 == 0 else q4)


def prepare(model: os.PathLike | str, out: os.PathLike | str | None = None, *, qtype: str = "q3_k",
            progress: bool = True) -> Path:
    """Writes the sidecar of low-precision copies of every expert of
    ``model`` (``qtype``, see low_types; default: beside it,
    ``sidecar_path``); returns its path."""
    gguf = gguf_module()
    model = Path(model)
    if not model.is_file():
        raise ModelNotFoundError(f"{model}: no such file")
    out = Path(out) if out is not None else sidecar_path(model)
    reader = read_gguf(model)
    n_layer, layers = _expert_stacks(reader)
    gate = layers[0][0]
    D, F, E = (int(x) for x in gate.shape[:3])
    try:
        t_in, t_down = low_types(D, F, qtype)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{model}: {e}") from None
    slabs = [F * row_bytes(t_in, D), F * row_bytes(t_in, D), D * row_bytes(t_down, F)]
    types = (t_in, t_in, t_down)
    stride = -(-sum(slabs) // _ALIGN_COPY) * _ALIGN_COPY
    n_copies = n_layer * E
    data_off = -(-(_SIDECAR_HEADER + 8 * n_copies) // _ALIGN_DATA) * _ALIGN_DATA
    with open(model, "rb") as f:
        meta = f.read(reader.data_offset)
    # The metadata and tensor infos, and the routers (which differ between
    # models of one shape), each zero-padded to 8 bytes: the checksums added.
    by_name = {t.name: t for t in reader.tensors}
    parts = [meta] + [bytes(raw_tensor(by_name[f"blk.{il}.ffn_gate_inp.weight"])) for il in range(n_layer)]
    identity = sum(checksum(p + b"\0" * (-len(p) % 8)) for p in parts) % 2**64
    header = bytearray(_SIDECAR_HEADER)
    header[0:8] = SIDECAR_MAGIC
    fields = [(8, "<I", _SIDECAR_VERSION), (12, "<I", t_in), (16, "<I", n_layer), (20, "<I", E),
              (24, "<Q", D), (32, "<Q", F), (40, "<Q", model.stat().st_size), (48, "<Q", identity),
              (56, "<Q", stride), (64, "<Q", data_off), (72, "<I", t_down)]
    for off, fmt, v in fields:
        struct.pack_into(fmt, header, off, v)
    struct.pack_into("<Q", header, 80, checksum(bytes(header[:80])))
    sums = np.zeros(n_copies, dtype="<u8")
    bar = ByteProgress(f"prepare {out.name}", n_copies * stride, enabled=progress)
    with gguf_output(out) as tmp, open(tmp, "wb") as f:
        f.write(bytes(header))
        f.write(sums.tobytes())
        f.write(b"\0" * (data_off - f.tell()))
        for il, stacks in enumerate(layers):
            for t in stacks:
                if tuple(int(x) for x in t.shape[2:3]) != (E,):
                    raise ModelFormatError(f"{t.name}: {t.shape[2]} experts, layer 0 has {E}")
            for e in range(E):
                copy = bytearray(stride)
                pos = 0
                for t, qt in zip(stacks, types):
                    w = gguf.quants.dequantize(raw_tensor(t)[e] if t.tensor_type not in (0, 1) else
                                               np.asarray(t.data)[e], t.tensor_type)
                    q = _low_copy(w, qt)
                    copy[pos:pos + len(q)] = q
                    pos += len(q)
                sums[il * E + e] = checksum(bytes(copy))
                f.write(copy)
                bar.update(stride)
        f.seek(_SIDECAR_HEADER)
        f.write(sums.tobytes())
    bar.done()
    return out


# ---- upcycle and synth ------------------------------------------------------------------------

UPCYCLE_ARCHS = ("llama", "qwen2")


def _neox_to_norm(n_rows: int, head_dim: int) -> np.ndarray:
    """The row order that takes a projection whose RoPE pairs each head's
    halves (NEOX, qwen2) to llama's adjacent pairs (NORM): row 2i of a head
    is its row i, row 2i + 1 its row i + head_dim / 2. Queries and keys
    permuted alike are rotated by the same angles and give the same scores."""
    half = head_dim // 2
    head = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
    return (np.arange(n_rows // head_dim)[:, None] * head_dim + head).reshape(-1)


def upcycle(model: os.PathLike | str, out: os.PathLike | str, *, experts: int, top_k: int = 2,
            seed: int = 0, router_scale: float = 1.0, progress: bool = True) -> Path:
    """A Mixtral-style MoE made of the dense llama or qwen2 GGUF ``model``:
    in each layer ``experts`` copies of its FFN and a router of random
    projections, N(0, router_scale^2 / n_embd), choosing ``top_k`` (a larger
    scale routes more sharply: unequal weights, as trained routers give).
    A qwen2 model becomes a llama one with its attention biases (which
    llama.cpp's llama reads), its query and key rows in llama's RoPE order."""
    gguf = gguf_module()
    _check_counts(experts, top_k)
    reader = read_gguf(model)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    if arch not in UPCYCLE_ARCHS:
        raise UnsupportedModelError(f"{model}: upcycling takes a {' or '.join(UPCYCLE_ARCHS)} model, not {arch}")
    by_name = {t.name: t for t in reader.tensors}
    if "blk.0.ffn_gate_exps.weight" in by_name:
        raise InvalidArgumentError(f"{model}: already a MoE model")
    D = int(reader.fields[f"{arch}.embedding_length"].contents())
    n_head = int(reader.fields[f"{arch}.attention.head_count"].contents())
    head_dim = (int(reader.fields[f"{arch}.attention.key_length"].contents())
                if f"{arch}.attention.key_length" in reader.fields else D // n_head)
    rng = np.random.default_rng(seed)
    tensors, sources = [], []
    for t in reader.tensors:
        kind = t.name.split(".")
        raw = raw_tensor(t) if t.tensor_type not in (0, 1) else np.asarray(t.data)
        if len(kind) == 4 and kind[0] == "blk" and kind[2] in ("ffn_gate", "ffn_up", "ffn_down"):
            name = f"blk.{kind[1]}.{kind[2]}_exps.weight"
            if kind[2] == "ffn_gate":
                router = rng.standard_normal((experts, D), dtype=np.float32) * np.float32(router_scale / np.sqrt(D))
                tensors.append((f"blk.{kind[1]}.ffn_gate_inp.weight", (experts, D), 0, router.nbytes))
                sources.append(lambda r=router: r)
            shape = (experts, *(int(x) for x in reversed(t.shape[:2])))
            tensors.append((name, shape, int(t.tensor_type), experts * raw.nbytes))
            sources.append(lambda raw=raw: np.broadcast_to(raw, (experts, *raw.shape)))
            continue
        shape = tuple(int(x) for x in reversed(t.shape))
        tensors.append((t.name, shape, int(t.tensor_type), int(t.n_bytes)))
        if arch == "qwen2" and len(kind) == 4 and kind[2] in ("attn_q", "attn_k"):
            order = _neox_to_norm(shape[0], head_dim)   # rows, whatever their type
            sources.append(lambda raw=raw, order=order: raw[order])
        else:
            sources.append(lambda raw=raw: raw)

    def keys(w):
        copy_keys(reader, w, lambda k: k not in (f"{arch}.expert_count", f"{arch}.expert_used_count"),
                  rename=lambda k: "llama." + k[len(arch) + 1:] if k.startswith(arch + ".") else k)
        w.add_uint32("llama.expert_count", experts)
        w.add_uint32("llama.expert_used_count", top_k)

    total = sum(t[3] for t in tensors)
    with gguf_output(out) as tmp:
        write_gguf(tmp, "llama", keys, tensors, (s() for s in sources),
                    ByteProgress(f"upcycle {Path(out).name}", total, enabled=progress))
    return Path(out)


def _check_counts(experts: int, top_k: int) -> None:
    if not 1 <= experts <= 256:
        raise InvalidArgumentError(f"--experts must be in [1, 256], got {experts}")
    if not 1 <= top_k <= experts:
        raise InvalidArgumentError(f"--top-k must be in [1, --experts], got {top_k}")


SYNTH_TYPES = ("f32", "f16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0")
# llama: Mixtral's layout; qwen3moe: per-head RMSNorm of queries and keys
# (attn_q_norm, attn_k_norm), RoPE in the NEOX layout, no dense FFN width
# but expert_feed_forward_length.
SYNTH_ARCHS = ("llama", "qwen3moe")


def synth(out: os.PathLike | str, tokenizer: os.PathLike | str, *, experts: int, top_k: int,
          layers: int, embd: int, ff: int, qtype: str = "q4_0", heads: int | None = None,
          seed: int = 0, arch: str = "llama", progress: bool = True) -> Path:
    """A random MoE of the given shape in the tensor layout of ``arch``
    (SYNTH_ARCHS; the tokenizer copied from the GGUF ``tokenizer``), every
    matrix of ``qtype``; norms and routers F32. Experts draw their rows from
    a bank of random rows, so a file of gigabytes is written at disk speed."""
    gguf = gguf_module()
    _check_counts(experts, top_k)
    if qtype not in SYNTH_TYPES:
        raise InvalidArgumentError(f"--type must be one of {', '.join(SYNTH_TYPES)}, got {qtype!r}"[:200])
    if arch not in SYNTH_ARCHS:
        raise InvalidArgumentError(f"--arch must be one of {', '.join(SYNTH_ARCHS)}, got {arch!r}"[:200])
    q = int(getattr(gguf.GGMLQuantizationType, qtype.upper()))
    for name, n, lo in (("--layers", layers, 1), ("--embd", embd, 64), ("--ff", ff, 32)):
        if n < lo:
            raise InvalidArgumentError(f"{name} must be >= {lo}, got {n}")
    for name, n in (("--embd", embd), ("--ff", ff)):
        if n % 32:
            raise InvalidArgumentError(f"{name} must be a multiple of 32, got {n}")
    heads = heads or max(1, embd // 64)
    if embd % heads:
        raise InvalidArgumentError(f"{heads} heads do not divide --embd {embd}")
    heads_kv = heads // 4 if heads % 4 == 0 else heads
    head_dim = embd // heads
    src = read_gguf(tokenizer)
    n_vocab = len(src.fields[gguf.Keys.Tokenizer.LIST].data)
    rng = np.random.default_rng(seed)
    bank = {}

    def rows(n_rows: int, n: int, gain: float = 1.0) -> np.ndarray:
        """n_rows random rows of n values of type q, drawn from a bank of 512."""
        if (n, gain) not in bank:
            w = rng.standard_normal((512, n), dtype=np.float32) * np.float32(gain / np.sqrt(n))
            bank[n, gain] = quantize(w, q)
        return bank[n, gain][rng.integers(0, 512, n_rows)]

    def f32(shape, ones=False):
        return (np.ones(shape, np.float32) if ones else
                rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[-1])))

    def nbytes(shape, t):
        return int(np.prod(shape[:-1])) * row_bytes(t, shape[-1])

    tensors, sources = [], []

    def add(name, shape, t, make):
        tensors.append((name, shape, t, nbytes(shape, t)))
        sources.append(make)

    add("token_embd.weight", (n_vocab, embd), q, lambda: rows(n_vocab, embd, np.sqrt(embd)))
    for il in range(layers):
        b = f"blk.{il}."
        add(b + "attn_norm.weight", (embd,), 0, lambda: f32((embd,), True))
        add(b + "attn_q.weight", (embd, embd), q, lambda: rows(embd, embd))
        add(b + "attn_k.weight", (heads_kv * head_dim, embd), q, lambda: rows(heads_kv * head_dim, embd))
        add(b + "attn_v.weight", (heads_kv * head_dim, embd), q, lambda: rows(heads_kv * head_dim, embd))
        add(b + "attn_output.weight", (embd, embd), q, lambda: rows(embd, embd))
        if arch == "qwen3moe":
            add(b + "attn_q_norm.weight", (head_dim,), 0, lambda: f32((head_dim,), True))
            add(b + "attn_k_norm.weight", (head_dim,), 0, lambda: f32((head_dim,), True))
        add(b + "ffn_norm.weight", (embd,), 0, lambda: f32((embd,), True))
        add(b + "ffn_gate_inp.weight", (experts, embd), 0, lambda: f32((experts, embd)) * 4)
        add(b + "ffn_gate_exps.weight", (experts, ff, embd), q, lambda: rows(experts * ff, embd))
        add(b + "ffn_up_exps.weight", (experts, ff, embd), q, lambda: rows(experts * ff, embd))
        add(b + "ffn_down_exps.weight", (experts, embd, ff), q, lambda: rows(experts * embd, ff))
    add("output_norm.weight", (embd,), 0, lambda: f32((embd,), True))
    add("output.weight", (n_vocab, embd), q, lambda: rows(n_vocab, embd, 4.0))

    def keys(w):
        w.add_name("edgespec synthetic MoE")
        copy_keys(src, w, lambda k: k.startswith("tokenizer."))
        w.add_vocab_size(n_vocab)
        w.add_context_length(4096)
        w.add_embedding_length(embd)
        w.add_block_count(layers)
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(ff)
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        else:
            w.add_feed_forward_length(ff)
        w.add_head_count(heads)
        w.add_head_count_kv(heads_kv)
        w.add_rope_dimension_count(head_dim)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_rope_freq_base(10000.0)
        w.add_expert_count(experts)
        w.add_expert_used_count(top_k)

    def data():
        for (_, shape, t, _), make in zip(tensors, sources):
            arr = make()
            yield arr.reshape(*shape[:-1], -1) if t not in (0, 1) else arr.reshape(shape)

    total = sum(t[3] for t in tensors)
    with gguf_output(out) as tmp:
        write_gguf(tmp, arch, keys, tensors, data(), ByteProgress(f"synth {Path(out).name}", total,
                                                                 enabled=progress))
    return Path(out)
