"""Anthropic's Messages API: ``POST /v1/messages`` (``stream`` for its
server-sent events) and ``POST /v1/messages/count_tokens``, so that apps
written against Anthropic's SDK run on a local model, as llama-server serves
them. The API key is taken from ``x-api-key`` as well as ``Authorization``.

A request becomes the same Completion an OpenAI chat does: ``system`` (a
string or text blocks) is the system message; a message's content is a string
or blocks: ``text``; ``tool_use`` (an assistant's call) and ``tool_result``
(the user's answer to one) become the chat's tool calls and tool messages;
``thinking`` blocks are dropped (no model here thinks aloud); images and
documents are a 400. ``tools`` ({name, description, input_schema}) and
``tool_choice`` (auto, any: a call is required, tool: that one, none) are
OpenAI's tools and tool_choice. ``max_tokens`` is required, ``temperature``
in [0, 1] (1 when omitted, Anthropic's default), ``top_p``, ``top_k``,
``stop_sequences`` (at most 16). A reply's calls come back as ``tool_use``
blocks with ``stop_reason`` "tool_use". Refusals have Anthropic's error shape.
"""
from __future__ import annotations

import json
import uuid

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ..chat import tools as chat_tools
from . import fields
from .errors import ANTHROPIC, ApiError, bad, is_int, is_number, show
from .request import Stream, endpoint, note, pick_runner, read_json, stream_pieces
from .runner import Completion, Job

DEFAULT_TEMPERATURE = 1.0   # Anthropic's default
STOP_REASON = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens", "context": "max_tokens",
               "cancelled": "end_turn"}


def routes() -> list[Route]:
    return [
        Route("/v1/messages", endpoint(messages, ANTHROPIC), methods=["POST"]),
        Route("/v1/messages/count_tokens", endpoint(count_tokens, ANTHROPIC), methods=["POST"]),
    ]


# -- request fields ---------------------------------------------------------------------

def _text_of(content, where: str) -> str:
    """A string, or text blocks joined (a system prompt, a tool result)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         and isinstance(b.get("text"), str) for b in content):
        return "".join(b["text"] for b in content)
    raise bad(where, f"{where} must be a string or a list of text blocks")


def _message(m, i: int) -> list[dict]:
    """The chat messages (edgespec's, OpenAI-shaped) of Anthropic message ``i``."""
    where = f"messages[{i}]"
    role = m.get("role") if isinstance(m, dict) else None
    if role not in ("user", "assistant"):
        raise bad(where, f"{where} must be an object with role user or assistant")
    content = m.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(blocks, list):
        raise bad(f"{where}.content", f"{where}.content must be a string or a list of content blocks")
    text, calls, results = [], [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_use" and role == "assistant" and isinstance(b.get("name"), str):
            calls.append({"id": str(b.get("id") or "toolu_" + uuid.uuid4().hex[:24]), "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})}})
        elif kind == "tool_result" and role == "user" and isinstance(b.get("tool_use_id"), str):
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": _text_of(b.get("content", ""), f"{at}.content")})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise bad(at, f"{at}: only text, tool_use (assistant) and tool_result (user) blocks are "
                      f"supported, got {show(kind)}")
    out = results
    if text or calls or not results:
        msg = {"role": role, "content": "".join(text)}
        if calls:
            msg["tool_calls"] = calls
        out = out + [msg]
    return out


def chat(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "messages must be a non-empty list of {role, content} objects")
    out = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _text_of(body["system"], "system")})
    for i, m in enumerate(msgs):
        out += _message(m, i)
    return out


def _tools(body: dict) -> dict:
    """OpenAI's tools and tool_choice from Anthropic's."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None and choice is None:
        return {}
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise bad("tools", "tools must be a list of {name, description, input_schema} objects")
        for i, t in enumerate(tools):
            if t.get("type") not in (None, "custom"):
                raise bad(f"tools[{i}]", f"tools[{i}]: server tools ({show(t.get('type'))}) are not supported")
        tools = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                                   "parameters": t.get("input_schema", {"type": "object"})}}
                 for t in tools]
    parallel = None   # the engine's: one call in a reply
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none") or (kind == "tool" and not isinstance(choice.get("name"), str)):
            raise bad("tool_choice", 'tool_choice must be {"type": "auto" | "any" | "none"} or '
                      '{"type": "tool", "name": ...}')
        if choice.get("disable_parallel_tool_use") is False:   # several calls in one reply, as the client says
            parallel = True
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or \
            {"type": "function", "function": {"name": choice["name"]}}
    return fields.tool_options({"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}, None)


def options(body: dict) -> dict:
    max_tokens = body.get("max_tokens")
    if not is_int(max_tokens) or max_tokens <= 0:
        raise bad("max_tokens", f"max_tokens is required: an integer > 0, got {show(max_tokens)}")
    opts = {"max_tokens": max_tokens}
    temperature = body.get("temperature", DEFAULT_TEMPERATURE)
    if not is_number(temperature) or not 0 <= temperature <= 1:
        raise bad("temperature", f"temperature must be a number in [0, 1], got {show(temperature)}")
    opts["temperature"] = float(temperature) if temperature >= fields.MIN_TEMPERATURE else 0.0
    top_p = body.get("top_p")
    if top_p is not None:
        if not is_number(top_p) or not 0 < top_p <= 1:
            raise bad("top_p", f"top_p must be a number in (0, 1], got {show(top_p)}")
        opts["top_p"] = float(top_p)
    top_k = body.get("top_k")
    if top_k is not None:
        if not is_int(top_k) or top_k < 0:
            raise bad("top_k", f"top_k must be an integer >= 0, got {show(top_k)}")
        opts["top_k"] = top_k
    stop = body.get("stop_sequences")
    if stop is not None:
        if not (isinstance(stop, list) and len(stop) <= fields.MAX_STOP and all(isinstance(s, str) and s for s in stop)):
            raise bad("stop_sequences", f"stop_sequences must be a list of at most {fields.MAX_STOP} non-empty strings")
        opts["stop"] = stop
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        raise bad("thinking", "extended thinking is not supported by this server")
    opts.update(_tools(body))
    return opts


def completion(body: dict) -> tuple[Completion, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", "stream must be a boolean")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "model must be a string")
    return Completion(messages=chat(body), options=options(body)), stream


# -- endpoints -----------------------------------------------------------------------------

async def count_tokens(request: Request):
    body = await read_json(request)
    runner = pick_runner(request, body.get("model"))
    opts = _tools(body)
    c = Completion(messages=chat(body), options=opts)
    n = await anyio.to_thread.run_sync(runner.count_tokens, c)
    return JSONResponse({"input_tokens": n})


def _usage(job: Job) -> dict:
    s = job.result.stats
    return {"input_tokens": s.prompt_tokens, "output_tokens": s.n_tokens, "cache_read_input_tokens": s.cached_tokens}


def _head(runner) -> dict:
    return {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant", "model": runner.name}


def _tool_use(call: chat_tools.ToolCall) -> dict:
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = {}
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": arguments}


def _stop(job: Job, calls: bool) -> tuple[str, str | None]:
    s = job.result.stats
    if calls:
        return "tool_use", None
    return STOP_REASON.get(s.stop_reason, "end_turn"), s.stop_string if s.stop_reason == "stop" else None


async def messages(request: Request):
    body = await read_json(request)
    runner = pick_runner(request, body.get("model"))
    c, stream = completion(body)
    job = await runner.start(c, request)
    head = _head(runner)
    if stream:
        return Stream(_events(request, job, head), "text/event-stream")
    text = await job.text()
    parsed = job.result.parsed
    calls = parsed.tool_calls if parsed is not None else []
    content = parsed.content if parsed is not None and calls else text
    blocks = ([{"type": "text", "text": content}] if content else []) + [_tool_use(c) for c in calls]
    stop_reason, stop_sequence = _stop(job, bool(calls))
    note(request, f"{job.result.stats.n_tokens} tokens")
    return JSONResponse({**head, "content": blocks, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                         "usage": _usage(job)})


def _event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n".encode("utf-8")


async def _events(request: Request, job: Job, head: dict):
    """Anthropic's stream: message_start, a text block's start, deltas and
    stop (once there is text), a tool_use block per call once the reply ends,
    message_delta (stop_reason, output tokens), message_stop. A failure
    mid-generation is an ``error`` event."""
    engine = job.runner.engine
    tools = job.completion.tools
    calls = chat_tools.ToolCallStream(chat_tools.style_of(engine.chat_template or ""), tools) if tools else None
    index = 0
    text_open = False

    def text(piece: str):
        nonlocal text_open
        if not text_open:
            text_open = True
            yield _event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
        yield _event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": piece}})

    try:
        yield _event("message_start", {"message": {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                                                   "usage": {"input_tokens": job.prompt_tokens, "output_tokens": 0}}})
        yield _event("ping", {})
        async for piece in stream_pieces(request, job):
            if isinstance(piece, ApiError):
                yield _event("error", {"error": piece.body(ANTHROPIC)["error"]})
                return
            shown = calls.push(piece) if calls else piece
            if shown:
                for event in text(shown):
                    yield event
        if job.client_gone:
            return
        parsed = []
        if calls:
            tail, result = calls.finish()
            if tail:
                for event in text(tail):
                    yield event
            parsed = result.tool_calls
        if text_open:
            yield _event("content_block_stop", {"index": index})
            index += 1
        for call in parsed:
            block = _tool_use(call)
            yield _event("content_block_start", {"index": index, "content_block": {**block, "input": {}}})
            yield _event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta",
                                                                           "partial_json": json.dumps(block["input"])}})
            yield _event("content_block_stop", {"index": index})
            index += 1
        stop_reason, stop_sequence = _stop(job, bool(parsed))
        yield _event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                       "usage": {"output_tokens": job.result.stats.n_tokens}})
        yield _event("message_stop", {})
        note(request, f"{job.result.stats.n_tokens} tokens")
    finally:
        job.close()
