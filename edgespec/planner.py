"""Hardware-aware draft planning.

Speculation pays only when the tokens a step is expected to add outweigh what
the step costs on this machine. Two measurements decide it:

* the batch cost curve ``cost[k]``: time to evaluate k tokens in one target
  batch relative to one token (k = 1..32), measured once per model file,
  backend and thread count and cached on disk;
* acceptance, tracked online per kind of draft (a drafter, or a finer key it
  gives, such as the n-gram drafter's match length) and per draft depth:
  alpha[d] is the chance that the token at depth d is accepted given that
  depth d - 1 was.

For a draft whose longest path has depth D and which has n nodes, the expected
tokens added are E = 1 + sum_{i<=D} prod_{j<=i} alpha[j], and the expected
speed relative to plain decoding is E / cost[n + 1]. Plain decoding scores
exactly 1. A costly drafter (a draft model) is asked beforehand for only as
many tokens as pay once its own time per token is added to the cost.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from .models import registry
from .drafters import Draft

MAX_BATCH = 33            # cost curve covers batches of 1..MAX_BATCH tokens
COST_FILE = "batch-costs.json"
EMA = 0.9                 # weight kept by old acceptance evidence at each update
PRIOR_ALPHA = 0.5         # acceptance assumed before any evidence
EXPLORE_EVERY = 96        # plain steps between one-token probes of drafts the planner had dropped


def _cost_key(backend) -> str:
    st = Path(backend.path).stat()
    device = f"@{backend.ep}" if getattr(backend, "ep", None) else ""  # onnx: execution provider
    # An expert cache's batches read the union of their tokens' experts from
    # disk: a curve of its own for each setting.
    cache = getattr(backend, "expert_cache", None)
    experts = (f":experts-{cache.budget_mb}MB-{cache.precision}-{cache.policy}-{cache.prefetch}"
               if cache is not None else "")
    return f"{backend.name}{device}:{Path(backend.path).name}:{st.st_size}:{backend.threads}{experts}"


MEASURED = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 28, 33)  # batch sizes timed; others interpolated


def time_batches(backend, sizes, *, reps: int = 3, prefix: int = 64) -> dict[int, float]:
    """Seconds of one target batch of each of ``sizes`` tokens (every row's
    logits kept, as verification does) after a ``prefix``-token context, the
    fastest of ``reps``. Leaves the KV cache cleared. With an expert cache
    every batch is of other tokens (random ones), so each reads the union of
    its own tokens' experts as verification does, not the experts the
    previous repetition left cached."""
    tokens = backend.tokenize("The quick brown fox jumps over the lazy dog. " * 16)
    while len(tokens) < prefix + max(sizes):
        tokens += tokens
    fresh = getattr(backend, "expert_cache", None) is not None
    rng = random.Random(0)
    backend.clear()
    backend.decode(tokens[:prefix])
    times = {}
    for k in sizes:
        best = float("inf")
        for _ in range(reps):
            batch = [rng.randrange(backend.n_vocab) for _ in range(k)] if fresh else tokens[prefix:prefix + k]
            t0 = time.perf_counter()
            backend.decode(batch, logits_from=0)
            best = min(best, time.perf_counter() - t0)
            backend.truncate(prefix)
        times[k] = best
    backend.clear()
    return times


def measure_batch_costs(backend, *, reps: int = 3, prefix: int = 64) -> list[float]:
    """Time target batches of MEASURED sizes after a short prefix; returns
    cost[k] = t(k) / t(1) for k = 0..MAX_BATCH (cost[0] = 0), interpolated
    linearly between measured sizes. Leaves the KV cache cleared."""
    times = time_batches(backend, MEASURED, reps=reps, prefix=prefix)
    costs = [0.0] * (MAX_BATCH + 1)
    for lo, hi in zip(MEASURED, MEASURED[1:]):
        for k in range(lo, hi + 1):
            w = (k - lo) / (hi - lo)
            costs[k] = ((1 - w) * times[lo] + w * times[hi]) / times[1]
    # Timings are noisy; a bigger batch never costs less.
    for k in range(2, MAX_BATCH + 1):
        costs[k] = max(costs[k], costs[k - 1])
    return costs


BUSY = 0.5  # other work, in CPUs' worth per CPU, above which a measured curve is provisional


def _other_load() -> float:
    """The 1-minute load average per CPU (0 where the system does not say)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 0.0


def cached_measurement(file: str, key: str, field: str, measure: Callable[[], Any],
                       valid: Callable[[Any], bool], *, remeasure: bool = False) -> Any:
    """A measurement of this machine, cached in ``registry.home() / file`` as
    ``{key: {field: value, "load": load}}``; ``measure()`` runs when it is
    missing, not ``valid``, or ``remeasure`` is asked.

    A value measured while the machine was busy (other work loading it more
    than BUSY) is kept as provisional: it is measured again the next time the
    machine is quieter than it was then, so one busy first run does not
    decide for good."""
    path = registry.home() / file
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    entry, load = table.get(key), _other_load()
    # (an entry without a recorded load was written before loads were: measured again once)
    if (not remeasure and isinstance(entry, dict) and valid(entry.get(field))
            and not (entry.get("load", 0.0) > BUSY and load < entry["load"] - BUSY / 2)):
        return entry[field]
    value = measure()
    table[key] = {field: value, "load": round(load, 3)}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, path)
    except OSError:
        # An unwritable cache only costs a measurement per process: the value
        # is used all the same.
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return value


def batch_costs(backend, *, remeasure: bool = False) -> list[float]:
    """The cached cost curve for this backend, measuring it when missing
    (provisional when measured on a busy machine: see cached_measurement)."""
    return cached_measurement(COST_FILE, _cost_key(backend), "costs", lambda: measure_batch_costs(backend),
                              lambda c: isinstance(c, list) and len(c) == MAX_BATCH + 1, remeasure=remeasure)


def speedup_ceiling(costs: list[float]) -> tuple[float, int]:
    """The best speedup over plain decoding this cost curve allows, and the
    draft length giving it: max over k of (k + 1) / cost[k + 1], every draft
    token accepted (k drafted tokens and the target's own next one per step)."""
    return max(((k + 1) / costs[k + 1], k) for k in range(1, len(costs) - 1))


@dataclass
class Acceptance:
    """Per-depth acceptance of one kind of draft, exponentially weighted."""

    prior: float = PRIOR_ALPHA
    alpha: list[float] = field(default_factory=list)
    seen: int = 0   # depths with evidence: deeper ones are taken to be like the deepest of them

    def __post_init__(self):
        self.alpha = self.alpha or [self.prior] * MAX_BATCH

    def update(self, depth: int, n_accepted: int) -> None:
        """A draft reaching ``depth`` had its first ``n_accepted`` levels accepted."""
        reached = min(depth, n_accepted + 1)
        for d in range(reached):
            hit = 1.0 if d < n_accepted else 0.0
            self.alpha[d] = EMA * self.alpha[d] + (1 - EMA) * hit
        self.seen = max(self.seen, reached)

    def expected(self, depth: int) -> list[float]:
        """e[d] = 1 (the target's own token) + expected accepted tokens of a
        draft cut at depth d, for d = 0..depth. A depth never drafted yet
        borrows the acceptance of the deepest one seen, so that drafts that
        have only ever been short can grow."""
        e, run = [1.0], 1.0
        for d in range(min(depth, MAX_BATCH - 1)):
            run *= self.alpha[d] if d < self.seen or not self.seen else self.alpha[self.seen - 1]
            e.append(e[-1] + run)
        return e


def _cut(draft: Draft, max_depth: int) -> Draft:
    """The part of ``draft`` no deeper than ``max_depth``."""
    if draft.parents is None:
        return replace(draft, tokens=draft.tokens[:max_depth])
    depth = draft.node_depths()
    keep = [i for i in range(len(draft.tokens)) if depth[i] <= max_depth]
    index = {old: new for new, old in enumerate(keep)}
    return replace(draft, tokens=[draft.tokens[i] for i in keep],
                   parents=[index.get(draft.parents[i], -1) for i in keep])


class Planner:
    """Chooses, each step, whether and how much to speculate. Lives as long as
    its engine: acceptance learned in one generation serves the next."""

    def __init__(self, costs: list[float]):
        self.costs = costs
        self.acceptance: dict[str, Acceptance] = {}
        self.draft_cost: dict[str, float] = {}   # drafting time per token, in target tokens
        self.catch_up_cost: dict[str, float] = {}  # a costly drafter's time per unseen context token, likewise
        self.t_token: float | None = None        # seconds of a one-token target step
        self.plain_steps = 0                     # plain steps since the last draft

    def _acc(self, key: str, prior: float | None = None) -> Acceptance:
        acc = self.acceptance.get(key)
        if acc is None:
            acc = self.acceptance[key] = Acceptance(prior if prior is not None else PRIOR_ALPHA)
        return acc

    def cost(self, n_tokens: int) -> float:
        return self.costs[min(n_tokens, MAX_BATCH)] * max(1.0, n_tokens / MAX_BATCH)

    def probing(self) -> bool:
        """Time to try a minimal draft so that acceptance estimates can recover."""
        return self.plain_steps >= EXPLORE_EVERY

    def budget(self, key: str, limit: int, may_skip: bool, prior: float | None = None) -> int:
        """How many tokens to ask a costly drafter (one that spends time per
        token, like a draft model) for: the chain length worth the most.
        ``prior``: the drafter's guess of its acceptance before any evidence;
        a drafter without evidence yet is asked for a short probe."""
        acc = self._acc(key, prior)
        if not acc.seen and key not in self.draft_cost and limit > 0:
            return min(limit, 2)   # nothing known yet: a probe measures its cost
        e = acc.expected(limit)
        per_token = self.draft_cost.get(key, 0.0)
        best_k, best = 0, 1.0
        for k in range(1, len(e)):
            value = e[k] / (self.cost(k + 1) + per_token * k)
            if value > best:
                best_k, best = k, value
        if best_k == 0 and limit > 0 and (not may_skip or self.probing()):
            best_k = 1 if may_skip else min(limit, 2)
        return best_k

    def worth(self, key: str, limit: int, prior: float | None = None) -> float:
        """The most a costly drafter's chain of up to ``limit`` tokens is
        expected to be worth (speed relative to plain decoding, drafting time
        included): a cheaper draft already worth as much makes asking it moot."""
        e = self._acc(key, prior).expected(limit)
        per_token = self.draft_cost.get(key, 0.0)
        return max((e[k] / (self.cost(k + 1) + per_token * k) for k in range(1, len(e))), default=0.0)

    def catch_up_pays(self, key: str, backlog: int, room: int, alternative: float, limit: int,
                      prior: float | None = None) -> bool:
        """Whether a costly drafter that must first evaluate ``backlog`` context
        tokens it has not seen is worth asking: the time its expected speed
        saves over ``alternative`` (the best draft in hand, or 1 for plain
        decoding) for the ``room`` tokens left must exceed the catch-up time.
        Unmeasured catch-up costs are measured by asking."""
        per_token = self.catch_up_cost.get(key)
        if backlog <= 0 or per_token is None:
            return True
        value = self.worth(key, limit, prior)
        if value <= alternative:
            return False
        return room / alternative - room / value > backlog * per_token

    def record_catch_up(self, key: str, seconds: float, n_tokens: int) -> None:
        if self.t_token and n_tokens > 0:
            per_token = seconds / self.t_token / n_tokens
            old = self.catch_up_cost.get(key, per_token)
            self.catch_up_cost[key] = EMA * old + (1 - EMA) * per_token

    def widen(self, key: str, n_chain: int, gains: list[float]) -> int:
        """How many leaves to add to a chain of ``n_chain`` tokens, taking
        ``gains`` in order (each the expected tokens a leaf adds: the chance
        that the chain is accepted up to its parent and the leaf's token is
        the target's): as many as raise the expected speed, a tree's accepted
        path costing its evaluation again with the next batch."""
        e = self._acc(key).expected(n_chain)[-1]
        marginal = self.cost(2) - self.cost(1)
        best, best_j, g = e / self.cost(n_chain + 1), 0, 0.0
        for j, gain in enumerate(gains, 1):
            g += gain
            value = (e + g) / (self.cost(n_chain + 1 + j) + (e + g - 1.0) * marginal)
            if value > best:
                best, best_j = value, j
        return best_j

    def cut(self, draft: Draft, may_skip: bool) -> tuple[Draft, float]:
        """The most valuable part of ``draft`` (cut by depth) and its expected
        speed relative to plain decoding (1.0). An explicitly chosen drafter
        (may_skip False) keeps at least its first level."""
        depths = draft.node_depths()
        if not depths:
            return draft, 0.0
        # Drafting time is spent by now (budget() weighed it): only the
        # target batch is left to pay for.
        e = self._acc(draft.key or draft.source, draft.prior).expected(max(depths))
        marginal = self.cost(2) - self.cost(1)
        tree = draft.parents is not None
        n_within = [0] * (len(e) + 1)  # n_within[d]: nodes no deeper than d
        for x in depths:
            if x < len(n_within):
                n_within[x] += 1
        for d in range(1, len(n_within)):
            n_within[d] += n_within[d - 1]
        best_d, best = 0, 1.0
        for d in range(1, len(e)):
            n = n_within[d]
            cost = self.cost(n + 1)
            if tree:  # the accepted path is evaluated again with the next batch
                cost += (e[d] - 1.0) * marginal
            value = e[d] / cost
            if value > best:
                best_d, best = d, value
        if best_d == 0:
            if may_skip and not self.probing():
                return Draft(source=draft.source), 0.0
            if may_skip:  # a probe: one token is enough to learn from
                return replace(draft, tokens=draft.tokens[:1], parents=[-1] if tree else None), 1.0
            best_d, best = 1, 1.0
        return _cut(draft, best_d), best

    def record(self, key: str, depth: int, n_accepted: int) -> None:
        if key == "none":
            self.plain_steps += 1
            return
        self.plain_steps = 0
        self._acc(key).update(depth, n_accepted)

    def record_draft_time(self, key: str, seconds: float, n_tokens: int) -> None:
        if self.t_token and n_tokens:
            per_token = seconds / self.t_token / n_tokens
            old = self.draft_cost.get(key, per_token)
            self.draft_cost[key] = EMA * old + (1 - EMA) * per_token

    def record_step_time(self, seconds: float, n_tokens: int) -> None:
        """A target step of ``n_tokens`` took ``seconds``: refreshes the time of one token."""
        one = seconds / self.cost(n_tokens)
        self.t_token = one if self.t_token is None else EMA * self.t_token + (1 - EMA) * one

    def summary(self) -> dict:
        return {
            "batch_cost": [round(c, 3) for c in self.costs[1:17]],
            "alpha": {k: [round(a, 3) for a in v.alpha[:8]] for k, v in self.acceptance.items()},
            "draft_cost": {k: round(v, 4) for k, v in self.draft_cost.items()},
        }
