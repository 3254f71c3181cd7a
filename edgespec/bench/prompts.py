"""Benchmark prompts: the suites shipped as package data, and the user's own JSONL.

Each suite is ``suites/<name>.jsonl`` (rebuilt by benchmarks/make_suites.py;
sources and licences in ``suites/SOURCES.txt``). A record is one line:

    {"id": "translate-deu", "suite": "multilingual", "lang": "deu", "chat": true,
     "prompt": "Translate the following German text ...", "source": "dataset-build ..."}

``chat`` true: the prompt is one user message rendered through the model's
chat template; false: the raw text is completed.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Sequence

from ..errors import InvalidArgumentError

SUITES = ("code", "multilingual", "edit", "chat")


@dataclass(frozen=True)
class Prompt:
    id: str
    suite: str
    lang: str
    chat: bool
    prompt: str
    source: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["prompt"]
        return d


def _suite_file(name: str):
    return resources.files(__package__).joinpath("suites", f"{name}.jsonl")


def load_suite(name: str) -> list[Prompt]:
    if name not in SUITES:
        raise InvalidArgumentError(f"unknown suite '{name}' (available: {', '.join(SUITES)})")
    text = _suite_file(name).read_text(encoding="utf-8")
    return [Prompt(**json.loads(line)) for line in text.splitlines() if line.strip()]


def spread(items: Sequence, limit: int | None) -> list:
    """``limit`` items evenly spaced over ``items`` (all when None or more): a
    small selection still covers the languages and tasks of the whole suite."""
    if limit is None or limit >= len(items):
        return list(items)
    return [items[i * len(items) // limit] for i in range(limit)]


def select(suites: Sequence[str], *, langs: Sequence[str] | None = None,
           limit: int | None = None, prompts_file: str | Path | None = None) -> list[Prompt]:
    """The prompts of ``suites`` (or of the user's ``prompts_file`` instead)
    whose language tag is in ``langs`` (all when None), at most ``limit`` per suite."""
    if limit is not None and limit <= 0:
        raise InvalidArgumentError(f"--limit must be > 0, got {limit}")
    if prompts_file is not None:
        suites = ["prompts"]
        loaded = {"prompts": load_prompts_file(prompts_file)}
    else:
        loaded = {name: load_suite(name) for name in suites}
    if langs:
        known = sorted({p.lang for ps in loaded.values() for p in ps})
        unknown = [x for x in langs if x not in known]
        if unknown:
            raise InvalidArgumentError(f"unknown language '{unknown[0]}' in {', '.join(suites)} "
                                       f"(available: {', '.join(known)})")
    out: list[Prompt] = []
    for name, prompts in loaded.items():
        if langs:
            prompts = [p for p in prompts if p.lang in langs]
        out.extend(spread(prompts, limit))
    if not out:
        raise InvalidArgumentError(f"no prompt of suites {', '.join(suites)} is in languages {', '.join(langs or [])}")
    return out


def load_prompts_file(path: str | Path) -> list[Prompt]:
    """The user's own prompts: JSONL, one object per line with a non-empty
    "prompt" string and optionally "id", "lang" (default "und") and "chat"
    (default true). Blank lines are skipped. Bad input raises
    InvalidArgumentError naming the line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidArgumentError(f"prompts file {path}: no such file") from None
    except IsADirectoryError:
        raise InvalidArgumentError(f"prompts file {path}: is a directory") from None
    except UnicodeDecodeError as e:
        raise InvalidArgumentError(f"prompts file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise InvalidArgumentError(f"prompts file {path}: {e.strerror or e}") from None
    out: list[Prompt] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"prompts file {path} line {n}"
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise InvalidArgumentError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(rec, dict):
            raise InvalidArgumentError(f"{where}: expected a JSON object")
        prompt = rec.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidArgumentError(f"{where}: \"prompt\" must be a non-empty string")
        chat = rec.get("chat", True)
        if not isinstance(chat, bool):
            raise InvalidArgumentError(f"{where}: \"chat\" must be true or false")
        for key in ("id", "lang"):
            if key in rec and not (isinstance(rec[key], str) and rec[key]):
                raise InvalidArgumentError(f"{where}: \"{key}\" must be a non-empty string")
        out.append(Prompt(id=rec.get("id", f"line-{n}"), suite="prompts", lang=rec.get("lang", "und"),
                          chat=chat, prompt=prompt, source=f"{path.name}:{n}"))
    if not out:
        raise InvalidArgumentError(f"prompts file {path} holds no prompts")
    ids = [p.id for p in out]
    dup = next((i for i in ids if ids.count(i) > 1), None)
    if dup is not None:
        raise InvalidArgumentError(f"prompts file {path}: id '{dup}' appears twice")
    return out


def corpus_text() -> str:
    """Every shipped prompt, one after another: the corpus the cache drafter's
    n-gram cache is built from when no --ngram-cache is given."""
    return "\n\n".join(p.prompt for name in SUITES for p in load_suite(name))
