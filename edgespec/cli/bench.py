"""``edgespec bench``: measure decoding configurations and peers side by side
(see edgespec.bench and benchmarks/README.md)."""
from __future__ import annotations

from pathlib import Path

import typer

from .base import app
from ..config import EngineConfig
from .options import engine_options


def _list(value: str | None) -> list[str] | None:
    if value is None:
        return None
    return [x.strip() for x in value.split(",") if x.strip()]


@app.command()
@engine_options(exclude=("drafter", "drafter_dir", "slots", "parallel"))   # --drafters: the configurations here
def bench(
    engine: EngineConfig = ...,
    suite: str = typer.Option("code,multilingual,edit,chat", "--suite",
                              help="Comma-separated suites: code (HumanEval), multilingual, edit, chat."),
    limit: int = typer.Option(None, "--limit", help="Most prompts per suite (> 0), spread over the suite "
                              "[default: 4; every prompt of a --prompts file]."),
    langs: str = typer.Option(None, "--langs", help="Only prompts in these language tags (e.g. deu,jpn,python)."),
    prompts: Path = typer.Option(None, "--prompts", help="Your own prompts instead of the suites: JSONL, "
                                 'one {"prompt": ..., "id"?, "lang"?, "chat"? (default true)} per line.'),
    drafters: str = typer.Option("none,ngram,auto", "--drafters",
                                 help="Comma-separated: none, ngram, recycle, cache, auto, model "
                                      "(none, the baseline, is always run; model without --draft-model "
                                      "uses the model's paired draft model)."),
    set_dir: Path = typer.Option(None, "--drafter-dir", metavar="DIR", help="auto's specialized drafters: "
                                     "the GGUF files of DIR and DIR/<model name>/ (default: the shipped ones and "
                                     "$EDGESPEC_HOME/drafters/<model name>/)."),
    modes: str = typer.Option("greedy", "--modes", help="greedy, sampled or greedy,sampled."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Tokens generated per run (> 0)."),
    repeats: int = typer.Option(2, "--repeats", help="Measured passes over the prompts (> 0), after one warm-up."),
    temperature: float = typer.Option(0.8, "--temperature", help="Temperature of the sampled mode."),
    top_p: float = typer.Option(0.95, "--top-p", help="Nucleus mass of the sampled mode, (0, 1]."),
    seed: int = typer.Option(0, "--seed", help="Base seed of the sampled mode (varies per prompt and repeat)."),
    peers: str = typer.Option("auto", "--peers", help="auto (llama-cpp-python, plus llama.cpp's binaries with "
                              "--llama-cpp-bin), none, or a comma-separated list of: llama-cpp-python, "
                              "llama-cpp-python:prompt-lookup, llama.cpp, llama.cpp:lookup, llama.cpp:speculative."),
    llama_cpp_bin: Path = typer.Option(None, "--llama-cpp-bin", help="Folder with llama.cpp's llama-completion or "
                                       "llama-simple, llama-lookup, llama-speculative-simple."),
    remeasure_costs: bool = typer.Option(True, "--remeasure-costs/--cached-costs",
                                         help="Measure the batch cost curve (the ceiling, auto's planner) "
                                              "at the start, or use the one cached from earlier."),
    quick: bool = typer.Option(False, "--quick", help="One prompt per suite, 48 tokens, drafters none,ngram,auto, "
                               "one repeat: a smoke run (about a minute on 2 cores)."),
    roofline: bool = typer.Option(False, "--roofline", help="Only the memory roofline: this machine's read "
                                  "bandwidth over the bytes a token reads, and the decode speed and batch cost "
                                  "(1-16 tokens) of --backend (default: native) beside llama.cpp's."),
    out: Path = typer.Option(Path("bench-results"), "--out", help="Folder for results.json, results.md and the plots."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress line on stderr."),
):
    """Benchmark plain decoding, each drafter and peers on real prompts, side by side.
    Every edgespec configuration opens its Engine with the engine options; the
    cache drafter without --ngram-cache gets a cache built from the shipped suite
    texts, and --draft-model (else the model's paired draft model) also drafts
    for the llama.cpp:speculative peer. Every run ends with the memory roofline
    (--roofline: only that).
    Exits 1 when a greedy speculative run differs from plain decoding."""
    from ..bench import report
    from ..bench.runner import BenchOptions, run_bench, run_roofline
    from ..errors import InvalidArgumentError

    if prompts is not None and not prompts.exists():
        raise InvalidArgumentError(f"prompts file {prompts}: no such file")
    options = BenchOptions(
        engine=engine.but(drafter_dir=str(set_dir) if set_dir is not None else None),   # drafters: per run
        suites=_list(suite) or [], langs=_list(langs), limit=limit, prompts_file=prompts,
        drafters=_list(drafters) or ["none"], modes=_list(modes) or [], max_tokens=max_tokens, repeats=repeats,
        peers=None if peers == "auto" else ([] if peers == "none" else _list(peers)),
        llama_cpp_bin=llama_cpp_bin, temperature=temperature, top_p=top_p, seed=seed,
        remeasure_costs=remeasure_costs, quick=quick)
    if not options.suites and prompts is None:
        raise InvalidArgumentError("--suite is empty")
    if not options.modes:
        raise InvalidArgumentError("--modes is empty")
    doc = run_roofline(options) if roofline else run_bench(options, progress=progress)
    files, no_plots = report.write(doc, out)
    typer.echo(report.markdown(doc))
    if no_plots:
        typer.echo(no_plots, err=True)
    typer.echo(f"wrote {', '.join(str(f) for f in files)}", err=True)
    bad = {k: v for k, v in doc.get("greedy_mismatches", {}).items() if v}
    if bad:
        typer.echo("FAIL: greedy runs differ from plain decoding: "
                   + ", ".join(f"{k} {v}" for k, v in bad.items())
                   + " (positions in results.json 'divergences')", err=True)
        raise typer.Exit(1)
