"""Property tests of the Python API's argument checking: whatever a caller
passes to Engine(...), generate(...), stream(...) or chat(...), the answer is
a Result or a typed EdgespecError naming the problem, never a TypeError,
AttributeError, UnicodeError, a crash, or an engine left unusable."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgespec import Engine
from edgespec.errors import EdgespecError

ANY = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8), st.binary(max_size=8),
    st.lists(st.integers(min_value=-5, max_value=5), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
OPTIONS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
           "seed", "stop", "chat", "drafter")
# Plausible values beside the arbitrary ones, so that some calls succeed.
PLAUSIBLE = {
    "max_tokens": st.integers(min_value=-2, max_value=3),
    "temperature": st.floats(min_value=-1, max_value=3),
    "top_k": st.integers(min_value=-2, max_value=50),
    "top_p": st.floats(min_value=-0.5, max_value=1.5),
    "min_p": st.floats(min_value=-0.5, max_value=1.5),
    "repeat_penalty": st.floats(min_value=-1, max_value=3),
    "repeat_last_n": st.integers(min_value=-2, max_value=128),
    "seed": st.integers(min_value=-1, max_value=2**64),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2)),
    "chat": st.booleans(),
    "drafter": st.sampled_from(["none", "ngram", "recycle", "auto", "model", "nope", ""]),
}
PROMPT = st.one_of(st.text(max_size=40), st.binary(max_size=8), st.none(), st.integers(),
                   st.just("\ud800 lone surrogate"), st.just("Hello there"))
MESSAGES = st.one_of(
    st.none(), st.integers(), st.text(max_size=5),
    st.lists(st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", ""]),
                               "content": st.one_of(st.text(max_size=20), st.none(), st.integers(),
                                                    st.just("\udfff"))}),
        st.dictionaries(st.text(max_size=4), ANY, max_size=2), ANY), max_size=3),
)


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    with Engine(str(tiny_llama_path), threads=1, n_ctx=256, draft_max=4) as e:
        yield e


def _options(data) -> dict:
    chosen = data.draw(st.lists(st.sampled_from(OPTIONS), unique=True, max_size=5))
    return {name: data.draw(st.one_of(PLAUSIBLE[name], ANY)) for name in chosen}


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                            HealthCheck.too_slow])


@SETTINGS
@given(data=st.data(), prompt=PROMPT, messages=MESSAGES)
def test_generate_answers_or_raises_a_typed_error(engine, data, prompt, messages):
    options = _options(data)
    options.setdefault("max_tokens", 2)
    if isinstance(options["max_tokens"], int) and options["max_tokens"] > 3:
        options["max_tokens"] = 3
    use_messages = data.draw(st.booleans())
    try:
        if use_messages:
            result = engine.chat(messages, **options)
        else:
            result = engine.generate(prompt, **options)
    except EdgespecError as e:
        assert str(e) and "\n" not in str(e).strip()
    else:
        assert isinstance(result.text, str) and len(result.tokens) <= 3
    # whatever happened, the engine still works
    assert engine.generate("Hello", max_tokens=1).stats.n_tokens == 1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(threads=st.one_of(st.integers(min_value=-3, max_value=10**6), ANY),
       n_ctx=st.one_of(st.integers(min_value=-3, max_value=2**40), ANY),
       n_batch=st.one_of(st.integers(min_value=-3, max_value=4096), ANY),
       gpu_layers=st.one_of(st.integers(min_value=-3, max_value=100), ANY),
       draft_max=st.one_of(st.integers(min_value=-3, max_value=100), ANY),
       drafter=st.one_of(st.sampled_from(["none", "ngram", "auto", "model", "x"]), ANY))
def test_engine_options_are_checked_before_anything_is_allocated(tiny_llama_path, threads, n_ctx, n_batch,
                                                                 gpu_layers, draft_max, drafter):
    try:
        engine = Engine(str(tiny_llama_path), threads=threads, n_ctx=n_ctx, n_batch=n_batch,
                        gpu_layers=gpu_layers, draft_max=draft_max, drafter=drafter)
    except EdgespecError as e:
        assert str(e) and "\n" not in str(e).strip()
    else:
        with engine:
            assert engine.generate("Hi", max_tokens=1).stats.n_tokens == 1
