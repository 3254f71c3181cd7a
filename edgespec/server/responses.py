"""OpenAI's Responses API: ``POST /v1/responses`` (``stream`` for its typed
server-sent events), ``GET /v1/responses/{id}`` and ``DELETE
/v1/responses/{id}``, which OpenAI's SDK (``client.responses``) and agent
frameworks now call.

A request becomes the Completion an OpenAI chat does: ``instructions`` is the
system message; ``input`` is a string (one user message) or a list of items:
messages (role user, assistant, system or developer; content a string or
``input_text`` / ``output_text`` parts), ``function_call`` items (an earlier
reply's calls) and ``function_call_output`` items (their results).
``tools`` are function tools (``{type: function, name, description,
parameters}``; built-in tools such as web search are a 400), ``tool_choice``
auto, none, required or ``{type: function, name}``; ``text.format``
(json_schema, json_object, text) is the response format;
``max_output_tokens``, ``temperature``, ``top_p`` as in chat completions.

``previous_response_id`` continues a conversation: the server keeps each
response's whole conversation in memory (the last ``KEPT`` responses, none
with ``store: false``), so a request sends only what is new. A reply's calls
are ``function_call`` output items; ``status`` is "incomplete" with
``incomplete_details.reason`` "max_output_tokens" when the limit cut it.
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ..chat import tools as chat_tools
from . import fields
from .errors import ApiError, bad, is_int, show
from .openai import DEFAULT_TEMPERATURE, options as chat_options
from .request import Stream, endpoint, note, pick_runner, read_json, stream_pieces
from .runner import Completion, Job

KEPT = 256   # responses whose conversations stay in memory for previous_response_id
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
# Fields that ask for what this server does not do, at the value asking for nothing.
UNSERVED = {"background": False, "conversation": None, "prompt": None, "reasoning": None, "include": None}


class Stored:
    """The last ``KEPT`` stored responses by id, each with its whole
    conversation (for previous_response_id); thread-safe, the oldest goes first."""

    def __init__(self, limit: int = KEPT):
        self._kept: OrderedDict[str, tuple[list[dict], dict]] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def conversation(self, response_id: str) -> list[dict] | None:
        with self._lock:
            kept = self._kept.get(response_id)
        return kept[0] if kept is not None else None

    def response(self, response_id: str) -> dict | None:
        with self._lock:
            kept = self._kept.get(response_id)
        return kept[1] if kept is not None else None

    def put(self, response: dict, conversation: list[dict]) -> None:
        with self._lock:
            self._kept[response["id"]] = conversation, response
            while len(self._kept) > self._limit:
                self._kept.popitem(last=False)

    def pop(self, response_id: str) -> bool:
        with self._lock:
            return self._kept.pop(response_id, None) is not None


def routes() -> list[Route]:
    return [
        Route("/v1/responses", endpoint(create), methods=["POST"]),
        Route("/v1/responses/{id}", endpoint(retrieve), methods=["GET"]),
        Route("/v1/responses/{id}", endpoint(delete), methods=["DELETE"]),
    ]


def _stored(request: Request) -> Stored:
    return request.app.state.responses


# -- request fields ----------------------------------------------------------------------

def _content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad(where, f"{where} must be a string or a list of input_text parts (only text is served)")


def _items(value) -> list[dict]:
    """``input``'s chat messages (edgespec's, OpenAI chat-shaped)."""
    if isinstance(value, str):
        if not value:
            raise bad("input", "input is empty")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad("input", "input must be a string or a non-empty list of items")
    out: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ROLES:
            out.append({"role": ROLES[item["role"]], "content": _content(item.get("content", ""), f"{where}.content")})
        elif kind == "function_call" and isinstance(item.get("name"), str) and isinstance(item.get("call_id"), str):
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": str(item.get("arguments", "{}"))}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output" and isinstance(item.get("call_id"), str):
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _content(item.get("output", ""), f"{where}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise bad(where, f"{where} must be a message (role user, assistant, system or developer), a "
                      f"function_call or a function_call_output item, got {show(kind)}")
    return out


def _tools(body: dict) -> dict:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise bad("tools", "tools must be a list of function tools")
        for i, t in enumerate(tools):
            if t.get("type") != "function":
                raise bad(f"tools[{i}]", f"tools[{i}]: only function tools are served, not {show(t.get('type'))}")
        tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
                 for t in tools] or None
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return fields.tool_options({"tools": tools, "tool_choice": choice, "parallel_tool_calls":
                                body.get("parallel_tool_calls")}, None)


def _format(body: dict) -> dict:
    """``text.format`` as chat completions' response_format."""
    text = body.get("text")
    if text is None:
        return {}
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return {}
    if not isinstance(fmt, dict):
        raise bad("text", "text.format must be an object")
    if fmt.get("type") == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    grammar = fields.structured({"response_format": fmt})
    return {"grammar": grammar} if grammar is not None else {}


def completion(body: dict, earlier: list[dict]) -> tuple[Completion, bool]:
    for name, off in UNSERVED.items():
        if body.get(name, off) not in (off, None):
            raise bad(name, f"{name} is not supported by this server")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", "stream must be a boolean")
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None and not (is_int(max_tokens) and max_tokens > 0):
        raise bad("max_output_tokens", f"max_output_tokens must be an integer > 0, got {show(max_tokens)}")
    opts = chat_options({"max_tokens": max_tokens, "temperature": body.get("temperature", DEFAULT_TEMPERATURE),
                         "top_p": body.get("top_p")})
    opts.update(_tools(body))
    opts.update(_format(body))
    messages = list(earlier)
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise bad("instructions", "instructions must be a string")
        messages = [m for m in messages if m["role"] != "system"]
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    messages += _items(body.get("input"))
    return Completion(messages=messages, options=opts), stream


# -- the response --------------------------------------------------------------------------

def _output(text: str, calls: list[chat_tools.ToolCall]) -> list[dict]:
    out = []
    if text or not calls:
        out.append({"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]})
    for c in calls:
        out.append({"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": c.id, "name": c.name,
                    "arguments": c.arguments, "status": "completed"})
    return out


def _response(head: dict, job: Job | None, output: list[dict], status: str) -> dict:
    r = {**head, "status": status, "output": output, "error": None, "incomplete_details": None, "usage": None}
    if job is not None and job.result is not None:
        s = job.result.stats
        if s.stop_reason in ("length", "context") and status != "in_progress":
            r["status"], r["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        r["usage"] = {"input_tokens": s.prompt_tokens, "output_tokens": s.n_tokens,
                      "total_tokens": s.prompt_tokens + s.n_tokens,
                      "input_tokens_details": {"cached_tokens": s.cached_tokens},
                      "output_tokens_details": {"reasoning_tokens": 0}}
    return r


def _head(body: dict, runner, c: Completion) -> dict:
    return {"id": "resp_" + uuid.uuid4().hex, "object": "response", "created_at": int(time.time()),
            "model": runner.name, "instructions": body.get("instructions"),
            "previous_response_id": body.get("previous_response_id"), "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice", "auto"), "parallel_tool_calls": True,
            "temperature": c.options.get("temperature"), "top_p": c.options.get("top_p", 1.0),
            "max_output_tokens": body.get("max_output_tokens"), "text": body.get("text") or {"format": {"type": "text"}},
            "store": body.get("store", True), "metadata": body.get("metadata") or {}}


def _keep(request: Request, body: dict, response: dict, c: Completion, text: str, calls) -> None:
    """Remember the conversation (for previous_response_id) and the response (GET), unless store is false."""
    if body.get("store") is False:
        return
    reply = {"role": "assistant", "content": text}
    if calls:
        reply["tool_calls"] = [call.to_openai() for call in calls]
    _stored(request).put(response, c.messages + [reply])


def _reply(job: Job, text: str) -> tuple[str, list]:
    parsed = job.result.parsed
    if parsed is not None and parsed.tool_calls:
        return parsed.content or "", parsed.tool_calls
    return text, []


# -- endpoints -----------------------------------------------------------------------------

async def create(request: Request):
    body = await read_json(request)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "model must be a string")
    runner = pick_runner(request, model)
    earlier: list[dict] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        earlier = _stored(request).conversation(previous) if isinstance(previous, str) else None
        if earlier is None:
            raise ApiError(404, f"previous response {show(previous)} not found (this server keeps the last {KEPT})",
                           param="previous_response_id")
    c, stream = completion(body, earlier)
    job = await runner.start(c, request)
    head = _head(body, runner, c)
    if stream:
        return Stream(_events(request, body, job, head, c), "text/event-stream")
    text = await job.text()
    text, calls = _reply(job, text)
    response = _response(head, job, _output(text, calls), "completed")
    _keep(request, body, response, c, text, calls)
    note(request, f"{job.result.stats.n_tokens} tokens")
    return JSONResponse(response)


async def retrieve(request: Request):
    response = _stored(request).response(request.path_params["id"])
    if response is None:
        raise ApiError(404, f"response {show(request.path_params['id'])} not found", param="id")
    return JSONResponse(response)


async def delete(request: Request):
    rid = request.path_params["id"]
    if not _stored(request).pop(rid):
        raise ApiError(404, f"response {show(rid)} not found", param="id")
    return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})


def _event(n: int, kind: str, data: dict) -> bytes:
    payload = json.dumps({"type": kind, "sequence_number": n, **data}, ensure_ascii=False)
    return f"event: {kind}\ndata: {payload}\n\n".encode("utf-8")


async def _events(request: Request, body: dict, job: Job, head: dict, c: Completion):
    """The Responses stream: created, in_progress, the message item and its
    text part (added, deltas, done), function_call items once the reply ends,
    completed (or incomplete) with the whole response; ``error`` when the
    generation fails."""
    engine = job.runner.engine
    tools = job.completion.tools
    calls_stream = chat_tools.ToolCallStream(chat_tools.style_of(engine.chat_template or ""), tools) if tools else None
    seq = iter(range(1 << 30))
    message_id = "msg_" + uuid.uuid4().hex
    shown = ""
    opened = False

    def open_message():
        item = {"type": "message", "id": message_id, "status": "in_progress", "role": "assistant", "content": []}
        yield _event(next(seq), "response.output_item.added", {"output_index": 0, "item": item})
        yield _event(next(seq), "response.content_part.added", {
            "item_id": message_id, "output_index": 0, "content_index": 0,
            "part": {"type": "output_text", "text": "", "annotations": []}})

    try:
        yield _event(next(seq), "response.created", {"response": _response(head, None, [], "in_progress")})
        yield _event(next(seq), "response.in_progress", {"response": _response(head, None, [], "in_progress")})
        async for piece in stream_pieces(request, job):
            if isinstance(piece, ApiError):
                yield _event(next(seq), "error", {"code": piece.code, "message": piece.message, "param": piece.param})
                return
            text = calls_stream.push(piece) if calls_stream else piece
            if text:
                if not opened:
                    opened = True
                    for e in open_message():
                        yield e
                shown += text
                yield _event(next(seq), "response.output_text.delta", {
                    "item_id": message_id, "output_index": 0, "content_index": 0, "delta": text, "logprobs": []})
        if job.client_gone:
            return
        calls = []
        if calls_stream:
            tail, parsed = calls_stream.finish()
            calls = parsed.tool_calls
            shown += tail
        if shown or not calls:
            if not opened:
                for e in open_message():
                    yield e
            part = {"type": "output_text", "text": shown, "annotations": []}
            yield _event(next(seq), "response.output_text.done", {
                "item_id": message_id, "output_index": 0, "content_index": 0, "text": shown, "logprobs": []})
            yield _event(next(seq), "response.content_part.done", {
                "item_id": message_id, "output_index": 0, "content_index": 0, "part": part})
            yield _event(next(seq), "response.output_item.done", {"output_index": 0, "item": {
                "type": "message", "id": message_id, "status": "completed", "role": "assistant", "content": [part]}})
        output = _output(shown, calls)
        if output[0]["type"] == "message":
            output[0]["id"] = message_id
        first_call = 1 if shown or not calls else 0
        for i, item in enumerate(output[first_call:], start=first_call):
            yield _event(next(seq), "response.output_item.added", {"output_index": i, "item": {**item, "arguments": ""}})
            yield _event(next(seq), "response.function_call_arguments.delta", {
                "item_id": item["id"], "output_index": i, "delta": item["arguments"]})
            yield _event(next(seq), "response.function_call_arguments.done", {
                "item_id": item["id"], "output_index": i, "arguments": item["arguments"]})
            yield _event(next(seq), "response.output_item.done", {"output_index": i, "item": item})
        response = _response(head, job, output, "completed")
        _keep(request, body, response, c, shown, calls)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield _event(next(seq), kind, {"response": response})
        note(request, f"{job.result.stats.n_tokens} tokens")
    finally:
        job.close()
