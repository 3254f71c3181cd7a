"""edgespec's HTTP server: OpenAI's API, Ollama's API, Prometheus metrics and
a chat page, for one Engine, on Starlette and uvicorn.

    from edgespec import Engine
    from edgespec.server import serve
    with Engine("smollm2-135m", drafter="auto") as engine:
        serve(engine, port=8080)            # http://127.0.0.1:8080/ (the chat page), /v1, /api

Modules: app.py (routes, API key, CORS, refusals, request bodies, the log),
openai.py and ollama.py (the two APIs), runner.py (where a request becomes
Engine calls), metrics.py (/metrics), http.py (the HTTP connection and the
Server), page/ (the chat page's static files).
"""
from .request import DEFAULT_MAX_REQUEST_BYTES, Settings  # noqa: F401
from .errors import ApiError  # noqa: F401
from .http import Server, default_model_name, make_server, serve  # noqa: F401
