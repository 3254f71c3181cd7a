"""The ``edgespec`` command line. Commands parse options and call the library;
every EdgespecError becomes one line on stderr and exit code 2."""
from __future__ import annotations

import json
import sys

import typer

from ..errors import EdgespecError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="edgespec: fast local LLM generation with lossless speculative decoding.")
models_app = typer.Typer(no_args_is_help=True, help="List, fetch and inspect models.")
app.add_typer(models_app, name="models")
drafter_app = typer.Typer(no_args_is_help=True, help="Build drafter data (n-gram caches).")
app.add_typer(drafter_app, name="drafter")


def fail(message: str) -> "typer.Exit":
    """Print a one-line error and return the exit to raise (code 2)."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def main() -> None:
    from . import bench, chat, drafter, models, onnx, serve  # noqa: F401  (register their commands)

    try:
        app()
    except EdgespecError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)


# -- generate / demo ---------------------------------------------------------

MODEL_HELP = "Built-in model name, GGUF path, or hf:owner/repo/file.gguf (default: the built-in default)."
BACKEND_HELP = ("llama (llama.cpp), native (edgespec's own C engine) or onnx (ONNX Runtime; --model may "
                "also be a folder from `edgespec export-onnx`, a GGUF is exported into the cache on first use).")
EP_HELP = "ONNX Runtime execution provider for the onnx backend: cpu, qnn, openvino, dml, coreml or cuda."
DRAFT_BACKEND_HELP = "Backend of the draft model (default: the target's), e.g. onnx on an NPU with a llama target."


def _result_json(engine, result) -> dict:
    s = result.stats
    return {
        "text": result.text,
        "tokens": result.tokens,
        "n_tokens": s.n_tokens,
        "prompt_tokens": s.prompt_tokens,
        "cached_tokens": s.cached_tokens,
        "prefill_s": round(s.prefill_s, 6),
        "decode_s": round(s.decode_s, 6),
        "tokens_per_s": round(s.tokens_per_s, 3),
        "prefill_tokens_per_s": round(s.prefill_tokens_per_s, 3),
        "stop_reason": s.stop_reason,
        "seed": s.seed,
        "model": engine.model_ref,
        "model_path": str(engine.model_path),
        "backend": engine.backend.name,
        "threads": engine.backend.threads,
        "drafter": s.drafter,
        **({"spec": s.spec.to_dict()} if s.spec is not None else {}),
    }


def _summary(result) -> str:
    s = result.stats
    line = (f"{s.n_tokens} tokens in {s.decode_s:.2f} s: {s.tokens_per_s:.1f} tokens/s decode, "
            f"prompt {s.prompt_tokens} tokens at {s.prefill_tokens_per_s:.1f} tokens/s, stop: {s.stop_reason}")
    if s.spec is not None:
        line += (f"; drafter {s.drafter}: drafted {s.spec.drafted}, accepted {s.spec.accepted} "
                 f"({100 * s.spec.acceptance_rate:.0f}%), {s.spec.mean_accepted:.2f} accepted per step")
    return line


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text."),
    model: str = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Most tokens to generate (> 0)."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy; > 0 samples."),
    top_k: int = typer.Option(0, help="Keep the k most likely tokens; 0 = off."),
    top_p: float = typer.Option(1.0, help="Nucleus mass in (0, 1]; 1 = off."),
    min_p: float = typer.Option(0.0, help="Drop tokens below min_p x p(best), [0, 1)."),
    repeat_penalty: float = typer.Option(1.0, help="Repetition penalty (> 0); 1 = off."),
    seed: int = typer.Option(None, help="RNG seed for sampling (default: random)."),
    stop: list[str] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    threads: int = typer.Option(None, help="CPU threads (default: physical cores)."),
    n_ctx: int = typer.Option(4096, "--ctx", help="Context window in tokens."),
    gpu_layers: int = typer.Option(0, help="Layers to offload to Metal/CUDA/Vulkan, if llama.cpp has them."),
    backend: str = typer.Option("llama", help=BACKEND_HELP),
    ep: str = typer.Option(None, "--ep", help=EP_HELP),
    draft_backend: str = typer.Option(None, help=DRAFT_BACKEND_HELP),
    drafter: str = typer.Option("auto", help="none, ngram, recycle, cache, model or auto (chooses per step, "
                                            "and decodes plainly when speculation does not pay)."),
    draft_model: str = typer.Option(None, help="Draft model for --drafter model/auto (same tokenizer)."),
    draft_max: int = typer.Option(16, help="Most draft tokens per target step, [1, 63]."),
    ngram_cache: str = typer.Option(None, help="N-gram cache file for --drafter cache/auto."),
    chat: bool = typer.Option(False, "--chat", help="Apply the model's chat template to PROMPT as one user message."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (last line of stdout) instead of streaming."),
    verbose: bool = typer.Option(False, "--verbose", help="Show llama.cpp's log."),
):
    """Generate text from PROMPT."""
    from ..engine import Engine

    with Engine(model, backend=backend, ep=ep, threads=threads, n_ctx=n_ctx, gpu_layers=gpu_layers,
                drafter=drafter, draft_model=draft_model, draft_backend=draft_backend,
                draft_max=draft_max, ngram_cache=ngram_cache, verbose=verbose) as engine:
        pieces = engine.stream(prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                               top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty, seed=seed,
                               stop=stop, chat=chat)
        if as_json:
            for _ in pieces:
                pass
            typer.echo(json.dumps(_result_json(engine, engine.last_result), ensure_ascii=False))
            return
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        typer.echo(_summary(engine.last_result), err=True)


DEMO_QUESTION = "Explain in three sentences why the sky is blue."


@app.command()
def demo(
    model: str = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    threads: int = typer.Option(None, help="CPU threads (default: physical cores)."),
):
    """Fetch the default model if needed and answer a question with it."""
    from ..engine import Engine

    with Engine(model, threads=threads, drafter="auto") as engine:
        typer.echo(f"model: {engine.model_ref} ({engine.model_path})", err=True)
        typer.echo(f"> {DEMO_QUESTION}")
        for piece in engine.stream(DEMO_QUESTION, chat=engine.chat_template is not None,
                                   max_tokens=128, seed=0):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        typer.echo(_summary(engine.last_result), err=True)
