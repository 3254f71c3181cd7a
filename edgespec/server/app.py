"""The ASGI application (Starlette): the routes, the Host check, CORS,
refusals and the request log. The endpoints themselves live in openai.py,
ollama.py and metrics.py, over request.py's shared helpers; each parses its
request into a runner.Completion and leaves the engine to runner.py.

Every endpoint goes through ``request.endpoint()``: the API key is checked on the
headers before anything else, then, on a request that acts (POST, DELETE),
its Origin (this server's page, a --cors-origin one, or none) and its
Content-Type (JSON), so that no web page makes a browser act on it; an ApiError is answered in the shape of the
endpoint's API (OpenAI's or Ollama's); anything else is a logged 500. A
request whose announced body was not read (refused from its headers) is
answered with ``Connection: close``; the connection then stops reading it
(see http.py).
"""
from __future__ import annotations

import ipaddress
import time
from importlib import resources

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import anthropic, llamacpp, ollama, openai, responses
from .errors import OLLAMA, OPENAI, ApiError
from .request import LOCAL_NAMES, LOCAL_ORIGINS, Settings, endpoint, error_response, host_name
from .runner import Runners

PAGE_FILES = {"index.html": "text/html; charset=utf-8", "chat.js": "text/javascript; charset=utf-8",
              "markdown.js": "text/javascript; charset=utf-8", "chat.css": "text/css; charset=utf-8"}


# -- the Host header (DNS rebinding) ------------------------------------------------------

def allowed_hosts(host: str, extra: tuple[str, ...] = ()) -> frozenset[str] | None:
    """The Host header names a server bound to ``host`` answers. A page on a
    domain that an attacker re-points at 127.0.0.1 (DNS rebinding) reaches a
    local server with its own domain in Host: bound to a loopback address,
    only that address and this machine's local names (any port), plus
    ``extra`` (--allowed-host), are answered. Bound elsewhere, clients name
    the machine as they please: any Host (None), unless ``extra`` lists them."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:   # a host name
        loopback = False
    if not loopback and not extra:
        return None
    return frozenset(host_name(h) for h in (host, *LOCAL_NAMES, *extra))


class HostCheck:
    """ASGI middleware: a request whose Host header names none of
    ``Settings.allowed_hosts`` gets a 403 in its API's error shape. A request
    without one (HTTP/1.0) is no browser's: it passes."""

    def __init__(self, app, *, state):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        allowed = self.state.settings.allowed_hosts
        if scope["type"] == "http" and allowed is not None:
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            if host is not None and host_name(host) not in allowed:
                e = ApiError(403, f"Host {host[:100]!r} is not a name this server answers to (a guard against "
                             "DNS rebinding); serve with --allowed-host NAME to add it", code="host_not_allowed")
                shape = OLLAMA if scope["path"].startswith("/api/") else OPENAI
                return await error_response(Request(scope, receive), e, shape)(scope, receive, send)
        return await self.app(scope, receive, send)


# -- endpoints -------------------------------------------------------------------------











async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def metrics_text(request: Request) -> Response:
    data, content_type = request.app.state.metrics.render()
    return Response(data, headers={"Content-Type": content_type})


async def page(request: Request) -> Response:
    """The chat page (page/): static files bundled with the package."""
    name = request.path_params.get("name", "index.html")
    if name not in PAGE_FILES:
        raise ApiError(404, f"no such file: {name}", code="not_found")
    data = (resources.files(__package__) / "page" / name).read_bytes()
    return Response(data, headers={"Content-Type": PAGE_FILES[name], "Cache-Control": "no-cache"})


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """The router's refusals (no such path, method not allowed) as API errors."""
    path = request.url.path
    if exc.status_code == 405:
        e = ApiError(405, f"{request.method} is not allowed on {path}", headers=exc.headers)
    elif exc.status_code == 404:
        e = ApiError(404, f"no such endpoint: {path}", code="not_found")
    else:
        e = ApiError(exc.status_code, str(exc.detail), headers=exc.headers)
    return error_response(request, e, OLLAMA if path.startswith("/api/") else OPENAI)


# -- the request log -----------------------------------------------------------------

class RequestLog:
    """ASGI middleware: one log line per request (``client "METHOD path" status
    ms note``) and the request counters of /metrics."""

    def __init__(self, app, *, state):
        self.app, self.state = app, state
        self.paths = {r.path for r in state.routes if "{" not in r.path}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), 0

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope["path"]
            self.state.metrics.request(path if path in self.paths else "other", status)
            if not self.state.settings.quiet:
                ms = 1000 * (time.perf_counter() - t0)
                extra = scope.get("state", {}).get("note")
                client = (scope.get("client") or ("-",))[0]
                self.state.log(f'{client} "{scope["method"]} {path}" {status} {ms:.0f} ms'
                               + (f" {extra}" if extra else ""))


# -- the application -------------------------------------------------------------------

def create_app(runners: Runners, settings: Settings, metrics, log) -> Starlette:

    routes = [
        Route("/", endpoint(page, keyed=False), methods=["GET"]),
        Route("/page/{name}", endpoint(page, keyed=False), methods=["GET"]),
        Route("/health", endpoint(health, keyed=False), methods=["GET"]),
        Route("/v1/health", endpoint(health, keyed=False), methods=["GET"]),   # llama-server's second name
        Route("/metrics", endpoint(metrics_text), methods=["GET"]),
        *openai.routes(),
        *anthropic.routes(),
        *responses.routes(),
        *ollama.routes(),
        *llamacpp.routes(),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    state = app.state
    state.runners, state.settings, state.metrics, state.log = runners, settings, metrics, log
    state.routes = routes
    state.responses = responses.Stored()   # /v1/responses' conversations, for previous_response_id
    # add_middleware wraps what is there: CORS answers preflights before the
    # routes, the Host check comes before both, the log (outermost) sees every answer
    app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                       allow_origin_regex=None if settings.cors_origins else LOCAL_ORIGINS,
                       allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"], max_age=600)
    app.add_middleware(HostCheck, state=state)
    app.add_middleware(RequestLog, state=state)
    return app


# -- shared by the endpoints -------------------------------------------------------------



