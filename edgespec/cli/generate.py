"""``edgespec generate``: one generation, streamed or as JSON."""
from __future__ import annotations

import json
import sys

import typer

from ..errors import InvalidArgumentError
from ..text import utf8_text
from .base import app
from ..config import EngineConfig
from ..engine import Engine
from .options import SamplingOptions, engine_options, sampling_options


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
        **({"experts": s.experts} if s.experts is not None else {}),
    }


def result_summary(result) -> str:
    """The one-line account of a generation printed on stderr: speed, stop, speculation, experts."""
    s = result.stats
    line = (f"{s.n_tokens} tokens in {s.decode_s:.2f} s: {s.tokens_per_s:.1f} tokens/s decode, "
            f"prompt {s.prompt_tokens} tokens at {s.prefill_tokens_per_s:.1f} tokens/s, stop: {s.stop_reason}")
    if s.spec is not None:
        line += (f"; drafter {s.drafter}: drafted {s.spec.drafted}, accepted {s.spec.accepted} "
                 f"({100 * s.spec.acceptance_rate:.0f}%), {s.spec.mean_accepted:.2f} accepted per step")
        if s.spec.per_drafter:
            line += "; accepted by " + ", ".join(f"{name} {d['accepted']}/{d['drafted']}"
                                                 for name, d in s.spec.per_drafter.items())
        if s.spec.specialized:
            line += f"; specialized drafter {s.spec.specialized}"
        mode = s.spec.drafters.get("model", {}).get("mode")
        if mode:
            line += f"; draft model {s.spec.drafters['model']['draft_model']} ({mode})"
    if s.experts is not None:
        line += "; " + experts_summary(s.experts)
    return line


def experts_summary(x: dict) -> str:
    """The expert cache's counters of one generation, in one phrase."""
    return (f"experts: {100 * x['hit_rate']:.0f}% hits, {x['bytes_read'] / 1e6:.1f} MB read, "
            f"{x['substitutions']} substituted, prefetch {100 * x['prefetch_accuracy']:.0f}% used, "
            f"stall {x['stall_ms_per_token']:.2f} ms/token")


@app.command()
@engine_options(exclude=("slots", "parallel"))
@sampling_options
def generate(
    prompt: str = typer.Argument(..., help="The prompt text (UTF-8)."),
    engine: EngineConfig = ...,
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Most tokens to generate, > 0."),
    sampling: SamplingOptions = ...,
    chat: bool = typer.Option(False, "--chat", help="Apply the model's chat template to PROMPT as one user message."),
    suffix: str = typer.Option(None, "--suffix", help="Fill in the middle: generate the text between PROMPT and "
                               "SUFFIX, from the model's FIM tokens (code models such as qwen2.5-coder-1.5b)."),
    raw: bool = typer.Option(False, "--raw", help="Read special-token text in PROMPT (<|fim_prefix|>, <|im_start|>) as "
                             "those tokens, as llama-server and Ollama's raw mode do (default: plain text)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (last line of stdout) instead of streaming."),
):
    """Generate text from PROMPT (or, with --suffix, between PROMPT and SUFFIX)."""
    utf8_text(prompt, "prompt")
    if max_tokens <= 0:   # before a model loads (and the machine is measured for it)
        raise InvalidArgumentError(f"max_tokens (--max-tokens) must be a whole number > 0, got {max_tokens}")
    if suffix is not None:
        utf8_text(suffix, "--suffix")
        if chat:
            raise InvalidArgumentError("--suffix (fill-in-the-middle) and --chat do not go together")
    if raw and (chat or suffix is not None):
        raise InvalidArgumentError("--raw is for a plain prompt, not with --chat or --suffix")
    with Engine(config=engine) as e:
        pieces = e.stream(prompt, suffix=suffix, max_tokens=max_tokens, chat=chat, parse_special=raw,
                          **sampling.kwargs())
        if as_json:
            for _ in pieces:
                pass
            typer.echo(json.dumps(_result_json(e, e.last_result), ensure_ascii=False))
            return
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        typer.echo(result_summary(e.last_result), err=True)
