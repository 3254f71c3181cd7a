"""``edgespec generate`` and ``edgespec demo``: one generation, streamed or as JSON."""
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


def _summary(result) -> str:
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
@engine_options(exclude=("slots",))
@sampling_options
def generate(
    prompt: str = typer.Argument(..., help="The prompt text (UTF-8)."),
    engine: EngineConfig = ...,
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Most tokens to generate, > 0."),
    sampling: SamplingOptions = ...,
    chat: bool = typer.Option(False, "--chat", help="Apply the model's chat template to PROMPT as one user message."),
    suffix: str = typer.Option(None, "--suffix", help="Fill in the middle: generate the text between PROMPT and "
                               "SUFFIX, from the model's FIM tokens (code models such as qwen2.5-coder-1.5b)."),
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
    with Engine(config=engine) as e:
        pieces = e.stream(prompt, suffix=suffix, max_tokens=max_tokens, chat=chat, **sampling.kwargs())
        if as_json:
            for _ in pieces:
                pass
            typer.echo(json.dumps(_result_json(e, e.last_result), ensure_ascii=False))
            return
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        typer.echo(_summary(e.last_result), err=True)


DEMO_QUESTION = "Explain in three sentences why the sky is blue."
DEMO_TOKENS = 160
# Prompts whose answers repeat much of their own text: where drafting pays first.
DEMO_PROMPTS = (
    ("edit: comment code", "Add a short comment above each line of this Python function and return the "
     "full code:\n\ndef mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
     "    count = len(values)\n    if count == 0:\n        return 0.0\n    return total / count\n"),
    ("edit: fix a list", "Correct the spelling in this list and return the whole list:\n"
     "1. Recieve the package at the frunt door\n2. Seperate the papers by date\n"
     "3. Adress the envelopes to the new ofice\n4. Calender the meeting for next wensday\n"
     "5. Acknowlege every email before lunch\n"),
    ("rewrite: JSON to YAML", "Convert this JSON to YAML:\n{\"name\": \"edgespec\", \"version\": \"0.1\", "
     "\"backends\": [\"llama\", \"native\", \"onnx\"], \"drafters\": {\"ngram\": true, \"model\": true, "
     "\"recycle\": false}, \"threads\": 2, \"context\": 4096}\n"),
)


def _compare(engine, prompt: str, drafter: str) -> tuple:
    """Plain and speculative greedy decoding of one prompt, in that order."""
    chat = engine.chat_template is not None
    plain = engine.generate(prompt, chat=chat, max_tokens=DEMO_TOKENS, seed=0, drafter="none")
    spec = engine.generate(prompt, chat=chat, max_tokens=DEMO_TOKENS, seed=0, drafter=drafter)
    return plain, spec


def _accepted_by(spec) -> str:
    by = spec.stats.spec.per_drafter
    return ", ".join(f"{name} {d['accepted']}" for name, d in by.items()) or "none"


@app.command()
@engine_options(exclude=("backend", "slots"))
def demo(engine: EngineConfig = ...,
         demo_backend: str = typer.Option("native", "--backend", help="llama, native or onnx (default: native, "
                                     "whose greedy output is the same whatever the draft, so the side by side "
                                     "texts must match).")):
    """Fetch the default model if needed and answer a question with it (greedy,
    128 tokens); then decode a few editing prompts plainly and speculatively,
    side by side, and show the one where speculation pays most on this machine."""
    with Engine(config=engine.but(backend=demo_backend)) as e:
        typer.echo(f"model: {e.model_ref} ({e.model_path})", err=True)
        typer.echo(f"> {DEMO_QUESTION}")
        for piece in e.stream(DEMO_QUESTION, chat=e.chat_template is not None, max_tokens=128, seed=0):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        typer.echo(_summary(e.last_result), err=True)

        drafter = e.drafter if e.drafter != "none" else "auto"
        typer.echo(f"\nplain vs speculative decoding (--drafter {drafter}), greedy, {DEMO_TOKENS} tokens, "
                   f"{e.backend.threads} threads:")
        typer.echo(f"  {'prompt':<24} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} "
                   f"{'acceptance':>10}  identical  accepted by")
        best = None
        for label, prompt in DEMO_PROMPTS:
            plain, spec = _compare(e, prompt, drafter)
            speedup = spec.stats.tokens_per_s / plain.stats.tokens_per_s if plain.stats.tokens_per_s else 0.0
            same = spec.tokens == plain.tokens and spec.text == plain.text
            typer.echo(f"  {label:<24} {plain.stats.tokens_per_s:>11.1f} {spec.stats.tokens_per_s:>10.1f} "
                       f"{speedup:>6.2f}x {100 * spec.stats.spec.acceptance_rate:>9.0f}%  "
                       f"{'yes' if same else 'NO':<9}  {_accepted_by(spec)}")
            if best is None or speedup > best[0]:
                best = (speedup, label, spec, same)
        speedup, label, spec, same = best
        typer.echo(f"\nbest: {label}, {speedup:.2f}x plain decoding, "
                   f"{'the same text as plain decoding' if same else 'TEXT DIFFERS from plain decoding'}:")
        typer.echo(spec.text)
