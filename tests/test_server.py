"""The OpenAI-compatible server (edgespec.server) against the official
``openai`` client, on the real built-in SmolLM2 with the auto drafter.

Every generation is greedy (temperature 0), so each answer is compared with
the engine's own answer to the same request; max_tokens stays small."""
from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai")

from edgespec import Engine  # noqa: E402
from edgespec.errors import EdgespecError  # noqa: E402
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
        return resp.status, resp.headers, json.loads(data)   # header names case-insensitive
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
    sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
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


# -- hardening: stopping work whose client left ---------------------------------------

COUNTING = "1, 2, 3, 4, 5, 6,"   # greedy SmolLM2 counts on and on: no end of text before the context


def _send(server, body: dict | bytes, path="/v1/completions", headers: str = "") -> socket.socket:
    """A raw socket that has sent one POST request (headers and body)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    sock = socket.create_connection(server.server_address[:2], timeout=60)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n{headers}"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _wait_locked(server, timeout=30.0) -> None:
    """Wait until a request holds the engine lock."""
    deadline = time.monotonic() + timeout
    while not server.engine_lock.locked():
        assert time.monotonic() < deadline, "no request took the engine lock"
        time.sleep(0.01)


def test_disconnect_stops_whole_generation(server, client, engine):
    """A non-streaming request asking for 10^9 tokens whose client leaves stops
    within a step; the next request does not wait for the context to fill."""
    ref = reference(server, messages=CHAT)   # (the auto drafter has measured this machine by now)
    sock = _send(server, {"prompt": COUNTING, "max_tokens": 10**9, "temperature": 0})
    _wait_locked(server)
    time.sleep(0.5)                    # generating by now
    sock.close()
    t0 = time.monotonic()
    with server.engine_lock:           # the generation has ended by now
        waited = time.monotonic() - t0
        last = engine.last_result
    assert last.stats.stop_reason in ("", "cancelled"), last.stats   # not "context": it stopped early
    assert 0 < last.stats.n_tokens < engine.backend.n_ctx - last.stats.prompt_tokens
    assert waited < 5, f"the engine stayed busy {waited:.1f} s after the client left"
    r = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=N, temperature=0)
    assert r.choices[0].message.content == ref.text


def test_disconnect_while_queued_starts_nothing(server, engine):
    before = engine.last_result
    with server.engine_lock:           # a generation is running: the request queues
        sock = _send(server, {"prompt": COUNTING, "max_tokens": 10**9, "temperature": 0})
        time.sleep(0.5)                # read and validated by now, waiting for the lock
        sock.close()
    time.sleep(0.5)                    # the handler takes the lock, sees the client gone
    with server.engine_lock:
        assert engine.last_result is before


# -- hardening: limits ------------------------------------------------------------------

def _headers_only(server, head: str, timeout=10) -> tuple[bytes, bool]:
    """Send a request's head without its body; the raw answer and whether the
    server then closed the connection."""
    sock = socket.create_connection(server.server_address[:2], timeout=timeout)
    try:
        sock.sendall(head.encode())
        data = b""
        while b"\r\n\r\n" not in data:
            more = sock.recv(65536)
            assert more, data
            data += more
        head_end = data.index(b"\r\n\r\n") + 4
        length = int(re.search(rb"(?i)content-length: (\d+)", data[:head_end]).group(1))   # names are case-insensitive
        while len(data) < head_end + length:
            data += sock.recv(65536)
        try:
            closed = sock.recv(1) == b""
        except ConnectionResetError:
            closed = True
        return data, closed
    finally:
        sock.close()


def _status_body(data: bytes) -> tuple[int, dict]:
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_oversized_body_refused_unread(server):
    """A 10 MB chat message is refused from the headers (413), the body never read."""
    data, closed = _headers_only(server, "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                                         f"Content-Length: {10 * 1024 * 1024}\r\n\r\n")
    status, body = _status_body(data)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert str(server.max_request_bytes) in body["error"]["message"]
    assert closed


def test_max_request_bytes_setting(engine, server):
    small, thread = _start(engine, max_request_bytes=2000)
    try:
        assert_error(raw(small, "POST", "/v1/completions", body={"prompt": "x" * 3000}), 413,
                     code="request_too_large")
        with server.engine_lock:   # the two servers share one engine: keep them apart
            status, _, body = raw(small, "POST", "/v1/completions",
                                  body={"prompt": PROMPT, "max_tokens": 1, "temperature": 0})
        assert status == 200, body
    finally:
        small.shutdown()
        small.server_close()
        thread.join(10)
    with pytest.raises(EdgespecError):
        make_server(engine, port=0, max_request_bytes=0)


def test_over_context_prompt_refused_without_the_engine_lock(server):
    """A prompt far over the context is tokenized and refused while a generation
    holds the engine (old: tokenized under the lock, after the running generation)."""
    text = "All work and no play makes Jack a dull boy. " * 20000   # ~900 kB, ~200k tokens
    with server.engine_lock:
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
                           ("/v1/completions", {"prompt": text})):
            host, port = server.server_address[:2]
            conn = http.client.HTTPConnection(host, port, timeout=30)
            conn.request("POST", path, body=json.dumps({**body, "max_tokens": 1}),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            err = json.loads(resp.read())["error"]
            conn.close()
            assert resp.status == 400 and err["code"] == "context_length_exceeded", err
            assert str(server.engine.backend.n_ctx) in err["message"]


# -- hardening: validation --------------------------------------------------------------

def test_invalid_values_are_400_not_500(server):
    chat, comp = "/v1/chat/completions", "/v1/completions"
    surrogate = '{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 1}'
    assert_error(raw(server, "POST", chat, body=surrogate), 400)
    assert_error(raw(server, "POST", comp, body='{"prompt": "\\udfff", "max_tokens": 1}'), 400)
    assert_error(raw(server, "POST", comp, body='{"prompt": "x", "stop": ["\\ud83d"], "max_tokens": 1}'), 400)
    assert_error(raw(server, "POST", comp, body="[" * 100000 + "]" * 100000), 400)
    assert_error(raw(server, "POST", comp, body='{"prompt": "x", "max_tokens": 1' + "0" * 5000 + "}"), 400)
    cases = [
        (chat, {"messages": [{"role": ["user"], "content": "x"}]}, "messages[0]"),
        (chat, {"messages": [{"role": {"a": 1}, "content": "x"}]}, "messages[0]"),
        (chat, {"messages": ["user"]}, "messages[0]"),
        (chat, {"messages": [{"role": "user", "content": {"text": "x"}}]}, "messages[0].content"),
        (chat, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        (chat, {"messages": {"role": "user"}}, "messages"),
        (chat, {"messages": []}, "messages"),
        (comp, {"prompt": ["a", "b"]}, "prompt"),
        (comp, {"prompt": [1, -2]}, "prompt"),            # token ids are served, this one is not one
        (comp, {"prompt": [[1, 2], [3]]}, "prompt"),      # two prompts would need n = 2
        (comp, {"prompt": [True, 2]}, "prompt"),
        (comp, {"prompt": "\x16"}, "prompt"),   # no tokens at all (found by tests/test_server_fuzz.py)
        (comp, {"prompt": "x", "stop": {"a": 1}}, "stop"),
        (comp, {"prompt": "x", "stop": [""]}, "stop"),
        (comp, {"prompt": "x", "stop": ["s"] * 17}, "stop"),
        (comp, {"prompt": "x", "temperature": 7.5}, "temperature"),
        (comp, {"prompt": "x", "temperature": 2.0001}, "temperature"),
        (comp, {"prompt": "x", "temperature": "1"}, "temperature"),
        (comp, {"prompt": "x", "temperature": 10**400}, "temperature"),
        (comp, {"prompt": "x", "top_p": 1.5}, "top_p"),
        (comp, {"prompt": "x", "top_p": -0.1}, "top_p"),
        (comp, {"prompt": "x", "n": 0}, "n"),
        (comp, {"prompt": "x", "n": 17}, "n"),
        (comp, {"prompt": "x", "n": True}, "n"),
        (comp, {"prompt": "x", "n": 1.0}, "n"),
        (comp, {"prompt": "x", "max_tokens": -5}, "max_tokens"),
        (comp, {"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
        (comp, {"prompt": "x", "max_tokens": None, "max_completion_tokens": "x"}, "max_completion_tokens"),
        (comp, {"prompt": "x", "seed": -1}, "seed"),
        (comp, {"prompt": "x", "stream": "yes"}, "stream"),
        (comp, {"prompt": "x", "stream_options": [1]}, "stream_options"),
        (comp, {"prompt": "x", "model": ["smollm2"]}, "model"),
    ]
    for path, body, param in cases:
        assert_error(raw(server, "POST", path, body={"max_tokens": 1, **body}), 400, param=param)
    assert raw(server, "GET", "/health")[0] == 200


def test_range_edges_are_served(server):
    """temperature 2 and top_p 0 (OpenAI's range ends) are served; top_p 0 keeps
    only the most likely token, so it is greedy; temperature 1e-7 is greedy too."""
    ref = reference(server, prompt=PROMPT)
    for extra in ({"temperature": 1.0, "top_p": 0}, {"temperature": 1e-7}):
        status, _, body = raw(server, "POST", "/v1/completions",
                              body={"prompt": PROMPT, "max_tokens": N, "seed": 7, **extra})
        assert status == 200 and body["choices"][0]["text"] == ref.text, (extra, body)
    status, _, body = raw(server, "POST", "/v1/completions",
                          body={"prompt": PROMPT, "max_tokens": 2, "temperature": 2, "top_p": 1})
    assert status == 200 and body["usage"]["completion_tokens"] <= 2


# -- hardening: HTTP framing and the API key --------------------------------------------

def _post_head(length_headers: str, extra: str = "") -> str:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"{extra}{length_headers}\r\n")


def test_request_framing(server):
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1, "temperature": 0})
    n = len(body)
    for head, status in [
        (_post_head(f"Content-Length: {n}\r\nContent-Length: {n + 5}\r\n"), 400),   # conflicting
        (_post_head(f"Content-Length: {n}\r\nContent-Length: {n}\r\n"), 400),       # duplicated
        (_post_head(f"Content-Length: +{n}\r\n"), 400),
        (_post_head(f"Content-Length: {n}, {n}\r\n"), 400),
        (_post_head("Content-Length: -1\r\n"), 400),
        (_post_head("Content-Length: 1" + "0" * 5000 + "\r\n"), 413),
        (_post_head("Transfer-Encoding: chunked\r\n"), 411),
        (_post_head(f"Transfer-Encoding: chunked\r\nContent-Length: {n}\r\n"), 400),
    ]:
        data, closed = _headers_only(server, head)
        got, err = _status_body(data)
        assert got == status and set(err["error"]) == {"message", "type", "param", "code"}, (head, err)
        assert closed, head
    # a body shorter than its Content-Length, then the client's half-close
    sock = socket.create_connection(server.server_address[:2], timeout=10)
    sock.sendall(_post_head(f"Content-Length: {n + 10}\r\n").encode() + body.encode())
    sock.shutdown(socket.SHUT_WR)
    got, err = _status_body(b"".join(iter(lambda: sock.recv(65536), b"")))
    sock.close()
    assert got == 400 and "ended" in err["error"]["message"]


def test_expect_100_continue(server):
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1, "temperature": 0}).encode()
    sock = socket.create_connection(server.server_address[:2], timeout=60)
    sock.sendall(_post_head(f"Content-Length: {len(body)}\r\n", "Expect: 100-continue\r\n").encode())
    assert sock.recv(4096).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
    sock.sendall(body)
    data = b""
    while b'"choices"' not in data:
        more = sock.recv(65536)
        assert more, data
        data += more
    sock.close()
    assert data.startswith(b"HTTP/1.1 200")


def test_api_key_checked_before_the_body(engine):
    """An unauthenticated 15 MB body is never read: 401 from the headers, then
    the connection closes (old: the body was read in full, then refused)."""
    keyed, thread = _start(engine, api_key="sekrit")
    try:
        for extra in ("", "Expect: 100-continue\r\n", "Authorization: Bearer wrong\r\n"):
            data, closed = _headers_only(keyed, _post_head(f"Content-Length: {15 * 1024 * 1024}\r\n", extra))
            status, body = _status_body(data)
            assert status == 401 and body["error"]["code"] == "invalid_api_key", extra
            assert closed
        # a client sending its whole body before reading still gets the answer (not a reset)
        assert_error(raw(keyed, "POST", "/v1/completions", body="x" * (3 * 1024 * 1024)), 401,
                     code="invalid_api_key")
        # a request without a body keeps its connection
        conn = http.client.HTTPConnection(*keyed.server_address[:2], timeout=10)
        socks = []
        for _ in range(2):
            conn.request("GET", "/v1/models")
            socks.append(conn.sock)
            resp = conn.getresponse()
            assert resp.status == 401 and json.loads(resp.read())["error"]["code"] == "invalid_api_key"
        assert socks[0] is socks[1]
        conn.close()
    finally:
        keyed.shutdown()
        keyed.server_close()
        thread.join(10)
