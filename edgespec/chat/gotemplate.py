"""Ollama's chat templates (Go's text/template, as a Modelfile's TEMPLATE
holds them) translated into the Jinja chat templates edgespec renders.

The subset Ollama's simpler templates use is translated: ``{{ .System }}``,
``{{ .Prompt }}``, ``{{ .Response }}``; ``{{ range .Messages }}`` with
``{{ .Role }}`` and ``{{ .Content }}`` inside; ``{{ if ... }}`` / ``{{ else
if ... }}`` / ``{{ else }}`` / ``{{ end }}`` on those fields or ``eq .Role
"user"``; comments; the ``{{-`` / ``-}}`` trim markers (Jinja's mean the
same). Anything else (variables ``$``, functions such as ``slice``, ``len``,
``json``, pipelines, ``.Tools``) is refused with InvalidArgumentError naming
the construct.

A template without ``.Messages`` is Ollama's older kind: it is rendered
once per user turn (``.System`` in the first, ``.Response`` the assistant's
answer to it), and in the last turn nothing after ``{{ .Response }}`` is
rendered, as Ollama cuts it there for the model to go on.
"""
from __future__ import annotations

import re

from ..errors import InvalidArgumentError

_ACTION = re.compile(r"\{\{(-?)(.*?)(-?)\}\}", re.S)
_FIELDS = {".System": "System", ".Prompt": "Prompt", ".Response": "Response"}
_IN_RANGE = {".Role": "m.role", ".Content": "m.content"}
_EQ = re.compile(r'eq\s+\.Role\s+"(system|user|assistant|tool)"')


def _refuse(construct: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"TEMPLATE: {construct.strip()[:60]!r} is not in the Go template subset this server "
                                "translates (.System, .Prompt, .Response, range .Messages with .Role and .Content, "
                                'if/else/end, eq .Role "...")')


def _value(expr: str, in_range: bool) -> str:
    names = _IN_RANGE if in_range else _FIELDS
    if expr in names:
        return names[expr]
    raise _refuse(expr)


def _condition(expr: str, in_range: bool) -> str:
    if expr == ".Messages" and not in_range:
        return "messages"
    m = _EQ.fullmatch(expr)
    if m and in_range:
        return f'm.role == "{m.group(1)}"'
    return _value(expr, in_range)


def _translate(go: str) -> tuple[str, bool, int]:
    """(the Jinja text, whether it ranges over .Messages, the offset in the
    Jinja text just after a top-level ``{{ .Response }}`` or -1). Block tags
    carry ``-`` where Go trims and ``+`` elsewhere, so that the renderer's
    trim_blocks and lstrip_blocks change nothing Go would keep."""
    out: list[str] = []
    stack: list[str] = []   # "if" / "range"
    uses_messages, after_response, pos = False, -1, 0
    for match in _ACTION.finditer(go):
        out.append(_text(go[pos:match.start()]))
        pos = match.end()
        left, expr, right = match.group(1), match.group(2).strip(), match.group(3)
        in_range = "range" in stack

        def block(inner: str) -> str:
            return f"{{%{left or '+'} {inner} {right or '+'}%}}"
        if expr.startswith("/*") and expr.endswith("*/"):
            out.append(block("set _ = none"))   # a comment: nothing, its trims kept
            continue
        word, _, rest = expr.partition(" ")
        rest = rest.strip()
        if word == "if":
            stack.append("if")
            out.append(block(f"if {_condition(rest, in_range)}"))
        elif word == "else" and rest.startswith("if "):
            out.append(block(f"elif {_condition(rest[3:].strip(), in_range)}"))
        elif word == "else" and not rest:
            out.append(block("else"))
        elif word == "end" and not rest and stack:
            out.append(block("endfor" if stack.pop() == "range" else "endif"))
        elif word == "range" and rest == ".Messages" and not in_range:
            stack.append("range")
            uses_messages = True
            out.append(block("for m in messages"))
        else:
            out.append(f"{{{{{left} {_value(expr, in_range)} {right}}}}}")
            if expr == ".Response" and not stack:
                after_response = sum(map(len, out))
    if stack:
        raise InvalidArgumentError(f"TEMPLATE: an {stack[-1]} without its {{{{ end }}}}")
    out.append(_text(go[pos:]))
    return "".join(out), uses_messages, after_response


def _text(text: str) -> str:
    """Go template text as Jinja text: what would open a Jinja tag is printed."""
    return text.replace("{#", "{{ '{#' }}").replace("{%", "{{ '{%' }}")


# Ollama's .System: the chat's system messages.
_SYSTEM = '{%- set System = messages | selectattr("role", "equalto", "system") | map(attribute="content") | join("\\n") +%}'
_END = '{{ "" }}'   # the renderer drops a template's last newline; Go keeps it


def to_jinja(go: str) -> str:
    """The Jinja chat template of Ollama template ``go`` (see the module docstring)."""
    if not isinstance(go, str) or not go.strip():
        raise InvalidArgumentError("TEMPLATE is empty")
    body, uses_messages, cut = _translate(go)
    if uses_messages:
        return _SYSTEM + '{%- set Prompt, Response = "", "" +%}' + body + _END
    if cut >= 0:   # the last turn ends at its .Response: the model goes on from there
        body = body[:cut] + "{%+ if not last +%}" + body[cut:] + "{%+ endif +%}"
    return (_SYSTEM + '{%- set turns = namespace(first=true) +%}'
            '{%- for m in messages if m.role == "user" +%}'
            '{%- set Prompt = m.content +%}'
            '{%- set i = messages.index(m) +%}'
            '{%- set answered = i + 1 < messages | length and messages[i + 1].role == "assistant" +%}'
            '{%- set Response = messages[i + 1].content if answered else "" +%}'
            '{%- set last = not answered +%}'
            '{%- if not turns.first %}{% set System = "" %}{% endif +%}'
            '{%- set turns.first = false +%}' + body + "{%+ endfor +%}" + _END)
