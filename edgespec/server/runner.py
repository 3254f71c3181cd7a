"""Where a request becomes Engine calls, whichever API it came through.

An endpoint parses its request into a ``Completion`` (the prompt or the chat,
and Engine.stream's keyword arguments), then::

    job = await runner.start(completion, request)   # tokenized outside the engine lock (400 if
                            # over the context), queued behind other generations, running;
                            # 4xx if the engine refuses
    async for piece in job.pieces(): ...      # text pieces as the engine makes them
    job.close()                               # job.result: the engine's Result

Each generation runs in a worker thread holding a turn of its runner
(``runner.turns.turn()``): as many at once as the engine's ``parallel`` (one
unless ``serve --parallel``; several then decode together, one batch per
step), the others queued; the event loop never blocks on the engine. The
runner admits jobs on top of the Engine's own lanes because a queued job,
once its turn comes, must still be droppable (its client gone, the server
stopping) before the engine does any work for it, and shutdown waits for
every runner's turns to end to know that no generation runs. The worker
counts the prompt's tokens before it takes a turn, so a prompt over the
context is refused without waiting for the running generations. Pieces
cross from the worker to the loop through a queue. A client that goes away (``http.disconnect``) cancels its
job: a queued one never starts, a running one ends after its next piece (a
token, at most a step).

Several models (``Runners`` over an EnginePool): a runner per model name,
each with its own lock, so generations of different models may run at the
same time. A job leases its model from the pool in the worker thread, which
loads it if needed and keeps it from being unloaded until the job ends; the
event loop awaits ``runner.ready()`` before it reads the engine itself.
Embeddings (``runner.embed``) run in a worker thread between the model's
generations (the engine's own lock).
"""
from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field

import anyio

from ..errors import (ContextOverflowError, EdgespecError, EngineBusyError, InvalidArgumentError,
                      ModelFetchError, ModelNotFoundError)
from ..pool import EnginePool, PoolFullError
from .errors import ApiError, server_error

SOCKET = "edgespec.socket"   # the ASGI scope extension holding the connection's socket (http.py)
# stop_reason -> finish_reason; "cancelled": cut by the server's shutdown (a
# client that leaves gets no answer).
FINISH_REASON = {"eos": "stop", "stop": "stop", "length": "length", "context": "length",
                 "cancelled": "cancelled"}


@dataclass
class Completion:
    """What a request asks of the engine."""

    prompt: str | list[int] | None = None   # a plain prompt (text or token ids), or
    messages: list[dict] | None = None   # a chat, rendered through the model's template
    suffix: str | None = None            # with a text prompt: fill in the middle
    parse_special: bool = False          # a text prompt's special-token text is those tokens (raw prompts)
    options: dict = field(default_factory=dict)   # Engine.stream's keyword arguments (max_tokens, temperature, ...)
    keep_alive: float | None = None      # seconds the model stays loaded once idle (None: the server's)

    @property
    def prompt_args(self) -> dict:
        if self.messages is not None:
            return {"messages": self.messages}
        return {"prompt": self.prompt, "suffix": self.suffix, "parse_special": self.parse_special}

    @property
    def tools(self) -> list[dict] | None:
        """The tools the chat renders (none when tool_choice is "none")."""
        return self.options.get("tools") if self.options.get("tool_choice") != "none" else None

    @property
    def param(self) -> str:
        """The request field that prompt errors name."""
        return "messages" if self.messages is not None else "suffix" if self.suffix is not None else "prompt"


def estimated_speedup(stats, costs: list[float] | None) -> float:
    """Estimated speed over plain decoding on this machine: the tokens the
    target steps made, over what those steps cost in units of a plain step
    (the machine's measured batch-cost curve: a step verifying n draft tokens
    costs cost[n + 1])."""
    spec = stats.spec
    if spec is None or not spec.target_steps or not costs:
        return 1.0
    cost = spec.target_steps - spec.spec_steps
    for n, by in spec.by_length.items():
        cost += by["steps"] * costs[min(int(n) + 1, len(costs) - 1)]
    return (spec.target_steps + spec.accepted) / cost if cost > 0 else 1.0


MAX_EMBED_INPUTS = 2048   # inputs per embeddings request (OpenAI's limit)


class Runner:
    """One model serving many requests (see the module docstring): an Engine,
    or a model of an EnginePool, loaded by the first job that needs it (in
    its worker thread) and held loaded while a job runs."""

    def __init__(self, engine, name: str, metrics=None, log=None, pool: EnginePool | None = None):
        self._engine = engine
        self.pool = pool
        self.name = name                 # the model id clients send
        self.metrics = metrics
        self.log = log or (lambda line: None)
        self.turns = Turns(lambda: self.engine.parallel, self._count_running)   # the generations' turns
        self.created = int(time.time())
        self.cache: dict = {}            # facts about the model endpoints compute once
        self.stopping = False            # set on shutdown: generations end at their next piece
        self._tokenizing = 0             # prompts being tokenized outside the lock
        self._keeping = anyio.Lock()      # load and unload requests, in order
        self._tokenizers_done = threading.Condition()

    @property
    def engine(self):
        """The model's Engine; from a pool, loaded first if it is not (blocking:
        the event loop awaits ``ready()`` before it reads this)."""
        if self.pool is None:
            return self._engine
        with self.lease(use=False) as engine:
            return engine

    @property
    def loaded(self) -> bool:
        return self.pool is None or self.pool.loaded(self.name)

    async def ready(self) -> None:
        """Load the model, in a worker thread, if it is not loaded."""
        if not self.loaded:
            await anyio.to_thread.run_sync(lambda: self.engine)

    async def keep(self, keep_alive: float | None) -> bool:
        """Ollama's request without a prompt: load the model and keep it for
        ``keep_alive`` seconds once idle (None: the server's), or unload it
        with 0. Such requests for one model take effect in the order they
        came. Returns whether the model is loaded now."""
        async with self._keeping:
            if keep_alive == 0:
                await anyio.to_thread.run_sync(self.pool.expire, self.name, 0)
            elif self.pool is not None:
                def load():
                    with self.lease(keep_alive):   # loaded, and its expiry set from now, in one lease
                        pass
                await anyio.to_thread.run_sync(load)
        return self.loaded

    @property
    def model_path(self):
        """The model's file if it is on this machine (nothing is loaded), else None."""
        return self.pool.local_path(self.name) if self.pool is not None else self._engine.model_path

    @contextmanager
    def lease(self, keep_alive: float | None = None, use: bool = True):
        """The Engine, kept loaded (a pool unloads only idle models) until the
        block ends, then for ``keep_alive`` seconds more (see EnginePool;
        ``use`` False: a look that does not put the expiry off); a pool's
        refusals as ApiErrors."""
        if self.pool is None:
            yield self._engine
            return
        try:
            with self.pool.engine(self.name, keep_alive, use=use) as engine:
                yield engine
        except ModelNotFoundError as e:
            raise ApiError(404, str(e), param="model", code="model_not_found")
        except PoolFullError as e:
            raise ApiError(503, str(e), type="server_error", code="model_not_loaded")
        except ModelFetchError as e:
            raise ApiError(502, str(e), type="server_error", code="model_not_loaded")

    @property
    def n_ctx(self) -> int:
        return self.engine.backend.n_ctx

    def embed(self, inputs, *, truncate: bool = False, dimensions: int | None = None,
              keep_alive: float | None = None, n_ctx: int | None = None) -> tuple[list, int]:
        """(vectors, prompt tokens) of an embeddings request's ``input``, in the
        calling (worker) thread; the engine runs it between generations.
        ``truncate``: inputs longer than the context (``n_ctx``, at most the
        engine's) are cut to it; ``dimensions``: the vectors' first so many,
        at unit length again."""
        if isinstance(inputs, list) and len(inputs) > MAX_EMBED_INPUTS:
            raise ApiError(400, f"input holds {len(inputs)} items; at most {MAX_EMBED_INPUTS}", param="input")
        with self._tokenizer(), self.lease(keep_alive) as engine:
            if dimensions is not None and not 1 <= dimensions <= engine.backend.n_embd:
                raise ApiError(400, f"dimensions must be in [1, {engine.backend.n_embd}] for this model, got "
                               f"{dimensions}", param="dimensions")
            try:
                sequences = engine.embedding_inputs(inputs, truncate=truncate, n_ctx=n_ctx)
                vectors = engine.embed(sequences, dimensions=dimensions)
            except ContextOverflowError as e:
                raise ApiError(400, str(e), param="input", code="context_length_exceeded")
            except InvalidArgumentError as e:
                raise ApiError(400, str(e), param="input")
            except EdgespecError as e:   # a backend without embeddings, a reranker's pooling
                raise ApiError(400, f"model {self.name!r} does not serve embeddings: {e}", param="model")
        return vectors, sum(len(s) for s in sequences)

    def _count_running(self, running: int, waiting: int) -> None:
        if self.metrics is not None:
            self.metrics.turns(self.name, running, waiting)

    def stop(self) -> None:
        """Shut down: running generations end at their next piece, queued ones
        never start; returns once no prompt is being tokenized."""
        with self._tokenizers_done:
            self.stopping = True
            self._tokenizers_done.wait_for(lambda: self._tokenizing == 0)

    @contextmanager
    def _tokenizer(self):
        """The engine's tokenizer, used outside the engine lock (never after shutdown)."""
        with self._tokenizers_done:
            if self.stopping:
                raise ApiError(503, "the server is shutting down", type="server_error")
            self._tokenizing += 1
        try:
            yield
        finally:
            with self._tokenizers_done:
                self._tokenizing -= 1
                self._tokenizers_done.notify_all()

    def request(self, c: Completion):
        """``c`` checked whole by the engine, once: its options, its prompt
        tokenized, the context (a size the request asks for checked against
        memory and the pool's budget). Done outside the engine lock (the
        tokenizer is read-only once a model is loaded), so that a prompt over
        the context is refused without waiting for the running generation.
        ApiError naming the field on a refusal."""
        n_ctx = c.options.get("n_ctx")
        with self._tokenizer():
            try:
                if n_ctx is not None and n_ctx != self.n_ctx and self.pool is not None:
                    self.pool.context_fits(self.name, n_ctx)
                return self.engine.request(**c.prompt_args, **c.options)
            except PoolFullError as e:
                raise ApiError(400, str(e), param="n_ctx")
            except ContextOverflowError as e:
                raise ApiError(400, str(e), param=c.param, code="context_length_exceeded")
            except InvalidArgumentError as e:     # an option, a chat template refusing the messages, a context size
                raise ApiError(400, str(e), param=getattr(e, "option", None) or c.param)

    def count_tokens(self, c: Completion) -> int:
        """The tokens of ``c``'s prompt as a generation would evaluate them
        (a chat rendered through its template, with its tools), whatever the
        context holds; ApiError naming the field on a refusal."""
        with self._tokenizer():
            try:
                return len(self.engine.prompt_tokens(c.prompt, c.messages, c.tools, c.suffix, c.parse_special))
            except InvalidArgumentError as e:
                raise ApiError(400, str(e), param=getattr(e, "option", None) or c.param)

    async def start(self, c: Completion, request=None) -> "Job":
        """Queue ``c`` for the engine and wait until it runs; ``request``'s
        client is watched for going away. ApiError if the engine refused it,
        ClientGone if the client left while queued (the job closed either way)."""
        job = Job(self, c, request)
        try:
            await job.started()
        except BaseException:
            job.close()
            raise
        return job

    def finished(self, job: "Job") -> None:
        """Called in the worker, still holding the engine, once a generation ended."""
        stats = job.result.stats
        costs = self.engine.batch_costs() if stats.spec is not None else None
        job.estimated_speedup = estimated_speedup(stats, costs)
        if self.metrics is not None:
            self.metrics.generation(stats, job.estimated_speedup, self.name)


class Turns:
    """A runner's turns to generate: at most ``limit()`` at once (the
    engine's ``parallel``; read once a job holds its model), the others
    waiting. ``with turns:`` holds them all (no generation runs meanwhile);
    ``locked()``: a turn is held; ``drain()``: none is given any more, once
    the running ones have ended."""

    def __init__(self, limit, on_change=lambda running, waiting: None):
        self._limit = limit
        self._on_change = on_change   # called with the numbers running and waiting, under the lock
        self._cond = threading.Condition()
        self._running = 0
        self._waiting = 0
        self._held = False      # all of them, by a ``with`` block
        self._drained = False

    @contextmanager
    def turn(self):
        limit = self._limit()
        with self._cond:
            self._waiting += 1
            try:
                self._cond.wait_for(lambda: self._running < limit and not self._held and not self._drained)
            finally:
                self._waiting -= 1
            self._change(+1)
        try:
            yield
        finally:
            with self._cond:
                self._change(-1)

    def _change(self, by: int) -> None:
        self._running += by
        self._on_change(self._running, self._waiting)
        self._cond.notify_all()

    def __enter__(self):
        with self._cond:
            self._cond.wait_for(lambda: self._running == 0 and not self._held)
            self._held = True
        return self

    def __exit__(self, *exc):
        with self._cond:
            self._held = False
            self._cond.notify_all()

    def locked(self) -> bool:
        return self._running > 0 or self._held

    def drain(self) -> None:
        with self._cond:
            self._drained = True
            self._cond.wait_for(lambda: self._running == 0 and not self._held)


_STARTED, _END = object(), object()


class Job:
    """One generation, run by a worker thread (see the module docstring)."""

    def __init__(self, runner: Runner, completion: Completion, request=None):
        self.runner, self.completion = runner, completion
        self.result = None               # the engine's Result once it ended
        self.prompt_tokens = 0           # the request's prompt, in tokens, once the engine checked it
        self.logprobs: list = []         # the generation's logprobs so far, when asked for
        self.estimated_speedup = 1.0   # modelled from the cost curve, not measured
        self.client_gone = False
        self.cut = False                 # the server's shutdown ended the generation early
        self.created = time.time()
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancel = threading.Event()
        self._watcher = self._loop.create_task(self._watch(request.receive)) if request is not None else None
        self._socket = request.scope.get("extensions", {}).get(SOCKET) if request is not None else None
        threading.Thread(target=self._run, name="edgespec-generation", daemon=True).start()

    # -- the event loop's side ----------------------------------------------------

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.client_gone = True
        self._cancel.set()

    async def started(self) -> None:
        """Wait for the engine; ApiError if it refused the request, ClientGone
        if the client left while queued."""
        item = await self._queue.get()
        if item is _STARTED:
            return
        if isinstance(item, ApiError):
            raise item
        raise ClientGone()

    async def pieces(self):
        """The text pieces; ApiError if the engine failed mid-generation."""
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            if isinstance(item, ApiError):
                raise item
            yield item

    async def text(self) -> str:
        """The whole text of a non-streamed answer, the job closed after it;
        ClientGone if the client left."""
        try:
            text = "".join([piece async for piece in self.pieces()])
        finally:
            self.close()
        if self.client_gone:
            raise ClientGone()
        return text

    def cut_error(self) -> ApiError:
        """How a stream cut by the shutdown ends: an error event, not a clean stop."""
        n = self.result.stats.n_tokens if self.result is not None else 0
        return ApiError(503, f"the server shut down mid-generation, after {n} tokens", type="server_error",
                        code="server_shutting_down")

    def close(self) -> None:
        """Stop the generation (if it still runs) and the watching."""
        self._cancel.set()
        if self._watcher is not None:
            self._watcher.cancel()

    # -- the worker's side ------------------------------------------------------

    def _peer_gone(self) -> bool:
        """Whether the client has closed its connection (end-of-file waiting) or
        reset it, asked of the socket itself: the event loop learns it a little
        later. A peek: a pipelined next request is left alone."""
        if self._socket is None:
            return False
        try:
            with self._socket.dup() as s:
                s.setblocking(False)
                return s.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:   # nothing to read: still there
            return False
        except OSError:           # reset, or closed already
            return True

    def _post(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:   # the event loop has closed (the server stopped): nobody is listening
            self._cancel.set()

    def _run(self) -> None:
        r, c = self.runner, self.completion
        try:
            with r.lease(c.keep_alive):   # a pool's model: loaded here, and not unloaded while the job runs
                request = r.request(c)
                self.prompt_tokens = len(request.prompt_tokens)
                with r.turns.turn():
                    if r.stopping:
                        self._post(ApiError(503, "the server is shutting down", type="server_error"))
                    elif not (self._cancel.is_set() or self._peer_gone()):   # it may have left while queued
                        self._generate(r, request)
        except ApiError as e:   # the request refused
            self._post(e)
        except BaseException:   # a bug: logged, answered as a 500
            r.log(traceback.format_exc().rstrip())
            self._post(server_error("internal server error"))
        finally:
            self._post(_END)

    def _generate(self, r: Runner, request) -> None:
        gen = r.engine.start(request)
        self.logprobs = gen.logprobs
        self._post(_STARTED)
        try:
            for piece in gen:
                self._post(piece)
                if self._cancel.is_set():
                    break
                if r.stopping:
                    gen.cancel()   # ends it here: its result says "cancelled"
                    self.cut = True
                    r.log(f"shutdown: a generation of {r.name} was cut after "
                          f"{gen.result.stats.n_tokens} tokens")
                    break
        except EdgespecError as e:   # the backend failed mid-generation
            self._post(server_error(str(e)))
        finally:
            gen.close()   # this thread owns the generation: closing it is immediate
            self.result = gen.result
            if self.result is not None:
                r.finished(self)


class Runners:
    """A server's runners by model name: one Engine's, or an EnginePool's
    models (a built-in name the pool may pull is added when first asked for)."""

    def __init__(self, source, name: str, metrics=None, log=None):
        self.pool = source if isinstance(source, EnginePool) else None
        self._metrics, self._log = metrics, log
        self._lock = threading.Lock()
        names = self.pool.names if self.pool is not None else [name]
        self._runners = {n: self._runner(n, source) for n in names}
        self.default = self._runners[self.pool.default if self.pool is not None else name]

    def _runner(self, name: str, source) -> Runner:
        if self.pool is not None:
            return Runner(None, name, self._metrics, self._log, pool=self.pool)
        return Runner(source, name, self._metrics, self._log)

    def __iter__(self):
        with self._lock:
            return iter(list(self._runners.values()))

    def get(self, model: str | None, *, add: bool = True) -> Runner:
        """The runner of ``model`` (None: the default; Ollama's ``name:latest``
        too); 404 naming the served models."""
        if model is None:
            return self.default
        name = model[:-len(":latest")] if model.endswith(":latest") else model
        with self._lock:
            runner = self._runners.get(name) or self._runners.get(model)
            if runner is not None:
                return runner
            if add and self.pool is not None:
                try:
                    self.pool.add(name)
                except ModelNotFoundError:
                    pass
                else:
                    runner = self._runners[name] = self._runner(name, self.pool)
                    return runner
            served = ", ".join(self._runners)
        raise ApiError(404, f"model {model[:80]!r} does not exist; this server has {served}",
                       param="model", code="model_not_found")

    def remove(self, name: str) -> None:
        """Stop serving ``name`` (a pool's model, unloaded first); 409 while a
        request holds it, 400 for the default model."""
        with self._lock:
            runner = self._runners.get(name)
            if runner is None:
                return
            if runner is self.default:
                raise ApiError(400, f"model {name!r} is this server's default model; it stays served",
                               param="model")
            try:
                self.pool.forget(name)
            except EngineBusyError as e:
                raise ApiError(409, str(e), param="model") from None
            del self._runners[name]

    def set_stopping(self) -> None:
        for r in self:
            r.stopping = True

    def stop(self) -> None:
        """Shut every runner down (see Runner.stop) and drain their turns: no
        generation runs once this returns."""
        for r in self:
            r.stop()
        for r in self:
            r.turns.drain()


class ClientGone(Exception):
    """The client closed its connection."""


def log_to_stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
