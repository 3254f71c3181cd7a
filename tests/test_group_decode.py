"""Backend.decode_group (edgespec.backends.base, native's es_decode_group):
several slots' steps in one batch give each slot the rows and the cache its
own decode / decode_tree gives, bit for bit, on the tiny generated models of
every native architecture; refusals leave every slot as it was; a backend
that cannot group says so."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from edgespec.backends import GroupStep, open_backend
from edgespec.errors import ContextOverflowError, InvalidArgumentError, UnsupportedModelError

N_CTX, N_BATCH, SLOTS = 96, 32, 4
TEXT = "The lighthouse keeper climbed the narrow stairs every evening to light the lamp. " * 3


def rows(b, address: int, n: int) -> np.ndarray:
    buf = (ctypes.c_float * (n * b.n_vocab)).from_address(address)
    return np.ctypeslib.as_array(buf).reshape(n, b.n_vocab).copy()


# gemma3 (heads of 32) also over a q8_0 KV cache: its sliding window read from q8_0 cells.
@pytest.fixture(params=["tiny_llama_path", "tiny_qwen2_path", "tiny_gemma3_path", "tiny_gemma3_path:q8_0"])
def backend(request):
    fixture, _, cache = request.param.partition(":")
    types = {"cache_type_k": cache, "cache_type_v": cache} if cache else {}
    with open_backend("native", request.getfixturevalue(fixture), n_ctx=N_CTX, n_batch=N_BATCH,
                      threads=2, slots=SLOTS, **types) as b:
        yield b


def steps_for(text: list[int], n: int) -> list[GroupStep]:
    """n slots' steps: different prefixes, pending lengths and drafts; slot
    2's draft is a tree."""
    plans = [  # (prefix, pending, draft, parents)
        (text[0:9], text[9:10], text[10:14], None),
        (text[20:23], text[23:26], [], None),
        (text[30:37], text[37:38], [text[38], text[5], text[39], text[40]], [-1, -1, 0, 2]),
        (text[41:42], text[42:43], text[43:45], None),
    ]
    return [(slot, *plan) for slot, plan in enumerate(plans[:n])]


def fill(b, plans) -> None:
    for slot, prefix, *_ in plans:
        b.select_slot(slot)
        b.clear()
        b.decode(prefix)


def _depths(parents: list[int]) -> list[int]:
    depths = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def alone(b, plans) -> list[np.ndarray]:
    """Each slot's step by its own decode / decode_tree: its rows."""
    out = []
    for slot, prefix, pending, draft, parents in plans:
        b.select_slot(slot)
        if parents is None:
            out.append(rows(b, b.decode(pending + draft, logits_from=len(pending) - 1), len(draft) + 1))
        else:
            out.append(rows(b, b.decode_tree(pending, draft, parents, _depths(parents)), len(draft) + 1))
    return out


def group_steps(plans) -> list[GroupStep]:
    return [GroupStep(slot, pending, draft, parents, _depths(parents) if parents is not None else None)
            for slot, prefix, pending, draft, parents in plans]


def next_rows(b, plans, token: int) -> list[np.ndarray]:
    """After a step: each slot's tree dropped, its record, and the row of one
    more token (read from the cells the step wrote)."""
    out = []
    for slot, *_ in plans:
        b.select_slot(slot)
        b.drop_tree()
        record = b.cached_tokens
        out.append((record, rows(b, b.decode([token]), 1)))
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_a_group_gives_each_slot_its_own_rows_and_cache(backend, n):
    b = backend
    text = b.tokenize(TEXT)[:48]
    plans = steps_for(text, n)
    fill(b, plans)
    want = alone(b, plans)
    want_next = next_rows(b, plans, text[47])

    fill(b, plans)
    addresses = b.decode_group(group_steps(plans))
    got = [rows(b, address, len(plan[3]) + 1) for address, plan in zip(addresses, plans)]
    got_next = next_rows(b, plans, text[47])
    for (slot, prefix, pending, draft, parents), g, w, (record, row), (want_record, want_row) in zip(
            plans, got, want, got_next, want_next):
        np.testing.assert_array_equal(g, w)
        assert record == want_record == prefix + pending + (draft if parents is None else [])
        np.testing.assert_array_equal(row, want_row)


def test_group_refusals_leave_every_slot_as_it_was(backend):
    b = backend
    text = b.tokenize(TEXT)[:48]
    fill(b, steps_for(text, 2))
    b.select_slot(1)
    b.decode([text[0]] * (N_CTX - b.n_past - 1))   # one cell left
    before = [b.slot_tokens(slot) for slot in range(SLOTS)]
    with pytest.raises(InvalidArgumentError, match="distinct slots"):
        b.decode_group([GroupStep(0, text[:1]), GroupStep(0, text[1:2])])
    with pytest.raises(InvalidArgumentError, match="does not fit one batch of 32"):
        b.decode_group([GroupStep(0, text[:20]), GroupStep(2, text[20:40])])
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        b.decode_group([GroupStep(0, text[:1]), GroupStep(2, [b.n_vocab])])
    with pytest.raises(InvalidArgumentError, match="needs its root token"):
        b.decode_group([GroupStep(0, [])])
    with pytest.raises(InvalidArgumentError, match="outside"):
        b.decode_group([GroupStep(SLOTS, text[:1])])
    with pytest.raises(ContextOverflowError, match="slot 1"):
        b.decode_group([GroupStep(0, text[:1]), GroupStep(1, text[:2])])
    assert [b.slot_tokens(slot) for slot in range(SLOTS)] == before
    for slot in range(SLOTS):
        b.select_slot(slot)
        assert b.n_past == len(before[slot])


def test_a_backend_that_cannot_group_says_so(tiny_llama_path):
    with open_backend("llama", tiny_llama_path, n_ctx=N_CTX, n_batch=N_BATCH, threads=2, slots=2) as b:
        assert not b.groups
        with pytest.raises(UnsupportedModelError, match="one slot at a time"):
            b.decode_group([GroupStep(0, [1]), GroupStep(1, [2])])
