"""``edgespec demo``: what the project does, in a minute, on this machine.

It opens the strongest built-in chat model this machine runs at a readable
speed (or ``--model``), says which and why, answers a question, then asks a
few editing prompts twice, plainly and with ``--drafter auto``, side by side.
Every prompt comes with a check of its answer (the misspelt words fixed, the
YAML parsing to the JSON's data, the renamed code the same program up to
its names): the best case shown is the fastest answer that is identical to
plain decoding *and* right; an answer that fails its check is reported as
wrong, never offered as the best case.
"""
from __future__ import annotations

import ast
import json
import re
import sys
from dataclasses import dataclass
from typing import Callable

import typer

from ..config import EngineConfig
from ..engine import Engine
from .base import app
from .generate import result_summary
from .options import engine_options, with_chat_model

DEMO_QUESTION = "Explain in three sentences why the sky is blue."
DEMO_TOKENS = 256

MEAN = ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
        "    count = len(values)\n    if count == 0:\n        return 0.0\n    return total / count\n")
SETTINGS = {"name": "edgespec", "version": "0.1.0", "backends": ["llama", "native", "onnx"],
            "drafters": {"ngram": True, "model": True, "recycle": False}, "threads": 2, "context": 4096}
TYPOS = {"Recieve": "Receive", "frunt": "front", "Seperate": "Separate", "Adress": "Address",
         "ofice": "office", "Calender": "Calendar", "wensday": "Wednesday", "Acknowlege": "Acknowledge"}
LIST = ("1. Recieve the package at the frunt door\n2. Seperate the papers by date\n"
        "3. Adress the envelopes to the new ofice\n4. Calender the meeting for next wensday\n"
        "5. Acknowlege every email before lunch\n")


def _block(text: str) -> str:
    """The first fenced block of an answer (```lang ... ```), else the whole answer."""
    m = re.search(r"```[^\n]*\n(.*?)```", text, re.S)
    return m.group(1) if m else text


def check_spelling(answer: str) -> tuple[bool, str]:
    words = set(re.findall(r"[A-Za-z]+", answer))
    left = sorted(t for t in TYPOS if t in words)
    missing = sorted(f for f in TYPOS.values() if f.lower() not in {w.lower() for w in words})
    if left:
        return False, f"misspellings left: {', '.join(left)}"
    if missing:
        return False, f"corrections missing: {', '.join(missing)}"
    return True, "every misspelling fixed"


def check_yaml(answer: str) -> tuple[bool, str]:
    import yaml

    try:
        data = yaml.safe_load(_block(answer))
    except yaml.YAMLError as e:
        return False, f"not YAML ({str(e).splitlines()[0]})"
    return (True, "the YAML holds the JSON's data") if data == SETTINGS else \
        (False, "the YAML's data differ from the JSON's")


def _shape(tree: ast.AST) -> str:
    """The program with its names numbered in order of first use: two programs
    of the same shape differ only by a consistent renaming."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            node.id = names.setdefault(node.id, f"n{len(names)}")
        elif isinstance(node, ast.arg):
            node.arg = names.setdefault(node.arg, f"n{len(names)}")
    return ast.dump(tree)


def check_rename(answer: str) -> tuple[bool, str]:
    try:
        tree = ast.parse(_block(answer))
    except SyntaxError as e:
        return False, f"the code does not compile ({e.msg}, line {e.lineno})"
    fn = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "mean"), None)
    if fn is None:
        return False, "the function mean is missing"
    if [a.arg for a in fn.args.args] != ["numbers"]:
        return False, f"its parameter is {', '.join(a.arg for a in fn.args.args) or 'gone'}, not numbers"
    if _shape(fn) != _shape(ast.parse(MEAN).body[0]):
        return False, "the code is not the same program"
    return True, "the same program, its parameter renamed"


@dataclass(frozen=True)
class DemoPrompt:
    label: str
    prompt: str
    check: Callable[[str], tuple[bool, str]]   # (right, why) of an answer


# Prompts whose answers repeat much of their own text: where drafting pays first.
DEMO_PROMPTS = (
    DemoPrompt("edit: rename", "Rename the parameter values to numbers in this Python function and return "
               f"the whole function:\n\n{MEAN}", check_rename),
    DemoPrompt("edit: fix the spelling", f"Correct the spelling in this list and return the whole list:\n{LIST}",
               check_spelling),
    DemoPrompt("rewrite: JSON to YAML", f"Convert this JSON to YAML:\n{json.dumps(SETTINGS)}\n", check_yaml),
)


def _accepted_by(spec) -> str:
    by = spec.stats.spec.per_drafter
    return ", ".join(f"{name} {d['accepted']}" for name, d in by.items()) or "none"


def run_prompt(engine: Engine, p: DemoPrompt, drafter: str) -> dict:
    """Plain and speculative greedy decoding of one prompt, in that order, and the answer's check."""
    chat = engine.chat_template is not None
    plain = engine.generate(p.prompt, chat=chat, max_tokens=DEMO_TOKENS, seed=0, drafter="none")
    spec = engine.generate(p.prompt, chat=chat, max_tokens=DEMO_TOKENS, seed=0, drafter=drafter)
    right, why = p.check(spec.text)
    return {"label": p.label, "plain_tokens_per_s": plain.stats.tokens_per_s,
            "tokens_per_s": spec.stats.tokens_per_s,
            "speedup": spec.stats.tokens_per_s / plain.stats.tokens_per_s if plain.stats.tokens_per_s else 0.0,
            "acceptance": spec.stats.spec.acceptance_rate, "accepted_by": _accepted_by(spec),
            "identical": spec.tokens == plain.tokens and spec.text == plain.text,
            "check": {"passed": right, "why": why}, "text": spec.text}


@app.command()
@engine_options(exclude=("backend", "slots", "parallel"))
def demo(engine: EngineConfig = ...,
         demo_backend: str = typer.Option("native", "--backend", help="llama, native or onnx (default: native, "
                                          "whose greedy output is the same whatever the draft, so the side by "
                                          "side texts must match)."),
         as_json: bool = typer.Option(False, "--json", help="Print one JSON object (the last line of stdout): "
                                      "the model and why, and each prompt's speeds and check.")):
    """Answer a question with the strongest built-in model this machine runs
    well, then decode a few editing prompts plainly and speculatively side by
    side; the best case shown is the fastest right answer."""
    engine, why = with_chat_model(engine.but(backend=demo_backend), quiet=as_json)
    drafter = engine.drafter if engine.drafter != "none" else "auto"
    with Engine(config=engine) as e:
        out = sys.stderr if as_json else sys.stdout
        print(f"> {DEMO_QUESTION}", file=out)
        for piece in e.stream(DEMO_QUESTION, chat=e.chat_template is not None, max_tokens=128, seed=0):
            print(piece, end="", file=out, flush=True)
        print(file=out)
        typer.echo(result_summary(e.last_result), err=True)
        if not as_json:
            typer.echo(f"\nplain vs speculative decoding (--drafter {drafter}), greedy, up to {DEMO_TOKENS} "
                       f"tokens, {e.backend.threads} threads:")
            typer.echo(f"  {'prompt':<24} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} "
                       f"{'acceptance':>10}  identical  answer")
        runs = []
        for p in DEMO_PROMPTS:
            r = run_prompt(e, p, drafter)
            runs.append(r)
            if not as_json:
                typer.echo(f"  {r['label']:<24} {r['plain_tokens_per_s']:>11.1f} {r['tokens_per_s']:>10.1f} "
                           f"{r['speedup']:>6.2f}x {100 * r['acceptance']:>9.0f}%  "
                           f"{'yes' if r['identical'] else 'NO':<9}  "
                           f"{'right' if r['check']['passed'] else 'WRONG'} ({r['check']['why']})")
        right = [r for r in runs if r["identical"] and r["check"]["passed"]]
        best = max(right, key=lambda r: r["speedup"]) if right else None
        if as_json:
            typer.echo(json.dumps({"model": e.model_ref, "why": why, "drafter": drafter,
                                   "threads": e.backend.threads, "prompts": runs,
                                   "best": best["label"] if best else None}, ensure_ascii=False))
        elif best is None:
            typer.echo(f"\nno answer was both right and identical to plain decoding: {e.model_ref} gets these "
                       "edits wrong (try a larger model with --model)")
        else:
            typer.echo(f"\nbest: {best['label']}, {best['speedup']:.2f}x plain decoding, the same text as plain "
                       f"decoding, and right ({best['check']['why']}):")
            typer.echo(best["text"])
