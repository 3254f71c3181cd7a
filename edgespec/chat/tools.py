"""Tool calling: OpenAI ``tools`` rendered through the model's own chat
template, tool calls parsed from what the model writes.

Two output forms:
  - "tags": the template's own form, ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
    (Qwen2.5 and the Hermes family; chosen when the template mentions ``<tool_call>``);
  - "json": for templates that render no tools, a system note lists the tools
    and asks for a bare JSON object ``{"name": ..., "arguments": {...}}``.
When ``tool_choice`` requires a call (``"required"`` or a named function), the
reply is constrained by a grammar to exactly one call in that form.

A tool call that does not parse is returned as text with a warning, never an
error: ``parse()`` and ``ToolCallStream`` both give a ``Parsed``.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Sequence

from ..errors import InvalidArgumentError
from ..grammar import bounded_schema

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALLS = 8   # calls one reply may make with parallel tool calls: a weak model must not call forever
_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass
class ToolCall:
    name: str
    arguments: str          # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function",
             "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


@dataclass
class Parsed:
    content: str | None                 # the text that is not a tool call (None: nothing)
    tool_calls: list[ToolCall] = field(default_factory=list)
    warning: str | None = None          # why what looked like a tool call was kept as text


# -- request side ---------------------------------------------------------------

def check_tools(tools) -> list[dict]:
    """OpenAI's ``tools``: a list of ``{"type": "function", "function": {"name", "description"?,
    "parameters"?}}``. Returns them with ``parameters`` defaulted to any object."""
    if not isinstance(tools, list) or not tools:
        raise InvalidArgumentError("tools must be a non-empty list of function tools")
    out, names = [], set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise InvalidArgumentError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = f.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise InvalidArgumentError(f"tools[{i}].function.name must be 1-64 letters, digits, _ . -")
        if name in names:
            raise InvalidArgumentError(f"tools[{i}].function.name {name!r} is given twice")
        names.add(name)
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InvalidArgumentError(f"tools[{i}].function.parameters must be a JSON schema object")
        fn = {"name": name, "parameters": params}
        if isinstance(f.get("description"), str):
            fn["description"] = f["description"]
        out.append({"type": "function", "function": fn})
    return out


def check_tool_choice(choice, tools: list[dict] | None) -> str | None:
    """``"none"``, ``"auto"``, ``"required"`` or a function name; None without tools."""
    if choice is None:
        return "auto" if tools else None
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise InvalidArgumentError('tool_choice must be "none", "auto", "required" or '
                                       '{"type": "function", "function": {"name": ...}}')
        if not tools or name not in {t["function"]["name"] for t in tools}:
            raise InvalidArgumentError(f"tool_choice names {name!r}, which is not among the tools")
        return name
    if choice not in ("none", "auto", "required"):
        raise InvalidArgumentError(f'tool_choice must be "none", "auto", "required" or a function, got {choice!r}'[:200])
    if choice != "none" and not tools:
        raise InvalidArgumentError(f'tool_choice "{choice}" needs tools')
    return choice


def style_of(template: str) -> str:
    """The form a template's model writes tool calls in."""
    return "tags" if OPEN in template and "tools" in template else "json"


def prepare_messages(messages: Sequence[dict], tools: list[dict] | None, style: str) -> list[dict]:
    """Messages as the template expects them: assistant tool calls with their
    arguments as objects (Hugging Face's convention); for the "json" form, the
    tools described in the system message and tool results as user turns."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            m["tool_calls"] = [_call_for_template(c) for c in calls]
            if style == "json":
                text = "\n".join(json.dumps({"name": c["function"]["name"],
                                             "arguments": c["function"]["arguments"]})
                                 for c in m.pop("tool_calls"))
                m["content"] = ((m.get("content") or "") + "\n" + text).strip()
        if m.get("content") is None:
            m["content"] = ""
        if style == "json" and m.get("role") == "tool":
            m = {"role": "user", "content": f"Tool result: {m['content']}"}
        out.append(m)
    if style == "json" and tools:
        note = _json_tools_note(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + note}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out


def _call_for_template(call: dict) -> dict:
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise InvalidArgumentError("an assistant tool_calls entry must have function.name and function.arguments")
    args = f.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError:
            raise InvalidArgumentError(f"tool call {f['name']!r}: arguments are not valid JSON") from None
    return {"type": "function", "id": call.get("id"), "function": {"name": f["name"], "arguments": args}}


def _json_tools_note(tools: list[dict]) -> str:
    lines = "\n".join(json.dumps(t["function"]) for t in tools)
    return ("You can call these tools:\n" + lines + "\n\nTo call a tool, reply with only a JSON object "
            '{"name": <tool name>, "arguments": <arguments object>} and nothing else.')


def call_schema(tools: list[dict], choice: str) -> dict:
    """The JSON schema of one call allowed by ``choice`` ("required": any tool)."""
    fns = [t["function"] for t in tools if choice == "required" or t["function"]["name"] == choice]
    one = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False} for f in fns]
    return one[0] if len(one) == 1 else {"anyOf": one}


def call_grammar(tools: list[dict], choice: str, style: str, open_token: int | None = None,
                 close_token: int | None = None, most: int = 1) -> str:
    """A Lark grammar (llguidance's dialect) for a reply that is a call, or
    up to ``most`` calls (parallel tool calls): the tags form's blocks one after
    another, the JSON form's calls as a list. ``open_token``/``close_token``:
    the vocabulary's own ``<tool_call>`` tokens, when it has them, as
    alternatives to the spelled-out text."""
    # compact JSON: a flexible-whitespace grammar lets a weak model pad forever; bounded: nor
    # may it write digits or argument keys forever
    schema = json.dumps({**bounded_schema(call_schema(tools, choice)), "x-guidance": {"whitespace_flexible": False}})
    call = f"call: %json {schema}\n"
    if style == "json":
        if most == 1:
            return "start: call\n" + call
        return 'start: call | "[" call more1 "]"\n' + call + _more_rules('"," call', most)

    def tag(text: str, token: int | None) -> str:
        return f'("{text}" | <[{token}]>)' if token is not None else f'"{text}"'
    return (f"start: block{' more1' if most > 1 else ''}\n"
            f'block: {tag(OPEN, open_token)} "\\n" call "\\n" {tag(CLOSE, close_token)}\n'
            + call + _more_rules('"\\n" block', most))


def _more_rules(item: str, most: int) -> str:
    """``more1`` .. ``more{most-1}``: each one more ``item``, optional, then the next."""
    return "".join(f"more{k}: ({item}{f' more{k + 1}' if k + 1 < most else ''})?\n" for k in range(1, most))


# -- reply side -------------------------------------------------------------------

def parse(text: str, style: str, tools: list[dict]) -> Parsed:
    """Split a whole reply into text and tool calls. Models whose template
    asks for <tool_call> tags sometimes answer with the generic JSON form
    instead (Qwen2.5-Coder does): that counts when it names a known tool."""
    names = {t["function"]["name"] for t in tools}
    if style != "tags":
        return _json_form(text, names)
    if OPEN not in text:
        parsed = _json_form(text, names)
        return parsed if parsed.tool_calls else Parsed(text)
    bodies = _TAGGED.findall(text)
    rest = _TAGGED.sub("", text).strip()
    if not bodies or OPEN in rest:
        return Parsed(text, warning="an unterminated <tool_call> was returned as text")
    return _calls(text, bodies, rest, names)


def _json_form(text: str, names: set[str]) -> Parsed:
    """A reply that is one JSON call or a list of them (bare or fenced)."""
    body = text.strip()
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.S)
    body = fenced.group(1) if fenced else body
    if not body.startswith(("{", "[")):
        return Parsed(text)
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return Parsed(text, warning=f"a tool call that is not valid JSON was returned as text ({e.msg})")
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        value = value["tool_calls"]
    if isinstance(value, dict) and "name" not in value:
        return Parsed(text)  # a JSON answer, not a call
    return _calls(text, value if isinstance(value, list) else [value], "", names)


def _calls(text: str, bodies: list, rest: str, names: set[str]) -> Parsed:
    calls = []
    for b in bodies:
        call, why = _one_call(b, names)
        if call is None:
            return Parsed(text, warning=f"a tool call that does not parse was returned as text ({why})")
        calls.append(call)
    return Parsed(rest or None, calls)


def _one_call(body, names: set[str]) -> tuple[ToolCall | None, str]:
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except json.JSONDecodeError as e:
            return None, f"not valid JSON: {e.msg}"
    if isinstance(body, dict) and isinstance(body.get("function"), dict):
        body = body["function"]
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None, "no function name"
    if body["name"] not in names:
        return None, f"unknown tool {body['name']!r}"
    args = body.get("arguments", body.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None, "arguments are not valid JSON"
    if not isinstance(args, dict):
        return None, "arguments are not an object"
    return ToolCall(body["name"], json.dumps(args, ensure_ascii=False)), ""


class ToolCallStream:
    """Streaming: ``push(piece)`` returns the text that can be shown now (never
    a possible start of a tool call); ``finish()`` parses what was held back."""

    def __init__(self, style: str, tools: list[dict]):
        self.style, self.tools = style, tools
        self._text = ""      # everything pushed
        self._shown = 0      # characters of it already returned
        self._held = False   # a tool call started: hold the rest

    def push(self, piece: str) -> str:
        self._text += piece
        if self._held:
            return ""
        stripped = self._text.lstrip()
        if self._shown == 0 and not stripped:
            return ""
        if self._shown == 0 and stripped[0] in "{[`":
            self._held = True   # the JSON form (also from models told to use tags)
            return ""
        if self.style == "tags":
            at = self._text.find(OPEN, self._shown)
            if at >= 0:
                self._held = True
                return self._take(at)
            # hold back a suffix that could be the start of OPEN
            keep = next((k for k in range(min(len(OPEN) - 1, len(self._text) - self._shown), 0, -1)
                         if self._text.endswith(OPEN[:k])), 0)
            return self._take(len(self._text) - keep)
        return self._take(len(self._text))

    def _take(self, end: int) -> str:
        out = self._text[self._shown:end]
        self._shown = max(self._shown, end)
        return out

    def finish(self) -> tuple[str, Parsed]:
        """The text not shown yet, and the parse of the whole reply (its
        ``content`` is the whole text when no call was found)."""
        parsed = parse(self._text, self.style, self.tools)
        if parsed.tool_calls:
            rest = self._text[self._shown:]
            tail = _TAGGED.sub("", rest).strip() if OPEN in rest else ""
            return tail, parsed
        return self._take(len(self._text)), parsed
