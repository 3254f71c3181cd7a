"""The public engine: load a model once, generate many times.

    with Engine("smollm2-135m", threads=2) as engine:
        result = engine.generate("Once upon a time", max_tokens=32)
        for piece in engine.stream("Tell me a story", max_tokens=64):
            print(piece, end="", flush=True)

An Engine may be shared between threads: generations run one at a time, in
the order they ask (``blocking=False`` raises EngineBusyError instead of
waiting), and ``cancel()`` from any thread stops the running one within one
target step or one chunk of prompt evaluation. With ``slots=N`` it keeps N
KV caches (one context each over the one loaded model): each generation runs
in the slot holding the longest prefix of its prompt (else an empty or the
least recently used one), so N conversations keep their prefixes. With
``parallel=N`` (native backend) up to N generations run at once, each in a
slot of its own, their steps evaluated in one batch (edgespec.batching).

    vectors = engine.embed(["first text", "second text"])   # (2, n_embd), unit length
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from . import drafters as drafting
from .backends import GroupStep, Interrupted, default_backend, open_backend
from .backends.base import kv_cache_bytes
from .batching import Batcher, evaluate
from .chat import template as chat_templates
from .chat import tools as chat_tools
from .config import AUTO_PARALLEL, EngineConfig
from .costs import available_memory, batch_costs
from .drafters import Draft, Drafter, DrafterConfig, Verified, routed
from .drafters.router import open_router
from .errors import (ContextOverflowError, EdgespecError, EngineBusyError, EngineClosedError,
                     GenerationAbandonedError, InvalidArgumentError, UnsupportedModelError)
from .grammar import Constraint, Grammar, tokenizer_for
from .models import registry
from .onnx import resolve_model
from .planner import ExpertMisses, Planner
from .results import GenerationStats, Result, SpecStats, Step
from .sampling import Sampler, SamplingParams, TokenLogprob, token_logprobs
from .files import write_atomic
from .text import TextStream, utf8_text

TREE_SEQS = 8          # KV sequences for draft-tree branches (leaves per tree)
# GGUF <arch>.pooling_type (llama.cpp's enum) -> how embed() pools token states;
# absent or 0 (none): the mean.
POOLING = {0: "mean", 1: "mean", 2: "cls", 3: "last"}
SLOT_MAGIC = b"edgespec-slot 1\n"   # a saved slot's first line; a JSON header line, then the state
_ALONE = contextlib.nullcontext()   # a lone generation's backend calls take no lock










@dataclass
class _Request:
    """One generation's validated inputs."""

    prompt_tokens: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop: list[str]
    drafter: str
    grammar: Grammar | None = None
    tools: list[dict] | None = None   # tool calls are parsed from the reply
    tool_style: str = ""              # chat_tools.style_of the template
    logprobs: int | None = None       # None: off; k: each token's logprob and the top k
    text: str | None = None           # what the request is about, for routing (None: its tokens say)
    n_ctx: int | None = None          # the context it runs in (None: the backend's)


@dataclass
class _Outcome:
    """What a generation's step generator hands back to its Generation: kept
    apart so that the generator never holds the Generation, which is then
    freed (and gives the engine back) the moment its consumer drops it, not
    at the next cyclic collection."""

    cancel: threading.Event = field(default_factory=threading.Event)
    logprobs: list[TokenLogprob] = field(default_factory=list)   # grows with the text, when asked for
    result: Result | None = None


@dataclass
class _Lane:
    """One of an engine's ``parallel`` places for a running generation: its
    drafters and planner (drafters keep a generation's state), and the slot
    its generation runs in. Lane 0's are the engine's ``_drafters`` and
    ``_planner`` (a lone generation's, as with parallel 1)."""

    drafters: dict[str, Drafter] = field(default_factory=dict)
    planner: Planner | None = None
    slot: int = 0


def auto_parallel(costs: list[float], kv_bytes: int | None, memory: int | None) -> int:
    """``parallel=None``'s choice: the most generations, up to AUTO_PARALLEL,
    whose one-token steps batched cost each at most half a lone step more
    (``costs[n]``: a batch of n tokens, a lone token 1.0), and whose KV caches
    (``kv_bytes`` each) fit in half of ``memory``."""
    n = 1
    while (n < AUTO_PARALLEL and n + 1 < len(costs) and costs[n + 1] <= 1.0 + 0.5 * n
           and (kv_bytes is None or memory is None or (n + 1) * kv_bytes <= memory // 2)):
        n += 1
    return n


class Generation(Iterator[str]):
    """A generation in progress: iterating yields its text pieces (never a
    split UTF-8 character); ``result`` holds the whole Result once it ends.

    It takes the engine when the first piece is asked for and gives it back
    when it ends: exhausted, ``close()``d, cancelled (from any thread, also
    while it waits between pieces), failed or dropped. One its engine ended
    for it (its thread started another generation, the engine was closed)
    raises GenerationAbandonedError or EngineClosedError when resumed.
    """

    def __init__(self, engine: "Engine", request: _Request, blocking: bool):
        self._engine = engine
        self._request = request
        self._blocking = blocking
        self._pieces: Iterator[str] | None = None
        self._outcome = _Outcome()
        # Held while a piece is made and by whoever ends the generation, so
        # that another thread ends it only between pieces.
        self._lock = threading.Lock()
        self._done = False
        self._ended_by: EdgespecError | None = None   # raised on resuming one the engine ended
        self.owner: threading.Thread | None = None    # the thread that started it
        self.lane = 0                                 # the engine's lane it runs in (_take)

    @property
    def result(self) -> Result | None:
        return self._outcome.result

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return self._outcome.logprobs

    @property
    def cancelled(self) -> bool:
        return self._outcome.cancel.is_set()

    def cancel(self) -> None:
        """Stop within one target step (or one chunk of prompt evaluation);
        one waiting between pieces ends now, in the calling thread."""
        self._outcome.cancel.set()
        self._end_if_idle()

    def __next__(self) -> str:
        with self._lock:
            if self._ended_by is not None:
                raise self._ended_by
            if self._done:
                raise StopIteration
            if self._pieces is None:
                self._engine._take(self, self._blocking)
                self._pieces = self._engine._pieces(self._request, self._outcome, self.lane)
            try:
                piece = next(self._pieces)
            except BaseException:
                self._finish()
                raise
        if self.cancelled:   # cancel() may have found it making this piece
            self._end_if_idle()
        return piece

    def close(self) -> None:
        """End the generation now (one making a piece in another thread is
        cancelled and waited for); ``result`` then holds what was generated."""
        if not self._lock.acquire(blocking=False):
            self._outcome.cancel.set()
            self._lock.acquire()
        try:
            self._end()
        finally:
            self._lock.release()

    def _end_if_idle(self, error: EdgespecError | None = None) -> None:
        """End a started generation unless a piece is being made (that thread
        ends it then); ``error``: what resuming it raises."""
        if self._pieces is not None and self._lock.acquire(blocking=False):
            try:
                if error is not None and not self._done:
                    self._ended_by = error
                self._end()
            finally:
                self._lock.release()

    def _end(self) -> None:
        """Under ``_lock``."""
        if self._pieces is not None and not self._done:
            try:
                self._pieces.close()
            finally:
                self._finish()
        self._done = True

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._engine._give_back(self)

    def __del__(self):
        self.close()


def _whole(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(f"{name} must be a whole number >= {minimum}, got {value!r}"[:200])


def _is_token(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _routing_text(prompt, messages, suffix) -> str | None:
    """A request's own text, which a router reads: a chat's messages but the
    system's (its template's text and a system prompt say little of the
    reply's language), a prompt with its suffix; None for token ids."""
    if messages is not None:   # validated: each content is a string, or absent beside tool calls
        return "\n".join(m["content"] for m in messages
                         if m.get("role") != "system" and isinstance(m.get("content"), str)) or None
    if isinstance(prompt, str):
        return prompt if suffix is None else prompt + "\n" + suffix
    return None


class Engine:
    """A loaded model and its context.

    Its options are an ``EngineConfig`` (edgespec.config: each option's range
    and meaning), given whole (``config=``) or as keywords, which are checked
    before anything loads (InvalidArgumentError naming the option; one a
    backend does not take, such as ``gpu_layers`` on the native engine, too).
    ``model``: a built-in name (``edgespec models list``), a GGUF path or
    ``hf:owner/repo/file.gguf`` (with ``backend="onnx"`` also a folder from
    ``edgespec export-onnx``; a GGUF is exported on first use). ``backend``
    None chooses one per model (edgespec.backends.default_backend: native
    where it is at least llama.cpp's speed, else llama; a file of a variant
    the native engine does not read falls back to llama). With a ``drafter``
    other than none the machine's costs are measured now, once per machine
    (edgespec.costs), never inside a generation. ``parallel=N``: up to N
    generations at once (see the module docstring; None chooses N from the
    cost curve, ``auto_parallel``); a backend that cannot group runs one.
    """

    def __init__(self, model: str | os.PathLike | None = None, *, config: EngineConfig | None = None,
                 **options):
        if config is None:
            config = EngineConfig.of(model=model, **options)
        elif model is not None or options:
            config = config.but(**options, **({"model": model} if model is not None else {}))
        self.config = c = config
        self.drafter = c.drafter
        self.draft_max = c.draft_max
        self.model_ref = c.model if c.model is not None else registry.default_model()
        open_router(c.router)   # fail early on an unknown one
        specialized = routed.set_files(registry.model_name(self.model_ref), c.drafter_dir)
        backend = c.backend or ("native" if c.expert_cache_mb is not None else None)  # the cache is native's
        auto = backend is None
        if auto:
            backend = default_backend(self.model_ref, c.gpu_layers)
        if c.ep is not None and "onnx" not in (backend, c.draft_backend):
            raise InvalidArgumentError("an execution provider (ep) applies to the onnx backend: "
                                       "use it with backend onnx or draft_backend onnx")
        # Each running generation needs a slot of its own; slots are made on
        # first use, so those parallel=None may not use cost nothing.
        slots = max(c.slots, c.parallel or AUTO_PARALLEL)
        options = dict(n_ctx=c.n_ctx, n_batch=c.n_batch, threads=c.threads, gpu_layers=c.gpu_layers,
                       n_seq=TREE_SEQS, slots=slots, ctx_extend=c.ctx_extend, experts=c.expert_cache,
                       verbose=c.verbose)
        self.model_path: Path = resolve_model(backend, self.model_ref)
        try:
            self.backend = open_backend(backend, self.model_path, **options,
                                        ep=c.ep if backend == "onnx" else None)
        except UnsupportedModelError:
            if not (auto and backend == "native"):
                raise
            # A variant of a native architecture the engine does not read (an extra tensor).
            self.model_path = resolve_model("llama", self.model_ref)
            self.backend = open_backend("llama", self.model_path, **options)
        self._drafter_config = DrafterConfig(n_vocab=self.backend.n_vocab, target=self.backend, options=c,
                                             paired_draft=registry.paired_draft(self.model_ref),
                                             specialized=tuple(specialized), n_ctx=self.backend.n_ctx)
        self._lanes = [_Lane()]
        self._costs: list[float] | None = None
        self.last_result: Result | None = None
        self._chat_template: str | None = None
        self._capabilities: tuple[str, ...] | None = None
        self._llg_tokenizer = None  # the grammar engine's view of the vocabulary, built on first use
        try:
            if self.drafter != "none":
                self._open_drafters(self.drafter)  # fail early on a bad draft model or cache
                # The machine is measured now, if it must be, never inside a generation.
                self._planner = self._new_planner()
            self.parallel = self._parallel(c.parallel)
        except BaseException:
            self._free()
            raise
        # Sharing between threads: each running generation holds one of
        # _busy's permits (a short exclusive call all of them, taken under
        # _gather); _state guards the fields below it and lets close() wait
        # for readers. With parallel > 1 every backend call of a generation
        # is made under _backend, its slot selected, and steps meet in _batcher.
        self._busy = threading.BoundedSemaphore(self.parallel)
        self._gather = threading.Lock()
        self._state = threading.Condition()
        self._running: dict[int, weakref.ref[Generation]] = {}   # lane -> its generation
        self._free_lanes = list(range(self.parallel))
        self._readers = 0       # calls reading the model outside a generation (tokenizing)
        self._closed = False
        self._backend = threading.Condition()
        self._batcher = Batcher(self.backend, self._backend) if self.parallel > 1 else None
        self._lanes += [_Lane() for _ in range(self.parallel - 1)]

    def _parallel(self, asked: int | None) -> int:
        """How many generations run at once: ``asked`` (None: ``auto_parallel``
        on this machine's cost curve), 1 where the backend cannot group."""
        if not self.backend.groups:
            return 1
        if asked is not None:
            return asked
        kv = kv_cache_bytes(self.backend.metadata, self.backend.n_ctx)
        return auto_parallel(self._batch_costs(), kv, available_memory())

    def _open_drafters(self, name: str, lane: int = 0) -> list[Drafter]:
        """Lane ``lane``'s drafters of ``name`` (opened on first use)."""
        names = {"none": [], "auto": drafting.auto_members(self._drafter_config)}.get(name, [name])
        drafters = self._lanes[lane].drafters
        for n in names:
            if n not in drafters:
                drafters[n] = drafting.open_drafter(n, self._drafter_config)
        return [drafters[n] for n in names]

    def _lane_planner(self, lane: int) -> Planner:
        """Lane ``lane``'s planner, made on first use."""
        if self._lanes[lane].planner is None:
            self._lanes[lane].planner = self._new_planner()
        return self._lanes[lane].planner

    @property
    def _drafters(self) -> dict[str, Drafter]:
        return self._lanes[0].drafters

    @property
    def _planner(self) -> Planner | None:
        return self._lanes[0].planner

    @_planner.setter
    def _planner(self, planner: Planner | None) -> None:
        self._lanes[0].planner = planner

    def batch_costs(self, remeasure: bool = False) -> list[float]:
        """This machine's target batch cost curve (see edgespec.planner)."""
        with self._exclusive():
            return self._batch_costs(remeasure)

    def _new_planner(self) -> Planner:
        """A planner over this machine's cost curve; on an offloaded MoE it
        also weighs the expert reads a batch waits for."""
        b, experts = self.backend, None
        if getattr(b, "expert_cache", None) is not None:
            experts = ExpertMisses(int(b.metadata(f"{b.arch}.expert_count")),
                                   int(b.metadata(f"{b.arch}.expert_used_count")))
        return Planner(self._batch_costs(), experts)

    def _batch_costs(self, remeasure: bool = False) -> list[float]:
        if self._costs is None or remeasure:
            self._costs = batch_costs(self.backend, remeasure=remeasure)
        return self._costs

    def forget_prefix(self) -> None:
        """Make the next generation evaluate its whole prompt instead of reusing
        the K/V of an earlier one's common prefix (benchmarks time prefill so):
        every slot is emptied."""
        with self._exclusive():
            self.backend.clear_slots()

    def slot_stats(self) -> list[dict]:
        """Each KV-cache slot's counters: tokens held, generations started in
        it, those with a reused prefix, prompt tokens reused in all."""
        with self._reading():
            return [asdict(s) for s in self.backend.slot_stats()]

    # -- saved slots ------------------------------------------------------------

    def save_slot(self, slot: int, path: os.PathLike | str) -> dict:
        """Write slot ``slot``'s KV cache (its tokens and state) to ``path``,
        whole or not at all, between generations. The file names the model,
        backend and context it was made for (``restore_slot`` checks them).
        Returns {"tokens", "bytes"}."""
        with self._exclusive():
            tokens, n_ctx, state = self.backend.slot_state(slot)
        head = json.dumps({"model": self._model_identity(), "backend": self.backend.name, "n_ctx": n_ctx,
                           "tokens": tokens, "state_bytes": len(state)}).encode()
        data = SLOT_MAGIC + head + b"\n" + state
        write_atomic(path, data)
        return {"tokens": len(tokens), "bytes": len(data)}

    def restore_slot(self, slot: int, path: os.PathLike | str) -> dict:
        """Make slot ``slot`` hold what ``save_slot`` wrote to ``path``; a file
        made for another model, backend or context size is refused
        (InvalidArgumentError saying which), and the slot left as it was.
        Returns {"tokens", "bytes"}."""
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise InvalidArgumentError(f"cannot read the slot file {Path(path).name}: {e.strerror or e}") from None
        end = data.find(b"\n", len(SLOT_MAGIC))
        try:
            if not data.startswith(SLOT_MAGIC) or end < 0:
                raise ValueError
            head = json.loads(data[len(SLOT_MAGIC):end])
            tokens, state = head["tokens"], data[end + 1:]
            if len(state) != head["state_bytes"] or not all(_is_token(t) for t in tokens):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise InvalidArgumentError(f"{Path(path).name} is not a slot file edgespec wrote (or it is cut short)") \
                from None
        with self._exclusive():
            have = {"model": self._model_identity(), "backend": self.backend.name,
                    "n_ctx": self.backend.slot_sizes()[slot] if 0 <= slot < self.backend.n_slots else None}
            for key, what in (("model", "model"), ("backend", "backend"), ("n_ctx", "context size")):
                if head.get(key) != have[key]:
                    raise InvalidArgumentError(f"{Path(path).name} was saved for {what} {head.get(key)}; slot "
                                               f"{slot} has {have[key]}")
            self.backend.restore_slot(slot, tokens, state)
        return {"tokens": len(tokens), "bytes": len(data)}

    def erase_slot(self, slot: int) -> int:
        """Empty slot ``slot``'s KV cache; returns the tokens it held."""
        with self._exclusive():
            return self.backend.erase_slot(slot)

    def _model_identity(self) -> str:
        """The model file, as a slot file names it: its name, size and the
        sha256 of its first MiB (its header and metadata)."""
        path = Path(self.model_path)
        with open(path, "rb") as f:
            head = hashlib.sha256(f.read(1 << 20)).hexdigest()[:16]
        return f"{path.name} ({path.stat().st_size} bytes, {head})"

    # -- sharing between threads --------------------------------------------

    def _take(self, gen: Generation | None, blocking: bool = True) -> None:
        """Hold the engine for ``gen`` (a lane of it), or, for None, all of it
        for a short exclusive call. A stream this thread left suspended is
        ended first: it can never resume correctly once another generation
        has used the cache, and a step loop would wait for it."""
        me = threading.current_thread()
        self._end_suspended(me, every=gen is None)
        permits = 1 if gen is not None else self.parallel
        if not self._acquire(permits, blocking):
            raise EngineBusyError("the engine is running another generation (blocking=False)")
        with self._state:
            if self._closed:
                self._release(permits)
                raise EngineClosedError("the engine was closed")
            if gen is not None:
                # The lowest lane: a lone client keeps the drafters and planner
                # that learned the most (lane 0's, as with parallel 1).
                gen.lane = min(self._free_lanes)
                self._free_lanes.remove(gen.lane)
                # Weakly: a stream its consumer dropped is freed and gives the engine back.
                self._running[gen.lane] = weakref.ref(gen)
                gen.owner = me

    def _acquire(self, permits: int, blocking: bool) -> bool:
        if permits == 1:
            return self._busy.acquire(blocking)
        with self._gather:   # one gatherer at a time: two would each hold some and wait forever
            taken = 0
            while taken < permits and self._busy.acquire(blocking):
                taken += 1
            if taken < permits:
                self._release(taken)
            return taken == permits

    def _release(self, permits: int) -> None:
        for _ in range(permits):
            self._busy.release()

    def _give_back(self, gen: Generation | None = None) -> None:
        """Called by the holder: a generation, or (None) a short exclusive call."""
        with self._state:
            if gen is not None:
                self._running.pop(gen.lane, None)
                self._free_lanes.append(gen.lane)
        self._release(1 if gen is not None else self.parallel)

    def _end_suspended(self, thread: threading.Thread, every: bool = True) -> None:
        """End the running generations ``thread`` left suspended; for another
        generation (not ``every`` lane wanted) only when no lane is free
        (parallel: each runs in a slot of its own, and this thread must not
        wait for itself). A method of its own so that no reference to them
        outlives the call: a thread waiting for the engine must not keep a
        dropped stream alive."""
        with self._state:
            self._check_open()
            if not every and self.parallel > 1 and self._free_lanes:
                return
            stale = [g for g in self._current() if g.owner is thread]
        for g in stale:
            g._end_if_idle(GenerationAbandonedError(
                "this stream was left suspended and ended when its thread started another "
                "generation (its result holds what it generated)"))

    def _current(self) -> list[Generation]:
        """The running generations still referenced (under ``_state``)."""
        return [g for ref in self._running.values() if (g := ref()) is not None]

    def running_slots(self) -> list[int]:
        """The slots the running generations are in."""
        return self._busy_slots(-1)

    def _busy_slots(self, lane: int) -> list[int]:
        """The slots of the running generations but lane ``lane``'s."""
        with self._state:
            return [self._lanes[other].slot for other in self._running if other != lane]

    @contextmanager
    def _exclusive(self):
        """Hold the engine for a short call between generations."""
        self._take(None)
        try:
            yield
        finally:
            self._give_back()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine was closed")

    def cancel(self) -> bool:
        """Stop the running generations within one step (thread-safe; one
        waiting between pieces ends now); their results say
        ``stop_reason="cancelled"``. Returns whether one was running."""
        with self._state:
            running = self._current()
        for gen in running:
            gen.cancel()
        return bool(running)

    # -- lifetime -------------------------------------------------------------

    def close(self) -> None:
        """Free the model. A generation running in another thread is cancelled
        and waited for, a suspended one ended (resuming it raises
        EngineClosedError); later calls raise EngineClosedError. Safe to call twice."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            running = self._current()
        while running:
            gen = running.pop()
            gen._outcome.cancel.set()
            gen._end_if_idle(EngineClosedError("the engine was closed"))
            del gen   # waiting below must not keep a dropped stream alive
        self._acquire(self.parallel, True)
        try:
            with self._state:
                self._state.wait_for(lambda: self._readers == 0)
            self._free()
        finally:
            self._release(self.parallel)

    def _free(self) -> None:
        for lane in self._lanes:
            for d in lane.drafters.values():
                d.close()
            lane.drafters.clear()
        self.backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- text -----------------------------------------------------------------

    @contextmanager
    def _reading(self):
        """Guard for calls that read the model outside a generation: close()
        waits for them."""
        with self._state:
            self._check_open()
            self._readers += 1
        try:
            yield
        finally:
            with self._state:
                self._readers -= 1
                self._state.notify_all()

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        with self._reading():
            return self.backend.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens`` (InvalidArgumentError for an id outside the vocabulary)."""
        tokens = self._known_tokens(tokens, "tokens")
        with self._reading():
            return b"".join(self.backend.piece(t) for t in tokens).decode("utf-8", "replace")

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template chats are rendered with: the one set here,
        else the model's own (GGUF metadata), else None."""
        with self._reading():
            return self._chat_template or self.backend.metadata("tokenizer.chat_template")

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        self._chat_template = template
        self._capabilities = None

    def _template(self, template: str | None = None) -> str:
        template = template or self.chat_template
        if not template:
            raise InvalidArgumentError(f"model {self.model_ref} has no chat template in its metadata; "
                                       "pass a template file or use plain prompts")
        return template

    @property
    def capabilities(self) -> tuple[str, ...]:
        """What the model does, in Ollama's words: ``completion`` (it
        generates), ``tools`` (its chat template renders the tools it is
        given), ``insert`` (it has fill-in-the-middle tokens), ``embedding``
        (``embed`` serves it). Found once, by trying."""
        if self._capabilities is None:
            found = ["completion"]
            template = self.chat_template
            probe = {"type": "function", "function": {"name": "edgespec_probe_tool", "parameters": {"type": "object"}}}
            try:
                if template and "edgespec_probe_tool" in chat_templates.render(
                        template, [{"role": "user", "content": "x"}], tools=[probe]):
                    found.append("tools")
            except InvalidArgumentError:   # a template that refuses the probe renders no tools
                pass
            with self._reading():
                if self.backend.fim_tokens is not None:
                    found.append("insert")
                if self._serves_embeddings():
                    found.append("embedding")
            self._capabilities = tuple(found)
        return self._capabilities

    def _serves_embeddings(self) -> bool:
        """Whether ``embed`` works for this model: a backend with hidden states
        and a pooling it can use (a reranker's is not)."""
        if not self.backend.embeds:
            return False
        try:
            return self.pooling in POOLING.values()
        except UnsupportedModelError:
            return False

    def render_chat(self, messages: Sequence[dict], template: str | None = None,
                    tools: list[dict] | None = None) -> str:
        """The chat as the model reads it; OpenAI ``tools`` go through the
        template when it takes them, else into a system note (chat/tools.py)."""
        return "".join(text for text, _ in self._chat_pieces(messages, template, tools))

    def _chat_pieces(self, messages: Sequence[dict], template: str | None = None,
                     tools: list[dict] | None = None) -> list[tuple[str, bool]]:
        """The rendered chat as ``(text, is_content)`` pieces: a message whose
        text holds a special token's text (``<|im_end|>``) is a piece of its
        own, tokenized as plain text (chat_templates.render_pieces)."""
        template = self._template(template)
        b = self.backend
        with self._reading():
            bos, eos = b.token_text(b.bos_token), b.token_text(b.eos_token)
            special = b.special_pattern
        messages = chat_templates.validate_messages(messages)
        style = chat_tools.style_of(template)
        if tools is not None or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            messages = chat_tools.prepare_messages(messages, tools, style)
        literal = [i for i, m in enumerate(messages) if special is not None and special.search(m["content"])]
        return chat_templates.render_pieces(template, messages, literal, bos_token=bos, eos_token=eos,
                                            tools=tools if style == "tags" else None)

    def prompt_tokens(self, prompt: str | Sequence[int] | None = None,
                      messages: Sequence[dict] | None = None, tools: list[dict] | None = None,
                      suffix: str | None = None, parse_special: bool = False) -> list[int]:
        """The tokens a generation of ``prompt`` (or of a reply to ``messages``,
        with ``tools``) evaluates: the text, or the chat rendered through its
        template, tokenized; a list of token ids as it is; with ``suffix``, the
        fill-in-the-middle prompt of ``prompt`` and ``suffix``. A chat's
        template text is parsed for special tokens, its messages' text never
        is; a text prompt's is with ``parse_special`` (``<|fim_prefix|>`` becomes
        that token, as llama-server and Ollama's raw mode tokenize prompts).
        Thread-safe; it does not wait for a running generation."""
        if suffix is not None:
            return self.fill_in_middle_tokens(prompt or "", suffix)
        if isinstance(prompt, (list, tuple)) and prompt and all(_is_token(t) for t in prompt):
            return self._known_tokens(prompt, "prompt")
        if messages is not None:
            pieces = self._chat_pieces(messages, tools=tools)
            utf8_text("".join(text for text, _ in pieces), "the chat")
            with self._reading():
                return self._one_bos([t for k, (text, content) in enumerate(pieces)
                                      for t in self.backend.tokenize(text, add_special=k == 0,
                                                                     parse_special=not content)])
        if not isinstance(prompt, str):
            raise InvalidArgumentError(f"prompt must be a str, not {type(prompt).__name__}")
        if not prompt:
            raise InvalidArgumentError("prompt is empty")
        utf8_text(prompt, "prompt")
        with self._reading():
            tokens = self.backend.tokenize(prompt, parse_special=parse_special)
            return self._one_bos(tokens) if parse_special else tokens

    def _one_bos(self, tokens: list[int]) -> list[int]:
        """``tokens`` less a second BOS: text that starts with the BOS token's
        own text, after the one the tokenizer adds (as llama.cpp warns of)."""
        bos = self.backend.bos_token
        return tokens[1:] if len(tokens) > 1 and tokens[0] == bos and tokens[1] == bos else tokens

    def fill_in_middle_tokens(self, prefix: str, suffix: str, *, extra: Sequence[tuple[str, str]] | None = None,
                              middle: str = "", keep: tuple[int, int, int] | None = None) -> list[int]:
        """The prompt that asks the model for the text between ``prefix`` and
        ``suffix``, from its own fill-in-the-middle tokens in prefix-suffix-middle
        order: [BOS] <fim_prefix> prefix <fim_suffix> suffix <fim_middle>. The
        texts are tokenized as plain text (special-token names in them stay text).
        Raises InvalidArgumentError when the model has no such tokens.

        With ``extra`` (a list, maybe empty), llama-server's /infill layout:
        the files ``(name, text)`` go first, in the repository-level form
        (``<|repo_name|>myproject``, then ``<|file_sep|>name`` + text each,
        and ``<|file_sep|>filename`` before the prefix) where the model has
        those tokens, else each after a ``--- snippet ---`` line; ``middle`` (the text typed so far
        after the prefix, its special-token text parsed) follows the prefix.
        ``keep``: the most tokens kept of the prefix's end, the suffix's
        start and the extra files' end."""
        for name, text in (("prompt", prefix), ("suffix", suffix), ("middle", middle)):
            if not isinstance(text, str):
                raise InvalidArgumentError(f"{name} must be a str, not {type(text).__name__}")
            utf8_text(text, name)
        with self._reading():
            b = self.backend
            fim = b.fim_tokens
            if fim is None:
                raise InvalidArgumentError(
                    f"model {self.model_ref} has no fill-in-the-middle tokens, so it cannot complete "
                    "between a prompt and a suffix (code models such as qwen2.5-coder-1.5b can)")
            pre, suf, mid = fim
            head = [b.bos_token] if b.adds_bos else []
            before = b.tokenize(prefix, add_special=False)
            after = b.tokenize(suffix, add_special=False)
            files = self._fim_files(extra) if extra is not None else []
            typed = b.tokenize(middle, add_special=False, parse_special=True) if middle else []
        if keep is not None:
            before, after, files = before[len(before) - min(keep[0], len(before)):], after[:keep[1]], \
                files[len(files) - min(keep[2], len(files)):]
        return files + head + [pre] + before + typed + [suf] + after + [mid]

    def _fim_files(self, extra: Sequence[tuple[str, str]]) -> list[int]:
        """llama-server's repository-level context of ``extra`` files (see
        fill_in_middle_tokens); under ``_reading``."""
        b = self.backend
        rep, sep = b.fim_repo_tokens
        out = [rep] + b.tokenize("myproject\n", add_special=False) if rep is not None else []
        for name, text in extra:
            utf8_text(name, "a file name")
            utf8_text(text, "a file's text")
            if sep is not None:
                out += [sep] + b.tokenize(name + "\n", add_special=False)
            else:
                out += b.tokenize("\n\n--- snippet ---\n\n", add_special=False)
            out += b.tokenize(text, add_special=False)
        if sep is not None:
            out += [sep] + b.tokenize("filename\n", add_special=False)
        return out

    def _known_tokens(self, tokens: Sequence[int], what: str) -> list[int]:
        """``tokens`` as a list, each checked to be in the vocabulary."""
        bad = next((t for t in tokens if not 0 <= t < self.backend.n_vocab), None)
        if bad is not None:
            raise InvalidArgumentError(f"{what}: token id {bad} is outside the vocabulary "
                                       f"[0, {self.backend.n_vocab})")
        return [int(t) for t in tokens]

    # -- embeddings ---------------------------------------------------------------

    def embedding_inputs(self, inputs, *, truncate: bool = False) -> list[list[int]]:
        """The token sequences ``embed`` evaluates for ``inputs``: a string, a
        list of strings, a list of token ids or a list of such lists (OpenAI's
        ``input``); with ``truncate``, one longer than the context is cut to
        its first n_ctx tokens (Ollama's default) instead of refused.
        Thread-safe; it does not wait for a running generation."""
        if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and _is_token(inputs[0])):
            inputs = [inputs]
        if not isinstance(inputs, (list, tuple)) or not inputs:
            raise InvalidArgumentError("input must be a non-empty string, list of strings, "
                                       "list of token ids or list of such lists")
        out = []
        for i, item in enumerate(inputs):
            if isinstance(item, str):
                if not item:
                    raise InvalidArgumentError(f"input {i} is an empty string")
                with self._reading():
                    tokens = self.backend.tokenize(utf8_text(item, f"input {i}"))
            elif isinstance(item, (list, tuple)) and item and all(_is_token(t) for t in item):
                tokens = self._known_tokens(item, f"input {i}")
            else:
                raise InvalidArgumentError(f"input {i} must be a non-empty string or list of token ids")
            if not tokens:
                raise InvalidArgumentError(f"input {i} has no tokens")
            if truncate:
                tokens = tokens[:self.backend.n_ctx]
            if len(tokens) > self.backend.n_ctx:
                raise ContextOverflowError(f"input {i} is {len(tokens)} tokens but the context holds "
                                           f"{self.backend.n_ctx}")
            out.append(tokens)
        return out

    @property
    def pooling(self) -> str:
        """How ``embed`` pools token states: the model's own GGUF
        ``<arch>.pooling_type`` (mean, cls = first token, last), else mean."""
        with self._reading():
            arch = self.backend.metadata("general.architecture")
            value = self.backend.metadata(f"{arch}.pooling_type")
        if value is None:
            return "mean"
        kind = POOLING.get(int(value)) if value.isdigit() else None
        if kind is None:
            raise UnsupportedModelError(f"{self.model_ref}: pooling type {value} (a reranker?) is not "
                                        "one embeddings can use (mean, cls, last)")
        return kind

    def embed(self, inputs, *, normalize: bool = True, dimensions: int | None = None) -> np.ndarray:
        """One vector per input (see ``embedding_inputs``): ``(n, n_embd)``
        float32, the model's hidden states after its final norm pooled as
        ``pooling`` says, scaled to unit length unless ``normalize`` is False;
        ``dimensions``: only the first so many of each (``(n, dimensions)``,
        scaled after the cut, as OpenAI's and Ollama's ``dimensions``).
        The inputs are evaluated apart from every generation's KV cache, in
        shared batches, between generations (never interleaved with one)."""
        sequences = self.embedding_inputs(inputs)
        pooling = self.pooling
        with self._exclusive():
            states = self.backend.hidden_states(sequences)
        if pooling == "cls":
            vectors = np.stack([s[0] for s in states])
        elif pooling == "last":
            vectors = np.stack([s[-1] for s in states])
        else:
            vectors = np.stack([s.mean(axis=0, dtype=np.float64) for s in states]).astype(np.float32)
        if dimensions is not None:
            _whole("dimensions", dimensions, 1)
            if dimensions > vectors.shape[1]:
                raise InvalidArgumentError(f"dimensions must be at most {vectors.shape[1]} for this model, "
                                           f"got {dimensions}")
            vectors = np.ascontiguousarray(vectors[:, :dimensions])
        if normalize:
            norms = np.linalg.norm(vectors, axis=1, keepdims=True)
            vectors = vectors / np.where(norms > 0, norms, 1)
        return vectors

    # -- generation -------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int] | None = None, *,
                 messages: Sequence[dict] | None = None, **options) -> Result:
        """Generate a completion of ``prompt`` (text or token ids), or a reply to
        chat ``messages``; with ``suffix``, the text between ``prompt`` and
        ``suffix`` (fill-in-the-middle, for code models with FIM tokens).

        Options: max_tokens (256), temperature (0 = greedy), top_k, top_p,
        min_p, repeat_penalty, presence_penalty, frequency_penalty,
        repeat_last_n (the penalties' window), logit_bias ({token: bias},
        added to the logits; -inf bans), n_ctx (the context to run in, when
        not the engine's: a KV-cache slot of that size, made if none is;
        Ollama's num_ctx), seed (random when None), stop
        (strings), chat (wrap ``prompt`` as one user message), parse_special
        (special-token text in a text prompt becomes those tokens, as in
        llama-server's and Ollama's raw prompts; see prompt_tokens), drafter (this
        call's drafter instead of the engine's: none, ngram, recycle, cache,
        model, auto), blocking (False: raise EngineBusyError rather than wait
        for another thread's generation).

        Structured output: ``json_schema`` (a dict or JSON text) or ``grammar``
        (a ``Grammar``, or Lark / GBNF text) constrains every token; a schema
        the grammar engine cannot compile raises GrammarError naming the construct.
        Tools (chats only): ``tools`` (OpenAI's list of functions) and
        ``tool_choice`` ("auto", "none", "required" or a function name / object;
        a required call is constrained by a grammar); ``result.tool_calls``
        holds the calls parsed from the reply. ``logprobs``: None, or k in
        [0, 20] to get each token's logprob and the k most likely alternatives.
        """
        gen = self.stream(prompt, messages=messages, **options)
        for _ in gen:
            pass
        return gen.result

    def chat(self, messages: Sequence[dict], **options) -> Result:
        return self.generate(messages=messages, **options)

    def stream(self, prompt: str | Sequence[int] | None = None, *, blocking: bool = True,
               **request) -> Generation:
        """Validate the request (``request``'s options: see ``generate``) and
        return its Generation: iterate it for text pieces; its ``result`` (and
        ``last_result``) holds the whole Result once it ends. Nothing runs
        until the first piece is asked for."""
        return Generation(self, self._request(prompt, **request), blocking)

    def _request(self, prompt: str | Sequence[int] | None = None, *,
                 messages: Sequence[dict] | None = None, suffix: str | None = None,
                 max_tokens: int = 256, stop: Sequence[str] | str | None = None,
                 chat: bool = False, seed: int | None = None, drafter: str | None = None,
                 json_schema=None, grammar: Grammar | str | None = None,
                 tools: list[dict] | None = None, tool_choice=None, logprobs: int | None = None,
                 parse_special: bool = False, n_ctx: int | None = None, **sampling) -> _Request:
        """A request checked whole, before anything runs: every option, the
        grammar or tool call it implies, the prompt's tokens against the
        context. InvalidArgumentError (or ContextOverflowError) naming what is wrong."""
        self._check_open()
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
            raise InvalidArgumentError(f"max_tokens must be a whole number > 0, got {max_tokens!r}")
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little")
        unknown = sorted(set(sampling) - {f.name for f in dataclasses.fields(SamplingParams)})
        if unknown:
            raise InvalidArgumentError(f"unknown generation option{'s' if len(unknown) > 1 else ''} "
                                       f"{', '.join(map(repr, unknown))}"[:300])
        params = SamplingParams(seed=seed, **sampling)
        try:
            self._known_tokens([t for t, _ in params.logit_bias], "logit_bias")
        except InvalidArgumentError as e:
            e.option = "logit_bias"   # the request field a server names
            raise
        if suffix is not None and (chat or messages is not None):
            raise InvalidArgumentError("suffix (fill-in-the-middle) is for plain prompts, not chats")
        if chat and messages is None:
            if not prompt:
                raise InvalidArgumentError("prompt is empty")
            messages = [{"role": "user", "content": prompt}]
        stop = [stop] if isinstance(stop, str) else stop
        if stop is not None and not (isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop)):
            raise InvalidArgumentError(f"stop must be a string or a list of strings, got {stop!r}"[:200])
        stop = list(stop or ())
        name = drafting.check_name(drafter or self.drafter)
        if logprobs is not None:
            _whole("logprobs", logprobs, 0)
            if logprobs > 20:
                raise InvalidArgumentError(f"logprobs must be in [0, 20], got {logprobs}")
        if json_schema is not None and grammar is not None:
            raise InvalidArgumentError("give json_schema or grammar, not both")
        if json_schema is not None:
            grammar = Grammar.json_schema(json_schema)
        elif isinstance(grammar, str):
            grammar = Grammar.from_text(grammar)
        elif grammar is not None and not isinstance(grammar, Grammar):
            raise InvalidArgumentError(f"grammar must be a Grammar or grammar text, not {type(grammar).__name__}")
        style = ""
        if tools is not None or tool_choice is not None:
            if messages is None:
                raise InvalidArgumentError("tools need a chat (messages)")
            tools = chat_tools.check_tools(tools) if tools is not None else None
            choice = chat_tools.check_tool_choice(tool_choice, tools)
            if choice == "none":
                tools = None
            style = chat_tools.style_of(self._template())
            if choice not in (None, "none", "auto"):
                if grammar is not None:
                    raise InvalidArgumentError("a required tool call cannot be combined with json_schema or grammar")
                grammar = Grammar.from_text(chat_tools.call_grammar(tools, choice, style, *self._tool_tags(style)))
        if not isinstance(parse_special, bool):
            raise InvalidArgumentError(f"parse_special must be true or false, got {parse_special!r}"[:200])
        tokens = self.prompt_tokens(prompt, messages, tools, suffix, parse_special)
        if not tokens:
            raise InvalidArgumentError("the prompt has no tokens (the tokenizer drops every character of it)")
        if n_ctx is not None:
            _whole("n_ctx", n_ctx, 1)
            with self._reading():
                n_ctx = self.backend.check_context(n_ctx)
        room = n_ctx or self.backend.n_ctx
        if len(tokens) >= room:
            raise ContextOverflowError(f"prompt is {len(tokens)} tokens but the context holds {room} "
                                       "(raise n_ctx or shorten the prompt)")
        return _Request(tokens, params, max_tokens, stop, name, grammar, tools, style, logprobs,
                        _routing_text(prompt, messages, suffix), n_ctx)

    def _tool_tags(self, style: str) -> tuple[int | None, int | None]:
        """The vocabulary's own <tool_call> / </tool_call> tokens, if it has them."""
        if style != "tags":
            return None, None
        with self._reading():
            ids = [self.backend.tokenize(t, add_special=False, parse_special=True)
                   for t in (chat_tools.OPEN, chat_tools.CLOSE)]
        return tuple(i[0] if len(i) == 1 else None for i in ids)

    def _constraint(self, grammar: Grammar) -> Constraint:
        """A grammar's state for one generation (runs under the engine)."""
        if self._llg_tokenizer is None:
            self._llg_tokenizer = tokenizer_for(self.backend)
        return Constraint(grammar, self._llg_tokenizer, self.backend.n_vocab)

    def _on_slot(self, lane: int):
        """What a generation's backend calls run under: nothing for a lone
        generation (parallel 1), else the backend lock with its slot selected."""
        return _ALONE if self._batcher is None else self._slot_held(self._lanes[lane].slot)

    @contextmanager
    def _slot_held(self, slot: int):
        with self._backend:
            self.backend.select_slot(slot)
            yield

    def _steps(self, lane: int, prompt_tokens: list[int], sampler: Sampler, drafters: list[Drafter],
               may_skip: bool, max_tokens: int, cancel: threading.Event,
               constraint: Constraint | None = None, logprobs: int | None = None,
               n_ctx: int | None = None) -> Iterator[Step]:
        """The speculative loop as a step generator: the first step evaluates
        the prompt (reusing the cache's common prefix) and samples one token;
        every later step plans a draft (possibly empty), evaluates the last
        token plus the draft, and yields what verification keeps. The
        backend's record of its cache is settled whenever a step is yielded.
        Under a grammar (``constraint``) the draft loses the nodes the grammar
        rejects and every logits row is verified inside its mask. With
        generations running at once (``parallel``), the step's evaluation
        joins theirs in one batch (the batcher); everything else is the
        generation's own."""
        backend, batcher = self.backend, self._batcher
        planner = self._lane_planner(lane) if drafters else None
        if planner is not None:
            planner.shared = 0   # alone until a batch says otherwise
        # An offloaded MoE's planner weighs the expert reads each step waits for.
        weigh_reads = bool(drafters) and planner.experts is not None
        t0 = time.perf_counter()
        with self._backend if batcher is not None else _ALONE:
            kept = backend.reuse_prefix(prompt_tokens, n_ctx, self._busy_slots(lane) if batcher else ())
            self._lanes[lane].slot = backend.slot
            logits = backend.decode(prompt_tokens[kept:], cancel=cancel.is_set)
            if batcher is not None:
                batcher.join(backend.slot)
        try:
            masks = constraint.masks(Draft())[1] if constraint else None
            new = sampler.verify(logits, [], masks_addr=masks)
            if constraint:
                constraint.advance(new)
            context = prompt_tokens + new
            produced = len(new)
            yield from self._away(lane, Step(new, time.perf_counter() - t0, cached=kept,
                                             logprobs=token_logprobs(logits, backend.n_vocab, sampler.rows, new,
                                                                     logprobs)))
            while not cancel.is_set():
                # Plan: the tokens of the text not in the cache yet (the root,
                # the last one, preceded by a tree step's accepted path) and a draft.
                with self._on_slot(lane):
                    n_past, size, n_batch = backend.n_past, backend.context, backend.n_batch
                if len(context) >= size:
                    break
                pending = context[n_past:]
                room = min(max_tokens - produced - 1, size - len(context) - 1, n_batch - len(pending))
                draft = (planner.choose(drafters, context, min(self.draft_max, room), room, may_skip,
                                        backend.exact_trees) if drafters and room > 0 else Draft())
                io0 = backend.expert_stats() if weigh_reads else None
                ts = time.perf_counter()
                masks = None
                if constraint:
                    draft, masks = constraint.masks(draft)
                # Decode: alone, or in the batch of the generations running at once.
                step = GroupStep(self._lanes[lane].slot, pending, draft.tokens, draft.parents,
                                 draft.node_depths() if draft.parents is not None else None)
                if batcher is None:
                    logits, batch_tokens = evaluate(backend, step), len(pending) + len(draft)
                else:
                    evaluated = batcher.step(step)
                    logits, batch_tokens = evaluated.address, evaluated.batch_tokens
                    if planner is not None:   # the next draft is weighed in a batch like this one
                        planner.shared = batch_tokens - len(pending) - len(draft)
                # Finish: verify, drop what was rejected, learn, yield.
                new = sampler.verify(logits, draft.tokens, draft.parents, draft.probs, masks)
                if constraint:
                    constraint.advance(new)
                n_acc = len(new) - 1
                with self._on_slot(lane):
                    if draft.parents is not None:
                        backend.drop_tree()
                    else:
                        backend.truncate(backend.n_past - (len(draft) - n_acc))  # the rejected tail
                step = Step(new, time.perf_counter() - ts, len(draft), n_acc, draft.source,
                            logprobs=token_logprobs(logits, backend.n_vocab, sampler.rows, new, logprobs))
                if drafters:
                    io = {}
                    if io0 is not None:   # an expert cache: what the step waited for its reads
                        io1 = backend.expert_stats()
                        io = dict(misses=(io1["lookups"] - io1["hits"]) - (io0["lookups"] - io0["hits"]),
                                  stall_s=(io1["stall_ns"] - io0["stall_ns"]) / 1e9)
                    # The curve is of lone steps: a batch shared with other
                    # generations (their attention, their caches) says nothing of it.
                    if batch_tokens == len(pending) + len(draft):
                        seconds = step.seconds if batcher is None else evaluated.seconds
                        planner.record_step_time(seconds, batch_tokens, **io)
                    planner.record(draft.key or draft.source or "none", draft.depth, n_acc)
                    verified = Verified(draft, n_acc, new, logits, [context[-1]] + draft.tokens)
                    for d in drafters:
                        d.accept(verified)
                context.extend(new)
                produced += len(new)
                yield from self._away(lane, step)
        finally:
            if batcher is not None:
                batcher.leave(self._lanes[lane].slot)

    def _away(self, lane: int, step: Step) -> Iterator[Step]:
        """Yield ``step``; meanwhile the batch does not wait for this generation
        longer than its grace (its consumer holds the piece)."""
        if self._batcher is None:
            yield step
            return
        self._batcher.away(self._lanes[lane].slot)
        yield step
        self._batcher.back(self._lanes[lane].slot)

    def _pieces(self, request: _Request, outcome: _Outcome, lane: int = 0) -> Iterator[str]:
        """Runs under the engine, in lane ``lane``: turns steps into text
        pieces, stopping exactly where plain decoding would (end of
        generation, stop string, max_tokens, full context, cancel)."""
        drafters = self._open_drafters(request.drafter, lane)
        planner = self._lane_planner(lane) if drafters else None
        for d in drafters:
            d.planner = planner
        backend = self.backend
        prompt = request.prompt_tokens
        stats = GenerationStats(prompt_tokens=len(prompt), seed=request.sampling.seed, drafter=request.drafter)
        spec = stats.spec = SpecStats() if drafters else None
        out: list[int] = []
        text = TextStream(request.stop)
        t_decode = None
        backend.expert_stats(reset=True)
        with Sampler(request.sampling, backend.n_vocab) as sampler:
            for t in prompt:
                sampler.accept(t)
            constraint = self._constraint(request.grammar) if request.grammar else None
            for d in drafters:
                d.route(request.text)
                d.begin(prompt, request.sampling)
                d.constrain(constraint)
            steps = self._steps(lane, prompt, sampler, drafters, request.drafter == "auto",
                                request.max_tokens, outcome.cancel, constraint, request.logprobs, request.n_ctx)
            try:
                for step in steps:
                    if t_decode is None:
                        t_decode = time.perf_counter()
                        stats.prefill_s, stats.cached_tokens = step.seconds, step.cached
                        stats.slot = self._lanes[lane].slot
                    elif spec is not None:
                        spec.count(step.source, step.drafted, step.accepted)
                    for i, token in enumerate(step.tokens):
                        if backend.is_eog(token):
                            stats.stop_reason = "eos"
                            break
                        out.append(token)
                        if step.logprobs:
                            outcome.logprobs.append(step.logprobs[i])
                        piece = text.push(backend.piece(token))
                        if piece:
                            yield piece
                        if text.stopped:
                            stats.stop_reason = "stop"
                            break
                        if len(out) >= request.max_tokens:
                            stats.stop_reason = "length"
                            break
                    if stats.stop_reason:
                        break
                else:
                    stats.stop_reason = "cancelled" if outcome.cancel.is_set() else "context"
                tail = text.finish()
                if tail:
                    yield tail
            except Interrupted:
                stats.stop_reason = "cancelled"
            finally:
                steps.close()
                stats.decode_s = time.perf_counter() - t_decode if t_decode is not None else 0.0
                stats.n_tokens = len(out)
                if not stats.stop_reason and outcome.cancel.is_set():   # ended between pieces
                    stats.stop_reason = "cancelled"
                stats.experts = backend.expert_stats()
                if spec is not None:
                    spec.planner = planner.summary()
                    spec.drafters = {d.name: d.stats() for d in drafters}
                parsed = (chat_tools.parse(text.text, request.tool_style, request.tools)
                          if request.tools else None)
                outcome.result = self.last_result = Result(
                    text=text.text, tokens=out, stats=stats,
                    logprobs=outcome.logprobs if request.logprobs is not None else None, parsed=parsed)
