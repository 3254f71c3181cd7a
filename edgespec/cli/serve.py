"""`edgespec serve`: an HTTP server for one or several models (see
edgespec.server and edgespec.pool): OpenAI's and Ollama's APIs, /metrics and
a chat page. The first model loads at start; the others when first asked
for, the least recently used idle one unloaded when a load would pass
--max-loaded-bytes. Requests to one model run --parallel at once, their
steps decoded together in one batch. Every option may also come from
its EDGESPEC_* environment variable or the [serve] table of the config file
(edgespec.cli.config). Ctrl-C stops it after the running generation's next piece."""
from __future__ import annotations

from typing import Optional

import typer

from ..server.request import (DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_SLOT_BYTES,
                              DEFAULT_MAX_SLOT_FILES, DEFAULT_REQUEST_TIMEOUT_S, REQUEST_MAX_S, REQUEST_S_PER_KIB)
from .base import app, fail
from ..config import MODEL_HELP, EngineConfig
from .options import engine_options, with_chat_model, with_envvar

DEFAULT_SLOTS = 3   # KV caches per model: an editor's completion, its chat and one more client


def _opt(*args, **kwargs):
    return with_envvar(typer.Option(*args, **kwargs))


@app.command()
@engine_options(envvars=True, exclude=("model",), defaults={"slots": DEFAULT_SLOTS, "parallel": None})
def serve(
    engine: EngineConfig = ...,
    models: Optional[list[str]] = _opt(None, "--model", "-m", help=MODEL_HELP + " Repeatable: every one "
                                       "is served under its name, the first is the default."),
    all_cached: bool = _opt(False, "--all-cached", help="Also serve every built-in model in the cache."),
    max_loaded_bytes: Optional[int] = _opt(None, "--max-loaded-bytes",
                                           help="Memory budget of the loaded models, bytes (file + KV caches); "
                                                "0: none (default: 80% of the memory available at start)."),
    keep_alive: str = _opt("5m", "--keep-alive",
                           help="How long an idle model stays loaded: seconds or a duration (30s, 5m, 1h); -1 keeps "
                                "it loaded (default: 5m, as Ollama; a request's keep_alive overrides it)."),
    host: str = _opt("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = _opt(8080, "--port", help="TCP port, [0, 65535]; 0 picks a free one."),
    api_key: str = _opt(None, "--api-key", help="Require 'Authorization: Bearer KEY' on the APIs and /metrics "
                                                "(default: open)."),
    model_name: str = _opt(None, "--model-name", help="Id of the first model, as clients send it and "
                                                      "/v1/models lists it (default: the built-in name or the "
                                                      "file's stem)."),
    cors_origin: Optional[list[str]] = _opt(None, "--cors-origin",
                                            help="Browser origin allowed to call the server, e.g. "
                                                 "http://localhost:3000, or '*' for any (repeatable; default: "
                                                 "http://localhost:* and http://127.0.0.1:*). A POST or DELETE "
                                                 "from a page of any other origin but the server's own gets 403."),
    allowed_host: Optional[list[str]] = _opt(None, "--allowed-host",
                                             help="A Host header name to answer besides the bound address, "
                                                  "localhost, 127.0.0.1 and [::1] (repeatable; a guard against "
                                                  "DNS rebinding: other names get 403; bound to a non-loopback "
                                                  "--host, any name unless this is given)."),
    max_request_bytes: int = _opt(DEFAULT_MAX_REQUEST_BYTES, "--max-request-bytes",
                                  help="Largest request body accepted, in bytes, > 0 (4 MiB; "
                                       "a larger one gets 413 without being read)."),
    allow_pull_from_hub: bool = _opt(False, "--allow-pull-from-hub",
                                     help="Let /api/create and /api/copy fetch hf:owner/repo/file.gguf from the "
                                          "Hugging Face Hub (default: refused with 403; the command line fetches)."),
    max_slot_files: int = _opt(DEFAULT_MAX_SLOT_FILES, "--max-slot-files",
                               help="Slot files /slots/N?action=save keeps, every model's together, >= 0 "
                                    f"({DEFAULT_MAX_SLOT_FILES}; a save past it gets 409)."),
    max_slot_bytes: int = _opt(DEFAULT_MAX_SLOT_BYTES, "--max-slot-bytes",
                               help=f"Their bytes in all, >= 0 ({DEFAULT_MAX_SLOT_BYTES >> 30} GiB; a save past it "
                                    "gets 409)."),
    max_connections: int = _opt(DEFAULT_MAX_CONNECTIONS, "--max-connections",
                                help=f"Connections open at once, >= 1 ({DEFAULT_MAX_CONNECTIONS}; one more is "
                                     "answered 503 and closed)."),
    request_timeout: float = _opt(DEFAULT_REQUEST_TIMEOUT_S, "--request-timeout",
                                  help=f"Seconds a request may take to arrive, from its first byte, > 0 "
                                       f"({DEFAULT_REQUEST_TIMEOUT_S:g}; plus {REQUEST_S_PER_KIB:g} s per KiB received, "
                                       f"at most {REQUEST_MAX_S:g} s; else 408 and the connection closes)."),
    template: Optional[list[str]] = _opt(None, "--template",
                                         help="Jinja chat template file for the first --model, or NAME=FILE for "
                                              "the model served as NAME (repeatable; as llama-server's "
                                              "--chat-template-file; default: each model's own, from its GGUF)."),
    quiet: bool = _opt(False, "--quiet", "-q", help="No per-request log lines on stderr."),
):
    """Serve models over HTTP: OpenAI's API (/v1), Ollama's (/api), /metrics and a chat page at /.
    Sampling settings come with each request."""
    from ..pool import EnginePool, cached_models, keep_alive_seconds
    from ..server import make_server

    if not 0 <= port <= 65535:
        raise fail(f"--port must be in [0, 65535], got {port}")
    for flag, value, low in (("--max-request-bytes", max_request_bytes, 1), ("--max-slot-files", max_slot_files, 0),
                             ("--max-slot-bytes", max_slot_bytes, 0), ("--max-connections", max_connections, 1)):
        if value < low:
            raise fail(f"{flag} must be >= {low}, got {value}")
    if not request_timeout > 0:
        raise fail(f"--request-timeout must be > 0, got {request_timeout}")
    if max_loaded_bytes is not None and max_loaded_bytes < 0:
        raise fail(f"--max-loaded-bytes must be >= 0, got {max_loaded_bytes}")
    refs: list = list(dict.fromkeys(models or []))
    if all_cached:
        refs += [name for name in cached_models() if name not in refs]
    refs = refs or [with_chat_model(engine)[0].model]
    if model_name:
        refs[0] = (model_name, refs[0])
    idle = keep_alive_seconds(keep_alive)
    with EnginePool(refs, engine, max_loaded_bytes=max_loaded_bytes, keep_alive=idle,
                    templates=_templates(template or [], refs)) as pool:
        with pool.engine() as e:   # the first model now: a bad file or option fails here
            drafter, parallel, slots = e.drafter, e.parallel, e.backend.n_slots
        try:
            server = make_server(pool, host, port, api_key=api_key, quiet=quiet,
                                 max_request_bytes=max_request_bytes, cors_origins=tuple(cors_origin or ()),
                                 allowed_hosts=tuple(allowed_host or ()), allow_pull_from_hub=allow_pull_from_hub,
                                 max_slot_files=max_slot_files, max_slot_bytes=max_slot_bytes,
                                 max_connections=max_connections, request_timeout_s=request_timeout)
        except OSError as err:
            raise fail(f"cannot listen on {host}:{port}: {err.strerror or err}")
        budget = f"{pool.budget / 2**30:.1f} GiB" if pool.budget else "none"
        typer.echo(f"serving {', '.join(pool.names)} (drafter {drafter}, {parallel} at once, {slots} slots each, "
                   f"memory budget {budget}) at {server.url} (chat page), {server.url}/v1 (OpenAI), {server.url}/api (Ollama)"
                   f"{' with an API key' if server.api_key else ''}; Ctrl-C to stop", err=True)
        server.serve_until_interrupted()
        typer.echo("stopped", err=True)


def _templates(given: list[str], refs: list) -> dict[str, str]:
    """--template values by served name: FILE is the first model's, NAME=FILE
    the named one's; each read and rendered once now, so that a bad one fails
    before anything loads."""
    from ..chat import template as chat_templates
    from ..chat.repl import read_template
    from ..pool import model_name

    first = refs[0][0] if isinstance(refs[0], tuple) else model_name(str(refs[0]))
    out: dict[str, str] = {}
    for value in given:
        name, sep, path = value.partition("=")
        if not sep or not name or "/" in name:   # a path (it may hold "="), not NAME=FILE
            name, path = first, value
        if name in out:
            raise fail(f"--template: two templates for {name}")
        text = read_template(path)
        chat_templates.render(text, [{"role": "user", "content": "hi"}])   # a template that cannot render: one line now
        out[name] = text
    return out
