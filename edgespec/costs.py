"""What work costs on this machine: measured once, cached on disk.

* The batch cost curve of a target backend: ``cost[k]``, the time to evaluate
  k tokens in one batch relative to one token (k = 1..MAX_BATCH), per model
  file, backend and thread count (``batch_costs``).
* The cost of a draft model beside its target (``draft_cost``): one drafted
  token, and one context token it must catch up on, in one-token target steps.
* The read bandwidth of a number of threads (``bandwidth``): the memory
  roofline's numerator, and what the default chat model is chosen by; and
  the int8 peak of the native kernels in use (``int8_peak``): the compute
  roofline's.

Both are measured when an Engine loads (never inside a generation), logged
once as a notice on the ``edgespec`` logger, and kept in
``registry.home()``. A value measured while the machine was busy is
provisional and measured again at a later load on a quieter machine
(``cached_measurement``). The planner treats them as priors and corrects
them from its own timed steps (edgespec.planner).
"""
from __future__ import annotations

import json
import logging
import os
import platform
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .files import write_atomic
from .models import registry

MAX_BATCH = 33            # cost curve covers batches of 1..MAX_BATCH tokens
COST_FILE = "batch-costs.json"
DRAFT_COST_FILE = "draft-costs.json"
MEASURED = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 28, 33)  # batch sizes timed; others interpolated
CATCH_UP_BATCH = 32       # batch a draft model's catch-up is timed with (a prompt evaluates in such chunks)
# Opening a draft model or head maps its (repacked) file and reads what its
# checks need: the 468 MB qwen2.5-coder-0.5b opened in 0.11-0.19 s from the
# page cache (AMD EPYC Zen 4), so about 2.5-4 GB/s; this is the cautious end.
OPEN_BYTES_PER_S = 2e9
BUSY = 0.5  # other work, in CPUs' worth per CPU, above which a measurement is provisional
CURVE_ROUNDS = 3      # most times the batches are timed at a load when the curve looks disturbed
NON_MONOTONE = 0.8    # a batch timed below this share of a smaller one's time: the smaller one was disturbed
ROOFLINE_SLACK = 4.0  # a one-token step this many times the memory roofline's time: the machine was busy
SUSPECT_TRIES = 2     # loads that measure a curve still looking disturbed before it is kept as it is

log = logging.getLogger("edgespec")


# Part of every cost key: raised when the engines' speeds change in a way
# that makes curves measured before misleading (2: AVX-512's one-token tiles).
COSTS_VERSION = 2


def cost_key(backend) -> str:
    """What a backend's costs depend on: backend (and ONNX execution
    provider, or the native engine's kernel set), model file, thread count,
    expert-cache settings, the rows of a trimmed output layer, and
    COSTS_VERSION."""
    st = Path(backend.path).stat()
    device, settings = backend.speed_variant()
    return (f"{backend.name}{device}:{Path(backend.path).name}:{st.st_size}:{backend.threads}{settings}"
            f":v{COSTS_VERSION}")


def _filler(backend, n: int) -> list[int]:
    """``n`` ordinary tokens of this backend's vocabulary."""
    tokens = backend.tokenize("The quick brown fox jumps over the lazy dog. " * 16)
    while len(tokens) < n:
        tokens += tokens
    return tokens[:n]


def time_batches(backend, sizes, *, reps: int = 3, prefix: int = 64) -> dict[int, float]:
    """Seconds of one target batch of each of ``sizes`` tokens (every row's
    logits kept, as verification does) after a ``prefix``-token context, the
    fastest of ``reps``. Leaves the KV cache cleared. With an expert cache
    every batch is of other tokens (random ones), so each reads the union of
    its own tokens' experts as verification does, not the experts the
    previous repetition left cached, and the time counted is the compute
    alone, without the reads the batch waited for (the planner weighs those
    as it measures them: edgespec.planner.ExpertMisses)."""
    tokens = _filler(backend, prefix + max(sizes))
    fresh = backend.expert_cache is not None
    rng = random.Random(0)
    backend.clear()
    backend.decode(tokens[:prefix])
    times = {}
    for k in sizes:
        best = float("inf")
        for _ in range(reps):
            batch = [rng.randrange(backend.n_vocab) for _ in range(k)] if fresh else tokens[prefix:prefix + k]
            stall = backend.expert_stats()["stall_ns"] if fresh else 0
            t0 = time.perf_counter()
            backend.decode(batch, logits_from=0)
            t = time.perf_counter() - t0
            if fresh:
                t -= (backend.expert_stats()["stall_ns"] - stall) / 1e9
            best = min(best, t)
            backend.truncate(prefix)
        times[k] = best
    backend.clear()
    return times


class Suspect(list):
    """A measurement that looks taken while other work disturbed it; ``why`` says what."""

    def __init__(self, value, why: str):
        super().__init__(value)
        self.why = why


def disturbed(times: dict[int, float], roofline_s: float | None = None) -> str | None:
    """What says that batch timings (seconds by size) were taken on a busy
    machine (None: nothing): a batch markedly faster than a smaller one
    (physics has a bigger batch read the same weights and compute more), or
    a one-token step far slower than the memory roofline (``roofline_s``:
    the time to read the weights once at this machine's bandwidth)."""
    sizes = sorted(times)
    slowest = 0.0
    for k in sizes:
        if slowest and times[k] < NON_MONOTONE * slowest:
            return f"a batch of {k} tokens took {times[k] / slowest:.2f}x the time of a smaller one"
        slowest = max(slowest, times[k])
    if roofline_s and times[sizes[0]] > ROOFLINE_SLACK * roofline_s:
        return (f"a one-token step took {times[sizes[0]] * 1e3:.1f} ms, {times[sizes[0]] / roofline_s:.1f}x "
                f"the memory roofline's {roofline_s * 1e3:.1f} ms")
    return None


def checked_curve(timer: Callable[[], dict[int, float]], roofline_s: float | None = None) -> list[float]:
    """The batch cost curve from ``timer()`` (seconds by size, MEASURED
    sizes), timed again up to CURVE_ROUNDS times while the fastest time of
    each size so far still looks ``disturbed``: cost[k] = t(k) / t(1) for
    k = 0..MAX_BATCH (cost[0] = 0), interpolated linearly between measured
    sizes; a ``Suspect`` when it still looks disturbed."""
    best: dict[int, float] = {}
    for _ in range(CURVE_ROUNDS):
        for k, t in timer().items():
            best[k] = min(t, best.get(k, float("inf")))
        why = disturbed(best, roofline_s)
        if why is None:
            break
    costs = [0.0] * (MAX_BATCH + 1)
    for lo, hi in zip(MEASURED, MEASURED[1:]):
        for k in range(lo, hi + 1):
            w = (k - lo) / (hi - lo)
            costs[k] = ((1 - w) * best[lo] + w * best[hi]) / best[1]
    return plausible(costs) if why is None else Suspect(plausible(costs), why)


def roofline_s(backend) -> float | None:
    """Seconds a native one-token step takes at least: its weights (the file)
    read once at this machine's read bandwidth, where that is cached already
    (None elsewhere: other backends, an expert cache reading a part of them)."""
    if backend.name != "native" or getattr(backend, "expert_cache", None) is not None:
        return None
    _, bps, _ = _cached(registry.home() / BANDWIDTH_FILE, f"{cpu_name()}:{backend.threads}", "bytes_per_s",
                        lambda v: isinstance(v, (int, float)) and v > 0)
    return Path(backend.path).stat().st_size / bps if bps else None


def measure_batch_costs(backend, *, reps: int = 3, prefix: int = 64) -> list[float]:
    """Time target batches of MEASURED sizes after a short prefix (each the
    fastest of ``reps``, the whole curve again where it looks disturbed:
    ``checked_curve``). Leaves the KV cache cleared."""
    return checked_curve(lambda: time_batches(backend, MEASURED, reps=reps, prefix=prefix), roofline_s(backend))


def plausible(costs: list[float]) -> list[float]:
    """A cost curve within what physics allows: a batch of k tokens costs at
    least one token (the weights are read once) and at most k (k one-token
    steps would do), and a bigger batch never less than a smaller one.
    Timings are noisy, and a curve measured on a busy machine can be wrong
    either way."""
    out = [0.0, 1.0]
    for k in range(2, len(costs)):
        out.append(min(max(costs[k], out[-1], 1.0), float(k)))
    return out


def _other_load() -> float:
    """The 1-minute load average per CPU (0 where the system does not say)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 0.0


# What this process measured and could not save ({(file path, key): entry}):
# used as the file's entries would be, so that a cache that cannot be written
# costs one measurement per process, not one per load; and the files it has
# said so for (once each).
_unsaved: dict[tuple[Path, str], dict] = {}
_said_unsaved: set[Path] = set()


def _cached(path: Path, key: str, field: str, valid: Callable[[Any], bool]) -> tuple[dict, Any, float]:
    """The cache file's table, the value cached under ``key`` (None: missing,
    not ``valid``, or provisional and the machine quieter now) and the load now."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    if not isinstance(table, dict):
        table = {}
    load = _other_load()
    kept = _unsaved.get((path, key))
    if kept is not None and valid(kept.get(field)):
        # What this process measured where the file could not keep it: once
        # per process, however busy it looked (measuring it again at every
        # load of the process would cost a measurement per load).
        return table, kept[field], load
    entry = table.get(key)
    # (an entry without a recorded load was written before loads were: measured again once)
    # (a curve that looked disturbed is measured again at the next loads, SUSPECT_TRIES in all)
    if (isinstance(entry, dict) and valid(entry.get(field))
            and not (entry.get("load", 0.0) > BUSY and load <= BUSY)
            and not (entry.get("suspect") and entry.get("tries", 1) < SUSPECT_TRIES)):
        return table, entry[field], load
    return table, None, load


def cached_measurement(file: str, key: str, field: str, measure: Callable[[], Any],
                       valid: Callable[[Any], bool], *, remeasure: bool = False,
                       notice: str | None = None) -> Any:
    """A measurement of this machine, cached in ``registry.home() / file`` as
    ``{key: {field: value, "load": load}}``; ``measure()`` runs when it is
    missing, not ``valid``, or ``remeasure`` is asked, after ``notice`` (what
    is measured) is logged.

    A value measured while the machine was busy (other work loading it more
    than BUSY) is kept as provisional: it is measured again the next time the
    machine is quiet, so one busy first run does not decide for good (and a
    machine whose load only wavers is not measured at every load). Where the
    file cannot be written (a read-only or full cache) the value is kept in
    this process instead, and that is said once per file."""
    path = registry.home() / file
    table, value, load = _cached(path, key, field, valid)
    if value is not None and not remeasure:
        return value
    unsaved = _cannot_save(path)
    if notice:
        log.info("measuring %s (%s)", notice, f"once for this machine; cached in {path}" if unsaved is None
                 else f"once per process: cannot save to {path}: {unsaved}")
        if unsaved is not None:
            _said_unsaved.add(path)
    value = measure()
    old = table.get(key) if isinstance(table.get(key), dict) else {}
    table[key] = {field: list(value) if isinstance(value, Suspect) else value, "load": round(load, 3)}
    if isinstance(value, Suspect):   # what looked disturbed, and how many loads measured it so
        tries = old.get("tries", 0) + 1 if old.get("suspect") else 1
        table[key].update(suspect=value.why, tries=tries)
        log.warning("%s looks measured on a busy machine (%s): %s", notice or key, value.why,
                    "used for now, and measured again at the next load" if tries < SUSPECT_TRIES
                    else "kept, corrected by the planner's own timings")
    try:
        write_atomic(path, json.dumps(table, indent=1).encode())
        _unsaved.pop((path, key), None)
    except OSError as e:
        _unsaved[(path, key)] = table[key]
        if path not in _said_unsaved:
            _said_unsaved.add(path)
            log.info("cannot save this machine's measurements to %s (%s): each process measures them "
                     "again", path, e.strerror or e)
    return value


def _cannot_save(path: Path) -> str | None:
    """Why a file cannot be written at ``path`` (a read-only or full cache,
    its folder not made), else None; the folder is made on the way."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=path.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return str(e.strerror or e)
    return None


def batch_costs(backend, *, remeasure: bool = False) -> list[float]:
    """The cached cost curve for this backend, measuring it when missing
    (provisional when measured on a busy machine: see cached_measurement)."""
    costs = cached_measurement(COST_FILE, cost_key(backend), "costs", lambda: measure_batch_costs(backend),
                               lambda c: isinstance(c, list) and len(c) == MAX_BATCH + 1
                               and all(isinstance(x, (int, float)) for x in c), remeasure=remeasure,
                               notice=f"the batch cost curve of {Path(backend.path).name} "
                                      f"({backend.name}, {backend.threads} threads)")
    return plausible(costs)


@dataclass(frozen=True)
class DraftCost:
    """What a draft model's work costs, in one-token target steps."""

    per_token: float   # drafting one token: one of its one-token steps
    catch_up: float    # evaluating one context token it has not seen (in a batch, as a prompt is)

    def to_list(self) -> list[float]:
        return [self.per_token, self.catch_up]


def measure_draft_cost(target, draft, *, reps: int = 5, prefix: int = 64) -> DraftCost:
    """Time a draft backend's one-token step and CATCH_UP_BATCH-token batch
    against the target's one-token step, interleaved so that the machine's
    drift touches both alike; the fastest of ``reps`` each. Leaves both KV
    caches cleared."""
    t_tokens = _filler(target, prefix + CATCH_UP_BATCH)
    # The draft's tokens need not be text (timing does not depend on them), so
    # its tokenizer, which a draft model drafting in target ids never loads, stays unused.
    d_tokens = [t % draft.n_vocab for t in t_tokens]
    target.clear()
    draft.clear()
    target.decode(t_tokens[:prefix])
    draft.decode(d_tokens[:prefix])
    best = {"target": float("inf"), "draft": float("inf"), "batch": float("inf")}
    runs = (("target", target, t_tokens[prefix:prefix + 1]), ("draft", draft, d_tokens[prefix:prefix + 1]),
            ("batch", draft, d_tokens[prefix:prefix + CATCH_UP_BATCH]))
    for _ in range(reps):
        for name, backend, batch in runs:
            t0 = time.perf_counter()
            backend.decode(batch)
            best[name] = min(best[name], time.perf_counter() - t0)
            backend.truncate(prefix)
    target.clear()
    draft.clear()
    return DraftCost(best["draft"] / best["target"], best["batch"] / CATCH_UP_BATCH / best["target"])


def open_seconds(path) -> float:
    """Seconds opening the draft model or head at ``path`` is expected to take
    (by its size: OPEN_BYTES_PER_S)."""
    try:
        return Path(path).stat().st_size / OPEN_BYTES_PER_S
    except OSError:
        return 0.0


def draft_cost_key(target, backend: str, path, rows: int = 0, ep: str | None = None) -> str:
    """What a draft model's cost beside ``target`` (open) depends on, known
    without opening it: the target's cost key (thread count and kernel set,
    which the draft model shares), the draft's backend (and ONNX execution
    provider), its file and the rows of a trimmed output layer."""
    path = Path(path)
    size = path.stat().st_size if path.is_file() else 0
    return (f"{cost_key(target)}|{backend}{f'@{ep}' if ep else ''}:{path.name}:{size}"
            f"{f':rows-{rows}' if rows else ''}")


def _valid_draft_cost(v) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) and x > 0 for x in v)


def draft_cost(target, draft, *, remeasure: bool = False) -> DraftCost:
    """The cached cost of draft backend ``draft`` beside ``target`` (open),
    measured when missing: the key reads only ``draft``'s name, path and,
    where it has them, ``output_rows`` and ``ep``, so a draft model known
    to the cache need not be open."""
    key = draft_cost_key(target, draft.name, draft.path, getattr(draft, "output_rows", 0), getattr(draft, "ep", None))
    value = cached_measurement(
        DRAFT_COST_FILE, key, "cost", lambda: measure_draft_cost(target, draft).to_list(), _valid_draft_cost,
        remeasure=remeasure,
        notice=f"the cost of draft model {Path(draft.path).name} beside {Path(target.path).name}")
    return DraftCost(*value)


def available_memory() -> int | None:
    """Bytes of memory the kernel says a new allocation can take, where it says."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Hardware", "cpu model"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


BANDWIDTH_FILE = "bandwidth.json"


def measure_bandwidth(threads: int, *, n_bytes: int = 512 << 20, passes: int = 5) -> float:
    """Read bandwidth in bytes/s with ``threads`` threads streaming a buffer of
    ``n_bytes`` (far larger than any last-level cache), the fastest of
    ``passes`` (the C core's es_measure_bandwidth)."""
    from .capi import check, ffi, lib

    params = ffi.new("es_bandwidth_params *", lib.es_bandwidth_default_params())
    params.n_bytes, params.n_threads, params.n_passes = n_bytes, threads, passes
    out = ffi.new("double *")
    check(lib.es_measure_bandwidth(params, out), "es_measure_bandwidth")
    return out[0]


def bandwidth(threads: int, *, remeasure: bool = False) -> float:
    """This machine's read bandwidth with ``threads`` threads, in bytes/s,
    cached like the cost curves (see cached_measurement)."""
    return cached_measurement(BANDWIDTH_FILE, f"{cpu_name()}:{threads}", "bytes_per_s",
                              lambda: measure_bandwidth(threads),
                              lambda v: isinstance(v, (int, float)) and v > 0, remeasure=remeasure,
                              notice=f"the read bandwidth of {threads} threads")


INT8_PEAK_FILE = "int8-peak.json"


def measure_int8_peak(threads: int) -> float:
    """int8 multiply-accumulates per second with ``threads`` threads, each in
    the kernel set in use's tightest loop of its integer step (the C core's
    es_measure_int8_peak), the fastest of five passes."""
    from .capi import check, ffi, lib

    params = ffi.new("es_int8_peak_params *", lib.es_int8_peak_default_params())
    params.n_threads = threads
    out = ffi.new("double *")
    check(lib.es_measure_int8_peak(params, out), "es_measure_int8_peak")
    return out[0]


def int8_peak(threads: int, *, remeasure: bool = False) -> tuple[float, str]:
    """(int8 MACs/s, kernel set) of this machine with ``threads`` threads and
    the kernel set in use in this process (es_kernels_select; the native
    backend selects EDGESPEC_KERNELS'): cached as ``bandwidth`` is."""
    from .capi import kernel_set

    kernels = kernel_set()
    peak = cached_measurement(INT8_PEAK_FILE, f"{cpu_name()}:{threads}:{kernels}", "macs_per_s",
                              lambda: measure_int8_peak(threads),
                              lambda v: isinstance(v, (int, float)) and v > 0, remeasure=remeasure,
                              notice=f"the int8 peak of {threads} threads ({kernels} kernels)")
    return peak, kernels
