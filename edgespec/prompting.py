"""A model's prompt text: tokens of plain prompts, chats rendered through
their template (with tools), fill-in-the-middle prompts, and what the model
can do (Ollama's capabilities).

A ``Prompter`` reads its backend's tokenizer and metadata under the
engine's ``reading`` guard (the engine's close waits for such calls), never
under the engine itself: a prompt is tokenized while another generation runs.
"""
from __future__ import annotations

from typing import Callable, ContextManager, Sequence

import numpy as np

from .backends import Backend
from .chat import template as chat_templates
from .chat import tools as chat_tools
from .errors import InvalidArgumentError
from .text import utf8_text


def is_token(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


class Prompter:
    """The prompt side of one loaded model (see the module docstring).
    ``model_ref`` names the model in errors; ``serves_embeddings()`` says
    whether embeddings work for it (a capability)."""

    def __init__(self, backend: Backend, model_ref: str, reading: Callable[[], ContextManager],
                 serves_embeddings: Callable[[], bool]):
        self.backend = backend
        self.model_ref = model_ref
        self.reading = reading
        self._serves_embeddings = serves_embeddings
        self._chat_template: str | None = None
        self._capabilities: tuple[str, ...] | None = None

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        with self.reading():
            return self.backend.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        tokens = self.known_tokens(tokens, "tokens")
        with self.reading():
            return b"".join(self.backend.piece(t) for t in tokens).decode("utf-8", "replace")

    def known_tokens(self, tokens: Sequence[int], what: str) -> list[int]:
        """``tokens`` as a list, each checked to be in the vocabulary."""
        bad = next((t for t in tokens if not 0 <= t < self.backend.n_vocab), None)
        if bad is not None:
            raise InvalidArgumentError(f"{what}: token id {bad} is outside the vocabulary "
                                       f"[0, {self.backend.n_vocab})")
        return [int(t) for t in tokens]

    # -- chats ------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The one set here, else the model's own (GGUF metadata), else None."""
        with self.reading():
            return self._chat_template or self.backend.metadata("tokenizer.chat_template")

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        self._chat_template = template
        self._capabilities = None

    def template(self, template: str | None = None) -> str:
        """``template``, else the chat template; InvalidArgumentError if there is none."""
        template = template or self.chat_template
        if not template:
            raise InvalidArgumentError(f"model {self.model_ref} has no chat template in its metadata; "
                                       "pass a template file or use plain prompts")
        return template

    @property
    def capabilities(self) -> tuple[str, ...]:
        """``completion`` (it generates), ``tools`` (its chat template renders
        the tools it is given), ``insert`` (it has fill-in-the-middle tokens),
        ``embedding`` (embeddings work). Found once, by trying."""
        if self._capabilities is None:
            found = ["completion"]
            template = self.chat_template
            probe = {"type": "function", "function": {"name": "edgespec_probe_tool", "parameters": {"type": "object"}}}
            try:
                if template and "edgespec_probe_tool" in chat_templates.render(
                        template, [{"role": "user", "content": "x"}], tools=[probe]):
                    found.append("tools")
            except InvalidArgumentError:   # a template that refuses the probe renders no tools
                pass
            with self.reading():
                if self.backend.fim_tokens is not None:
                    found.append("insert")
            if self._serves_embeddings():
                found.append("embedding")
            self._capabilities = tuple(found)
        return self._capabilities

    def chat_pieces(self, messages: Sequence[dict], template: str | None = None,
                    tools: list[dict] | None = None) -> list[tuple[str, bool]]:
        """The rendered chat as ``(text, is_content)`` pieces: a message whose
        text holds a special token's text (``<|im_end|>``) is a piece of its
        own, tokenized as plain text (chat_templates.render_pieces)."""
        template = self.template(template)
        b = self.backend
        with self.reading():
            bos, eos = b.token_text(b.bos_token), b.token_text(b.eos_token)
            special = b.special_pattern
        messages = chat_templates.validate_messages(messages)
        style = chat_tools.style_of(template)
        if tools is not None or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            messages = chat_tools.prepare_messages(messages, tools, style)
        literal = [i for i, m in enumerate(messages) if special is not None and special.search(m["content"])]
        return chat_templates.render_pieces(template, messages, literal, bos_token=bos, eos_token=eos,
                                            tools=tools if style == "tags" else None)

    def tool_tags(self, style: str) -> tuple[int | None, int | None]:
        """The vocabulary's own <tool_call> / </tool_call> tokens, if it has them."""
        if style != "tags":
            return None, None
        ids = [self.tokenize(t, add_special=False, parse_special=True) for t in (chat_tools.OPEN, chat_tools.CLOSE)]
        return tuple(i[0] if len(i) == 1 else None for i in ids)

    # -- prompts -------------------------------------------------------------------

    def prompt_tokens(self, prompt: str | Sequence[int] | None = None,
                      messages: Sequence[dict] | None = None, tools: list[dict] | None = None,
                      suffix: str | None = None, parse_special: bool = False) -> list[int]:
        """See ``Engine.prompt_tokens``."""
        if suffix is not None:
            return self.fill_in_middle_tokens(prompt or "", suffix)
        if isinstance(prompt, (list, tuple)) and prompt and all(is_token(t) for t in prompt):
            return self.known_tokens(prompt, "prompt")
        if messages is not None:
            pieces = self.chat_pieces(messages, tools=tools)
            utf8_text("".join(text for text, _ in pieces), "the chat")
            with self.reading():
                return self._one_bos([t for k, (text, content) in enumerate(pieces)
                                      for t in self.backend.tokenize(text, add_special=k == 0,
                                                                     parse_special=not content)])
        if not isinstance(prompt, str):
            raise InvalidArgumentError(f"prompt must be a str, not {type(prompt).__name__}")
        if not prompt:
            raise InvalidArgumentError("prompt is empty")
        utf8_text(prompt, "prompt")
        tokens = self.tokenize(prompt, parse_special=parse_special)
        return self._one_bos(tokens) if parse_special else tokens

    def _one_bos(self, tokens: list[int]) -> list[int]:
        """``tokens`` less a second BOS: text that starts with the BOS token's
        own text, after the one the tokenizer adds (as llama.cpp warns of)."""
        bos = self.backend.bos_token
        return tokens[1:] if len(tokens) > 1 and tokens[0] == bos and tokens[1] == bos else tokens

    def fill_in_middle_tokens(self, prefix: str, suffix: str, *, extra: Sequence[tuple[str, str]] | None = None,
                              middle: str = "", keep: tuple[int, int, int] | None = None) -> list[int]:
        """See ``Engine.fill_in_middle_tokens``."""
        for name, text in (("prompt", prefix), ("suffix", suffix), ("middle", middle)):
            if not isinstance(text, str):
                raise InvalidArgumentError(f"{name} must be a str, not {type(text).__name__}")
            utf8_text(text, name)
        with self.reading():
            b = self.backend
            fim = b.fim_tokens
            if fim is None:
                raise InvalidArgumentError(
                    f"model {self.model_ref} has no fill-in-the-middle tokens, so it cannot complete "
                    "between a prompt and a suffix (code models such as qwen2.5-coder-1.5b can)")
            pre, suf, mid = fim
            head = [b.bos_token] if b.adds_bos else []
            before = b.tokenize(prefix, add_special=False)
            after = b.tokenize(suffix, add_special=False)
            files = self._fim_files(extra) if extra is not None else []
            typed = b.tokenize(middle, add_special=False, parse_special=True) if middle else []
        if keep is not None:
            before, after, files = before[len(before) - min(keep[0], len(before)):], after[:keep[1]], \
                files[len(files) - min(keep[2], len(files)):]
        return files + head + [pre] + before + typed + [suf] + after + [mid]

    def _fim_files(self, extra: Sequence[tuple[str, str]]) -> list[int]:
        """llama-server's repository-level context of ``extra`` files (see
        fill_in_middle_tokens); under ``reading``."""
        b = self.backend
        rep, sep = b.fim_repo_tokens
        out = [rep] + b.tokenize("myproject\n", add_special=False) if rep is not None else []
        for name, text in extra:
            utf8_text(name, "a file name")
            utf8_text(text, "a file's text")
            if sep is not None:
                out += [sep] + b.tokenize(name + "\n", add_special=False)
            else:
                out += b.tokenize("\n\n--- snippet ---\n\n", add_special=False)
            out += b.tokenize(text, add_special=False)
        if sep is not None:
            out += [sep] + b.tokenize("filename\n", add_special=False)
        return out
