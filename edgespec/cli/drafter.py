"""`edgespec drafter ngram`: build a static n-gram cache for the cache drafter.

The corpus is tokenized with the target model's own tokenizer, loaded alone:
llama.cpp reads the vocabulary and skips the weights, so this works for
models of any size in a fraction of a second. Errors are raised as
EdgespecError; edgespec.cli.main prints them as one line with exit code 2.
"""
from __future__ import annotations

import time
from pathlib import Path

import typer

from ..models import registry
from ..backends.vocab import Vocab
from . import drafter_app
from .options import MODEL_HELP
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
