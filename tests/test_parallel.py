"""Several generations at once on one engine (``parallel=N``, continuous
batching: edgespec.batching): concurrent greedy generations each equal their
serial answer, with and without speculation, their steps batched together
in slots of their own; a cancelled one leaves the others running and
correct; a backend that cannot group runs them one at a time; the choice of
N from the cost curve; refusals."""
from __future__ import annotations

import threading

import pytest

from edgespec import Engine, batching
from edgespec.backends.base import kv_cache_bytes
from edgespec.costs import available_memory
from edgespec.config import MAX_PARALLEL, EngineConfig
from edgespec.engine import auto_parallel
from edgespec.errors import EngineBusyError, GenerationAbandonedError, InvalidArgumentError

PROMPTS = ["Once upon a time", "The lighthouse keeper climbed", "In the beginning there was",
           "A quick brown fox jumps over", "She opened the door and"]


def at_once(engine: Engine, prompts: list[str], **options) -> list:
    """Each prompt's Result, generated in a thread of its own; all of them
    running together once each has its first piece (as many prompts as the
    engine has lanes)."""
    results = [None] * len(prompts)
    started = threading.Barrier(len(prompts))

    def run(i):
        gen = engine.stream(prompts[i], **options)
        next(gen, None)
        started.wait()
        for _ in gen:
            pass
        results[i] = gen.result

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(r is not None for r in results)
    return results


@pytest.mark.parametrize("drafter", ["none", "ngram", "recycle"])
def test_concurrent_greedy_generations_equal_their_serial_answers(tiny_llama_path, drafter, monkeypatch):
    # A tiny model's steps take microseconds: a long grace keeps the batches
    # whole however this machine schedules the threads.
    monkeypatch.setattr(batching, "AWAY_GRACE_S", 0.5)
    with Engine(tiny_llama_path, backend="native", threads=2, parallel=3, drafter=drafter) as engine:
        assert engine.parallel == 3 and engine.backend.n_slots >= 3
        serial = [engine.generate(p, max_tokens=48).tokens for p in PROMPTS[:3]]
        alone = engine.batcher.batched_steps
        together = at_once(engine, PROMPTS[:3], max_tokens=48)
        assert [r.tokens for r in together] == serial
        batched = engine.batcher.batched_steps - alone
        assert batched > 0 and engine.batcher.batches < engine.batcher.batched_steps  # some batches held several
        if drafter != "none":
            assert sum(r.stats.spec.accepted for r in together) > 0


def test_generations_running_together_never_share_a_slot(tiny_llama_path):
    with Engine(tiny_llama_path, backend="native", threads=2, parallel=3, slots=3) as engine:
        streams = [engine.stream(p, max_tokens=200) for p in PROMPTS[:3]]
        for s in streams:   # all three started by this thread, none finished
            next(s)
        slots = [engine.lanes[s.lane].slot for s in streams]
        assert sorted(slots) == [0, 1, 2]
        refused = []

        def fourth():   # another thread: this one's own suspended streams would be ended first
            try:
                next(engine.stream(PROMPTS[3], max_tokens=4, blocking=False))
            except EngineBusyError as e:
                refused.append(e)

        t = threading.Thread(target=fourth)
        t.start()
        t.join(timeout=60)
        assert refused   # every lane taken
        assert all(not s.cancelled for s in streams)
        assert [len(list(s)) > 0 for s in streams] == [True] * 3   # each resumes and ends
        assert all(s.result.stats.stop_reason in ("length", "eos") for s in streams)
        assert engine.generate(PROMPTS[3], max_tokens=4).tokens   # lanes given back


def test_a_cancelled_generation_leaves_the_others_running_and_correct(tiny_llama_path):
    with Engine(tiny_llama_path, backend="native", threads=2, parallel=2, drafter="ngram") as engine:
        want = engine.generate(PROMPTS[1], max_tokens=64).tokens
        doomed = engine.stream(PROMPTS[0], max_tokens=500)
        got = {}
        started = threading.Event()

        def other():
            gen = engine.stream(PROMPTS[1], max_tokens=64)
            for i, _ in enumerate(gen):
                if i == 2:
                    started.set()
            got["tokens"] = gen.result.tokens

        t = threading.Thread(target=other)
        next(doomed)
        t.start()
        assert started.wait(60)
        for _ in range(3):
            next(doomed)
        doomed.cancel()
        t.join(timeout=120)
        assert doomed.result.stats.stop_reason == "cancelled"
        assert got["tokens"] == want


def test_a_backend_that_cannot_group_runs_generations_one_at_a_time(tiny_llama_path):
    with Engine(tiny_llama_path, backend="llama", threads=2, parallel=3) as engine:
        assert engine.parallel == 1 and engine.batcher is None
        serial = [engine.generate(p, max_tokens=24).tokens for p in PROMPTS[:3]]
        got = [None] * 3

        def run(i):
            got[i] = engine.generate(PROMPTS[i], max_tokens=24).tokens

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert got == serial


def test_parallel_none_is_chosen_from_the_cost_curve_and_memory():
    flat = [0.0, 1.0, 1.02, 1.05, 1.1, 1.2, 1.3]
    steep = [0.0, 1.0, 1.9, 2.8, 3.7]
    assert auto_parallel(flat, None, None) == 4
    assert auto_parallel(steep, None, None) == 1
    assert auto_parallel([0.0, 1.0, 1.4, 2.4], None, None) == 2   # a third sequence adds more than half a step
    assert auto_parallel(flat, kv_bytes=1 << 30, memory=5 << 30) == 2   # two 1 GiB caches in half of 5 GiB


def test_parallel_none_opens_with_the_chosen_number(tiny_llama_path):
    with Engine(tiny_llama_path, backend="native", threads=2, parallel=None) as engine:
        kv = kv_cache_bytes(engine.backend.metadata, engine.backend.n_ctx)
        assert engine.parallel == auto_parallel(engine.batch_costs(), kv, available_memory())
        assert engine.backend.n_slots >= engine.parallel


@pytest.mark.parametrize("bad", [0, MAX_PARALLEL + 1, "2", 1.5])
def test_parallel_out_of_range_is_refused_naming_it(bad):
    with pytest.raises(InvalidArgumentError, match="parallel"):
        EngineConfig(parallel=bad)


def test_an_exclusive_call_ends_this_threads_suspended_stream_instead_of_waiting_for_it(tiny_llama_path):
    with Engine(tiny_llama_path, backend="native", threads=2, parallel=2) as engine:
        stream = engine.stream(PROMPTS[0], max_tokens=100)
        next(stream)
        engine.forget_prefix()   # takes every lane: would wait forever for this thread's own stream
        with pytest.raises(GenerationAbandonedError):
            next(stream)
