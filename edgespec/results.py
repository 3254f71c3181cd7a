"""What a generation gives back: its text and tokens (``Result``), its
timing and counters (``GenerationStats``), what speculation did
(``SpecStats``), and the steps the engine's step generator yields (``Step``)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .chat import tools as chat_tools
from .sampling import TokenLogprob


@dataclass
class SpecStats:
    """What speculation did during one generation."""

    drafted: int = 0          # draft tokens (tree nodes) sent to the target
    accepted: int = 0         # of those, accepted
    target_steps: int = 0     # target forward passes after prefill
    spec_steps: int = 0       # of those, with a draft
    per_drafter: dict = field(default_factory=dict)   # name -> {steps, drafted, accepted}
    by_length: dict = field(default_factory=dict)     # draft length -> {steps, accepted}
    planner: dict = field(default_factory=dict)
    drafters: dict = field(default_factory=dict)      # drafter-specific counters

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Draft tokens accepted per target step."""
        return self.accepted / self.target_steps if self.target_steps else 0.0

    @property
    def specialized(self) -> str | None:
        """The specialized drafter the router chose for this generation (its
        file stem; None: none), whether or not the planner used it."""
        return next((d["specialized"] for d in self.drafters.values() if d.get("specialized")), None)

    def count(self, name: str, drafted: int, accepted: int) -> None:
        self.target_steps += 1
        if drafted:
            self.spec_steps += 1
            self.drafted += drafted
            self.accepted += accepted
            d = self.per_drafter.setdefault(name, {"steps": 0, "drafted": 0, "accepted": 0})
            d["steps"] += 1
            d["drafted"] += drafted
            d["accepted"] += accepted
            n = self.by_length.setdefault(drafted, {"steps": 0, "accepted": 0})
            n["steps"] += 1
            n["accepted"] += accepted

    def to_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_accepted"] = self.mean_accepted
        d["specialized"] = self.specialized
        return d


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0         # prompt tokens whose K/V were reused from an earlier generation
    slot: int = 0                  # the KV-cache slot it ran in
    n_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stop_reason: str = ""          # "eos", "stop", "length", "context", "cancelled"; "" if closed early
    stop_string: str | None = None  # with stop_reason "stop": the stop string that ended it
    seed: int = 0
    drafter: str = "none"
    spec: SpecStats | None = None   # None for plain decoding
    experts: dict | None = None     # the expert cache's counters over this generation (moe.stats_dict)
    context_shifts: int = 0         # times a full context dropped its oldest half (context_shift) and went on

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens / decode time (prefill excluded)."""
        return self.n_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens evaluated (the cached ones excluded) / prefill time."""
        evaluated = self.prompt_tokens - self.cached_tokens
        return evaluated / self.prefill_s if self.prefill_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.spec is not None:
            d["spec"] = self.spec.to_dict()
        d["tokens_per_s"] = self.tokens_per_s
        d["prefill_tokens_per_s"] = self.prefill_tokens_per_s
        return d


@dataclass
class Result:
    text: str
    tokens: list[int]
    stats: GenerationStats = field(default_factory=GenerationStats)
    logprobs: list[TokenLogprob] | None = None   # one per token, when asked for
    parsed: chat_tools.Parsed | None = None      # with tools: the reply split into text and calls

    @property
    def tool_calls(self) -> list[chat_tools.ToolCall]:
        return self.parsed.tool_calls if self.parsed else []


@dataclass
class Step:
    """One target step of a generation, as the step generator yields it."""

    tokens: list[int]        # appended to the text: accepted draft tokens, then the target's own
    seconds: float           # wall time of the step (the first: prompt evaluation)
    drafted: int = 0         # draft tokens (tree nodes) verified
    accepted: int = 0        # of those, accepted
    source: str = ""         # the drafter of the draft ("" for a plain step)
    cached: int = 0          # the first step: prompt tokens whose K/V the cache already held
    logprobs: list[TokenLogprob] | None = None  # one per token, when asked for
    shifted: bool = False    # the context was shifted before this step (context_shift)
