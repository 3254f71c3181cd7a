"""Chat templates: the model's own Jinja template from its GGUF metadata,
rendered the way its authors (and Hugging Face's tokenizers) render it, in a
worker process with a time, output and memory budget."""
from __future__ import annotations

import atexit
import json
import re
import resource
import secrets
import select
import signal
import subprocess
import sys
import threading
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


# A chat template is code from the model file: its render is bounded, in a
# worker process that is killed when it runs over (a thread could not be
# stopped, and would keep its CPU and memory after the request is gone).
RENDER_SECONDS = 5.0              # wall time of one render
RENDER_BYTES = 16 << 20           # its text: more than any context holds
RENDER_MEMORY = 1 << 30           # the worker's heap (RLIMIT_DATA): a template doubling a string


class TemplateBudgetError(InvalidArgumentError):
    """A chat template that runs over its time, output or memory budget."""


def render(template: str, messages: Sequence[dict], *, bos_token: str = "", eos_token: str = "",
           add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
    """Render ``messages`` (and the OpenAI ``tools``, for templates that take
    them) with a Jinja chat template (sandboxed), within RENDER_SECONDS and
    RENDER_BYTES: TemplateBudgetError beyond them, InvalidArgumentError for a
    template that fails."""
    request = {"template": template, "messages": validate_messages(messages), "bos_token": bos_token,
               "eos_token": eos_token, "add_generation_prompt": add_generation_prompt, "tools": tools}
    return _renderers.render(json.dumps(request, default=str))


def render_pieces(template: str, messages: Sequence[dict], literal: Sequence[int], **options) -> list[tuple[str, bool]]:
    """The chat as ``render`` makes it, cut into pieces ``(text, is_content)``:
    the contents of the messages numbered in ``literal`` are pieces of their
    own, which a tokenizer keeps as plain text while it parses the template's
    special tokens (so a message cannot write the template's markers). The
    contents are found by rendering once more with a marker in their place;
    a template that inserts one other than whole (or trimmed), or decides by
    what it says, is refused with InvalidArgumentError."""
    whole = render(template, messages, **options)
    if not literal:
        return [(whole, False)]
    mark = f"\ue000{secrets.token_hex(6)}:"   # private-use characters: no template gives them meaning
    marked = [dict(m, content=f"{mark}{i}\ue001") if i in literal else m for i, m in enumerate(messages)]
    parts = re.split(re.escape(mark) + r"(\d+)\ue001", render(template, marked, **options))
    pieces, at = [], 0
    for k in range(0, len(parts) - 1, 2):   # text, message index, text, ..., text
        i, before, after = int(parts[k + 1]), parts[k], parts[k + 2]
        content = messages[i]["content"]
        at += len(before)
        found = next((c for c in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip()))
                      if whole.startswith(before, at - len(before)) and whole.startswith(c, at)
                      and whole.startswith(after, at + len(c))), None)
        if found is None:
            _not_literal(i)
        pieces += [(before, False), (found, True)]
        at += len(found)
    if whole[at:] != parts[-1]:
        _not_literal(literal[0])
    return [p for p in pieces + [(parts[-1], False)] if p[0]]


def _not_literal(i: int):
    raise InvalidArgumentError(f"message {i} holds the text of one of the model's special tokens, and this chat "
                               "template does not insert message text as it is, so that text could not be kept "
                               "plain: remove the special token's text from it")


def _render_here(request: dict) -> str:
    """The render itself (in a worker): output counted as it is made."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        loader=jinja2.BaseLoader())
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    template = request.pop("template")
    try:
        pieces, size = [], 0
        for piece in env.from_string(template).generate(**request):
            size += len(piece)
            if size > RENDER_BYTES:
                raise TemplateBudgetError(f"chat template renders more than {RENDER_BYTES >> 20} MiB of text")
            pieces.append(piece)
        return "".join(pieces)
    except jinja2.TemplateError as e:
        raise InvalidArgumentError(f"chat template could not be rendered: {e}") from None
    except (MemoryError, RecursionError):
        raise TemplateBudgetError("chat template needs more memory or recursion than a chat may use") from None


class _Renderers:
    """Idle worker processes (``python -m edgespec.chat.template``), one per
    render at a time: a render that runs over RENDER_SECONDS kills its
    worker, and the next render starts a fresh one."""

    def __init__(self):
        self._idle: list = []
        self._lock = threading.Lock()

    def render(self, request: str) -> str:
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None or worker.poll() is not None:
            worker = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            worker.stdin.write(request.encode() + b"\n")
            worker.stdin.flush()
            # A little longer than the worker's own alarm, whose clean error keeps it alive.
            ready, _, _ = select.select([worker.stdout], [], [], RENDER_SECONDS + 1)
            line = worker.stdout.readline() if ready else b""
        except OSError:
            line = b""
        if not line:   # over time (or the worker died): it is killed, not waited for
            worker.kill()
            worker.wait()
            raise TemplateBudgetError(f"chat template took more than {RENDER_SECONDS:g} s to render")
        with self._lock:
            self._idle.append(worker)
        reply = json.loads(line)
        if "error" in reply:
            kind = TemplateBudgetError if reply["budget"] else InvalidArgumentError
            raise kind(reply["error"])
        return reply["text"]


    def close(self) -> None:
        """End the idle workers (at exit: their stdin closes, they return)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.stdin.close()
            worker.stdout.close()
            worker.wait()


_renderers = _Renderers()
atexit.register(_renderers.close)


def _serve() -> None:
    """A render worker: one JSON request a line on stdin, one reply a line on
    stdout, each render under an alarm (its own time limit) and a heap limit."""
    resource.setrlimit(resource.RLIMIT_DATA, (RENDER_MEMORY, RENDER_MEMORY))

    def over_time(*_):
        raise TemplateBudgetError(f"chat template took more than {RENDER_SECONDS:g} s to render")

    signal.signal(signal.SIGALRM, over_time)
    for line in sys.stdin:
        signal.setitimer(signal.ITIMER_REAL, RENDER_SECONDS)
        try:
            reply = {"text": _render_here(json.loads(line))}
        except InvalidArgumentError as e:
            reply = {"error": str(e), "budget": isinstance(e, TemplateBudgetError)}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
