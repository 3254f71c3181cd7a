"""Continuous batching: the steps of the generations running at once on one
engine (``parallel=N``) evaluated together, one batch per step
(``Backend.decode_group``), each generation in its own KV-cache slot.

Each generation runs its own step loop in its own thread (edgespec.engine);
where it would evaluate its step it calls ``Batcher.step``, which returns its
rows once evaluated. The steps wait for each other: the batch goes when every
member has its step in, or is away (its consumer holds the last piece) for
longer than ``AWAY_GRACE_S``, or the oldest step has waited ``STALL_S``. The
caller that finds the batch ready evaluates it, holding the engine's backend
lock (every backend call of a generation is made under it, with its slot
selected), and wakes the others. A batch of one is an ordinary decode.

Greedy output is unchanged: the native engine is batch invariant, so each
row is what the generation's own decode would give (tests/test_parallel.py).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from .backends import Backend, GroupStep

AWAY_GRACE_S = 0.005   # a consumer handing a piece on (a server's queue) is back well within it
STALL_S = 0.25         # a member working longer than this on its draft is left for the next batch


def evaluate(backend: Backend, step: GroupStep) -> int:
    """One slot's step alone, in the selected slot: its pending tokens and
    draft (decode_tree for a tree); returns the address of its rows from the root."""
    if step.parents is not None:
        return backend.decode_tree(step.pending, step.tokens, step.parents, step.depths)
    return backend.decode(list(step.pending) + list(step.tokens), logits_from=len(step.pending) - 1)


@dataclass
class Evaluated:
    """What ``Batcher.step`` gives back: the step's rows and its batch."""

    address: int       # the step's (len(tokens) + 1, n_vocab) rows from its root
    seconds: float     # the batch's evaluation
    batch_tokens: int  # tokens of the whole batch


@dataclass(eq=False)   # queued steps are told apart by identity
class _Entry:
    step: GroupStep
    since: float
    result: Evaluated | None = None
    error: BaseException | None = None


class Batcher:
    """The meeting point of one engine's concurrent step loops (see the
    module docstring). ``lock`` is the engine's backend lock."""

    def __init__(self, backend: Backend, lock: threading.Condition):
        self.backend = backend
        self._cond = lock
        self._members: dict[int, float | None] = {}   # slot -> None: working; t: away since t (monotonic)
        self._queue: list[_Entry] = []
        self.batches = 0        # decode_group calls (and lone steps) so far
        self.batched_steps = 0  # steps they evaluated

    def join(self, slot: int) -> None:
        with self._cond:
            self._members[slot] = None

    def leave(self, slot: int) -> None:
        with self._cond:
            self._members.pop(slot, None)
            self._cond.notify_all()

    def away(self, slot: int) -> None:
        """The member's step is done and its consumer has the piece."""
        with self._cond:
            self._members[slot] = time.monotonic()
            self._cond.notify_all()

    def back(self, slot: int) -> None:
        with self._cond:
            self._members[slot] = None

    def step(self, step: GroupStep) -> Evaluated:
        """Evaluate ``step`` (its slot a member's) in the next batch."""
        entry = _Entry(step, time.monotonic())
        with self._cond:
            self._queue.append(entry)
            self._cond.notify_all()
            while entry.result is None and entry.error is None:
                wait = self._wait()
                if wait <= 0:
                    self._run()
                else:
                    self._cond.wait(wait)
        if entry.error is not None:
            raise entry.error
        return entry.result

    def _wait(self) -> float:
        """Seconds until the queued steps should go (<= 0: now): the longest
        grace left to an away member, unless one is still working on its
        step (then until the stall bound; its step or its leaving wakes us)."""
        if not self._queue:
            return STALL_S
        now = time.monotonic()
        stall = self._queue[0].since + STALL_S - now
        if stall <= 0:
            return 0.0
        queued = {e.step.slot for e in self._queue}
        grace = 0.0
        for slot, away in self._members.items():
            if slot in queued:
                continue
            if away is None:
                return stall
            grace = max(grace, away + AWAY_GRACE_S - now)
        return min(grace, stall)

    def _run(self) -> None:
        """Evaluate the queued steps that fit one batch (oldest first), under the lock."""
        batch, total = [], 0
        for e in self._queue:
            n = len(e.step.pending) + len(e.step.tokens)
            if not batch or total + n <= self.backend.n_batch:
                batch.append(e)
                total += n
        self._queue = [e for e in self._queue if e not in batch]
        t0 = time.perf_counter()
        try:
            if len(batch) == 1:
                self.backend.select_slot(batch[0].step.slot)
                addresses = [evaluate(self.backend, batch[0].step)]
            else:
                addresses = self.backend.decode_group([e.step for e in batch])
        except BaseException as error:   # every member of the batch raises it
            for e in batch:
                e.error = error
        else:
            seconds = time.perf_counter() - t0
            for e, address in zip(batch, addresses):
                e.result = Evaluated(address, seconds, total)
            self.batches += 1
            self.batched_steps += len(batch)
        self._cond.notify_all()
