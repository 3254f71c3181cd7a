"""The public engine: load a model once, generate many times.

    with Engine("smollm2-135m", threads=2) as engine:
        result = engine.generate("Once upon a time", max_tokens=32)
        for piece in engine.stream("Tell me a story", max_tokens=64):
            print(piece, end="", flush=True)

An Engine is not thread-safe: one generation at a time (serve queues requests).
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from .chat import template as chat_templates
from .models import registry
from . import drafters as drafting
from .backends import BACKENDS, open_backend, resolve_model
from .drafters import Draft, DrafterConfig, Verified
from .errors import ContextOverflowError, InvalidArgumentError
from .planner import Planner, batch_costs
from .sampling import Sampler, SamplingParams
from .text import TextStream

TREE_SEQS = 8          # KV sequences for draft-tree branches (leaves per tree)
DEFAULT_DRAFT_MAX = 16  # most draft tokens (tree nodes) per target step


@dataclass
class SpecStats:
    """What speculation did during one generation."""

    drafted: int = 0          # draft tokens (tree nodes) sent to the target
    accepted: int = 0         # of those, accepted
    target_steps: int = 0     # target forward passes after prefill
    spec_steps: int = 0       # of those, with a draft
    per_drafter: dict = field(default_factory=dict)   # name -> {steps, drafted, accepted}
    by_length: dict = field(default_factory=dict)     # draft length -> {steps, accepted}
    planner: dict = field(default_factory=dict)
    drafters: dict = field(default_factory=dict)      # drafter-specific counters

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Draft tokens accepted per target step."""
        return self.accepted / self.target_steps if self.target_steps else 0.0

    def count(self, name: str, drafted: int, accepted: int) -> None:
        self.target_steps += 1
        if drafted:
            self.spec_steps += 1
            self.drafted += drafted
            self.accepted += accepted
            d = self.per_drafter.setdefault(name, {"steps": 0, "drafted": 0, "accepted": 0})
            d["steps"] += 1
            d["drafted"] += drafted
            d["accepted"] += accepted
            n = self.by_length.setdefault(drafted, {"steps": 0, "accepted": 0})
            n["steps"] += 1
            n["accepted"] += accepted

    def to_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_accepted"] = self.mean_accepted
        return d


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0         # prompt tokens whose K/V were reused from the previous generation
    n_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stop_reason: str = ""          # "eos", "stop", "length" or "context"
    seed: int = 0
    drafter: str = "none"
    spec: SpecStats | None = None   # None for plain decoding

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens / decode time (prefill excluded)."""
        return self.n_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens evaluated (the cached ones excluded) / prefill time."""
        evaluated = self.prompt_tokens - self.cached_tokens
        return evaluated / self.prefill_s if self.prefill_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.spec is not None:
            d["spec"] = self.spec.to_dict()
        d["tokens_per_s"] = self.tokens_per_s
        d["prefill_tokens_per_s"] = self.prefill_tokens_per_s
        return d


@dataclass
class Result:
    text: str
    tokens: list[int]
    stats: GenerationStats = field(default_factory=GenerationStats)


class Engine:
    """A loaded model and its context.

    ``model``: a built-in name (``edgespec models list``), a GGUF path or
    ``hf:owner/repo/file.gguf`` (with ``backend="onnx"`` also a folder from
    ``edgespec export-onnx``; a GGUF is exported on first use). ``n_ctx`` is
    capped at the model's training context. ``gpu_layers`` offloads layers
    when llama.cpp was built with Metal/CUDA/Vulkan. ``draft_backend`` runs
    the draft model on another backend than the target; ``ep`` is the ONNX
    Runtime execution provider of whichever of them is onnx (cpu, qnn,
    openvino, dml, coreml, cuda).
    """

    def __init__(self, model: str | os.PathLike | None = None, *, backend: str = "llama",
                 threads: int | None = None, n_ctx: int = 4096, n_batch: int = 512,
                 gpu_layers: int = 0, drafter: str = "none", draft_model: str | None = None,
                 draft_backend: str | None = None, ep: str | None = None,
                 ngram_cache: str | None = None, draft_max: int = DEFAULT_DRAFT_MAX,
                 verbose: bool = False):
        if threads is not None and threads <= 0:
            raise InvalidArgumentError(f"threads must be > 0, got {threads}")
        if n_ctx <= 0 or n_batch <= 0:
            raise InvalidArgumentError("n_ctx and n_batch must be > 0")
        if not 1 <= draft_max < min(n_batch, 64):
            raise InvalidArgumentError(f"draft_max must be in [1, {min(n_batch, 64) - 1}], got {draft_max}")
        for name in (backend, draft_backend or backend):
            if name not in BACKENDS:
                raise InvalidArgumentError(f"unknown backend '{name}' (available: {', '.join(BACKENDS)})")
        if ep is not None and "onnx" not in (backend, draft_backend):
            raise InvalidArgumentError("an execution provider (ep) applies to the onnx backend: "
                                       "use it with backend onnx or draft_backend onnx")
        self.drafter = drafting.check_name(drafter)
        self.draft_max = draft_max
        self.model_ref = str(model) if model is not None else registry.default_model()
        self.model_path: Path = resolve_model(backend, self.model_ref)
        self.backend = open_backend(backend, self.model_path, n_ctx=n_ctx, n_batch=n_batch,
                                    threads=threads, gpu_layers=gpu_layers, n_seq=TREE_SEQS,
                                    ep=ep, verbose=verbose)
        self._drafter_config = DrafterConfig(n_vocab=self.backend.n_vocab, target=self.backend,
                                             draft_model=draft_model, draft_backend=draft_backend,
                                             ep=ep, ngram_cache=ngram_cache,
                                             threads=threads, n_ctx=self.backend.n_ctx)
        self._drafters: dict[str, drafting.Drafter] = {}
        self._costs: list[float] | None = None
        self._planner: Planner | None = None
        self._kv_tokens: list[int] = []  # what the KV cache holds, in order, between generations
        self.last_result: Result | None = None
        self._chat_template: str | None = None
        if self.drafter != "none":
            self._open_drafters(self.drafter)  # fail early on a bad draft model or cache

    def _open_drafters(self, name: str) -> list:
        names = {"none": [], "auto": drafting.auto_members(self._drafter_config)}.get(name, [name])
        for n in names:
            if n not in self._drafters:
                self._drafters[n] = drafting.open_drafter(n, self._drafter_config)
        return [self._drafters[n] for n in names]

    def batch_costs(self, remeasure: bool = False) -> list[float]:
        """This machine's target batch cost curve (see edgespec.planner)."""
        if self._costs is None or remeasure:
            self._kv_tokens = []  # measuring may clear the cache
            self._costs = batch_costs(self.backend, remeasure=remeasure)
        return self._costs

    def forget_prefix(self) -> None:
        """Make the next generation evaluate its whole prompt instead of reusing
        the K/V of the previous one's common prefix (benchmarks time prefill so)."""
        self._kv_tokens = []

    # -- lifetime -------------------------------------------------------------

    def close(self) -> None:
        for d in self._drafters.values():
            if hasattr(d, "close"):
                d.close()
        self._drafters.clear()
        self.backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- text -----------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return self.backend.tokenize(text, add_special=add_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.backend.piece(t) for t in tokens).decode("utf-8", "replace")

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template chats are rendered with: the one set here,
        else the model's own (GGUF metadata), else None."""
        return self._chat_template or self.backend.metadata("tokenizer.chat_template")

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        self._chat_template = template

    def render_chat(self, messages: Sequence[dict], template: str | None = None) -> str:
        template = template or self.chat_template
        if not template:
            raise InvalidArgumentError(f"model {self.model_ref} has no chat template in its metadata; "
                                       "pass a template file or use plain prompts")
        b = self.backend
        return chat_templates.render(template, messages, bos_token=b.token_text(b.bos_token),
                                     eos_token=b.token_text(b.eos_token))

    def _prompt_tokens(self, prompt: str | None, messages: Sequence[dict] | None) -> list[int]:
        if messages is not None:
            tokens = self.backend.tokenize(self.render_chat(messages), parse_special=True)
            bos = self.backend.bos_token
            if len(tokens) > 1 and tokens[0] == bos and tokens[1] == bos:
                tokens = tokens[1:]  # the template wrote BOS and the tokenizer added one
            return tokens
        if not isinstance(prompt, str) or not prompt:
            raise InvalidArgumentError("prompt is empty")
        return self.backend.tokenize(prompt)

    # -- generation -------------------------------------------------------------

    def generate(self, prompt: str | None = None, *, messages: Sequence[dict] | None = None,
                 **options) -> Result:
        """Generate a completion of ``prompt`` (or a reply to chat ``messages``).

        Options: max_tokens (256), temperature (0 = greedy), top_k, top_p,
        min_p, repeat_penalty, repeat_last_n, seed (random when None), stop
        (strings), chat (wrap ``prompt`` as one user message), drafter (this
        call's drafter instead of the engine's: none, ngram, recycle, cache,
        model, auto).
        """
        for _ in self.stream(prompt, messages=messages, **options):
            pass
        return self.last_result

    def chat(self, messages: Sequence[dict], **options) -> Result:
        return self.generate(messages=messages, **options)

    def stream(self, prompt: str | None = None, *, messages: Sequence[dict] | None = None,
               max_tokens: int = 256, stop: Sequence[str] | str | None = None,
               chat: bool = False, seed: int | None = None, drafter: str | None = None,
               **sampling) -> Iterator[str]:
        """Yield text pieces as they are generated; ``last_result`` holds the
        whole result once the iterator is exhausted."""
        if max_tokens <= 0:
            raise InvalidArgumentError(f"max_tokens must be > 0, got {max_tokens}")
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little")
        params = SamplingParams(seed=seed, **sampling)
        if chat and messages is None:
            if not prompt:
                raise InvalidArgumentError("prompt is empty")
            messages = [{"role": "user", "content": prompt}]
        stop = [stop] if isinstance(stop, str) else list(stop or ())
        tokens = self._prompt_tokens(prompt, messages)
        n_ctx = self.backend.n_ctx
        if len(tokens) >= n_ctx:
            raise ContextOverflowError(f"prompt is {len(tokens)} tokens but the context holds {n_ctx} "
                                       "(raise n_ctx or shorten the prompt)")
        name = drafting.check_name(drafter or self.drafter)
        members = self._open_drafters(name)
        if members and self._planner is None:
            self._planner = Planner(self.batch_costs())
        return self._generate(tokens, params, max_tokens, stop, name, members)

    def _choose_draft(self, drafters, context: list[int], room: int, may_skip: bool) -> Draft:
        """Ask each drafter for a draft and keep the part of one that pays most
        on this machine (or nothing: a plain step)."""
        planner = self._planner
        best, best_value = Draft(), 0.0
        limit = min(self.draft_max, room)
        for d in drafters:
            ask = planner.budget(d.name, limit, may_skip) if d.costly else limit
            if ask <= 0:
                continue
            t0 = time.perf_counter()
            draft = d.draft(context, ask)
            if d.costly:
                planner.record_draft_time(d.name, time.perf_counter() - t0, len(draft))
            if not len(draft):
                continue
            draft, value = planner.cut(draft, may_skip)
            if len(draft) and value > best_value:
                best, best_value = draft, value
        return best

    def _generate(self, prompt_tokens: list[int], params: SamplingParams, max_tokens: int,
                  stop: list[str], drafter_name: str, drafters: list) -> Iterator[str]:
        """The one decoding loop: each target step evaluates the last token plus
        a draft (possibly empty) and keeps what verification accepts."""
        backend = self.backend
        planner = self._planner
        may_skip = drafter_name == "auto"  # an explicitly chosen drafter always drafts
        stats = GenerationStats(prompt_tokens=len(prompt_tokens), seed=params.seed, drafter=drafter_name)
        spec = stats.spec = SpecStats() if drafters else None
        out: list[int] = []
        text = TextStream(stop)
        context = list(prompt_tokens)
        with Sampler(params, backend.n_vocab) as sampler:
            for t in prompt_tokens:
                sampler.accept(t)
            for d in drafters:
                if hasattr(d, "set_sampling"):
                    d.set_sampling(params)
                d.begin(prompt_tokens)
            # Reuse the K/V of the longest common prefix with the previous
            # generation (a chat's earlier turns); the last prompt token is
            # always evaluated, its row gives the first token.
            kv, self._kv_tokens = self._kv_tokens, []  # unknown until this generation settles
            reuse, limit = 0, min(len(kv), len(prompt_tokens) - 1)
            while reuse < limit and kv[reuse] == prompt_tokens[reuse]:
                reuse += 1
            if reuse == 0:
                backend.clear()
            elif reuse < len(kv):
                backend.truncate(reuse)
            stats.cached_tokens = reuse
            t0 = time.perf_counter()
            logits = backend.decode(prompt_tokens[reuse:], reuse)
            t1 = time.perf_counter()
            stats.prefill_s = t1 - t0
            n_past = len(prompt_tokens)          # tokens whose K/V the cache holds
            new = sampler.verify(logits, [])  # the first token comes from the prompt's row
            context.extend(new)
            settled = True                       # the cache holds exactly context[:n_past]
            try:
                while True:
                    for token in new:
                        if backend.is_eog(token):
                            stats.stop_reason = "eos"
                            break
                        out.append(token)
                        piece = text.push(backend.piece(token))
                        if piece:
                            yield piece
                        if text.stopped:
                            stats.stop_reason = "stop"
                            break
                        if len(out) >= max_tokens:
                            stats.stop_reason = "length"
                            break
                    if stats.stop_reason:
                        break
                    if len(context) >= backend.n_ctx:
                        stats.stop_reason = "context"
                        break
                    # Tokens of the text not in the KV cache yet: the root (the
                    # last one), preceded by a tree step's accepted path.
                    pending = context[n_past:]
                    root = context[-1]
                    room = min(max_tokens - len(out) - 1, backend.n_ctx - len(context) - 1,
                               backend.n_batch - len(pending))
                    draft = self._choose_draft(drafters, context, room, may_skip) if drafters and room > 0 else Draft()
                    settled = False
                    ts = time.perf_counter()
                    if draft.parents is not None:
                        logits = backend.decode_tree(pending, draft.tokens, draft.parents, n_past)
                    else:
                        logits = backend.decode(pending + draft.tokens, n_past, logits_from=len(pending) - 1)
                    new = sampler.verify(logits, draft.tokens, draft.parents, draft.probs)
                    n_acc = len(new) - 1
                    n_past += len(pending)
                    if draft.parents is not None:
                        backend.drop_tree(n_past)
                    else:
                        n_past += n_acc
                        if n_acc < len(draft.tokens):
                            backend.truncate(n_past)
                    context.extend(new)
                    settled = True
                    if spec is not None:
                        planner.record_step_time(time.perf_counter() - ts, len(pending) + len(draft))
                        planner.record(draft.key or draft.source or "none", draft.depth, n_acc)
                        spec.count(draft.source, len(draft), n_acc)
                        step = Verified(draft, n_acc, new, logits, [root] + draft.tokens)
                        for d in drafters:
                            d.accept(step)
                tail = text.finish()
                if tail:
                    yield tail
            finally:
                if settled:
                    self._kv_tokens = context[:n_past]
                stats.decode_s = time.perf_counter() - t1
                stats.n_tokens = len(out)
                if spec is not None:
                    spec.planner = planner.summary()
                    spec.drafters = {d.name: d.stats() for d in drafters}
                self.last_result = Result(text=text.text, tokens=out, stats=stats)
