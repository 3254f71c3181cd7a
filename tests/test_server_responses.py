"""OpenAI's Responses API (/v1/responses) through the official ``openai``
SDK's ``client.responses``, on the tiny random llama: answers equal the
engine's own greedy chat replies, previous_response_id continues a
conversation kept in memory, function tools come back as function_call
items, refusals in OpenAI's error shape."""
from __future__ import annotations

import json

import jsonschema
import pytest

openai = pytest.importorskip("openai")

from edgespec import Engine  # noqa: E402

from test_grammar import TAGS_TEMPLATE, TOOLS  # noqa: E402
from test_server_platform import start, stop  # noqa: E402

GREEDY = {"temperature": 0}
TOOLS_RESPONSES = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    with Engine(str(tiny_llama_path), threads=1, n_ctx=2048, ctx_extend=True, drafter="ngram") as e:
        e.chat_template = TAGS_TEMPLATE
        yield e


@pytest.fixture(scope="module")
def client(engine):
    server, thread = start(engine)
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    stop(server, thread)


def test_a_response_is_the_engines_own_chat_reply(client, engine):
    r = client.responses.create(model="tiny", input="Weather in Paris?", instructions="Be brief.",
                                max_output_tokens=12, **GREEDY)
    want = engine.generate(messages=[{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Weather in Paris?"}], max_tokens=12, **GREEDY)
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == want.text
    assert r.status == ("incomplete" if want.stats.stop_reason == "length" else "completed")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (want.stats.prompt_tokens, want.stats.n_tokens)


def test_previous_response_id_continues_the_conversation(client, engine):
    first = client.responses.create(model="tiny", input="Hello there", max_output_tokens=6, **GREEDY)
    second = client.responses.create(model="tiny", input="And then?", previous_response_id=first.id,
                                     max_output_tokens=6, **GREEDY)
    want = engine.generate(messages=[{"role": "user", "content": "Hello there"},
                                     {"role": "assistant", "content": first.output_text},
                                     {"role": "user", "content": "And then?"}], max_tokens=6, **GREEDY)
    assert second.output_text == want.text and second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="x", previous_response_id=first.id, max_output_tokens=2)


def test_a_streamed_response_is_the_whole_one(client):
    whole = client.responses.create(model="tiny", input="Weather in Paris?", max_output_tokens=16, **GREEDY)
    events = list(client.responses.create(model="tiny", input="Weather in Paris?", max_output_tokens=16,
                                          stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


@pytest.mark.parametrize("streamed", [False, True])
def test_a_required_function_call_is_a_function_call_item(client, streamed):
    kw = dict(model="tiny", input="Weather in Paris?", tools=TOOLS_RESPONSES, tool_choice="required",
              max_output_tokens=200, temperature=0.7)
    if streamed:
        r = [e for e in client.responses.create(stream=True, **kw)][-1].response
    else:
        r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls
    for call in calls:
        schema = next(t["parameters"] for t in TOOLS_RESPONSES if t["name"] == call.name)
        jsonschema.validate(json.loads(call.arguments), schema)
    follow = client.responses.create(model="tiny", previous_response_id=r.id, tools=TOOLS_RESPONSES,
                                     input=[{"type": "function_call_output", "call_id": c.call_id, "output": "21 C"}
                                            for c in calls], max_output_tokens=4, **GREEDY)
    assert follow.status in ("completed", "incomplete")


def test_text_format_json_schema_constrains_the_answer(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    r = client.responses.create(model="tiny", input="Which city?", max_output_tokens=200, temperature=0.7,
                                text={"format": {"type": "json_schema", "name": "out", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.parametrize("kw, param", [
    (dict(input=[{"type": "image", "url": "x"}]), "input[0]"),
    (dict(input="x", tools=[{"type": "web_search"}]), "tools[0]"),
    (dict(input="x", max_output_tokens=0), "max_output_tokens"),
    (dict(input="x", temperature=3), "temperature"),
    (dict(input="x", background=True), "background"),
])
def test_bad_fields_are_400_naming_them(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", **kw)
    assert e.value.body["param"] == param
