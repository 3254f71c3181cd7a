"""What the planner learned on this machine, kept from one process to the next.

Per target (its cost key: model file, backend, threads), the planner's
acceptance counts of each kind of draft on each route of text (the drafter's
statistics key and the request's language or domain, e.g.
``specialized:python@latin:prose``), by depth, and each costly drafter's
time per drafted and per caught-up token as it measured them (in one-token
target steps), and the cost of each batch size it timed against one token
(the corrected cost curve; the measurement at load may be from another
hour of a machine whose bandwidth moves). A new process's planner starts
from them instead of the drafters' guesses and the curve measured at load,
so a drafter that missed on this kind of text last time is not tried at
length again; a fresh machine starts from the guesses.

One JSON file in ``registry.home()`` beside the cost caches (or where
$EDGESPEC_ACCEPTANCE says)::

    {"format": FORMAT, "version": VERSION,
     "targets": {cost key: {"used": unix time,
                            "acceptance": {key: {"hits": [..], "trials": [..], "used": unix time}},
                            "costs": {drafter: [per_token, catch_up]},
                            "curve": {batch size: cost in one-token steps}}}}

It is small and bounded (MAX_TARGETS targets, MAX_KEYS keys each, DEPTHS
depths: the least recently used go first). Writers merge under a lock file
and replace the file atomically (``files.write_atomic``), so concurrent
processes neither tear it nor lose each other's keys; one that cannot be
read (corrupt, or another program's) is ignored with a one-line notice and
rewritten at the next save.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .costs import MAX_BATCH
from .files import write_atomic
from .models import registry

FILE = "acceptance.json"
ENV = "EDGESPEC_ACCEPTANCE"   # another path for the file (tests give each test its own)
FORMAT = "edgespec-acceptance"
VERSION = 2        # 2: drafter costs timed without their opening and a head's catch-up
MAX_TARGETS = 16   # targets kept (least recently used dropped)
MAX_KEYS = 64      # acceptance keys kept per target
DEPTHS = 16        # draft depths kept per key

log = logging.getLogger("edgespec")


def _counts(value, n: int = DEPTHS) -> list[float] | None:
    """``value`` as a list of at most ``n`` finite non-negative counts (None: it is not one)."""
    if not isinstance(value, list) or not all(isinstance(x, (int, float)) and 0 <= x < 1e9 for x in value):
        return None
    return [float(x) for x in value[:n]]


def _curve(value) -> dict[int, float] | None:
    """``value`` as {batch size: cost}, each size in [2, MAX_BATCH] and each
    cost in [1, size] (None: it is not one)."""
    if not isinstance(value, dict):
        return None
    curve = {}
    for k, v in value.items():
        n = int(k) if isinstance(k, str) and k.isdigit() else 0
        if not (2 <= n <= MAX_BATCH and isinstance(v, (int, float)) and 1.0 <= v <= n):
            return None
        curve[n] = float(v)
    return curve


def _problem(table) -> str | None:
    """Why ``table`` is not an acceptance file of this version (None: it is)."""
    if not isinstance(table, dict) or table.get("format") != FORMAT:
        return "not an edgespec acceptance file"
    if table.get("version") != VERSION:
        return f"version {table.get('version')!r}, not {VERSION}"
    targets = table.get("targets")
    if not isinstance(targets, dict):
        return "no targets"
    for target in targets.values():
        if not (isinstance(target, dict) and isinstance(target.get("acceptance", {}), dict)
                and isinstance(target.get("costs", {}), dict)):
            return "a target entry of the wrong shape"
        for entry in target.get("acceptance", {}).values():
            if not (isinstance(entry, dict) and _counts(entry.get("hits")) is not None
                    and _counts(entry.get("trials")) is not None):
                return "an acceptance entry of the wrong shape"
        for cost in target.get("costs", {}).values():
            if not (isinstance(cost, list) and len(cost) == 2
                    and all(isinstance(x, (int, float)) and x > 0 for x in cost)):
                return "a drafter cost of the wrong shape"
        if _curve(target.get("curve", {})) is None:
            return "a cost curve of the wrong shape"
    return None


def _newest(entries: dict, n: int) -> dict:
    """The ``n`` most recently used of ``entries`` (each a dict with "used")."""
    if len(entries) <= n:
        return entries
    kept = sorted(entries.items(), key=lambda kv: kv[1].get("used", 0), reverse=True)[:n]
    return dict(kept)


class AcceptanceMemory:
    """The learned acceptance and drafter costs of one target, read once
    when made and merged into the file by ``save``."""

    def __init__(self, target_key: str, path: Path | None = None):
        self.key = target_key
        self.path = path or Path(os.environ.get(ENV) or registry.home() / FILE)
        target = self._read(notice=True).get("targets", {}).get(target_key, {})
        self.acceptance: dict[str, dict] = dict(target.get("acceptance", {}))
        self.costs: dict[str, list[float]] = dict(target.get("costs", {}))
        self._curve: dict[int, float] = _curve(target.get("curve", {})) or {}
        self._changed: set[str] = set()       # acceptance keys learned by this process
        self._changed_costs: set[str] = set()  # drafters timed by this process
        self._changed_curve: set[int] = set()  # batch sizes timed by this process
        self._unwritable = False

    def _read(self, notice: bool = False) -> dict:
        """The file's table ({} when missing; with ``notice``, one that cannot
        be read is said once)."""
        try:
            text = self.path.read_text("utf-8")
        except FileNotFoundError:
            return {}
        except OSError as e:
            problem = str(e)
        else:
            try:
                table = json.loads(text)
                problem = _problem(table)
            except ValueError as e:
                problem = f"not JSON ({e})"
            if problem is None:
                return table
        if notice:
            log.warning("ignoring the acceptance cache %s (%s); it is rewritten at the next save", self.path, problem)
        return {}

    def counts(self, key: str) -> tuple[list[float], list[float]] | None:
        """(hits, trials) by depth learned for acceptance ``key``, if any."""
        entry = self.acceptance.get(key)
        return (_counts(entry["hits"]), _counts(entry["trials"])) if entry else None

    def learn(self, key: str, hits: list[float], trials: list[float]) -> None:
        self.acceptance[key] = {"hits": [round(h, 3) for h in hits[:DEPTHS]],
                                "trials": [round(t, 3) for t in trials[:DEPTHS]], "used": int(time.time())}
        self._changed.add(key)

    def cost(self, drafter: str) -> list[float] | None:
        return self.costs.get(drafter)

    def learn_cost(self, drafter: str, per_token: float, catch_up: float) -> None:
        self.costs[drafter] = [round(per_token, 5), round(catch_up, 5)]
        self._changed_costs.add(drafter)

    def curve(self) -> dict[int, float]:
        """Batch size -> cost in one-token steps, as an earlier process timed them."""
        return dict(self._curve)

    def learn_curve(self, ratios: dict[int, float]) -> None:
        """Costs of the batch sizes this process timed (others keep what was learned)."""
        self._curve.update({n: round(r, 4) for n, r in ratios.items()})
        self._changed_curve.update(ratios)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Writers one at a time: an exclusive lock on a file beside the cache."""
        with open(self.path.with_name(f".{self.path.name}.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def save(self) -> None:
        """Merge what this process learned into the file (other targets and
        keys as the file has them now), bounded; an unwritable cache keeps
        it for this process only (said once)."""
        if not self._changed and not self._changed_costs and not self._changed_curve:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._locked():
                table = self._read()
                targets = dict(table.get("targets", {}))
                old = targets.get(self.key, {})
                acceptance = {**old.get("acceptance", {}), **{k: self.acceptance[k] for k in self._changed}}
                targets[self.key] = {"used": int(time.time()),
                                     "acceptance": _newest(acceptance, MAX_KEYS),
                                     "costs": {**old.get("costs", {}),
                                               **{k: self.costs[k] for k in self._changed_costs}},
                                     "curve": {**old.get("curve", {}),
                                               **{str(n): self._curve[n] for n in self._changed_curve}}}
                table = {"format": FORMAT, "version": VERSION, "targets": _newest(targets, MAX_TARGETS)}
                write_atomic(self.path, json.dumps(table, separators=(",", ":")).encode())
            self._changed.clear()
            self._changed_costs.clear()
            self._changed_curve.clear()
        except OSError as e:
            if self._unwritable:
                return
            self._unwritable = True
            log.info("the acceptance cache %s cannot be written (%s): what was learned serves this process only",
                     self.path, e)
