"""`edgespec models list | pull | add | remove | prune | verify | path | info`: thin commands over
edgespec.models.registry and edgespec.models.gguf. Errors are raised as
EdgespecError; edgespec.cli.main prints them as one line with exit code 2."""
from __future__ import annotations

import json
from typing import Optional

import typer

from ..errors import ModelFetchError
from ..models import registry
from .base import models_app
from ..models.gguf import ModelInfo, model_info


@models_app.command("list")
def list_cmd(as_json: bool = typer.Option(False, "--json", help="Print a JSON array.")) -> None:
    """List the built-in models and their cache status: cached, damaged or not cached (* = default)."""
    models = registry.list_models()
    if as_json:
        typer.echo(json.dumps(models, indent=2))
        return
    rows = [(("* " if m["default"] else "  ") + m["name"], _mb(m["size"]), m["status"],
             m["description"]) for m in models]
    header = ("  NAME", "SIZE", "STATUS", "DESCRIPTION")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
    for r in [header, *rows]:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[3])
    local = registry.local_models()
    if local:
        typer.echo("\nlocal models (edgespec models add):")
        for name, path in sorted(local.items()):
            typer.echo(f"  {name}  {path}")
    typer.echo(f"\ncache: {registry.models_dir()}")
    for m in models:
        if m["problem"]:
            typer.echo(m["problem"])


@models_app.command("pull")
def pull_cmd(
    name: str = typer.Argument(..., help="A built-in model name (see `edgespec models list`)."),
    force: bool = typer.Option(False, "--force", help="Download again even if cached (repairs a damaged file)."),
) -> None:
    """Download a built-in model into the cache (skipped if already there and intact)."""
    typer.echo(registry.pull(name, force=force))


@models_app.command("add")
def add_cmd(
    name: str = typer.Argument(..., help="The name to serve it under (letters, digits, . _ -)."),
    path: str = typer.Argument(..., help="A GGUF file on this machine (it stays where it is)."),
) -> None:
    """Give a local GGUF file a name, as Ollama's create does: `--model NAME`, the server's
    /api and /v1 then know it. The file is validated as a model first."""
    typer.echo(f"{name}: {registry.add_local(name, path)}")


@models_app.command("remove")
def remove_cmd(name: str = typer.Argument(..., help="A name from `edgespec models add`, or a built-in model.")) -> None:
    """Forget a model: a name from `models add` is dropped (its file stays); a built-in
    model's cached copy is deleted."""
    typer.echo(registry.remove(name))


@models_app.command("prune")
def prune_cmd(
    max_gb: Optional[float] = typer.Option(
        None, "--max-gb", min=0.0,
        help="The most GiB the native engine's repacked weights may keep in the cache; the least recently "
             "used go first (default: EDGESPEC_REPACK_MAX_GB, else "
             f"{registry.REPACKED_MAX_BYTES >> 30}). Every load applies the same bound."),
) -> None:
    """Remove repacked weights of models that are gone or unused for 30 days, parts left by killed
    loads, and the least recently used past the bound."""
    freed = registry.prune_repacked(max_bytes=None if max_gb is None else int(max_gb * (1 << 30)))
    typer.echo(f"freed {_mb(freed)} in {registry.home() / registry.REPACKED_DIR}")


@models_app.command("verify")
def verify_cmd(
    names: Optional[list[str]] = typer.Argument(None, help="Built-in model names (default: every cached one)."),
    repair: bool = typer.Option(False, "--repair", help="Download a damaged model again."),
) -> None:
    """Check cached models against their full sha256 (a load checks size, mtime and
    sampled windows only). Exit code 2 if one is damaged and not repaired."""
    entries = [registry.builtin_model(n) for n in names] if names else \
        [e for e in registry.builtin_models().values() if registry.cached_path(e).is_file()]
    if not entries:
        typer.echo("no built-in model is cached")
    damaged = []
    for entry in entries:
        status, problem = registry.cache_status(entry, full=True, progress=True)
        typer.echo(problem or f"{entry.name}: {status}")
        if problem and repair:
            registry.pull_entry(entry, force=True)
            typer.echo(f"{entry.name}: repaired")
        elif problem:
            damaged.append(problem)
    if len(damaged) == 1:
        raise ModelFetchError(damaged[0])
    if damaged:
        raise ModelFetchError(f"{len(damaged)} cached models are damaged; "
                              "run: edgespec models verify --repair")


@models_app.command("path")
def path_cmd(ref: str = typer.Argument(..., help="A built-in name, a .gguf path, or hf:owner/repo/file.gguf.")) -> None:
    """Print the local file of a model, downloading it first if needed.
    The path is the last line of stdout."""
    typer.echo(registry.resolve(ref))


@models_app.command("info")
def info_cmd(
    ref: str = typer.Argument(..., help="A built-in name, a .gguf path, or hf:owner/repo/file.gguf."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Show a model's architecture, size, quantization, vocabulary and chat template."""
    from ..backends import check_model, default_backend

    path = check_model(ref)
    info, backend = model_info(path), default_backend(path)
    if as_json:
        typer.echo(json.dumps({**info.to_dict(), "default_backend": backend}, indent=2))
    else:
        for label, value in _info_rows(info) + [("default backend", backend)]:
            typer.echo(f"{label:<16}{value}")


def _info_rows(i: ModelInfo) -> list[tuple[str, str]]:
    def opt(v) -> str:
        return "?" if v is None else str(v)

    types = ", ".join(f"{t} x{n}" for t, n in sorted(i.tensor_types.items(), key=lambda kv: -kv[1]))
    heads = opt(i.n_heads) + (f" (kv {i.n_kv_heads})" if i.n_kv_heads is not None else "")
    template = f"yes ({len(i.chat_template)} chars)" if i.has_chat_template else "no"
    return [
        ("file", f"{i.path} ({_mb(i.file_size)}, GGUF v{i.gguf_version})"),
        ("name", opt(i.name)),
        ("architecture", opt(i.architecture)),
        ("parameters", f"{i.n_params / 1e6:.1f}M in {i.n_tensors} tensors"),
        ("file type", opt(i.file_type)),
        ("tensor types", types or "-"),
        ("vocabulary", opt(i.vocab_size)),
        ("context length", opt(i.context_length)),
        ("embedding", opt(i.embedding_length)),
        ("layers", opt(i.n_layers)),
        ("heads", heads),
        ("bos / eos", f"{opt(i.bos_token_id)} / {opt(i.eos_token_id)}"),
        ("chat template", template),
    ]


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
