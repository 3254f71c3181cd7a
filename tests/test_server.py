"""The OpenAI-compatible server (edgespec.server) against the official
``openai`` client, on the real built-in SmolLM2 with the auto drafter.

Every generation is greedy (temperature 0), so each answer is compared with
the engine's own answer to the same request; max_tokens stays small."""
from __future__ import annotations

import http.client
import json
import socket
import threading

import pytest

openai = pytest.importorskip("openai")

from edgespec import Engine  # noqa: E402
from edgespec.server import make_server  # noqa: E402

N = 8  # tokens per generation unless a test needs more
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def engine(smollm2_path):
    with Engine(str(smollm2_path), threads=2, n_ctx=1024, drafter="auto") as e:
        yield e


def _start(engine, **kw):
    server = make_server(engine, port=0, quiet=True, model_name="smollm2", **kw)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


@pytest.fixture(scope="module")
def server(engine):
    server, thread = _start(engine)
    yield server
    server.shutdown()
    server.server_close()
    thread.join(10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


_refs: dict = {}


def reference(server, *, max_tokens=N, **request):
    """The engine's own greedy result for a request (computed once, under the server's lock)."""
    key = json.dumps(request, sort_keys=True) + f"/{max_tokens}"
    if key not in _refs:
        with server.engine_lock:
            _refs[key] = server.engine.generate(max_tokens=max_tokens, temperature=0.0, **request)
    return _refs[key]


def raw(server, method, path, body=None, headers=None):
    """(status, headers, parsed JSON) of one plain HTTP request."""
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=300)
    try:
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, dict(resp.getheaders()), json.loads(data)
    finally:
        conn.close()


def assert_error(status_body, status, code=None, param=None):
    got_status, _, body = status_body
    assert got_status == status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return err


# -- happy paths ---------------------------------------------------------------------

def test_health_and_models(server, client):
    assert raw(server, "GET", "/health")[2] == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2"]
    assert client.models.retrieve("smollm2").id == "smollm2"


def test_chat_completion(server, client):
    ref = reference(server, messages=CHAT)
    r = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=N, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "smollm2"
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content and choice.message.content == ref.text
    assert choice.finish_reason == {"eos": "stop", "stop": "stop", "length": "length"}[ref.stats.stop_reason]
    assert r.usage.prompt_tokens == ref.stats.prompt_tokens
    assert r.usage.completion_tokens == ref.stats.n_tokens == len(ref.tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    extra = r.model_extra["edgespec"]
    assert extra["drafter"] == "auto" and extra["tokens_per_s"] > 0
    assert extra["spec"] is not None and {"drafted", "accepted", "acceptance_rate"} <= set(extra["spec"])


def test_chat_streaming_equals_whole_answer(server, client):
    ref = reference(server, messages=CHAT)
    chunks = list(client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=N,
                                                 temperature=0, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert [c.choices[0].finish_reason for c in chunks][-1] in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_completion_with_stop(server, client):
    ref = reference(server, prompt=PROMPT)
    r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == ref.text
    assert r.usage.completion_tokens == ref.stats.n_tokens
    # a stop string cut at the first word of the answer
    word = ref.text.split()[1]
    cut = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=N, temperature=0, stop=[word])
    assert cut.choices[0].text == ref.text[:ref.text.index(word)]
    assert cut.choices[0].finish_reason == "stop"
    # "model" may be left out; a one-string list is a prompt too
    status, _, body = raw(server, "POST", "/v1/completions",
                          body={"prompt": [PROMPT], "max_tokens": N, "temperature": 0})
    assert status == 200 and body["choices"][0]["text"] == ref.text and body["model"] == "smollm2"


def test_raw_event_stream(server):
    """The wire format: data: lines, a final chunk with finish_reason, usage on request, [DONE]."""
    ref = reference(server, prompt=PROMPT)
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=300)
    conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                 body=json.dumps({"prompt": PROMPT, "max_tokens": N, "temperature": 0, "stream": True,
                                  "stream_options": {"include_usage": True}}))
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    payload = resp.read().decode()
    conn.close()
    events = payload.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert all(c["object"] == "text_completion" for c in chunks)
    *pieces, final, usage = chunks
    assert "".join(c["choices"][0]["text"] for c in pieces) == ref.text
    assert final["choices"][0]["finish_reason"] == "length" and final["edgespec"]["spec"] is not None
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == ref.stats.n_tokens == N


def test_concurrent_clients_are_queued(server, client):
    requests = [{"messages": [{"role": "user", "content": q}]}
                for q in ("Name a fruit.", "What is 2 + 2?", "Say hello.")] + [{"prompt": PROMPT}]
    refs = [reference(server, **r).text for r in requests]
    answers, errors = [None] * len(requests), []

    def ask(i, req):
        try:
            if "messages" in req:
                r = client.chat.completions.create(model="smollm2", max_tokens=N, temperature=0, **req)
                answers[i] = r.choices[0].message.content
            else:
                answers[i] = client.completions.create(model="smollm2", max_tokens=N, temperature=0,
                                                       **req).choices[0].text
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i, r)) for i, r in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors
    assert answers == refs


def test_client_disconnect_stops_generation(server, client):
    """Read two events, drop the connection: the generation ends early, the server goes on."""
    host, port = server.server_address[:2]
    body = json.dumps({"prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 128, "temperature": 0, "stream": True})
    sock = socket.create_connection((host, port), timeout=300)
    sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
    data = b""
    while data.count(b"\n\n") < 2:   # two events (the headers end in \r\n\r\n)
        more = sock.recv(4096)
        assert more, data
        data += more
    assert data.startswith(b"HTTP/1.1 200")
    sock.close()
    with server.engine_lock:          # the generation has ended by now
        last = server.engine.last_result
    assert last.stats.stop_reason == "" and last.stats.n_tokens < 128  # closed, not run to the end
    ref = reference(server, messages=CHAT)
    r = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=N, temperature=0)
    assert r.choices[0].message.content == ref.text


# -- errors ------------------------------------------------------------------------------

def test_bad_requests(server, client):
    chat = "/v1/chat/completions"
    assert_error(raw(server, "POST", chat, body="{not json"), 400)
    assert_error(raw(server, "POST", chat, body="[1, 2]"), 400)
    assert_error(raw(server, "POST", chat, body={"messages": CHAT, "max_tokens": "x"}), 400, param="max_tokens")
    assert_error(raw(server, "POST", chat, body={"messages": CHAT, "max_tokens": 0}), 400, param="max_tokens")
    assert_error(raw(server, "POST", chat, body={"messages": CHAT, "temperature": -1}), 400, param="temperature")
    assert_error(raw(server, "POST", chat, body={"messages": "hi"}), 400, param="messages")
    assert_error(raw(server, "POST", chat, body={"messages": [{"role": "robot", "content": "x"}]}), 400)
    assert_error(raw(server, "POST", "/v1/completions", body={"prompt": 7}), 400, param="prompt")
    assert_error(raw(server, "POST", "/v1/completions", body={"prompt": "x", "stop": [1]}), 400, param="stop")
    assert_error(raw(server, "POST", chat, body={"messages": CHAT, "model": "gpt-4"}), 404,
                 code="model_not_found")
    assert_error(raw(server, "POST", "/v1/completions", body={"prompt": "hello " * 1200}), 400,
                 code="context_length_exceeded")
    assert_error(raw(server, "GET", "/v1/nothing"), 404)
    assert_error(raw(server, "POST", "/v2/chat"), 404)
    status, headers, _ = raw(server, "GET", chat)
    assert status == 405 and headers["Allow"] == "POST"
    assert_error(raw(server, "POST", "/health", body="{}"), 405)
    # the same errors through the official client
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=N, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT, max_tokens=N)
    assert raw(server, "GET", "/health")[0] == 200   # still serving


def test_api_key(engine, server):
    keyed, thread = _start(engine, api_key="sekrit")
    try:
        url = keyed.url + "/v1"
        bad = openai.OpenAI(base_url=url, api_key="wrong", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        # missing, wrong scheme, wrong key
        assert_error(raw(keyed, "POST", "/v1/completions", body={"prompt": "x"}), 401, code="invalid_api_key")
        assert_error(raw(keyed, "GET", "/v1/models", headers={"Authorization": "Basic sekrit"}), 401)
        assert_error(raw(keyed, "GET", "/v1/models", headers={"Authorization": "Bearer sekrit2"}), 401)
        assert raw(keyed, "GET", "/health")[0] == 200   # the health check stays open
        good = openai.OpenAI(base_url=url, api_key="sekrit", max_retries=0, timeout=300)
        assert [m.id for m in good.models.list().data] == ["smollm2"]
        with server.engine_lock:   # the two servers share one engine: keep them apart
            r = good.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2, temperature=0)
        assert r.choices[0].text
    finally:
        keyed.shutdown()
        keyed.server_close()
        thread.join(10)
