"""Drafters: cheap proposers of tokens that the target model verifies.

A drafter is a handful of verbs (the ``Drafter`` base class); each kind lives in
its own module ``edgespec.drafters.<name>`` exposing ``DRAFTER`` (its class),
found by name. The heavy data structures (n-gram index and cache, recycling matrix)
are in the C core; these modules are thin.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Sequence

from ..config import DEFAULT_CTX, DRAFTERS, EngineConfig
from ..costs import DraftCost
from ..errors import InvalidArgumentError
from ..sampling import SamplingParams



@dataclass
class Draft:
    """Proposed tokens: a chain, or a tree when ``parents`` is given."""

    tokens: list[int] = field(default_factory=list)  # (n_nodes)
    parents: list[int] | None = None  # (n_nodes) parent node, -1 = under the root; None = chain
    probs: int | None = None  # address of (n_nodes, n_vocab) float32 draft distributions, or None
    source: str = ""  # the drafter that made it
    key: str = ""     # acceptance statistics bucket (default: source), e.g. "ngram:3"
    prior: float | None = None  # the drafter's guess of per-token acceptance for a new key
    # (chain) the drafter's own probability of each token of its chain (the
    # first nodes of a widened tree), under greedy decoding: what the planner
    # cuts a draft by (EAGLE-2: a head's confidence predicts acceptance)
    confidence: list[float] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def node_depths(self) -> list[int]:
        """Depth of each node: 1 for children of the root."""
        if self.parents is None:
            return list(range(1, len(self.tokens) + 1))
        depth: list[int] = []
        for p in self.parents:
            depth.append(1 if p < 0 else depth[p] + 1)
        return depth

    def first_path(self) -> Draft:
        """A tree's first root-to-leaf path (each node's first child) as a chain;
        a chain as it is. (Tree drafts carry no q rows.)"""
        if self.parents is None:
            return self
        keep, node = [], -1
        for i, p in enumerate(self.parents):
            if p == node:  # the first child of the last node kept
                keep.append(i)
                node = i
        return replace(self, tokens=[self.tokens[i] for i in keep], parents=None)

    @property
    def depth(self) -> int:
        """Longest root-to-leaf path: the most tokens this draft can add."""
        return len(self.tokens) if self.parents is None else max(self.node_depths(), default=0)


@dataclass
class Verified:
    """What one target step made of a draft; drafters learn from it."""

    draft: Draft
    n_accepted: int          # draft tokens accepted
    tokens: list[int]        # tokens appended to the text: accepted, then the target's own
    logits: int              # address of this step's (n_rows, n_vocab) target logits
    row_tokens: list[int]    # (n_rows) the token each logits row was computed at
    slot: int | None = None  # the target's KV-cache slot the rows are of (None: the selected one)


@dataclass
class DrafterConfig:
    """What a drafter may need to set itself up: the engine's options
    (draft_model, draft_backend, ep, ngram_cache, router, threads, ...) and
    what the loaded target gives. Each kind reads its own fields."""

    n_vocab: int
    target: object = None            # the target backend (tokenizer checks, vocabulary)
    options: EngineConfig = field(default_factory=EngineConfig)
    paired_draft: str | None = None  # the built-in draft model the registry pairs with the target
    specialized: tuple = ()          # routed drafter: the target's set of specialized drafter files
    n_ctx: int = DEFAULT_CTX         # the target's context (a draft model's cache follows its text)


class Drafter(ABC):
    """The drafter protocol. Each verb has a default but ``draft``."""

    name: str
    costly: bool = False  # drafting spends real time per token (a draft model): ask only for what pays
    prior: float | None = None  # costly drafters: guessed acceptance before any evidence (None: the planner's)
    # Costly drafters: what drafting and catching up cost on this machine,
    # measured when the drafter opens (None: unknown, the planner assumes a
    # cautious cost until it has timed some drafts).
    cost: DraftCost | None = None
    planner = None        # the engine's Planner, set before the first draft (drafters that size trees read it)
    # Costly drafters: seconds of the last draft spent catching up with text
    # that steps without this drafter added (not a cost of drafting per step).
    backlog_seconds: float = 0.0

    def backlog(self, context: Sequence[int]) -> int:
        """Tokens of ``context`` this drafter has not seen, which it would
        evaluate before drafting (a draft model that earlier steps went without)."""
        return 0

    def opening(self) -> float:
        """Seconds its first draft would spend opening what it drafts with
        (a draft model or head opened on first use: costs.open_seconds), 0
        once open: the planner charges them with its backlog."""
        return 0.0

    def open(self) -> None:
        """Open what it drafts with now (the planner does, before it times a
        draft, so that opening is not taken for drafting)."""

    def begin(self, prompt: Sequence[int], sampling: SamplingParams) -> None:
        """A new generation starts: ``prompt`` is its whole context, ``sampling``
        how the target chooses tokens (a draft model drafts the same way)."""

    def route(self, text: str | None) -> None:
        """The request about to begin is about ``text`` (a chat's messages
        but the system's, or the prompt; None: only its tokens say): for a
        drafter that chooses by it (the routed one)."""

    def constrain(self, constraint) -> None:
        """A grammar (an ``edgespec.grammar.Constraint``, or None) constrains the
        generation begun last. The engine prunes every draft to it anyway; a
        drafter that samples (the draft model) drafts inside it, through
        ``constraint.lookahead()``."""

    @abstractmethod
    def draft(self, context: Sequence[int], max_tokens: int) -> Draft:
        """Propose up to ``max_tokens`` tokens (tree nodes) following ``context``
        (prompt + output so far; its last token is the root)."""

    def accept(self, step: Verified) -> None:
        """Learn from a verified step; ``step.tokens`` now extend the context."""

    def stats(self) -> dict:
        """Drafter-specific counters for the result's stats."""
        return {}

    def close(self) -> None:
        """Free what the drafter owns; safe to call twice."""


def open_drafter(name: str, config: DrafterConfig) -> Drafter:
    """The drafter module called ``name`` (not "none" or "auto")."""
    return importlib.import_module(f"{__name__}.{name}").DRAFTER(config)


def auto_members(config: DrafterConfig) -> list[str]:
    """What "auto" chooses among: the n-gram drafter, plus the n-gram cache
    when the user gave one, the specialized drafter a router chooses per
    request when the target has a set of them (``routed``), the draft head
    when the user gave a head file (``head``), and the draft model when the
    user gave one or the registry pairs one with the target.
    Cheap drafters come first (the engine asks a costly one only when the
    drafts before it are worth less; a specialized drafter costs a few
    percent of a paired model). Token recycling is left out: its trees cost
    more than they add on every measured suite (README, Performance)."""
    names = ["ngram"]
    if config.options.ngram_cache:
        names.append("cache")
    if config.specialized:
        names.append("routed")
    if config.options.head:
        names.append("head")
    if config.options.draft_model or config.paired_draft:
        names.append("model")
    return names


def check_name(name: str) -> str:
    if name not in DRAFTERS:
        raise InvalidArgumentError(f"unknown drafter '{name}' (available: {', '.join(DRAFTERS)})")
    return name
