"""`edgespec serve`: an OpenAI-compatible HTTP server for one model (see
edgespec.server). Ctrl-C stops it after the running generation's next piece."""
from __future__ import annotations

import typer

from ..server import DEFAULT_MAX_REQUEST_BYTES
from . import app, fail
from .options import EngineOptions, engine_options


@app.command()
@engine_options
def serve(
    engine: EngineOptions = ...,
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8080, help="TCP port, [0, 65535]; 0 picks a free one."),
    api_key: str = typer.Option(None, "--api-key", envvar="EDGESPEC_API_KEY",
                                help="Require 'Authorization: Bearer KEY' on /v1 (default: open; "
                                     "also read from EDGESPEC_API_KEY)."),
    model_name: str = typer.Option(None, help="Model id clients send and /v1/models lists "
                                              "(default: the built-in name or the file's stem)."),
    max_request_bytes: int = typer.Option(DEFAULT_MAX_REQUEST_BYTES,
                                          help="Largest request body accepted, in bytes, > 0 (4 MiB; "
                                               "a larger one gets 413 without being read)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No per-request log lines on stderr."),
):
    """Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions).
    Sampling settings come with each request."""
    from ..server import make_server

    if not 0 <= port <= 65535:
        raise fail(f"--port must be in [0, 65535], got {port}")
    if max_request_bytes <= 0:
        raise fail(f"--max-request-bytes must be > 0, got {max_request_bytes}")
    with engine.open() as e:
        try:
            server = make_server(e, host, port, api_key=api_key, model_name=model_name, quiet=quiet,
                                 max_request_bytes=max_request_bytes)
        except OSError as err:
            raise fail(f"cannot listen on {host}:{port}: {err.strerror or err}")
        typer.echo(f"serving {server.model_name} (backend {e.backend.name}, drafter {e.drafter}) at {server.url}/v1"
                   f"{' with an API key' if server.api_key else ''}; Ctrl-C to stop", err=True)
        server.serve_until_interrupted()
        typer.echo("stopped", err=True)
