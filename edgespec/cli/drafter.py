"""`edgespec drafter ngram`: build a static n-gram cache for the cache drafter;
`edgespec drafter list`: a target's specialized drafters.

The corpus is tokenized with the target model's own tokenizer, loaded alone:
llama.cpp reads the vocabulary and skips the weights, so this works for
models of any size in a fraction of a second. Errors are raised as
EdgespecError; edgespec.cli.main prints them as one line with exit code 2.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from ..models import registry
from ..backends.vocab import Vocab
from . import drafter_app
from .options import MODEL_HELP
from ..drafters import routed
from ..drafters.cache import N_MAX_LIMIT, build_ngram_cache


@drafter_app.command("ngram")
def ngram_cmd(
    corpus: list[Path] = typer.Argument(..., help="UTF-8 text files whose n-grams to count."),
    model: str = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    out: Path = typer.Option(..., "--out", "-o", help="The cache file to write (replaced whole, never half-written)."),
    n_max: int = typer.Option(4, "--n-max", min=1, max=N_MAX_LIMIT,
                              help=f"Longest context counted, in tokens, [1, {N_MAX_LIMIT}]."),
) -> None:
    """Count the n-grams of CORPUS into a cache file for `--drafter cache --ngram-cache FILE`."""
    path = registry.model_path_checked(model or registry.default_model())
    t0 = time.perf_counter()
    with Vocab.load(path) as vocab:
        # Running text: no BOS, special tokens kept literal.
        stats = build_ngram_cache(lambda text: vocab.tokenize(text, add_special=False), corpus, out, n_max=n_max)
    typer.echo(f"wrote {stats['path']}: {stats['contexts']} contexts from {stats['tokens']} tokens "
               f"in {stats['files']} file(s), n_max {stats['n_max']}, {stats['bytes'] / 1e6:.1f} MB, "
               f"{time.perf_counter() - t0:.1f} s")


@drafter_app.command("list")
def list_cmd(
    model: str = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    drafters: Path = typer.Option(None, "--drafters", metavar="DIR", help="List the drafters of DIR and "
                                  "DIR/<model name>/ instead of the model's set (the shipped ones and "
                                  "$EDGESPEC_HOME/drafters/<model name>/)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per drafter instead of text."),
) -> None:
    """Show the specialized drafters of a target model: what each was trained on, its size, and why one
    that cannot draft for this model is left out of `--drafter auto`."""
    ref = model or registry.default_model()
    name = registry.model_name(ref)
    files = routed.set_files(name, drafters)
    with Vocab.load(registry.model_path_checked(ref)) as vocab:
        infos = routed.find_set(vocab, files)
    if as_json:
        for info in infos:
            typer.echo(json.dumps(info.to_dict(), ensure_ascii=False))
        return
    if not infos:
        folders = ", ".join(str(f) for f in routed.set_folders(name, drafters))
        typer.echo(f"no specialized drafters for {name} (looked in {folders})")
        return
    usable = sum(i.problem is None for i in infos)
    typer.echo(f"specialized drafters for {name}: {usable} of {len(infos)} usable by --drafter auto")
    for i in infos:
        if i.problem is not None:
            typer.echo(f"{i.path.name}: incompatible: {i.problem}")
        else:
            typer.echo(f"{i.path.name}: langs {', '.join(i.langs) or '-'}, {i.size / 1e6:.1f} MB, "
                       f"{i.n_params / 1e6:.1f}M parameters, vocabulary {i.n_vocab} of {i.target_n_vocab} "
                       f"tokens, trained for {i.target or '?'}")
            if i.recipe:
                typer.echo(f"  recipe: {i.recipe_summary()}")
        typer.echo(f"  {i.path}")
