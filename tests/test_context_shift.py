"""Context shift: a generation that fills its context keeps its first n_keep
tokens, drops the oldest half of the rest, evaluates the kept tail again at
its new positions and goes on; speculation stays exact against plain
decoding with the same shift."""
from __future__ import annotations

import pytest

from edgespec import Engine
from edgespec.errors import InvalidArgumentError

N_CTX = 64
PROMPT = "Repeat: red green blue red green blue"


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    with Engine(str(tiny_llama_path), threads=1, n_ctx=N_CTX, drafter="auto") as e:
        yield e


def _greedy(engine, **options):
    """Greedy, the end of generation banned: the tiny random model runs to its limits."""
    return dict(temperature=0, logit_bias={engine.backend.eos_token: float("-inf")}, **options)


def test_without_a_shift_a_full_context_ends_the_generation(engine):
    r = engine.generate(PROMPT, max_tokens=200, **_greedy(engine, drafter="none"))
    assert r.stats.stop_reason == "context" and r.stats.context_shifts == 0
    assert r.stats.prompt_tokens + r.stats.n_tokens == N_CTX


def test_after_a_shift_the_text_goes_on_as_from_the_shifted_context(engine):
    p = len(engine.tokenize(PROMPT))
    after = 12
    r = engine.generate(PROMPT, max_tokens=N_CTX - p + after, **_greedy(engine, drafter="none",
                                                                         context_shift=True, n_keep=2))
    assert r.stats.context_shifts == 1 and r.stats.n_tokens == N_CTX - p + after
    keep = engine.request(PROMPT, context_shift=True, n_keep=2).n_keep
    assert keep == 2 + (engine.tokenize(PROMPT)[0] == engine.backend.bos_token)
    full = engine.tokenize(PROMPT) + r.tokens
    shifted = full[:keep] + full[keep + (N_CTX - keep) // 2:N_CTX]
    # The shifted context evaluated afresh gives the same next tokens: the
    # kept tail was re-positioned, not left at its old positions.
    fresh = engine.generate(shifted, max_tokens=after, **_greedy(engine, drafter="none"))
    assert r.tokens[N_CTX - p:] == fresh.tokens


@pytest.mark.parametrize("drafter", ["ngram", "auto", "recycle"])
def test_speculation_is_exact_across_context_shifts(engine, drafter):
    options = _greedy(engine, context_shift=True, n_keep=4)
    plain = engine.generate(PROMPT, max_tokens=150, drafter="none", **options)
    spec = engine.generate(PROMPT, max_tokens=150, drafter=drafter, **options)
    assert plain.stats.context_shifts >= 3
    assert spec.tokens == plain.tokens and spec.stats.context_shifts == plain.stats.context_shifts


def test_n_keep_minus_one_keeps_the_whole_prompt(engine):
    request = engine.request(PROMPT, context_shift=True, n_keep=-1)
    assert request.n_keep == len(request.prompt_tokens)
    r = engine.generate(PROMPT, max_tokens=100, **_greedy(engine, drafter="none", context_shift=True, n_keep=-1))
    assert r.stats.context_shifts >= 1 and r.stats.n_tokens == 100


@pytest.mark.parametrize("options, match", [
    (dict(context_shift=True, n_keep=-2), "n_keep"),
    (dict(context_shift=True, n_keep=1.5), "n_keep"),
    (dict(context_shift="yes"), "context_shift"),
])
def test_bad_shift_options_are_refused(engine, options, match):
    with pytest.raises(InvalidArgumentError, match=match):
        engine.generate(PROMPT, max_tokens=4, **options)


def test_a_kept_start_that_fills_the_context_is_refused_and_a_large_n_keep_keeps_the_prompt(engine):
    long_prompt = engine.tokenize("word " * 200)[:N_CTX - 2]
    with pytest.raises(InvalidArgumentError, match="nothing to drop"):
        engine.generate(long_prompt, max_tokens=4, context_shift=True, n_keep=-1)
    assert engine.request(PROMPT, context_shift=True, n_keep=10_000).n_keep == len(engine.tokenize(PROMPT))


def test_the_engine_option_sets_the_default(tiny_llama_path):
    with Engine(str(tiny_llama_path), threads=1, n_ctx=N_CTX, context_shift=True) as e:
        r = e.generate(PROMPT, max_tokens=80, **_greedy(e))
        assert r.stats.context_shifts >= 1
        assert e.generate(PROMPT, max_tokens=80, context_shift=False, **_greedy(e)).stats.stop_reason == "context"


def test_serve_context_shift_goes_past_the_context_on_the_openai_api(tiny_llama_path):
    import threading

    openai = pytest.importorskip("openai")
    from edgespec.server import make_server

    with Engine(str(tiny_llama_path), threads=1, n_ctx=N_CTX, context_shift=True) as e:
        server = make_server(e, port=0, quiet=True, model_name="tiny")
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=120, temperature=0,
                                          logit_bias={str(e.backend.eos_token): -100})
        finally:
            server.shutdown()
            server.server_close()
            thread.join(10)
        assert r.usage.completion_tokens == 120 > N_CTX and r.choices[0].finish_reason == "length"
        assert r.choices[0].text == e.generate(PROMPT, max_tokens=120, **_greedy(e)).text
