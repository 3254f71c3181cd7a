"""Hostile requests against `edgespec serve` in a process of its own, and its
memory: shared by tests/test_server_hardening.py and
benchmarks/probe_hardening.py.

    with serving(model, "--threads", "1") as (proc, host, port):
        idle = rss(proc.pid)
        status = huge_header(host, port, 200 << 20)     # 431 after the first chunk
        status = chat(host, port, "hi")                 # (status, body)
        ends = slowloris(host, port, 100)               # [(status, seconds until dropped), ...]
"""
from __future__ import annotations

import contextlib
import http.client
import json
import re
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from gguf_mutants import STR, Mutant, Value, Workbench, read_layout

# A chat template that loops 10^10 times without output (the sandbox's
# per-loop cap is 100000), then renders the chat.
RUNAWAY_TEMPLATE = ("{% set r = range(100000)|list %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}"
                    "{{ messages[0].content }}")


@contextlib.contextmanager
def serving(model: Path, *args: str):
    """`edgespec serve` of ``model`` on a free port: (process, host, port);
    stopped (SIGKILL) at the end if it still runs."""
    proc = subprocess.Popen([sys.executable, "-m", "edgespec", "serve", "--model", str(model), "--port", "0",
                             "-q", *args], stderr=subprocess.PIPE, text=True)
    try:
        lines = []   # notices first (a first load measures this machine's costs), then the address
        while not (found := re.search(r"http://([\d.]+):(\d+)", line := proc.stderr.readline())) and line:
            lines.append(line)
        assert found, "".join(lines)
        yield proc, found.group(1), int(found.group(2))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()


def rss(pid: int) -> int:
    """Resident memory of a process, bytes."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


def request(host: str, port: int, method: str, path: str, body: dict | None = None,
            headers: dict | None = None, timeout: float = 120) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(method, path, body=json.dumps(body) if body is not None else None,
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def chat(host: str, port: int, content: str, **options) -> tuple[int, bytes]:
    return request(host, port, "POST", "/v1/chat/completions",
                   {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **options})


def huge_header(host: str, port: int, total: int, chunk: int = 1 << 20) -> tuple[int | None, int]:
    """Send a request whose one header is ``total`` bytes, ``chunk`` at a time,
    stopping as soon as the server answers: (its status or None, bytes sent)."""
    sock = socket.create_connection((host, port), timeout=30)
    sent = 0
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: ")
        block = b"a" * chunk
        while sent < total:
            try:
                sock.sendall(block)
            except OSError:   # the server closed after answering
                break
            sent += chunk
            sock.settimeout(0.05)
            try:
                if sock.recv(1, socket.MSG_PEEK):
                    break
            except (BlockingIOError, TimeoutError, socket.timeout):
                pass
            finally:
                sock.settimeout(30)
        data = b""
        with contextlib.suppress(OSError):
            while b"\r\n" not in data:
                more = sock.recv(4096)
                if not more:
                    break
                data += more
        found = re.match(rb"HTTP/1\.1 (\d+)", data)
        return (int(found.group(1)) if found else None), sent
    finally:
        sock.close()


def slowloris(host: str, port: int, n: int, every: float = 2.0,
              seconds: float = 60.0) -> list[tuple[int | None, float | None]]:
    """``n`` slowloris clients at once, in this thread: each a connection
    sending a request's head one byte every ``every`` seconds until the
    server answers or closes it, for at most ``seconds``. Per connection: (the
    answer's status, or None for a close without one; seconds until the
    server ended it, or None if it was still open at the end)."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n" * 1000
    t0 = time.monotonic()
    socks = []
    for _ in range(n):
        sock = socket.create_connection((host, port), timeout=30)
        sock.setblocking(False)
        socks.append(sock)
    data = {s: b"" for s in socks}
    ended: dict = {}
    sent = 0

    def end(sock) -> None:
        ended[sock] = time.monotonic() - t0
        sock.close()

    try:
        with selectors.DefaultSelector() as sel:
            for sock in socks:
                sel.register(sock, selectors.EVENT_READ)
            tick = t0
            while len(ended) < n and time.monotonic() - t0 < seconds:
                if time.monotonic() >= tick:   # one more byte on every open connection
                    for sock in socks:
                        if sock not in ended:
                            try:
                                sock.send(head[sent:sent + 1])
                            except OSError:   # reset: the server closed it
                                sel.unregister(sock)
                                end(sock)
                    sent, tick = sent + 1, tick + every
                for key, _ in sel.select(timeout=max(0.0, min(tick, t0 + seconds) - time.monotonic())):
                    sock = key.fileobj
                    try:
                        more = sock.recv(65536)
                    except OSError:
                        more = b""
                    data[sock] += more
                    if not more:   # the server closed it (after its answer, if any)
                        sel.unregister(sock)
                        end(sock)
    finally:
        for sock in socks:
            sock.close()
    return [(int(m.group(1)) if (m := re.match(rb"HTTP/1\.1 (\d+)", data[s])) else None, ended.get(s))
            for s in socks]


def with_template(model: Path, template: str, workdir: Path) -> contextlib.AbstractContextManager:
    """A copy of ``model`` whose chat template is ``template`` (a context: the path)."""
    layout, _ = read_layout(model)
    layout.kvs = [(k, v) for k, v in layout.kvs if k != b"tokenizer.chat_template"]
    layout.kvs.append((b"tokenizer.chat_template", Value(STR, template.encode())))

    @contextlib.contextmanager
    def copy():
        with Workbench(model, workdir) as bench, bench.applied(Mutant("template", layout)) as path:
            yield path
    return copy()
