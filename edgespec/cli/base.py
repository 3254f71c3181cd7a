"""The Typer application, its command groups and what every command shares
(``fail``: the one-line error and exit code 2). The commands register on
these from their own modules; edgespec.cli.main imports them."""
from __future__ import annotations

import typer

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
