"""What every endpoint shares: reading and checking a request (its body, its
JSON, the API key, where it comes from), answering an ApiError in the API's own shape, the
runner a request names, and streamed responses. edgespec.server.app builds
the application from the endpoints of openai.py and ollama.py, which build
on this module."""
from __future__ import annotations

import hmac
import json
import re
import traceback
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import InvalidArgumentError
from .errors import OLLAMA, OPENAI, ApiError
from .runner import ClientGone, Runner, Runners


DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # a 128k-token context's text several times over
DEFAULT_MAX_CONNECTIONS = 512   # open at once; beyond it a connection gets 503 (see http.py)
DEFAULT_REQUEST_TIMEOUT_S = 10.0   # a request's head and first KiB, from its first byte (see http.py)
REQUEST_S_PER_KIB = 2.0         # more time a request gets per KiB received (a 4 MiB body: 35 KB/s at the most)
REQUEST_MAX_S = 120.0           # the longest any request may take to arrive
DEFAULT_MAX_SLOT_FILES = 64     # /slots/N?action=save files kept, over every model
DEFAULT_MAX_SLOT_BYTES = 4 << 30   # ... and their bytes (a 4k-token slot of a 1.5B model: ~120 MB)

# Browser pages that may call the API when no --cors-origin is given: any port on this machine.
LOCAL_ORIGINS = r"http://(localhost|127\.0\.0\.1)(:\d+)?"
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")   # those that change nothing: no Origin check


@dataclass(frozen=True)
class Settings:
    api_key: str | None = None          # required as "Authorization: Bearer KEY" on the APIs
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    cors_origins: tuple[str, ...] = ()  # origins allowed ("*": any); empty: LOCAL_ORIGINS
    quiet: bool = False                 # no request log on stderr
    allowed_hosts: frozenset[str] | None = None   # Host header names answered (None: any); see app.allowed_hosts
    allow_pull_from_hub: bool = False   # /api/create and /api/copy may fetch hf:owner/repo/file.gguf
    max_slot_files: int = DEFAULT_MAX_SLOT_FILES   # 0: no slot saves
    max_slot_bytes: int = DEFAULT_MAX_SLOT_BYTES
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S

    def __post_init__(self):
        for name, low in (("max_request_bytes", 1), ("max_slot_files", 0), ("max_slot_bytes", 0),
                          ("max_connections", 1)):
            if getattr(self, name) < low:
                raise InvalidArgumentError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if not self.request_timeout_s > 0:
            raise InvalidArgumentError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")

    def allows_origin(self, origin: str) -> bool:
        """Whether a page from ``origin`` may call the server (what CORS allows too)."""
        if not self.cors_origins:
            return re.fullmatch(LOCAL_ORIGINS, origin) is not None
        return "*" in self.cors_origins or origin in self.cors_origins


def host_name(value: str) -> str:
    """A Host header's name: without its port or an IPv6 address's brackets,
    lower case, no trailing dot."""
    value = value.strip().lower()
    if value.startswith("["):
        value = value[1:value.find("]")] if "]" in value else value[1:]
    elif value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".")


def _port(netloc: str) -> str:
    """The port a Host header or an origin's host names, "" for the scheme's default."""
    _, colon, port = netloc.rpartition(":")
    return port if colon and "]" not in port else ""


def _same_origin(origin: str, host: str | None) -> bool:
    """Whether ``origin`` (a page's scheme://host[:port]) is this server's own,
    as the request's Host names it: the same name and port, or a loopback
    name and the same port (the chat page opened as localhost, asking 127.0.0.1)."""
    scheme, sep, netloc = origin.lower().partition("://")
    if host is None or not sep or scheme not in ("http", "https") or "/" in netloc:
        return False
    if _port(netloc) != _port(host.lower()):
        return False
    name, own = host_name(netloc), host_name(host)
    return name == own or (name in LOCAL_NAMES and own in LOCAL_NAMES)


def _is_json(content_type: str) -> bool:
    """application/json, or a +json type (application/vnd.x+json), with any parameters."""
    kind = content_type.partition(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def _check_origin(request: Request) -> None:
    """A request that acts (not GET/HEAD/OPTIONS) from a web page comes from
    this server's own page or one --cors-origin allows. Browsers name the page
    in Origin on every such request; without one it is no browser's (curl,
    SDKs) and passes."""
    h = request.headers
    origin = h.get("origin")
    if origin is not None and not (_same_origin(origin, h.get("host"))
                                   or request.app.state.settings.allows_origin(origin)):
        raise ApiError(403, f"a page from {origin[:100]!r} may not call this server (a guard against cross-site "
                       "requests); serve with --cors-origin ORIGIN to allow it", code="origin_not_allowed")


def _announces_body(request: Request) -> bool:
    h = request.headers
    return "transfer-encoding" in h or h.get("content-length", "0").lstrip("0") != ""


async def read_body(request: Request) -> bytes:
    """The request body, read only once its headers have passed (a client
    waiting on Expect: 100-continue is told to send it by the first read),
    among them a JSON Content-Type.
    The HTTP parser has already refused a malformed or repeated Content-Length."""
    h = request.headers
    if "transfer-encoding" in h:
        raise ApiError(411, "chunked request bodies are not supported; send Content-Length")
    n = int(h.get("content-length", "0"))
    limit = request.app.state.settings.max_request_bytes
    if n > limit:
        raise ApiError(413, f"request body of {n} bytes; this server takes at most {limit} "
                       "(edgespec serve --max-request-bytes)", code="request_too_large")
    content_type = h.get("content-type")
    if content_type is None or not _is_json(content_type):
        # a browser sends JSON across sites only after a preflight, which CORS refuses to other
        # origins; a form, text/plain or typeless POST needs none
        got = "none" if content_type is None else repr(content_type[:100])
        raise ApiError(415, f"Content-Type must be application/json, got {got} (curl: -H 'Content-Type: "
                       "application/json'; a guard against cross-site requests)", code="unsupported_media_type")
    body = bytearray()
    while True:   # the connection bounds how long it may take (http.py)
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    request.state.body_read = True
    if len(body) < n:   # the client ended its side early (see http.py)
        raise ApiError(400, f"the request body ended after {len(body)} of its {n} bytes")
    return bytes(body)


def parse_json(body: bytes) -> dict:
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


async def read_json(request: Request) -> dict:
    return parse_json(await read_body(request))


def runners_of(request: Request) -> Runners:
    return request.app.state.runners


def note(request: Request, text: str) -> None:
    """A few words for the request's log line."""
    request.state.note = text


def error_response(request: Request, e: ApiError, shape: str) -> Response:
    headers = dict(e.headers)
    if _announces_body(request) and not getattr(request.state, "body_read", False):
        headers["Connection"] = "close"   # what follows on the connection is that body
    return JSONResponse(e.body(shape), e.status, headers=headers)


def _check_key(request: Request) -> None:
    key = request.app.state.settings.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":   # Anthropic's SDK sends its key as x-api-key
        token = request.headers.get("x-api-key", "")
    if not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise ApiError(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def endpoint(handler, shape: str = OPENAI, keyed: bool = True):
    """``handler`` (async, Request -> Response) with the API key checked first,
    then a request that acts checked for a cross-site origin, and its
    refusals answered in ``shape``."""

    async def run(request: Request) -> Response:
        try:
            if keyed:
                _check_key(request)
            if request.method not in SAFE_METHODS:
                _check_origin(request)
            return await handler(request)
        except ApiError as e:
            return error_response(request, e, shape)
        except ClientGone:
            note(request, "client disconnected")
            return Response(status_code=499)   # never sent: the connection is gone
        except Exception:  # a bug: never a traceback to the client
            request.app.state.log(traceback.format_exc().rstrip())
            return error_response(request, ApiError(500, "internal server error", type="server_error"), shape)

    return run


def pick_runner(request: Request, model, *, add: bool = True) -> Runner:
    """The runner serving ``model`` (a name as /v1/models lists it, or Ollama's
    ``name:latest``; None: the default); 404 naming what is served. With a
    pool, a built-in model it may pull is added (unless ``add`` is False)."""
    return runners_of(request).get(model, add=add)


async def stream_pieces(request: Request, job):
    """A streamed answer's text pieces; then, instead of the final chunk, the
    ApiError that ends it when it does not end cleanly (the engine failed,
    the server's shutdown cut it). Nothing more when the client left: the
    caller sends its final chunk only if the last item was a piece and
    ``job.client_gone`` is false."""
    try:
        async for piece in job.pieces():
            yield piece
    except ApiError as e:
        yield e
        return
    if job.client_gone:
        note(request, "client disconnected")
    elif job.cut:
        yield job.cut_error()


class Stream:
    """A streamed answer (ASGI): each chunk is sent as soon as it is made."""

    def __init__(self, chunks, content_type: str):
        self.chunks = chunks
        self.headers = [(b"content-type", content_type.encode()), (b"cache-control", b"no-cache")]

    async def __call__(self, scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        async for chunk in self.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
