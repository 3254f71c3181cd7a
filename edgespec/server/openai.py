"""OpenAI's API: ``GET /v1/models``, ``GET /v1/models/{id}``,
``POST /v1/chat/completions`` and ``POST /v1/completions`` (``stream`` for
server-sent events, ``stream_options.include_usage`` for a usage chunk),
``POST /v1/embeddings`` (``encoding_format`` float or base64). /v1/models
lists every model the server serves, with ``loaded`` saying which are in
memory now.
Responses carry OpenAI's fields plus ``edgespec``: the generation's drafter,
tokens per second, estimated_speedup over plain decoding and speculative
stats.

Defaults where OpenAI's differ from the engine's: ``temperature`` is 1.0 when
omitted (OpenAI's default; send 0 for greedy, reproducible output),
``max_tokens`` (or its newer name ``max_completion_tokens``; both with different
values are a 400) is 256, capped at the room the prompt leaves in the context.
``n`` (at most 16) choices run as concurrent generations, batched on a
``--parallel`` server and queued beyond it; choice i > 0 uses seed + i.
OpenAI fields this server cannot honour (audio, prediction,
web_search_options, the deprecated functions, reasoning_effort, verbosity,
store: true, modalities other than text) are a 400 naming them; user,
metadata, service_tier, prompt_cache_key and safety_identifier say nothing
about the answer and are taken; fields OpenAI does not define are ignored,
as OpenAI's clients send extras (docs/server.md lists them all).
Ranges are OpenAI's: temperature in [0, 2] (below 1e-6 is greedy), top_p in
[0, 1] (0 keeps the most likely token only), at most 16 stop strings.
Structured output, tools, logprobs, penalties, top_k and min_p: fields.py.
A reply with tools is parsed for calls (``tool_calls``, finish_reason
"tool_calls"; streamed as one delta per call once the reply ends); a call
that does not parse is returned as text with finish_reason "stop" and a
``warning`` beside it in the choice.
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import time
import uuid

import anyio

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ..chat import tools as chat_tools
from . import fields
from .request import Stream, endpoint, note, pick_runner, read_json, runners_of, stream_pieces
from .errors import ApiError, bad, is_int, is_number, show
from .runner import FINISH_REASON, Completion, Job

DEFAULT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 1.0     # OpenAI's default
MAX_TEMPERATURE = 2.0         # OpenAI's range: [0, 2]
MAX_N = 16                    # choices per request
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
              "tool": "tool"}


def routes() -> list[Route]:
    return [
        Route("/v1/models", endpoint(list_models), methods=["GET"]),
        Route("/v1/models/{model:path}", endpoint(get_model), methods=["GET"]),
        Route("/v1/chat/completions", endpoint(chat_completions), methods=["POST"]),
        Route("/v1/completions", endpoint(completions), methods=["POST"]),
        Route("/v1/embeddings", endpoint(embeddings), methods=["POST"]),
    ]


# -- request fields ----------------------------------------------------------------------

def options(body: dict) -> dict:
    """Engine.stream's keyword arguments from a completion request's sampling fields."""
    opts: dict = {}
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None \
            and body["max_tokens"] != body["max_completion_tokens"]:
        raise bad("max_completion_tokens", "give max_tokens or max_completion_tokens (its newer name), not "
                  f"both with different values ({show(body['max_tokens'])} and "
                  f"{show(body['max_completion_tokens'])})")
    param = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
    max_tokens = body.get(param)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not is_int(max_tokens) or max_tokens <= 0:
        raise bad(param, f"{param} must be an integer > 0, got {show(max_tokens)}")
    opts["max_tokens"] = max_tokens

    temperature = body.get("temperature")
    if temperature is None:
        temperature = DEFAULT_TEMPERATURE
    if not is_number(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
        raise bad("temperature", f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], "
                  f"got {show(temperature)}")
    opts["temperature"] = float(temperature) if temperature >= fields.MIN_TEMPERATURE else 0.0

    top_p = body.get("top_p")
    if top_p is not None:
        if not is_number(top_p) or not 0 <= top_p <= 1:
            raise bad("top_p", f"top_p must be a number in [0, 1], got {show(top_p)}")
        opts["top_p"] = max(float(top_p), fields.MIN_TOP_P)

    seed = body.get("seed")
    if seed is not None:
        if not is_int(seed) or not 0 <= seed < 2**64:
            raise bad("seed", f"seed must be an integer in [0, 2**64), got {show(seed)}")
        opts["seed"] = seed

    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not (isinstance(stops, list) and len(stops) <= fields.MAX_STOP
                and all(isinstance(s, str) and s for s in stops)):
            raise bad("stop", f"stop must be a non-empty string or a list of at most {fields.MAX_STOP} "
                      "non-empty strings")
        opts["stop"] = stops

    return opts


def choices(body: dict) -> int:
    """``n``: the choices to generate, each in a generation of its own (run at
    once, batched, as far as the server's --parallel allows; queued beyond it)."""
    n = body.get("n", 1)
    if n is None:
        return 1
    if not (is_int(n) and 1 <= n <= MAX_N):
        raise bad("n", f"n must be an integer in [1, {MAX_N}], got {show(n)}")
    return n


def messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        role = m.get("role") if isinstance(m, dict) else None
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise bad(f"messages[{i}]", f"messages[{i}] must be an object with role "
                      "system, developer, user, assistant or tool")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):  # content parts: only text is served
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(p["text"] for p in content)
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content", f"messages[{i}].content must be a string")
        msg = {"role": CHAT_ROLES[role], "content": content}
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls):
                raise bad(f"messages[{i}].tool_calls", "tool_calls belong to assistant messages: a list of "
                          '{"id", "type": "function", "function": {"name", "arguments"}}')
            msg["tool_calls"] = calls
        if role == "tool" and isinstance(m.get("tool_call_id"), str):
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def prompt(body: dict) -> str | list[int]:
    """A completion's prompt: a string or a list of token ids (or a one-element
    list of either; several prompts would need n > 1). With ``suffix`` an empty
    prompt is allowed: the middle goes at the start."""
    text = body.get("prompt")
    if isinstance(text, list) and len(text) == 1 and isinstance(text[0], (str, list)):
        text = text[0]
    if isinstance(text, list) and text and all(is_int(t) for t in text):
        return text
    if not isinstance(text, str) or not (text or isinstance(body.get("suffix"), str)):
        raise bad("prompt", "prompt must be a non-empty string or a list of token ids")
    return text


def suffix(body: dict) -> str | None:
    """``suffix``: fill in the middle between the prompt and this text."""
    value = body.get("suffix")
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad("suffix", "suffix must be a string")
    if isinstance(body.get("prompt"), list) and not isinstance(prompt(body), str):
        raise bad("suffix", "suffix needs a text prompt, not token ids")
    return value


# OpenAI fields with no meaning here, at the value that asks for nothing: any other is a 400.
UNSERVED = {"audio": None, "prediction": None, "web_search_options": None, "functions": None,
            "function_call": None, "reasoning_effort": None, "verbosity": None, "store": False}


def _refuse_unserved(body: dict, chat: bool) -> None:
    """Fields this server cannot honour: a 400 rather than ignoring them."""
    for name, off in UNSERVED.items():
        if body.get(name, off) not in (off, None):
            raise bad(name, f"{name} is not supported by this server" + (" (use tools)" if "function" in name else ""))
    modalities = body.get("modalities")
    if modalities not in (None, ["text"]):
        raise bad("modalities", "only text output is supported (modalities: [\"text\"])")
    if chat:
        return
    if body.get("echo") is True:
        raise bad("echo", "echo is not supported")
    best_of = body.get("best_of")
    if best_of is not None and not (is_int(best_of) and best_of == 1):
        raise bad("best_of", f"only best_of = 1 is supported, got {show(best_of)}")


def completion(body: dict, chat: bool) -> tuple[Completion, bool, bool]:
    """(the Completion, stream, include_usage) of a request body (its ``n``: ``choices``)."""
    opts = options(body)
    opts.update(fields.engine_options(body, chat))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", "stream must be a boolean")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise bad("stream_options", "stream_options must be an object")
    _refuse_unserved(body, chat)
    if chat:
        c = Completion(messages=messages(body))
    else:
        # as llama-server: a prompt's special-token text is those tokens (editors send FIM prompts so)
        c = Completion(prompt=prompt(body), suffix=suffix(body), parse_special=True)
    c.options = opts
    return c, stream, stream_options.get("include_usage") is True


def model_field(body: dict):
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "model must be a string")
    return model


# -- endpoints ---------------------------------------------------------------------------

def _card(runner) -> dict:
    return {"id": runner.name, "object": "model", "created": runner.created, "owned_by": "edgespec",
            "loaded": runner.loaded}


async def list_models(request: Request):
    return JSONResponse({"object": "list", "data": [_card(r) for r in runners_of(request)]})


async def get_model(request: Request):
    return JSONResponse(_card(pick_runner(request, request.path_params["model"], add=False)))


async def embeddings(request: Request):
    """One vector per input (a string, a list of strings, a list of token ids
    or of such lists): the model's hidden states pooled as its metadata says
    (mean by default), unit length; ``dimensions``: the first so many of each,
    at unit length again (as OpenAI shortens its text-embedding-3 vectors)."""
    body = await read_json(request)
    runner = pick_runner(request, model_field(body))
    if "input" not in body:
        raise bad("input", "input is required: a string, a list of strings or of token id lists")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad("encoding_format", f"encoding_format must be float or base64, got {show(fmt)}")
    dimensions = body.get("dimensions")
    if dimensions is not None and not (is_int(dimensions) and dimensions > 0):
        raise bad("dimensions", f"dimensions must be an integer > 0, got {show(dimensions)}")
    vectors, n_tokens = await anyio.to_thread.run_sync(lambda: runner.embed(body["input"], dimensions=dimensions))
    if fmt == "base64":   # little-endian float32, as OpenAI's clients decode it
        data = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in vectors]
    else:
        data = [v.tolist() for v in vectors]
    note(request, f"{len(data)} embeddings, {n_tokens} tokens")
    return JSONResponse({"object": "list", "model": runner.name,
                         "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
                         "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})


async def chat_completions(request: Request):
    return await _complete(request, chat=True)


async def completions(request: Request):
    return await _complete(request, chat=False)


async def _complete(request: Request, chat: bool):
    body = await read_json(request)
    runner = pick_runner(request, model_field(body))
    c, stream, include_usage = completion(body, chat)
    jobs = await _start(runner, [_variant(c, i) for i in range(choices(body))], request)
    head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "object": ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion",
            "created": int(time.time()), "model": runner.name}
    if stream:
        return Stream(_events(request, jobs, head, chat, include_usage), "text/event-stream")
    try:
        texts = [await job.text() for job in jobs]
    finally:
        for job in jobs:
            job.close()
    choices_ = [_choice(job, text, i, chat) for i, (job, text) in enumerate(zip(jobs, texts))]
    usage, extra = extras(request, jobs)
    return JSONResponse({**head, "choices": choices_, "usage": usage, "edgespec": extra})


def _variant(c: Completion, i: int) -> Completion:
    """Choice ``i`` of a request: its own seed (the request's + i) after the first."""
    if i == 0 or c.options.get("seed") is None:
        return c
    return dataclasses.replace(c, options={**c.options, "seed": (c.options["seed"] + i) % 2**64})


async def _start(runner, completions: list[Completion], request: Request) -> list[Job]:
    """Each completion's job, started together (they share the batch as
    concurrent users do); if one is refused, the others are closed."""
    started = await asyncio.gather(*(runner.start(c, request) for c in completions), return_exceptions=True)
    failed = next((s for s in started if isinstance(s, BaseException)), None)
    if failed is not None:
        for s in started:
            if isinstance(s, Job):
                s.close()
        raise failed
    return started


def _choice(job: Job, text: str, index: int, chat: bool) -> dict:
    r = job.result
    finish = FINISH_REASON.get(r.stats.stop_reason, "stop")
    engine = job.runner.engine
    if chat:
        message = {"role": "assistant", "content": text}
        logprobs = fields.chat_logprobs(engine, r.logprobs) if r.logprobs is not None else None
        choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
        if r.parsed is not None:
            choice["message"], calls = fields.tool_message(r.parsed)
            choice["finish_reason"] = calls or ("stop" if r.parsed.warning else finish)
            if r.parsed.warning:
                choice["warning"] = r.parsed.warning
        return choice
    logprobs = fields.completion_logprobs(engine, r.logprobs) if r.logprobs is not None else None
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def extras(request: Request, jobs: list[Job]) -> tuple[dict, dict]:
    """(usage, edgespec) of finished generations (one request's choices: the
    prompt counted once, the completions summed); notes it for the log line."""
    first = jobs[0].result.stats
    n_tokens = sum(job.result.stats.n_tokens for job in jobs)
    usage = {"prompt_tokens": first.prompt_tokens, "completion_tokens": n_tokens,
             "total_tokens": first.prompt_tokens + n_tokens,
             "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}
    extra = {"drafter": first.drafter, "tokens_per_s": round(first.tokens_per_s, 3),
             "estimated_speedup": round(jobs[0].estimated_speedup, 3), "slot": first.slot,
             "spec": first.spec.to_dict() if first.spec is not None else None}
    note(request, f"{n_tokens} tokens {first.tokens_per_s:.1f} tok/s" + (f" ({len(jobs)} choices)" if len(jobs) > 1 else ""))
    return usage, extra


def _event(obj) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode("utf-8")


async def _events(request: Request, jobs: list[Job], head: dict, chat: bool, include_usage: bool):
    """The server-sent events of a streamed completion: each choice's chunks
    (``_choice_events``) as they come, choices interleaved; usage on
    request, [DONE]. A failure mid-generation is an error event, without
    [DONE]; a client that left gets nothing more."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, job: Job) -> None:
        try:
            async for item in _choice_events(request, job, head, chat, i):
                await queue.put(item)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        ended = 0
        while ended < len(jobs):
            item = await queue.get()
            if item is None:
                ended += 1
            elif item == b"":   # a choice failed (its error event was sent) or the client left
                return
            else:
                yield item
        usage, _ = extras(request, jobs)
        if include_usage:
            yield _event({**head, "choices": [], "usage": usage})
        yield _event("[DONE]")
    finally:
        for task in tasks:
            task.cancel()
        for job in jobs:
            job.close()


async def _choice_events(request: Request, job: Job, head: dict, chat: bool, index: int):
    """One choice's chunks: a chunk per piece, then a final chunk with
    finish_reason and the edgespec stats; an error event then b"" when the
    generation fails, b"" alone when the client left."""

    engine = job.runner.engine
    want_logprobs = job.completion.options.get("logprobs") is not None
    sent = 0      # logprobs entries sent
    offset = 0    # completions: text offset of the next token

    def new_logprobs():
        nonlocal sent, offset
        if not want_logprobs:
            return None
        lps = job.logprobs[sent:]
        sent += len(lps)
        if chat:
            return fields.chat_logprobs(engine, lps)
        out = fields.completion_logprobs(engine, lps, offset)
        offset += sum(len(t) for t in out["tokens"])
        return out

    def chunk(delta_or_text, finish=None, logprobs=None) -> dict:
        if chat:
            choice = {"index": index, "delta": delta_or_text, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": delta_or_text, "logprobs": logprobs, "finish_reason": finish}
        return {**head, "choices": [choice]}

    tools = job.completion.tools if chat else None
    calls = chat_tools.ToolCallStream(chat_tools.style_of(engine.chat_template or ""), tools) if tools else None
    if chat:
        yield _event(chunk({"role": "assistant", "content": ""}))
    async for piece in stream_pieces(request, job):
        if isinstance(piece, ApiError):
            yield _event({"error": piece.body()["error"]})
            yield b""
            return
        text = calls.push(piece) if calls else piece
        lps = new_logprobs()
        if text or lps:
            yield _event(chunk({"content": text} if chat else text, logprobs=lps))
    if job.client_gone:
        yield b""
        return
    _, extra = extras(request, [job])
    finish = FINISH_REASON.get(job.result.stats.stop_reason, "stop")
    warning = None
    if calls:
        tail, parsed = calls.finish()
        if tail:
            yield _event(chunk({"content": tail}))
        for i, call in enumerate(parsed.tool_calls):
            yield _event(chunk({"tool_calls": [call.to_openai(index=i)]}))
        finish = "tool_calls" if parsed.tool_calls else "stop" if parsed.warning else finish
        warning = parsed.warning
    final = chunk({} if chat else "", finish, new_logprobs())
    if warning:
        final["choices"][0]["warning"] = warning
    final["edgespec"] = extra
    yield _event(final)
