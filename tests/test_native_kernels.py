"""The native engine's weight types (csrc/quants.c) against the `gguf`
package's numpy reference (gguf.quants.dequantize), on real tensors of the
built-in models: SmolLM2 (Q4_1, Q8_0) and Gemma 3 (Q5_0, Q4_K, Q6_K, Q8_0).

Both compute each value as ggml defines it, in float32 and in the same
order (d * q or d * q + m, with K-quants' sub-block scales d * sc formed
first), so the values must be bit-identical. The tensors are found with
our own GGUF reader (es_gguf_*), which is also much faster than parsing
the 262k-token vocabularies with gguf.GGUFReader."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

ROWS = 48  # rows per tensor: enough blocks of every kind, fast


class Tensor(ctypes.Structure):  # es_tensor, csrc/native.h
    _fields_ = [("name", ctypes.c_char_p), ("type", ctypes.c_int32), ("n_dims", ctypes.c_int32),
                ("ne", ctypes.c_int64 * 4), ("data", ctypes.c_void_p), ("nbytes", ctypes.c_size_t)]


@pytest.fixture(scope="module")
def lib(native_lib_path):
    lib = ctypes.CDLL(str(native_lib_path))
    lib.es_gguf_open.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p,
                                 ctypes.c_size_t]
    lib.es_gguf_close.argtypes = [ctypes.c_void_p]
    lib.es_gguf_n_tensors.argtypes = [ctypes.c_void_p]
    lib.es_gguf_n_tensors.restype = ctypes.c_int64
    lib.es_gguf_tensor_at.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.es_gguf_tensor_at.restype = ctypes.POINTER(Tensor)
    lib.es_dequantize_row.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.es_dequantize_row.restype = None
    lib.es_type_row_bytes.argtypes = [ctypes.c_int32, ctypes.c_int64]
    lib.es_type_row_bytes.restype = ctypes.c_size_t
    return lib


def check_tensors(lib, path, expected_types, per_type=3):
    """Compares the first ROWS rows of up to per_type tensors of each
    quantized type, spread over the file."""
    g = ctypes.c_void_p()
    err = ctypes.create_string_buffer(256)
    assert lib.es_gguf_open(str(path).encode(), ctypes.byref(g), err, len(err)) == 0, err.value
    try:
        by_type: dict[GGMLQuantizationType, list] = {}
        for i in range(lib.es_gguf_n_tensors(g)):
            t = lib.es_gguf_tensor_at(g, i).contents
            if t.type != GGMLQuantizationType.F32:
                by_type.setdefault(GGMLQuantizationType(t.type), []).append(t)
        assert set(by_type) == set(expected_types)
        for qtype, tensors in by_type.items():
            for t in tensors[:: max(1, len(tensors) // per_type)][:per_type]:
                check_tensor(lib, t, qtype)
    finally:
        lib.es_gguf_close(g)


def check_tensor(lib, t, qtype):
    n, rows = t.ne[0], min(ROWS, t.ne[1])
    row_bytes = lib.es_type_row_bytes(int(qtype), n)
    assert row_bytes * t.ne[1] * t.ne[2] * t.ne[3] == t.nbytes, t.name
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * (row_bytes * rows)).from_address(t.data))
    raw = raw.reshape(rows, row_bytes).copy()
    want = dequantize(raw, qtype).reshape(rows, n).astype(np.float32)
    got = np.empty_like(want)
    for r in range(rows):
        lib.es_dequantize_row(int(qtype), raw[r].ctypes.data, got[r].ctypes.data, n)
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, (f"{t.name.decode()} ({qtype.name}): {bad.size} values differ, first at "
                           f"{bad[0]}: {got.flat[bad[0]]!r} vs {want.flat[bad[0]]!r}")


def test_smollm2_types_match_gguf_reference(lib, smollm2_path):
    check_tensors(lib, smollm2_path, {GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0})


def test_gemma3_types_match_gguf_reference(lib, gemma_path):
    check_tensors(lib, gemma_path, {GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q4_K,
                                    GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q8_0})
