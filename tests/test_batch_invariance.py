"""Batch invariance of the native engine over every quantized weight type:
a token's logits are bit-identical whether it is decoded alone or in a batch
of any size from 2 to 16 (the shapes speculative verification and draft
trees produce), and whatever the number of threads (1 to 4); and, in every
kernel set this CPU runs, whether the weights are repacked at load (the
default: the tile kernels, kept in the cache between loads; or at every
load, EDGESPEC_REPACK=memory) or not (EDGESPEC_REPACK=0); and over a q8_0
KV cache as over the default f16 one.

Each type gets a one-layer random qwen2 (QKV biases) 256 wide, so that the
K-quants' 256-element super-blocks fit, over the generated tokenizer; the
kernels run in the best set this CPU has (the C tests hold each set against
the scalar one and against float64)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from edgespec.backends import open_backend
from edgespec.capi import ffi, lib
from edgespec.errors import InvalidArgumentError
from tiny_gguf import write_tiny_qwen2

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K]
TEXT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
BATCHES = [2, 3, 4, 5, 7, 8, 9, 16]


@pytest.fixture(scope="module", params=TYPES, ids=lambda q: q.name)
def quantized_qwen2(request, tmp_path_factory, tiny_vocab_path):
    path = tmp_path_factory.mktemp("invariance") / f"qwen2-{request.param.name}.gguf"
    write_tiny_qwen2(path, tiny_vocab_path, n_layer=1, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                     dtype=request.param)
    return path


def logits(b, addr: int, n: int) -> np.ndarray:
    buf = (ctypes.c_float * (n * b.n_vocab)).from_address(addr)
    return np.ctypeslib.as_array(buf).reshape(n, b.n_vocab).copy()


def in_batches(b, tokens: list[int], size: int) -> np.ndarray:
    b.clear()
    out = [logits(b, b.decode(tokens[i:i + size], logits_from=0), len(tokens[i:i + size]))
           for i in range(0, len(tokens), size)]
    return np.concatenate(out)


def test_logits_equal_for_every_batch_size_and_thread_count(quantized_qwen2):
    with open_backend("native", quantized_qwen2, n_ctx=128, threads=1) as b:
        tokens = b.tokenize(TEXT)[:40]
        alone = in_batches(b, tokens, 1)
    assert np.isfinite(alone).all() and alone.std() > 0
    for threads in (1, 2, 3, 4):
        with open_backend("native", quantized_qwen2, n_ctx=128, threads=threads) as b:
            for size in BATCHES if threads == 1 else [1, *BATCHES]:
                got = in_batches(b, tokens, size)
                assert np.array_equal(got, alone), f"{threads} threads, batches of {size}"


def test_logits_equal_for_every_batch_size_over_a_q8_0_kv_cache(tmp_path, tiny_vocab_path):
    """A q8_0 cache's rows are quantized one by one and read in ascending
    cell order: its logits are as batch invariant as the f16 cache's."""
    path = tmp_path / "qwen2-q8-cache.gguf"
    write_tiny_qwen2(path, tiny_vocab_path, n_layer=1, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                     dtype=Q.Q4_K)   # heads of 64: two Q8_0 blocks a cache row
    q8 = {"cache_type_k": "q8_0", "cache_type_v": "q8_0"}
    with open_backend("native", path, n_ctx=128, threads=1, **q8) as b:
        tokens = b.tokenize(TEXT)[:40]
        alone = in_batches(b, tokens, 1)
    assert np.isfinite(alone).all() and alone.std() > 0
    for threads in (1, 3):
        with open_backend("native", path, n_ctx=128, threads=threads, **q8) as b:
            for size in BATCHES:
                assert np.array_equal(in_batches(b, tokens, size), alone), f"{threads} threads, batches of {size}"


def kernel_sets() -> list[str]:
    return [ffi.string(lib.es_kernels_available(i)).decode() for i in range(4)
            if lib.es_kernels_available(i) != ffi.NULL]


def test_logits_equal_repacked_or_not_in_every_kernel_set(quantized_qwen2, monkeypatch):
    """Tile kernels over the repacked weights and the kernels over the rows
    as they are compute the same per-token arithmetic: the logits are
    bit-identical, in every kernel set (across sets attention's F16 dot
    products differ in rounding)."""
    for kernels in kernel_sets():
        logits = {}
        for repack in ("1", "memory", "0"):
            monkeypatch.setenv("EDGESPEC_KERNELS", kernels)
            monkeypatch.setenv("EDGESPEC_REPACK", repack)
            with open_backend("native", quantized_qwen2, n_ctx=128, threads=2) as b:
                logits[repack] = in_batches(b, b.tokenize(TEXT)[:24], 8)
        assert np.array_equal(logits["1"], logits["0"]) and np.array_equal(logits["memory"], logits["0"]), kernels


def test_repack_setting_is_checked(quantized_qwen2, monkeypatch):
    monkeypatch.setenv("EDGESPEC_REPACK", "yes")
    with pytest.raises(InvalidArgumentError, match="EDGESPEC_REPACK=yes: 1 repacks"):
        open_backend("native", quantized_qwen2, n_ctx=64)
