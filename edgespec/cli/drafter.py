"""`edgespec drafter ngram`: build a static n-gram cache for the cache drafter;
`edgespec drafter rank`: a tokenizer's token ranking, for trimmed draft heads;
`edgespec drafter distill` / `train`: make a specialized drafter for a target;
`edgespec drafter train-head`: a draft head on a target's own features;
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
from typing import Optional

import typer

from ..models import registry
from ..backends.vocab import Vocab
from .base import drafter_app
from .options import ENGINE_OPTIONS
from ..config import MODEL_HELP
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


@drafter_app.command("rank")
def rank_cmd(
    model: str = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    chars: int = typer.Option(4_000_000, "--chars", help="Characters of text counted, spread over "
                              "dataset-build's languages and Python code, > 0."),
) -> None:
    """Rank MODEL's tokens by how often text uses them, for `--draft-vocab N`
    (a draft head trimmed to the N most used). The built-in models' rankings ship."""
    from ..errors import InvalidArgumentError
    from ..training.ranking import rank_tokens

    if chars <= 0:
        raise InvalidArgumentError(f"--chars must be > 0, got {chars}")
    out = rank_tokens(model or registry.default_model(), chars=chars)
    typer.echo(f"wrote {out}")


@drafter_app.command("distill")
def distill_cmd(
    model: str = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    lang: str = typer.Option(..., "--lang", help="The language or domain tag (python, deu, ...): the "
                             "dataset-build text read, and the tag the drafter will carry."),
    out: Path = typer.Option(..., "--out", "-o", help="The folder to write (a run on a folder it already "
                             "wrote goes on where that one stopped)."),
    sources: list[str] = typer.Option(None, "--source", help="Text to label, repeatable: dataset-build, "
                                      "python-stdlib (lang python), or a file or folder of UTF-8 text. "
                                      "Default: dataset-build, and python-stdlib for python."),
    top_k: int = typer.Option(16, "--top-k", help="Target probabilities kept per position, [1, 64]."),
    ctx: int = typer.Option(256, "--ctx", help="Tokens per labelled sequence, [16, 4096]."),
    tokens: int = typer.Option(None, "--tokens", help="Stop after this many labelled tokens in all (default: all the text)."),
    minutes: float = typer.Option(None, "--minutes", help="Stop after this many minutes (what is done is kept)."),
    mode: str = typer.Option("text", "--mode", help="text: label the text itself (teacher forcing, about "
                             "a prefill's cost); generate: the target first continues each sequence's first "
                             "--prompt-tokens tokens itself (self-distillation, a generation's cost), then labels that."),
    prompt_tokens: int = typer.Option(64, "--prompt-tokens", help="generate mode: prompt tokens per sequence."),
    temperature: float = typer.Option(0.0, "--temperature", help="generate mode: 0 greedy, else sampled, [0, 2]."),
    backend: str = typer.Option(None, "--backend", help="native or llama (default: as generate chooses)."),
    threads: Optional[int] = ENGINE_OPTIONS["threads"][1],
) -> None:
    """Label text with the target's own next-token probabilities (teacher forcing, top-k soft labels),
    for `edgespec drafter train`. Text shared with the benchmark suites is left out."""
    from ..training import distill

    params = distill.DistillParams(lang=lang, sources=sources or _default_sources(lang), top_k=top_k,
                                   ctx=ctx, max_tokens=tokens, minutes=minutes, mode=mode,
                                   prompt_tokens=prompt_tokens, temperature=temperature)
    t0 = time.perf_counter()
    manifest = distill.distill_model(model, out, params, backend=backend, threads=threads)
    typer.echo(f"{out}: {manifest['tokens']} of {manifest['tokens_total']} tokens labelled "
               f"({manifest['sequences']} sequences, {len(manifest['shards'])} shards, top {top_k}); "
               f"{manifest['held_out_paragraphs']} paragraphs left out as benchmark text; "
               f"{time.perf_counter() - t0:.0f} s this run")


@drafter_app.command("train")
def train_cmd(
    model: str = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    data: Path = typer.Option(..., "--data", help="A folder written by `edgespec drafter distill` for this model."),
    lang: str = typer.Option(..., "--lang", help="The language or domain tag: the distillation's."),
    out: Path = typer.Option(..., "--out", "-o", help="The drafter GGUF to write; OUT.ckpt beside it holds "
                             "the checkpoint a later run goes on from."),
    minutes: float = typer.Option(30.0, "--minutes", help="Training time of all runs together; the best "
                                  "state so far is exported when it is spent."),
    init: str = typer.Option("target", "--init", help="Where the drafter starts: target (a new small llama "
                             "whose embedding starts from the target's rows), random, or a model with the "
                             "target's tokenizer to grow it from (a built-in name or GGUF path: "
                             "qwen2.5-coder-0.5b for qwen2.5-coder-1.5b)."),
    layers: str = typer.Option(None, "--layers", help="Grown: the N layers of the --init model that change "
                               "its hidden state most on held-out text (default 4), or the layers named, "
                               "e.g. 0,3,7."),
    n_embd: int = typer.Option(None, "--n-embd", help="From scratch: width of the drafter (default 256)."),
    n_layer: int = typer.Option(None, "--n-layer", help="From scratch: transformer blocks (default 4)."),
    n_head: int = typer.Option(None, "--n-head", help="From scratch: attention heads (default 4)."),
    n_head_kv: int = typer.Option(None, "--n-head-kv", help="From scratch: key/value heads, dividing --n-head "
                                  "(default 4)."),
    n_ff: int = typer.Option(None, "--n-ff", help="From scratch: feed-forward width (default 768)."),
    vocab: int = typer.Option(8192, "--vocab", help="Target tokens the drafter keeps (the ones the target's "
                              "labels use most; the others get probability 0), [256, the target's vocabulary]."),
    quant: str = typer.Option(None, "--quant", help="The exported matrices: f16, q8_0 or q4_0 (default: f16 "
                              "from scratch, q8_0 grown)."),
    ctx: int = typer.Option(512, "--ctx", help="Tokens per plain-text training window."),
    batch_tokens: int = typer.Option(None, "--batch-tokens", help="Tokens per step and kind of batch (default: "
                                     "4096 from scratch, 1024 grown)."),
    lr: float = typer.Option(None, "--lr", help="Peak learning rate (AdamW, cosine decay per stage; default: "
                             "2e-3 from scratch, 2e-4 grown)."),
    pretrain_share: float = typer.Option(None, "--pretrain-share", help="Share of --minutes on plain text "
                                         "before distillation, [0, 1) (default: 0.4 from scratch, 0 grown)."),
    sources: list[str] = typer.Option(None, "--source", help="Plain text for pretraining, repeatable (as "
                                      "distill's --source; default: the distillation's sources)."),
    seed: int = typer.Option(0, "--seed", help="Random seed."),
    threads: int = typer.Option(None, "--threads", "-t", help="CPU threads for PyTorch (default: PyTorch's own, its "
                                "count of physical cores)."),
    device: str = typer.Option("auto", "--device", help="auto (a CUDA GPU, else Apple's MPS, else the CPU), "
                               "cpu, cuda or mps."),
    restart: bool = typer.Option(False, "--restart", help="Start over, ignoring OUT.ckpt."),
) -> None:
    """Train a drafter for a target on its soft labels (from scratch: plain text first; or grown from a
    smaller model with the target's tokenizer, --init MODEL) and export it as a GGUF for `--drafter model
    --draft-model OUT` or a target's drafter set. Needs the train extra: pip install 'edgespec\\[train]'."""
    import shlex
    import sys

    from ..training import train

    params = train.TrainParams(lang=lang, minutes=minutes, init=init, layers=_layers(layers), n_embd=n_embd,
                               n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff, vocab=vocab,
                               quant=quant, ctx=ctx, batch_tokens=batch_tokens, lr=lr,
                               pretrain_share=pretrain_share, seed=seed, threads=threads, device=device,
                               sources=list(sources or []))
    command = "edgespec drafter " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    result = train.train_model(model, data, out, params, restart=restart, command=command)
    typer.echo(f"wrote {result.out}: {result.n_params / 1e6:.1f}M parameters, {result.bytes / 1e6:.1f} MB; "
               f"{result.steps} steps, {result.tokens_seen / 1e6:.1f}M tokens in {result.seconds / 60:.1f} min "
               f"({result.tokens_seen / max(result.seconds, 1e-9):.0f} tokens/s); "
               f"held-out acceptance {result.held_out_acceptance:.1%}")


@drafter_app.command("train-head")
def train_head_cmd(
    model: str = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    lang: str = typer.Option(..., "--lang", help="The language or domain tag (python, eng, deu, ...): the "
                             "dataset-build text read."),
    out: Path = typer.Option(..., "--out", "-o", help="The head GGUF to write; OUT.data/ holds the target's "
                             "features and OUT.ckpt the checkpoint, which a later run goes on from."),
    sources: list[str] = typer.Option(None, "--source", help="Text, repeatable: dataset-build, python-stdlib "
                                      "(lang python), or a file or folder of UTF-8 text. Default: dataset-build, "
                                      "and python-stdlib for python."),
    mode: str = typer.Option("text", "--mode", help="What the head learns from: text (the text itself), "
                             "generate (the target's continuations of it), chat (its answers to requests about "
                             "it), translate (its translations of it into English), questions (its answers to questions it "
                             "writes itself about the text: users' short requests)."),
    minutes: float = typer.Option(30.0, "--minutes", help="Training time of all runs together."),
    data_minutes: float = typer.Option(None, "--data-minutes", help="Collect the target's features for this "
                                       "long, all runs together (default: all the text, or --tokens)."),
    tokens: int = typer.Option(None, "--tokens", help="Collect until this many tokens, all runs together."),
    data: list[Path] = typer.Option(None, "--data", help="Features folders, repeatable: the first is where this "
                                    "run collects (default OUT.data/), every one is trained on (others made by "
                                    "earlier runs, e.g. English text beside translations)."),
    ctx: int = typer.Option(256, "--ctx", help="Tokens per sequence, prompt and answer, [16, 4096]."),
    prompt_tokens: int = typer.Option(96, "--prompt-tokens", help="generate, chat, translate: the text "
                                      "each prompt is made of, in tokens."),
    n_ff: int = typer.Option(2048, "--n-ff", help="The head's feed-forward width."),
    draft_vocab: int = typer.Option(8192, "--draft-vocab", help="Output rows the head computes (the most "
                                    "used tokens); the head drafter's default --draft-vocab."),
    quant: str = typer.Option("q8_0", "--quant", help="The exported matrices: f16, q8_0 or q4_0."),
    window: int = typer.Option(64, "--window", help="Rows per training window."),
    batch_rows: int = typer.Option(256, "--batch-rows", help="Rows per optimizer step."),
    lr: float = typer.Option(1e-3, "--lr", help="Peak learning rate (AdamW, cosine decay)."),
    unroll: int = typer.Option(2, "--unroll", help="Drafted tokens per chain trained on: step 2 on reads the "
                               "head's own guesses, as drafting does (1: EAGLE-1's single step)."),
    seed: int = typer.Option(0, "--seed", help="Random seed."),
    threads: int = typer.Option(None, "--threads", "-t", help="CPU threads for the target and PyTorch."),
    init: Path = typer.Option(None, "--init", help="Start from the weights of another run's checkpoint "
                              "(its OUT.ckpt: a head of this target and --n-ff, e.g. an English head's for a "
                              "translation head) or of a head file (a shipped head, to train further); a run "
                              "with a checkpoint of its own goes on from that."),
    restart: bool = typer.Option(False, "--restart", help="Train from the start, ignoring OUT.ckpt."),
) -> None:
    """Train a draft head (EAGLE-1) on TARGET's own features for `--drafter head --head OUT`: the target's
    hidden states over text of the language (or its own answers), then the head's layer (PyTorch).
    Resumable at every stage. Needs the train extra: pip install 'edgespec\\[train]'."""
    import shlex
    import sys

    from ..training import head

    params = head.HeadParams(lang=lang, sources=sources or _default_sources(lang), mode=mode, minutes=minutes,
                             data_minutes=data_minutes, tokens=tokens, ctx=ctx, prompt_tokens=prompt_tokens,
                             n_ff=n_ff, draft_vocab=draft_vocab, quant=quant, window=window,
                             batch_rows=batch_rows, lr=lr, unroll=unroll, seed=seed, threads=threads)
    command = "edgespec drafter " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    r = head.train_head_model(model, out, params, data=data, init=init, restart=restart, command=command)
    typer.echo(f"wrote {r.out}: {r.bytes / 1e6:.1f} MB; {r.steps} steps, {r.rows_seen / 1e6:.2f}M rows in "
               f"{r.seconds / 60:.1f} min; held-out agreement {r.held_out_agreement:.1%} (the chain's first token)")


def _layers(text: str | None) -> int | list[int] | None:
    """--layers: a count ("4") or layer numbers ("0,3,7")."""
    from ..errors import InvalidArgumentError

    if text is None:
        return None
    try:
        parts = [int(x) for x in text.split(",")]
    except ValueError:
        raise InvalidArgumentError(f"--layers must be a count such as 4 or layer numbers such as 0,3,7, "
                                   f"got {text!r}") from None
    return parts if "," in text else parts[0]


def _default_sources(lang: str) -> list[str]:
    return ["dataset-build", "python-stdlib"] if lang == "python" else ["dataset-build"]


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
