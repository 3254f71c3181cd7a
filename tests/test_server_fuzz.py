"""Fuzzing the server's request handling (edgespec.server) with Hypothesis.

Random JSON for /v1/chat/completions, /v1/completions, /api/generate and
/api/chat: the fields the server reads, each either near-valid (roles, content parts, small numbers
around the edges of their ranges) or any JSON value at all (lone surrogates,
NaN, huge integers, nesting included), plus unknown fields and raw bytes. Every
request must be answered with 200 (a completion or an event stream that ends
in [DONE]; Ollama's: one object, or NDJSON lines ending in one with done) or
a 4xx in the API's error shape; never a 5xx, never a hang.

The model is the tiny random llama (2 layers, SmolLM2's tokenizer and chat
template) with a 256-token context, so a generation of up to max_tokens 2, or
of all the room a huge max_tokens leaves, takes milliseconds."""
from __future__ import annotations

import http.client
import json
import threading

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from edgespec import Engine
from edgespec.server import make_server

N_CTX = 256   # llama.cpp pads a context to a multiple of 256
MODEL = "tiny"
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def server(tiny_llama_path):
    with Engine(str(tiny_llama_path), threads=1, n_ctx=N_CTX) as engine:
        server = make_server(engine, port=0, quiet=True, model_name=MODEL)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield server
        server.shutdown()
        server.server_close()
        thread.join(10)


def post(server, path: str, body: bytes) -> tuple[int, str, bytes]:
    """(status, Content-Type, body) of one POST; a stall over 30 s fails the test."""
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read()
    finally:
        conn.close()


def check_answer(status: int, content_type: str, data: bytes, request) -> None:
    assert status < 500, (status, data, request)
    if status >= 400:
        err = json.loads(data)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], (err, request)
        event(f"HTTP {status}, param {err['param']}")
        return
    assert status == 200, (status, data, request)
    event("HTTP 200")
    if content_type == "text/event-stream":
        events = data.decode().split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""], (data, request)
        for e in events[:-2]:
            assert "choices" in json.loads(e[len("data: "):]), (e, request)
    else:
        body = json.loads(data)
        assert len(body["choices"]) == 1 and body["usage"]["completion_tokens"] >= 0, (body, request)


# -- strategies ---------------------------------------------------------------------

PLAIN = st.text(min_size=1, max_size=10) | st.sampled_from(["\x00", "é🙂", "<|im_start|>", "<|im_end|>"])
SURROGATE = st.tuples(PLAIN, st.characters(categories=["Cs"]), PLAIN).map("".join)   # a lone one
SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.integers(-3, 3)
           | st.floats(allow_nan=True, allow_infinity=True) | PLAIN | SURROGATE)
ANY = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(PLAIN, kids, max_size=4),
                   max_leaves=8)


def mostly(valid, edge):
    """Mostly a valid value (9 times in 10), sometimes one just past an edge."""
    return st.integers(0, 9).flatmap(lambda k: edge if k == 9 else valid)


def field(near_valid):
    """A field's value: mostly near-valid, sometimes any JSON value."""
    return mostly(near_valid, ANY)


TEXT = mostly(PLAIN, SURROGATE)
CONTENT_PART = st.fixed_dictionaries({"type": field(st.just("text")), "text": field(TEXT)})
ROLE = mostly(st.sampled_from(["system", "developer", "user", "assistant"]), st.sampled_from(["tool", "User"]))
MESSAGE = field(st.fixed_dictionaries({"role": field(ROLE)}, optional={
    "content": field(TEXT | st.lists(CONTENT_PART, max_size=3)), "name": PLAIN}))
MAX_TOKENS = field(mostly(st.integers(1, 2), st.sampled_from([0, -1])))
COMMON = {
    "model": field(mostly(st.just(MODEL), st.just("gpt-4"))),
    "max_completion_tokens": MAX_TOKENS,
    "temperature": field(mostly(st.floats(0, 2), st.sampled_from([1e-7, -0.1, 2.1, 7.5]))),
    "top_p": field(mostly(st.floats(0, 1), st.sampled_from([-0.1, 1.1]))),
    "n": field(mostly(st.just(1), st.just(2))),
    "seed": field(mostly(st.integers(0, 2**64 - 1), st.sampled_from([-1, 2**64]))),
    "stop": field(mostly(TEXT | st.lists(TEXT, max_size=4), st.sampled_from(["", [""], ["x"] * 17]))),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": field(st.booleans())})),
}
PROMPT = field(mostly(TEXT | st.lists(TEXT, min_size=1, max_size=1), st.sampled_from(["", [], ["a", "b"]])))
MESSAGES = field(st.lists(MESSAGE, min_size=1, max_size=3))
CHAT = st.fixed_dictionaries({"max_tokens": MAX_TOKENS, "messages": MESSAGES}, optional=COMMON)
COMPLETION = st.fixed_dictionaries({"max_tokens": MAX_TOKENS, "prompt": PROMPT}, optional=COMMON)


def with_extras(bodies):
    """A body, sometimes with unknown fields, sometimes any JSON value at all."""
    extras = st.tuples(bodies, st.dictionaries(PLAIN, ANY, max_size=2)).map(lambda b: {**b[1], **b[0]})
    return mostly(bodies | extras, ANY)


# -- the fuzz ---------------------------------------------------------------------

@FUZZ
@given(body=with_extras(CHAT))
def test_fuzz_chat_bodies(server, body):
    check_answer(*post(server, "/v1/chat/completions", json.dumps(body).encode()), body)


@FUZZ
@given(body=with_extras(COMPLETION))
def test_fuzz_completion_bodies(server, body):
    check_answer(*post(server, "/v1/completions", json.dumps(body).encode()), body)


@FUZZ
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
       data=st.binary(max_size=64) | TEXT.map(lambda t: t.encode("utf-8", "surrogatepass"))
       | ANY.map(lambda v: json.dumps(v).encode()[:-1]))   # cut short
def test_fuzz_raw_bodies(server, path, data):
    check_answer(*post(server, path, data), data)


OLLAMA_OPTIONS = st.fixed_dictionaries({  # num_predict -1 / -2 (or absent) generates up to the context: rarely
    "num_predict": mostly(st.integers(1, 2), st.sampled_from([-1, -2, 0, -3, "x"]))}, optional={
    "temperature": field(mostly(st.floats(0, 2), st.sampled_from([-1.0, 1e-7]))),
    "top_k": field(st.integers(-1, 100)), "top_p": field(mostly(st.floats(0.01, 1), st.just(1.5))),
    "min_p": field(st.floats(0, 0.99)), "repeat_penalty": field(mostly(st.floats(0.5, 2), st.just(0.0))),
    "seed": field(st.integers(0, 2**64 - 1)),
    "stop": field(st.lists(TEXT, max_size=3)), "num_ctx": ANY, "mirostat": field(st.sampled_from([0, 1])),
})
OLLAMA_REQUIRED = {"model": field(mostly(st.sampled_from([MODEL, MODEL + ":latest"]), st.just("llama3"))),
                   "options": field(OLLAMA_OPTIONS)}
OLLAMA_COMMON = {"stream": field(st.booleans()), "format": field(st.sampled_from(["", "json"])), "keep_alive": ANY}
OLLAMA_MESSAGE = field(st.fixed_dictionaries({"role": field(mostly(st.sampled_from(["system", "user", "assistant"]),
                                                                    st.just("tool")))},
                                             optional={"content": field(TEXT), "images": field(st.just([]))}))
OLLAMA_GENERATE = st.fixed_dictionaries(OLLAMA_REQUIRED,
                                        optional={**OLLAMA_COMMON, "prompt": field(TEXT), "system": field(TEXT),
                                                  "raw": field(st.booleans())})
OLLAMA_CHAT = st.fixed_dictionaries(OLLAMA_REQUIRED,
                                    optional={**OLLAMA_COMMON, "messages": field(st.lists(OLLAMA_MESSAGE, max_size=3))})


def check_ollama_answer(status: int, content_type: str, data: bytes, request) -> None:
    assert status < 500, (status, data, request)
    if status >= 400:
        err = json.loads(data)
        assert set(err) == {"error"} and isinstance(err["error"], str) and err["error"], (err, request)
        event(f"HTTP {status}")
        return
    assert status == 200, (status, data, request)
    if content_type == "application/x-ndjson":
        lines = [json.loads(line) for line in data.decode().splitlines()]
        assert all(not line["done"] for line in lines[:-1]) and lines[-1]["done"], (lines, request)
    else:
        lines = [json.loads(data)]
        assert lines[0]["done"] is True, (lines, request)
    event(f"HTTP 200, {len(lines)} lines")


OLLAMA_FUZZ = settings(FUZZ, max_examples=75)


@OLLAMA_FUZZ
@given(body=with_extras(OLLAMA_GENERATE))
def test_fuzz_ollama_generate(server, body):
    check_ollama_answer(*post(server, "/api/generate", json.dumps(body).encode()), body)


@OLLAMA_FUZZ
@given(body=with_extras(OLLAMA_CHAT))
def test_fuzz_ollama_chat(server, body):
    check_ollama_answer(*post(server, "/api/chat", json.dumps(body).encode()), body)


def test_huge_max_tokens_gets_the_room_left(server):
    """max_tokens is capped at the room the prompt leaves in the context."""
    status, _, data = post(server, "/v1/completions", json.dumps(
        {"prompt": "Once upon a time", "max_tokens": 10**9, "temperature": 0}).encode())
    body = json.loads(data)
    assert status == 200, body
    usage = body["usage"]
    assert body["choices"][0]["finish_reason"] == "length"
    assert usage["completion_tokens"] == server.engine.backend.n_ctx - usage["prompt_tokens"]
