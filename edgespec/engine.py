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

import hashlib
import json
import os
import threading
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from . import embeddings
from .backends import default_backend, open_backend
from .backends.base import kv_cache_bytes
from .batching import Batcher
from .config import AUTO_PARALLEL, EngineConfig
from .costs import available_memory, batch_costs, cost_key
from .drafters import DrafterConfig, routed
from .drafters.router import open_router
from .errors import InvalidArgumentError, UnsupportedModelError
from .generation import Generation, Outcome, Request, check_request, pieces
from .grammar import Constraint, Grammar, tokenizer_for
from .lanes import Lane, Lanes
from .learned import AcceptanceMemory
from . import onnx  # noqa: F401  (extends resolve_model to the onnx backend: an export made on first use)
from .models import registry, resolve_model
from .planner import ExpertMisses, Planner
from .prompting import Prompter, is_token
from .results import Result
from .files import write_atomic

TREE_SEQS = 8          # KV sequences for draft-tree branches (leaves per tree)
SLOT_MAGIC = b"edgespec-slot 1\n"   # a saved slot's first line; a JSON header line, then the state


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
        self._open_backend(c)
        self._costs: list[float] | None = None
        self.last_result: Result | None = None
        self._llg_tokenizer = None  # the grammar engine's view of the vocabulary, built on first use
        self._share: Lanes | None = None   # set below, once parallel is known
        self.prompter = Prompter(self.backend, str(self.model_ref), self._reading, self._serves_embeddings)
        specialized = routed.set_files(registry.model_name(self.model_ref), c.drafter_dir)
        drafter_config = DrafterConfig(n_vocab=self.backend.n_vocab, target=self.backend, options=c,
                                       paired_draft=registry.paired_draft(self.model_ref),
                                       specialized=tuple(specialized), n_ctx=self.backend.n_ctx)
        new_lane = partial(Lane, self.backend, drafter_config, self._new_planner)
        #: The places generations run in (``parallel`` of them): each lane's
        #: drafters, planner and slot; lane 0's serve a lone generation.
        self.lanes: list[Lane] = [new_lane()]
        #: The meeting point of the lanes' steps (parallel > 1), else None.
        self.batcher: Batcher | None = None
        try:
            if self.drafter != "none":
                self.lanes[0].open_drafters(self.drafter)  # fail early on a bad draft model or cache
                # The machine is measured now, if it must be, never inside a generation.
                self.lanes[0].drafting_planner()
            self.parallel = self._parallel(c.parallel)
        except BaseException:
            self._free()
            raise
        self.lanes += [new_lane() for _ in range(self.parallel - 1)]
        if self.parallel > 1:
            # Every backend call of a generation is made under this lock, its slot selected.
            lock = threading.Condition()
            self.batcher = Batcher(self.backend, lock)
            for lane in self.lanes:
                lane.batch_with(self.batcher, lock)
        self._share = Lanes(self.lanes, c.stream_idle_ms / 1000)

    def _open_backend(self, c: EngineConfig) -> None:
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
                       verbose=c.verbose, **c.cache_types)
        self.model_path: Path = resolve_model(backend, self.model_ref)
        try:
            self.backend = open_backend(backend, self.model_path, **options,
                                        **(dict(c.native_options, vocab_early=True) if backend == "native" else {}),
                                        ep=c.ep if backend == "onnx" else None)
        except UnsupportedModelError:
            if not (auto and backend == "native"):
                raise
            # A variant of a native architecture the engine does not read (an extra tensor).
            self.model_path = resolve_model("llama", self.model_ref)
            self.backend = open_backend("llama", self.model_path, **options)

    def _parallel(self, asked: int | None) -> int:
        """How many generations run at once: ``asked`` (None: ``auto_parallel``
        on this machine's cost curve), 1 where the backend cannot group."""
        if not self.backend.groups:
            return 1
        if asked is not None:
            return asked
        kv = kv_cache_bytes(self.backend.metadata, self.backend.n_ctx, self.backend.cache_types)
        return auto_parallel(self._batch_costs(), kv, available_memory())

    def batch_costs(self, remeasure: bool = False) -> list[float]:
        """This machine's target batch cost curve (see edgespec.planner)."""
        with self._share.exclusive():
            return self._batch_costs(remeasure)

    def _new_planner(self) -> Planner:
        """A planner over this machine's cost curve; on an offloaded MoE it
        also weighs the expert reads a batch waits for."""
        b, experts = self.backend, None
        if getattr(b, "expert_cache", None) is not None:
            experts = ExpertMisses(int(b.metadata(f"{b.arch}.expert_count")),
                                   int(b.metadata(f"{b.arch}.expert_used_count")))
        return Planner(self._batch_costs(), experts, AcceptanceMemory(cost_key(b)))

    def _batch_costs(self, remeasure: bool = False) -> list[float]:
        if self._costs is None or remeasure:
            self._costs = batch_costs(self.backend, remeasure=remeasure)
        return self._costs

    def forget_prefix(self) -> None:
        """Make the next generation evaluate its whole prompt instead of reusing
        the K/V of an earlier one's common prefix (benchmarks time prefill so):
        every slot is emptied."""
        with self._share.exclusive():
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
        with self._share.exclusive():
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
            if len(state) != head["state_bytes"] or not all(is_token(t) for t in tokens):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise InvalidArgumentError(f"{Path(path).name} is not a slot file edgespec wrote (or it is cut short)") \
                from None
        with self._share.exclusive():
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
        with self._share.exclusive():
            return self.backend.erase_slot(slot)

    def _model_identity(self) -> str:
        """The model file, as a slot file names it: its name, size and the
        sha256 of its first MiB (its header and metadata)."""
        path = Path(self.model_path)
        with open(path, "rb") as f:
            head = hashlib.sha256(f.read(1 << 20)).hexdigest()[:16]
        return f"{path.name} ({path.stat().st_size} bytes, {head})"

    # -- sharing between threads and lifetime --------------------------------------

    def running_slots(self) -> list[int]:
        """The slots the running generations are in."""
        return self._share.busy_slots()

    def cancel(self) -> bool:
        """Stop the running generations within one step (thread-safe; one
        waiting between pieces ends now); their results say
        ``stop_reason="cancelled"``. Returns whether one was running."""
        running = self._share.running()
        for gen in running:
            gen.cancel()
        return bool(running)

    def close(self) -> None:
        """Free the model. A generation running in another thread is cancelled
        and waited for, a suspended one ended (resuming it raises
        EngineClosedError); later calls raise EngineClosedError. Safe to call twice."""
        self._share.close(self._free)

    def _free(self) -> None:
        for lane in self.lanes:
            lane.close()
        self.backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _reading(self):
        """Guard for calls that read the model outside a generation: close()
        waits for them (none is made before the lanes exist)."""
        return self._share.reading()

    # -- text -----------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.prompter.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens`` (InvalidArgumentError for an id outside the vocabulary)."""
        return self.prompter.detokenize(tokens)

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template chats are rendered with: the one set here,
        else the model's own (GGUF metadata), else None."""
        return self.prompter.chat_template

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        self.prompter.chat_template = template

    @property
    def capabilities(self) -> tuple[str, ...]:
        """What the model does, in Ollama's words: ``completion`` (it
        generates), ``tools`` (its chat template renders the tools it is
        given), ``insert`` (it has fill-in-the-middle tokens), ``embedding``
        (``embed`` serves it). Found once, by trying."""
        return self.prompter.capabilities

    def render_chat(self, messages: Sequence[dict], template: str | None = None,
                    tools: list[dict] | None = None) -> str:
        """The chat as the model reads it; OpenAI ``tools`` go through the
        template when it takes them, else into a system note (chat/tools.py)."""
        return "".join(text for text, _ in self.prompter.chat_pieces(messages, template, tools))

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
        return self.prompter.prompt_tokens(prompt, messages, tools, suffix, parse_special)

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
        return self.prompter.fill_in_middle_tokens(prefix, suffix, extra=extra, middle=middle, keep=keep)

    # -- embeddings ---------------------------------------------------------------

    def embedding_inputs(self, inputs, *, truncate: bool = False, n_ctx: int | None = None) -> list[list[int]]:
        """The token sequences ``embed`` evaluates for ``inputs``: a string, a
        list of strings, a list of token ids or a list of such lists (OpenAI's
        ``input``); with ``truncate``, one longer than the context (``n_ctx``,
        at most the engine's) is cut to its first n_ctx tokens (Ollama's
        default) instead of refused. Thread-safe; it does not wait for a
        running generation."""
        return embeddings.inputs_tokens(self.prompter, inputs, truncate=truncate, n_ctx=n_ctx)

    @property
    def pooling(self) -> str:
        """How ``embed`` pools token states: the model's own GGUF
        ``<arch>.pooling_type`` (mean, cls = first token, last), else mean."""
        with self._reading():
            return embeddings.pooling(self.backend, self.model_ref)

    def _serves_embeddings(self) -> bool:
        """Whether ``embed`` works for this model: a backend with hidden states
        and a pooling it can use (a reranker's is not)."""
        if not self.backend.embeds:
            return False
        try:
            return self.pooling in embeddings.POOLING.values()
        except UnsupportedModelError:
            return False

    def embed(self, inputs, *, normalize: bool = True, dimensions: int | None = None) -> np.ndarray:
        """One vector per input (see ``embedding_inputs``): ``(n, n_embd)``
        float32, the model's hidden states after its final norm pooled as
        ``pooling`` says, scaled to unit length unless ``normalize`` is False;
        ``dimensions``: only the first so many of each (``(n, dimensions)``,
        scaled after the cut, as OpenAI's and Ollama's ``dimensions``).
        The inputs are evaluated apart from every generation's KV cache, in
        shared batches, between generations (never interleaved with one)."""
        sequences = self.embedding_inputs(inputs)
        how = self.pooling
        with self._share.exclusive():
            states = self.backend.hidden_states(sequences)
        return embeddings.pool(states, how, normalize=normalize, dimensions=dimensions)

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
        a required call is constrained by a grammar: one call, or up to 8 one
        after another with ``parallel_tool_calls=True``); ``result.tool_calls``
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
        return self.start(self.request(prompt, **request), blocking=blocking)

    def start(self, request: Request, *, blocking: bool = True) -> Generation:
        """The Generation of a request ``request()`` checked (a server checks
        it before it queues the request, and tokenizes its prompt once)."""
        return Generation(self._share, request, blocking, self._pieces)

    def request(self, prompt: str | Sequence[int] | None = None, **options) -> Request:
        """The request ``stream(prompt, **options)`` would run, checked whole
        and its prompt tokenized, without running it (see ``generate``);
        InvalidArgumentError or ContextOverflowError naming what is wrong.
        Thread-safe; it does not wait for a running generation."""
        self._share.check_open()
        return check_request(self.prompter, self.drafter, prompt, **{"context_shift": self.config.context_shift,
                                                                      **options})

    def _constraint(self, grammar: Grammar) -> Constraint:
        """A grammar's state for one generation (runs under the engine)."""
        if self._llg_tokenizer is None:
            self._llg_tokenizer = tokenizer_for(self.backend)
        return Constraint(grammar, self._llg_tokenizer, self.backend.n_vocab)

    def _pieces(self, request: Request, outcome: Outcome, lane: Lane) -> Iterator[str]:
        """A generation's pieces, run holding ``lane`` (edgespec.generation.pieces)."""
        busy = partial(self._share.busy_slots, self.lanes.index(lane))
        return pieces(lane, request, outcome, draft_max=self.draft_max, busy_slots=busy,
                      constraint=self._constraint, done=self._done)

    def _done(self, result: Result) -> None:
        self.last_result = result
