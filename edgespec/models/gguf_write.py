"""Writing GGUF files, and copying from one: gguf-py's writer (and, for
copying metadata with its exact value types, gguf-py's reader), beside the
C core's reader (edgespec.models.gguf). Used by the MoE tools
(edgespec.moe), the drafter trainer and its trimmed tokenizer.

    with gguf_output(path) as tmp:                    # written whole or not at all
        write_gguf(tmp, "llama", keys, tensors, data, progress)

gguf-py is imported on use (the ``train`` and ``test`` extras bring it).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ..errors import InvalidArgumentError, ModelFormatError, ModelNotFoundError
from ..files import atomic_output
from ..progress import Progress


def gguf_module():
    """gguf-py, imported on use, like the commands that need it."""
    import gguf

    return gguf


def read_gguf(path: os.PathLike | str):
    """gguf-py's reader of ``path``, for copying: ModelNotFoundError or one
    ModelFormatError line for a missing or unreadable file."""
    gguf = gguf_module()
    if not Path(path).is_file():
        raise ModelNotFoundError(f"{path}: no such file")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, struct.error, ... on a bad file
        raise ModelFormatError(f"{path}: not a readable GGUF file ({e})"[:300]) from None


def field_value(field):
    """A reader field's value as GGUFWriter.add_key_value takes it (strings
    as bytes, so tokens that are not valid UTF-8 survive the copy)."""
    gguf = gguf_module()
    main = field.types[0]
    if main == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]])
    if main == gguf.GGUFValueType.ARRAY and field.types[-1] == gguf.GGUFValueType.STRING:
        return [bytes(field.parts[i]) for i in field.data]
    return field.contents()


def copy_keys(reader, writer, keep: Callable[[str], bool] = lambda key: True,
              rename: Callable[[str], str] = lambda key: key) -> None:
    """The metadata of ``reader`` (a gguf.GGUFReader) that ``keep`` accepts,
    onto ``writer`` under the name ``rename`` gives: all but the header's
    counts and the architecture, which the writer sets."""
    gguf = gguf_module()
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == gguf.Keys.General.ARCHITECTURE or not keep(key):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(rename(key), field_value(field), field.types[0], sub_type)


def raw_tensor(t) -> np.ndarray:
    """A reader tensor's bytes, (rows..., bytes per row) as uint8."""
    data = np.asarray(t.data)
    return data.view(np.uint8).reshape(*data.shape[:-1], -1)


@contextmanager
def gguf_output(path: os.PathLike | str) -> Iterator[Path]:
    """A temporary path for a GGUF written whole or not at all (files.atomic_output),
    its folder checked first (InvalidArgumentError naming it)."""
    path = Path(path)
    if not path.parent.is_dir():
        raise InvalidArgumentError(f"{path.parent}: no such folder")
    with atomic_output(path) as tmp:
        yield tmp


def write_gguf(path: Path, arch: str, keys: Callable, tensors: list[tuple[str, tuple, int, int]],
               data: Iterator[np.ndarray], progress: Progress) -> None:
    """Streams a GGUF: ``keys(writer)`` adds the metadata; ``tensors`` lists
    (name, numpy shape, ggml type, bytes) and ``data`` yields each one's
    array in that order."""
    gguf = gguf_module()
    w = gguf.GGUFWriter(str(path), arch)
    try:
        keys(w)
        for name, shape, qtype, nbytes in tensors:
            if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                dtype = np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.float16
            else:  # raw bytes: the writer takes the shape in bytes per row
                dtype, shape = np.uint8, (*shape[:-1], row_bytes(qtype, shape[-1]))
            w.add_tensor_info(name, shape, np.dtype(dtype), nbytes, raw_dtype=gguf.GGMLQuantizationType(qtype))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for (name, _, _, nbytes), arr in zip(tensors, data):
            w.write_tensor_data(np.ascontiguousarray(arr))
            progress.update(nbytes)
    finally:
        w.close()
    progress.done()


def row_bytes(qtype: int, n: int) -> int:
    """Bytes of a row of ``n`` values of ggml type ``qtype``."""
    gguf = gguf_module()
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    if n % block:
        raise InvalidArgumentError(f"rows of {n} values are not a multiple of the "
                                   f"{gguf.GGMLQuantizationType(qtype).name} block of {block}")
    return n // block * size


def quantize(w: np.ndarray, qtype: int) -> np.ndarray:
    """Floats (..., n) as ``qtype``: F32/F16 as numpy floats, other types as
    raw bytes (..., bytes per row)."""
    gguf = gguf_module()
    q = gguf.GGMLQuantizationType(qtype)
    if q == q.F32:
        return w.astype(np.float32)
    if q == q.F16:
        return w.astype(np.float16)
    try:
        return gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), q)
    except NotImplementedError:
        raise InvalidArgumentError(f"cannot write weights of type {q.name} "
                                   "(f32, f16, q4_0, q4_1, q5_0, q5_1, q8_0)") from None
