"""`edgespec serve`: an HTTP server for one model (see edgespec.server): OpenAI's
and Ollama's APIs, /metrics and a chat page. Every option may also come from
its EDGESPEC_* environment variable or the [serve] table of the config file
(edgespec.cli.config). Ctrl-C stops it after the running generation's next piece."""
from __future__ import annotations

from typing import Optional

import typer

from ..server import DEFAULT_MAX_REQUEST_BYTES
from . import app, fail
from .options import EngineOptions, engine_options, with_envvar


def _opt(*args, **kwargs):
    return with_envvar(typer.Option(*args, **kwargs))


@app.command()
@engine_options(envvars=True)
def serve(
    engine: EngineOptions = ...,
    host: str = _opt("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = _opt(8080, "--port", help="TCP port, [0, 65535]; 0 picks a free one."),
    api_key: str = _opt(None, "--api-key", help="Require 'Authorization: Bearer KEY' on the APIs and /metrics "
                                                "(default: open)."),
    model_name: str = _opt(None, "--model-name", help="Model id clients send and /v1/models lists "
                                                      "(default: the built-in name or the file's stem)."),
    cors_origin: Optional[list[str]] = _opt(None, "--cors-origin",
                                            help="Browser origin allowed to call the server, e.g. "
                                                 "http://localhost:3000, or '*' for any (repeatable; default: "
                                                 "http://localhost:* and http://127.0.0.1:*)."),
    max_request_bytes: int = _opt(DEFAULT_MAX_REQUEST_BYTES, "--max-request-bytes",
                                  help="Largest request body accepted, in bytes, > 0 (4 MiB; "
                                       "a larger one gets 413 without being read)."),
    quiet: bool = _opt(False, "--quiet", "-q", help="No per-request log lines on stderr."),
):
    """Serve a model over HTTP: OpenAI's API (/v1), Ollama's (/api), /metrics and a chat page at /.
    Sampling settings come with each request."""
    from ..server import make_server

    if not 0 <= port <= 65535:
        raise fail(f"--port must be in [0, 65535], got {port}")
    if max_request_bytes <= 0:
        raise fail(f"--max-request-bytes must be > 0, got {max_request_bytes}")
    with engine.open() as e:
        try:
            server = make_server(e, host, port, api_key=api_key, model_name=model_name, quiet=quiet,
                                 max_request_bytes=max_request_bytes, cors_origins=tuple(cors_origin or ()))
        except OSError as err:
            raise fail(f"cannot listen on {host}:{port}: {err.strerror or err}")
        typer.echo(f"serving {server.model_name} (drafter {e.drafter}) at {server.url} (chat page), "
                   f"{server.url}/v1 (OpenAI), {server.url}/api (Ollama)"
                   f"{' with an API key' if server.api_key else ''}; Ctrl-C to stop", err=True)
        server.serve_until_interrupted()
        typer.echo("stopped", err=True)
