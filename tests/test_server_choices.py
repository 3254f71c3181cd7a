"""``n`` choices per request on /v1/chat/completions and /v1/completions:
each a generation of its own, run at once and batched on a --parallel
engine, queued beyond it; choice i > 0 samples with seed + i."""
from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from edgespec import Engine  # noqa: E402

from test_server_platform import start, stop  # noqa: E402

MSGS = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module", params=[1, 2], ids=["parallel-1", "parallel-2"])
def served(request, tiny_llama_path):
    with Engine(str(tiny_llama_path), threads=1, n_ctx=256, parallel=request.param, drafter="ngram") as e:
        server, thread = start(e)
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120), e
        stop(server, thread)


def test_n_sampled_choices_are_each_seeds_own_generation(served):
    client, engine = served
    r = client.chat.completions.create(model="tiny", messages=MSGS, n=3, max_tokens=12, temperature=0.9, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, c in enumerate(r.choices):
        want = engine.generate(messages=MSGS, max_tokens=12, temperature=0.9, seed=5 + i)
        assert c.message.content == want.text
    assert r.usage.completion_tokens == sum(
        engine.generate(messages=MSGS, max_tokens=12, temperature=0.9, seed=5 + i).stats.n_tokens for i in range(3))
    assert r.usage.prompt_tokens == len(engine.prompt_tokens(messages=MSGS))


def test_n_greedy_choices_are_the_same_text(served):
    client, engine = served
    want = engine.generate("Once upon a time", max_tokens=10, temperature=0).text
    r = client.completions.create(model="tiny", prompt="Once upon a time", n=4, max_tokens=10, temperature=0)
    assert [c.text for c in r.choices] == [want] * 4


def test_n_streamed_choices_are_the_whole_ones(served):
    client, _ = served
    kw = dict(model="tiny", messages=MSGS, n=2, max_tokens=10, temperature=0.9, seed=11)
    whole = client.chat.completions.create(**kw)
    texts, finishes = {0: "", 1: ""}, {}
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert set(finishes) == {0, 1}
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
