"""The ``edgespec`` command line. Commands parse options and call the library;
every EdgespecError becomes one line on stderr and exit code 2. The option
sets the commands share live in edgespec.cli.options; defaults may come from
a config file (edgespec.cli.config). ``edgespec --install-completion`` installs
typer's shell completion."""
from __future__ import annotations

import logging
import sys

import typer

from ..errors import EdgespecError

app = typer.Typer(no_args_is_help=True,
                  help="edgespec: fast local LLM generation with lossless speculative decoding.")
models_app = typer.Typer(no_args_is_help=True, help="List, fetch and inspect models.")
app.add_typer(models_app, name="models")
drafter_app = typer.Typer(no_args_is_help=True, help="Drafter data (n-gram caches) and specialized drafters.")
app.add_typer(drafter_app, name="drafter")
moe_app = typer.Typer(no_args_is_help=True, help="Mixture-of-experts files: upcycle, synth, prepare.")
app.add_typer(moe_app, name="moe")


def _version(show: bool) -> None:
    if show:
        from .. import __version__

        typer.echo(f"edgespec {__version__}")
        raise typer.Exit()


@app.callback()
def _options(ctx: typer.Context,
             version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                          help="Show the version and exit.")):
    """edgespec: fast local LLM generation with lossless speculative decoding."""
    from . import config

    ctx.default_map = config.defaults(ctx)


def fail(message: str) -> "typer.Exit":
    """Print a one-line error and return the exit to raise (code 2)."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def _show_notices() -> None:
    """The library's notices (the ``edgespec`` logger at INFO: a measurement of
    this machine being taken, say) as lines on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("edgespec: %(message)s"))
    log = logging.getLogger("edgespec")
    log.addHandler(handler)
    log.setLevel(logging.INFO)


def main() -> None:
    from . import bench, chat, drafter, generate, models, moe, onnx, serve  # noqa: F401  (register their commands)

    _show_notices()
    try:
        app()
    except EdgespecError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
