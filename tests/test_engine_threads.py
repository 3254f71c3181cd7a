"""One Engine shared between threads: generations serialized (never a crash,
outputs equal to serial runs), non-blocking calls refused while busy,
cancel() from another thread during prompt evaluation and during decoding,
close() while another thread generates, abandoned streams, calls after close."""
from __future__ import annotations

import gc
import threading
import time

import pytest

from edgespec import Engine
from edgespec.errors import EngineBusyError, EngineClosedError, GenerationAbandonedError

PROMPTS = ["Once upon a time", "The capital of France is", "def add(a, b):\n    return",
           "1, 2, 3, 4, 5,", "Repeat: red green blue red green blue", "Hello there", "In 1492,", "Dear Sir,"]
N = 24


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    with Engine(str(tiny_llama_path), threads=1, n_ctx=512, drafter="auto") as e:
        yield e


@pytest.fixture(scope="module")
def serial(engine):
    """Each prompt's greedy output, one generation at a time."""
    return {p: engine.generate(p, max_tokens=N).tokens for p in PROMPTS}


def _hammer(engine, n_threads: int, rounds: int) -> tuple[dict, list]:
    results: dict[tuple[int, int], tuple[str, list[int]]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(n_threads)

    def worker(i: int) -> None:
        try:
            start.wait()
            for r in range(rounds):
                prompt = PROMPTS[(i + r) % len(PROMPTS)]
                if (i + r) % 2:
                    tokens = engine.generate(prompt, max_tokens=N).tokens
                else:
                    gen = engine.stream(prompt, max_tokens=N)
                    for _ in gen:
                        pass
                    tokens = gen.result.tokens
                results[i, r] = prompt, tokens
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a generation hung"
    return results, errors


@pytest.mark.parametrize("n_threads, rounds", [(2, 4), (8, 2)])
def test_threads_sharing_one_engine_get_the_serial_outputs(engine, serial, n_threads, rounds):
    results, errors = _hammer(engine, n_threads, rounds)
    assert errors == []
    assert len(results) == n_threads * rounds
    for (i, r), (prompt, tokens) in results.items():
        assert tokens == serial[prompt], f"thread {i} round {r}: {prompt!r}"


def test_a_non_blocking_call_is_refused_while_another_thread_generates(engine):
    gen = engine.stream(PROMPTS[0], max_tokens=N)
    next(gen)                                   # holds the engine, suspended
    outcome = []
    t = threading.Thread(target=lambda: outcome.append(_try(lambda: engine.generate("Hi", max_tokens=2,
                                                                                     blocking=False))))
    t.start()
    t.join(timeout=60)
    assert isinstance(outcome[0], EngineBusyError)
    gen.close()
    assert gen.result.stats.n_tokens >= 1
    assert engine.generate("Hi", max_tokens=2, blocking=False).stats.n_tokens == 2


def _try(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return e


def _slow_evaluate(engine, monkeypatch, seconds: float) -> None:
    real = type(engine.backend)._evaluate

    def slow(self, *args):
        time.sleep(seconds)
        return real(self, *args)

    monkeypatch.setattr(type(engine.backend), "_evaluate", slow)


def _generate_in_thread(engine, prompt, **options):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("result", _try(lambda: engine.generate(prompt, **options))))
    t.start()
    return t, box


def test_cancel_during_prompt_evaluation(tiny_llama_path, monkeypatch):
    with Engine(str(tiny_llama_path), threads=1, n_ctx=512, n_batch=16, draft_max=4) as engine:
        prompt = "word " * 300                    # ~20 chunks of 16 tokens
        n_prompt = len(engine.tokenize(prompt))
        _slow_evaluate(engine, monkeypatch, 0.05)
        t, box = _generate_in_thread(engine, prompt, max_tokens=8)
        while engine.backend.n_past < 32:          # prompt evaluation under way
            time.sleep(0.01)
        assert engine.cancel()
        t.join(timeout=30)
        result = box["result"]
        assert result.stats.stop_reason == "cancelled"
        assert result.tokens == []
        assert engine.backend.n_past < n_prompt    # it stopped within a chunk or two
        monkeypatch.undo()
        # The cache holds a true prefix of the prompt: the next run reuses it
        # and gives what a fresh engine gives.
        again = engine.generate(prompt, max_tokens=8)
        assert again.stats.cached_tokens > 0
    with Engine(str(tiny_llama_path), threads=1, n_ctx=512, n_batch=16, draft_max=4) as fresh:
        assert again.tokens == fresh.generate(prompt, max_tokens=8).tokens


def test_cancel_during_decoding(engine, serial, monkeypatch):
    _slow_evaluate(engine, monkeypatch, 0.02)
    gen = engine.stream(PROMPTS[1], max_tokens=400, drafter="none")
    pieces = []

    def consume():
        for piece in gen:
            pieces.append(piece)

    t = threading.Thread(target=consume)
    t.start()
    while len(pieces) < 5:
        time.sleep(0.005)
    assert engine.cancel()
    t.join(timeout=30)
    assert not t.is_alive()
    result = gen.result
    assert result.stats.stop_reason == "cancelled"
    assert 5 <= result.stats.n_tokens < 400
    monkeypatch.undo()
    n = min(N, len(result.tokens))
    assert result.tokens[:n] == serial[PROMPTS[1]][:n]
    assert not engine.cancel()                      # nothing runs now
    assert engine.generate(PROMPTS[1], max_tokens=N).tokens == serial[PROMPTS[1]]


def test_an_abandoned_stream_never_continues_another_prompt(engine, serial):
    abandoned = engine.stream(PROMPTS[0], max_tokens=N)
    next(abandoned)
    b = engine.generate(PROMPTS[1], max_tokens=N)   # finalizes the abandoned stream first
    assert b.tokens == serial[PROMPTS[1]]
    assert abandoned.result is not None and abandoned.result.stats.n_tokens < N
    with pytest.raises(GenerationAbandonedError, match="started another generation"):
        next(abandoned)
    del abandoned
    gc.collect()
    assert engine.generate(PROMPTS[2], max_tokens=N).tokens == serial[PROMPTS[2]]
    assert engine.generate(PROMPTS[0], max_tokens=N).tokens == serial[PROMPTS[0]]


def test_close_while_another_thread_generates(tiny_llama_path, monkeypatch):
    engine = Engine(str(tiny_llama_path), threads=1, n_ctx=512)
    _slow_evaluate(engine, monkeypatch, 0.02)
    t, box = _generate_in_thread(engine, "Once upon a time", max_tokens=400)
    while engine.backend.n_past == 0:
        time.sleep(0.005)
    engine.close()                                   # cancels it and waits for it
    t.join(timeout=30)
    assert box["result"].stats.stop_reason == "cancelled"
    for call in (lambda: engine.generate("Hi"), lambda: engine.stream("Hi"), lambda: engine.tokenize("Hi"),
                 lambda: engine.batch_costs()):
        with pytest.raises(EngineClosedError):
            call()
    engine.close()


def test_a_stream_made_before_close_refuses_to_start(tiny_llama_path):
    engine = Engine(str(tiny_llama_path), threads=1, n_ctx=256)
    gen = engine.stream("Hello", max_tokens=4)
    engine.close()
    with pytest.raises(EngineClosedError):
        next(gen)


def _stays_alive(n_threads: int, body) -> tuple[list[threading.Thread], threading.Event, list]:
    """Threads that each run ``body(i)`` once, then stay alive until the event."""
    leave, errors, ran = threading.Event(), [], threading.Barrier(n_threads + 1)

    def worker(i: int) -> None:
        try:
            body(i)
        except BaseException as e:  # noqa: BLE001  (reported by the test)
            errors.append(e)
        ran.wait()
        leave.wait()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n_threads)]
    for t in threads:
        t.start()
    ran.wait(timeout=120)
    return threads, leave, errors


def test_threads_that_break_out_of_streams_and_stay_alive_never_hold_the_engine(engine, serial):
    # A UI thread leaves a stream with `break` and lives on; the stream must
    # not keep the engine from any other thread, without waiting for the
    # cyclic garbage collector (switched off here).
    def leave_early(i: int) -> None:
        for _ in engine.stream(PROMPTS[i % len(PROMPTS)], max_tokens=N):
            break

    gc.disable()
    try:
        for _ in range(3):
            threads, leave, errors = _stays_alive(6, leave_early)
            t, box = _generate_in_thread(engine, PROMPTS[3], max_tokens=N)
            t.join(timeout=60)
            leave.set()
            assert not t.is_alive(), "a generation waited for an abandoned stream"
            assert errors == []
            assert box["result"].tokens == serial[PROMPTS[3]]
    finally:
        gc.enable()


def test_a_suspended_stream_kept_by_a_live_thread_is_ended_by_cancel_from_another(engine, serial):
    kept = []

    def keep(i: int) -> None:
        gen = engine.stream(PROMPTS[0], max_tokens=N)
        next(gen)
        kept.append(gen)

    threads, leave, errors = _stays_alive(1, keep)
    assert errors == []
    assert engine.cancel()                      # ends it now, from this thread
    assert kept[0].result.stats.stop_reason == "cancelled"
    t, box = _generate_in_thread(engine, PROMPTS[2], max_tokens=N)
    t.join(timeout=60)
    assert not t.is_alive()
    assert box["result"].tokens == serial[PROMPTS[2]]
    with pytest.raises(StopIteration):          # a cancelled stream ends; nothing more comes
        next(kept[0])
    leave.set()


def test_close_ends_a_stream_suspended_in_another_live_thread(tiny_llama_path):
    engine = Engine(str(tiny_llama_path), threads=1, n_ctx=256)
    kept = []

    def keep(i: int) -> None:
        gen = engine.stream("Once upon a time", max_tokens=N)
        next(gen)
        kept.append(gen)

    threads, leave, errors = _stays_alive(1, keep)
    closer = threading.Thread(target=engine.close)
    closer.start()
    closer.join(timeout=60)
    assert not closer.is_alive(), "close() waited for a suspended stream"
    assert kept[0].result.stats.stop_reason == "cancelled"
    with pytest.raises(EngineClosedError):
        next(kept[0])
    leave.set()


@pytest.mark.parametrize("backend", ["native", "llama"])
def test_a_stream_held_idle_in_a_live_thread_does_not_block_another_forever(tiny_llama_path, backend):
    # `s = e.stream(...); for p in s: break` in a thread that lives on, keeping
    # `s`: another thread's generate() waits at most stream_idle_ms for it,
    # then the idle stream is ended for it (its owner gets a typed error).
    with Engine(str(tiny_llama_path), backend=backend, threads=1, n_ctx=256, stream_idle_ms=200) as engine:
        alone = engine.generate(PROMPTS[2], max_tokens=N, temperature=0).tokens
        kept = []

        def keep(i: int) -> None:
            s = engine.stream(PROMPTS[0], max_tokens=N)
            for _ in s:
                break
            kept.append(s)

        threads, leave, errors = _stays_alive(1, keep)
        assert errors == []
        t, box = _generate_in_thread(engine, PROMPTS[2], max_tokens=N, temperature=0)
        t.join(timeout=60)
        assert not t.is_alive(), "a generation waited without end for an idle stream"
        assert box["result"].tokens == alone
        with pytest.raises(GenerationAbandonedError, match="idle"):
            next(kept[0])
        assert kept[0].result is not None and kept[0].result.stats.n_tokens >= 1   # what it generated
        leave.set()


def test_a_stream_consumed_without_pause_is_never_ended_for_a_waiting_thread(tiny_llama_path, monkeypatch):
    # The idle bound ends only streams whose owner stopped asking: one whose
    # consumer asks for every piece runs to its end (24 steps of 50 ms, far
    # past the bound) while another thread waits.
    with Engine(str(tiny_llama_path), threads=1, n_ctx=256, stream_idle_ms=300) as engine:
        _slow_evaluate(engine, monkeypatch, 0.05)
        s = engine.stream(PROMPTS[1], max_tokens=N, temperature=0)
        pieces = [next(s)]
        t, box = _generate_in_thread(engine, PROMPTS[2], max_tokens=4, temperature=0)
        pieces += list(s)
        t.join(timeout=60)
        assert not t.is_alive()
        assert s.result.stats.stop_reason == "length" and "".join(pieces) == s.result.text
        assert box["result"].stats.n_tokens >= 1
