"""Ollama's Modelfile, as ``/api/create`` takes it: ``FROM`` (a GGUF file or
a model this server has), ``SYSTEM``, ``PARAMETER name value`` (repeatable;
``stop`` several times makes a list), ``TEMPLATE`` (Ollama's Go template,
translated by edgespec.chat.gotemplate) and ``LICENSE``; a value is the rest
of its line, a "quoted" string or a \"\"\"triple-quoted\"\"\" one across lines.
``#`` starts a comment line. Any other instruction (ADAPTER, MESSAGE, ...) is
refused naming it."""
from __future__ import annotations

import json
import re

from .errors import ApiError

INSTRUCTIONS = ("FROM", "SYSTEM", "PARAMETER", "TEMPLATE", "LICENSE")
_SKIP = re.compile(r"(\s|#[^\n]*)*")
_LINE = re.compile(r'\s*([A-Za-z]+)\s+("""(.*?)"""|"((?:[^"\\]|\\.)*)"|[^\n]*)', re.S)


def _bad(message: str) -> ApiError:
    return ApiError(400, f"modelfile: {message}")


def parse(text: str) -> dict:
    """{"from", "system", "template", "license": text, "parameters": {name: value}}
    of the instructions ``text`` has."""
    out: dict = {}
    params: dict = {}
    pos = 0
    while True:
        pos = _SKIP.match(text, pos).end()   # blank lines and comments
        if pos >= len(text):
            break
        m = _LINE.match(text, pos)
        if m is None:
            raise _bad(f"cannot read {text[pos:pos + 40].strip()!r}")
        word = m.group(1).upper()
        value = m.group(3) if m.group(3) is not None else (
            json.loads(f'"{m.group(4)}"') if m.group(4) is not None else m.group(2).strip())
        pos = m.end()
        if word not in INSTRUCTIONS:
            raise _bad(f"{word} is not supported by this server (it takes {', '.join(INSTRUCTIONS)})")
        if word == "PARAMETER":
            name, _, raw = value.strip().partition(" ")
            if not name or not raw.strip():
                raise _bad(f"PARAMETER needs a name and a value, got {value.strip()[:60]!r}")
            parsed = _value(raw.strip())
            if name == "stop":
                params.setdefault("stop", []).append(str(parsed) if not isinstance(parsed, str) else parsed)
            else:
                params[name] = parsed
        else:
            if word.lower() in out:
                raise _bad(f"{word} is given twice")
            out[word.lower()] = value
    if params:
        out["parameters"] = params
    return out


def _value(raw: str):
    """A PARAMETER's value: a number, true/false, or text (quotes removed)."""
    if raw.startswith('"') and raw.endswith('"') and len(raw) > 1:
        return raw[1:-1]
    for convert in (int, float):
        try:
            return convert(raw)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(raw.lower(), raw)


def lines(settings: dict) -> str:
    """The Modelfile lines of a model's settings (for /api/show's modelfile)."""
    out = []
    for name, value in settings.get("parameters", {}).items():
        for v in (value if isinstance(value, list) else [value]):
            out.append(f"PARAMETER {name} {json.dumps(v) if isinstance(v, str) else v}")
    for word in ("system", "template", "license"):
        if settings.get(word):
            out.append(f'{word.upper()} """{settings[word]}"""')
    return "\n".join(out)
