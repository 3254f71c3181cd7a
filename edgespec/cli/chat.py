"""``edgespec chat``: an interactive chat in the terminal (see edgespec.chat.repl)."""
from __future__ import annotations

import typer

from ..text import utf8_text
from .base import app
from ..config import EngineConfig
from ..engine import Engine
from .options import SamplingOptions, engine_options, sampling_options, with_chat_model


@app.command()
@engine_options(exclude=("slots", "parallel"))
@sampling_options
def chat(
    engine: EngineConfig = ...,
    system: str = typer.Option(None, "--system", help="System prompt (default: none; the template's own default applies)."),
    template: str = typer.Option(None, "--template", help="Jinja chat template file (default: the model's own)."),
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", help="Most tokens per answer, > 0."),
    sampling: SamplingOptions = ...,
):
    """Chat with a model: streamed answers, multi-turn history, /help for commands.
    With stdin piped, answers each input line on stdout (stats on stderr). The
    oldest turns are dropped to fit the context; --seed is reused for every answer."""
    from ..chat.repl import read_template, run_chat

    if system is not None:
        utf8_text(system, "--system")
    template_text = read_template(template) if template else None  # fail before loading the model
    with Engine(config=with_chat_model(engine)[0]) as e:
        code = run_chat(e, system=system, template=template_text, max_tokens=max_tokens, **sampling.kwargs())
    raise typer.Exit(code)
