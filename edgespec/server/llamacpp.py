"""llama-server's own API, for the tools that speak only it (llama.vscode,
llama.vim and other editor plugins): ``POST /infill`` (fill-in-the-middle
with ``input_prefix``, ``input_suffix``, ``input_extra`` files and
``prompt``, the text typed after the prefix) and ``POST /completion``, both
streamed as server-sent events with ``"stream": true``; the answers are
llama-server's (``content``, ``stop``, ``tokens_predicted``, ``timings``,
... filtered by ``response_fields``). The utility endpoints: ``POST
/tokenize`` and ``/detokenize``, ``POST /apply-template`` (the chat as the
model reads it), ``GET /props``, ``GET /slots`` and ``POST
/slots/{id}?action=save|restore|erase`` (a slot's KV cache to and from a
file under ``$EDGESPEC_HOME/slots/<model>/``; a file made for another
model, backend or context size is refused, saying which; a save that would
pass --max-slot-files or --max-slot-bytes is a 409).

Fields are llama-server's, with its defaults (temperature 0.8, top_k 40,
top_p 0.95, min_p 0.05, n_predict -1 = as much as fits; n_predict 0
evaluates the prompt into the cache and generates nothing). ``samplers``
names the samplers that apply (those left out are off, as in llama.cpp);
edgespec applies them in its own order (penalties, temperature, top_k,
top_p, min_p). ``n_indent`` and ``t_max_predict_ms`` stop a completion as
llama-server does. ``cache_prompt`` and ``t_max_prompt_ms`` change nothing
in the answer (edgespec always reuses a cached prefix; llama-server ignores
the second too), and the ``infill`` sampler is accepted without effect:
docs/server.md lists these. Options llama-server has and edgespec does not
(mirostat, typical_p, xtc, dry, ...) are refused with a 400 naming them
unless they are at their neutral value. Refusals are in OpenAI's shape
(llama-server's is the same object with a numeric code).
"""
from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from .. import __version__
from ..errors import EdgespecError, InvalidArgumentError
from ..files import atomic_output
from ..models import registry
from . import fields, openai
from .errors import ApiError, bad, is_int, is_number, show
from .request import Stream, endpoint, note, pick_runner, read_json, stream_pieces
from .runner import ClientGone, Completion, Job

DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0,
            "repeat_last_n": 64, "presence_penalty": 0.0, "frequency_penalty": 0.0}
# A sampler `samplers` may name -> the options it governs and their value when it is left out.
SAMPLERS = {"penalties": {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0},
            "top_k": {"top_k": 0}, "top_p": {"top_p": 1.0}, "min_p": {"min_p": 0.0},
            "temperature": {"temperature": 1.0}, "infill": {}}
# llama-server's options edgespec does not have, at the value that turns them off.
NEUTRAL = {"typical_p": 1.0, "xtc_probability": 0.0, "dry_multiplier": 0.0, "mirostat": 0, "top_n_sigma": -1.0,
           "dynatemp_range": 0.0, "min_keep": 0, "n_keep": 0, "n_discard": 0, "n_cmpl": 1, "n": 1,
           "id_slot": -1, "timings_per_token": False, "post_sampling_probs": False, "return_progress": False,
           "lora": []}
# llama-server's names of neutral sampler types (samplers may list them if their option is neutral).
NEUTRAL_SAMPLERS = ("typ_p", "typical_p", "xtc", "dry", "top_n_sigma")
FIM_BATCH = 2048   # llama-server's default batch, which its /infill prompt layout is cut to


def routes() -> list[Route]:
    return [
        Route("/infill", endpoint(infill), methods=["POST"]),
        Route("/completion", endpoint(completion), methods=["POST"]),
        Route("/tokenize", endpoint(tokenize), methods=["POST"]),
        Route("/detokenize", endpoint(detokenize), methods=["POST"]),
        Route("/apply-template", endpoint(apply_template), methods=["POST"]),
        Route("/props", endpoint(props), methods=["GET"]),
        Route("/slots", endpoint(slots), methods=["GET"]),
        Route("/slots/{id_slot}", endpoint(slot_action), methods=["POST"]),
    ]


# -- request fields ----------------------------------------------------------------------

def options(body: dict, n_ctx: int) -> dict:
    """Engine.stream's keyword arguments from a llama-server completion request."""
    opts = dict(DEFAULTS)
    for name in DEFAULTS:
        value = body.get(name)
        if value is None:
            continue
        whole = name in ("top_k", "repeat_last_n")
        if not (is_int(value) if whole else is_number(value)):
            raise bad(name, f"{name} must be {'an integer' if whole else 'a number'}, got {show(value)}")
        opts[name] = value
    if opts["temperature"] < 0 or opts["top_k"] < 0 or opts["repeat_last_n"] < 0:
        name = next(n for n in ("temperature", "top_k", "repeat_last_n") if opts[n] < 0)
        raise bad(name, f"{name} must be >= 0, got {show(opts[name])}")
    for name, off in NEUTRAL.items():
        value = body.get(name)
        if value is not None and value != off:
            raise bad(name, f"{name} is not supported by this server (only {json.dumps(off)})")
    samplers = body.get("samplers")
    if samplers is not None:
        if not (isinstance(samplers, list) and all(isinstance(s, str) for s in samplers)):
            raise bad("samplers", "samplers must be a list of sampler names")
        for s in samplers:
            if s not in SAMPLERS and s not in NEUTRAL_SAMPLERS:
                raise bad("samplers", f"sampler {show(s)} is not supported (known: "
                          f"{', '.join([*SAMPLERS, *NEUTRAL_SAMPLERS])})")
        for s, off in SAMPLERS.items():
            if s not in samplers:
                opts.update(off)
    n_predict = body.get("n_predict", body.get("max_tokens"))
    if n_predict is None:
        n_predict = -1
    if not is_int(n_predict) or n_predict < -1:
        raise bad("n_predict", f"n_predict must be an integer >= -1, got {show(n_predict)}")
    opts["max_tokens"] = n_ctx if n_predict == -1 else max(n_predict, 1)   # 0: the prompt only (see answer)
    if opts["temperature"] < fields.MIN_TEMPERATURE:
        opts["temperature"] = 0.0
    opts["top_p"] = max(opts["top_p"], fields.MIN_TOP_P)
    seed = body.get("seed")
    if seed is not None and seed != -1:
        if not is_int(seed) or not 0 <= seed < 2**32:
            raise bad("seed", f"seed must be -1 (random) or an integer in [0, 2**32), got {show(seed)}")
        opts["seed"] = seed
    stop = body.get("stop")
    if stop is not None:
        if not (isinstance(stop, list) and len(stop) <= fields.MAX_STOP and all(isinstance(s, str) for s in stop)):
            raise bad("stop", f"stop must be a list of at most {fields.MAX_STOP} strings")
        opts["stop"] = [s for s in stop if s]
    grammar = fields.structured(body)
    if grammar is not None:
        opts["grammar"] = grammar
    opts.update(fields.logit_bias(body))
    n_probs = body.get("n_probs")
    if n_probs is not None:
        if not (is_int(n_probs) and 0 <= n_probs <= fields.MAX_TOP_LOGPROBS):
            raise bad("n_probs", f"n_probs must be an integer in [0, {fields.MAX_TOP_LOGPROBS}], got {show(n_probs)}")
        if n_probs:
            opts["logprobs"] = n_probs
    return opts


class Limits:
    """llama-server's ends of a completion that the engine does not know:
    ``n_indent`` (a new line indented less than this many spaces or tabs ends
    it, cut before its first other character) and ``t_max_predict_ms`` (after
    this long, the next new line ends it). ``push(piece)`` returns the text
    that may be sent now; ``stopped`` says one of them ended it."""

    def __init__(self, body: dict):
        self.n_indent = _whole(body, "n_indent", 0)
        self.t_max_s = _whole(body, "t_max_predict_ms", 0) / 1000
        self.text, self.sent = "", 0
        self.stopped = False
        self._t0 = None      # the first piece's time (llama-server times from the first token)
        self._scan = 0       # where to look for the next new line
        self._line = None    # where a new line's text starts, while its indentation is unknown

    def push(self, piece: str) -> str:
        self._t0 = self._t0 or time.perf_counter()
        self.text += piece
        while self.n_indent and not self.stopped:
            if self._line is None:
                nl = self.text.find("\n", self._scan)
                if nl < 0:
                    break
                self._line = self._scan = nl + 1
            rest = self.text[self._line:]
            indent = len(rest) - len(rest.lstrip(" \t"))
            if indent == len(rest):
                break   # only spaces so far: its indentation is not known yet
            if indent < self.n_indent:   # cut before the line's first other character
                self.text = self.text[:self._line + indent]
                self.stopped = True
            self._line = None
        if "\n" in piece and self.t_max_s and time.perf_counter() - self._t0 > self.t_max_s:
            self.stopped = True
        end = self._line if self._line is not None and not self.stopped else len(self.text)
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


def _whole(body: dict, name: str, default: int) -> int:
    value = body.get(name, default)
    if value is None:
        return default
    if not is_int(value) or value < -1:
        raise bad(name, f"{name} must be an integer >= 0, got {show(value)}")
    return max(value, 0)


def _response_fields(body: dict) -> list[str] | None:
    value = body.get("response_fields")
    if value is None:
        return None
    if not (isinstance(value, list) and all(isinstance(f, str) for f in value)):
        raise bad("response_fields", "response_fields must be a list of field names (a/b for nested ones)")
    return value


def _picked(obj: dict, paths: list[str] | None) -> dict:
    """``obj`` reduced to ``paths`` (``timings/prompt_n`` moves a nested value
    to the top, under that name), as llama-server does; missing ones are left out."""
    if paths is None:
        return obj
    out = {}
    for path in paths:
        value, found = obj, True
        for key in path.split("/"):
            if isinstance(value, dict) and key in value:
                value = value[key]
            else:
                found = False
                break
        if found:
            out[path] = value
    return out


def _stream_flag(body: dict) -> bool:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", "stream must be a boolean")
    return stream


def _text_field(body: dict, name: str, required: bool) -> str:
    value = body.get(name)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise bad(name, f'"{name}" is required and must be a string' if required else f"{name} must be a string")
    return value


def _extra(body: dict) -> list[tuple[str, str]]:
    chunks = body.get("input_extra")
    if chunks is None:
        return []
    if not isinstance(chunks, list):
        raise bad("input_extra", 'input_extra must be a list of {"filename": string, "text": string}')
    out = []
    for i, c in enumerate(chunks):
        if not isinstance(c, dict) or not isinstance(c.get("text"), str):
            raise bad(f"input_extra[{i}]", f"input_extra[{i}] must hold a string text")
        name = c.get("filename", "tmp")
        if not isinstance(name, str):
            raise bad(f"input_extra[{i}]", f"input_extra[{i}].filename must be a string")
        out.append((name, c["text"]))
    return out


# -- endpoints ---------------------------------------------------------------------------

async def infill(request: Request):
    """llama-server's /infill: its prompt layout (extra files, the prefix's
    end and the suffix's start cut to its default batch, the typed ``prompt``
    after the prefix) from the model's FIM tokens."""
    body = await read_json(request)
    runner = pick_runner(request, _model(body))
    prefix = _text_field(body, "input_prefix", True)
    suffix = _text_field(body, "input_suffix", True)
    middle = _text_field(body, "prompt", False)
    extra = _extra(body)
    stream = _stream_flag(body)
    await runner.ready()
    opts = options(body, runner.n_ctx)
    engine = runner.engine
    n_predict = 0 if body.get("n_predict", body.get("max_tokens")) in (None, -1) else opts["max_tokens"]
    typed = len(engine.tokenize(middle, add_special=False, parse_special=True)) if middle else 0
    # llama-server's cut: 3/4 of a batch for the prefix, the rest for the suffix, for the extra
    # files what the context leaves after the batch and twice the answer (the batch no more than
    # half a small context)
    batch = min(FIM_BATCH, runner.n_ctx // 2)
    keep = (3 * (batch // 4), max(0, batch // 4 - (2 + typed)),
            max(0, runner.n_ctx - batch - max(2 * n_predict, 64)))

    def tokens():
        try:
            return engine.fill_in_middle_tokens(prefix, suffix, extra=extra, middle=middle, keep=keep)
        except InvalidArgumentError as e:   # a model without FIM tokens, text that is not UTF-8
            raise ApiError(400, str(e), param="input_prefix") from None

    c = Completion(prompt=await anyio.to_thread.run_sync(tokens))
    c.options = opts
    return await _answer(request, runner, c, body, stream)


async def completion(request: Request):
    """llama-server's /completion: a prompt (text, its special-token text
    parsed, or token ids) continued."""
    body = await read_json(request)
    runner = pick_runner(request, _model(body))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if not ((isinstance(prompt, str) and prompt)
            or (isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt))):
        raise bad("prompt", "prompt must be a non-empty string or a list of token ids")
    stream = _stream_flag(body)
    await runner.ready()
    c = Completion(prompt=prompt, parse_special=True)
    c.options = options(body, runner.n_ctx)
    return await _answer(request, runner, c, body, stream)


def _model(body: dict):
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "model must be a string")
    return model


async def _answer(request: Request, runner, c: Completion, body: dict, stream: bool):
    limits = Limits(body)
    paths = _response_fields(body)
    warm_only = body.get("n_predict", body.get("max_tokens")) == 0
    return_tokens = body.get("return_tokens") is True
    job = await runner.start(c, request)
    if stream:
        return Stream(_events(request, job, limits, paths, warm_only, return_tokens), "text/event-stream")
    try:
        text = await _text(job, limits, warm_only)
    finally:
        job.close()
    if job.client_gone:
        raise ClientGone()
    if job.cut:
        raise job.cut_error()
    return JSONResponse(_picked(_final(request, job, text, limits, warm_only, return_tokens), paths))


async def _text(job: Job, limits: Limits, warm_only: bool) -> str:
    """The whole answer, ended early where ``limits`` say."""
    parts = []
    async for piece in job.pieces():
        if warm_only or limits.stopped:
            continue   # the engine ends at its next piece (job.close)
        parts.append(limits.push(piece))
        if limits.stopped:
            job.close()
    return "" if warm_only else "".join(parts) + limits.finish()


def _final(request: Request, job: Job, text: str, limits: Limits, warm_only: bool, return_tokens: bool) -> dict:
    r = job.result
    s = r.stats
    predicted = 0 if warm_only else s.n_tokens
    stop_type = "limit" if limits.stopped or s.stop_reason in ("length", "context") else \
        "eos" if s.stop_reason == "eos" else "word" if s.stop_reason == "stop" else "none"
    timings = {"cache_n": s.cached_tokens, "prompt_n": s.prompt_tokens - s.cached_tokens,
               "prompt_ms": 1000 * s.prefill_s,
               "prompt_per_token_ms": 1000 * s.prefill_s / max(s.prompt_tokens - s.cached_tokens, 1),
               "prompt_per_second": s.prefill_tokens_per_s,
               "predicted_n": predicted, "predicted_ms": 1000 * s.decode_s,
               "predicted_per_token_ms": 1000 * s.decode_s / max(predicted, 1),
               "predicted_per_second": s.tokens_per_s}
    if s.spec is not None and s.spec.drafted:
        timings.update(draft_n=s.spec.drafted, draft_n_accepted=s.spec.accepted)
    note(request, f"{s.n_tokens} tokens {s.tokens_per_s:.1f} tok/s")
    opts = job.completion.options
    probabilities = {} if r.logprobs is None else \
        {"completion_probabilities": fields.token_probabilities(job.runner.engine, r.logprobs[:predicted])}
    return {**probabilities, "index": 0, "content": text, "tokens": r.tokens[:predicted] if return_tokens else [],
            "id_slot": s.slot, "stop": True, "model": job.runner.name, "tokens_predicted": predicted,
            "tokens_evaluated": s.prompt_tokens,
            "generation_settings": {k: opts[k] for k in (*DEFAULTS, "max_tokens") if k in opts} | {"seed": s.seed},
            "prompt": "", "has_new_line": "\n" in text, "truncated": False, "stop_type": stop_type,
            "stopping_word": "", "tokens_cached": s.prompt_tokens + predicted, "timings": timings,
            "edgespec": {"drafter": s.drafter, "estimated_speedup": round(job.estimated_speedup, 3),
                         "spec": s.spec.to_dict() if s.spec is not None else None}}


def _event(obj: dict) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode("utf-8")


async def _events(request: Request, job: Job, limits: Limits, paths, warm_only: bool, return_tokens: bool):
    """A chunk per piece ({content, stop: false, ...}), then the final object
    (stop: true); a failure is an error event."""
    n = 0
    sent = 0   # completion_probabilities entries sent (n_probs)
    try:
        async for piece in stream_pieces(request, job):
            if isinstance(piece, ApiError):
                yield _event({"error": piece.body()["error"]})
                return
            if warm_only or limits.stopped:
                continue
            text = limits.push(piece)
            if limits.stopped:
                job.close()
            n += 1
            if text:
                chunk = {"index": 0, "content": text, "tokens": [], "stop": False, "id_slot": -1,
                         "tokens_predicted": n, "tokens_evaluated": 0}
                if job.completion.options.get("logprobs") is not None:
                    new = job.logprobs[sent:]
                    sent += len(new)
                    chunk["completion_probabilities"] = fields.token_probabilities(job.runner.engine, new)
                yield _event(_picked(chunk, paths))
        if job.client_gone:
            return
        tail = "" if warm_only else limits.finish()
        final = _final(request, job, tail, limits, warm_only, return_tokens)
        if "completion_probabilities" in final:   # the stream sent those of its chunks already
            final["completion_probabilities"] = final["completion_probabilities"][sent:]
        yield _event(_picked(final, paths))
    finally:
        job.close()


# -- utility endpoints -------------------------------------------------------------------

async def tokenize(request: Request):
    """``content`` (text, or a list of texts and token ids) -> ``tokens``
    (with ``with_pieces``: {id, piece}, a piece that is no whole UTF-8 text as
    its bytes); ``add_special`` (default false), ``parse_special`` (default
    true), as llama-server."""
    body = await read_json(request)
    runner = pick_runner(request, _model(body))
    content = body.get("content")
    if content is None:
        return JSONResponse({"tokens": []})
    parts = [content] if isinstance(content, str) else content
    if not (isinstance(parts, list) and all(isinstance(p, str) or is_int(p) for p in parts)):
        raise bad("content", "content must be a string or a list of strings and token ids")
    flags = {}
    for name, default in (("add_special", False), ("parse_special", True), ("with_pieces", False)):
        flags[name] = body.get(name, default)
        if not isinstance(flags[name], bool):
            raise bad(name, f"{name} must be a boolean")
    await runner.ready()
    engine = runner.engine
    tokens = []
    try:
        for k, part in enumerate(parts):
            if isinstance(part, str):
                tokens += engine.tokenize(part, add_special=flags["add_special"] and k == 0,
                                          parse_special=flags["parse_special"])
            elif 0 <= part < engine.backend.n_vocab:
                tokens.append(part)
            else:
                raise InvalidArgumentError(f"token id {part} is outside the vocabulary [0, {engine.backend.n_vocab})")
    except InvalidArgumentError as e:
        raise bad("content", str(e)) from None
    if not flags["with_pieces"]:
        return JSONResponse({"tokens": tokens})
    pieces = []
    for t in tokens:
        raw = engine.backend.piece(t) or engine.backend.token_text(t).encode()   # a control token: its text
        try:
            piece = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        pieces.append({"id": t, "piece": piece})
    return JSONResponse({"tokens": pieces})


async def detokenize(request: Request):
    """``tokens`` -> ``content``."""
    body = await read_json(request)
    runner = pick_runner(request, _model(body))
    tokens = body.get("tokens", [])
    if not (isinstance(tokens, list) and all(is_int(t) for t in tokens)):
        raise bad("tokens", "tokens must be a list of token ids")
    await runner.ready()
    engine = runner.engine
    try:
        return JSONResponse({"content": engine.detokenize(tokens)})
    except InvalidArgumentError as e:
        raise bad("tokens", str(e)) from None


async def apply_template(request: Request):
    """An OpenAI chat request's ``messages`` (and ``tools``) -> ``prompt``,
    the text the model reads for it."""
    body = await read_json(request)
    runner = pick_runner(request, _model(body))
    messages = openai.messages(body)
    tools = fields.engine_options({k: body[k] for k in ("tools", "tool_choice") if k in body}, True).get("tools")
    await runner.ready()
    engine = runner.engine
    try:
        prompt = await anyio.to_thread.run_sync(lambda: engine.render_chat(messages, tools=tools))
    except InvalidArgumentError as e:
        raise bad("messages", str(e)) from None
    return JSONResponse({"prompt": prompt})


async def props(request: Request):
    """llama-server's description of the model and its settings."""
    runner = pick_runner(request, request.query_params.get("model"))
    await runner.ready()
    engine = runner.engine
    b = engine.backend
    capabilities = await anyio.to_thread.run_sync(lambda: engine.capabilities)
    params = {**DEFAULTS, "n_predict": -1, "seed": -1, "stop": [], "samplers": list(SAMPLERS)[:-1],
              "speculative": engine.drafter != "none", "drafter": engine.drafter}
    return JSONResponse({
        "default_generation_settings": {"params": params, "n_ctx": runner.n_ctx},
        "total_slots": b.n_slots, "parallel": engine.parallel, "model_alias": runner.name, "model_path": str(engine.model_path),
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": True, "endpoint_props": False, "endpoint_metrics": True,
        "chat_template": engine.chat_template or "",
        "chat_template_caps": {"supports_tools": "tools" in capabilities, "supports_system_role": True},
        "bos_token": b.token_text(b.bos_token), "eos_token": b.token_text(b.eos_token),
        "build_info": f"edgespec {__version__} ({b.name} backend)", "is_sleeping": False,
        "capabilities": list(capabilities)})


async def slots(request: Request):
    """Each KV-cache slot: its context size, the tokens it holds, whether a
    generation runs in it now."""
    runner = pick_runner(request, request.query_params.get("model"))
    await runner.ready()
    engine = runner.engine
    busy = engine.running_slots()
    sizes = engine.backend.slot_sizes()
    return JSONResponse([{"id": s["slot"], "id_task": -1, "n_ctx": sizes[s["slot"]],
                          "speculative": engine.drafter != "none",
                          "is_processing": s["slot"] in busy,
                          "n_prompt_tokens": s["tokens"], "n_prompt_tokens_cache": s["reused"],
                          "uses": s["uses"], "prefix_hits": s["prefix_hits"]}
                         for s in engine.slot_stats()])


SLOT_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_SAVING = threading.Lock()   # one save at a time: each is checked against what the others left


def _save_capped(engine, slot: int, path: Path, settings) -> dict:
    """Engine.save_slot(slot, path) unless the slot files of every model
    (``<slots>/<model>/<file>``; ``path`` replaced counts as gone) would then
    pass ``settings.max_slot_files`` or ``max_slot_bytes``: a 409 naming the
    cap instead. The file is written aside and renamed once its size is
    known, so a refused save leaves nothing and an old file of its name as it
    was."""
    with _SAVING:
        kept = [f for f in path.parent.parent.glob("*/*") if SLOT_FILE.fullmatch(f.name) and f != path and f.is_file()]
        held = sum(f.stat().st_size for f in kept)
        if len(kept) >= settings.max_slot_files:
            raise _slots_full(path, f"{len(kept)} slot files are kept, the most this server keeps "
                              f"(edgespec serve --max-slot-files {settings.max_slot_files})")
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_output(path) as aside:
            done = engine.save_slot(slot, aside)
            if held + done["bytes"] > settings.max_slot_bytes:
                raise _slots_full(path, f"this slot's {done['bytes']} bytes would bring the slot files to "
                                  f"{held + done['bytes']}, over this server's cap (edgespec serve --max-slot-bytes "
                                  f"{settings.max_slot_bytes})")
        return done


def _slots_full(path: Path, why: str) -> ApiError:
    return ApiError(409, f"{path.name} was not saved: {why}; save under a kept name to replace it, or delete "
                    f"files in {path.parent.parent}", param="filename", code="slot_files_full")


async def slot_action(request: Request):
    """``?action=save`` / ``restore`` (``{"filename": name}``, a plain file
    name under the slots folder) or ``erase``, as llama-server's."""
    runner = pick_runner(request, request.query_params.get("model"))
    try:
        slot = int(request.path_params["id_slot"])
    except ValueError:
        raise bad("id_slot", f"invalid slot ID {show(request.path_params['id_slot'])}") from None
    action = request.query_params.get("action")
    if action not in ("save", "restore", "erase"):
        raise bad("action", f"action must be save, restore or erase, got {show(action)}")
    body = await read_json(request) if action != "erase" else {}
    await runner.ready()
    engine = runner.engine
    if not 0 <= slot < engine.backend.n_slots:
        raise bad("id_slot", f"invalid slot ID {slot}: this model has slots 0 to {engine.backend.n_slots - 1}")
    if action == "erase":
        n = await anyio.to_thread.run_sync(engine.erase_slot, slot)
        return JSONResponse({"id_slot": slot, "n_erased": n})
    name = body.get("filename")
    if not (isinstance(name, str) and SLOT_FILE.fullmatch(name)):
        raise bad("filename", "filename must be a plain file name (letters, digits, . _ -), no folders")
    folder = registry.home() / "slots" / runner.name
    t0 = time.perf_counter()
    try:
        if action == "save":
            done = await anyio.to_thread.run_sync(_save_capped, engine, slot, folder / name,
                                                  request.app.state.settings)
        else:
            if not (folder / name).is_file():
                raise ApiError(404, f"no saved slot named {name}", param="filename", code="not_found")
            done = await anyio.to_thread.run_sync(engine.restore_slot, slot, folder / name)
    except InvalidArgumentError as e:
        raise bad("filename", str(e)) from None
    except OSError as e:
        raise ApiError(500, f"cannot write {name}: {e.strerror or e}", type="server_error") from None
    except EdgespecError as e:   # a backend that cannot save its cache
        raise ApiError(501, str(e), type="not_supported_error") from None
    ms = 1000 * (time.perf_counter() - t0)
    if action == "save":
        return JSONResponse({"id_slot": slot, "filename": name, "n_saved": done["tokens"], "n_written": done["bytes"],
                             "timings": {"save_ms": ms}})
    return JSONResponse({"id_slot": slot, "filename": name, "n_restored": done["tokens"], "n_read": done["bytes"],
                         "timings": {"restore_ms": ms}})
