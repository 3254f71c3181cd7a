"""Routers: which specialized drafter of a target's set serves a request.

A router sees the request's text once, before the generation starts, and
picks one drafter of the set (or none); the planner then weighs that drafter
against the cheap ones and plain decoding at every step as it weighs any
draft model. Routers are found by name: ``profile`` (the default) or
``package.module:Class`` for one of the user's own (a ``Router`` subclass).
"""
from __future__ import annotations

import importlib
import math
import unicodedata
from abc import ABC, abstractmethod
from collections import Counter
from typing import Sequence

from ..errors import InvalidArgumentError
from . import specialized

ROUTING_CHARS = 4000   # the request's last characters a router reads
MIN_SCORE = 0.25       # the profile router's least score for a drafter to be chosen
ZIPF_OFFSET = 10       # the profile router's n-gram at rank r: probability ~ 1 / (r + ZIPF_OFFSET)
ABSENT = 1e-4          # its probability of an n-gram outside a drafter's profile
FIT_WEIGHT = 0.5       # the part of the score the n-grams decide (the rest: the scripts)


class Router(ABC):
    """Chooses per request among a target's compatible specialized drafters
    (``edgespec.drafters.routed.DrafterInfo``: name, langs, profile)."""

    name: str

    @abstractmethod
    def choose(self, text: str, drafters: Sequence) -> tuple[object | None, dict[str, float]]:
        """The drafter for a request whose text is ``text`` (None: none fits),
        and each drafter's score by name (for the stats)."""

    def confidence(self, text: str, drafter, score: float) -> float:
        """How sure the router is, in [0, 1], that ``drafter`` (chosen with
        ``score``) was made for text like ``text``: the routed drafter's
        acceptance prior is its own guess times this, so that text it was
        not made for stops it after a miss or two. By default the score."""
        return min(max(score, 0.0), 1.0)


def script(ch: str) -> str | None:
    """The Unicode script of a letter, from its character name ("LATIN",
    "CYRILLIC", "HAN", "HIRAGANA", ...); None for digits, punctuation,
    symbols and spaces, which every script shares."""
    if not ch.isalpha():
        return None
    name = unicodedata.name(ch, "")
    if name.startswith("CJK"):
        return "HAN"
    word = name.split(" ", 1)[0]
    return word or None


def script_shares(text: str) -> dict[str, float]:
    """The share of each script among the letters of ``text``."""
    counts = Counter(s for s in map(script, text) if s is not None)
    total = sum(counts.values())
    return {s: n / total for s, n in counts.items()} if total else {}


# Characters of code that prose seldom has (parentheses it has): a text with
# CODE_SHARE of its visible characters among them, or INDENTED_SHARE of its
# lines indented, reads as code (every prompt of the code suite does, no
# translation, chat or prose continuation prompt does).
CODE_CHARS = frozenset("{}[];=<>_#/\\*|&$`")
CODE_SHARE = 0.03
INDENTED_SHARE = 0.3


# The most frequent short words of the languages in Latin letters that the
# prompt suites have most text in: a Latin text's language is the one whose
# words it uses most, ahead of the next (the script alone says it for most
# others). One-letter words are left out: languages share them.
LATIN_WORDS = {
    "eng": "the and of to is in that it for you with are this be",
    "deu": "der die und das ist nicht ein eine zu den mit sich auf für",
    "fra": "le la les et des est une un du que pour dans pas sur",
    "spa": "el la los las de que es en un una por para con del",
    "ita": "il la di che un una per non sono del della con gli",
    "por": "os as de que um uma para com não do da em se",
    "nld": "de het een en van is dat niet op te zijn met voor",
}
_LATIN_WORDS = {lang: frozenset(words.split()) for lang, words in LATIN_WORDS.items()}


def latin_language(text: str) -> str | None:
    """The language of LATIN_WORDS whose words ``text`` uses most (None: none of them)."""
    words = Counter(w.strip(".,;:!?\"'()«»") for w in text.casefold().split())
    hits = {lang: sum(words[w] for w in ws) for lang, ws in _LATIN_WORDS.items()}
    best, second = sorted(hits, key=hits.get, reverse=True)[:2]
    return best if hits[best] >= 2 and hits[best] > hits[second] else None


def text_route(text: str) -> str:
    """The route of a request's text, what the planner keeps acceptance
    apart by: the script most of its letters are in (with the language for
    prose in Latin letters, ``latin_language``) and whether it reads as code
    or prose ("latin-eng:prose", "han:prose", "latin:code"; "none:prose"
    without letters), from its last ROUTING_CHARS characters."""
    text = text[-ROUTING_CHARS:]
    shares = script_shares(text)
    main = max(shares, key=shares.get).lower() if shares else "none"
    visible = [c for c in text if not c.isspace()]
    lines = [line for line in text.splitlines() if line.strip()]
    code = ((visible and sum(c in CODE_CHARS for c in visible) / len(visible) >= CODE_SHARE)
            or (lines and sum(line.startswith(("    ", "\t")) for line in lines) / len(lines) >= INDENTED_SHARE))
    language = latin_language(text) if main == "latin" and not code else None
    return f"{main}{f'-{language}' if language else ''}:{'code' if code else 'prose'}"


def _kind(text: str) -> str:
    """"code" or "prose", as ``text_route`` reads ``text``."""
    return text_route(text).rpartition(":")[2]


def _overlap(scripts: dict[str, float], profile_scripts: dict[str, float]) -> float:
    """The share of a text's letters in a profile's scripts (1 for a text without letters)."""
    return sum(min(s, profile_scripts.get(k, 0.0)) for k, s in scripts.items()) if scripts else 1.0


class ProfileRouter(Router):
    """Character n-gram profiles, read as a language model, gated by script.

    A drafter's ``edgespec.drafter.profile`` ranks its training text's most
    frequent n-grams; taken as Zipf's law (the n-gram at rank r has a
    probability proportional to 1 / (r + ZIPF_OFFSET), one outside the
    profile ABSENT), it gives the text's n-grams a mean log-probability,
    scaled to a fit in [0, 1] (1: every n-gram the drafter's most frequent,
    0: none in its profile). The score is the overlap of the scripts of the
    text's letters and of the profile's, times (1 - FIT_WEIGHT + FIT_WEIGHT x
    fit): scripts decide between scripts (a German drafter never serves
    Japanese text, and a top-400 trigram profile covers little of a Han text),
    n-grams within one (German against Python code). The best drafter is
    chosen unless its score is below ``min_score``."""

    name = "profile"

    def __init__(self, min_score: float = MIN_SCORE):
        self.min_score = min_score
        self._models: dict[tuple, tuple[dict[str, float], dict[str, float], str]] = {}

    def _model(self, d) -> tuple[dict[str, float], dict[str, float], str]:
        """log-probability of each n-gram of a drafter's profile, its script
        shares, and the kind of text it was made for (code or prose)."""
        key = tuple(d.profile)
        if key not in self._models:
            weights = [1.0 / (r + ZIPF_OFFSET) for r in range(len(d.profile))]
            total = sum(weights) or 1.0
            self._models[key] = ({g: math.log(w / total) for g, w in zip(d.profile, weights)},
                                 script_shares("".join(d.profile)), _kind("".join(d.profile)))
        return self._models[key]

    def score(self, counts: Counter, scripts: dict[str, float], d) -> float:
        logp, profile_scripts, _ = self._model(d)
        n = sum(counts.values())
        if not logp or not n:
            return 0.0
        best = max(logp.values())
        floor = math.log(ABSENT)
        mean = sum(c * logp.get(g, floor) for g, c in counts.items()) / n
        overlap = _overlap(scripts, profile_scripts)
        fit = max(0.0, (mean - floor) / (best - floor))
        return overlap * (1.0 - FIT_WEIGHT + FIT_WEIGHT * fit)

    def confidence(self, text, drafter, score):
        """0 where the text is code and the drafter's profile prose or the
        other way round (Python's drafter on a German letter), else the share
        of the text's letters in the profile's scripts. The n-gram fit is
        left out: on the routing texts it does not tell code from prose
        (HumanEval's docstrings fit a Python profile no better than chat
        does), and a Han or kana text fits its own language's top-400
        trigrams barely more than another's; another language of the same
        script keeps its prior, and its misses teach the planner."""
        if _kind(text) != self._model(drafter)[2]:
            return 0.0
        return _overlap(script_shares(specialized.normalise(text[-ROUTING_CHARS:])), self._model(drafter)[1])

    def choose(self, text, drafters):
        kind = _kind(text)
        text = specialized.normalise(text[-ROUTING_CHARS:])
        n = specialized.PROFILE_N
        counts = Counter(text[i:i + n] for i in range(len(text) - n + 1))
        scripts = script_shares(text)
        scores = {d.name: round(self.score(counts, scripts, d), 4) for d in drafters}
        # A drafter made for the text's kind (code or prose) first: a Python
        # function whose docstring is English prose fits the English
        # profile's n-grams a little better than Python's (56 of HumanEval's
        # 164 prompts), yet its answer is code.
        best = max(drafters, key=lambda d: (self._model(d)[2] == kind, scores[d.name]), default=None)
        if best is None or scores[best.name] < self.min_score:
            return None, scores
        return best, scores


ROUTERS = {ProfileRouter.name: ProfileRouter}


def open_router(name: str) -> Router:
    """The router called ``name``: a built-in one, or ``module:Class``."""
    if name in ROUTERS:
        return ROUTERS[name]()
    module, _, attr = name.partition(":")
    if not attr:
        raise InvalidArgumentError(f"unknown router '{name}' (built in: {', '.join(ROUTERS)}; "
                                   "or module:Class for a Router of your own)")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise InvalidArgumentError(f"router '{name}' cannot be loaded: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, Router)):
        raise InvalidArgumentError(f"router '{name}' is not a subclass of edgespec.drafters.router.Router")
    return cls()
