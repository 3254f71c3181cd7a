"""The llama.cpp backend's evaluation contracts that exact verification rests
on: batched rows equal token-by-token rows (while the KV cache holds at most
256 cells: past that llama.cpp's single-token flash attention splits the KV
range over threads and rounds differently), draft trees give every node the
logits of its own path, and dropping a tree leaves the cache as a plain chain
would."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from edgespec.backends import open_backend


@pytest.fixture(scope="module")
def backend(smollm2_path):
    with open_backend("llama", smollm2_path, n_ctx=1024, threads=2, n_seq=8) as b:
        yield b


def rows(backend, addr, n):
    return np.ctypeslib.as_array((ctypes.c_float * (n * backend.n_vocab)).from_address(addr)
                                 ).reshape(n, backend.n_vocab).copy()


@pytest.fixture(scope="module")
def text(backend):
    return backend.tokenize("The history of the printing press begins in China, where " * 20)[:200]


@pytest.mark.parametrize("k", [2, 4, 8])
def test_batched_rows_equal_single_token_rows(backend, text, k):
    base = 100
    backend.clear()
    backend.decode(text[:base])
    singles = [rows(backend, backend.decode([text[base + i]]), 1)[0] for i in range(k)]
    backend.clear()
    backend.decode(text[:base])
    batch = rows(backend, backend.decode(text[base:base + k], logits_from=0), k)
    for i in range(k):
        assert np.array_equal(batch[i], singles[i])


def test_tree_rows_and_drop_tree(backend, text):
    base = 60
    prefix, root = text[:base], text[base]
    a, b, c = text[base + 1:base + 4]
    x, y = 1234, 4321  # an off-text branch
    tokens, parents = [a, x, b, y, c], [-1, -1, 0, 1, 2]

    backend.clear()
    backend.decode(prefix)
    tree = rows(backend, backend.decode_tree([root], tokens, parents, [1, 1, 2, 2, 3]), 6)
    backend.drop_tree()
    assert backend.n_past == base + 1
    # after the drop the cache holds the prefix and the root: the accepted
    # path is evaluated again, as the engine does with its next batch
    after = rows(backend, backend.decode([a, b, c], logits_from=0), 3)

    backend.clear()
    backend.decode(prefix)
    chain = rows(backend, backend.decode([root, a, b, c], logits_from=0), 4)
    backend.clear()
    backend.decode(prefix)
    other = rows(backend, backend.decode([root, x, y], logits_from=0), 3)

    assert np.array_equal(tree[0], chain[0])     # root
    assert np.array_equal(tree[1], chain[1])     # a
    assert np.array_equal(tree[3], chain[2])     # b
    assert np.array_equal(tree[5], chain[3])     # c
    assert np.array_equal(tree[2], other[1])     # x
    assert np.array_equal(tree[4], other[2])     # y
    assert np.array_equal(after, chain[1:])


def test_truncate_rolls_back(backend, text):
    backend.clear()
    backend.decode(text[:50])
    ref = rows(backend, backend.decode([text[50]]), 1)[0]
    backend.decode([7, 8, 9], logits_from=0)  # a rejected draft
    backend.truncate(50)
    again = rows(backend, backend.decode([text[50]]), 1)[0]
    assert np.array_equal(ref, again)
