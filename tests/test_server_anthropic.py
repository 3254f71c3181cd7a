"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through
the official ``anthropic`` SDK, on the tiny random llama: answers are
compared with the engine's own greedy chat replies, tool calls validated
against their schemas, refusals in Anthropic's error shape."""
from __future__ import annotations

import json

import jsonschema
import pytest

anthropic = pytest.importorskip("anthropic")

from edgespec import Engine  # noqa: E402

from test_grammar import TAGS_TEMPLATE, TOOLS  # noqa: E402
from test_server_platform import request, start, stop  # noqa: E402

MSGS = [{"role": "user", "content": "Weather in Paris?"}]
GREEDY = {"temperature": 0}
# The SDK has no temperature argument any more (Anthropic's API sets it per model): sent as a body field.
SDK_GREEDY = {"extra_body": GREEDY}
TOOLS_ANTHROPIC = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    with Engine(str(tiny_llama_path), threads=1, n_ctx=2048, ctx_extend=True, drafter="ngram") as e:
        e.chat_template = TAGS_TEMPLATE
        yield e


@pytest.fixture(scope="module")
def server(engine):
    server, thread = start(engine)
    yield server
    stop(server, thread)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def test_a_message_is_the_engines_own_chat_reply(client, engine):
    r = client.messages.create(model="tiny", max_tokens=12, messages=MSGS, system="Be brief.", **SDK_GREEDY)
    want = engine.generate(messages=[{"role": "system", "content": "Be brief."}, *MSGS], max_tokens=12, **GREEDY)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == want.text
    assert r.stop_reason == ("max_tokens" if want.stats.stop_reason == "length" else "end_turn")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (want.stats.prompt_tokens, want.stats.n_tokens)


def test_a_stop_sequence_is_named(client, engine):
    text = engine.generate(messages=MSGS, max_tokens=24, **GREEDY).text
    stop_at = text[len(text) // 2:len(text) // 2 + 3]
    assert stop_at.strip()
    r = client.messages.create(model="tiny", max_tokens=24, messages=MSGS, stop_sequences=[stop_at], **SDK_GREEDY)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop_at
    assert r.content[0].text == text[:text.find(stop_at)]


def test_a_streamed_message_is_the_whole_one(client):
    whole = client.messages.create(model="tiny", max_tokens=16, messages=MSGS, **SDK_GREEDY)
    with client.messages.stream(model="tiny", max_tokens=16, messages=MSGS, **SDK_GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens


@pytest.mark.parametrize("streamed", [False, True])
def test_a_required_tool_call_comes_back_as_tool_use_and_round_trips(client, streamed):
    kw = dict(model="tiny", max_tokens=200, messages=MSGS, tools=TOOLS_ANTHROPIC, tool_choice={"type": "any"},
              extra_body={"temperature": 0.7})
    if streamed:
        with client.messages.stream(**kw) as stream:
            r = stream.get_final_message()
    else:
        r = client.messages.create(**kw)
    assert r.stop_reason == "tool_use"
    uses = [b for b in r.content if b.type == "tool_use"]
    assert uses
    for use in uses:
        schema = next(t["input_schema"] for t in TOOLS_ANTHROPIC if t["name"] == use.name)
        jsonschema.validate(use.input, schema)
        assert use.id.startswith("toolu_")
    follow = MSGS + [{"role": "assistant", "content": [u.model_dump() for u in uses]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "21 C"}
                                                  for u in uses]}]
    r2 = client.messages.create(model="tiny", max_tokens=8, messages=follow, tools=TOOLS_ANTHROPIC, **SDK_GREEDY)
    assert r2.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_a_named_tool_is_the_one_called(client):
    r = client.messages.create(model="tiny", max_tokens=200, messages=MSGS, tools=TOOLS_ANTHROPIC,
                               tool_choice={"type": "tool", "name": "add"}, extra_body={"temperature": 0.7})
    assert [b.name for b in r.content if b.type == "tool_use"] == ["add"]


def test_count_tokens_is_the_prompt_a_message_evaluates(client, engine):
    n = client.messages.count_tokens(model="tiny", messages=MSGS, system="Be brief.").input_tokens
    assert n == len(engine.prompt_tokens(messages=[{"role": "system", "content": "Be brief."}, *MSGS]))
    with_tools = client.messages.count_tokens(model="tiny", messages=MSGS, tools=TOOLS_ANTHROPIC).input_tokens
    assert with_tools > len(engine.prompt_tokens(messages=MSGS))


@pytest.mark.parametrize("body, kind, says", [
    ({"messages": MSGS}, "invalid_request_error", "max_tokens"),
    ({"messages": MSGS, "max_tokens": 4, "temperature": 1.5}, "invalid_request_error", "temperature"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4},
     "invalid_request_error", "blocks"),
    ({"messages": [{"role": "robot", "content": "x"}], "max_tokens": 4}, "invalid_request_error", "role"),
    ({"messages": MSGS, "max_tokens": 4, "tools": [{"type": "web_search_20250305", "name": "s"}]},
     "invalid_request_error", "server tools"),
    ({"messages": MSGS, "max_tokens": 4, "model": "nope"}, "not_found_error", "nope"),
])
def test_bad_requests_get_anthropics_error_shape(server, body, kind, says):
    status, _, raw = request(server, "POST", "/v1/messages", body, {"Content-Type": "application/json"})
    err = json.loads(raw)
    assert status in (400, 404) and err["type"] == "error" and err["error"]["type"] == kind, err
    assert says in err["error"]["message"]


def test_the_sdk_raises_its_own_errors(client):
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="tiny", max_tokens=4, messages=MSGS, extra_body={"temperature": 3})
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=4, messages=MSGS)


def test_the_api_key_is_read_from_x_api_key(engine):
    server, thread = start(engine, api_key="sekret")
    try:
        ok = anthropic.Anthropic(base_url=server.url, api_key="sekret", max_retries=0)
        assert ok.messages.create(model="tiny", max_tokens=2, messages=MSGS, **SDK_GREEDY).usage.output_tokens == 2
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
                model="tiny", max_tokens=2, messages=MSGS)
    finally:
        stop(server, thread)
