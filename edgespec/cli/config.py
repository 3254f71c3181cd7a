"""The configuration file: defaults for command options.

``~/.config/edgespec/config.toml`` (or the file $EDGESPEC_CONFIG names) holds
one table per command, keyed by option name (``max-request-bytes`` or
``max_request_bytes``)::

    [serve]
    model = "qwen2.5-coder-0.5b"
    port = 11434
    cors-origin = ["http://localhost:3000"]

A value given on the command line wins, then an environment variable
(``EDGESPEC_PORT``, ... as ``--help`` shows), then the file, then the
built-in default. A file that cannot be read, an unknown table or key, or a
value of the wrong kind is a one-line error naming the file and the key.
"""
from __future__ import annotations

import os
import tomllib
from pathlib import Path

import typer

from ..errors import InvalidArgumentError

ENV = "EDGESPEC_CONFIG"


def path() -> Path:
    env = os.environ.get(ENV)
    return Path(env).expanduser() if env else Path.home() / ".config" / "edgespec" / "config.toml"


def _params(command) -> dict:
    """A command's options by every name a config key may use."""
    names = {}
    for p in command.params:
        if p.param_type_name != "option" or p.name is None:
            continue
        names[p.name] = p
        for opt in p.opts:
            if opt.startswith("--"):
                names[opt[2:]] = p
    return names


def defaults(ctx: typer.Context) -> dict | None:
    """The click default_map of the config file (None without one)."""
    file = path()
    if not file.is_file():
        if os.environ.get(ENV):
            raise InvalidArgumentError(f"{file}: no such config file (${ENV})")
        return None
    try:
        data = tomllib.loads(file.read_text("utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgumentError(f"{file}: cannot read the config file: {getattr(e, 'strerror', None) or e}")
    except tomllib.TOMLDecodeError as e:
        raise InvalidArgumentError(f"{file}: not valid TOML: {e}")
    group = ctx.command
    out = {}
    for section, values in data.items():
        command = group.get_command(ctx, section)
        if command is None or not isinstance(values, dict) or hasattr(command, "commands"):
            raise InvalidArgumentError(f"{file}: [{section}] is not a command's table "
                                       f"(commands: {', '.join(group.list_commands(ctx))})")
        params = _params(command)
        table = out[section] = {}
        for key, value in values.items():
            p = params.get(key)
            if p is None:
                raise InvalidArgumentError(f"{file}: unknown key {section}.{key} (known: "
                                           f"{', '.join(sorted(k for k in params if '_' not in k))})")
            if p.multiple and not isinstance(value, list):
                value = [value]
            try:
                converted = p.get_runtime_param().coerce(value, param=p, ctx=ctx)   # typer's own conversion
            except Exception as e:   # click's BadParameter: its message, without the option's flags
                message = getattr(e, "message", None) or str(e)
                raise InvalidArgumentError(f"{file}: {section}.{key}: {message}")
            if (list(converted) if p.multiple else converted) != value:   # "8080" for a number, 1 for a text
                shown = type(converted[0] if p.multiple and converted else converted).__name__
                raise InvalidArgumentError(f"{file}: {section}.{key}: expected {'a list of ' if p.multiple else ''}"
                                           f"{shown}, got {value!r}"[:300])
            table[p.name] = value
    return out
