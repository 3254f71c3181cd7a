"""Chat templates: the model's own Jinja template from its GGUF metadata,
rendered the way its authors (and Hugging Face's tokenizers) render it."""
from __future__ import annotations

import json
from datetime import datetime
from typing import Sequence

from ..errors import InvalidArgumentError

ROLES = ("system", "user", "assistant", "tool")


def _raise(message: str):
    raise InvalidArgumentError(f"chat template: {message}")


def validate_messages(messages: Sequence[dict]) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise InvalidArgumentError(f"messages must be a list of objects, not {type(messages).__name__}")
    if not messages:
        raise InvalidArgumentError("messages must not be empty")
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if not isinstance(m, dict) or not (isinstance(m.get("content"), str) or calls):
            raise InvalidArgumentError(f"message {i} must be an object with a string 'content'")
        if m.get("role") not in ROLES:
            raise InvalidArgumentError(f"message {i} has role {m.get('role')!r}; expected one of {', '.join(ROLES)}")
        if calls and (m["role"] != "assistant" or not isinstance(calls, list)):
            raise InvalidArgumentError(f"message {i}: only an assistant message carries a tool_calls list")
        kept = {"role": m["role"], "content": m.get("content") or ""}
        for key in ("tool_calls", "tool_call_id", "name"):
            if m.get(key) is not None:
                kept[key] = m[key]
        out.append(kept)
    return out


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    """Hugging Face's tojson: plain JSON (Jinja's own escapes HTML characters)."""
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators,
                      sort_keys=sort_keys)


def render(template: str, messages: Sequence[dict], *, bos_token: str = "", eos_token: str = "",
           add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
    """Render ``messages`` (and the OpenAI ``tools``, for templates that take
    them) with a Jinja chat template (sandboxed)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        loader=jinja2.BaseLoader())
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(template).render(
            messages=validate_messages(messages), bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt, tools=tools)
    except jinja2.TemplateError as e:
        raise InvalidArgumentError(f"chat template could not be rendered: {e}") from None
