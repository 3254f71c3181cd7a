"""Target features out of the native engine (NativeBackend.keep_features /
features): beside the logits of an evaluation, the hidden states after the
final norm of the same rows, the input a draft head (EAGLE's) reads.

On the tiny llama, qwen2 and gemma3 and a Q4_K qwen2 (the repacked tile
kernels): the features of a decode equal the embeddings pass's states of the
same tokens bit for bit, after a cache and from logits_from, for a draft
tree's root and nodes and for each slot of a group evaluation; a row's
features do not depend on the batch it was in; the logits are those of an
evaluation without features; none are given before they are asked for."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from edgespec.backends import open_backend
from edgespec.backends.base import GroupStep
from edgespec.errors import InvalidArgumentError
from tiny_gguf import write_tiny_qwen2

TEXT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"


@pytest.fixture(scope="module")
def tiny_q4k_qwen2_path(tmp_path_factory, tiny_vocab_path):
    path = tmp_path_factory.mktemp("features") / "qwen2-q4k.gguf"
    write_tiny_qwen2(path, tiny_vocab_path, n_layer=1, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                     dtype=Q.Q4_K)
    return path


@pytest.fixture(scope="module", params=["tiny_llama_path", "tiny_qwen2_path", "tiny_gemma3_path",
                                        "tiny_q4k_qwen2_path"])
def backend(request):
    with open_backend("native", request.getfixturevalue(request.param), n_ctx=256, n_batch=32,
                      threads=1, slots=2) as b:
        b.keep_features()
        yield b


@pytest.fixture(scope="module")
def tokens(backend):
    return backend.tokenize(TEXT)[:28]


@pytest.fixture(scope="module")
def states(backend, tokens):
    """The embeddings pass's (len(tokens), n_embd) hidden states."""
    return backend.hidden_states([tokens])[0]


def logits(b, address: int, n: int) -> np.ndarray:
    buf = (ctypes.c_float * (n * b.n_vocab)).from_address(address)
    return np.ctypeslib.as_array(buf).reshape(n, b.n_vocab).copy()


def test_features_of_a_decode_equal_the_embeddings_pass(backend, tokens, states):
    backend.clear()
    backend.decode(tokens, logits_from=0)
    f = backend.features()
    assert f.shape == (len(tokens), backend.n_embd) and f.dtype == np.float32
    assert np.array_equal(f, states)
    assert f.std() > 0
    # After a cache, from logits_from: the rows whose logits were kept.
    backend.clear()
    backend.decode(tokens[:10])
    assert np.array_equal(backend.features(), states[9:10])
    backend.decode(tokens[10:16], logits_from=2)
    assert np.array_equal(backend.features(), states[12:16])


def test_features_of_a_tree_are_those_of_each_nodes_path(backend, tokens, states):
    backend.clear()
    backend.decode(tokens[:10])
    decoy = (tokens[11] + 1) % backend.n_vocab
    # Below the root tokens[10]: tokens[11] and a decoy sibling, tokens[12] under tokens[11].
    backend.decode_tree([tokens[10]], [tokens[11], decoy, tokens[12]], [-1, -1, 0], [1, 1, 2])
    f = backend.features()
    assert f.shape == (4, backend.n_embd)
    assert np.array_equal(f[[0, 1, 3]], states[10:13])
    assert not np.array_equal(f[2], states[11])
    backend.drop_tree()


@pytest.mark.parametrize("size", [1, 3, 5, 8])
def test_a_rows_features_do_not_depend_on_its_batch(backend, tokens, states, size):
    backend.clear()
    rows = []
    for i in range(0, len(tokens), size):
        backend.decode(tokens[i:i + size], logits_from=0)
        rows.append(backend.features())
    assert np.array_equal(np.concatenate(rows), states)


def test_features_of_each_slot_in_a_group(backend, tokens, states):
    for slot, cached in ((0, 6), (1, 13)):
        backend.use_slot(slot)
        backend.clear()
        backend.decode(tokens[:cached])
    # Slot 0: a chain of 4 after its root; slot 1: a tree (a decoy beside tokens[14]).
    decoy = (tokens[14] + 1) % backend.n_vocab
    backend.decode_group([GroupStep(0, [tokens[6]], tokens[7:11]),
                          GroupStep(1, [tokens[13]], [tokens[14], decoy], [-1, -1], [1, 1])])
    assert np.array_equal(backend.features(0), states[6:11])
    assert np.array_equal(backend.features(1)[:2], states[13:15])
    backend.drop_tree()   # slot 1's tree (the group left it selected)
    backend.use_slot(0)


def test_logits_are_unchanged_by_keeping_features(backend, tokens):
    backend.clear()
    with_features = logits(backend, backend.decode(tokens, logits_from=0), len(tokens))
    backend.keep_features(False)
    try:
        backend.clear()
        plain = logits(backend, backend.decode(tokens, logits_from=0), len(tokens))
        with pytest.raises(InvalidArgumentError, match="keep_features"):
            backend.features()
    finally:
        backend.keep_features()
    assert np.array_equal(with_features, plain)


def test_features_not_kept_until_asked(tiny_llama_path):
    with open_backend("native", tiny_llama_path, n_ctx=64, threads=1) as b:
        b.decode(b.tokenize("Hello there"))
        with pytest.raises(InvalidArgumentError, match="keep_features"):
            b.features()
        b.keep_features()
        with pytest.raises(InvalidArgumentError, match="slot 3"):
            b.features(3)
