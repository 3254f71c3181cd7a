"""Structured output, tool calls, logprobs and validation through the HTTP
server and the official ``openai`` client, on the tiny random llama (fast
tier): its output means nothing, but a grammar makes it valid."""
from __future__ import annotations

import json
import threading

import jsonschema
import pytest

openai = pytest.importorskip("openai")

from edgespec import Engine  # noqa: E402
from edgespec.server import make_server  # noqa: E402

from test_grammar import SCHEMAS, TAGS_TEMPLATE, TOOLS  # noqa: E402

MSGS = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    with Engine(str(tiny_llama_path), threads=1, n_ctx=2048, ctx_extend=True, drafter="ngram") as e:
        yield e


@pytest.fixture(scope="module")
def server(engine):
    server = make_server(engine, port=0, quiet=True, model_name="tiny")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(params=[None, TAGS_TEMPLATE], ids=["json-form", "tags-form"])
def template(request, engine):
    engine.chat_template = request.param
    yield request.param
    engine.chat_template = None


# -- structured output ------------------------------------------------------------------

@pytest.mark.parametrize("schema", SCHEMAS[:5], ids=[str(i) for i in range(5)])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_response_format_json_schema(client, schema, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
    for seed in range(2):
        kw = dict(model="tiny", messages=MSGS, response_format=fmt, max_tokens=200, seed=seed)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                           if c.choices)
        else:
            r = client.chat.completions.create(**kw)
            assert r.choices[0].finish_reason == "stop"
            text = r.choices[0].message.content
        jsonschema.validate(json.loads(text), schema)


def test_json_object_and_grammar_fields(client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, response_format={"type": "json_object"},
                                       max_tokens=200, temperature=0)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model="tiny", prompt="Answer:", max_tokens=8, seed=1,
                                  extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert r.choices[0].text in ("yes", "no")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"not": {}}}}}}}, "response_format"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logprobs": True, "top_logprobs": 40}, "top_logprobs"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
])
def test_bad_fields_are_400_naming_them(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, extra_body=body)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    if param == "response_format":
        assert "not" in e.value.body["message"]


# -- tool calls ---------------------------------------------------------------------------

def _check_calls(calls):
    assert calls
    for c in calls:
        fn = next(t["function"] for t in TOOLS if t["function"]["name"] == c.function.name)
        jsonschema.validate(json.loads(c.function.arguments), fn["parameters"])
        assert c.id and c.type == "function"


def test_tool_call_round_trip(client, template):
    r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required",
                                       max_tokens=150, seed=2)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls)
    call = choice.message.tool_calls[0]
    history = MSGS + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    r2 = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=10, seed=3)
    # The reason this answer must carry: a call if it made one, else "length"
    # exactly when it used all 10 tokens, else "stop".
    c2 = r2.choices[0]
    want = "tool_calls" if c2.message.tool_calls else "length" if r2.usage.completion_tokens == 10 else "stop"
    assert c2.finish_reason == want, (c2, r2.usage)


def test_tool_call_streamed_as_deltas(client, template):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MSGS, tools=TOOLS, max_tokens=150, seed=4, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["get_weather"]
    _check_calls(deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""


def test_unparseable_tool_call_is_text_with_a_warning(client, engine):
    # A grammar forces a malformed call: the server answers with it as text.
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1'
    engine.chat_template = TAGS_TEMPLATE
    try:
        for stream in (False, True):
            kw = dict(model="tiny", messages=MSGS, tools=TOOLS, max_tokens=60,
                      extra_body={"grammar": f"start: {json.dumps(bad)}"})
            if stream:
                chunks = list(client.chat.completions.create(stream=True, **kw))
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                last = chunks[-1].choices[0]
            else:
                last = client.chat.completions.create(**kw).choices[0]
                text = last.message.content
                assert not last.message.tool_calls
            assert text == bad and last.finish_reason == "stop" and last.model_extra["warning"]
    finally:
        engine.chat_template = None


def test_tool_messages_are_accepted(client):
    msgs = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


# -- logprobs -------------------------------------------------------------------------------

def test_chat_logprobs_shape(client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3 and bytes(t.bytes).decode("utf-8", "replace") == t.token
        assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
    chunks = list(client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2).choices[0].logprobs is None


def test_completion_logprobs_shape(client):
    r = client.completions.create(model="tiny", prompt="Once upon", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and all(len(d) == 2 for d in lp.top_logprobs)


def test_penalties_top_k_min_p_change_the_output(client):
    kw = dict(model="tiny", prompt="a a a a", max_tokens=16, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    assert client.completions.create(presence_penalty=2, frequency_penalty=2, **kw).choices[0].text != plain
    for extra in ({"top_k": 1}, {"min_p": 0.999}):
        r = client.completions.create(model="tiny", prompt="a a a a", max_tokens=16, temperature=1.5, seed=5,
                                      extra_body=extra)
        assert r.choices[0].text == plain  # keeps only the most likely token: greedy


def test_ollama_format(server):
    import http.client

    schema = SCHEMAS[1]
    for path, body in (("/api/generate", {"prompt": "Data:"}), ("/api/chat", {"messages": MSGS})):
        for fmt in ("json", schema):
            conn = http.client.HTTPConnection(*server.server_address[:2], timeout=120)
            conn.request("POST", path, json.dumps({"model": "tiny", "stream": False, "format": fmt,
                                                   "options": {"num_predict": 200, "seed": 1}, **body}),
                         {"Content-Type": "application/json"})
            reply = json.loads(conn.getresponse().read())
            conn.close()
            text = reply["response"] if path == "/api/generate" else reply["message"]["content"]
            value = json.loads(text)
            assert isinstance(value, dict)
            if fmt == schema:
                jsonschema.validate(value, schema)


# -- structured output that ends (smollm2-135m, the smallest built-in model) -------------------

def test_bounded_schema_caps_digits_and_closes_objects():
    from edgespec.grammar import bounded_schema

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": ["number", "null"]},
                                               "free": {"type": "object", "additionalProperties": True,
                                                        "properties": {"a": {"type": "integer", "minimum": 0}}},
                                               "list": {"type": "array", "items": {"type": "object",
                                                                                  "properties": {}}}}}
    out = bounded_schema(schema)
    assert out["additionalProperties"] is False and "additionalProperties" not in schema   # a copy
    assert out["properties"]["n"] == {"type": "integer", "minimum": -(10 ** 16 - 1), "maximum": 10 ** 16 - 1}
    assert out["properties"]["x"]["multipleOf"] == 1e-10 and out["properties"]["x"]["maximum"] == 10 ** 16 - 1
    free = out["properties"]["free"]
    assert free["additionalProperties"] is True and free["properties"]["a"]["minimum"] == 0
    assert out["properties"]["list"]["items"]["additionalProperties"] is False


@pytest.fixture(scope="module")
def smollm2_server(smollm2_path):
    from test_server_platform import start, stop

    with Engine(str(smollm2_path), threads=2, n_ctx=1024, drafter="auto") as e:
        server, thread = start(e)
        yield server
        stop(server, thread)


@pytest.mark.parametrize("prompt", ["Make up an order.", "Order 7781 for customer 42: two items."])
def test_the_sdk_s_parse_ends_with_a_valid_object(smollm2_server, prompt):
    from pydantic import BaseModel

    class Item(BaseModel):
        sku: int
        quantity: int

    class Order(BaseModel):
        order_id: int
        customer_id: int
        total_cents: int
        first_item: Item
        second_item: Item

    client = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    # without the digit caps this model writes order_id digits until max_tokens (parse() then raises)
    r = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": prompt}],
                                      response_format=Order, temperature=0, max_tokens=400)
    assert r.choices[0].finish_reason == "stop"
    order = r.choices[0].message.parsed
    assert isinstance(order, Order) and isinstance(order.second_item, Item)
    assert all(abs(v) < 10 ** 16 for v in (order.order_id, order.customer_id, order.total_cents))


def test_a_required_tool_call_on_the_smallest_model_returns_a_parsed_call(smollm2_server):
    client = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    weather = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=weather, tool_choice="required", temperature=0, max_tokens=100)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}   # no keys beside the listed ones


def test_parallel_tool_calls_lets_a_required_reply_make_several_calls(client, template):
    kw = dict(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required", max_tokens=1500, temperature=0.8)
    one = client.chat.completions.create(seed=3, **kw)
    assert len(one.choices[0].message.tool_calls) == 1          # one call unless asked for several
    several = client.chat.completions.create(seed=3, parallel_tool_calls=True, **kw)
    calls = several.choices[0].message.tool_calls
    assert several.choices[0].finish_reason == "tool_calls" and 1 <= len(calls) <= 8
    _check_calls(calls)
