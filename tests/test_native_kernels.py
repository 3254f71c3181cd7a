"""The native engine's weight types (csrc/native/kernels/quants.c) on real tensors of the
built-in models: SmolLM2 (Q4_1, Q8_0) and Gemma 3 (Q5_0, Q4_K, Q6_K, Q8_0).

Dequantization is checked against the `gguf` package's numpy reference
(gguf.quants.dequantize); activation quantization and es_matvec against
llama.cpp's own CPU kernels (libggml-cpu from llama-cpp-python), which is
what keeps our logits within rounding of llama.cpp's.

Both compute each value as ggml defines it, in float32 and in the same
order (d * q or d * q + m, with K-quants' sub-block scales d * sc formed
first), so the values must be bit-identical. The tensors are found with
our own GGUF reader (es_gguf_*), which is also much faster than parsing
the 262k-token vocabularies with gguf.GGUFReader."""
from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

import llama_cpp

ROWS = 48  # rows per tensor: enough blocks of every kind, fast


class Tensor(ctypes.Structure):  # es_tensor, csrc/native/es_native.h
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
    lib.es_dequantize_row.restype = ctypes.c_int
    lib.es_type_row_bytes.argtypes = [ctypes.c_int32, ctypes.c_int64]
    lib.es_type_row_bytes.restype = ctypes.c_size_t
    lib.es_act_type.argtypes = [ctypes.c_int32]
    lib.es_act_type.restype = ctypes.c_int32
    lib.es_quantize_act.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.es_quantize_act.restype = None
    lib.es_matvec.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                              ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.es_matvec.restype = None
    lib.es_kernels_name.restype = ctypes.c_char_p
    return lib


@pytest.fixture(scope="module")
def ggml():
    """llama.cpp's CPU backend, for its activation quantization and vec_dot."""
    path = os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-cpu.so")
    ggml = ctypes.CDLL(path)
    ggml.ggml_cpu_init()  # fills ggml's fp16 tables
    for quantize, vec_dot in GGML_KERNELS.values():
        getattr(ggml, quantize).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        # (n, s, bs, x, bx, y, by, nrc)
        getattr(ggml, vec_dot).argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                           ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return ggml


# Weight type -> (ggml's activation quantizer, ggml's vec_dot).
GGML_KERNELS = {
    GGMLQuantizationType.Q4_1: ("quantize_row_q8_1", "ggml_vec_dot_q4_1_q8_1"),
    GGMLQuantizationType.Q5_0: ("quantize_row_q8_0", "ggml_vec_dot_q5_0_q8_0"),
    GGMLQuantizationType.Q8_0: ("quantize_row_q8_0", "ggml_vec_dot_q8_0_q8_0"),
    GGMLQuantizationType.Q4_K: ("quantize_row_q8_K", "ggml_vec_dot_q4_K_q8_K"),
    GGMLQuantizationType.Q6_K: ("quantize_row_q8_K", "ggml_vec_dot_q6_K_q8_K"),
}


def check_tensors(lib, path, expected_types, check=None, per_type=3):
    """Runs check(lib, tensor, qtype) (by default the dequantization check)
    on up to per_type tensors of each quantized type, spread over the file."""
    check = check or check_tensor
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
                check(lib, t, qtype)
    finally:
        lib.es_gguf_close(g)


def first_rows(lib, t, qtype):
    """The first ROWS rows of tensor t as a (rows, row bytes) uint8 array."""
    n, rows = t.ne[0], min(ROWS, t.ne[1])
    row_bytes = lib.es_type_row_bytes(int(qtype), n)
    assert row_bytes * t.ne[1] * t.ne[2] * t.ne[3] == t.nbytes, t.name
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * (row_bytes * rows)).from_address(t.data))
    return raw.reshape(rows, row_bytes).copy()


def check_tensor(lib, t, qtype):
    n, rows = t.ne[0], min(ROWS, t.ne[1])
    raw = first_rows(lib, t, qtype)
    want = dequantize(raw, qtype).reshape(rows, n).astype(np.float32)
    got = np.empty_like(want)
    for r in range(rows):
        assert lib.es_dequantize_row(int(qtype), raw[r].ctypes.data, got[r].ctypes.data, n) == 0
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, (f"{t.name.decode()} ({qtype.name}): {bad.size} values differ, first at "
                           f"{bad[0]}: {got.flat[bad[0]]!r} vs {want.flat[bad[0]]!r}")


def test_smollm2_types_match_gguf_reference(lib, smollm2_path):
    check_tensors(lib, smollm2_path, {GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0})


def test_gemma3_types_match_gguf_reference(lib, gemma_path):
    check_tensors(lib, gemma_path, {GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q4_K,
                                    GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q8_0})


def check_against_ggml(lib, ggml, t, qtype):
    n, raw = t.ne[0], first_rows(lib, t, qtype)
    rows = raw.shape[0]
    act = lib.es_act_type(int(qtype))
    act_bytes = lib.es_type_row_bytes(act, n)
    rng = np.random.default_rng(n + rows)
    x = (rng.standard_normal(n) * 2).astype(np.float32)
    x[rng.integers(n)] = 40.0  # an outlier channel, as real activations have

    ours = np.zeros(act_bytes, np.uint8)
    theirs = np.zeros(act_bytes, np.uint8)
    quantize, vec_dot = GGML_KERNELS[qtype]
    lib.es_quantize_act(int(qtype), x.ctypes.data, ours.ctypes.data, n)
    getattr(ggml, quantize)(x.ctypes.data, theirs.ctypes.data, n)
    if lib.es_kernels_name() in (b"avx512", b"avx2"):  # ggml's x86 quantizer: bit-identical
        assert np.array_equal(ours, theirs), f"{t.name.decode()}: activation quantization differs"

    y = np.zeros(rows, np.float32)
    lib.es_matvec(int(qtype), raw.ctypes.data, ours.ctypes.data, n, 0, rows, y.ctypes.data)
    dot = getattr(ggml, vec_dot)
    want = np.zeros(1, np.float32)
    w = dequantize(raw, qtype).reshape(rows, n).astype(np.float64)
    a = np.zeros(n, np.float32)
    lib.es_dequantize_row(act, ours.ctypes.data, a.ctypes.data, n)
    mag = np.abs(w * a.astype(np.float64)).sum(axis=1)
    for r in range(rows):
        dot(n, want.ctypes.data, 0, raw[r].ctypes.data, 0, ours.ctypes.data, 0, 1)
        # Same integers, float sums grouped differently: within 1e-6 of sum |terms|.
        assert abs(float(y[r]) - float(want[0])) <= 1e-6 * mag[r], (t.name.decode(), r, y[r], want[0])


def test_smollm2_matvec_matches_llama_cpp(lib, ggml, smollm2_path):
    check_tensors(lib, smollm2_path, {GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0},
                  lambda lib, t, q: check_against_ggml(lib, ggml, t, q))


def test_gemma3_matvec_matches_llama_cpp(lib, ggml, gemma_path):
    check_tensors(lib, gemma_path, {GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q4_K,
                                    GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q8_0},
                  lambda lib, t, q: check_against_ggml(lib, ggml, t, q))
