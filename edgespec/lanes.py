"""Where an engine's generations run, and who holds the engine.

A ``Lane`` is one of an engine's ``parallel`` places for a running
generation: it owns that generation's drafters and planner (drafters keep a
generation's state between steps, the planner what it learned of them), the
KV-cache slot it runs in, and the way its backend calls are made (alone, or
under the backend lock with its slot selected, its steps meeting the other
lanes' in one batch: edgespec.batching).

``Lanes`` shares an engine between threads: each running generation holds
one of ``parallel`` permits and a lane; a short exclusive call (saving a
slot, embeddings) holds every permit; calls that only read the model
(tokenizing) are counted so that closing waits for them. A thread that
waits for the engine never waits without end: a stream its owner left idle
between pieces for longer than ``idle_s`` is ended for it
(GenerationAbandonedError when its owner resumes it), and one this thread
itself left suspended is ended at once, as it could never resume correctly
once another generation has used the cache.
"""
from __future__ import annotations

import contextlib
import threading
import time
import weakref
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

from .backends import Backend, GroupStep
from .batching import Batcher, Evaluated, evaluate
from .drafters import Drafter, DrafterConfig, auto_members, open_drafter
from .errors import EngineBusyError, EngineClosedError, GenerationAbandonedError
from .planner import Planner

if TYPE_CHECKING:
    from .results import Step

_ALONE = contextlib.nullcontext()   # a lone generation's backend calls take no lock
POLL_S = 0.5                        # how often a waiting thread looks for idle streams


class Holder(Protocol):
    """A running generation as ``Lanes`` sees it (edgespec.generation.Generation)."""

    owner: threading.Thread | None
    lane: int

    def idle_for(self) -> float: ...
    def end_if_idle(self, error: Exception | None = None) -> None: ...
    def cancel_and_end(self, error: Exception) -> None: ...


class Lane:
    """One place for a running generation (see the module docstring). Its
    drafters are opened on first use, its planner made on first use over
    ``new_planner()`` (the machine's cost curve)."""

    def __init__(self, backend: Backend, drafter_config: DrafterConfig, new_planner: Callable[[], Planner]):
        self.backend = backend
        self.drafters: dict[str, Drafter] = {}
        self.planner: Planner | None = None
        self.slot = 0
        self._drafter_config = drafter_config
        self._new_planner = new_planner
        self._batcher: Batcher | None = None
        self._lock: threading.Condition | None = None

    def batch_with(self, batcher: Batcher, lock: threading.Condition) -> None:
        """Run this lane's steps in ``batcher``'s batches, its backend calls under ``lock``."""
        self._batcher, self._lock = batcher, lock

    @property
    def batched(self) -> bool:
        return self._batcher is not None

    def open_drafters(self, name: str) -> list[Drafter]:
        """The drafters of ``name`` (auto: its members; none: none), opened on first use."""
        names = {"none": [], "auto": auto_members(self._drafter_config)}.get(name, [name])
        for n in names:
            if n not in self.drafters:
                self.drafters[n] = open_drafter(n, self._drafter_config)
        return [self.drafters[n] for n in names]

    def drafting_planner(self) -> Planner:
        if self.planner is None:
            self.planner = self._new_planner()
        return self.planner

    def on_slot(self):
        """What this lane's backend calls run under: nothing when alone, else
        the backend lock with its slot selected."""
        return _ALONE if self._batcher is None else self._slot_held()

    @contextmanager
    def _slot_held(self):
        with self._lock:
            self.backend.select_slot(self.slot)
            yield

    # -- the step loop's backend calls ------------------------------------------

    def prefill(self, tokens: list[int], n_ctx: int | None, busy_slots: Callable[[], list[int]],
                cancel) -> tuple[int, int]:
        """Evaluate ``tokens`` after the longest prefix a slot holds but the
        ``busy_slots()`` of the other running generations (asked under the
        backend lock, where the others choose theirs); the slot becomes this
        lane's. Returns (prompt tokens reused, rows' address)."""
        with self._lock if self._batcher is not None else _ALONE:
            kept = self.backend.reuse_prefix(tokens, n_ctx, busy_slots() if self._batcher else ())
            self.slot = self.backend.slot
            logits = self.backend.decode(tokens[kept:], cancel=cancel)
            if self._batcher is not None:
                self._batcher.join(self.slot)
        return kept, logits

    def position(self) -> tuple[int, int, int]:
        """(tokens the cache holds, its context size, the backend's batch size)."""
        with self.on_slot():
            return self.backend.n_past, self.backend.context, self.backend.n_batch

    def evaluate(self, step: GroupStep, t0: float) -> Evaluated:
        """A step's pending tokens and draft, alone or in the shared batch."""
        if self._batcher is not None:
            return self._batcher.step(step)
        address = evaluate(self.backend, step)
        return Evaluated(address, time.perf_counter() - t0, len(step.pending) + len(step.tokens))

    def evaluate_again(self, context: list[int], keep: int, cancel) -> None:
        """Make the cache hold ``context`` but its last token (pending, as after
        any step), its first ``keep`` tokens kept and the rest evaluated again."""
        with self.on_slot():
            self.backend.truncate(keep)
            if len(context) - 1 > keep:
                self.backend.decode(context[keep:-1], cancel=cancel)

    def settle(self, tree: bool, rejected: int) -> None:
        """Drop what verification rejected: a tree's cells, or a chain's tail."""
        with self.on_slot():
            if tree:
                self.backend.drop_tree()
            else:
                self.backend.truncate(self.backend.n_past - rejected)

    def away(self, step: "Step") -> Iterator["Step"]:
        """Yield ``step``; meanwhile the batch does not wait for this lane
        longer than its grace (its consumer holds the piece)."""
        if self._batcher is None:
            yield step
            return
        self._batcher.away(self.slot)
        yield step
        self._batcher.back(self.slot)

    def leave(self) -> None:
        if self._batcher is not None:
            self._batcher.leave(self.slot)

    def close(self) -> None:
        for d in self.drafters.values():
            d.close()
        self.drafters.clear()


class Lanes:
    """An engine's lanes and who holds them (see the module docstring)."""

    def __init__(self, lanes: list[Lane], idle_s: float):
        self.lanes = lanes
        self.parallel = len(lanes)
        self.idle_s = idle_s
        self.closed = False
        self._busy = threading.BoundedSemaphore(self.parallel)
        self._gather = threading.Lock()
        self._state = threading.Condition()   # guards the fields below
        self._running: dict[int, weakref.ref[Holder]] = {}   # lane -> its generation
        self._free = list(range(self.parallel))
        self._readers = 0   # calls reading the model outside a generation (tokenizing)

    def take(self, gen: Holder | None, blocking: bool = True) -> None:
        """Hold the engine for ``gen`` (a lane of it), or, for None, all of it
        for a short exclusive call. A stream this thread left suspended is
        ended first: a step loop would wait for it."""
        me = threading.current_thread()
        self._end_suspended(me, every=gen is None)
        permits = 1 if gen is not None else self.parallel
        if not self._acquire(permits, blocking):
            raise EngineBusyError("the engine is running another generation (blocking=False)")
        with self._state:
            if self.closed:
                self._release(permits)
                raise EngineClosedError("the engine was closed")
            if gen is not None:
                # The lowest lane: a lone client keeps the drafters and planner
                # that learned the most (lane 0's, as with parallel 1).
                gen.lane = min(self._free)
                self._free.remove(gen.lane)
                # Weakly: a stream its consumer dropped is freed and gives the engine back.
                self._running[gen.lane] = weakref.ref(gen)
                gen.owner = me

    def give_back(self, gen: Holder | None = None) -> None:
        """Called by the holder: a generation, or (None) a short exclusive call."""
        with self._state:
            if gen is not None:
                self._running.pop(gen.lane, None)
                self._free.append(gen.lane)
        self._release(1 if gen is not None else self.parallel)

    def _acquire(self, permits: int, blocking: bool) -> bool:
        if permits == 1:
            return self._acquire_one(blocking)
        with self._gather:   # one gatherer at a time: two would each hold some and wait forever
            taken = 0
            while taken < permits and self._acquire_one(blocking):
                taken += 1
            if taken < permits:
                self._release(taken)
            return taken == permits

    def _acquire_one(self, blocking: bool) -> bool:
        """A permit; waiting, end the streams left idle past ``idle_s``."""
        if not blocking:
            return self._busy.acquire(False)
        while not self._busy.acquire(timeout=min(POLL_S, self.idle_s)):
            self._end_idle()
        return True

    def _release(self, permits: int) -> None:
        for _ in range(permits):
            self._busy.release()

    def _end_idle(self) -> None:
        with self._state:
            idle = [g for g in self._current() if g.idle_for() > self.idle_s]
        for g in idle:
            g.end_if_idle(GenerationAbandonedError(
                f"this stream sat idle for over {self.idle_s:g} s while another thread waited for the "
                "engine, and was ended (its result holds what it generated)"))

    def _end_suspended(self, thread: threading.Thread, every: bool = True) -> None:
        """End the running generations ``thread`` left suspended; for another
        generation (not ``every`` lane wanted) only when no lane is free
        (each runs in a slot of its own, and this thread must not wait for
        itself). A method of its own so that no reference to them outlives
        the call: a thread waiting for the engine must not keep a dropped
        stream alive."""
        with self._state:
            self.check_open()
            if not every and self.parallel > 1 and self._free:
                return
            stale = [g for g in self._current() if g.owner is thread]
        for g in stale:
            g.end_if_idle(GenerationAbandonedError(
                "this stream was left suspended and ended when its thread started another "
                "generation (its result holds what it generated)"))

    def _current(self) -> list[Holder]:
        """The running generations still referenced (under ``_state``)."""
        return [g for ref in self._running.values() if (g := ref()) is not None]

    def running(self) -> list[Holder]:
        with self._state:
            return self._current()

    def busy_slots(self, lane: int = -1) -> list[int]:
        """The slots of the running generations but lane ``lane``'s."""
        with self._state:
            return [self.lanes[other].slot for other in self._running if other != lane]

    @contextmanager
    def exclusive(self):
        """Hold the engine for a short call between generations."""
        self.take(None)
        try:
            yield
        finally:
            self.give_back()

    @contextmanager
    def reading(self):
        """Guard for calls that read the model outside a generation: closing waits for them."""
        with self._state:
            self.check_open()
            self._readers += 1
        try:
            yield
        finally:
            with self._state:
                self._readers -= 1
                self._state.notify_all()

    def check_open(self) -> None:
        if self.closed:
            raise EngineClosedError("the engine was closed")

    def close(self, free: Callable[[], None]) -> None:
        """End every generation (a running one cancelled and waited for, a
        suspended one ended: resuming it raises EngineClosedError), wait for
        readers, then ``free()``. Later calls raise EngineClosedError."""
        with self._state:
            if self.closed:
                return
            self.closed = True
            running = self._current()
        while running:
            gen = running.pop()
            gen.cancel_and_end(EngineClosedError("the engine was closed"))
            del gen   # waiting below must not keep a dropped stream alive
        self._acquire(self.parallel, True)
        try:
            with self._state:
                self._state.wait_for(lambda: self._readers == 0)
            free()
        finally:
            self._release(self.parallel)
