"""The server against hostile requests, on the tiny random llama (fast tier):
a Host header naming another site (DNS rebinding) is refused; a 200 MB
header is refused after its first 64 KiB and leaves no memory behind; a chat
template that renders without end is a 400 while the server keeps answering
and stops on SIGTERM; requests cut by the shutdown say so."""
from __future__ import annotations

import json
import signal
import threading
import time

import pytest

from edgespec import Engine
from edgespec.chat.template import RENDER_SECONDS
from edgespec.server import make_server
from edgespec.server.app import allowed_hosts
from hostile_server import RUNAWAY_TEMPLATE, chat, huge_header, request, rss, serving, with_template

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
