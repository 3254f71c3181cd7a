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
        self._models: dict[tuple, tuple[dict[str, float], dict[str, float]]] = {}

    def _model(self, d) -> tuple[dict[str, float], dict[str, float]]:
        """log-probability of each n-gram of a drafter's profile, and its script shares."""
        key = tuple(d.profile)
        if key not in self._models:
            weights = [1.0 / (r + ZIPF_OFFSET) for r in range(len(d.profile))]
            total = sum(weights) or 1.0
            self._models[key] = ({g: math.log(w / total) for g, w in zip(d.profile, weights)},
                                 script_shares("".join(d.profile)))
        return self._models[key]

    def score(self, counts: Counter, scripts: dict[str, float], d) -> float:
        logp, profile_scripts = self._model(d)
        n = sum(counts.values())
        if not logp or not n:
            return 0.0
        best = max(logp.values())
        floor = math.log(ABSENT)
        mean = sum(c * logp.get(g, floor) for g, c in counts.items()) / n
        overlap = sum(min(s, profile_scripts.get(k, 0.0)) for k, s in scripts.items()) if scripts else 1.0
        fit = max(0.0, (mean - floor) / (best - floor))
        return overlap * (1.0 - FIT_WEIGHT + FIT_WEIGHT * fit)

    def choose(self, text, drafters):
        text = specialized.normalise(text[-ROUTING_CHARS:])
        n = specialized.PROFILE_N
        counts = Counter(text[i:i + n] for i in range(len(text) - n + 1))
        scripts = script_shares(text)
        scores = {d.name: round(self.score(counts, scripts, d), 4) for d in drafters}
        best = max(drafters, key=lambda d: scores[d.name], default=None)
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
