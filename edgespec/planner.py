"""Hardware-aware draft planning: at every step, which draft (if any) to verify.

Speculation pays only when the tokens a step is expected to add outweigh what
the step costs on this machine. The planner weighs:

* the batch cost curve ``cost(k)``: time to evaluate k tokens in one target
  batch relative to one token. The curve measured at load (edgespec.costs)
  is a prior; the planner corrects it from its own timed steps (``CostCurve``:
  the median of the recent steps of each batch size, within what physics
  allows, weighed against the prior by how many there are), so neither a
  curve measured on a busy machine nor one noisy step decides a run;
* acceptance, tracked online per kind of draft (a drafter, or a finer key it
  gives, such as the n-gram drafter's match length) and per draft depth:
  alpha[d] is the chance that the token at depth d is accepted given that
  depth d - 1 was;
* on a MoE model whose experts an expert cache reads from disk (issue 32),
  the reads a batch waits for (``ExpertMisses``): a batch of k tokens needs
  the union of its tokens' experts, so it misses more than one token does;
  the misses per batch size and the stall per miss are measured from the
  cache's counters at every step (the union of uniform routing the prior
  for sizes not seen yet), and added to the batch's compute, which the
  curve above then holds alone;
* what a costly drafter (a draft model) spends: time per drafted token, and
  time per context token it must first catch up on (a prompt it has not
  seen). Its measured ``DraftCost`` is the prior, corrected by timings like
  the curve.

For a draft whose longest path has depth D and which has n nodes, the expected
tokens added are E = 1 + sum_{i<=D} prod_{j<=i} alpha[j], and the expected
speed relative to plain decoding is E / cost(n + 1). Plain decoding scores
exactly 1. A costly drafter is asked only when its expected saving over the
tokens still to generate exceeds its catch-up, and one without evidence yet
only while trying it costs less than EXPLORE_SHARE of that generation's
plain decoding time; it is then asked for as many tokens as pay once its own
time per token is added to the cost.

In a batch shared with other generations (``shared``: their tokens in it),
a draft is weighed by the whole batch's tokens per unit of time: it must
add more than the time its tokens add to the batch takes from the others.

Acceptance is kept per route of text (``begin``: the request's script and
whether it is code or prose, ``drafters.router.text_route``), and with an
``AcceptanceMemory`` (edgespec.learned) what one process learned per route,
each costly drafter's measured cost and the batch costs timed, are the
next process's priors (``end`` saves them). A planner that may choose takes
a plain step now and then (``CostCurve.wants_plain``): drafting at every
step would leave the one-token time, the unit of the whole curve, unmeasured.
"""
from __future__ import annotations

import bisect
import statistics
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Sequence

from .costs import MAX_BATCH, DraftCost, plausible
from .drafters import Draft, Drafter
from .drafters.router import text_route
from .learned import AcceptanceMemory

DECAY = 0.95              # weight kept by old acceptance counts at each update (about 20 steps' memory)
PRIOR_STRENGTH = 2.0      # observations' worth of evidence a drafter's guessed acceptance counts as
PRIOR_ALPHA = 0.5         # acceptance assumed before any evidence
EXPLORE_EVERY = 96        # plain steps between one-token probes of drafts the planner had dropped
WINDOW = 9                # recent timings kept per quantity: decisions read their median
MIN_SAMPLES = 3           # timings before a measured value moves away from its prior
PRIOR_WEIGHT = 0.5        # timings' worth of evidence a cached measurement counts as
REBUILD_EVERY = 8         # plain steps between rebuilds of the corrected cost curve
# A planner that drafts at every step never times a one-token step, the unit
# its curve is corrected against, and keeps a curve measured at another time
# (qwen2.5-coder-1.5b: 1.12 cached for 2 and 3 tokens, 1.26-1.35 timed in the
# same hour on a VM whose bandwidth moves). It takes a plain step every
# CALIBRATE_EVERY steps while fewer than MIN_SAMPLES are timed, and one every
# RECALIBRATE_EVERY steps after, so that the unit follows the machine.
CALIBRATE_EVERY = 4
RECALIBRATE_EVERY = 64
# Timings' worth of evidence the memory's curve (what earlier processes
# timed) counts as against this process's: one process moves it at most
# half of the way (geometrically), a short answer timing one token
# MIN_SAMPLES times a quarter. One process alone replaced it before, and
# on a VM whose speed drifts within a minute a 96-token answer timed 2
# tokens at 1.64x one where batches timed alone cost 1.15x: the next
# processes then declined 2-token drafts, so that size was never timed
# again to correct it.
CURVE_MEMORY = WINDOW
EXPLORE_SHARE = 0.03      # most of a generation's plain decoding time trying an unproven costly drafter may cost
# A draft is verified only if it is expected to beat plain decoding by this
# much: acceptance and costs are estimates, and a draft expected to gain
# 1% loses as often as it wins (chat on qwen2.5-coder-1.5b: prompt lookup's
# short matches, accepted 12-20%, ran at 0.92-0.96x plain).
DRAFT_MARGIN = 0.03
MEMORY_STRENGTH = 8.0     # observations' worth (at depth 1) of what earlier processes learned about a key
EXPECTED_ROOM_MIN = 16    # tokens a generation is expected to go on for before it has made as many
# A drafter's own probability of a greedy token predicts whether the target
# takes it (EAGLE-2). The shipped heads of qwen2.5-coder-1.5b, on held-out
# chat, code and translation: tokens drafted at 0-0.2 accepted 6%, 0.2-0.4
# 17%, 0.4-0.6 27%, 0.6-0.8 38%, 0.8-0.95 57%, above 0.95 90%. Before
# evidence a token counts as accepted at CONFIDENCE_PRIOR times its
# probability, as CONFIDENCE_STRENGTH observations of its bin.
CONFIDENCE_BINS = 10
CONFIDENCE_PRIOR = 0.6
CONFIDENCE_STRENGTH = 8.0
CONFIDENCE_DECAY = 0.99   # per update of a bin: a drafter's calibration changes slowly, unlike its text


class Timings:
    """Recent timings of one quantity; ``median`` once there are MIN_SAMPLES."""

    def __init__(self):
        self.window: deque[float] = deque(maxlen=WINDOW)

    def add(self, value: float) -> None:
        self.window.append(value)

    def __len__(self) -> int:
        return len(self.window)

    @property
    def median(self) -> float | None:
        return statistics.median(self.window) if len(self.window) >= MIN_SAMPLES else None

    def blend(self, prior: float, measured: float) -> float:
        """``measured`` weighed against ``prior`` by the evidence behind it,
        geometrically (costs are ratios): the prior counts as PRIOR_WEIGHT
        timings, since a cached measurement may have been taken on a busier
        (or quieter) machine than this process runs on."""
        w = len(self.window) / (len(self.window) + PRIOR_WEIGHT)
        return prior ** (1 - w) * measured ** w


class CostCurve:
    """The time of a target batch of n tokens in one-token steps: the prior
    curve measured at load, corrected by the timed steps of this planner."""

    def __init__(self, prior: list[float], learned: dict[int, float] | None = None):
        """``prior``: the curve measured at load; ``learned``: batch size ->
        cost an earlier process timed (``ratios``), which replace the prior
        at those sizes (and scale it between and beyond them)."""
        prior = plausible(prior)
        factors = {n: r / prior[n] for n, r in (learned or {}).items() if 1 < n <= MAX_BATCH}
        self.prior = _scaled(prior, factors) if factors else prior
        self.steps: dict[int, Timings] = {}   # batch size -> seconds of recent steps
        self._table: list[float] | None = None  # the corrected curve, rebuilt after new timings
        self._plain_since_rebuild = 0
        self._since_plain = 0                 # steps timed since the last one-token one
        self._t_token: tuple[float | None] | None = None   # t_token until the next timing (asked often per step)

    def record(self, seconds: float, n_tokens: int) -> None:
        n = min(n_tokens, MAX_BATCH)
        timings = self.steps.setdefault(n, Timings())
        timings.add(seconds)
        self._t_token = None
        self._since_plain = 0 if n == 1 else self._since_plain + 1
        # A plain step moves the unit (the median one-token time) only a
        # little: the curve is rebuilt after a batch's timing, or every
        # REBUILD_EVERY plain steps, so that declining to draft stays cheap.
        self._plain_since_rebuild += n == 1
        if n > 1 or self._plain_since_rebuild >= REBUILD_EVERY:
            self._table = None
            self._plain_since_rebuild = 0

    @property
    def t_token(self) -> float | None:
        """Seconds of a one-token step: the median of recent plain steps, else
        what the recent steps of other sizes say through the curve."""
        if self._t_token is None:
            one = self.steps.get(1)
            if one is not None and one.median is not None:
                self._t_token = (one.median,)
            else:
                recent = [s / self.prior[n] for n, t in self.steps.items() for s in t.window]
                self._t_token = (statistics.median(recent) if recent else None,)
        return self._t_token[0]

    def table(self) -> list[float]:
        if self._table is None:
            self._table = self._corrected()
        return self._table

    def _corrected(self) -> list[float]:
        """The prior scaled at each size by what timings of that size (or the
        nearest timed sizes, interpolated) say; one-token steps are the unit."""
        ratios = self.ratios()
        factors = {n: self.steps[n].blend(self.prior[n], r) / self.prior[n] for n, r in ratios.items()}
        return _scaled(self.prior, factors) if factors else self.prior

    def ratios(self) -> dict[int, float]:
        """Batch size -> its timed cost in one-token steps (the median of its
        recent steps over that of recent one-token steps, within what physics
        allows), for each size timed enough; {} before one-token steps are."""
        one = self.steps.get(1)
        t1 = one.median if one is not None else None
        if not t1:
            return {}
        return {n: min(max(t.median / t1, 1.0), float(n))
                for n, t in self.steps.items() if n > 1 and t.median is not None}

    def learned(self) -> dict[int, float]:
        """What this process adds to the memory's curve: at each size timed
        enough, the curve it started from (``prior``: the memory's, or the
        one measured at load) moved towards the timed ratio by the share its
        timings hold against CURVE_MEMORY earlier ones, geometrically."""
        one = self.steps.get(1)
        moved = {}
        for n, r in self.ratios().items():
            k = min(len(self.steps[n]), len(one))
            w = k / (k + CURVE_MEMORY)
            moved[n] = self.prior[n] ** (1 - w) * r ** w
        return moved

    def wants_plain(self) -> bool:
        """Whether the next step should be plain, to time the unit the curve is corrected against."""
        one = self.steps.get(1)
        if one is None or one.median is None:
            return self._since_plain >= CALIBRATE_EVERY - 1
        return self._since_plain >= RECALIBRATE_EVERY - 1

    def __call__(self, n_tokens: int) -> float:
        return self.table()[min(n_tokens, MAX_BATCH)] * max(1.0, n_tokens / MAX_BATCH)


def _scaled(prior: list[float], factors: dict[int, float]) -> list[float]:
    """``prior`` scaled at each size by ``factors`` (batch size -> factor; 1
    at one token, the unit), geometrically between the sizes given and by the
    largest one's factor beyond it."""
    factors = {1: 1.0, **factors}
    sizes = sorted(factors)   # 1 first
    table = [0.0, 1.0]
    for n in range(2, MAX_BATCH + 1):
        i = bisect.bisect_left(sizes, n)
        if i == len(sizes):       # past the largest size given: its factor
            f = factors[sizes[-1]]
        elif sizes[i] == n:
            f = factors[n]
        else:                     # between two given sizes: geometric interpolation
            lo, hi = sizes[i - 1], sizes[i]
            w = (n - lo) / (hi - lo)
            f = factors[lo] ** (1 - w) * factors[hi] ** w
        table.append(prior[n] * f)
    return plausible(table)


class ExpertMisses:
    """The expert reads a target batch waits for, on a model whose experts
    an expert cache reads from disk: misses per batch size (the median of
    recent steps of that size) times the stall per miss (the median over
    recent steps of any size). A size not timed yet scales the nearest one
    timed by the union of uniform routing: n tokens each choosing top_k of
    n_expert experts touch n_expert * (1 - (1 - top_k / n_expert)^n)."""

    def __init__(self, n_expert: int, top_k: int):
        self.n_expert, self.top_k = n_expert, top_k
        self.misses: dict[int, Timings] = {}   # batch size -> misses of recent steps
        self.per_miss = Timings()              # seconds decoding waited per miss

    def record(self, n_tokens: int, misses: int, stall_s: float) -> None:
        n = min(n_tokens, MAX_BATCH)
        self.misses.setdefault(n, Timings()).add(float(misses))
        if misses > 0:
            self.per_miss.add(stall_s / misses)

    @staticmethod
    def waited(before: dict, after: dict) -> dict:
        """The misses and stall seconds of a step, from the expert cache's
        counters (Backend.expert_stats) read before and after it: the
        keywords of Planner.record_step_time."""
        return dict(misses=(after["lookups"] - after["hits"]) - (before["lookups"] - before["hits"]),
                    stall_s=(after["stall_ns"] - before["stall_ns"]) / 1e9)

    def _union(self, n: int) -> float:
        return self.n_expert * (1.0 - (1.0 - self.top_k / self.n_expert) ** n)

    def expected(self, n_tokens: int) -> float:
        """Misses of a batch of n_tokens (0 before any step was timed)."""
        n = min(n_tokens, MAX_BATCH)
        timed = [m for m, t in self.misses.items() if t.median is not None]
        if not timed:
            return 0.0
        if n in timed:
            return self.misses[n].median
        near = min(timed, key=lambda m: (abs(m - n), m))
        return self.misses[near].median * self._union(n) / self._union(near)

    def seconds(self, n_tokens: int) -> float:
        """Seconds a batch of n_tokens is expected to wait for expert reads."""
        t = self.per_miss.median
        return self.expected(n_tokens) * t if t is not None else 0.0


@dataclass
class Acceptance:
    """Per-depth acceptance of one kind of draft: alpha[d], the chance that the
    token at depth d is accepted given that depth d - 1 was, estimated from
    counts (hits over trials at that depth, both decayed by DECAY per update
    so the estimate follows a text that changes) and the prior, which counts
    as PRIOR_STRENGTH observations: one rejection of a hopeful new key stops
    it, a run of acceptances makes it bold."""

    prior: float = PRIOR_ALPHA
    hits: list[float] = field(default_factory=lambda: [0.0] * MAX_BATCH)
    trials: list[float] = field(default_factory=lambda: [0.0] * MAX_BATCH)
    seen: int = 0   # depths with evidence: deeper ones are taken to be like the deepest of them

    @property
    def alpha(self) -> list[float]:
        return [(self.prior * PRIOR_STRENGTH + h) / (PRIOR_STRENGTH + t) for h, t in zip(self.hits, self.trials)]

    def update(self, depth: int, n_accepted: int) -> None:
        """A draft reaching ``depth`` had its first ``n_accepted`` levels accepted."""
        reached = min(depth, n_accepted + 1)
        for d in range(reached):
            self.trials[d] = DECAY * self.trials[d] + 1.0
            self.hits[d] = DECAY * self.hits[d] + (1.0 if d < n_accepted else 0.0)
        self.seen = max(self.seen, reached)

    def expected(self, depth: int) -> list[float]:
        """e[d] = 1 (the target's own token) + expected accepted tokens of a
        draft cut at depth d, for d = 0..depth. A depth never drafted yet
        borrows the acceptance of the deepest one seen, so that drafts that
        have only ever been short can grow."""
        alpha = self.alpha
        e, run = [1.0], 1.0
        for d in range(min(depth, MAX_BATCH - 1)):
            run *= alpha[d] if d < self.seen or not self.seen else alpha[self.seen - 1]
            e.append(e[-1] + run)
        return e


@dataclass
class Calibration:
    """The chance that a drafted token is accepted given the drafter's own
    probability of it, by bins of that probability, apart for a chain's
    first token and the later ones (a head drafts those from its own guessed
    features, and is as sure of them as it is wrong: the shipped Python head
    on held-out HumanEval, tokens it gave 0.9-1.0 taken 72% of the time,
    chains of four such tokens 25/168): counts (decayed by CONFIDENCE_DECAY)
    over a prior of CONFIDENCE_PRIOR x the probability."""

    hits: list[list[float]] = field(default_factory=lambda: [[0.0] * CONFIDENCE_BINS for _ in range(2)])
    trials: list[list[float]] = field(default_factory=lambda: [[0.0] * CONFIDENCE_BINS for _ in range(2)])

    @staticmethod
    def _bin(confidence: float) -> int:
        return min(CONFIDENCE_BINS - 1, max(0, int(confidence * CONFIDENCE_BINS)))

    def acceptance(self, confidence: float, depth: int = 0) -> float:
        """Of a token at ``depth`` (0: the chain's first) given its drafter's ``confidence``."""
        b, d = self._bin(confidence), min(depth, 1)
        prior = CONFIDENCE_PRIOR * min(max(confidence, 0.0), 1.0)
        return (prior * CONFIDENCE_STRENGTH + self.hits[d][b]) / (CONFIDENCE_STRENGTH + self.trials[d][b])

    def update(self, confidence: float, depth: int, accepted: bool) -> None:
        b, d = self._bin(confidence), min(depth, 1)
        self.trials[d][b] = CONFIDENCE_DECAY * self.trials[d][b] + 1.0
        self.hits[d][b] = CONFIDENCE_DECAY * self.hits[d][b] + (1.0 if accepted else 0.0)


class DrafterCosts:
    """A costly drafter's time per drafted token and per caught-up context
    token, in one-token target steps: its measured DraftCost, corrected by
    the time its drafts take here (seconds, converted with the curve's
    current one-token time)."""

    def __init__(self, prior: DraftCost):
        self.prior = prior
        self.per_token, self.catch_up = Timings(), Timings()

    def now(self, t_token: float | None) -> DraftCost:
        return DraftCost(self._corrected(self.per_token, self.prior.per_token, t_token),
                         self._corrected(self.catch_up, self.prior.catch_up, t_token))

    @staticmethod
    def _corrected(timings: Timings, prior: float, t_token: float | None) -> float:
        median = timings.median
        if median is None or not t_token:
            return prior
        return timings.blend(prior, max(median / t_token, 1e-4))


def _cut(draft: Draft, max_depth: int) -> Draft:
    """The part of ``draft`` no deeper than ``max_depth``."""
    if draft.parents is None:
        return replace(draft, tokens=draft.tokens[:max_depth])
    depth = draft.node_depths()
    keep = [i for i in range(len(draft.tokens)) if depth[i] <= max_depth]
    index = {old: new for new, old in enumerate(keep)}
    return replace(draft, tokens=[draft.tokens[i] for i in keep],
                   parents=[index.get(draft.parents[i], -1) for i in keep])


# A costly drafter that says nothing of its cost is taken to cost this much
# (in one-token target steps per drafted / caught-up token) until timed.
UNKNOWN_COST = DraftCost(per_token=0.5, catch_up=0.25)


class Planner:
    """Chooses, each step, whether and how much to speculate. Lives as long as
    its engine: acceptance and costs learned in one generation serve the next."""

    def __init__(self, costs: list[float], experts: ExpertMisses | None = None,
                 memory: AcceptanceMemory | None = None):
        self.costs = CostCurve(costs, memory.curve() if memory is not None else None)
        self.experts = experts
        self.memory = memory
        self.acceptance: dict[str, Acceptance] = {}   # by key@route (key alone before any route)
        self.calibration: dict[str, Calibration] = {}  # by key: what a drafter's confidence is worth
        # This step's greedy chains that said their confidence, uncut: (key,
        # tokens, confidence). What the target then chose says how far each
        # would have been accepted, even where the planner cut it.
        self._chains: list[tuple[str, list[int], list[float]]] = []
        self._limit = 0   # the draft size choose() allows this step (draft_further's bound)
        self.drafters: dict[str, DrafterCosts] = {}   # costly drafters by name
        self.plain_steps = 0                          # plain steps since the last draft
        self.route = ""                               # the current request's route of text ("": unknown)
        self._evidence: set[str] = set()              # acceptance keys (key@route) verified since the last end()
        # Tokens of other generations in the batch this one's steps join
        # (an engine's parallel generations): what this one's tokens cost is
        # what they add to that batch, and what they hold up is the others' output.
        self.shared = 0

    # -- a generation ------------------------------------------------------------------

    def begin(self, text: str | None) -> None:
        """A generation about ``text`` (its request's text; None: only its
        tokens say) starts: acceptance is looked up on its route."""
        self.route = text_route(text) if text is not None else ""

    def end(self) -> None:
        """A generation ended: what was learned becomes the memory's (saved)."""
        if self.memory is None:
            return
        for key in self._evidence:
            acc = self.acceptance[key]
            self.memory.learn(key, acc.hits, acc.trials)
        self._evidence.clear()
        for name, d in self.drafters.items():
            if d.per_token.median is not None:
                self.memory.learn_cost(name, *self.drafter_cost(name).to_list())
        moved = self.costs.learned()
        if moved:
            self.memory.learn_curve(moved)
        self.memory.save()

    # -- what things cost ------------------------------------------------------------

    def cost(self, n_tokens: int) -> float:
        """A batch of n_tokens in plain steps: its compute, and on an
        offloaded MoE the expert reads it waits for (a plain step's own
        included, so that plain decoding still costs 1). In a batch shared
        with ``shared`` other tokens: the batch with these n_tokens against
        the batch with one of them."""
        if self.shared:
            # Each token added to the batch costs at least what the batch's
            # tokens beyond the first cost on average: a curve flat there
            # (measured while other work disturbed it) must not make a
            # shared batch's extra tokens free, and the steps of shared
            # batches are not timed to correct it (edgespec.engine).
            base = self._cost(self.shared + 1)
            floor = 1.0 + (n_tokens - 1) * (base - 1.0) / self.shared / base
            return max(self._cost(self.shared + n_tokens) / base, floor)
        return self._cost(n_tokens)

    def _cost(self, n_tokens: int) -> float:
        compute = self.costs(n_tokens)
        if self.experts is None:
            return compute
        t = self.t_token
        if not t:
            return compute
        return (compute + self.experts.seconds(n_tokens) / t) / (1.0 + self.experts.seconds(1) / t)

    @property
    def t_token(self) -> float | None:
        return self.costs.t_token

    def drafter_costs(self, key: str, prior: DraftCost | None = None) -> DrafterCosts:
        """The cost record of costly drafter ``key``, made when first asked
        for from what an earlier process measured of it (the memory's), else
        ``prior`` (its DraftCost measured at load; None: UNKNOWN_COST)."""
        d = self.drafters.get(key)
        if d is None:
            learned = self.memory.cost(key) if self.memory is not None else None
            d = self.drafters[key] = DrafterCosts(DraftCost(*learned) if learned else prior or UNKNOWN_COST)
        return d

    def drafter_cost(self, key: str) -> DraftCost:
        """What costly drafter ``key`` spends per drafted and per caught-up
        token now, in target tokens."""
        return self.drafter_costs(key).now(self.t_token)

    def _on_route(self, key: str) -> str:
        """Acceptance key ``key`` on the current route."""
        return f"{key}@{self.route}" if self.route else key

    def _acc(self, key: str, prior: float | None = None) -> Acceptance:
        """The acceptance of drafts of ``key`` on the current route: made on
        first use from what the memory learned of them, else from ``prior``
        (the drafter's guess; None: PRIOR_ALPHA), which a drafter may revise
        for each request (a router's confidence)."""
        key = self._on_route(key)
        acc = self.acceptance.get(key)
        if acc is None:
            acc = self.acceptance[key] = Acceptance(prior if prior is not None else PRIOR_ALPHA)
            learned = self.memory.counts(key) if self.memory is not None else None
            if learned and learned[1] and learned[1][0] > 0:
                hits, trials = learned
                scale = min(1.0, MEMORY_STRENGTH / trials[0])
                for d, (h, t) in enumerate(zip(hits, trials)):
                    acc.hits[d], acc.trials[d] = h * scale, t * scale
                acc.seen = sum(1 for t in trials if t > 0)
        elif prior is not None:
            acc.prior = prior
        return acc

    def speed(self, expected: float, n_tokens: int, extra: float = 0.0) -> float:
        """Expected output per unit of time of a step that adds ``expected``
        tokens in a batch of ``n_tokens`` (its cost plus ``extra`` plain
        steps), relative to a plain step. In a batch shared with other
        generations' ``shared`` tokens, the whole batch's: (expected +
        shared) / ((1 + shared) x cost), a draft paying only where it adds
        more than its batch slots take from the others (their tokens taken
        as output, which errs towards plain steps)."""
        s = self.shared
        return (expected + s) / ((1.0 + s) * (self.cost(n_tokens) + extra))

    def probing(self) -> bool:
        """Time to try a minimal draft so that acceptance estimates can recover."""
        return self.plain_steps >= EXPLORE_EVERY

    # -- costly drafters ---------------------------------------------------------------

    def worth(self, key: str, limit: int, prior: float | None = None) -> float:
        """The most a costly drafter's chain of up to ``limit`` tokens is
        expected to be worth (speed relative to plain decoding, drafting time
        included): a cheaper draft already worth as much makes asking it moot."""
        e = self._acc(key, prior).expected(limit)
        per_token = self.drafter_cost(key).per_token
        return max((self.speed(e[k], k + 1, per_token * k) for k in range(1, len(e))), default=0.0)

    def budget(self, key: str, limit: int, may_skip: bool, prior: float | None = None) -> int:
        """How many tokens to ask a costly drafter for: the chain length worth
        the most, drafting time included (0: none pays). An explicitly chosen
        drafter (may_skip False) is asked for a short chain regardless, and
        every EXPLORE_EVERY plain steps a declined one for a probe."""
        e = self._acc(key, prior).expected(limit)
        per_token = self.drafter_cost(key).per_token
        best_k, best = 0, 1.0 + DRAFT_MARGIN
        for k in range(1, len(e)):
            value = self.speed(e[k], k + 1, per_token * k)
            if value > best:
                best_k, best = k, value
        if best_k == 0 and limit > 0 and (not may_skip or self.probing()):
            best_k = 1 if may_skip else min(limit, 2)
        return best_k

    def catch_up_pays(self, key: str, backlog: int, room: int, alternative: float, limit: int,
                      prior: float | None = None, opening_s: float = 0.0, expected: int | None = None) -> bool:
        """Whether a costly drafter that must first evaluate ``backlog`` context
        tokens it has not seen, and first be opened (``opening_s`` seconds),
        is worth asking: the time its expected speed saves over
        ``alternative`` (the best draft in hand, or 1 for plain decoding) for
        the ``room`` tokens left must exceed that time, and a drafter with no
        evidence yet may spend at most EXPLORE_SHARE of the plain time left
        finding out. Opening waits for a timed step to price it in tokens,
        and must pay within the tokens the answer is ``expected`` still to
        make (``expected_room``; default ``room``): an answer that may end
        soon does not open a drafter it would not use."""
        if backlog <= 0 and opening_s <= 0:
            return True
        value = self.worth(key, limit, prior)
        if value <= alternative:
            return False
        catch_up = backlog * self.drafter_cost(key).catch_up
        opening = 0.0
        if opening_s > 0:
            if not self.t_token:
                return False
            opening = opening_s / self.t_token
        if not self._acc(key, prior).seen and catch_up + opening > EXPLORE_SHARE * room:
            return False
        saved = 1.0 / alternative - 1.0 / value   # per token left
        expected = room if expected is None else min(expected, room)
        return room * saved > catch_up + opening and expected * saved > opening

    def record_draft_time(self, key: str, seconds: float, n_tokens: int) -> None:
        if n_tokens > 0:
            self.drafter_costs(key).per_token.add(seconds / n_tokens)

    def record_catch_up(self, key: str, seconds: float, n_tokens: int) -> None:
        if n_tokens > 0:
            self.drafter_costs(key).catch_up.add(seconds / n_tokens)

    # -- choosing a draft ----------------------------------------------------------------

    def choose(self, drafters: Sequence[Drafter], context: list[int], limit: int, room: int,
               may_skip: bool, trees: bool, expected: int | None = None) -> Draft:
        """Ask each drafter for a draft of up to ``limit`` tokens and keep the
        part of one that pays most on this machine (or nothing: a plain step).
        ``room``: tokens still to generate at most, ``expected`` of them
        expected (``expected_room``); ``trees``: False where the backend
        verifies a tree's first path only."""
        best, best_value = Draft(), 0.0
        self._chains, self._limit = [], limit
        # Where the planner may choose (auto) and a lone step is timed, some
        # steps are plain so that what one token costs now is known.
        if may_skip and not self.shared and self.costs.wants_plain():
            return best
        for d in drafters:
            behind = 0
            if d.costly:
                self.drafter_costs(d.name, d.cost)
                if best_value and best_value >= self.worth(d.name, limit, d.prior):
                    continue  # a cheap draft is worth at least what this one could be
                # Text that steps without this drafter added must be evaluated
                # first, and one opened on first use opened: where the planner
                # may choose (auto), only if that pays.
                behind = d.backlog(context)
                if may_skip and not self.catch_up_pays(d.name, behind, room, max(best_value, 1.0), limit, d.prior,
                                                       d.opening(), expected):
                    continue
                ask = self.budget(d.name, limit, may_skip, d.prior)
            else:
                ask = limit
            if ask <= 0:
                continue
            if d.costly:
                d.open()
            t0 = time.perf_counter()
            draft = d.draft(context, ask)
            if d.costly:
                self.record_draft_time(d.name, time.perf_counter() - t0 - d.backlog_seconds, len(draft))
                if d.backlog_seconds > 0:   # the part beyond the step's own tokens
                    self.record_catch_up(d.name, d.backlog_seconds, max(1, behind - ask - 1))
            if not len(draft):
                continue
            if draft.confidence:
                self._chains.append((draft.key or draft.source, draft.tokens[:len(draft.confidence)],
                                     draft.confidence))
            if not trees:  # verified as a chain: exact where a tree is not
                draft = draft.first_path()
            draft, value = self.cut(draft, may_skip)
            if len(draft) and value > best_value:
                best, best_value = draft, value
        return best

    def widen(self, key: str, n_chain: int, gains: list[float]) -> int:
        """How many leaves to add to a chain of ``n_chain`` tokens, taking
        ``gains`` in order (each the expected tokens a leaf adds: the chance
        that the chain is accepted up to its parent and the leaf's token is
        the target's): as many as raise the expected speed, a tree's accepted
        path costing its evaluation again with the next batch."""
        e = self._acc(key).expected(n_chain)[-1]
        marginal = self.cost(2) - self.cost(1)
        best, best_j, g = self.speed(e, n_chain + 1), 0, 0.0
        for j, gain in enumerate(gains, 1):
            g += gain
            value = self.speed(e + g, n_chain + 1 + j, (e + g - 1.0) * marginal)
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
        key = draft.key or draft.source
        e = (self._calibrated(key, draft.confidence) if draft.confidence
             else self._acc(key, draft.prior).expected(max(depths)))
        marginal = self.cost(2) - self.cost(1)
        tree = draft.parents is not None
        n_within = [0] * (len(e) + 1)  # n_within[d]: nodes no deeper than d
        for x in depths:
            if x < len(n_within):
                n_within[x] += 1
        for d in range(1, len(n_within)):
            n_within[d] += n_within[d - 1]
        best_d, best = 0, 1.0 + DRAFT_MARGIN
        for d in range(1, len(e)):
            # A tree's accepted path is evaluated again with the next batch.
            value = self.speed(e[d], n_within[d] + 1, (e[d] - 1.0) * marginal if tree else 0.0)
            if value > best:
                best_d, best = d, value
        if best_d == 0:
            if may_skip and not self.probing():
                return Draft(source=draft.source), 0.0
            if may_skip:  # a probe: one token is enough to learn from
                return replace(draft, tokens=draft.tokens[:1], parents=[-1] if tree else None), 1.0
            best_d, best = 1, 1.0
        return _cut(draft, best_d), best

    def _calibrated(self, key: str, confidence: list[float]) -> list[float]:
        """``expected`` of a chain whose tokens the drafter gave these
        probabilities: e[d] = 1 + the tokens expected accepted to depth d."""
        cal = self.calibration.setdefault(key, Calibration())
        e, run = [1.0], 1.0
        for depth, c in enumerate(confidence[:MAX_BATCH - 1]):
            run *= cal.acceptance(c, depth)
            e.append(e[-1] + run)
        return e

    def draft_further(self, key: str, confidence: list[float]) -> bool:
        """Whether a greedy chain of drafter ``key`` whose tokens so far had
        these probabilities is worth one token more than it was asked for
        (EAGLE-2's dynamic depth): the next token, taken to be as sure as
        the last (a drafter's sure tokens come in runs), raises the chain's
        expected speed, its drafting time included, above what it is worth
        now. Drafting is cheap beside verifying, and cut() still decides
        how much of the chain is verified."""
        k = len(confidence)
        if k >= self._limit:
            return False
        e = self._calibrated(key, confidence)
        next_accepted = (e[-1] - e[-2]) * self.calibration[key].acceptance(confidence[-1], k)
        per_token = self.drafter_cost(key).per_token
        now = max(self.speed(e[j], j + 1, per_token * k) for j in range(len(e)))
        return self.speed(e[-1] + next_accepted, k + 2, per_token * (k + 1)) > now

    # -- learning ------------------------------------------------------------------------

    def record(self, key: str, depth: int, n_accepted: int, tokens: Sequence[int] | None = None) -> None:
        """The step verified a draft of ``key`` reaching ``depth`` and took
        its first ``n_accepted`` levels, then ``tokens`` (the step's: the
        accepted ones and the target's own next; given under greedy
        decoding, where each is the target's choice). A chain that said its
        confidence is learned from as drafted, before any cut: its tokens
        up to the first the target did not choose."""
        chains, self._chains = self._chains, []
        learned = set()
        for ckey, chain, confidence in chains if tokens is not None else ():
            cal = self.calibration.setdefault(ckey, Calibration())
            n = 0
            while n < min(len(chain), len(tokens)) and chain[n] == tokens[n]:
                cal.update(confidence[n], n, True)
                n += 1
            known = n
            if n < min(len(chain), len(tokens)):   # the first the target did not choose
                cal.update(confidence[n], n, False)
                known += 1
            self._acc(ckey).update(known, n)
            self._evidence.add(self._on_route(ckey))
            learned.add(ckey)
        if key == "none":
            self.plain_steps += 1
            return
        self.plain_steps = 0
        if key not in learned:
            self._acc(key).update(depth, n_accepted)
            self._evidence.add(self._on_route(key))

    def record_step_time(self, seconds: float, n_tokens: int, misses: int = 0, stall_s: float = 0.0) -> None:
        """A target step of ``n_tokens`` took ``seconds``, ``stall_s`` of them
        waiting for the reads of its ``misses`` experts (an expert cache)."""
        self.costs.record(seconds - stall_s, n_tokens)
        if self.experts is not None:
            self.experts.record(n_tokens, misses, stall_s)

    def summary(self) -> dict:
        return {
            "batch_cost": [round(c, 3) for c in self.costs.table()[1:17]],
            "alpha": {k: [round(a, 3) for a in v.alpha[:8]] for k, v in self.acceptance.items()},
            "draft_cost": {k: [round(x, 4) for x in self.drafter_cost(k).to_list()] for k in self.drafters},
        }


def expected_room(room: int, produced: int) -> int:
    """The tokens a generation that has produced ``produced`` and may make
    ``room`` more is expected still to make, as opening a costly drafter
    is priced (catch_up_pays): ``max_tokens`` bounds an answer, but chat
    answers mostly end well before it (qwen2.5-coder-1.5b's held-out short
    chat: 19-24 tokens of 96, where opening the English head and three
    drafts it cut took 65 ms, 8% of the answer), and one that has gone on
    for n tokens is about as likely to go on for n more (Lindy's estimate)."""
    return min(room, max(produced, EXPECTED_ROOM_MIN))


def speedup_ceiling(costs: list[float]) -> tuple[float, int]:
    """The best speedup over plain decoding this cost curve allows, and the
    draft length giving it: max over k of (k + 1) / cost[k + 1], every draft
    token accepted (k drafted tokens and the target's own next one per step)."""
    return max(((k + 1) / costs[k + 1], k) for k in range(1, len(costs) - 1))
