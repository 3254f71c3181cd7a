"""An OpenAI-compatible HTTP server for one Engine, on the standard library.

    from edgespec import Engine
    from edgespec.server import serve
    with Engine("smollm2-135m", drafter="auto") as engine:
        serve(engine, port=8080)            # http://127.0.0.1:8080/v1

Endpoints: ``GET /health``, ``GET /v1/models``, ``GET /v1/models/{id}``,
``POST /v1/chat/completions`` and ``POST /v1/completions`` (``stream`` for
server-sent events). Responses carry OpenAI's fields plus ``edgespec``: the
speculative-decoding stats of the generation and its tokens per second.

Defaults where OpenAI's differ from the engine's: ``temperature`` is 1.0 when
omitted (OpenAI's default; send 0 for greedy, reproducible output),
``max_tokens`` is 256. ``n`` must be 1; tools, logprobs and penalties other
than none are not served (unknown fields are ignored, as OpenAI's clients send
extras). Ranges are OpenAI's: temperature in [0, 2] (below 1e-6 is greedy),
top_p in [0, 1] (0 keeps the most likely token only), at most 16 stop strings.

Limits. A request body over ``max_request_bytes`` (4 MiB by default, ``edgespec
serve --max-request-bytes``) is refused with 413 from its headers alone, before
anything is read, tokenized or locked. The prompt is tokenized before the
engine lock is taken (llama.cpp's tokenizer is read-only once a model is
loaded; llama-server tokenizes in its HTTP threads too), so a prompt over the
context is refused (400, ``context_length_exceeded``) without holding up the
running generation. ``max_tokens`` is capped at the room the prompt leaves in
the context: clients routinely send large values meaning "as much as fits",
and the answer ends there with finish_reason "length" either way.

HTTP. The API key is checked on the headers, before the body is read; so are
the body's framing (exactly one decimal Content-Length; Transfer-Encoding is
refused with 411, or 400 beside a Content-Length) and its size. A refused
request's body is never read: after the answer the connection is closed (what
the client still sends for another second is discarded, so that it can read
the answer before the close). A client sending ``Expect: 100-continue`` is
told to go on only once all of that has passed. Every refusal is a 4xx in
OpenAI's shape, {"error": {message, type, param, code}}; a 500 means a bug.

The engine is not thread-safe, so requests are served one at a time in the
order they take the lock; others wait. A client that goes away stops its
generation within a piece (a token, at most a step): between pieces the
socket is polled for end-of-file or a reset (a client that half-closes its
side after sending counts as gone).
"""
from __future__ import annotations

import hmac
import json
import math
import socket
import sys
import threading
import time
import traceback
import uuid
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from .errors import ContextOverflowError, EdgespecError, InvalidArgumentError

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # a 128k-token context's text several times over
DEFAULT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 1.0     # OpenAI's default
MAX_TEMPERATURE = 2.0         # OpenAI's range: [0, 2]
MIN_TEMPERATURE = 1e-6        # the sampler's smallest; below it is greedy
MIN_TOP_P = 1e-6              # the sampler's top_p is in (0, 1]; this keeps the top token only
MAX_STOP = 16                 # stop strings per request
LINGER_S = 1.0                # at most this long discarding an unread body after the answer
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
FINISH_REASON = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}

GET_PATHS = {"/health", "/v1/models"}
POST_PATHS = {"/v1/chat/completions", "/v1/completions"}


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ClientGone(Exception):
    """The client closed its connection while we were writing."""


# -- request validation ------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    """A finite JSON number (an integer may be too large for a float: finite all the same)."""
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


def _show(value, limit: int = 60) -> str:
    """A value for an error message: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _request(body: bytes) -> dict:
    """The JSON object of a request body; every string in it valid Unicode."""
    try:
        req = json.loads(body.decode("utf-8")) if body else None
        # a \ud800-style escape decodes to a lone surrogate, which no text can hold
        json.dumps(req, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff unpaired)")
    except (UnicodeDecodeError, ValueError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}")
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply")
    if not isinstance(req, dict):
        raise ApiError(400, "request body must be a JSON object")
    return req


def _options(body: dict) -> dict:
    """The engine options of a completion request (fields shared by both endpoints)."""
    opts: dict = {}
    param = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
    max_tokens = body.get(param)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not _is_int(max_tokens) or max_tokens <= 0:
        raise _bad(param, f"{param} must be an integer > 0, got {_show(max_tokens)}")
    opts["max_tokens"] = max_tokens

    temperature = body.get("temperature")
    if temperature is None:
        temperature = DEFAULT_TEMPERATURE
    if not _is_number(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
        raise _bad("temperature", f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], "
                   f"got {_show(temperature)}")
    opts["temperature"] = float(temperature) if temperature >= MIN_TEMPERATURE else 0.0

    top_p = body.get("top_p")
    if top_p is not None:
        if not _is_number(top_p) or not 0 <= top_p <= 1:
            raise _bad("top_p", f"top_p must be a number in [0, 1], got {_show(top_p)}")
        opts["top_p"] = max(float(top_p), MIN_TOP_P)

    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed) or not 0 <= seed < 2**64:
            raise _bad("seed", f"seed must be an integer in [0, 2**64), got {_show(seed)}")
        opts["seed"] = seed

    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not (isinstance(stops, list) and len(stops) <= MAX_STOP
                and all(isinstance(s, str) and s for s in stops)):
            raise _bad("stop", f"stop must be a non-empty string or a list of at most {MAX_STOP} "
                       "non-empty strings")
        opts["stop"] = stops

    n = body.get("n")
    if n is not None and not (_is_int(n) and n == 1):
        raise _bad("n", f"only n = 1 is supported, got {_show(n)}")
    return opts


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise _bad(f"messages[{i}]", f"messages[{i}] must be an object with role "
                       "system, developer, user or assistant")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):  # content parts: only text is served
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise _bad(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(p["text"] for p in content)
        elif not isinstance(content, str):
            raise _bad(f"messages[{i}].content", f"messages[{i}].content must be a string")
        out.append({"role": CHAT_ROLES[role], "content": content})
    return out


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise _bad("prompt", "prompt must be a non-empty string")
    return prompt


# -- the server ----------------------------------------------------------------------

class EdgespecServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer holding the engine, its lock and the settings."""

    daemon_threads = True

    def __init__(self, address, engine, *, api_key: str | None, model_name: str, quiet: bool,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
        if max_request_bytes <= 0:
            raise InvalidArgumentError(f"max_request_bytes must be > 0, got {max_request_bytes}")
        self.engine = engine
        self.engine_lock = threading.Lock()
        self.api_key = api_key
        self.model_name = model_name
        self.max_request_bytes = max_request_bytes
        self.quiet = quiet
        self.created = int(time.time())
        self.stopping = False       # set on shutdown: generations end at the next piece
        self._tokenizing = 0        # prompts being tokenized outside the engine lock
        self._tokenizers_done = threading.Condition()
        super().__init__(address, Handler)

    def serve_until_interrupted(self) -> None:
        """serve_forever() until Ctrl-C, then stop: close the socket and wait for
        the running generation (it ends at its next piece) and tokenizations. The
        engine lock is kept, so queued requests never start and the caller may
        close the engine."""
        try:
            self.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            with self._tokenizers_done:
                self.stopping = True
                self._tokenizers_done.wait_for(lambda: self._tokenizing == 0)
            self.server_close()
            self.engine_lock.acquire()

    @contextmanager
    def _tokenizer(self):
        """The engine's tokenizer, used outside the engine lock (never after shutdown)."""
        with self._tokenizers_done:
            if self.stopping:
                raise ApiError(503, "the server is shutting down", type="server_error")
            self._tokenizing += 1
        try:
            yield
        finally:
            with self._tokenizers_done:
                self._tokenizing -= 1
                self._tokenizers_done.notify_all()

    def prompt_tokens(self, prompt_args: dict) -> int:
        """The number of tokens of a request's prompt, counted outside the engine
        lock: a prompt over the context is refused here, so the engine, which
        tokenizes again under its lock, only ever tokenizes what fits."""
        param = "messages" if "messages" in prompt_args else "prompt"
        with self._tokenizer():
            try:
                n = len(self.engine.prompt_tokens(prompt_args.get("prompt"), prompt_args.get("messages")))
            except InvalidArgumentError as e:     # a chat template refusing the messages
                raise ApiError(400, str(e), param=param)
        if n == 0:   # text the tokenizer drops (control characters), no BOS to stand in
            raise ApiError(400, "the prompt has no tokens", param=param)
        n_ctx = self.engine.backend.n_ctx
        if n >= n_ctx:
            raise ApiError(400, f"the prompt is {n} tokens but the context holds {n_ctx}",
                           param=param, code="context_length_exceeded")
        return n

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def log(self, line: str) -> None:
        if not self.quiet:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()


class Handler(BaseHTTPRequestHandler):
    server: EdgespecServer
    protocol_version = "HTTP/1.1"     # keep-alive for JSON answers; streams close the connection
    server_version = "edgespec"
    timeout = 120                     # seconds a socket read or write may stall
    disable_nagle_algorithm = True    # stream each piece as it comes
    _body_unread = False              # the request announced a body not read yet: close after answering

    # -- plumbing ---------------------------------------------------------------

    def log_message(self, format, *args):   # the base class's own messages (bad request lines)
        self.server.log(f"{self.address_string()} {format % args}")

    def log_request(self, code="-", size="-"):
        self._status = code                   # logged once the request is done

    def send_error(self, code, message=None, explain=None):
        """The base class's errors (bad request line, unsupported method) in OpenAI's shape."""
        self.log_error("code %d, message %s", code, message)
        self.close_connection = True
        try:
            self._send_json(code, ApiError(code, message or self.responses.get(code, ("error",))[0],
                                           type="invalid_request_error").body())
        except OSError:
            pass

    def finish(self):
        super().finish()
        if self._body_unread:
            self._linger()

    def _linger(self) -> None:
        """After answering a request whose body was left unread: end our side, then
        discard what the client still sends (up to max_request_bytes, for LINGER_S),
        so that the close does not reset the connection before the client has read
        the answer (closing with unread data sends a reset)."""
        sock = self.connection
        left, deadline = self.server.max_request_bytes, time.monotonic() + LINGER_S
        try:
            sock.shutdown(socket.SHUT_WR)
            while left > 0 and time.monotonic() < deadline:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                data = sock.recv(min(left, 65536))
                if not data:
                    break
                left -= len(data)
        except OSError:   # a timeout or a reset: done either way
            pass

    def handle_expect_100(self):
        """Expect: 100-continue is answered in _read_body, once the headers have passed."""
        return True

    def _send_json(self, status: int, obj: dict, headers: dict | None = None) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode("utf-8")
        if self._body_unread:   # what follows on the connection is that body: end it
            self.close_connection = True
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _read_body(self) -> bytes:
        """The request body, read only once its headers have passed every check
        (a client waiting on Expect: 100-continue is told to send it now)."""
        lengths = self.headers.get_all("Content-Length") or []
        if self.headers.get_all("Transfer-Encoding"):
            if lengths:
                raise ApiError(400, "a request may not carry both Transfer-Encoding and Content-Length")
            raise ApiError(411, "chunked request bodies are not supported; send Content-Length")
        if not lengths:
            return b""
        if len(lengths) > 1:
            raise ApiError(400, f"a request carries one Content-Length header, got {len(lengths)}")
        value = lengths[0].strip()
        if not (value.isascii() and value.isdigit()):
            raise ApiError(400, f"invalid Content-Length {_show(value)}")
        limit = self.server.max_request_bytes
        if len(value.lstrip("0")) > len(str(limit)) or int(value) > limit:
            shown = value if len(value) <= 20 else value[:20] + "..."
            raise ApiError(413, f"request body of {shown} bytes; this server takes at most {limit} "
                           "(edgespec serve --max-request-bytes)", code="request_too_large")
        if self.headers.get("Expect", "").lower() == "100-continue" and self.request_version >= "HTTP/1.1":
            self.send_response_only(100)
            self.end_headers()
        n = int(value)
        body = self.rfile.read(n)
        if len(body) < n:
            raise ApiError(400, f"the request body ended after {len(body)} of its {n} bytes")
        self._body_unread = False
        return body

    def _check_auth(self) -> None:
        key = self.server.api_key
        if key is None:
            return
        given = self.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _handle(self, method: str) -> None:
        t0 = time.perf_counter()
        self._status, self._note, self._streaming = "-", "", False
        self._body_unread = bool(self.headers.get_all("Transfer-Encoding")) or any(
            v.strip().lstrip("0") for v in self.headers.get_all("Content-Length") or [])
        path = self.path.split("?", 1)[0]
        try:
            try:
                self._route(method, path)
            except ApiError as e:
                self._send_json(e.status, e.body(), e.headers)
            except (ClientGone, BrokenPipeError, ConnectionResetError):
                self.close_connection = True
                self._note = "client disconnected"
            except Exception:  # never a traceback to the client
                self.server.log(traceback.format_exc().rstrip())
                self.close_connection = True
                if not self._streaming:
                    self._send_json(500, ApiError(500, "internal server error", type="server_error").body())
        except OSError:
            self.close_connection = True
            self._note = self._note or "client disconnected"
        ms = 1000 * (time.perf_counter() - t0)
        note = f" {self._note}" if self._note else ""
        self.server.log(f'{self.address_string()} "{method} {self.path}" {self._status} {ms:.0f} ms{note}')

    def _client_gone(self) -> bool:
        """Whether the client has closed its connection (end-of-file waiting) or
        reset it. A peek without blocking: a pipelined next request is left alone."""
        sock = self.connection
        timeout = sock.gettimeout()
        sock.settimeout(0)
        try:
            return sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:   # nothing to read: still there
            return False
        except OSError:           # reset
            return True
        finally:
            sock.settimeout(timeout)

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def do_PUT(self):
        self._handle("PUT")

    def do_DELETE(self):
        self._handle("DELETE")

    def do_PATCH(self):
        self._handle("PATCH")

    # -- routes -------------------------------------------------------------------

    def _route(self, method: str, path: str) -> None:
        if path.startswith("/v1/"):
            self._check_auth()
        name = self.server.model_name
        model_path = f"/v1/models/{name}"
        if path in GET_PATHS or path == model_path:
            if method != "GET":
                raise ApiError(405, f"{method} is not allowed on {path}", headers={"Allow": "GET"})
            if path == "/health":
                self._send_json(200, {"status": "ok"})
            elif path == "/v1/models":
                self._send_json(200, {"object": "list", "data": [self._model_card()]})
            else:
                self._send_json(200, self._model_card())
        elif path in POST_PATHS:
            if method != "POST":
                raise ApiError(405, f"{method} is not allowed on {path}", headers={"Allow": "POST"})
            self._completion(chat=path == "/v1/chat/completions")
        elif path.startswith("/v1/models/"):
            raise ApiError(404, f"model {path[len('/v1/models/'):]!r} does not exist; this server has {name!r}",
                           code="model_not_found", param="model")
        else:
            raise ApiError(404, f"no such endpoint: {path}", code="not_found")

    def _model_card(self) -> dict:
        return {"id": self.server.model_name, "object": "model", "created": self.server.created,
                "owned_by": "edgespec"}

    def _completion(self, chat: bool) -> None:
        req = _request(self._read_body())
        model = req.get("model")
        if model is not None and not isinstance(model, str):
            raise _bad("model", "model must be a string")
        if model is not None and model != self.server.model_name:
            raise ApiError(404, f"model {_show(model)} does not exist; this server has "
                           f"{self.server.model_name!r}", param="model", code="model_not_found")
        opts = _options(req)
        stream = req.get("stream", False)
        if not isinstance(stream, bool):
            raise _bad("stream", "stream must be a boolean")
        stream_options = req.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise _bad("stream_options", "stream_options must be an object")
        include_usage = stream_options.get("include_usage") is True
        if chat:
            prompt_args = {"messages": _messages(req)}
        else:
            prompt_args = {"prompt": _prompt(req)}

        server = self.server
        n_prompt = server.prompt_tokens(prompt_args)
        opts["max_tokens"] = min(opts["max_tokens"], server.engine.backend.n_ctx - n_prompt)
        with server.engine_lock:
            if server.stopping:
                raise ApiError(503, "the server is shutting down", type="server_error")
            if self._client_gone():   # it left while queued
                raise ClientGone()
            try:
                pieces = server.engine.stream(**prompt_args, **opts)
            except ContextOverflowError as e:
                raise ApiError(400, str(e), param="messages" if chat else "prompt",
                               code="context_length_exceeded")
            except InvalidArgumentError as e:
                raise ApiError(400, str(e))
            except EdgespecError as e:
                raise ApiError(500, str(e), type="server_error")
            try:
                if stream:
                    self._stream(pieces, chat, include_usage)
                else:
                    self._whole(pieces, chat)
            except EdgespecError as e:   # the backend failed mid-generation
                if not self._streaming:
                    raise ApiError(500, str(e), type="server_error")
                self._event({"error": ApiError(500, str(e), type="server_error").body()["error"]})
            finally:
                pieces.close()   # a client gone: the generation ends here

    def _envelope(self, chat: bool, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        return {"id": self._id, "object": kind, "created": self._created, "model": self.server.model_name}

    def _extras(self, result) -> dict:
        s = result.stats
        usage = {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.n_tokens,
                 "total_tokens": s.prompt_tokens + s.n_tokens}
        extra = {"drafter": s.drafter, "tokens_per_s": round(s.tokens_per_s, 3),
                 "spec": s.spec.to_dict() if s.spec is not None else None}
        self._note = f"{s.n_tokens} tokens {s.tokens_per_s:.1f} tok/s"
        return {"usage": usage, "edgespec": extra}

    def _generated(self, pieces):
        """The pieces, stopping early when the server shuts down; ClientGone as
        soon as the client has left (checked after every piece)."""
        for piece in pieces:
            yield piece
            if self.server.stopping:
                return
            if self._client_gone():
                self._stop(pieces)
                raise ClientGone()

    def _stop(self, pieces) -> None:
        """End the generation now: this thread owns it, so closing it is
        immediate (Engine.cancel() is for stopping it from another thread)."""
        pieces.close()

    def _whole(self, pieces, chat: bool) -> None:
        self._id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self._created = int(time.time())
        text = "".join(self._generated(pieces))
        pieces.close()   # sets its result, also when stopped early
        result = pieces.result
        finish = FINISH_REASON.get(result.stats.stop_reason, "stop")
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        self._send_json(200, {**self._envelope(chat, False), "choices": [choice], **self._extras(result)})

    def _event(self, obj) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
        try:
            self.wfile.write(f"data: {data}\n\n".encode("utf-8"))
        except (BrokenPipeError, ConnectionResetError) as e:
            raise ClientGone() from e

    def _stream(self, pieces, chat: bool, include_usage: bool) -> None:
        self._id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self._created = int(time.time())
        self.close_connection = True          # the event stream ends with the connection
        self._streaming = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        head = self._envelope(chat, True)

        def chunk(delta_or_text, finish=None) -> dict:
            if chat:
                choice = {"index": 0, "delta": delta_or_text, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_or_text, "logprobs": None, "finish_reason": finish}
            return {**head, "choices": [choice]}

        if chat:
            self._event(chunk({"role": "assistant", "content": ""}))
        for piece in self._generated(pieces):
            self._event(chunk({"content": piece} if chat else piece))
        pieces.close()
        result = pieces.result
        extras = self._extras(result)
        final = chunk({} if chat else "", FINISH_REASON.get(result.stats.stop_reason, "stop"))
        final["edgespec"] = extras["edgespec"]
        self._event(final)
        if include_usage:
            self._event({**head, "choices": [], "usage": extras["usage"]})
        self._event("[DONE]")


# -- entry points -------------------------------------------------------------------

def default_model_name(engine) -> str:
    """The id a server reports for ``engine``: the built-in name, or a file's stem."""
    ref = engine.model_ref
    if ref.startswith("hf:"):
        return Path(ref[3:]).stem
    return Path(ref).stem if ref.endswith(".gguf") or Path(ref).exists() else ref


def make_server(engine, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
                model_name: str | None = None, quiet: bool = False,
                max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> EdgespecServer:
    """Bind a server for ``engine`` without serving (port 0 picks a free one).
    Run it with ``serve_forever()``; end it with ``shutdown()`` and ``server_close()``."""
    return EdgespecServer((host, port), engine, api_key=api_key or None,
                          model_name=model_name or default_model_name(engine), quiet=quiet,
                          max_request_bytes=max_request_bytes)


def serve(engine, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
          model_name: str | None = None, quiet: bool = False,
          max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
    """Serve ``engine`` until Ctrl-C; returns once no generation is running,
    so the caller may close the engine."""
    server = make_server(engine, host, port, api_key, model_name, quiet, max_request_bytes)
    print(f"edgespec: serving {server.model_name} at {server.url}/v1 (Ctrl-C to stop)",
          file=sys.stderr, flush=True)
    server.serve_until_interrupted()
