"""Batch invariance of the native engine over every quantized weight type:
a token's logits are bit-identical whether it is decoded alone or in a batch
of any size from 2 to 16 (the shapes speculative verification and draft
trees produce), and whatever the number of threads (1 to 4).

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
