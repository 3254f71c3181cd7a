"""The server against hostile requests, on the tiny random llama (fast tier):
a Host header naming another site (DNS rebinding) is refused; a 200 MB
header is refused after its first 64 KiB and leaves no memory behind; a chat
template that renders without end is a 400 while the server keeps answering
and stops on SIGTERM; requests cut by the shutdown say so. Issue 42: a web
page's cross-site POST (a foreign Origin, a body not sent as JSON) is
refused; /api/create fetches from the Hub only when allowed; slot files are
capped; slow or silent connections are dropped after the request deadline,
and past the connection cap a new one gets 503; options.stop is capped."""
from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from edgespec import Engine
from edgespec.chat.template import RENDER_SECONDS
from edgespec.models import registry
from edgespec.pool import EnginePool
from edgespec.server import make_server
from edgespec.server.app import allowed_hosts
from edgespec.server.fields import MAX_STOP
from hostile_server import (RUNAWAY_TEMPLATE, chat, huge_header, request, rss, serving, slowloris,
                            with_template)

MODEL = "tiny"


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    with Engine(str(tiny_llama_path), threads=1, n_ctx=512, drafter="none") as e:
        yield e


def start(engine, **kw):
    server = make_server(engine, port=0, quiet=True, model_name=MODEL, **kw)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


def stop(server, thread):
    server.shutdown()
    server.server_close()
    thread.join(30)


# -- the Host header ------------------------------------------------------------------

@pytest.mark.parametrize("path, shape", [("/v1/models", "openai"), ("/api/tags", "ollama"),
                                         ("/health", "openai"), ("/", "openai")])
def test_a_foreign_host_is_refused_in_the_apis_shape(engine, path, shape):
    server, thread = start(engine, allowed_hosts=("my.box",))
    host, port = server.server_address[:2]
    try:
        status, body = request(host, port, "GET", path, headers={"Host": "evil.example:8080"})
        assert status == 403
        error = json.loads(body)["error"]
        message = error["message"] if shape == "openai" else error
        assert "'evil.example:8080' is not a name this server answers to" in message
        if shape == "openai":
            assert error["code"] == "host_not_allowed"
        for name in (f"localhost:{port}", "LOCALHOST", "127.0.0.1", f"127.0.0.1:{port}", "[::1]:9",
                     "my.box", "my.box.:1234"):
            assert request(host, port, "GET", path, headers={"Host": name})[0] == 200, name
        # a browser's preflight from the rebinding page is refused too
        assert request(host, port, "OPTIONS", path, headers={
            "Host": "evil.example", "Origin": "http://evil.example",
            "Access-Control-Request-Method": "POST"})[0] == 403
    finally:
        stop(server, thread)


def test_a_foreign_host_announcing_a_body_is_refused_unread(engine):
    import socket

    server, thread = start(engine)
    try:
        with socket.create_connection(server.server_address[:2], timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: evil.example\r\n"
                         b"Content-Length: 10485760\r\n\r\n")
            data = b""
            while more := sock.recv(65536):   # the answer, then the server closes
                data += more
        assert data.startswith(b"HTTP/1.1 403") and b"connection: close" in data.lower()
    finally:
        stop(server, thread)


def test_hosts_answered_by_address_bound():
    assert allowed_hosts("127.0.0.1") == {"127.0.0.1", "localhost", "::1"}
    assert allowed_hosts("::1", ("Box.Local",)) == {"127.0.0.1", "localhost", "::1", "box.local"}
    assert allowed_hosts("0.0.0.0") is None                    # bound elsewhere: any name
    assert allowed_hosts("192.168.1.5", ("box",)) == {"192.168.1.5", "127.0.0.1", "localhost", "::1", "box"}


# -- a process of its own: headers, templates, SIGTERM ---------------------------------

def test_a_200_mb_header_gets_431_and_leaves_no_memory_behind(tiny_llama_path):
    with serving(tiny_llama_path, "--threads", "1", "--drafter", "none") as (proc, host, port):
        assert request(host, port, "GET", "/health")[0] == 200
        idle = rss(proc.pid)
        for _ in range(3):
            status, sent = huge_header(host, port, 200 << 20)
            assert status == 431
            assert sent <= 8 << 20, sent            # refused after the first chunks, not read to the end
        assert request(host, port, "GET", "/health")[0] == 200
        assert rss(proc.pid) < idle + (16 << 20), (idle, rss(proc.pid))


def test_a_runaway_chat_template_is_a_400_and_sigterm_still_stops_the_server(tiny_llama_path, tmp_path):
    with with_template(tiny_llama_path, RUNAWAY_TEMPLATE, tmp_path) as model, \
            serving(model, "--threads", "1", "--drafter", "none") as (proc, host, port):
        idle = rss(proc.pid)
        answers = []
        asker = threading.Thread(target=lambda: answers.append(chat(host, port, "hi")))
        t0 = time.monotonic()
        asker.start()
        time.sleep(0.5)
        t1 = time.monotonic()
        assert request(host, port, "GET", "/health")[0] == 200   # answered while the template runs
        assert time.monotonic() - t1 < 2
        asker.join(RENDER_SECONDS + 30)
        status, body = answers[0]
        assert status == 400 and "chat template took more than" in json.loads(body)["error"]["message"]
        assert time.monotonic() - t0 < RENDER_SECONDS + 10
        assert rss(proc.pid) < idle + (32 << 20)
        # SIGTERM while another runaway render is under way
        threading.Thread(target=lambda: chat(host, port, "again"), daemon=True).start()
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(RENDER_SECONDS + 15) == 0   # stopped as Ctrl-C stops it
        assert proc.stderr.read().strip().endswith("stopped")


# -- the shutdown -------------------------------------------------------------------------

@pytest.fixture
def slow(engine, monkeypatch):
    """Every evaluation takes 20 ms: a generation is still running at shutdown."""
    real = type(engine.backend)._evaluate

    def slowly(self, *args):
        time.sleep(0.02)
        return real(self, *args)

    monkeypatch.setattr(type(engine.backend), "_evaluate", slowly)


def _when_running(server, then) -> None:
    while not server.engine_lock.locked():
        time.sleep(0.01)
    time.sleep(0.2)
    then()


def test_a_shutdown_labels_what_it_cuts(engine, slow, capfd):
    server, thread = start(engine)
    host, port = server.server_address[:2]
    answers = {}
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0}
    running = threading.Thread(target=lambda: answers.setdefault(
        "running", request(host, port, "POST", "/v1/completions", body)))
    running.start()
    _when_running(server, lambda: None)
    queued = threading.Thread(target=lambda: answers.setdefault(
        "queued", request(host, port, "POST", "/v1/completions", body)))
    queued.start()
    time.sleep(0.3)
    stop(server, thread)
    running.join(30)
    queued.join(30)
    status, data = answers["running"]
    assert status == 200
    choice = json.loads(data)["choices"][0]
    assert choice["finish_reason"] == "cancelled" and choice["text"]
    status, data = answers["queued"]
    assert status == 503 and json.loads(data)["error"]["message"] == "the server is shutting down"
    assert "shutdown: a generation of tiny was cut after" in capfd.readouterr().err


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
    ("/api/generate", {"prompt": "hi", "stream": True}),
])
def test_a_stream_cut_by_the_shutdown_ends_with_an_error(engine, slow, path, body):
    server, thread = start(engine)
    host, port = server.server_address[:2]
    answers = []
    options = {"max_tokens": 400} if path.startswith("/v1") else {"options": {"num_predict": 400}}
    asker = threading.Thread(target=lambda: answers.append(
        request(host, port, "POST", path, {**body, "model": MODEL, **options})))
    asker.start()
    _when_running(server, lambda: stop(server, thread))
    asker.join(30)
    status, data = answers[0]
    assert status == 200
    lines = [ln for ln in data.decode().splitlines() if ln.strip()]
    last = json.loads(lines[-1].removeprefix("data: "))
    error = last["error"] if path.startswith("/api") else last["error"]["message"]
    assert error.startswith("the server shut down mid-generation, after"), last
    assert "[DONE]" not in data.decode() and '"done": true' not in data.decode()


def test_max_tokens_and_max_completion_tokens_disagreeing_is_a_400(engine):
    server, thread = start(engine)
    host, port = server.server_address[:2]
    try:
        body = {"prompt": "Once", "temperature": 0}
        status, data = request(host, port, "POST", "/v1/completions",
                               {**body, "max_tokens": 3, "max_completion_tokens": 5})
        assert status == 400 and json.loads(data)["error"]["param"] == "max_completion_tokens"
        status, data = request(host, port, "POST", "/v1/completions",
                               {**body, "max_tokens": 3, "max_completion_tokens": 3})
        assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 3
    finally:
        stop(server, thread)


# -- cross-site requests (issue 42) -------------------------------------------------------

def send(server, method: str, path: str, body: bytes | None, headers: dict) -> tuple[int, dict]:
    """(status, JSON answer) of one request sent exactly as given (no Content-Type unless named)."""
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def message(answer: dict) -> str:
    error = answer["error"]
    return error if isinstance(error, str) else error["message"]   # Ollama's shape, OpenAI's


EVIL = "https://evil.example"
ACTING = [   # (path, body): what a page's simple POST could make the server do
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("/api/generate", {"prompt": "hi", "stream": False, "options": {"num_predict": 1}}),
    ("/api/pull", {"model": "smollm2-135m"}),
    ("/api/create", {"model": "x", "from": "/etc/hostname"}),
    ("/slots/0?action=save", {"filename": "x1.bin"}),
    ("/completion", {"prompt": "hi", "n_predict": 1}),
    ("/tokenize", {"content": "hi"}),
]


@pytest.mark.parametrize("path, body", ACTING, ids=[p for p, _ in ACTING])
def test_a_cross_site_post_is_refused(engine, path, body):
    server, thread = start(engine)
    data = json.dumps(body).encode()
    ollama_shape = path.startswith("/api/")
    try:
        # the request: a foreign page, text/plain (no preflight)
        status, answer = send(server, "POST", path, data, {"Origin": EVIL, "Content-Type": "text/plain"})
        assert status == 403 and "a page from 'https://evil.example' may not call" in message(answer), answer
        assert ollama_shape == isinstance(answer["error"], str)
        # no Origin (a browser that sends none), a body not sent as JSON: nothing read or done
        for content_type in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                             "multipart/form-data; boundary=x", None):
            headers = {"Content-Type": content_type} if content_type else {}
            status, answer = send(server, "POST", path, data, headers)
            assert status == 415, (content_type, answer)
            assert message(answer).startswith("Content-Type must be application/json, got "), answer
        # JSON from a foreign page: 403 too
        status, answer = send(server, "POST", path, data, {"Origin": EVIL, "Content-Type": "application/json"})
        assert status == 403, answer
    finally:
        stop(server, thread)


def test_json_without_origin_and_the_servers_own_page_are_answered(engine):
    server, thread = start(engine)
    port = server.server_address[1]
    body = json.dumps({"content": "hi"}).encode()
    try:
        for headers in ({}, {"Origin": f"http://127.0.0.1:{port}"}, {"Origin": f"http://localhost:{port}"},
                        {"Origin": "http://localhost:3000"}):   # the default allow-list: this machine's pages
            for content_type in ("application/json", "application/json; charset=utf-8", "application/vnd.x+json"):
                status, answer = send(server, "POST", "/tokenize", body, {**headers, "Content-Type": content_type})
                assert status == 200 and answer["tokens"], (headers, content_type, answer)
        # a POST without a body needs no Content-Type (curl -X POST .../slots/0?action=erase)
        status, answer = send(server, "POST", "/slots/0?action=erase", None, {})
        assert status == 200 and answer["id_slot"] == 0
        # GETs are not refused for an Origin (CORS keeps a foreign page from reading them)
        status, _ = send(server, "GET", "/v1/models", None, {"Origin": EVIL})
        assert status == 200
    finally:
        stop(server, thread)


def test_cors_origin_allows_the_page_it_names(engine):
    server, thread = start(engine, cors_origins=(EVIL,))
    port = server.server_address[1]
    body = json.dumps({"content": "hi"}).encode()
    try:
        status, answer = send(server, "POST", "/tokenize", body, {"Origin": EVIL, "Content-Type": "application/json"})
        assert status == 200 and answer["tokens"]
        assert send(server, "POST", "/tokenize", body, {"Origin": EVIL, "Content-Type": "text/plain"})[0] == 415
        # naming origins replaces the default list; the server's own page stays allowed
        status, answer = send(server, "POST", "/tokenize", body,
                              {"Origin": "http://localhost:3000", "Content-Type": "application/json"})
        assert status == 403 and "--cors-origin" in message(answer)
        status, _ = send(server, "POST", "/tokenize", body,
                         {"Origin": f"http://127.0.0.1:{port}", "Content-Type": "application/json"})
        assert status == 200
    finally:
        stop(server, thread)


# -- /api/create and /api/copy: the Hub ------------------------------------------------

@pytest.fixture
def pooled(tiny_llama_path, tmp_path, monkeypatch):
    """A pool serving the tiny llama, EDGESPEC_HOME in tmp_path."""
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    with EnginePool([str(tiny_llama_path)], backend="native", threads=1, n_ctx=128, drafter="none") as pool:
        yield pool


HUB = "hf:owner/repo/model.gguf"


def test_create_from_the_hub_needs_the_servers_flag(pooled, tiny_llama_path, monkeypatch):
    fetched = []
    resolve = registry.resolve

    def fetch(ref, **kw):   # the Hub, were it asked
        if ref.startswith("hf:"):
            fetched.append(ref)
            return tiny_llama_path
        return resolve(ref, **kw)

    monkeypatch.setattr(registry, "resolve", fetch)
    for allowed in (False, True):
        server = make_server(pooled, port=0, quiet=True, allow_pull_from_hub=allowed)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        host, port = server.server_address[:2]
        try:
            for path, body in (("/api/create", {"model": "hubbed", "from": HUB, "stream": False}),
                               ("/api/create", {"model": "hubbed", "modelfile": f"FROM {HUB}", "stream": False}),
                               ("/api/copy", {"source": HUB, "destination": "hubbed"})):
                status, data = request(host, port, "POST", path, body)
                if allowed:
                    assert status == 200, data
                else:
                    assert status == 403 and "--allow-pull-from-hub" in json.loads(data)["error"], data
            # a local file and a known name are created as before
            status, _ = request(host, port, "POST", "/api/create",
                                {"model": "mine", "from": str(tiny_llama_path), "stream": False})
            assert status == 200
            assert request(host, port, "POST", "/api/copy", {"source": "mine", "destination": "also"})[0] == 200
        finally:
            stop(server, thread)
        assert fetched == ([HUB] * 3 if allowed else [])


# -- slot files ---------------------------------------------------------------------------

def test_slot_saves_are_capped_by_count_and_bytes(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    folder = tmp_path / "slots" / MODEL

    def save(host, port, name):
        status, data = request(host, port, "POST", "/slots/0?action=save", {"filename": name})
        return status, json.loads(data)

    server, thread = start(engine, max_slot_files=2)
    host, port = server.server_address[:2]
    try:
        request(host, port, "POST", "/completion", {"prompt": "the slot keeps this", "n_predict": 2, "id_slot": -1})
        assert save(host, port, "a.bin")[0] == 200 and save(host, port, "b.bin")[0] == 200
        status, answer = save(host, port, "c.bin")
        assert status == 409 and answer["error"]["code"] == "slot_files_full"
        assert "--max-slot-files 2" in answer["error"]["message"]
        assert save(host, port, "a.bin")[0] == 200   # a kept name is replaced
        assert sorted(p.name for p in folder.iterdir()) == ["a.bin", "b.bin"]   # nothing half-written left
        size = (folder / "a.bin").stat().st_size
    finally:
        stop(server, thread)

    (folder / "b.bin").unlink()
    server, thread = start(engine, max_slot_bytes=size + size // 2)
    host, port = server.server_address[:2]
    try:
        status, answer = save(host, port, "c.bin")
        assert status == 409 and f"--max-slot-bytes {size + size // 2}" in answer["error"]["message"], answer
        before = (folder / "a.bin").read_bytes()
        assert save(host, port, "a.bin")[0] == 200   # replacing it stays within the cap
        assert sorted(p.name for p in folder.iterdir()) == ["a.bin"] and (folder / "a.bin").read_bytes() == before
    finally:
        stop(server, thread)


# -- slow and idle connections ---------------------------------------------------------

def test_slow_and_silent_connections_are_dropped_after_the_deadline(engine):
    server, thread = start(engine, request_timeout_s=1.0)
    host, port = server.server_address[:2]
    try:
        with socket.create_connection((host, port), timeout=10) as silent:   # says nothing at all
            answer = silent.recv(4096)
            assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in answer, answer
        for status, seconds in slowloris(host, port, 3, every=0.2, seconds=8):
            assert status == 408 and seconds < 4, (status, seconds)
        # the same after a first request on a kept-alive connection
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            data = b""
            while not data.endswith(b'{"status":"ok"}'):   # the whole answer (head and body come apart)
                data += sock.recv(4096)
            t1 = time.monotonic()
            sock.sendall(b"POST /v1/comp")
            answer = sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - t1 < 3, answer
        # a slow client that keeps sending gets more time per KiB: 4 KiB over ~3 s arrives
        body = json.dumps({"content": "x" * 4000}).encode()
        with socket.create_connection((host, port), timeout=30) as sock:
            sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body))
            for i in range(0, len(body), 512):
                time.sleep(0.35)
                sock.sendall(body[i:i + 512])
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    finally:
        stop(server, thread)


def test_past_the_connection_cap_a_new_connection_gets_503(engine):
    server, thread = start(engine, max_connections=4)
    host, port = server.server_address[:2]
    held = []
    try:
        for _ in range(4):   # each answered once: accepted and counted, then kept alive
            conn = http.client.HTTPConnection(host, port, timeout=10)
            conn.request("GET", "/health")
            assert conn.getresponse().read()
            held.append(conn)
        with socket.create_connection((host, port), timeout=10) as extra:
            answer = b"".join(iter(lambda: extra.recv(4096), b""))   # then the server closes it
        assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer, answer
        assert b"--max-connections" in answer
    finally:
        for conn in held:
            conn.close()
    try:
        deadline = time.monotonic() + 5
        while True:   # the held connections' close reaches the server
            try:
                if request(host, port, "GET", "/health", timeout=5)[0] == 200:
                    break
            except (ConnectionError, http.client.HTTPException):
                pass
            assert time.monotonic() < deadline, "/health not answered once the connections left"
            time.sleep(0.1)
    finally:
        stop(server, thread)


# -- options.stop -------------------------------------------------------------------------

@pytest.mark.parametrize("path, body", [
    ("/api/generate", lambda stops: {"prompt": "hi", "stream": False, "options": {"stop": stops, "num_predict": 1}}),
    ("/v1/completions", lambda stops: {"prompt": "hi", "stop": stops, "max_tokens": 1}),
    ("/completion", lambda stops: {"prompt": "hi", "stop": stops, "n_predict": 1}),
])
def test_stop_strings_are_capped_on_every_api(engine, path, body):
    server, thread = start(engine)
    host, port = server.server_address[:2]
    try:
        status, data = request(host, port, "POST", path, {**body(["x"] * 100_000), "model": MODEL})
        assert status == 400 and f"at most {MAX_STOP}" in data.decode(), data[:200]
        status, data = request(host, port, "POST", path, {**body(["x"] * MAX_STOP), "model": MODEL})
        assert status == 200, data[:200]
    finally:
        stop(server, thread)


# -- serve --template ----------------------------------------------------------------

def test_serve_template_replaces_the_models_own(tiny_llama_path, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}### assistant:")
    msgs = [{"role": "user", "content": "hello there"}]
    with Engine(str(tiny_llama_path), threads=1) as engine:
        own = len(engine.prompt_tokens(messages=msgs))
        engine.chat_template = template.read_text()
        want = len(engine.prompt_tokens(messages=msgs))
    assert want != own
    with serving(tiny_llama_path, "--threads", "1", "--drafter", "none", "--template", str(template)) \
            as (proc, host, port):
        status, body = request(host, port, "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 2})
        assert status == 200 and json.loads(body)["usage"]["prompt_tokens"] == want


@pytest.mark.parametrize("value, words", [("{path}", "cannot read template file"),
                                          ("nobody={good}", "not served"),
                                          ("{bad}", "template")])
def test_a_bad_serve_template_is_one_line_before_loading(tiny_llama_path, tmp_path, value, words):
    good, bad = tmp_path / "good.jinja", tmp_path / "bad.jinja"
    good.write_text("{{ messages[0]['content'] }}")
    bad.write_text("{% for m in messages %}{{ m['content'] }")
    arg = value.format(path=tmp_path / "absent.jinja", good=good, bad=bad)
    p = subprocess.run([sys.executable, "-m", "edgespec", "serve", "--model", str(tiny_llama_path), "--port", "0",
                        "--template", arg], capture_output=True, text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and lines[-1].startswith("error:") and words in lines[-1], p.stderr
