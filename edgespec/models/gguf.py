"""GGUF files through the C core's strict reader (csrc/native/gguf.c).

llama.cpp trusts the counts and offsets in a GGUF header and can crash on a
corrupt or truncated file; the C reader checks every count, length, type
code and offset against the file before anything is used, and any problem
becomes one ModelFormatError line naming the file. This module owns an open
reader and turns what it hands out into Python values:

    with GGUFFile("model.gguf") as f:
        f.get("general.architecture")            # "llama"
        f.get("tokenizer.ggml.tokens")           # list[str]
        t = f.tensor("token_embd.weight")        # name, type_name, shape, data (numpy view)
        f.arch_shapes(), f.arch_traits()         # what the native engine reads of it, and computes
    check_gguf("model.gguf")                     # validate only
    info = model_info("model.gguf")              # the summary `edgespec models info` prints
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..capi import ERR_CAP, Owned, check, check_file, ffi, lib
from ..errors import ModelFormatError, UnsupportedModelError

# Scalar metadata value types (enum es_gguf_type) -> numpy little-endian dtype.
_SCALAR_DTYPES = {
    lib.ES_GGUF_U8: "<u1", lib.ES_GGUF_I8: "<i1", lib.ES_GGUF_U16: "<u2", lib.ES_GGUF_I16: "<i2",
    lib.ES_GGUF_U32: "<u4", lib.ES_GGUF_I32: "<i4", lib.ES_GGUF_F32: "<f4", lib.ES_GGUF_BOOL: "u1",
    lib.ES_GGUF_U64: "<u8", lib.ES_GGUF_I64: "<i8", lib.ES_GGUF_F64: "<f8",
}

# llama_ftype (`general.file_type`) -> name, "MOSTLY_" dropped.
FILE_TYPES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
    10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M",
    16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S",
    22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M",
    28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0",
    37: "TQ2_0", 38: "MXFP4_MOE", 39: "NVFP4", 40: "Q1_0", 41: "Q2_0",
}


def type_name(ggml_type: int) -> str:
    """A ggml tensor type's name ("Q4_K"), from the C reader's type table."""
    return ffi.string(lib.es_type_name(ggml_type)).decode()


class GGUFTensor:
    """One tensor of an open GGUFFile. ``shape`` is in ggml order: shape[0]
    is the contiguous (row) dimension."""

    __slots__ = ("_file", "_t", "name", "ggml_type", "shape", "n_elements", "n_bytes")

    def __init__(self, file: GGUFFile, t):
        self._file, self._t = file, t  # t: the es_tensor, owned by the file's es_gguf
        self.name = ffi.string(t.name).decode("utf-8", "replace")
        self.ggml_type = t.type
        self.shape = tuple(t.ne[d] for d in range(t.n_dims))
        self.n_elements = math.prod(self.shape)
        self.n_bytes = t.nbytes

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    def dequantize(self) -> np.ndarray:
        """The tensor as float32, in numpy order (shape reversed). An
        UnsupportedModelError for a type the kernels cannot read."""
        self._file._require_open()
        out = np.empty(self.shape[::-1], dtype=np.float32)
        status = lib.es_dequantize_row(self.ggml_type, self._t.data,
                                       ffi.from_buffer("float[]", out), self.n_elements)
        if status == lib.ES_ERR_UNSUPPORTED:
            raise UnsupportedModelError(f"{self._file.path}: tensor {self.name} is of type "
                                        f"{self.type_name}, which edgespec cannot convert")
        check(status, f"dequantize {self.name}")
        return out

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes (uint8, read-only): a view of the mapping, no
        copy, valid until the file is closed."""
        self._file._require_open()
        view = np.frombuffer(ffi.buffer(self._t.data, self.n_bytes), dtype=np.uint8)
        view.flags.writeable = False
        return view

    def __repr__(self) -> str:
        return f"GGUFTensor({self.name!r}, {self.type_name}, shape={self.shape})"


class GGUFFile(Owned):
    """An open, validated GGUF file: metadata values as Python objects (arrays
    as lists), tensors with zero-copy views of their data. Close it (or use
    ``with``) to unmap the file; tensor data views must not be used after."""

    _free = lib.es_gguf_close

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()
        out = ffi.new("es_gguf **")
        err = ffi.new("char[]", ERR_CAP)
        check_file(lib.es_gguf_open(str(self.path).encode(), out, err, ERR_CAP), err, self.path,
                   "es_gguf_open")
        self._ptr = out[0]
        self.file_size = self.path.stat().st_size
        self.version = lib.es_gguf_version(self._ptr)
        self.alignment = lib.es_gguf_alignment(self._ptr)
        self.data_offset = lib.es_gguf_data_offset(self._ptr)  # where tensor data starts
        self.tensors = [GGUFTensor(self, lib.es_gguf_tensor_at(self._ptr, i))
                        for i in range(lib.es_gguf_n_tensors(self._ptr))]
        self._by_name = {t.name: t for t in self.tensors}

    def _require_open(self) -> None:
        if self._ptr is None:
            raise ModelFormatError(f"{self.path}: the GGUF file is closed")

    # -- metadata -------------------------------------------------------------

    def keys(self) -> list[str]:
        """Metadata keys in file order."""
        self._require_open()
        return [ffi.string(lib.es_gguf_key_at(self._ptr, i)).decode("utf-8", "replace")
                for i in range(lib.es_gguf_n_kv(self._ptr))]

    def __contains__(self, key: str) -> bool:
        self._require_open()
        return lib.es_gguf_find_key(self._ptr, key.encode()) >= 0

    def _value(self, key: str):
        self._require_open()
        i = lib.es_gguf_find_key(self._ptr, key.encode())
        if i < 0:
            return None
        v = ffi.new("es_gguf_value *")
        lib.es_gguf_value_at(self._ptr, i, v)
        return v

    def value_type(self, key: str) -> int | None:
        """The key's GGUF value type (lib.ES_GGUF_*), None when absent."""
        v = self._value(key)
        return None if v is None else v.type

    def array_length(self, key: str) -> int | None:
        """The element count of an array key (without reading the elements);
        None when absent or not an array."""
        v = self._value(key)
        return v.n if v is not None and v.type == lib.ES_GGUF_ARRAY else None

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value: int, float, bool, str, or a list of them (arrays,
        nested arrays as lists of lists); ``default`` when the key is absent."""
        v = self._value(key)
        return default if v is None else _decode(v)

    def strings_nul_joined(self, key: str) -> bytes | None:
        """A string array's elements as their bytes lie in the file, each
        followed by a NUL byte (None when absent or not an array of strings):
        a vocabulary to hash or compare whole, without a Python string per
        token (reading 150k of them takes a few hundred ms)."""
        v = self._value(key)
        if v is None or v.type != lib.ES_GGUF_ARRAY or v.elem_type != lib.ES_GGUF_STRING:
            return None
        if v.n == 0:
            return b""
        elems = ffi.new("es_gguf_value[]", v.n)
        check(lib.es_gguf_array_elems(v, elems, v.n), "es_gguf_array_elems")
        size = ffi.sizeof("es_gguf_value")
        # (n,) element records: their byte counts and addresses in the mapping
        records = np.frombuffer(ffi.buffer(elems, v.n * size), dtype=np.dtype(
            {"names": ["n", "data"], "formats": ["<u8", "<u8"], "offsets": [8, 16], "itemsize": size}))
        base = int(ffi.cast("uintptr_t", v.data))
        starts = records["data"].astype(np.int64) - base           # each string's bytes, in the array
        lengths = records["n"].astype(np.int64)
        end = int(starts[-1] + lengths[-1])
        raw = np.frombuffer(ffi.buffer(v.data, end), dtype=np.uint8)
        # Strings lie one after another, each after its 8-byte length: keep
        # their bytes and put a NUL where each one ends.
        out = np.zeros(int(lengths.sum()) + v.n, dtype=np.uint8)
        out_starts = np.concatenate(([0], np.cumsum(lengths + 1)[:-1]))
        keep = np.repeat(starts - out_starts, lengths + 1)        # source - destination, per output byte
        index = np.arange(len(out), dtype=np.int64) + keep
        is_text = np.ones(len(out), dtype=bool)
        is_text[out_starts + lengths] = False
        out[is_text] = raw[index[is_text]]
        return out.tobytes()

    # -- tensors ----------------------------------------------------------------

    def tensor(self, name: str) -> GGUFTensor | None:
        return self._by_name.get(name)

    def arch_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor this file's architecture reads (its table, each layer's
        rows by full name, the rows that apply to this file), with the shape
        its hyperparameters give, ggml order (-1: any). UnsupportedModelError
        for an architecture the native engine does not read; ModelFormatError
        when the hyperparameters are refused."""
        self._require_open()
        n = ffi.new("int32_t *")
        err = ffi.new("char[]", ERR_CAP)
        check_file(lib.es_gguf_arch_shapes(self._ptr, ffi.NULL, 0, n, err, ERR_CAP), err, self.path,
                   "es_gguf_arch_shapes")
        out = ffi.new("es_tensor_shape[]", max(n[0], 1))
        check_file(lib.es_gguf_arch_shapes(self._ptr, out, n[0], n, err, ERR_CAP), err, self.path,
                   "es_gguf_arch_shapes")
        shapes = {}
        for t in out[0:n[0]]:
            ne = tuple(t.ne)
            while len(ne) > 1 and ne[-1] == 1:
                ne = ne[:-1]
            shapes[ffi.string(t.name).decode()] = ne
        return shapes

    def arch_traits(self) -> ModelTraits:
        """This file's architecture's traits resolved by its keys, as the
        native loader resolves them (es_gguf_arch_traits): the scales, the
        sliding window and each layer's RoPE. UnsupportedModelError for an
        architecture the native engine does not read (or a RoPE scaling it
        does not); ModelFormatError for a key out of range."""
        self._require_open()
        out = ffi.new("es_model_traits *")
        err = ffi.new("char[]", ERR_CAP)
        check_file(lib.es_gguf_arch_traits(self._ptr, out, ffi.NULL, 0, err, ERR_CAP), err, self.path,
                   "es_gguf_arch_traits")
        layers = ffi.new("es_layer_traits[]", max(out.n_layer, 1))
        check_file(lib.es_gguf_arch_traits(self._ptr, out, layers, out.n_layer, err, ERR_CAP), err, self.path,
                   "es_gguf_arch_traits")
        return ModelTraits(arch=_arch_traits(out.arch), embd_scale=out.embd_scale,
                           final_softcap=out.final_softcap, attn_scale=out.attn_scale, n_swa=out.n_swa,
                           layers=tuple(LayerTraits(bool(t.swa), t.rope_base, t.rope_scale)
                                        for t in layers[0:out.n_layer]))


def _decode(v) -> Any:
    """An es_gguf_value * as a Python object (its data lies in the open mapping)."""
    if v.type == lib.ES_GGUF_STRING:
        return _text(v)
    if v.type == lib.ES_GGUF_ARRAY:
        if v.elem_type in _SCALAR_DTYPES:
            dtype = np.dtype(_SCALAR_DTYPES[v.elem_type])
            values = np.frombuffer(ffi.buffer(v.data, v.n * dtype.itemsize), dtype=dtype).tolist()
            return [bool(x) for x in values] if v.elem_type == lib.ES_GGUF_BOOL else values
        elems = ffi.new("es_gguf_value[]", max(v.n, 1))
        check(lib.es_gguf_array_elems(v, elems, v.n), "es_gguf_array_elems")
        if v.elem_type == lib.ES_GGUF_STRING:  # vocabularies: the common, long case
            return [_text(elems + i) for i in range(v.n)]
        return [_decode(elems + i) for i in range(v.n)]
    dtype = np.dtype(_SCALAR_DTYPES[v.type])
    x = np.frombuffer(ffi.buffer(v.data, dtype.itemsize), dtype=dtype)[0].item()
    return bool(x) if v.type == lib.ES_GGUF_BOOL else x


def _text(v) -> str:
    return ffi.unpack(ffi.cast("char *", v.data), v.n).decode("utf-8", "replace")


# ---------------------------------------------------------------------------
# Architectures: each one's tensor table and traits (csrc/native/arch/<name>.c)
# ---------------------------------------------------------------------------

# enum es_dim, as the tables write a shape's axes.
DIMS = ("1", "n_embd", "n_vocab", "n_ff", "n_q", "n_k", "n_v", "head_dim", "n_qkv", "n_expert", "n_ff_exp")


@dataclass(frozen=True)
class TensorSpec:
    """One row of an architecture's tensor table."""

    name: str                 # "attn_q.weight"; per layer under "blk.<il>."
    dims: tuple[str, ...]     # each axis as a hyperparameter (DIMS), ggml order
    layer: bool               # one per layer
    required: bool            # a file without it is refused (Q, K, V: unless fused)
    flags: int                # es_tensor_flags


def architectures() -> list[str]:
    """The architectures the native engine reads."""
    out, i = [], 0
    while (name := lib.es_arch_name(i)) != ffi.NULL:
        out.append(ffi.string(name).decode())
        i += 1
    return out


def arch_tensors(arch: str) -> list[TensorSpec]:
    """Architecture ``arch``'s tensor table ([] for one the engine does not read)."""
    spec, out, i = ffi.new("es_tensor_spec *"), [], 0
    while lib.es_arch_tensor(arch.encode(), i, spec):
        dims = tuple(DIMS[d] for d in spec.ne)
        while len(dims) > 1 and dims[-1] == "1":
            dims = dims[:-1]
        out.append(TensorSpec(ffi.string(spec.name).decode(), dims, bool(spec.flags & lib.ES_TENSOR_LAYER),
                              bool(spec.flags & (lib.ES_TENSOR_REQUIRED | lib.ES_TENSOR_UNFUSED)), spec.flags))
        i += 1
    return out


# enum es_activation, by name.
ACTIVATIONS = {lib.ES_ACT_SILU: "silu", lib.ES_ACT_GELU_TANH: "gelu_tanh"}


@dataclass(frozen=True)
class ArchTraits:
    """What an architecture's layers compute besides its tensors (es_arch_traits)."""

    rope_neox: bool         # RoPE turns the two halves of a head (NEOX), not adjacent pairs (NORM)
    activation: str         # the FFN's gate (ACTIVATIONS): down(act(gate(x)) * up(x))
    qk_norm: bool           # attn_q_norm, attn_k_norm: RMSNorm of each head of Q and K before RoPE
    post_norms: bool        # post_attention_norm, post_ffw_norm on each block's output, before its residual add
    embd_scale: bool        # token embeddings times sqrt(n_embd)
    final_softcap: bool     # logits soft-capped by final_logit_softcapping
    attn_scale_on_q: bool   # the attention scale multiplies Q (gemma3, as llama.cpp) rather than the scores
    sliding_window: bool    # layers may attend through a sliding window (gemma3's pattern)


@dataclass(frozen=True)
class LayerTraits:
    """One layer's traits resolved for a file (es_layer_traits)."""

    swa: bool               # attends through the sliding window
    rope_base: float
    rope_scale: float       # linear RoPE scaling: positions times it (1: none)


@dataclass(frozen=True)
class ModelTraits:
    """An architecture's traits resolved for a file (es_model_traits): the numbers its keys give."""

    arch: ArchTraits
    embd_scale: float       # token embeddings times it (1: none)
    final_softcap: float    # logits = c * tanh(logits / c); 0: off
    attn_scale: float       # attention scores = q.k * attn_scale
    n_swa: int              # a sliding layer's token at p sees p - n_swa < q <= p; 0: no window
    layers: tuple[LayerTraits, ...]


def _arch_traits(t) -> ArchTraits:
    return ArchTraits(rope_neox=t.rope_type == lib.ES_ROPE_NEOX, activation=ACTIVATIONS[t.activation],
                      qk_norm=bool(t.qk_norm), post_norms=bool(t.post_norms), embd_scale=bool(t.embd_scale),
                      final_softcap=bool(t.final_softcap), attn_scale_on_q=t.attn_scale == lib.ES_ATTN_SCALE_Q_GEMMA3,
                      sliding_window=t.swa != lib.ES_SWA_NONE)


def arch_traits(arch: str) -> ArchTraits | None:
    """Architecture ``arch``'s traits (None for one the engine does not read)."""
    out = ffi.new("es_arch_traits *")
    return _arch_traits(out) if lib.es_arch_get_traits(arch.encode(), out) else None


def check_gguf(path: str | os.PathLike) -> None:
    """Validate a GGUF file as a model before any engine reads it: the reader's
    checks of the layout, then es_gguf_validate's of the hyperparameters,
    vocabulary and tensors (csrc/native/validate.c: what llama.cpp would
    otherwise assert on). ModelNotFoundError when ``path`` does not exist,
    ModelFormatError (one line: the path and the problem) otherwise."""
    with GGUFFile(path) as f:
        err = ffi.new("char[]", ERR_CAP)
        check_file(lib.es_gguf_validate(f.handle, err, ERR_CAP), err, f.path, "es_gguf_validate")


# ---------------------------------------------------------------------------
# Model summary
# ---------------------------------------------------------------------------


@dataclass
class ModelInfo:
    path: Path
    file_size: int
    gguf_version: int
    architecture: str | None
    name: str | None
    n_params: int                       # sum of tensor element counts
    n_tensors: int
    file_type: str | None               # `general.file_type` as a name ("Q4_K_M")
    tensor_types: dict[str, int]        # ggml type name -> number of tensors
    vocab_size: int | None
    context_length: int | None
    embedding_length: int | None
    n_layers: int | None
    n_heads: int | None
    n_kv_heads: int | None
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["path"] = str(self.path)
        d["has_chat_template"] = self.has_chat_template
        return d


def model_info(path: str | os.PathLike) -> ModelInfo:
    """Read a GGUF file (strictly, see GGUFFile) and summarise it."""
    with GGUFFile(path) as f:
        def scalar(key: str, kind: type) -> Any:
            # Per-layer hyperparameters may be arrays; a summary only shows plain values.
            if f.value_type(key) in (None, lib.ES_GGUF_ARRAY):
                return None
            v = f.get(key)
            return v if isinstance(v, kind) and not isinstance(v, bool) else None

        arch = scalar("general.architecture", str)

        def arch_int(key: str) -> int | None:
            return scalar(f"{arch}.{key}", int) if arch else None

        tensor_types: dict[str, int] = {}
        for t in f.tensors:
            tensor_types[t.type_name] = tensor_types.get(t.type_name, 0) + 1
        ftype = scalar("general.file_type", int)
        return ModelInfo(
            path=f.path,
            file_size=f.file_size,
            gguf_version=f.version,
            architecture=arch,
            name=scalar("general.name", str),
            n_params=sum(t.n_elements for t in f.tensors),
            n_tensors=len(f.tensors),
            file_type=None if ftype is None else FILE_TYPES.get(ftype, f"unknown ({ftype})"),
            tensor_types=tensor_types,
            vocab_size=f.array_length("tokenizer.ggml.tokens"),
            context_length=arch_int("context_length"),
            embedding_length=arch_int("embedding_length"),
            n_layers=arch_int("block_count"),
            n_heads=arch_int("attention.head_count"),
            n_kv_heads=arch_int("attention.head_count_kv"),
            chat_template=scalar("tokenizer.chat_template", str),
            bos_token_id=scalar("tokenizer.ggml.bos_token_id", int),
            eos_token_id=scalar("tokenizer.ggml.eos_token_id", int),
        )
