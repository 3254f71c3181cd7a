"""A strict, dependency-free GGUF (v2/v3) header reader.

llama.cpp trusts the counts and offsets in a GGUF header and can crash on a
corrupt or truncated file, so every model is read here first: every count,
length, type code and offset is checked against the file size before it is
used, and any problem becomes one ModelFormatError line naming the file.

    f = read_gguf("model.gguf")        # GGUFFile: metadata + tensor infos
    info = model_info("model.gguf")    # ModelInfo: the summary `edgespec models info` prints

Layout (little-endian):
    "GGUF" u32 version  u64 n_tensors  u64 n_kv
    n_kv      x  { string key, u32 value_type, value }
    n_tensors x  { string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset }
    padding to `general.alignment`, then the tensor data (offsets are relative to it)
    where string = u64 length + UTF-8 bytes, array = u32 elem_type + u64 count + elements.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ModelFormatError, ModelNotFoundError

# ---------------------------------------------------------------------------
# Format constants
# ---------------------------------------------------------------------------

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4           # GGML_MAX_DIMS
MAX_TENSOR_NAME = 63   # GGML_MAX_NAME is 64 including the terminating NUL
MAX_ARRAY_DEPTH = 8    # nested arrays are legal; a bound keeps recursion finite
KEEP_ARRAY_MAX = 256   # longer arrays keep only their type and length
_INT64_MAX = 2**63 - 1

# GGUF metadata value types -> (name, struct format or None for string/array)
VALUE_TYPES: dict[int, tuple[str, str | None]] = {
    0: ("UINT8", "<B"), 1: ("INT8", "<b"), 2: ("UINT16", "<H"), 3: ("INT16", "<h"),
    4: ("UINT32", "<I"), 5: ("INT32", "<i"), 6: ("FLOAT32", "<f"), 7: ("BOOL", "<?"),
    8: ("STRING", None), 9: ("ARRAY", None),
    10: ("UINT64", "<Q"), 11: ("INT64", "<q"), 12: ("FLOAT64", "<d"),
}
_UINT32, _STRING, _ARRAY = 4, 8, 9
_SCALARS = {code: struct.Struct(fmt) for code, (_, fmt) in VALUE_TYPES.items() if fmt}

# ggml tensor types -> (name, elements per block, bytes per block), as in
# ggml.h / gguf-py GGML_QUANT_SIZES. Codes removed from ggml (4, 5, 31-33, 36-38)
# are absent on purpose: llama.cpp rejects them too.
QK_K = 256
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 2 + 16),
    3: ("Q4_1", 32, 2 + 2 + 16),
    6: ("Q5_0", 32, 2 + 4 + 16),
    7: ("Q5_1", 32, 2 + 2 + 4 + 16),
    8: ("Q8_0", 32, 2 + 32),
    9: ("Q8_1", 32, 4 + 4 + 32),
    10: ("Q2_K", QK_K, 2 + 2 + QK_K // 16 + QK_K // 4),
    11: ("Q3_K", QK_K, 2 + QK_K // 4 + QK_K // 8 + 12),
    12: ("Q4_K", QK_K, 2 + 2 + QK_K // 2 + 12),
    13: ("Q5_K", QK_K, 2 + 2 + QK_K // 2 + QK_K // 8 + 12),
    14: ("Q6_K", QK_K, 2 + QK_K // 2 + QK_K // 4 + QK_K // 16),
    15: ("Q8_K", QK_K, 4 + QK_K + QK_K // 8),
    16: ("IQ2_XXS", QK_K, 2 + QK_K // 4),
    17: ("IQ2_XS", QK_K, 2 + QK_K // 4 + QK_K // 32),
    18: ("IQ3_XXS", QK_K, 2 + QK_K // 4 + QK_K // 8),
    19: ("IQ1_S", QK_K, 2 + QK_K // 8 + QK_K // 16),
    20: ("IQ4_NL", 32, 2 + 16),
    21: ("IQ3_S", QK_K, 2 + QK_K // 4 + QK_K // 8 + QK_K // 32 + 4),
    22: ("IQ2_S", QK_K, 2 + QK_K // 4 + QK_K // 16),
    23: ("IQ4_XS", QK_K, 2 + 2 + QK_K // 2 + QK_K // 64),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", QK_K, QK_K // 8 + QK_K // 16 + QK_K // 32),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", QK_K, 2 + 4 * 13),
    35: ("TQ2_0", QK_K, 2 + 64),
    39: ("MXFP4", 32, 1 + 16),
    40: ("NVFP4", 64, 4 + 32),
    41: ("Q1_0", 128, 2 + 16),
    42: ("Q2_0", 64, 2 + 16),
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

# ---------------------------------------------------------------------------
# Parsed data
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array. `values` is None when it has more than KEEP_ARRAY_MAX
    elements (e.g. tokenizer.ggml.tokens): its length and type are still exact
    and every element was bounds-checked."""
    elem_type: int          # a VALUE_TYPES code
    length: int
    values: tuple | None

    def __len__(self) -> int:
        return self.length


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the contiguous (row) dimension
    ggml_type: int
    offset: int             # relative to GGUFFile.data_offset
    n_elements: int
    n_bytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.ggml_type][0]


@dataclass
class GGUFFile:
    path: Path
    version: int
    file_size: int
    alignment: int
    data_offset: int        # absolute offset of the tensor data section
    metadata: dict[str, Any] = field(default_factory=dict)   # key -> scalar, str or GGUFArray
    value_types: dict[str, int] = field(default_factory=dict)  # key -> VALUE_TYPES code
    tensors: list[GGUFTensor] = field(default_factory=list)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


# ---------------------------------------------------------------------------
# Reader
# ---------------------------------------------------------------------------

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class _Reader:
    """A cursor over the mapped file; every read is bounds-checked."""

    def __init__(self, buf, size: int, label: str):
        self.buf, self.size, self.label, self.pos = buf, size, label, 0

    def fail(self, problem: str) -> ModelFormatError:
        # Names come from the file: escape control characters so the message stays one line.
        message = f"{self.label}: {problem}"
        return ModelFormatError("".join(c if c.isprintable() else ascii(c)[1:-1] for c in message))

    def need(self, n: int, what: str) -> int:
        """Reserve n bytes at the cursor for `what`; return their start."""
        start, end = self.pos, self.pos + n
        if end > self.size:
            raise self.fail(f"truncated: {what} needs bytes up to {end} but the file has {self.size}")
        self.pos = end
        return start

    def u32(self, what: str) -> int:
        return _U32.unpack_from(self.buf, self.need(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack_from(self.buf, self.need(8, what))[0]

    def count(self, what: str, min_item_bytes: int) -> int:
        """A u64 element count that must fit in what is left of the file."""
        n = self.u64(what)
        left = self.size - self.pos
        if n * min_item_bytes > left:
            raise self.fail(f"truncated or corrupt: {what} is {n} but only {left} bytes are left")
        return n

    def raw_string(self, what: str) -> bytes:
        n = self.u64(f"{what} length")
        left = self.size - self.pos
        if n > left:
            raise self.fail(f"truncated or corrupt: {what} length is {n} but only {left} bytes are left")
        start = self.need(n, what)
        return bytes(self.buf[start:start + n])

    def string(self, what: str) -> str:
        return self.raw_string(what).decode("utf-8", errors="replace")

    def skip_strings(self, n: int, what: str) -> None:
        """Walk n strings without decoding them (tokenizer vocabularies and merges)."""
        buf, size, pos, unpack = self.buf, self.size, self.pos, _U64.unpack_from
        for i in range(n):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"{what} element {i} length")
            pos += 8 + unpack(buf, pos)[0]
            if pos > size:
                raise self.fail(f"truncated: {what} element {i} needs bytes up to {pos} "
                                f"but the file has {size}")
        self.pos = pos

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            s = _SCALARS[vtype]
            return s.unpack_from(self.buf, self.need(s.size, what))[0]
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            return self.array(what, depth)
        raise self.fail(f"{what} has unknown value type {vtype}")

    def array(self, what: str, depth: int) -> GGUFArray:
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"{what} nests arrays deeper than {MAX_ARRAY_DEPTH} levels")
        etype = self.u32(f"{what} element type")
        if etype not in VALUE_TYPES:
            raise self.fail(f"{what} has unknown array element type {etype}")
        # Smallest possible element: a scalar's size, a string's or array's length header.
        min_size = _SCALARS[etype].size if etype in _SCALARS else (8 if etype == _STRING else 12)
        n = self.count(f"{what} array length", min_size)
        if n <= KEEP_ARRAY_MAX:
            return GGUFArray(etype, n, tuple(self.value(etype, f"{what}[{i}]", depth + 1)
                                             for i in range(n)))
        if etype in _SCALARS:
            self.need(n * min_size, what)
        elif etype == _STRING:
            self.skip_strings(n, what)
        else:
            for i in range(n):
                self.array(f"{what}[{i}]", depth + 1)
        return GGUFArray(etype, n, None)


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse and validate a GGUF file's header and tensor table.

    Raises ModelNotFoundError if `path` does not exist and ModelFormatError
    (one line: the path and the problem) for anything malformed.
    """
    p = Path(path).expanduser()
    label = str(p)
    if not p.exists():
        raise ModelNotFoundError(f"{label}: no such file")
    if not p.is_file():
        raise ModelFormatError(f"{label}: not a regular file")
    try:
        with open(p, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < len(GGUF_MAGIC):
                raise ModelFormatError(f"{label}: not a GGUF file (only {size} bytes)")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(_Reader(buf, size, label), p)
    except OSError as e:
        raise ModelFormatError(f"{label}: cannot read: {e.strerror or e}") from e


def _parse(r: _Reader, path: Path) -> GGUFFile:
    r.need(len(GGUF_MAGIC), "magic")
    if bytes(r.buf[:len(GGUF_MAGIC)]) != GGUF_MAGIC:
        raise r.fail("not a GGUF file (bad magic)")
    version = r.u32("version")
    if version not in SUPPORTED_VERSIONS:
        # A big-endian v2/v3 file reads as version 0x02000000 / 0x03000000 here.
        if version in (2 << 24, 3 << 24):
            raise r.fail("big-endian GGUF files are not supported")
        raise r.fail(f"unsupported GGUF version {version} (supported: 2, 3)")
    # Smallest tensor info: empty name (8) + n_dims (4) + type (4) + offset (8);
    # smallest KV: empty key (8) + type (4) + a one-byte value.
    n_tensors = r.count("tensor count", 24)
    n_kv = r.count("metadata count", 13)

    metadata: dict[str, Any] = {}
    value_types: dict[str, int] = {}
    for i in range(n_kv):
        key = r.string(f"metadata key #{i}")
        if not key:
            raise r.fail(f"metadata key #{i} is empty")
        if key in metadata:
            raise r.fail(f"duplicate metadata key '{_short(key)}'")
        vtype = value_types[key] = r.u32(f"type of metadata '{_short(key)}'")
        metadata[key] = r.value(vtype, f"metadata '{_short(key)}'")

    # llama.cpp asserts (aborts) when general.alignment is not a UINT32.
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if value_types.get("general.alignment", _UINT32) != _UINT32:
        raise r.fail("general.alignment must be a UINT32, got "
                     f"{VALUE_TYPES[value_types['general.alignment']][0]}")
    if alignment == 0 or alignment & (alignment - 1):
        raise r.fail(f"general.alignment must be a power of two, got {alignment}")

    infos = []
    names: set[str] = set()
    for i in range(n_tensors):
        raw_name = r.raw_string(f"tensor #{i} name")
        if len(raw_name) > MAX_TENSOR_NAME:
            raise r.fail(f"tensor #{i} name is {len(raw_name)} bytes long (at most {MAX_TENSOR_NAME})")
        name = raw_name.decode("utf-8", errors="replace")
        if name in names:
            raise r.fail(f"duplicate tensor '{name}'")
        names.add(name)
        n_dims = r.u32(f"tensor '{name}' dimension count")
        if n_dims > MAX_DIMS:
            raise r.fail(f"tensor '{name}' has {n_dims} dimensions (at most {MAX_DIMS})")
        shape = tuple(r.u64(f"tensor '{name}' dimensions") for _ in range(n_dims))
        ggml_type = r.u32(f"tensor '{name}' type")
        offset = r.u64(f"tensor '{name}' offset")
        infos.append((name, shape, ggml_type, offset))

    data_offset = _pad(r.pos, alignment)
    tensors = []
    expected = 0  # llama.cpp requires tensor data packed in order, each padded to the alignment
    for info in infos:
        t = _check_tensor(r, data_offset, *info)
        if t.offset != expected:
            raise r.fail(f"tensor '{t.name}' has data offset {t.offset}, expected {expected}")
        expected += _pad(t.n_bytes, alignment)
        tensors.append(t)
    return GGUFFile(path=path, version=version, file_size=r.size, alignment=alignment,
                    data_offset=data_offset, metadata=metadata, value_types=value_types,
                    tensors=tensors)


def _short(text: str, limit: int = 80) -> str:
    """A key as shown in an error: long enough to recognise, never a screenful."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _check_tensor(r: _Reader, data_offset: int,
                  name: str, shape: tuple[int, ...], ggml_type: int, offset: int) -> GGUFTensor:
    if ggml_type not in GGML_TYPES:
        raise r.fail(f"tensor '{name}' has unknown ggml type {ggml_type}")
    type_name, block, block_bytes = GGML_TYPES[ggml_type]
    n_elements = 1
    for d in shape:
        n_elements *= d
        if d > _INT64_MAX or n_elements > _INT64_MAX:
            raise r.fail(f"tensor '{name}' shape {list(shape)} has too many elements")
    if shape and shape[0] % block:
        raise r.fail(f"tensor '{name}' row of {shape[0]} elements is not a multiple of "
                     f"the {type_name} block size {block}")
    n_bytes = n_elements // block * block_bytes
    end = data_offset + offset + n_bytes
    if end > r.size:
        raise r.fail(f"truncated: tensor '{name}' needs bytes up to {end} but the file has {r.size}")
    return GGUFTensor(name, shape, ggml_type, offset, n_elements, n_bytes)


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
    """Read a GGUF file (strictly, see read_gguf) and summarise it."""
    f = read_gguf(path)
    md = f.metadata
    arch = _str(md.get("general.architecture"))

    def arch_int(key: str) -> int | None:
        return _int(md.get(f"{arch}.{key}")) if arch else None

    tensor_types: dict[str, int] = {}
    for t in f.tensors:
        tensor_types[t.type_name] = tensor_types.get(t.type_name, 0) + 1
    ftype = _int(md.get("general.file_type"))
    tokens = md.get("tokenizer.ggml.tokens")
    return ModelInfo(
        path=f.path,
        file_size=f.file_size,
        gguf_version=f.version,
        architecture=arch,
        name=_str(md.get("general.name")),
        n_params=sum(t.n_elements for t in f.tensors),
        n_tensors=len(f.tensors),
        file_type=None if ftype is None else FILE_TYPES.get(ftype, f"unknown ({ftype})"),
        tensor_types=tensor_types,
        vocab_size=tokens.length if isinstance(tokens, GGUFArray) else None,
        context_length=arch_int("context_length"),
        embedding_length=arch_int("embedding_length"),
        n_layers=arch_int("block_count"),
        n_heads=arch_int("attention.head_count"),
        n_kv_heads=arch_int("attention.head_count_kv"),
        chat_template=_str(md.get("tokenizer.chat_template")),
        bos_token_id=_int(md.get("tokenizer.ggml.bos_token_id")),
        eos_token_id=_int(md.get("tokenizer.ggml.eos_token_id")),
    )


def _int(v: Any) -> int | None:
    # Per-layer hyperparameters may be arrays; a summary only shows plain integers.
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None
