"""One generation: its request checked whole, the step loop, and the text.

``check_request`` turns a call's options into a ``Request`` before anything
runs (the prompt tokenized once, the context checked), so that a bad request
fails without waiting for the engine. ``Generation`` is the iterator a
stream returns; it takes a lane of the engine (edgespec.lanes) when its first
piece is asked for. ``pieces`` turns the speculative step loop (``steps``:
plan a draft, evaluate it with the pending tokens, verify, learn) into text
pieces, stopping exactly where plain decoding would.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from . import drafters as drafting
from .backends import GroupStep, Interrupted
from .chat import tools as chat_tools
from .drafters import Draft, Drafter, Verified
from .errors import ContextOverflowError, EdgespecError, InvalidArgumentError, check_whole
from .grammar import Constraint, Grammar
from .lanes import Lane, Lanes
from .planner import Planner, expected_room
from .prompting import Prompter
from .results import GenerationStats, Result, SpecStats, Step
from .sampling import Sampler, SamplingParams, TokenLogprob, token_logprobs
from .text import TextStream


@dataclass
class Request:
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
    context_shift: bool = False       # a full context drops the oldest half after the kept start, and goes on
    n_keep: int = 0                   # the start a shift keeps, in tokens


@dataclass
class Outcome:
    """What a generation's pieces hand back to its Generation: kept apart so
    that the pieces' generator never holds the Generation, which is then
    freed (and gives the engine back) the moment its consumer drops it, not
    at the next cyclic collection."""

    cancel: threading.Event = field(default_factory=threading.Event)
    logprobs: list[TokenLogprob] = field(default_factory=list)   # grows with the text, when asked for
    result: Result | None = None


# -- the request ---------------------------------------------------------------------


def routing_text(prompt, messages, suffix) -> str | None:
    """A request's own text, which a router reads: a chat's messages but the
    system's (its template's text and a system prompt say little of the
    reply's language), a prompt with its suffix; None for token ids."""
    if messages is not None:   # validated: each content is a string, or absent beside tool calls
        return "\n".join(m["content"] for m in messages
                         if m.get("role") != "system" and isinstance(m.get("content"), str)) or None
    if isinstance(prompt, str):
        return prompt if suffix is None else prompt + "\n" + suffix
    return None


def _sampling(prompter: Prompter, seed: int | None, sampling: dict) -> SamplingParams:
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    unknown = sorted(set(sampling) - {f.name for f in dataclasses.fields(SamplingParams)})
    if unknown:
        raise InvalidArgumentError(f"unknown generation option{'s' if len(unknown) > 1 else ''} "
                                   f"{', '.join(map(repr, unknown))}"[:300])
    params = SamplingParams(seed=seed, **sampling)
    try:
        prompter.known_tokens([t for t, _ in params.logit_bias], "logit_bias")
    except InvalidArgumentError as e:
        e.option = "logit_bias"   # the request field a server names
        raise
    return params


def _grammar(json_schema, grammar) -> Grammar | None:
    if json_schema is not None and grammar is not None:
        raise InvalidArgumentError("give json_schema or grammar, not both")
    if json_schema is not None:
        return Grammar.json_schema(json_schema)
    if isinstance(grammar, str):
        return Grammar.from_text(grammar)
    if grammar is not None and not isinstance(grammar, Grammar):
        raise InvalidArgumentError(f"grammar must be a Grammar or grammar text, not {type(grammar).__name__}")
    return grammar


def _tools(prompter: Prompter, messages, tools, tool_choice, grammar, parallel_tool_calls):
    """(tools, their style, the grammar) once tools and tool_choice are checked:
    a required call is constrained by a grammar of its own (of up to
    MAX_CALLS calls with ``parallel_tool_calls``, else one)."""
    if not isinstance(parallel_tool_calls, bool):
        raise InvalidArgumentError(f"parallel_tool_calls must be true or false, got {parallel_tool_calls!r}"[:200])
    if tools is None and tool_choice is None:
        return None, "", grammar
    if messages is None:
        raise InvalidArgumentError("tools need a chat (messages)")
    tools = chat_tools.check_tools(tools) if tools is not None else None
    choice = chat_tools.check_tool_choice(tool_choice, tools)
    if choice == "none":
        tools = None
    style = chat_tools.style_of(prompter.template())
    if choice not in (None, "none", "auto"):
        if grammar is not None:
            raise InvalidArgumentError("a required tool call cannot be combined with json_schema or grammar")
        most = chat_tools.MAX_CALLS if parallel_tool_calls else 1
        grammar = Grammar.from_text(chat_tools.call_grammar(tools, choice, style, *prompter.tool_tags(style), most=most))
    return tools, style, grammar


def check_request(prompter: Prompter, default_drafter: str, prompt: str | Sequence[int] | None = None, *,
                  messages: Sequence[dict] | None = None, suffix: str | None = None,
                  max_tokens: int = 256, stop: Sequence[str] | str | None = None,
                  chat: bool = False, seed: int | None = None, drafter: str | None = None,
                  json_schema=None, grammar: Grammar | str | None = None,
                  tools: list[dict] | None = None, tool_choice=None, parallel_tool_calls: bool = False,
                  logprobs: int | None = None, parse_special: bool = False, n_ctx: int | None = None, context_shift: bool = False,
                  n_keep: int = 0, **sampling) -> Request:
    """A request checked whole, before anything runs (see ``Engine.generate``
    for the options): every option, the grammar or tool call it implies, the
    prompt's tokens against the context. InvalidArgumentError (or
    ContextOverflowError) naming what is wrong."""
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
        raise InvalidArgumentError(f"max_tokens must be a whole number > 0, got {max_tokens!r}")
    params = _sampling(prompter, seed, sampling)
    if suffix is not None and (chat or messages is not None):
        raise InvalidArgumentError("suffix (fill-in-the-middle) is for plain prompts, not chats")
    if chat and messages is None:
        if not prompt:
            raise InvalidArgumentError("prompt is empty")
        messages = [{"role": "user", "content": prompt}]
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop)):
        raise InvalidArgumentError(f"stop must be a string or a list of strings, got {stop!r}"[:200])
    name = drafting.check_name(drafter or default_drafter)
    if logprobs is not None and check_whole("logprobs", logprobs, 0) > 20:
        raise InvalidArgumentError(f"logprobs must be in [0, 20], got {logprobs}")
    tools, style, grammar = _tools(prompter, messages, tools, tool_choice, _grammar(json_schema, grammar),
                                   parallel_tool_calls)
    if not isinstance(parse_special, bool):
        raise InvalidArgumentError(f"parse_special must be true or false, got {parse_special!r}"[:200])
    tokens = prompter.prompt_tokens(prompt, messages, tools, suffix, parse_special)
    if not tokens:
        raise InvalidArgumentError("the prompt has no tokens (the tokenizer drops every character of it)")
    if n_ctx is not None:
        check_whole("n_ctx", n_ctx, 1)
        with prompter.reading():
            n_ctx = prompter.backend.check_context(n_ctx)
    room = n_ctx or prompter.backend.n_ctx
    if len(tokens) >= room:
        raise ContextOverflowError(f"prompt is {len(tokens)} tokens but the context holds {room} "
                                   "(raise n_ctx or shorten the prompt)")
    return Request(tokens, params, max_tokens, list(stop or ()), name, grammar, tools, style, logprobs,
                   routing_text(prompt, messages, suffix), n_ctx, *_shift_rule(prompter, context_shift, n_keep,
                                                                             tokens, room))


def _shift_rule(prompter: Prompter, context_shift, n_keep, tokens: list[int], room: int) -> tuple[bool, int]:
    """(context_shift, the tokens a shift keeps): ``n_keep`` tokens of the
    prompt after its BOS (-1: the whole prompt), as llama-server's n_keep."""
    if not isinstance(context_shift, bool):
        raise InvalidArgumentError(f"context_shift must be true or false, got {context_shift!r}"[:200])
    if n_keep != -1:
        check_whole("n_keep", n_keep, -1)
    keep = len(tokens) if n_keep == -1 else min(n_keep + (tokens[0] == prompter.backend.bos_token), len(tokens))
    if context_shift and keep >= room - 2:
        raise InvalidArgumentError(f"n_keep keeps {keep} tokens of a context of {room}: a context shift "
                                   "would have nothing to drop (keep fewer)")
    return context_shift, keep


# -- the iterator a stream returns ----------------------------------------------------


class Generation(Iterator[str]):
    """A generation in progress: iterating yields its text pieces (never a
    split UTF-8 character); ``result`` holds the whole Result once it ends.

    It takes a lane of the engine when the first piece is asked for and gives
    it back when it ends: exhausted, ``close()``d, cancelled (from any
    thread, also while it waits between pieces), failed or dropped. One the
    engine ended for it (its thread started another generation, another
    thread waited while it sat idle, the engine was closed) raises
    GenerationAbandonedError or EngineClosedError when resumed.
    ``run(request, outcome, lane)`` makes its pieces (the engine's).
    """

    def __init__(self, lanes: Lanes, request: Request, blocking: bool,
                 run: Callable[[Request, Outcome, Lane], Iterator[str]]):
        self.request = request
        self._lanes = lanes
        self._blocking = blocking
        self._run = run
        self._pieces: Iterator[str] | None = None
        self._outcome = Outcome()
        # Held while a piece is made and by whoever ends the generation, so
        # that another thread ends it only between pieces.
        self._lock = threading.Lock()
        self._done = False
        self._ended_by: EdgespecError | None = None   # raised on resuming one the engine ended
        self._idle_since = time.monotonic()           # when its last piece was handed out
        self.owner: threading.Thread | None = None    # the thread that started it
        self.lane = 0                                 # the engine's lane it runs in (Lanes.take)

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
        self.end_if_idle()

    def __next__(self) -> str:
        with self._lock:
            if self._ended_by is not None:
                raise self._ended_by
            if self._done:
                raise StopIteration
            if self._pieces is None:
                self._lanes.take(self, self._blocking)
                self._pieces = self._run(self.request, self._outcome, self._lanes.lanes[self.lane])
            try:
                piece = next(self._pieces)
            except BaseException:
                self._finish()
                raise
            self._idle_since = time.monotonic()
        if self.cancelled:   # cancel() may have found it making this piece
            self.end_if_idle()
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

    def idle_for(self) -> float:
        """Seconds since it last handed out a piece, while nobody is making one (else 0)."""
        if self._pieces is None or self._done or self._lock.locked():
            return 0.0
        return time.monotonic() - self._idle_since

    def end_if_idle(self, error: EdgespecError | None = None) -> None:
        """End a started generation unless a piece is being made (that thread
        ends it then); ``error``: what resuming it raises."""
        if self._pieces is not None and self._lock.acquire(blocking=False):
            try:
                if error is not None and not self._done:
                    self._ended_by = error
                self._end()
            finally:
                self._lock.release()

    def cancel_and_end(self, error: EdgespecError) -> None:
        """Cancel it and end it between pieces; resuming it raises ``error``."""
        self._outcome.cancel.set()
        self.end_if_idle(error)

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
            self._lanes.give_back(self)

    def __del__(self):
        self.close()


# -- the step loop ------------------------------------------------------------------


def steps(lane: Lane, request: Request, sampler: Sampler, drafters: list[Drafter], draft_max: int,
          cancel: threading.Event, constraint: Constraint | None,
          busy_slots: Callable[[], list[int]]) -> Iterator[Step]:
    """The speculative loop as a step generator: the first step evaluates the
    prompt (reusing the cache's common prefix) and samples one token; every
    later step plans a draft (possibly empty), evaluates the last token plus
    the draft, and yields what verification keeps. The backend's record of
    its cache is settled whenever a step is yielded. Under a grammar
    (``constraint``) the draft loses the nodes the grammar rejects and every
    logits row is verified inside its mask. In a batched lane the step's
    evaluation joins the other lanes' in one batch; everything else is the
    generation's own. ``busy_slots``: the other running generations' slots."""
    n_vocab = lane.backend.n_vocab
    planner = lane.drafting_planner() if drafters else None
    if planner is not None:
        planner.shared = 0   # alone until a batch says otherwise
    prompt = request.prompt_tokens
    t0 = time.perf_counter()
    kept, logits = lane.prefill(prompt, request.n_ctx, busy_slots, cancel.is_set)
    try:
        masks = constraint.masks(Draft())[1] if constraint else None
        new = sampler.verify(logits, [], masks_addr=masks)
        if constraint:
            constraint.advance(new)
        context = prompt + new
        produced = len(new)
        yield from lane.away(Step(new, time.perf_counter() - t0, cached=kept,
                                  logprobs=token_logprobs(logits, n_vocab, sampler.rows, new, request.logprobs)))
        may_skip = request.drafter == "auto"
        while not cancel.is_set():
            # Plan: the tokens of the text not in the cache yet (the root, the
            # last one, preceded by a tree step's accepted path) and a draft.
            n_past, size, n_batch = lane.position()
            shifted = len(context) >= size
            if shifted:
                if not (request.context_shift and _shift(lane, context, request, drafters, cancel)):
                    break
                n_past, size, n_batch = lane.position()
            pending = context[n_past:]
            room = min(request.max_tokens - produced - 1, size - len(context) - 1,
                       n_batch - len(pending))
            draft = (planner.choose(drafters, context, min(draft_max, room), room, may_skip, lane.backend.exact_trees,
                                    expected_room(room, produced)) if drafters and room > 0 else Draft())
            step = _step(lane, planner, drafters, sampler, constraint, context, pending, draft, request.logprobs)
            step.shifted = shifted
            context.extend(step.tokens)
            produced += len(step.tokens)
            yield from lane.away(step)
    finally:
        lane.leave()


def _shift(lane: Lane, context: list[int], request: Request, drafters: list[Drafter],
           cancel: threading.Event) -> bool:
    """The context is full: keep its first ``request.n_keep`` tokens, drop the
    oldest half of the rest, and evaluate the kept tail again at its new
    positions (the native engine rotates K when it writes it, so evaluating
    again is what re-positions them: one prefill of the kept part, as
    llama.cpp's own re-evaluation after a shift). Plain decoding shifts at
    the same token (a draft never runs past the context), so speculation
    stays exact against it. The drafters start again on the new text.
    False where nothing can be dropped."""
    keep = request.n_keep
    n_discard = (len(context) - keep) // 2
    if n_discard < 1:
        return False
    del context[keep:keep + n_discard]
    lane.evaluate_again(context, keep, cancel.is_set)
    for d in drafters:
        d.begin(context, request.sampling)
    return True


def _step(lane: Lane, planner: Planner | None, drafters: list[Drafter], sampler: Sampler,
          constraint: Constraint | None, context: list[int], pending: list[int], draft: Draft,
          logprobs: int | None) -> Step:
    """One target step after the prompt's: evaluate ``pending`` and ``draft``
    (alone or in the shared batch), verify, drop what was rejected, learn."""
    backend = lane.backend
    reads = backend.expert_stats() if planner is not None and planner.experts is not None else None
    ts = time.perf_counter()
    masks = None
    if constraint:
        draft, masks = constraint.masks(draft)
    tree = draft.parents is not None
    evaluated = lane.evaluate(GroupStep(lane.slot, pending, draft.tokens, draft.parents,
                                        draft.node_depths() if tree else None), ts)
    own = len(pending) + len(draft)
    if planner is not None and lane.batched:   # the next draft is weighed in a batch like this one
        planner.shared = evaluated.batch_tokens - own
    new = sampler.verify(evaluated.address, draft.tokens, draft.parents, draft.probs, masks)
    if constraint:
        constraint.advance(new)
    n_acc = len(new) - 1
    lane.settle(tree, len(draft) - n_acc)
    step = Step(new, time.perf_counter() - ts, len(draft), n_acc, draft.source,
                logprobs=token_logprobs(evaluated.address, backend.n_vocab, sampler.rows, new, logprobs))
    if drafters:
        # The curve is of lone steps: a batch shared with other generations
        # (their attention, their caches) says nothing of it. A lone step is
        # timed whole (its verification too), as the curve was measured.
        if evaluated.batch_tokens == own:
            io = planner.experts.waited(reads, backend.expert_stats()) if reads is not None else {}
            planner.record_step_time(evaluated.seconds if lane.batched else step.seconds, own, **io)
        planner.record(draft.key or draft.source or "none", draft.depth, n_acc,
                       new if sampler.params.greedy else None)
        verified = Verified(draft, n_acc, new, evaluated.address, [context[-1]] + draft.tokens, lane.slot)
        for d in drafters:
            d.accept(verified)
    return step


# -- steps into text ------------------------------------------------------------------


def pieces(lane: Lane, request: Request, outcome: Outcome, *, draft_max: int, busy_slots: Callable[[], list[int]],
           constraint: Callable[[Grammar], Constraint], done: Callable[[Result], None]) -> Iterator[str]:
    """Runs holding ``lane``: turns steps into text pieces, stopping exactly
    where plain decoding would (end of generation, stop string, max_tokens,
    full context, cancel); ``done(result)`` once it ends, however it ends."""
    backend = lane.backend
    drafters = lane.open_drafters(request.drafter)
    planner = lane.drafting_planner() if drafters else None
    for d in drafters:
        d.planner = planner
    stats = GenerationStats(prompt_tokens=len(request.prompt_tokens), seed=request.sampling.seed,
                            drafter=request.drafter)
    stats.spec = SpecStats() if drafters else None
    out: list[int] = []
    text = TextStream(request.stop)
    backend.expert_stats(reset=True)
    with Sampler(request.sampling, backend.n_vocab) as sampler:
        for t in request.prompt_tokens:
            sampler.accept(t)
        grammar = constraint(request.grammar) if request.grammar else None
        for d in drafters:
            d.route(request.text)
            d.begin(request.prompt_tokens, request.sampling)
            d.constrain(grammar)
        if planner is not None:
            planner.begin(request.text)   # the route of text whose learned acceptance applies
        loop = steps(lane, request, sampler, drafters, draft_max, outcome.cancel, grammar, busy_slots)
        try:
            yield from _text(loop, lane, request, outcome, stats, out, text)
        except Interrupted:
            stats.stop_reason = "cancelled"
        finally:
            loop.close()
            stats.n_tokens = len(out)
            if not stats.stop_reason and outcome.cancel.is_set():   # ended between pieces
                stats.stop_reason = "cancelled"
            stats.experts = backend.expert_stats()
            if stats.spec is not None:
                stats.spec.planner = planner.summary()
                planner.end()   # what it learned kept for the next process
                stats.spec.drafters = {d.name: d.stats() for d in drafters}
            parsed = chat_tools.parse(text.text, request.tool_style, request.tools) if request.tools else None
            outcome.result = Result(text=text.text, tokens=out, stats=stats,
                                    logprobs=outcome.logprobs if request.logprobs is not None else None,
                                    parsed=parsed)
            done(outcome.result)


def _text(loop: Iterator[Step], lane: Lane, request: Request, outcome: Outcome, stats: GenerationStats,
          out: list[int], text: TextStream) -> Iterator[str]:
    """The pieces of ``loop``'s tokens (appended to ``out``), until one ends
    the text (``stats.stop_reason``); ``stats`` times the steps."""
    backend = lane.backend
    t_decode = None
    try:
        for step in loop:
            if t_decode is None:
                t_decode = time.perf_counter()
                stats.prefill_s, stats.cached_tokens, stats.slot = step.seconds, step.cached, lane.slot
            elif stats.spec is not None:
                stats.spec.count(step.source, step.drafted, step.accepted)
            stats.context_shifts += step.shifted
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
                    stats.stop_reason, stats.stop_string = "stop", text.matched
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
    finally:
        stats.decode_s = time.perf_counter() - t_decode if t_decode is not None else 0.0
