"""Hardware-aware draft planning.

Speculation pays only when the tokens a step is expected to add outweigh what
the step costs on this machine. Two measurements decide it:

* the batch cost curve ``cost[k]``: time to evaluate k tokens in one target
  batch relative to one token (k = 1..32), measured once per model file,
  backend and thread count and cached on disk;
* acceptance, tracked online per drafter and per draft depth: alpha[d] is the
  chance that the token at depth d is accepted given that depth d - 1 was.

For a draft whose longest path has depth D and which has n nodes, the expected
tokens added are E = 1 + sum_{i<=D} prod_{j<=i} alpha[j], and the expected
speed relative to plain decoding is E / (cost[n + 1] + draft_cost). Plain
decoding scores exactly 1.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import registry

MAX_BATCH = 33            # cost curve covers batches of 1..MAX_BATCH tokens
COST_FILE = "batch-costs.json"
EMA = 0.9                 # weight kept by old acceptance evidence at each update
PRIOR_ALPHA = 0.6         # acceptance assumed before any evidence
EXPLORE_EVERY = 24        # plain steps between probes of a drafter the planner had dropped


def _cost_key(backend) -> str:
    st = Path(backend.path).stat()
    return f"{backend.name}:{Path(backend.path).name}:{st.st_size}:{backend.threads}"


MEASURED = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 28, 33)  # batch sizes timed; others interpolated


def measure_batch_costs(backend, *, reps: int = 3, prefix: int = 64) -> list[float]:
    """Time target batches of MEASURED sizes after a short prefix; returns
    cost[k] = t(k) / t(1) for k = 0..MAX_BATCH (cost[0] = 0), interpolated
    linearly between measured sizes. Leaves the KV cache cleared."""
    tokens = backend.tokenize("The quick brown fox jumps over the lazy dog. " * 16)
    while len(tokens) < prefix + MAX_BATCH:
        tokens += tokens
    backend.clear()
    backend.decode(tokens[:prefix], 0)
    times = {}
    for k in MEASURED:
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            backend.decode(tokens[prefix:prefix + k], prefix, all_logits=True)
            best = min(best, time.perf_counter() - t0)
            backend.truncate(prefix)
        times[k] = best
    backend.clear()
    costs = [0.0] * (MAX_BATCH + 1)
    for lo, hi in zip(MEASURED, MEASURED[1:]):
        for k in range(lo, hi + 1):
            w = (k - lo) / (hi - lo)
            costs[k] = ((1 - w) * times[lo] + w * times[hi]) / times[1]
    # Timings are noisy; a bigger batch never costs less.
    for k in range(2, MAX_BATCH + 1):
        costs[k] = max(costs[k], costs[k - 1])
    return costs


def batch_costs(backend, *, remeasure: bool = False) -> list[float]:
    """The cached cost curve for this backend, measuring it when missing."""
    path = registry.home() / COST_FILE
    key = _cost_key(backend)
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    if not remeasure and isinstance(table.get(key), list) and len(table[key]) == MAX_BATCH + 1:
        return table[key]
    costs = measure_batch_costs(backend)
    table[key] = costs
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table, indent=1))
    os.replace(tmp, path)
    return costs


@dataclass
class Acceptance:
    """Per-depth acceptance of one drafter, exponentially weighted."""

    alpha: list[float] = field(default_factory=lambda: [PRIOR_ALPHA] * MAX_BATCH)

    def update(self, depth: int, n_accepted: int) -> None:
        """A draft reaching ``depth`` had its first ``n_accepted`` levels accepted."""
        for d in range(min(depth, n_accepted + 1)):
            hit = 1.0 if d < n_accepted else 0.0
            self.alpha[d] = EMA * self.alpha[d] + (1 - EMA) * hit

    def expected_tokens(self, depth: int) -> float:
        """1 (the target's own token) + expected accepted draft tokens."""
        total, run = 1.0, 1.0
        for d in range(min(depth, MAX_BATCH)):
            run *= self.alpha[d]
            total += run
        return total


class Planner:
    """Chooses, each step, whether and how much to speculate."""

    def __init__(self, costs: list[float], *, may_skip: bool):
        self.costs = costs
        self.may_skip = may_skip       # False: an explicitly chosen drafter always drafts
        self.acceptance: dict[str, Acceptance] = {}
        self.draft_cost: dict[str, float] = {}   # drafting time in units of one target token
        self.t_token = None                      # seconds of one single-token target step
        self.plain_steps = 0
        self.choices: dict[str, int] = {}        # how often each option was taken

    def _acc(self, name: str) -> Acceptance:
        return self.acceptance.setdefault(name, Acceptance())

    def cost(self, n_tokens: int) -> float:
        return self.costs[min(n_tokens, MAX_BATCH)] * max(1.0, n_tokens / MAX_BATCH)

    def draft_budget(self, name: str, limit: int) -> int:
        """The most draft tokens worth asking ``name`` for (chain-shaped estimate)."""
        acc = self._acc(name)
        best_k, best = 0, 1.0
        for k in range(1, min(limit, MAX_BATCH - 1) + 1):
            value = acc.expected_tokens(k) / (self.cost(k + 1) + self.draft_cost.get(name, 0.0) * k)
            if value > best:
                best_k, best = k, value
        if best_k == 0 and not self.may_skip:
            best_k = min(limit, 2)
        if best_k == 0 and self.plain_steps >= EXPLORE_EVERY:
            best_k = 1  # probe now and then so acceptance estimates can recover
        return best_k

    def value(self, name: str, depth: int, n_nodes: int) -> float:
        """Expected speed of a draft relative to plain decoding."""
        acc = self._acc(name)
        return acc.expected_tokens(depth) / (self.cost(n_nodes + 1) + self.draft_cost.get(name, 0.0) * n_nodes)

    def worth_it(self, name: str, depth: int, n_nodes: int) -> bool:
        if n_nodes == 0:
            return False
        if not self.may_skip or self.plain_steps >= EXPLORE_EVERY:
            return True
        return self.value(name, depth, n_nodes) > 1.0

    def record(self, name: str, depth: int, n_accepted: int) -> None:
        self.choices[name] = self.choices.get(name, 0) + 1
        if name == "none":
            self.plain_steps += 1
            return
        self.plain_steps = 0
        self._acc(name).update(depth, n_accepted)

    def record_draft_time(self, name: str, seconds: float, n_nodes: int) -> None:
        if self.t_token and n_nodes:
            per_token = seconds / self.t_token / n_nodes
            old = self.draft_cost.get(name, per_token)
            self.draft_cost[name] = EMA * old + (1 - EMA) * per_token

    def record_step_time(self, seconds: float, n_tokens: int) -> None:
        """A target step of ``n_tokens`` took ``seconds``: refreshes the time of one token."""
        one = seconds / self.cost(n_tokens)
        self.t_token = one if self.t_token is None else EMA * self.t_token + (1 - EMA) * one

    def summary(self) -> dict:
        return {
            "choices": dict(self.choices),
            "batch_cost": [round(c, 3) for c in self.costs[1:17]],
            "alpha": {k: [round(a, 3) for a in v.alpha[:8]] for k, v in self.acceptance.items()},
            "draft_cost": {k: round(v, 4) for k, v in self.draft_cost.items()},
        }
