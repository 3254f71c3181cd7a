"""Engine.embed: one vector per input from the hidden states after the final
norm, pooled as the model's metadata says (mean by default), on the llama and
native backends; evaluated apart from the generation KV cache."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec import Engine
from edgespec.errors import ContextOverflowError, InvalidArgumentError, UnsupportedModelError

TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b",
         "Hello", "Paris is the capital of France, and Berlin is the capital of Germany."]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.fixture(scope="module", params=["llama", "native"])
def engine(request, tiny_llama_path):
    with Engine(str(tiny_llama_path), backend=request.param, threads=1, n_ctx=256, n_batch=64) as e:
        yield e


def test_shape_unit_length_and_determinism(engine):
    v = engine.embed(TEXTS)
    assert v.shape == (len(TEXTS), engine.backend.n_embd) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-5)
    assert np.array_equal(v, engine.embed(TEXTS))
    # distinct texts, distinct vectors
    assert cosine(v[0], v[2]) < 0.999


def test_a_string_a_token_list_and_a_batch_agree(engine):
    batch = engine.embed(TEXTS)
    alone = engine.embed(TEXTS[1])
    assert alone.shape == (1, engine.backend.n_embd)
    tokens = engine.embedding_inputs(TEXTS[1])[0]
    assert np.array_equal(engine.embed(tokens), alone)
    assert np.array_equal(engine.embed([tokens]), alone)
    if engine.backend.name == "native":   # batch invariant: bit-identical in any batch
        assert np.array_equal(batch[1], alone[0])
    else:
        assert np.allclose(batch[1], alone[0], atol=1e-4)


def test_mean_of_the_token_states_unnormalized(engine):
    tokens = engine.embedding_inputs(TEXTS[0])[0]
    states = engine.backend.hidden_states([tokens])[0]
    assert states.shape == (len(tokens), engine.backend.n_embd)
    raw = engine.embed(TEXTS[0], normalize=False)[0]
    assert np.allclose(raw, states.mean(axis=0), atol=1e-5)


def test_an_input_longer_than_a_batch_goes_in_chunks(engine, tiny_llama_path):
    text = " ".join(f"word{i}" for i in range(60))
    n = len(engine.embedding_inputs(text)[0])
    assert n > engine.backend.n_batch
    chunked = engine.embed(text)
    with Engine(str(tiny_llama_path), backend=engine.backend.name, threads=1, n_ctx=256, n_batch=256) as whole:
        one_batch = whole.embed(text)
    if engine.backend.name == "native":
        assert np.array_equal(chunked, one_batch)
    else:
        assert cosine(chunked[0], one_batch[0]) > 0.9999


def test_the_generation_cache_is_left_alone(engine):
    prompt = "Once upon a time there was a"
    first = engine.generate(prompt, max_tokens=4, temperature=0)
    engine.embed(TEXTS)
    again = engine.generate(prompt, max_tokens=4, temperature=0)
    assert again.stats.cached_tokens == again.stats.prompt_tokens - 1
    assert again.tokens == first.tokens


def test_pooling_follows_the_model_metadata(engine, monkeypatch):
    tokens = engine.embedding_inputs(TEXTS[3])[0]
    states = engine.backend.hidden_states([tokens])[0]
    metadata = engine.backend.metadata

    def with_pooling(value):
        monkeypatch.setattr(engine.backend, "metadata",
                            lambda key: value if key.endswith(".pooling_type") else metadata(key))

    with_pooling("3")   # last
    assert engine.pooling == "last"
    assert np.allclose(engine.embed(TEXTS[3], normalize=False)[0], states[-1], atol=1e-6)
    with_pooling("2")   # cls: the first token
    assert np.allclose(engine.embed(TEXTS[3], normalize=False)[0], states[0], atol=1e-6)
    with_pooling("4")   # rank: a reranker's head, not an embedding
    with pytest.raises(UnsupportedModelError, match="pooling type 4"):
        engine.embed("x")


@pytest.mark.parametrize("bad, error", [
    ([], InvalidArgumentError), ("", InvalidArgumentError), (["ok", ""], InvalidArgumentError),
    ([[1, 2, 10**6]], InvalidArgumentError), ([[]], InvalidArgumentError), (42, InvalidArgumentError),
    ("word " * 400, ContextOverflowError)])
def test_bad_input_is_one_typed_error(engine, bad, error):
    with pytest.raises(error):
        engine.embed(bad)


def test_native_and_llama_agree_on_the_tiny_model(tiny_llama_path):
    with Engine(str(tiny_llama_path), backend="llama", threads=1, n_ctx=256) as a, \
         Engine(str(tiny_llama_path), backend="native", threads=1, n_ctx=256) as b:
        assert (cosine(a.embed(TEXTS), b.embed(TEXTS)) > 0.999).all()


def test_native_and_llama_agree_on_smollm2(smollm2_path):
    with Engine(str(smollm2_path), backend="llama", threads=2, n_ctx=512) as a, \
         Engine(str(smollm2_path), backend="native", threads=2, n_ctx=512) as b:
        va, vb = a.embed(TEXTS), b.embed(TEXTS)
    assert va.shape == vb.shape == (len(TEXTS), 576)
    assert (cosine(va, vb) > 0.99).all()
