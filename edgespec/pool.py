"""Several models behind one server: an Engine per model name, loaded on first
use and unloaded least recently used first under a memory budget.

    pool = EnginePool(["smollm2-135m", "qwen2.5-coder-0.5b"], EngineConfig(slots=3, threads=2))
    with pool.engine("qwen2.5-coder-0.5b") as engine:    # loads it, or waits for its load
        engine.generate("def fib(n):")
    pool.models()       # [{"name", "loaded", "bytes"}, ...]: what the pool serves
    pool.close()

A model's cost is its file (the weights are mapped) plus the KV caches of
all its slots and its embeddings context, from the GGUF's hyperparameters: an
upper bound, since a slot's context is made when first used. Before a load,
idle models (no request holding them) are unloaded, least recently used
first, until the new one fits; when models in use hold the budget, or the
model alone is over it, the load is refused with PoolFullError (a server
answers 503) rather than waiting. A name the pool does not serve is a built-in model the pool adds (and
pulls on first use) when ``pull`` is on; otherwise ModelNotFoundError names
the available ones.

A model left idle unloads ``keep_alive`` seconds after its last request
ended (None: never; a request may ask for its own, as Ollama's keep_alive:
0 unloads it as soon as it is idle, a negative value keeps it loaded).
"""
from __future__ import annotations

import math
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from .backends import default_backend
from . import onnx  # noqa: F401  (extends resolve_model to the onnx backend)
from .models import resolve_model
from .backends.base import available_memory, kv_cache_bytes
from .config import AUTO_PARALLEL, DEFAULT_CTX, EngineConfig
from .engine import Engine
from .errors import EdgespecError, EngineBusyError, InvalidArgumentError, ModelNotFoundError
from .models import registry
from .models.gguf import GGUFFile

BUDGET_SHARE = 0.8   # the default budget: this share of the memory available when the pool starts
_DURATION = re.compile(r"(-)?((?:\d+(?:\.\d+)?(?:h|ms|m|s))+|\d+(?:\.\d+)?)")
_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "": 1.0}


def keep_alive_seconds(value) -> float:
    """A keep_alive as Ollama takes it: seconds (a number or its text) or a Go
    duration ("5m", "1h30m", "-1"); negative: forever. InvalidArgumentError
    for anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    match = _DURATION.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise InvalidArgumentError(f'keep_alive must be seconds or a duration such as "5m" or "-1", '
                                   f"got {str(value)[:40]!r}")
    total = sum(float(n) * _UNITS[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s)?", match.group(2)))
    return -total if match.group(1) else total


class PoolFullError(EngineBusyError):
    """Loading a model would pass the memory budget, and the loaded models are in use."""


def model_name(ref: str) -> str:
    """The name a model is served under: the built-in name, or a file's stem."""
    return registry.ref_stem(ref)


def cached_models() -> list[str]:
    """The built-in models in the cache, intact (``--all-cached``)."""
    return [m["name"] for m in registry.list_models() if m["cached"]]


def default_budget() -> int | None:
    """BUDGET_SHARE of the memory available now; None where the system does not say."""
    have = available_memory()
    return int(have * BUDGET_SHARE) if have is not None else None


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def model_bytes(path: Path, n_ctx: int | None, contexts: int,
                cache_types: tuple[str, str] = ("f16", "f16")) -> int:
    """What a model at ``path`` costs loaded: its file(s) plus ``contexts`` KV
    caches of ``n_ctx`` tokens (the engine's default when None) of
    ``cache_types`` (key type, value type)."""
    if path.is_dir():   # an ONNX export
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    size = path.stat().st_size
    with GGUFFile(path) as f:
        arch = f.get("general.architecture")
        train = f.get(f"{arch}.context_length") or 0
        ctx = n_ctx or (min(DEFAULT_CTX, train) if train else DEFAULT_CTX)
        kv = kv_cache_bytes(f.get, ctx, cache_types)
    return size + contexts * (kv or 0)


@dataclass
class _Entry:
    name: str
    ref: str
    engine: Engine | None = None
    bytes: int = 0             # the estimate it was admitted with (0 while not loaded)
    leases: int = 0            # requests holding it
    last_used: int = 0         # the pool's clock at its latest lease
    expires: float | None = None   # time.time() it unloads at once idle (None: never)
    keep_alive: float | None = None   # what the latest request asked for (None: the pool's)
    loading: threading.Lock = field(default_factory=threading.Lock)


class EnginePool:
    """Engines by model name (see the module docstring). ``refs``: model
    references (built-in names, paths, ``hf:``), served under ``model_name``
    of each, the first as the default. ``max_loaded_bytes``: the memory
    budget (None: ``default_budget()``; 0: none). A ``(name, ref)`` pair in
    ``refs`` serves ``ref`` under ``name``. ``templates``: a served name's
    Jinja chat template instead of its model's own. ``config`` (with
    ``options`` as keywords over it) is every Engine's (its model aside)."""

    def __init__(self, refs: Sequence[str], config: EngineConfig | None = None, *,
                 max_loaded_bytes: int | None = None, pull: bool = True, keep_alive: float | None = None,
                 templates: dict[str, str] | None = None, opener: Callable[..., Engine] = Engine, **options):
        if not refs:
            raise InvalidArgumentError("the pool needs at least one model")
        if max_loaded_bytes is not None and (isinstance(max_loaded_bytes, bool) or max_loaded_bytes < 0):
            raise InvalidArgumentError(f"max_loaded_bytes must be >= 0, got {max_loaded_bytes!r}")
        self._entries: dict[str, _Entry] = {}
        for item in refs:
            name, ref = item if isinstance(item, tuple) else (model_name(str(item)), str(item))
            if name in self._entries:
                raise InvalidArgumentError(f"two models would be served as '{name}': {self._entries[name].ref} "
                                           f"and {ref}")
            self._entries[name] = _Entry(name, str(ref))
        self.default = next(iter(self._entries))
        unknown = sorted(set(templates or {}) - set(self._entries))
        if unknown:
            raise InvalidArgumentError(f"a chat template names {unknown[0]!r}, which is not served "
                                       f"(served: {', '.join(self._entries)})")
        self._templates = dict(templates or {})   # name -> the Jinja chat template its engine uses
        self.budget = default_budget() if max_loaded_bytes is None else max_loaded_bytes or None
        self.pull = pull
        self._opener = opener
        self.config = config.but(**options) if config is not None and options else config or EngineConfig.of(**options)
        # contexts per model: a slot each (at least one per generation running
        # at once; parallel None chooses at most AUTO_PARALLEL), and the embeddings context
        self._contexts = max(self.config.slots, self.config.parallel or AUTO_PARALLEL) + 1
        self._cache_types = (self.config.cache_type_k, self.config.cache_type_v)   # their key and value types
        self.keep_alive = None if keep_alive is None or keep_alive < 0 else float(keep_alive)
        self._lock = threading.Lock()
        self._clock = 0
        self._closed = False
        self._expiry = threading.Condition(self._lock)   # wakes the reaper when an expiry changes
        self._reaper: threading.Thread | None = None

    # -- names ----------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def models(self) -> list[dict]:
        """What the pool serves: name, reference, whether loaded, the bytes it was admitted with."""
        with self._lock:
            return [{"name": e.name, "ref": e.ref, "loaded": e.engine is not None, "bytes": e.bytes}
                    for e in self._entries.values()]

    def add(self, name: str) -> None:
        """Serve ``name`` too if it is a local model's name (registry.add_local)
        or a built-in model and pulling is on (it is pulled on first use);
        else ModelNotFoundError naming the served ones."""
        self._entry(name)

    def forget(self, name: str) -> None:
        """Stop serving ``name`` (unloaded first); EngineBusyError while a
        request holds it."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                return
            if entry.leases:
                raise EngineBusyError(f"model '{name}' is serving a request; try again when it ends")
            del self._entries[name]
            engine, entry.engine = entry.engine, None
        if engine is not None:
            engine.close()

    def loaded(self, name: str) -> bool:
        with self._lock:
            entry = self._entries.get(name)
            return entry is not None and entry.engine is not None

    def local_path(self, name: str) -> Path | None:
        """The model file of ``name`` if it is on this machine (nothing is
        pulled or loaded); None otherwise."""
        entry = self._entry(name)
        if entry.engine is not None:
            return Path(entry.engine.model_path)
        try:
            return registry.resolve(entry.ref, pull_missing=False)
        except EdgespecError:
            return None

    def _entry(self, name: str | None) -> _Entry:
        """The entry for ``name`` (None: the default), adding a pullable built-in model."""
        name = self.default if name is None else name
        with self._lock:
            if self._closed:
                raise EngineBusyError("the pool is closed")
            entry = self._entries.get(name)
            if entry is None and name in registry.local_models():
                entry = self._entries[name] = _Entry(name, name)
            if entry is None and self.pull and name in registry.builtin_models():
                entry = self._entries[name] = _Entry(name, name)
            if entry is None:
                raise ModelNotFoundError(f"model '{name}' is not served here (available: "
                                         f"{', '.join(self._entries)})")
            return entry

    # -- leases -----------------------------------------------------------------

    @contextmanager
    def engine(self, name: str | None = None, keep_alive: float | None = None, *,
               use: bool = True) -> Iterator[Engine]:
        """Hold the Engine of ``name`` (loading it first if needed) for a
        request; ``keep_alive``: seconds it stays loaded once idle (None: the
        pool's; < 0: forever; 0: unloaded as soon as it is idle). ``use``
        False: a look at the model (its metadata), which does not put its
        expiry off."""
        entry = self._lease(name)
        try:
            yield entry.engine
        finally:
            self._release(entry, keep_alive, use)

    def _release(self, entry: _Entry, keep_alive: float | None, use: bool = True) -> None:
        with self._lock:
            entry.leases -= 1
            if keep_alive is not None:
                entry.keep_alive = keep_alive
            ka = self.keep_alive if entry.keep_alive is None else entry.keep_alive
            if use or entry.expires is None:   # a look leaves a running clock alone
                entry.expires = None if ka is None or ka < 0 else time.time() + ka
            if entry.expires is not None:
                self._start_reaper()
                self._expiry.notify_all()
        self._unload_expired()

    def expire(self, name: str, keep_alive: float) -> bool:
        """Set ``name``'s keep_alive now, as a request that loads nothing does
        (Ollama's ``{"model": ..., "keep_alive": 0}`` unloads); returns whether
        it is unloaded now."""
        entry = self._entry(name)
        with self._lock:
            entry.leases += 1
        self._release(entry, keep_alive)
        return not self.loaded(name)

    def expires_at(self, name: str) -> float | None:
        """When ``name`` unloads if it stays idle (time.time(); None: never)."""
        with self._lock:
            entry = self._entries.get(name)
            return entry.expires if entry is not None else None

    def _unload_expired(self) -> None:
        """Unload every idle model whose time has come."""
        now = time.time()
        with self._lock:
            due = [e for e in self._entries.values()
                   if e.engine is not None and not e.leases and e.expires is not None and e.expires <= now]
            engines = []
            for e in due:
                engines.append(e.engine)
                e.engine, e.bytes, e.expires, e.keep_alive = None, 0, None, None
        for engine in engines:
            engine.close()

    def _start_reaper(self) -> None:
        """Under the lock: the thread that unloads idle models when they expire."""
        if self._reaper is None and not self._closed:
            self._reaper = threading.Thread(target=self._reap, name="edgespec-pool-expiry", daemon=True)
            self._reaper.start()

    def _reap(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                times = [e.expires for e in self._entries.values()
                         if e.engine is not None and not e.leases and e.expires is not None]
                wait = min(times) - time.time() if times else None
                if wait is None or wait > 0:
                    self._expiry.wait(wait)
                    continue
            self._unload_expired()

    def context_fits(self, name: str, n_ctx: int) -> None:
        """Refuse (PoolFullError naming the sizes) a request for a context of
        ``n_ctx`` tokens that the memory budget cannot hold: the model loaded
        with one of its slots at that size instead of the default."""
        entry = self._entry(name)
        if self.budget is None or entry.engine is None:
            return
        path = Path(entry.engine.model_path)
        if path.is_dir():
            return
        types = self._cache_types
        extra = model_bytes(path, n_ctx, 1, types) - model_bytes(path, self.config.n_ctx, 1, types)
        with self._lock:
            used = sum(e.bytes for e in self._entries.values())
        if extra > 0 and used + extra > self.budget:
            raise PoolFullError(f"a context of {n_ctx} tokens needs {_size(extra)} more for its KV cache; "
                                f"the loaded models hold {_size(used)} of the memory budget of "
                                f"{_size(self.budget)} (--max-loaded-bytes)")

    def _lease(self, name: str | None) -> _Entry:
        entry = self._entry(name)
        with entry.loading:   # one load per model; others asking for it wait here
            with self._lock:
                if entry.engine is not None:
                    return self._take(entry)
            backend = self.config.backend or default_backend(entry.ref, self.config.gpu_layers)
            path = resolve_model(backend, entry.ref)   # pulls a built-in model on first use
            need = model_bytes(path, self.config.n_ctx, self._contexts, self._cache_types)
            victims = self._make_room(entry, need)
            for engine in victims:
                engine.close()
            try:
                engine = self._opener(str(path), config=self.config)
                # serve --template, else what a Modelfile's TEMPLATE set for a local name
                template = self._templates.get(entry.name) or registry.local_settings(entry.name).get("chat_template")
                if template:
                    engine.chat_template = template
            except BaseException:
                with self._lock:
                    entry.bytes = 0   # the reserved room
                raise
            with self._lock:
                if self._closed:
                    engine.close()
                    raise EngineBusyError("the pool is closed")
                # A model loaded afresh: no expiry or keep_alive left from before it
                # was unloaded (an unload request's 0 would unload it again at once).
                entry.engine, entry.bytes, entry.expires, entry.keep_alive = engine, need, None, None
                return self._take(entry)

    def _take(self, entry: _Entry) -> _Entry:
        """Under the lock: one more lease, and the LRU clock."""
        self._clock += 1
        entry.leases += 1
        entry.last_used = self._clock
        return entry

    def _make_room(self, entry: _Entry, need: int) -> list[Engine]:
        """Unload idle models, least recently used first, until ``need`` more
        bytes fit the budget; returns their engines, to be closed. The room is
        reserved for ``entry`` at once (its bytes set), so concurrent loads of
        other models count it."""
        with self._lock:
            if self.budget is None:
                return []
            if need > self.budget:
                raise PoolFullError(f"model '{entry.name}' needs about {_size(need)} loaded, "
                                    f"more than the whole budget of {_size(self.budget)} "
                                    "(--max-loaded-bytes)")
            used = sum(e.bytes for e in self._entries.values())
            idle = sorted((e for e in self._entries.values() if e.engine is not None and e.leases == 0),
                          key=lambda e: e.last_used)
            victims = []
            while used + need > self.budget and idle:
                e = idle.pop(0)
                victims.append(e)
                used -= e.bytes
            if used + need > self.budget:
                busy = [e.name for e in self._entries.values() if e.bytes and e not in victims]
                raise PoolFullError(f"loading model '{entry.name}' (about {_size(need)}) would pass the "
                                    f"memory budget of {_size(self.budget)} while {', '.join(busy)} "
                                    "serve requests; try again when they finish")
            engines = []
            for e in victims:
                engines.append(e.engine)
                e.engine, e.bytes = None, 0
            entry.bytes = need
            return engines

    # -- lifetime -----------------------------------------------------------------

    def unload(self, name: str) -> bool:
        """Unload ``name`` now if loaded and idle; returns whether it was unloaded."""
        entry = self._entry(name)
        with self._lock:
            if entry.engine is None or entry.leases:
                return False
            engine, entry.engine, entry.bytes = entry.engine, None, 0
        engine.close()
        return True

    def close(self) -> None:
        """Close every engine (running generations are cancelled and waited for)."""
        with self._lock:
            self._closed = True
            self._expiry.notify_all()
            engines = [e.engine for e in self._entries.values() if e.engine is not None]
            for e in self._entries.values():
                e.engine, e.bytes = None, 0
        for engine in engines:
            engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
