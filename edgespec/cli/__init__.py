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
from .base import app, fail  # noqa: F401  (the application, and fail for the commands)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a notice comes (main() may run
    many times in one process, each with its own stderr: a test's capture)."""

    stream = property(lambda self: sys.stderr, lambda self, value: None)


def _show_notices() -> None:
    """The library's notices (the ``edgespec`` logger at INFO: a measurement of
    this machine being taken, say) as lines on stderr, by one handler however
    often main() runs."""
    log = logging.getLogger("edgespec")
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("edgespec: %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)


def main() -> None:
    from . import bench, chat, demo, drafter, generate, models, moe, onnx, serve  # noqa: F401  (register their commands)

    _show_notices()
    try:
        app()
    except EdgespecError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
