"""The HTTP side: uvicorn (httptools' parser) serving the application, with
edgespec's handling of what a parser refuses and of bodies left unread.

* A request the parser refuses (a bad request line, a malformed, repeated or
  conflicting Content-Length, Transfer-Encoding beside Content-Length) is a
  400 in OpenAI's error shape; a Content-Length over 2**64 a 413; a request
  line and headers over MAX_HEADER_BYTES a 431, counted before the parser
  holds any of it (it would buffer a header of any size).
* A request answered without reading its announced body (refused from its
  headers: 401, 411, 413, ...) ends its connection: our side is closed for
  writing, then what the client still sends is discarded (up to
  max_request_bytes, for LINGER_S), so that the close does not reset the
  connection before the client has read the answer.
* A client that ends its side before its body is complete gets a 400 naming
  the bytes that came; once its body is complete, ending its side counts as
  going away (its generation stops).
* A request must arrive whole (request line, headers, body) within
  ``request_timeout_s`` from its first byte (for the first request, from the
  connection's start), plus REQUEST_S_PER_KIB per KiB received, at most
  REQUEST_MAX_S: else a 408 and the connection closes. A client dripping a
  byte now and then (slowloris) or saying nothing holds a connection for
  seconds, not for ever; one that uploads at a few hundred bytes a second
  still gets there. Time a request waits on the server (a pipelined
  request while the one before is answered) does not count.
* At most ``max_connections`` are open at once: past it a new connection is
  answered 503 and closed (lingering as a refusal does, or at once past
  REFUSING_ROOM more), so that the process never runs out of file
  descriptors and accept() never fails; the file limit is raised to hold
  them if it can be (else Server refuses the setting).
"""
from __future__ import annotations

import asyncio
import json
import logging
import resource
import signal
import socket
import sys
import threading
from http import HTTPStatus

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..errors import InvalidArgumentError
from ..pool import EnginePool, model_name as served_name
from .app import allowed_hosts as hosts_answered
from .app import create_app
from .request import REQUEST_MAX_S, REQUEST_S_PER_KIB, Settings
from .errors import ApiError
from .metrics import Metrics
from .runner import SOCKET, Runners, log_to_stderr

LINGER_S = 1.0          # at most this long discarding an unread body after the answer
MAX_HEADER_BYTES = 64 * 1024   # a request line and headers, at most (a browser's are ~1-8 KiB)
KEEP_ALIVE_S = 30       # an idle connection is closed after this long
REFUSING_ROOM = 64      # refused connections that may linger beyond max_connections
FILES_RESERVED = 256    # open files kept for the process besides its connections (models, slots, pipes)


class _Transport:
    """The connection's transport as one request sees it: closing it after the
    answer lingers when the request's body was left unread."""

    def __init__(self, protocol: "Protocol"):
        self._protocol, self._transport = protocol, protocol.transport

    def write(self, data: bytes) -> None:
        self._transport.write(data)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        self._protocol.close_after_answer()


class Protocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 connection with the refusals described above."""

    def __init__(self, *args, settings: Settings, **kwargs):
        super().__init__(*args, **kwargs)
        self.settings = settings
        self.max_request_bytes = settings.max_request_bytes
        self._discard: int | None = None    # lingering: bytes still to discard
        self._linger = None
        self._head: int | None = 0          # bytes of the request line and headers so far; None: in a body
        self._deadline = None               # the timer of the request arriving, while it does
        self._started = 0.0                 # when the request (or the connection) began, loop time
        self._received = 0                  # bytes of it so far

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        over = len(self.connections) - self.settings.max_connections
        if over > 0:
            self._refuse(ApiError(503, f"this server has {self.settings.max_connections} connections open, the most "
                                  "it holds (edgespec serve --max-connections); try again shortly",
                                  type="server_error", code="too_many_connections"), linger=over <= REFUSING_ROOM)
            return
        self._await_request()

    def _await_request(self) -> None:
        """Start the clock of a request arriving (see the module docstring)."""
        self._started, self._received = self.loop.time(), 0
        self._deadline = self.loop.call_at(self._started + self.settings.request_timeout_s, self._check_deadline)

    def _check_deadline(self) -> None:
        self._deadline = None
        if self._discard is not None:
            return   # answered (refused) already: the connection is ending
        now = self.loop.time()
        # the request before it still being answered, or reading paused: it waits on us, not on
        # the client, and its clock starts again
        if self.flow.read_paused or (self.cycle is not None and self.cycle.response_started
                                     and not self.cycle.response_complete):
            self._started, self._received = now, 0
        allowed = min(REQUEST_MAX_S, self.settings.request_timeout_s + REQUEST_S_PER_KIB * self._received / 1024)
        if now < self._started + allowed:
            self._deadline = self.loop.call_at(self._started + allowed, self._check_deadline)
            return
        self._refuse(ApiError(408, f"the request did not arrive within {allowed:.0f} s ({self._received} bytes "
                              f"came; a request gets {self.settings.request_timeout_s:g} s and "
                              f"{REQUEST_S_PER_KIB:g} s more per KiB, at most {REQUEST_MAX_S:g} s)",
                              code="request_timeout"))

    def _stop_clock(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:   # a later request on the connection (the first's clock runs from the start)
            self._await_request()

    def on_headers_complete(self) -> None:
        self._head = None
        self.scope.setdefault("extensions", {})[SOCKET] = self.transport.get_extra_info("socket")
        super().on_headers_complete()
        if self.cycle is not None:
            self.cycle.transport = _Transport(self)

    def on_message_complete(self) -> None:
        self._head = 0   # a pipelined request's head may follow
        self._stop_clock()
        super().on_message_complete()

    def data_received(self, data: bytes) -> None:
        self._received += len(data)
        if self._discard is None:
            if self._head is not None and not self._head_fits(data):
                self._refuse(ApiError(431, f"request headers of more than {MAX_HEADER_BYTES // 1024} KiB",
                                      code="request_header_too_large"))
                return
            super().data_received(data)
            return
        self._discard -= len(data)
        if self._discard <= 0:
            self.transport.close()

    def _head_fits(self, data: bytes) -> bool:
        """Whether the head stays within MAX_HEADER_BYTES with ``data``,
        counted before the parser, which would hold a header of any size."""
        room = MAX_HEADER_BYTES - self._head
        self._head += len(data)
        return len(data) <= room or b"\r\n\r\n" in data[:room + 4]

    def eof_received(self) -> bool | None:
        cycle = self.cycle
        if self._discard is None and cycle is not None and cycle.more_body and not cycle.response_complete:
            # the body ended early: the request gets it as it is (then a 400), the
            # connection closes after the answer
            cycle.more_body = False
            cycle.keep_alive = False
            cycle.message_event.set()
            return True   # keep our side open for the answer
        return None       # the client has gone: close (the request sees http.disconnect)

    def connection_lost(self, exc) -> None:
        if self._linger is not None:
            self._linger.cancel()
        self._stop_clock()
        super().connection_lost(exc)

    def close_after_answer(self) -> None:
        if self.cycle is None or not self.cycle.more_body:
            self.transport.close()
            return
        self._discard = self.max_request_bytes
        self.flow.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._linger = self.loop.call_later(LINGER_S, self.transport.close)

    def send_400_response(self, msg: str) -> None:
        """The parser's refusal (called while its exception is handled)."""
        reason = sys.exc_info()[1]
        reason = str(reason) if isinstance(reason, httptools.HttpParserError) else msg
        if "overflow" in reason:   # a Content-Length past 2**64
            e = ApiError(413, f"request body of more than 2**64 bytes; this server takes at most "
                         f"{self.max_request_bytes} (edgespec serve --max-request-bytes)",
                         code="request_too_large")
        else:
            e = ApiError(400, f"malformed HTTP request: {reason}")
        self._refuse(e)

    def _refuse(self, e: ApiError, linger: bool = True) -> None:
        """Answer ``e`` before the request was parsed (or whole), then close the
        connection once what the client still sends is discarded (lingering),
        or at once."""
        self._stop_clock()
        body = json.dumps(e.body()).encode()
        self.transport.write(f"HTTP/1.1 {e.status} {HTTPStatus(e.status).phrase}"
                             f"\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
                             "connection: close\r\n\r\n".encode() + body)
        if not linger:
            self.transport.close()
            return
        self._discard = self.max_request_bytes
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._linger = self.loop.call_later(LINGER_S, self.transport.close)


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket. Its protocol is named (IPPROTO_TCP), so that
    asyncio sets TCP_NODELAY on the connections: a response's head and body,
    written apart, would otherwise wait on the client's delayed ACK (40 ms)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


def _hold_open_files(n: int) -> None:
    """Let this process open ``n`` files, raising its soft limit up to the
    hard one if needed; InvalidArgumentError when even that is too few."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or n <= soft:
        return
    if hard != resource.RLIM_INFINITY and n > hard:
        raise InvalidArgumentError(f"max_connections: {n} open files needed (connections and {FILES_RESERVED} "
                                   f"for the process), and this process may open at most {hard} (ulimit -Hn)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))


class _Uvicorn(uvicorn.Server):
    def __init__(self, config, runners: Runners):
        super().__init__(config)
        self.runners = runners

    def handle_exit(self, sig, frame) -> None:   # Ctrl-C: generations end at their next piece
        self.runners.set_stopping()
        super().handle_exit(sig, frame)


class Server:
    """A bound server for one Engine or an EnginePool's models:
    ``serve_forever()`` serves until ``shutdown()`` (from another thread) or
    Ctrl-C (from the main thread); ``server_close()`` releases the socket."""

    def __init__(self, engine, host: str, port: int, *, model_name: str, settings: Settings):
        _hold_open_files(settings.max_connections + REFUSING_ROOM + FILES_RESERVED)
        self.settings = settings
        self.metrics = Metrics(model_name)
        self.runners = Runners(engine, model_name, self.metrics, log_to_stderr)
        self.runner = self.runners.default
        self.app = create_app(self.runners, settings, self.metrics, log_to_stderr)
        self.socket = _listen(host, port)
        self.server_address = self.socket.getsockname()
        logging.getLogger("uvicorn").addHandler(logging.NullHandler())   # its messages are ours to write
        config = uvicorn.Config(self.app, lifespan="off", ws="none", log_config=None, access_log=False,
                                server_header=False, headers=[("server", "edgespec")],
                                timeout_keep_alive=KEEP_ALIVE_S,
                                http=lambda **kw: Protocol(settings=settings, **kw))
        self._uvicorn = _Uvicorn(config, self.runners)
        self._served = threading.Event()

    # what the tests and callers read
    engine = property(lambda self: self.runner.engine)
    engine_lock = property(lambda self: self.runner.turns)   # `with`: no generation runs meanwhile
    model_name = property(lambda self: self.runner.name)
    api_key = property(lambda self: self.settings.api_key)
    max_request_bytes = property(lambda self: self.settings.max_request_bytes)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def serve_forever(self) -> None:
        try:
            asyncio.run(self._uvicorn.serve(sockets=[self.socket]))
        finally:
            self._served.set()

    def shutdown(self) -> None:
        """Stop serving (from another thread), as Ctrl-C does: running
        generations end at their next piece (their answers say they were cut),
        queued ones get 503; wait for serve_forever to return."""
        self.runners.set_stopping()
        self._uvicorn.should_exit = True
        self._served.wait()

    def server_close(self) -> None:
        self.socket.close()

    def serve_until_interrupted(self) -> None:
        """serve_forever() until Ctrl-C or SIGTERM, then stop: the running generation ends
        at its next piece, queued ones never start. Returns holding every
        engine lock, so the caller may close the engine (or pool)."""
        def interrupt(*_):
            raise KeyboardInterrupt

        # SIGTERM stops it as Ctrl-C does: uvicorn handles both while it
        # serves, then raises the signal again, which would otherwise kill
        # the process before the engines are closed.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, interrupt)
        try:
            self.serve_forever()
        except KeyboardInterrupt:   # uvicorn raises the signal again once it has stopped
            pass
        finally:
            self.server_close()
            self.runners.stop()


def default_model_name(engine) -> str:
    """The id a server reports for ``engine``: the built-in name, or a file's
    stem; for a pool, its default model's name."""
    if isinstance(engine, EnginePool):
        return engine.default
    return served_name(engine.model_ref)


def make_server(engine, host: str = "127.0.0.1", port: int = 8080, *, model_name: str | None = None,
                allowed_hosts: tuple[str, ...] = (), **settings) -> Server:
    """Bind a server for ``engine`` (an Engine or an EnginePool) without
    serving (port 0 picks a free one). ``settings``: Settings' fields
    (api_key, max_request_bytes, cors_origins, quiet, max_connections, ...).
    ``allowed_hosts``: Host header names answered besides the bound address
    and this machine's local names (see app.allowed_hosts)."""
    settings = Settings(**{**settings, "api_key": settings.get("api_key") or None,
                           "cors_origins": tuple(settings.get("cors_origins", ())),
                           "allowed_hosts": hosts_answered(host, tuple(allowed_hosts))})
    return Server(engine, host, port, model_name=model_name or default_model_name(engine), settings=settings)


def serve(engine, host: str = "127.0.0.1", port: int = 8080, **kwargs) -> None:
    """Serve ``engine`` until Ctrl-C; returns once no generation is running,
    so the caller may close the engine."""
    server = make_server(engine, host, port, **kwargs)
    print(f"edgespec: serving {server.model_name} at {server.url} (Ctrl-C to stop)", file=sys.stderr, flush=True)
    server.serve_until_interrupted()
