"""`edgespec serve`: an OpenAI-compatible HTTP server for one model (see
edgespec.server). Ctrl-C stops it after the running generation's next piece."""
from __future__ import annotations

import typer

from ..server import DEFAULT_MAX_REQUEST_BYTES
from . import BACKEND_HELP, DRAFT_BACKEND_HELP, EP_HELP, MODEL_HELP, app, fail


@app.command()
def serve(
    model: str = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    backend: str = typer.Option("llama", help=BACKEND_HELP),
    ep: str = typer.Option(None, "--ep", help=EP_HELP),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8080, help="TCP port, [0, 65535]; 0 picks a free one."),
    api_key: str = typer.Option(None, "--api-key", envvar="EDGESPEC_API_KEY",
                                help="Require 'Authorization: Bearer KEY' on /v1 (default: open; "
                                     "also read from EDGESPEC_API_KEY)."),
    model_name: str = typer.Option(None, help="Model id clients send and /v1/models lists "
                                              "(default: the built-in name or the file's stem)."),
    threads: int = typer.Option(None, help="CPU threads (default: physical cores)."),
    n_ctx: int = typer.Option(4096, "--ctx", help="Context window in tokens."),
    gpu_layers: int = typer.Option(0, help="Layers to offload to Metal/CUDA/Vulkan, if llama.cpp has them."),
    drafter: str = typer.Option("auto", help="none, ngram, recycle, cache, model or auto (chooses per step, "
                                            "and decodes plainly when speculation does not pay)."),
    draft_model: str = typer.Option(None, help="Draft model for --drafter model/auto (same tokenizer)."),
    draft_backend: str = typer.Option(None, help=DRAFT_BACKEND_HELP),
    ngram_cache: str = typer.Option(None, help="N-gram cache file for --drafter cache/auto."),
    max_request_bytes: int = typer.Option(DEFAULT_MAX_REQUEST_BYTES,
                                          help="Largest request body accepted, in bytes, > 0 (4 MiB; "
                                               "a larger one gets 413 without being read)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No per-request log lines on stderr."),
    verbose: bool = typer.Option(False, "--verbose", help="Show llama.cpp's log."),
):
    """Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions)."""
    from ..engine import Engine
    from ..server import make_server

    if not 0 <= port <= 65535:
        raise fail(f"--port must be in [0, 65535], got {port}")
    if max_request_bytes <= 0:
        raise fail(f"--max-request-bytes must be > 0, got {max_request_bytes}")
    with Engine(model, backend=backend, ep=ep, threads=threads, n_ctx=n_ctx, gpu_layers=gpu_layers,
                drafter=drafter, draft_model=draft_model, draft_backend=draft_backend,
                ngram_cache=ngram_cache, verbose=verbose) as engine:
        try:
            server = make_server(engine, host, port, api_key=api_key, model_name=model_name, quiet=quiet,
                                 max_request_bytes=max_request_bytes)
        except OSError as e:
            raise fail(f"cannot listen on {host}:{port}: {e.strerror or e}")
        typer.echo(f"serving {server.model_name} (drafter {engine.drafter}) at {server.url}/v1"
                   f"{' with an API key' if server.api_key else ''}; Ctrl-C to stop", err=True)
        server.serve_until_interrupted()
        typer.echo("stopped", err=True)
