"""Specialized drafter sets, and the drafter that routes each request to one.

A target's set is the GGUF files of one folder per source, by the target's
name (``registry.model_name``): the package's
``edgespec/models/drafters/<target>/`` (shipped drafters), then the user's
``$EDGESPEC_HOME/drafters/<target>/`` (a file of the same name replaces a
shipped one); or, given explicitly (``--drafters DIR``), the files of ``DIR``
and of ``DIR/<target>/``. Each file's metadata (``specialized.py``) says what
it was trained for; one trained for another target's vocabulary stays out of
``auto`` and ``edgespec drafter list`` says why.

The routed drafter is ``auto``'s member for the set: a router (``router.py``)
chooses one drafter per request from its text, and that drafter (a
``ModelDrafter`` in trimmed-vocabulary mode, opened on first use and kept)
drafts under the name ``specialized:<file stem>``, so the planner keeps its
acceptance and cost apart from the others' and the stats name it.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Sequence

from ..errors import EdgespecError, InvalidArgumentError
from ..models import registry
from ..models.gguf import GGUFFile
from ..sampling import SamplingParams
from . import Draft, Drafter, DrafterConfig, Verified, head, specialized
from .router import open_router

PREFIX = "specialized:"   # drafter name of a set's member: PREFIX + its file stem
GUESS = 0.5               # a member's acceptance guess where its recipe measured none
MIN_PRIOR = 0.05          # its prior on text its router is sure it was not made for


@dataclass
class DrafterInfo:
    """One specialized drafter file, as its metadata describes it."""

    path: Path
    name: str                 # the file's stem
    target: str = ""          # the target it was trained for (KEY_TARGET)
    langs: tuple[str, ...] = ()
    profile: tuple[str, ...] = ()
    recipe: str = ""          # KEY_RECIPE: JSON text
    n_vocab: int = 0          # tokens kept
    target_n_vocab: int = 0
    n_params: int = 0
    size: int = 0             # bytes
    problem: str | None = None  # why it cannot draft for this target (None: it can)
    head: bool = False        # a draft head (drafters.head) rather than a draft model

    def recipe_summary(self, width: int = 100) -> str:
        """The recipe in one short line: its command if it names one, else its scalar fields."""
        try:
            recipe = json.loads(self.recipe) if self.recipe else {}
        except ValueError:
            return self.recipe[:width]
        if not isinstance(recipe, dict):
            return str(recipe)[:width]
        command = recipe.get("command")
        if command:
            line = " ".join(map(str, command)) if isinstance(command, list) else str(command)
        else:
            line = ", ".join(f"{k} {v}" for k, v in recipe.items() if isinstance(v, (str, int, float)))
        line = line if len(line) <= width else line[:width - 3] + "..."
        if self.held_out_acceptance is not None:
            line += f" (held-out acceptance {self.held_out_acceptance:.0%})"
        return line

    @property
    def held_out_acceptance(self) -> float | None:
        """The acceptance its training measured on held-out text (its recipe's), if any."""
        try:
            recipe = json.loads(self.recipe) if self.recipe else {}
            # a head's: the agreement of its first drafted token with the target's choice
            value = recipe.get("held_out_acceptance", recipe.get("held_out_agreement"))
        except (ValueError, AttributeError):
            return None
        return float(value) if isinstance(value, (int, float)) and 0 <= value <= 1 else None

    def to_dict(self) -> dict:
        return {"file": str(self.path), "name": self.name, "target": self.target, "langs": list(self.langs),
                "size": self.size, "parameters": self.n_params, "vocab": self.n_vocab,
                "target_vocab": self.target_n_vocab, "recipe": self.recipe_summary(), "problem": self.problem}


def set_folders(target_name: str, explicit: str | Path | None = None) -> list[Path]:
    """The folders of a target's set, in order (a later file of the same name
    replaces an earlier one)."""
    if explicit is not None:
        folder = Path(explicit).expanduser()
        if not folder.is_dir():
            raise InvalidArgumentError(f"drafters folder {folder}: no such folder")
        return [folder, folder / target_name]
    builtin = Path(str(resources.files("edgespec.builtin") / "drafters"))
    return [builtin / target_name, registry.home() / "drafters" / target_name]


def set_files(target_name: str, explicit: str | Path | None = None) -> list[Path]:
    """The GGUF files of a target's set, one per file name."""
    files: dict[str, Path] = {}
    for folder in set_folders(target_name, explicit):
        if folder.is_dir():
            for path in sorted(folder.glob("*.gguf")):
                files[path.name] = path
    return list(files.values())


def read_info(path: Path) -> DrafterInfo:
    """A drafter file's metadata; a file that is no specialized drafter comes
    back with its ``problem`` said."""
    info = DrafterInfo(path=path, name=path.stem)
    try:
        info.size = path.stat().st_size
        with GGUFFile(path) as f:
            info.head = f.get("general.architecture") == head.ARCH
            if info.head and specialized.KEY_LANGS not in f:
                info.problem = f"a draft head with no languages to route it by (no {specialized.KEY_LANGS})"
            elif not info.head and specialized.KEY_TOKEN_MAP not in f:
                info.problem = f"not a specialized drafter (no {specialized.KEY_TOKEN_MAP})"
            info.target = str(f.get(specialized.KEY_TARGET, ""))
            info.langs = tuple(map(str, f.get(specialized.KEY_LANGS) or ()))
            info.profile = tuple(map(str, f.get(specialized.KEY_PROFILE) or ()))
            info.recipe = str(f.get(specialized.KEY_RECIPE, ""))
            info.n_vocab = f.array_length(specialized.KEY_TOKEN_MAP) or f.array_length("tokenizer.ggml.tokens") or 0
            info.target_n_vocab = int(f.get(specialized.KEY_TARGET_N_VOCAB) or f.get(head.TARGET_N_VOCAB_KEY) or 0)
            if info.head:
                info.n_vocab = int(f.get(head.DRAFT_VOCAB_KEY) or info.target_n_vocab)
            info.n_params = sum(t.n_elements for t in f.tensors)
    except EdgespecError as e:
        info.problem = str(e)
    return info


def check_info(info: DrafterInfo, target) -> DrafterInfo:
    """``info`` with ``problem`` set when its drafter cannot draft for the
    ``target`` vocabulary (anything with ``n_vocab`` and ``token_text``): the
    trimmed-vocabulary checks of the model drafter."""
    from .model import checked_once, token_map   # the draft model's module loads backends: only when needed

    def problem() -> list:
        try:
            if info.head:
                head.check_target(target, info.path)
            else:
                token_map(target, info.path, info.n_vocab, info.name)
        except EdgespecError as e:
            return [str(e)]
        return [None]

    if info.problem is None:
        info.problem = checked_once("token-map", target, info.path, problem)[0]
    if info.problem is None and info.head:   # the backend's, never cached with the files' check
        info.problem = head.backend_problem(target)
    return info


def find_set(target, files: Sequence[Path]) -> list[DrafterInfo]:
    """The drafter ``files`` of a target's set, each checked against ``target``."""
    return [check_info(read_info(Path(p)), target) for p in files]


class RoutedDrafter(Drafter):
    """``auto``'s member for a target's specialized drafters: each request
    drafts with the one its router chooses (or with none)."""

    costly = True

    def __init__(self, config: DrafterConfig):
        self.config = config
        self.router = open_router(config.options.router)
        found = find_set(config.target, config.specialized)
        self.members = [i for i in found if i.problem is None]
        if not self.members:
            warnings.warn("no specialized drafter of this target's set can draft for it: "
                          + "; ".join(f"{i.path.name}: {i.problem}" for i in found), stacklevel=2)
        self.current: Drafter | None = None
        # Every member is made now, so that what each costs is known before a
        # request (from the cost cache, else measured now); each opens its
        # model when the planner first asks it for a draft.
        self._open: dict[str, Drafter] = {}
        try:
            for info in self.members:
                self._open[info.name] = self._load(info)
        except BaseException:
            self.close()
            raise
        self.name = PREFIX.rstrip(":")
        self.planner = None
        self._text: str | None = None
        self.scores: dict[str, float] = {}
        self.confidence: float | None = None   # the router's in the drafter chosen for the request

    @property
    def prior(self):
        return self.current.prior if self.current is not None else None

    @property
    def backlog_seconds(self) -> float:
        return self.current.backlog_seconds if self.current is not None else 0.0

    @property
    def cost(self):
        return self.current.cost if self.current is not None else None

    def route(self, text: str | None) -> None:
        self._text = text

    def _load(self, info: DrafterInfo) -> Drafter:
        from .model import ModelDrafter

        if info.head:
            d = head.HeadDrafter(replace(self.config, options=self.config.options.but(head=str(info.path))))
        else:
            d = ModelDrafter(replace(self.config, options=self.config.options.but(draft_model=str(info.path))))
        d.name = PREFIX + info.name
        return d

    def begin(self, prompt: Sequence[int], sampling: SamplingParams) -> None:
        text = self._text
        if text is None:   # token ids: route on their text
            target = self.config.target
            text = b"".join(target.piece(t) for t in prompt).decode("utf-8", "replace")
        self._text = None
        chosen, self.scores = self.router.choose(text, self.members) if self.members else (None, {})
        self.current = self._open[chosen.name] if chosen is not None else None
        self.confidence = None
        self.name = self.current.name if self.current is not None else PREFIX.rstrip(":")
        if self.current is not None:
            # Its acceptance guess (what its training measured on held-out
            # text) as far as the router is sure this text is what it was made for.
            self.confidence = self.router.confidence(text, chosen, self.scores.get(chosen.name, 0.0))
            guess = chosen.held_out_acceptance if chosen.held_out_acceptance is not None else GUESS
            self.current.prior = max(MIN_PRIOR, guess * self.confidence)
            self.current.planner = self.planner
            self.current.begin(prompt, sampling)

    def constrain(self, constraint) -> None:
        if self.current is not None:
            self.current.constrain(constraint)

    def backlog(self, context: Sequence[int]) -> int:
        return self.current.backlog(context) if self.current is not None else 0

    def opening(self) -> float:
        return self.current.opening() if self.current is not None else 0.0

    def open(self) -> None:
        if self.current is not None:
            self.current.open()

    def draft(self, context: Sequence[int], max_tokens: int) -> Draft:
        if self.current is None:
            return Draft(source=self.name)
        return self.current.draft(context, max_tokens)

    def accept(self, step: Verified) -> None:
        if self.current is not None:
            self.current.accept(step)

    def stats(self) -> dict:
        chosen = self.current.name[len(PREFIX):] if self.current is not None else None
        return {"specialized": chosen, "router": self.router.name, "scores": self.scores,
                "confidence": round(self.confidence, 3) if self.confidence is not None else None,
                **(self.current.stats() if self.current is not None else {})}

    def close(self) -> None:
        for d in self._open.values():
            d.close()
        self._open.clear()
        self.current = None


DRAFTER = RoutedDrafter
