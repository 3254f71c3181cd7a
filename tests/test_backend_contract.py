"""The backend contract (edgespec.backends.base), tested once against every
backend with the same cases: appending, chunking with the wanted rows in the
last chunk, rollback, prefix reuse, draft trees, cancellation between chunks,
refusals that leave the cache as it was, and a failed evaluation resynced.

The numbers are each backend's own: rows computed two ways must agree to the
backend's batch tolerance (bit-exact on the native engine, which is batch
invariant by construction)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from edgespec.backends import Interrupted, open_backend
from edgespec.drafters import Draft
from edgespec.errors import ContextOverflowError, EngineClosedError, InvalidArgumentError

N_CTX, N_BATCH = 128, 8
TOLERANCE = {"native": 0.0, "llama": 1e-2, "onnx": 1e-2}  # llama.cpp rounds F16 activations per batch
TEXT = "The lighthouse keeper climbed the narrow stairs every evening to light the lamp. " * 3


@pytest.fixture(params=["llama", "native", "onnx"])
def backend(request, tiny_llama_path):
    path = request.getfixturevalue("tiny_onnx_dir") if request.param == "onnx" else tiny_llama_path
    with open_backend(request.param, path, n_ctx=N_CTX, n_batch=N_BATCH, threads=2, n_seq=8) as b:
        yield b


def rows(b, address: int, n: int) -> np.ndarray:
    buf = (ctypes.c_float * (n * b.n_vocab)).from_address(address)
    return np.ctypeslib.as_array(buf).reshape(n, b.n_vocab).copy()


def close(b, x: np.ndarray, y: np.ndarray) -> None:
    np.testing.assert_allclose(x, y, rtol=0, atol=TOLERANCE[b.name])


@pytest.fixture
def text(backend):
    tokens = backend.tokenize(TEXT)
    assert len(tokens) >= 40
    return tokens[:40]


def one_by_one(b, tokens) -> np.ndarray:
    return np.concatenate([rows(b, b.decode([t]), 1) for t in tokens])


def test_decode_appends_and_keeps_the_record(backend, text):
    b = backend
    assert b.n_past == 0
    first = rows(b, b.decode(text[:5]), 1)
    assert b.n_past == 5 and b.cached_tokens == text[:5]
    more = rows(b, b.decode(text[5:9], logits_from=0), 4)
    assert b.n_past == 9 and b.cached_tokens == text[:9]
    b.clear()
    singles = one_by_one(b, text[:9])
    close(b, first[0], singles[4])
    close(b, more, singles[5:9])


def test_prefill_chunks_keep_the_wanted_rows_together(backend, text):
    b = backend
    tokens = text[:20]
    singles = one_by_one(b, tokens)
    b.clear()
    close(b, rows(b, b.decode(tokens), 1)[0], singles[-1])       # 3 chunks, the last row
    b.clear()
    close(b, rows(b, b.decode(tokens, logits_from=13), 7), singles[13:])  # rows across the n_batch grid
    b.clear()
    with pytest.raises(InvalidArgumentError, match="12 logits rows do not fit one batch of 8"):
        b.decode(tokens, logits_from=8)
    assert b.n_past == 0


def test_truncate_rolls_back_exactly_what_was_dropped(backend, text):
    b = backend
    a, c = text[:12], text[20:26]
    fresh = rows(b, b.decode(a + c, logits_from=len(a)), len(c))
    b.clear()
    b.decode(a + text[12:20])
    b.truncate(len(a))
    assert b.cached_tokens == a
    close(b, rows(b, b.decode(c, logits_from=0), len(c)), fresh)
    b.truncate(1000)  # keeping more than the cache holds keeps everything
    assert b.n_past == len(a) + len(c)
    with pytest.raises(InvalidArgumentError):
        b.truncate(-1)


def test_reuse_prefix_keeps_the_common_part_and_evaluates_the_last_token(backend, text):
    b = backend
    b.decode(text[:16])
    assert b.reuse_prefix(text[:10] + text[30:35]) == 10
    assert b.cached_tokens == text[:10]
    b.decode(text[10:16])
    assert b.reuse_prefix(text[:16]) == 15          # the last token is evaluated again
    assert b.reuse_prefix(text[:16] + text[16:20]) == 15
    assert b.reuse_prefix(text[20:30]) == 0 and b.n_past == 0


def test_tree_rows_equal_chain_rows_and_drop_tree_keeps_the_pending_tokens(backend, text):
    b = backend
    prefix, root, (x, y, z) = text[:20], text[20], text[21:24]
    decoy = 7 if x != 7 else 8
    nodes, parents = [decoy, x, y, z], [-1, -1, 1, 2]   # a decoy sibling, the true path x y z
    b.decode(prefix[:-3])
    tree = rows(b, b.decode_tree(prefix[-3:] + [root], nodes, parents, Draft(nodes, parents).node_depths()), 5)
    b.drop_tree()
    assert b.cached_tokens == prefix + [root]
    after = rows(b, b.decode([x, y, z], logits_from=0), 3)
    b.clear()
    b.decode(prefix)
    chain = rows(b, b.decode([root, x, y, z], logits_from=0), 4)
    close(b, tree[0], chain[0])
    close(b, tree[2], chain[1])
    close(b, tree[3], chain[2])
    close(b, tree[4], chain[3])
    close(b, after, chain[1:])


def test_a_next_call_drops_an_undropped_tree(backend, text):
    b = backend
    b.decode(text[:10])
    b.decode_tree([text[10]], [text[11], text[12]], [-1, 0], [1, 2])
    ref = rows(b, b.decode([text[11]]), 1)   # settles the tree first
    assert b.cached_tokens == text[:12]
    b.clear()
    close(b, ref, rows(b, b.decode(text[:12]), 1))


def test_cancel_between_chunks_keeps_what_was_evaluated(backend, text):
    b = backend
    calls = []

    def cancel():
        calls.append(1)
        return len(calls) == 2   # stop after the second chunk

    with pytest.raises(Interrupted):
        b.decode(text[:30], cancel=cancel)
    assert b.cached_tokens == text[:2 * N_BATCH]
    resumed = rows(b, b.decode(text[2 * N_BATCH:30]), 1)
    b.clear()
    close(b, resumed, rows(b, b.decode(text[:30]), 1))


def test_refusals_leave_the_cache_as_it_was(backend, text):
    b = backend
    b.decode(text[:10])
    with pytest.raises(InvalidArgumentError, match="empty"):
        b.decode([])
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        b.decode([1, b.n_vocab])
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        b.decode([-1])
    with pytest.raises(ContextOverflowError):
        b.decode(text[:8] * (b.n_ctx // 8))   # n_ctx: llama.cpp rounds it up
    with pytest.raises(ContextOverflowError):
        b.decode_tree([text[10]], list(text[11:21]), list(range(-1, 9)), list(range(1, 11)))
    assert b.cached_tokens == text[:10]


def test_a_failed_evaluation_is_resynced(backend, text, monkeypatch):
    b = backend
    real, seen = type(b)._evaluate, []

    def failing(self, tokens, positions, parents, logits_from):
        seen.append(len(tokens))
        if len(seen) == 2:
            raise RuntimeError("device lost")
        return real(self, tokens, positions, parents, logits_from)

    monkeypatch.setattr(type(b), "_evaluate", failing)
    with pytest.raises(RuntimeError):
        b.decode(text[:20])
    monkeypatch.undo()
    assert b.cached_tokens == text[:N_BATCH]   # the first chunk stays, the failed one is gone
    resumed = rows(b, b.decode(text[N_BATCH:20]), 1)
    b.clear()
    close(b, resumed, rows(b, b.decode(text[:20]), 1))


def test_calls_after_close_raise(backend, text):
    backend.close()
    backend.close()  # twice is fine
    with pytest.raises(EngineClosedError):
        backend.decode(text[:3])
    with pytest.raises(EngineClosedError):
        backend.truncate(0)
