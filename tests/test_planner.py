"""The draft planner on synthetic cost curves: pure logic, no model (but for
the cached measurements at the end, on the tiny model)."""
from __future__ import annotations

import time

from edgespec.costs import MAX_BATCH, DraftCost
from edgespec.drafters import Draft, Drafter
from edgespec.planner import (CONFIDENCE_STRENGTH, EXPECTED_ROOM_MIN, EXPLORE_EVERY, EXPLORE_SHARE, MIN_SAMPLES,
                              CostCurve, ExpertMisses, Planner, expected_room)

LINEAR = [0.0] + [float(k) for k in range(1, MAX_BATCH + 1)]        # no batching gain
FLAT = [0.0] + [1.0 + 0.05 * (k - 1) for k in range(1, MAX_BATCH + 1)]  # batches nearly free


def chain(n, key="k"):
    return Draft(tokens=list(range(n)), source="x", key=key)


# A 4-token batch at 1.3x one token, as on qwen2.5-coder-1.5b (AVX2 Zen 3).
MEMORY_BOUND = [0.0, 1.0, 1.12, 1.2, 1.3] + [1.3 + 0.25 * (k - 4) for k in range(5, MAX_BATCH + 1)]


def test_no_speculation_when_batches_cost_as_much_as_tokens():
    p = Planner(LINEAR)
    for _ in range(20):
        p.record("k", 4, 4)  # even perfect acceptance cannot pay
    cut, value = p.cut(chain(8), may_skip=True)
    assert len(cut) == 0 and value == 0.0


def test_cheap_batches_and_good_acceptance_draft_deep():
    p = Planner(FLAT)
    for _ in range(30):
        p.record("k", 16, 16)
    cut, value = p.cut(chain(16), may_skip=True)
    assert len(cut) == 16 and value > 5


def test_in_a_shared_batch_a_draft_costs_what_it_adds_to_it():
    # Flat up to 5 tokens, then each token costs 0.3 of a step: alone, a
    # 4-token draft rides the flat part; beside 4 other generations' tokens it
    # pays for the slope, which drafts accepted one time in four do not repay.
    curve = [0.0] + [1.0] * 5 + [1.0 + 0.3 * (n - 5) for n in range(6, MAX_BATCH + 1)]
    p = Planner(curve)
    for i in range(40):
        p.record("k", 4, 4 if i % 4 == 0 else 0)
    assert len(p.cut(chain(4), may_skip=True)[0]) == 4
    p.shared = 4
    assert p.cost(1) == 1.0 and p.cost(5) == curve[9] / curve[5]
    assert len(p.cut(chain(4), may_skip=True)[0]) == 0


def offloaded(misses, per_miss: float = 0.005) -> Planner:
    """A planner on an offloaded MoE (8 experts, top 2) whose compute alone
    makes batches nearly free (10 ms a token, FLAT), with scripted steps of
    1 to 4 tokens: a step of n tokens misses misses(n) experts, each read
    stalling per_miss seconds; half the drafts accepted whole, half not at all."""
    p = Planner(FLAT, ExpertMisses(n_expert=8, top_k=2))
    for _ in range(MIN_SAMPLES):
        for n in range(1, 5):
            stall = misses(n) * per_miss
            p.record_step_time(0.01 * FLAT[n] + stall, n, misses=misses(n), stall_s=stall)
    for i in range(30):
        p.record("k", 3, 3 * (i % 2))
    return p


def test_planner_declines_drafts_whose_expert_misses_cost_more_than_they_save():
    # A token's reads take 5 times its compute, and each drafted token misses
    # as many experts again (routed elsewhere, none of them cached): a batch
    # of 4 costs 3.5 plain steps for 2.5 tokens expected; drafting does not pay.
    p = offloaded(lambda n: 10 * n)
    assert p.cost(4) > 3.5
    cut, value = p.cut(chain(3), may_skip=True)
    assert len(cut) == 0 and value == 0.0
    # The same reads, but the drafted tokens route to the experts the plain
    # step reads anyway: verifying costs little more than a token, drafting pays.
    p = offloaded(lambda n: 10 + n // 2)
    cut, value = p.cut(chain(3), may_skip=True)
    assert len(cut) == 3 and value > 2.0
    # No reads at all (every expert cached): the compute curve alone decides.
    p = offloaded(lambda n: 0)
    assert p.cost(4) == Planner(FLAT).cost(4)


def test_expert_misses_of_sizes_not_timed_follow_the_union_of_routing():
    x = ExpertMisses(n_expert=8, top_k=2)
    assert x.expected(4) == 0.0 and x.seconds(4) == 0.0   # nothing timed: no reads assumed
    for _ in range(MIN_SAMPLES):
        x.record(1, 10, 0.05)
    # 1 token touches 2 experts a layer, 2 tokens 8 * (1 - 0.75^2) = 3.5
    assert abs(x.expected(2) - 10 * 3.5 / 2) < 1e-9
    assert abs(x.seconds(2) - x.expected(2) * 0.005) < 1e-12
    assert x.expected(33) < 10 * 8 / 2 + 1e-9                 # never more than every expert


def test_acceptance_decides_depth():
    p = Planner(FLAT)
    for _ in range(40):
        p.record("k", 8, 2)  # the third token is always rejected
    cut, _ = p.cut(chain(8), may_skip=True)
    assert len(cut) == 2 or len(cut) == 3


def test_keys_learn_apart():
    p = Planner([0.0] + [1.0 + 0.6 * (k - 1) for k in range(1, MAX_BATCH + 1)])
    for _ in range(40):
        p.record("good", 4, 4)
        p.record("bad", 4, 0)
    assert len(p.cut(chain(4, "good"), may_skip=True)[0]) > 0
    assert len(p.cut(chain(4, "bad"), may_skip=True)[0]) == 0


def test_explicit_drafter_always_drafts_and_probes_are_one_token():
    p = Planner(LINEAR)
    assert len(p.cut(chain(5), may_skip=False)[0]) == 1
    for _ in range(EXPLORE_EVERY):
        p.record("none", 0, 0)
    probe, _ = p.cut(Draft(tokens=[5, 6, 7], parents=[-1, -1, 0], source="t"), may_skip=True)
    assert probe.tokens == [5] and probe.parents == [-1]


def test_tree_cut_keeps_valid_parents():
    p = Planner(FLAT)
    for _ in range(30):
        p.record("t", 3, 1)  # depth 1 accepted, depth 2 rejected
    tree = Draft(tokens=[10, 11, 12, 13, 14], parents=[-1, -1, 0, 2, 1], source="t")
    cut, _ = p.cut(tree, may_skip=True)
    assert cut.tokens == [10, 11]  # depth 2 does not pay
    assert cut.parents == [-1, -1]


def test_budget_for_costly_drafters_counts_drafting_time():
    p = Planner(FLAT)
    p.drafter_costs("m", DraftCost(per_token=0.05, catch_up=0.01))
    for _ in range(30):
        p.record("m", 8, 8)
    assert p.budget("m", 8, may_skip=True) == 8
    for _ in range(MIN_SAMPLES):
        p.record_step_time(0.01, 1)          # a target token takes 10 ms
    for _ in range(20):
        p.record_draft_time("m", 0.02, 1)    # drafting a token takes two target tokens
    assert p.drafter_cost("m").per_token > 1.0
    assert p.budget("m", 8, may_skip=True) == 0
    assert p.budget("m", 8, may_skip=False) == 2


def test_a_draft_model_is_asked_to_catch_up_only_where_that_pays():
    """A draft model that earlier steps went without must first evaluate the
    text they added: worth it for a long answer to come, not for a short one,
    and never when the draft in hand is worth as much as the draft model."""
    p = Planner(FLAT)
    p.drafter_costs("m", DraftCost(per_token=0.1, catch_up=0.05))   # as measured at load
    for _ in range(30):
        p.record("m", 4, 4)                  # the draft model's drafts are all accepted
    value = p.worth("m", 4)
    assert 2.5 < value < 3.5                 # 5 tokens for 1.2 + 4 x 0.1
    assert p.catch_up_pays("m", 0, room=1, alternative=1.0, limit=4)
    assert p.catch_up_pays("m", 500, room=200, alternative=1.0, limit=4)   # 25 spent, ~130 saved
    assert not p.catch_up_pays("m", 500, room=20, alternative=1.0, limit=4)  # ~13 saved
    assert not p.catch_up_pays("m", 10, room=200, alternative=value, limit=4)


def test_opening_a_draft_model_is_charged_as_its_backlog():
    """A draft model not open yet must be opened before its first draft:
    those seconds, in the machine's target tokens, count with its catch-up,
    so that a short answer does not open it; before any step was timed
    they cannot be priced, and it is not opened."""
    p = Planner(FLAT)
    p.drafter_costs("m", DraftCost(per_token=0.1, catch_up=0.05))
    for _ in range(30):
        p.record("m", 4, 4)
    assert not p.catch_up_pays("m", 0, room=200, alternative=1.0, limit=4, opening_s=0.2)   # no step timed
    for _ in range(MIN_SAMPLES):
        p.record_step_time(0.01, 1)          # a target token takes 10 ms: opening is 20 tokens
    assert p.catch_up_pays("m", 0, room=200, alternative=1.0, limit=4, opening_s=0.2)      # ~130 saved
    assert not p.catch_up_pays("m", 0, room=25, alternative=1.0, limit=4, opening_s=0.2)   # ~17 saved
    assert p.catch_up_pays("m", 0, room=25, alternative=1.0, limit=4)                      # open already


class Unopened(Drafter):
    """A costly drafter that opens on its first draft (as draft models and heads do)."""

    name = "unopened"
    costly = True
    prior = 0.9
    cost = DraftCost(per_token=0.1, catch_up=0.05)

    def __init__(self, opening_s: float):
        self.opening_s, self.asked, self.opened = opening_s, 0, False

    def opening(self):
        return 0.0 if self.opened else self.opening_s

    def open(self):
        if not self.opened:
            time.sleep(self.opening_s)
            self.opened = True

    def draft(self, context, max_tokens):
        self.asked += 1
        return Draft(tokens=[1] * max_tokens, source=self.name)


def test_choose_asks_an_unopened_drafter_only_where_opening_it_pays():
    p = Planner(FLAT)
    for _ in range(MIN_SAMPLES):
        p.record_step_time(0.01, 1)
    slow_to_open, quick_to_open = Unopened(opening_s=1.0), Unopened(opening_s=0.01)
    for _ in range(5):
        assert len(p.choose([slow_to_open], [1, 2, 3], limit=4, room=100, may_skip=True, trees=True)) == 0
    assert slow_to_open.asked == 0
    assert len(p.choose([quick_to_open], [1, 2, 3], limit=4, room=100, may_skip=True, trees=True)) > 0
    assert len(p.choose([slow_to_open], [1, 2, 3], limit=4, room=100, may_skip=False, trees=True)) > 0
    # Opened before its draft was timed: a second of opening is not taken for drafting.
    assert slow_to_open.opened and max(p.drafter_costs("unopened").per_token.window) < 0.01


class SlowDrafter(Drafter):
    """A costly drafter that has seen none of the text: every draft must first
    evaluate the whole context, at half a target token per context token."""

    name = "slow"
    costly = True
    prior = 0.9
    cost = DraftCost(per_token=0.1, catch_up=0.5)

    def __init__(self):
        self.asked = 0

    def backlog(self, context):
        return len(context)

    def draft(self, context, max_tokens):
        self.asked += 1
        return Draft(tokens=[1] * max_tokens, source=self.name)


def test_a_slow_drafter_with_a_large_catch_up_is_not_tried_on_a_short_generation():
    """Catching up on a 200-token prompt costs ~100 target tokens: not worth it
    for 32 tokens to come, whatever the drafter would then save; worth it
    when thousands are to come and the drafts are expected to pay."""
    p = Planner(FLAT)
    slow = SlowDrafter()
    context = list(range(200))
    for _ in range(10):
        assert len(p.choose([slow], context, limit=8, room=32, may_skip=True, trees=True)) == 0
    assert slow.asked == 0
    # Unproven, it may spend only EXPLORE_SHARE of the plain time left finding out.
    assert not p.catch_up_pays("slow", 200, room=int(100 / EXPLORE_SHARE) - 1, alternative=1.0, limit=8,
                               prior=slow.prior)
    assert len(p.choose([slow], context, limit=8, room=10_000, may_skip=True, trees=True)) > 0
    assert slow.asked == 1


def test_a_drafter_that_does_not_say_its_cost_is_taken_to_be_costly():
    p = Planner(FLAT)
    slow = SlowDrafter()
    slow.cost = None
    assert p.drafter_cost(slow.name) == p.drafter_costs(slow.name).prior
    assert p.drafter_cost(slow.name).per_token >= 0.5


def test_a_lying_cost_curve_is_corrected_by_timed_steps_within_a_few_steps():
    """The cached curve says batches are free; this machine's steps say a
    5-token batch costs 3.3 tokens. After a few timed steps the planner
    uses the truth and stops drafting what only the lie made pay."""
    truth = [0.0] + [1.0 + 0.58 * (k - 1) for k in range(1, MAX_BATCH + 1)]
    p = Planner([0.0] + [1.0] * MAX_BATCH)
    for _ in range(30):
        p.record("k", 4, 1)                  # the second drafted token is always rejected
    assert len(p.cut(chain(4), may_skip=True)[0]) == 4      # the lie: every token free
    t1 = 0.030
    steps = 0
    while len(p.cut(chain(4), may_skip=True)[0]) == 4:
        p.record_step_time(t1, 1)
        p.record_step_time(t1 * truth[5], 5)
        steps += 1
        assert steps <= MIN_SAMPLES + 2, "the lie outlived a few timed steps"
    assert abs(p.cost(5) - truth[5]) / truth[5] < 0.25
    assert 1.0 <= p.cost(3) <= p.cost(5) <= p.cost(9) <= 9   # sizes not timed: within bounds
    assert len(p.cut(chain(4), may_skip=True)[0]) <= 1    # the first token is always accepted: it pays


def test_one_noisy_step_does_not_move_the_curve():
    p = Planner(FLAT)
    for _ in range(8):
        p.record_step_time(0.03, 1)
        p.record_step_time(0.03 * FLAT[5], 5)
    before = p.cost(5)
    p.record_step_time(3.0, 5)               # the machine stalled once: 100 tokens' time
    assert abs(p.cost(5) - before) < 0.05 * before
    assert p.cost(5) <= 5


def test_an_unwritable_cache_still_gives_a_measured_curve(tiny_llama_path, tmp_path, monkeypatch):
    """EDGESPEC_HOME unwritable (a file where the folder should be): the curve
    is measured and used, nothing raised, nothing left behind."""
    from edgespec.backends import open_backend
    from edgespec.costs import batch_costs

    blocker = tmp_path / "home"
    blocker.write_text("not a folder")
    monkeypatch.setenv("EDGESPEC_HOME", str(blocker))
    with open_backend("native", tiny_llama_path, n_ctx=256, threads=1) as backend:
        costs = batch_costs(backend)
    assert len(costs) == MAX_BATCH + 1 and costs[1] == 1.0
    assert [p.name for p in tmp_path.iterdir()] == ["home"]


def test_a_curve_measured_on_a_busy_machine_is_measured_again_when_quieter(tiny_llama_path, tmp_path,
                                                                          monkeypatch):
    import os

    from edgespec import costs
    from edgespec.backends import open_backend

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    measured = []
    real = costs.measure_batch_costs
    monkeypatch.setattr(costs, "measure_batch_costs", lambda b: measured.append(1) or real(b))
    cpus = os.cpu_count() or 1
    with open_backend("native", tiny_llama_path, n_ctx=256, threads=1) as backend:
        monkeypatch.setattr(os, "getloadavg", lambda: (3.0 * cpus, 0.0, 0.0))   # busy
        costs.batch_costs(backend)
        costs.batch_costs(backend)              # as busy: the provisional curve is kept
        assert len(measured) == 1
        monkeypatch.setattr(os, "getloadavg", lambda: (0.1 * cpus, 0.0, 0.0))   # quiet
        costs.batch_costs(backend)              # measured again
        costs.batch_costs(backend)              # and now trusted
        assert len(measured) == 2
        monkeypatch.setattr(os, "getloadavg", lambda: (3.0 * cpus, 0.0, 0.0))
        costs.batch_costs(backend)              # a quiet curve stays, however busy now
        assert len(measured) == 2


def test_a_curve_of_unknown_load_is_measured_again_once(tiny_llama_path, tmp_path, monkeypatch):
    import json

    from edgespec import costs
    from edgespec.backends import open_backend

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    with open_backend("native", tiny_llama_path, n_ctx=256, threads=1) as backend:
        stale = [0.0] + [1.0] * costs.MAX_BATCH        # batches as cheap as one token: wrong
        (tmp_path / costs.COST_FILE).write_text(json.dumps({costs.cost_key(backend): stale}))
        curve = costs.batch_costs(backend)
    assert curve != stale
    entry = json.loads((tmp_path / costs.COST_FILE).read_text())[costs.cost_key(backend)]
    assert entry["costs"] == curve and "load" in entry


def test_each_kernel_set_has_a_cost_curve_of_its_own(tiny_llama_path, monkeypatch):
    from edgespec import costs
    from edgespec.backends import open_backend
    from edgespec.capi import ffi, lib

    sets = [ffi.string(lib.es_kernels_available(i)).decode() for i in range(4)
            if lib.es_kernels_available(i) != ffi.NULL]
    keys = set()
    try:
        for name in sets:
            monkeypatch.setenv("EDGESPEC_KERNELS", name)
            with open_backend("native", tiny_llama_path, n_ctx=64, threads=1) as backend:
                key = costs.cost_key(backend)
            assert f"@{name}:" in key and key.endswith(f":v{costs.COSTS_VERSION}")
            keys.add(key)
    finally:
        lib.es_kernels_select(b"auto")   # the set is the process's: leave the best one in use
    assert len(keys) == len(sets) >= 1


def test_widen_adds_leaves_only_where_the_cost_curve_pays():
    p = Planner(FLAT)
    for _ in range(30):
        p.record("m", 4, 2)
    assert p.widen("m", 4, [0.4, 0.3, 0.01]) >= 2      # cheap batches: likely leaves pay
    assert Planner(LINEAR).widen("m", 4, [0.4, 0.3]) == 0   # every node costs a full token
    assert p.widen("m", 4, []) == 0


# The measured curve of qwen2.5-coder-1.5b on a 2-core Zen 4 (batches of 1..5 tokens).
ZEN4 = [0.0, 1.0, 1.72, 2.11, 2.9, 3.3] + [3.3 + 0.6 * k for k in range(1, MAX_BATCH - 4)]


def test_one_rejection_stops_a_hopeful_new_key_and_acceptances_bring_it_back():
    """A prompt-lookup key with a hopeful prior (0.8) drafts before any
    evidence; rejected once, it stops (each further rejection would cost more
    than a target token here); a few acceptances of it later make it draft again."""
    p = Planner(ZEN4)
    draft = Draft(tokens=[1, 2, 3], source="ngram", key="ngram:6", prior=0.8)
    assert len(p.cut(draft, may_skip=True)[0]) >= 1
    p.record("ngram:6", 2, 0)
    assert len(p.cut(draft, may_skip=True)[0]) == 0
    for _ in range(4):
        p.record("ngram:6", 3, 3)
    assert len(p.cut(draft, may_skip=True)[0]) >= 2


# -- routes, learned acceptance, shared batches, a disturbed cost curve -------------------

# A 2-core AVX2 machine's curve for a 1.5B target (4 tokens 1.33x, 8 tokens 2.53x one).
AVX2 = [0.0, 1.0, 1.1, 1.2, 1.33, 1.6, 1.9, 2.2, 2.53] + [2.53 + 0.3 * k for k in range(1, MAX_BATCH - 7)]
ENGLISH = "Please explain in a few sentences why the sky looks blue on a clear day."
GERMAN = "Bitte erkläre in ein paar Sätzen, warum der Himmel an einem klaren Tag blau aussieht."


class Bilingual(Drafter):
    """A cheap costly drafter (a specialized one's cost) whose drafts the
    target always accepts on English text and never on German; ``prior`` is
    what its router gives it (both are prose in Latin letters: a router
    sure of both)."""

    name = "specialized:eng"
    costly = True
    prior = 0.5
    cost = DraftCost(per_token=0.03, catch_up=0.01)

    def draft(self, context, max_tokens):
        return Draft(tokens=[7] * max_tokens, source=self.name)


def generate(planner: Planner, drafter: Drafter, text: str, right: bool, n: int = 64) -> list[int]:
    """A generation of ``n`` tokens about ``text`` with ``drafter`` alone
    under auto; each step's draft is accepted whole (``right``) or not at
    all. Returns the tokens drafted at each step (0: a plain step)."""
    planner.begin(text)
    drafted, produced = [], 0
    while produced < n:
        draft = planner.choose([drafter], list(range(100 + produced)), limit=8, room=n - produced,
                               may_skip=True, trees=True)
        accepted = len(draft) if right else 0
        planner.record(draft.key or draft.source or "none", draft.depth, accepted)
        drafted.append(len(draft))
        produced += 1 + accepted
    planner.end()
    return drafted


def test_a_drafter_wrong_on_one_language_stops_within_a_few_tokens_and_the_next_process_knows(tmp_path):
    """Right on English, wrong on German: on German the planner drafts at
    most N = 8 tokens (a first draft of 2 at its prior, 0.5, then single
    tokens while the misses bring it down) and then decodes plainly; on
    English it keeps drafting 3 deep (what pays on this curve). The next
    process (a fresh planner over the same acceptance file) drafts nothing
    on German and 3 deep on English from its first step."""
    from edgespec.learned import AcceptanceMemory

    path = tmp_path / "acceptance.json"
    planner = Planner(AVX2, memory=AcceptanceMemory("target", path))
    german = generate(planner, Bilingual(), GERMAN, right=False)
    assert 0 < sum(german) <= 8 and not any(german[len(german) // 2:])
    english = generate(planner, Bilingual(), ENGLISH, right=True)
    assert sum(english) > 40 and max(english) >= 3

    later = Planner(AVX2, memory=AcceptanceMemory("target", path))
    assert sum(generate(later, Bilingual(), GERMAN, right=False)) == 0
    assert generate(later, Bilingual(), ENGLISH, right=True)[0] >= 3
    # Another target learned nothing of it: the guess again.
    assert generate(Planner(AVX2, memory=AcceptanceMemory("other", path)), Bilingual(), GERMAN, right=False)[0] > 0


def timed_generation(planner: Planner, truth: list[float], n: int = 64, t1: float = 0.03) -> list[int]:
    """``generate`` with every step timed as ``truth`` says a batch costs
    (one token: ``t1`` seconds) and every draft accepted to its first token."""
    planner.begin(ENGLISH)
    drafted, produced = [], 0
    while produced < n:
        draft = planner.choose([Bilingual()], list(range(100 + produced)), limit=8, room=n - produced,
                               may_skip=True, trees=True)
        planner.record_step_time(t1 * truth[1 + len(draft)], 1 + len(draft))
        accepted = min(1, len(draft))
        planner.record(draft.key or draft.source or "none", draft.depth, accepted)
        drafted.append(len(draft))
        produced += 1 + accepted
    planner.end()
    return drafted


def test_a_planner_drafting_at_every_step_times_plain_steps_and_corrects_its_curve():
    """The cached curve says 2 and 3 tokens cost 1.05 of one (measured in a
    quieter hour); this machine's steps say 1.3 and 1.4. A drafter that pays
    at either would draft at every step and never time the one-token step
    the curve is corrected against: the planner takes a plain step every
    CALIBRATE_EVERY steps until MIN_SAMPLES are timed, corrects the curve,
    and then takes one every RECALIBRATE_EVERY steps only."""
    from edgespec.planner import CALIBRATE_EVERY, RECALIBRATE_EVERY

    truth = [0.0, 1.0, 1.3, 1.4] + [1.4 + 0.3 * k for k in range(1, MAX_BATCH - 2)]
    lie = [0.0, 1.0, 1.05, 1.05] + [1.05 + 0.3 * k for k in range(1, MAX_BATCH - 2)]
    p = Planner(lie)
    drafted = timed_generation(p, truth, n=400)
    plain = [i for i, k in enumerate(drafted) if k == 0]
    calibrating = CALIBRATE_EVERY * MIN_SAMPLES
    assert plain[:MIN_SAMPLES] == list(range(CALIBRATE_EVERY - 1, calibrating, CALIBRATE_EVERY))
    assert abs(p.cost(2) - truth[2]) < 0.05 and abs(p.cost(3) - truth[3]) < 0.05
    later = [i for i in plain if i >= calibrating]
    assert later and len(later) <= (len(drafted) - calibrating) // RECALIBRATE_EVERY + 1
    # A drafter chosen explicitly (may_skip False) is never held back.
    assert all(len(p.choose([Bilingual()], [1, 2, 3], 8, 100, may_skip=False, trees=True))
               for _ in range(RECALIBRATE_EVERY))


def test_the_curve_processes_timed_is_the_next_process_prior(tmp_path):
    """What processes timed (2 tokens 1.3, 3 tokens 1.4, where the curve
    measured at load said 1.05) is the curve the next starts from, before it
    times anything: each process moves it part of the way (its timings
    against CURVE_MEMORY earlier ones), so that it converges on what steps
    cost and one process's odd timing moves it only a little. Sizes never
    timed are scaled like the largest timed one, within what physics allows;
    a process timing other sizes keeps the others'."""
    import json
    import math

    from edgespec.learned import AcceptanceMemory
    from edgespec.planner import CURVE_MEMORY, WINDOW

    truth = [0.0, 1.0, 1.3, 1.4] + [1.4 + 0.3 * k for k in range(1, MAX_BATCH - 2)]
    lie = [0.0, 1.0, 1.05, 1.05] + [1.05 + 0.3 * k for k in range(1, MAX_BATCH - 2)]
    path = tmp_path / "acceptance.json"

    def stored() -> dict:
        return json.loads(path.read_text())["targets"]["t"]["curve"]

    timed_generation(Planner(lie, memory=AcceptanceMemory("t", path)), truth)
    curve = stored()
    assert set(curve) == {"2", "3"}
    for n, c in curve.items():   # moved part of the way: at most a full window's share
        share = math.log(c / lie[int(n)]) / math.log(truth[int(n)] / lie[int(n)])
        assert 0.1 < share <= WINDOW / (WINDOW + CURVE_MEMORY) + 1e-3
    later = Planner(lie, memory=AcceptanceMemory("t", path))
    assert abs(later.cost(2) - curve["2"]) < 0.01 and abs(later.cost(3) - curve["3"]) < 0.01
    assert later.cost(3) <= later.cost(9) <= 9
    assert abs(later.cost(9) / lie[9] - curve["3"] / lie[3]) < 0.01
    for _ in range(12):            # processes that time the same converge on it
        timed_generation(Planner(lie, memory=AcceptanceMemory("t", path)), truth)
    assert all(abs(c - truth[int(n)]) < 0.02 for n, c in stored().items())

    # One process timing 2 tokens at 2.0 (a busy minute) moves it a little.
    odd = list(truth)
    odd[2] = 2.0
    timed_generation(Planner(lie, memory=AcceptanceMemory("t", path)), odd)
    assert truth[2] < stored()["2"] < 1.5

    # A process timing only 5 tokens keeps the sizes it never timed.
    before = stored()
    p = Planner(lie, memory=AcceptanceMemory("t", path))
    for _ in range(MIN_SAMPLES):
        p.record_step_time(0.03, 1)
        p.record_step_time(0.03 * 2.0, 5)
    p.end()
    curve = stored()
    assert "5" not in before and set(curve) == {*before, "5"} and all(curve[n] == c for n, c in before.items())
    assert min(p.costs.prior[5], 2.0) < curve["5"] < max(p.costs.prior[5], 2.0)   # part of the way
    # Another target learned nothing: its curve is the one measured at load.
    assert Planner(lie, memory=AcceptanceMemory("other", path)).cost(2) == lie[2]


def test_routes_keep_acceptance_apart_within_a_process():
    p = Planner(AVX2)
    generate(p, Bilingual(), GERMAN, right=False)
    assert {"specialized:eng@latin-deu:prose"} <= set(p.acceptance)
    p.begin("def f(x):\n    return {k: v for k, v in x.items()}\n")
    assert p.route == "latin:code"
    assert p._acc("specialized:eng").trials[0] == 0      # code: no evidence yet
    p.begin(None)                                         # token ids only: no route
    assert p.route == ""


def test_a_slow_drafter_that_pays_alone_declines_in_a_batch_of_four():
    """A draft model at 0.25 of a target token per drafted token, accepted
    0.8 of the time: alone it pays (a few tokens per step); beside three
    other generations (parallel=4, their 3 tokens in the batch) its tokens
    take batch time from them that its acceptance does not repay."""
    class Slow(Bilingual):
        name = "model"
        prior = 0.8
        cost = DraftCost(per_token=0.25, catch_up=0.05)

    p = Planner(AVX2)
    slow = Slow()
    assert len(p.choose([slow], list(range(100)), limit=8, room=200, may_skip=True, trees=True)) >= 2
    p.shared = 3
    assert len(p.choose([slow], list(range(100)), limit=8, room=200, may_skip=True, trees=True)) == 0
    # Where batches are nearly free, a free draft with that acceptance still pays in the batch.
    flat = Planner(FLAT)
    flat.shared = 3
    assert len(flat.cut(Draft(tokens=[1, 2], source="ngram", prior=0.8), may_skip=True)[0]) >= 1


def test_a_corrupt_or_foreign_acceptance_cache_is_ignored_with_a_notice_and_rewritten(tmp_path, caplog):
    import json

    from edgespec.learned import FORMAT, VERSION, AcceptanceMemory

    path = tmp_path / "acceptance.json"
    for bad in ("{not json", json.dumps({"format": "someone-else", "version": VERSION}),
                json.dumps({"format": FORMAT, "version": 99, "targets": {}}),
                json.dumps({"format": FORMAT, "version": VERSION - 1, "targets": {}}),   # an older release's
                json.dumps({"format": FORMAT, "version": VERSION,
                            "targets": {"t": {"acceptance": {"k": {"hits": "x"}}}}}),
                json.dumps({"format": FORMAT, "version": VERSION,   # a batch costing less than one token
                            "targets": {"t": {"acceptance": {}, "curve": {"4": 0.5}}}})):
        path.write_text(bad)
        caplog.clear()
        with caplog.at_level("WARNING", logger="edgespec"):
            planner = Planner(AVX2, memory=AcceptanceMemory("t", path))
        notices = [r.getMessage() for r in caplog.records]
        assert len(notices) == 1 and str(path) in notices[0] and "ignoring" in notices[0]
        assert len(notices[0].splitlines()) == 1
        generate(planner, Bilingual(), GERMAN, right=False)   # learns, and saves over the bad file
        table = json.loads(path.read_text())
        assert table["format"] == FORMAT and "specialized:eng@latin-deu:prose" in table["targets"]["t"]["acceptance"]


def test_concurrent_writers_never_tear_the_acceptance_cache_nor_lose_keys(tmp_path):
    """Eight writers (threads, each its own memory as a process would have)
    save different keys 20 times each at once: the file always parses and
    ends with every key."""
    import json
    import threading

    from edgespec.learned import AcceptanceMemory

    path = tmp_path / "acceptance.json"
    torn = []

    def writer(i):
        m = AcceptanceMemory("t", path)
        for j in range(20):
            m.learn(f"k{i}", [float(j)], [float(j + 1)])
            m.save()
            try:
                json.loads(path.read_text())
            except ValueError as e:
                torn.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not torn
    keys = json.loads(path.read_text())["targets"]["t"]["acceptance"]
    assert set(keys) == {f"k{i}" for i in range(8)} and all(keys[k]["trials"] == [20.0] for k in keys)


def test_the_acceptance_cache_stays_bounded(tmp_path):
    import json

    from edgespec import learned

    path = tmp_path / "acceptance.json"
    for t in range(learned.MAX_TARGETS + 3):
        m = learned.AcceptanceMemory(f"t{t}", path)
        for k in range(learned.MAX_KEYS + 5):
            m.learn(f"k{k}", [1.0] * 40, [2.0] * 40)
        m.save()
    table = json.loads(path.read_text())["targets"]
    assert len(table) == learned.MAX_TARGETS
    assert all(len(t["acceptance"]) == learned.MAX_KEYS for t in table.values())
    assert all(len(e["hits"]) == learned.DEPTHS for t in table.values() for e in t["acceptance"].values())


def quiet_times() -> dict[int, float]:
    """Batch timings (seconds by size) of a quiet machine: 20 ms a token, the AVX2 curve."""
    from edgespec.costs import MEASURED

    return {k: 0.02 * AVX2[k] for k in MEASURED}


def test_a_cost_curve_measured_on_a_busy_machine_is_timed_again_and_said(caplog):
    """A scripted timer: the first round was disturbed (the one-token step
    took 3x its time, so every batch looks cheap), the second quiet. The
    disturbed round is detected and the curve comes from the fastest times."""
    from edgespec.costs import Suspect, checked_curve, disturbed

    busy = {**quiet_times(), 1: 0.06, 2: 0.05}
    rounds = iter([busy, quiet_times()])
    assert disturbed(busy) is not None and disturbed(quiet_times()) is None
    curve = checked_curve(lambda: next(rounds))
    assert not isinstance(curve, Suspect)
    assert abs(curve[4] - AVX2[4]) < 1e-9 and abs(curve[8] - AVX2[8]) < 1e-9
    # Busy at every round: a suspect curve, saying why.
    curve = checked_curve(lambda: busy)
    assert isinstance(curve, Suspect) and "smaller one" in curve.why
    # A one-token step far above the roofline (20 ms where reading the weights takes 2 ms).
    slow = checked_curve(quiet_times, roofline_s=0.002)
    assert isinstance(slow, Suspect) and "roofline" in slow.why
    assert not isinstance(checked_curve(quiet_times, roofline_s=0.01), Suspect)


def test_a_suspect_curve_is_measured_again_at_the_next_load_then_kept(tiny_llama_path, tmp_path, monkeypatch,
                                                                      caplog):
    import json
    import os

    from edgespec import costs
    from edgespec.backends import open_backend

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))   # the load average sees nothing
    timed = []
    busy = {**quiet_times(), 1: 0.06, 2: 0.05}
    monkeypatch.setattr(costs, "time_batches", lambda *a, **k: timed.append(1) or busy)
    with open_backend("native", tiny_llama_path, n_ctx=256, threads=1) as backend:
        with caplog.at_level("WARNING", logger="edgespec"):
            costs.batch_costs(backend)
        assert len(timed) == costs.CURVE_ROUNDS
        assert any("busy machine" in r.getMessage() for r in caplog.records)
        entry = json.loads((tmp_path / costs.COST_FILE).read_text())[costs.cost_key(backend)]
        assert entry["suspect"] and entry["tries"] == 1
        costs.batch_costs(backend)                       # measured again at the next load
        assert len(timed) == 2 * costs.CURVE_ROUNDS
        costs.batch_costs(backend)                       # after SUSPECT_TRIES loads: kept
        assert len(timed) == 2 * costs.CURVE_ROUNDS


def test_in_a_shared_batch_a_curve_flat_there_does_not_make_drafts_free():
    """A curve measured while the machine was busy: 2 to 8 tokens all cost
    1.8 one-token steps. Beside 3 other generations' tokens, taken at its
    word a draft of 4 would ride free; each added token is charged at least
    the batch's average cost per token beyond the first instead (0.27 of a
    step), which drafts accepted half the time do not repay."""
    flat_middle = [0.0, 1.0] + [1.8] * 7 + [1.8 + 0.3 * k for k in range(1, MAX_BATCH - 7)]
    p = Planner(flat_middle)
    p.shared = 3
    assert p.cost(5) > 1.5
    for i in range(30):
        p.record("k", 4, i % 2)               # half the first tokens accepted, no second one
    assert len(p.cut(chain(4), may_skip=True)[0]) == 0
    p.shared, p.costs = 3, CostCurve(flat_middle[:5] + [1.8 + 0.27 * k for k in range(1, MAX_BATCH - 3)])
    assert len(p.cut(chain(4), may_skip=True)[0]) == 0   # the same as the curve beyond 4 were true


def confident(tokens, confidence, key="head"):
    return Draft(tokens=list(tokens), source=key, confidence=list(confidence))


def test_a_greedy_chain_is_cut_where_its_drafter_is_unsure():
    # The same drafter and the same average acceptance: a chain whose first
    # token it is sure of is verified that far, one it is unsure of is not
    # verified at all; a sure run is verified whole.
    p = Planner(MEMORY_BOUND)
    cut, value = p.cut(confident([5, 6, 7], [0.97, 0.15, 0.9]), may_skip=True)
    assert cut.tokens == [5] and value > 1.0
    assert len(p.cut(confident([5, 6], [0.15, 0.97]), may_skip=True)[0]) == 0
    assert p.cut(confident([5, 6, 7], [0.99, 0.99, 0.99]), may_skip=True)[0].tokens == [5, 6, 7]
    # an explicitly chosen drafter still verifies its first token
    assert p.cut(confident([5, 6], [0.15, 0.97]), may_skip=False)[0].tokens == [5]


class _Confident(Drafter):
    """A costly drafter (its cost known, small) that drafts ``chain`` with ``confidence``."""
    name = "head"
    costly = True
    cost = DraftCost(per_token=0.03, catch_up=0.01)

    def __init__(self, chain, confidence):
        self.chain, self.confidence = chain, confidence

    def draft(self, context, max_tokens):
        return confident(self.chain[:max_tokens], self.confidence[:max_tokens])


def test_what_the_target_chose_teaches_a_drafter_s_confidence_even_where_its_chain_was_cut():
    # Tokens the drafter is unsure of (0.05) are right every time here: the
    # planner cuts them at first, yet learns from the target's own choice at
    # each plain step that they are taken, and starts verifying them.
    p = Planner(MEMORY_BOUND)
    d = _Confident([7, 8], [0.05, 0.05])
    steps = 0
    while not len(p.choose([d], [1, 2, 3], 2, 100, may_skip=True, trees=False)):
        p.record("none", 0, 0, [7])   # a plain step: the target chose 7
        steps += 1
        cal = p.calibration["head"]
        assert cal.hits[0][0] == cal.trials[0][0] > steps - 1   # a chain's first tokens, decayed counts
    assert 1 <= steps <= CONFIDENCE_STRENGTH
    # and the drafter's acceptance, for deciding whether to ask it, is of every chain drafted
    assert steps - 1 < p._acc("head").trials[0] <= steps   # decayed counts
    # wrong where it was sure: after a few misses its sure tokens are cut too
    p2 = Planner(MEMORY_BOUND)
    sure = _Confident([7, 8], [0.95, 0.95])
    assert len(p2.choose([sure], [1, 2, 3], 2, 100, may_skip=True, trees=False)) == 2
    for _ in range(6):
        p2.choose([sure], [1, 2, 3], 2, 100, may_skip=True, trees=False)
        p2.record("head", 2, 0, [9])
    assert len(p2.choose([sure], [1, 2, 3], 2, 100, may_skip=True, trees=False)) == 0


def test_sampled_steps_teach_no_confidence():
    p = Planner(MEMORY_BOUND)
    d = _Confident([7, 8], [0.95, 0.95])
    p.choose([d], [1, 2, 3], 2, 100, may_skip=True, trees=False)
    p.record("head", 2, 1, None)
    assert "head" not in p.calibration or sum(map(sum, p.calibration["head"].trials)) == 0
    assert p._acc("head").trials[0] == 1.0   # the verified draft, as any drafter's


def test_a_sure_head_drafts_past_what_it_was_asked_for_and_an_unsure_one_stops():
    # Where batches are nearly free, a head whose sure tokens (0.99) are
    # accepted goes on past what it was asked for, to the step's limit;
    # it stops after a token it is unsure of (0.1), and where a batch's
    # next token costs a quarter of a step.
    def planner(curve):
        p = Planner(curve)
        p.drafter_costs("head", DraftCost(per_token=0.03, catch_up=0.01))
        for _ in range(20):   # every token verified is accepted
            d = p.choose([_Confident([7] * 8, [0.99] * 8)], [1, 2, 3], 6, 100, may_skip=True, trees=False)
            p.record(d.source or "none", d.depth, d.depth, [7] * (d.depth + 1))
        return p

    p = planner(FLAT)
    assert p.calibration["head"].acceptance(0.99, 0) > 0.85 and p.calibration["head"].acceptance(0.99, 3) > 0.85
    assert p.draft_further("head", [0.99])
    assert p.draft_further("head", [0.99] * 5)
    assert not p.draft_further("head", [0.99] * 6)    # the step's limit
    assert not p.draft_further("head", [0.99, 0.1])
    p = planner(MEMORY_BOUND)
    assert p.draft_further("head", [0.99] * 2) and not p.draft_further("head", [0.99] * 5)


def test_a_chain_s_later_tokens_are_calibrated_apart_from_its_first():
    # A drafter right when sure of a chain's first token (0.95) but as sure
    # and wrong of the next: it keeps having its first tokens verified, not
    # the later ones.
    p = Planner(FLAT)
    d = _Confident([7, 8, 9], [0.95, 0.95, 0.95])
    for _ in range(12):
        draft = p.choose([d], [1, 2, 3], 3, 100, may_skip=True, trees=False)
        p.record("head", draft.depth, min(draft.depth, 1), [7, 5])
    cal = p.calibration["head"]
    assert cal.acceptance(0.95, 0) > 0.8 and cal.acceptance(0.95, 1) < 0.4
    assert p.choose([d], [1, 2, 3], 3, 100, may_skip=True, trees=False).tokens == [7]


def test_opening_a_drafter_is_priced_on_the_answer_s_expected_rest():
    # A drafter that pays (cheap, accepted half the time) but takes five
    # tokens' time to open: worth opening with 96 tokens left, not where
    # the answer is expected to end within 16 (planner.expected_room); a
    # backlog of an open drafter is still priced on what is left at most.
    p = Planner(MEMORY_BOUND)
    for _ in range(MIN_SAMPLES):
        p.record_step_time(0.02, 1)
    p.drafter_costs("head", DraftCost(per_token=0.03, catch_up=0.01))
    for i in range(10):
        p.record("head", 1, i % 2)
    assert expected_room(96, 0) == EXPECTED_ROOM_MIN and expected_room(96, 40) == 40 and expected_room(8, 40) == 8
    assert p.catch_up_pays("head", 1, 96, 1.0, 2, opening_s=0.1)
    assert not p.catch_up_pays("head", 1, 96, 1.0, 2, opening_s=0.1, expected=expected_room(96, 0))
    assert p.catch_up_pays("head", 1, 96, 1.0, 2, opening_s=0.1, expected=expected_room(96, 60))
    assert p.catch_up_pays("head", 40, 96, 1.0, 2, expected=expected_room(96, 0))
