"""Chat templates: the model's own Jinja template from its GGUF metadata,
rendered the way its authors (and Hugging Face's tokenizers) render it."""
from __future__ import annotations

from datetime import datetime
from typing import Sequence

from ..errors import InvalidArgumentError

ROLES = ("system", "user", "assistant")


def _raise(message: str):
    raise InvalidArgumentError(f"chat template: {message}")


def validate_messages(messages: Sequence[dict]) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise InvalidArgumentError(f"messages must be a list of objects, not {type(messages).__name__}")
    if not messages:
        raise InvalidArgumentError("messages must not be empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise InvalidArgumentError(f"message {i} must be an object with a string 'content'")
        if m.get("role") not in ROLES:
            raise InvalidArgumentError(f"message {i} has role {m.get('role')!r}; expected one of {', '.join(ROLES)}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def render(template: str, messages: Sequence[dict], *, bos_token: str = "", eos_token: str = "",
           add_generation_prompt: bool = True) -> str:
    """Render ``messages`` with a Jinja chat template (sandboxed)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        loader=jinja2.BaseLoader())
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(
            messages=validate_messages(messages), bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as e:
        raise InvalidArgumentError(f"chat template could not be rendered: {e}") from None
