"""What every endpoint shares: reading and checking a request (its body, its
JSON, the API key), answering an ApiError in the API's own shape, the
runner a request names, and streamed responses. edgespec.server.app builds
the application from the endpoints of openai.py and ollama.py, which build
on this module."""
from __future__ import annotations

import hmac
import json
import traceback
from dataclasses import dataclass

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .errors import OLLAMA, OPENAI, ApiError
from .runner import ClientGone, Runner, Runners


DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # a 128k-token context's text several times over


BODY_TIMEOUT_S = 120           # the longest a request body may take to arrive


@dataclass(frozen=True)
class Settings:
    api_key: str | None = None          # required as "Authorization: Bearer KEY" on the APIs
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    cors_origins: tuple[str, ...] = ()  # origins allowed ("*": any); empty: LOCAL_ORIGINS
    quiet: bool = False                 # no request log on stderr
    allowed_hosts: frozenset[str] | None = None   # Host header names answered (None: any); see app.allowed_hosts


def _announces_body(request: Request) -> bool:
    h = request.headers
    return "transfer-encoding" in h or h.get("content-length", "0").lstrip("0") != ""


async def read_body(request: Request) -> bytes:
    """The request body, read only once its headers have passed (a client
    waiting on Expect: 100-continue is told to send it by the first read).
    The HTTP parser has already refused a malformed or repeated Content-Length."""
    h = request.headers
    if "transfer-encoding" in h:
        raise ApiError(411, "chunked request bodies are not supported; send Content-Length")
    n = int(h.get("content-length", "0"))
    limit = request.app.state.settings.max_request_bytes
    if n > limit:
        raise ApiError(413, f"request body of {n} bytes; this server takes at most {limit} "
                       "(edgespec serve --max-request-bytes)", code="request_too_large")
    body = bytearray()
    try:
        with anyio.fail_after(BODY_TIMEOUT_S):
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone()
                body += message.get("body", b"")
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {BODY_TIMEOUT_S} s")
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
    """``handler`` (async, Request -> Response) with the API key checked first
    and its refusals answered in ``shape``."""

    async def run(request: Request) -> Response:
        try:
            if keyed:
                _check_key(request)
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
