"""``edgespec chat``: an interactive chat in the terminal (see edgespec.chat.repl)."""
from __future__ import annotations

import typer

from . import BACKEND_HELP, DRAFT_BACKEND_HELP, EP_HELP, MODEL_HELP, app


@app.command()
def chat(
    model: str = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    backend: str = typer.Option("llama", help=BACKEND_HELP),
    ep: str = typer.Option(None, "--ep", help=EP_HELP),
    drafter: str = typer.Option("auto", help="none, ngram, recycle, cache, model or auto (chooses per step, "
                                            "and decodes plainly when speculation does not pay)."),
    draft_model: str = typer.Option(None, help="Draft model for --drafter model/auto (same tokenizer)."),
    draft_backend: str = typer.Option(None, help=DRAFT_BACKEND_HELP),
    ngram_cache: str = typer.Option(None, help="N-gram cache file for --drafter cache/auto."),
    system: str = typer.Option(None, "--system", help="System prompt (default: none; the template's own default applies)."),
    template: str = typer.Option(None, "--template", help="Jinja chat template file (default: the model's own)."),
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", help="Most tokens per answer (> 0)."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy; > 0 samples."),
    seed: int = typer.Option(None, help="RNG seed for sampling, reused for every answer (default: random)."),
    threads: int = typer.Option(None, help="CPU threads (default: physical cores)."),
    n_ctx: int = typer.Option(4096, "--ctx", help="Context window in tokens; the oldest turns are dropped to fit."),
    verbose: bool = typer.Option(False, "--verbose", help="Show llama.cpp's log."),
):
    """Chat with a model: streamed answers, multi-turn history, /help for commands.
    With stdin piped, answers each input line on stdout (stats on stderr)."""
    from ..chat.repl import read_template, run_chat
    from ..engine import Engine

    template_text = read_template(template) if template else None  # fail before loading the model
    with Engine(model, backend=backend, ep=ep, threads=threads, n_ctx=n_ctx, drafter=drafter,
                draft_model=draft_model, draft_backend=draft_backend, ngram_cache=ngram_cache,
                verbose=verbose) as engine:
        code = run_chat(engine, system=system, template=template_text, max_tokens=max_tokens,
                        temperature=temperature, seed=seed)
    raise typer.Exit(code)
