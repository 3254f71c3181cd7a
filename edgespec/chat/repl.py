"""The interactive terminal chat behind ``edgespec chat``.

One ChatSession holds the conversation (system prompt + user/assistant turns)
and an Engine; ``run_chat`` drives it from a terminal (prompts, streamed
answers, a dim footer per answer, slash commands) or from a pipe (one answer
per input line on stdout, a plain stats line per answer on stderr, no prompts).

Behaviour worth knowing:
- Ctrl-C during an answer stops it; the partial answer (what was printed)
  stays in the history, so "continue" works. Ctrl-C at the prompt clears the
  line, Ctrl-D at the prompt ends the session (exit status 0).
- Before each turn the rendered conversation plus max_tokens must fit the
  context; otherwise the oldest user/assistant turns are dropped (never the
  system prompt) until it fits with a quarter of the context to spare (so the
  next turns reuse the KV cache again), with one line on screen saying so.
- Speedup in the footer = this answer's tokens/s over plain decoding's on this
  machine: the median of this session's plain answers (``/drafter none``) when
  there are any, else a ~16-token plain generation measured once at startup
  (not done when the session's drafter is "none").
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import threading
from pathlib import Path
from typing import TextIO

from ..errors import ContextOverflowError, EdgespecError, InvalidArgumentError
from ..text import utf8_text

HELP = """commands:
  /reset          clear the conversation (keeps the system prompt)
  /system TEXT    set the system prompt (/system alone removes it)
  /drafter NAME   drafter for the next answers: none, ngram, recycle, cache, model, auto
  /stats          statistics of the last answer
  /save FILE      write the conversation as JSON
  /help           this list
  /exit           leave (Ctrl-D too); Ctrl-C stops an answer"""

CALIBRATION_PROMPT = "Count from 1 to 30, separated by commas."
CALIBRATION_TOKENS = 16


def read_template(path: str | os.PathLike) -> str:
    """The contents of a --template FILE (a Jinja chat template)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgumentError(f"cannot read template file {path}: {e}") from None
    if not text.strip():
        raise InvalidArgumentError(f"template file {path} is empty")
    return text


class ChatSession:
    """A conversation with one engine. Output goes to ``out`` (answers) and
    ``err`` (piped-mode stats); ``interactive`` selects prompts and footers.
    ``sampling``: Engine.stream's sampling options for every answer
    (temperature, top_k, top_p, min_p, repeat_penalty, seed, stop)."""

    def __init__(self, engine, *, system: str | None = None, template: str | None = None,
                 max_tokens: int = 512, interactive: bool = True, colour: bool = False,
                 out: TextIO | None = None, err: TextIO | None = None, **sampling):
        if template:
            engine.chat_template = template
        if not engine.chat_template:
            raise InvalidArgumentError(f"model {engine.model_ref} has no chat template; "
                                       "pass one with --template FILE")
        if max_tokens <= 0:
            raise InvalidArgumentError(f"max_tokens must be > 0, got {max_tokens}")
        self.engine = engine
        self.system = system or None
        self.history: list[dict] = []      # user/assistant messages, oldest first
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.drafter = engine.drafter
        self.interactive = interactive
        self.colour = colour
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.last = None                   # Result of the last answer
        self.plain_rates: list[float] = []  # tokens/s of this session's plain answers
        self.startup_rate: float | None = None

    # -- conversation ---------------------------------------------------------

    def messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.history

    def _prompt_len(self, messages: list[dict]) -> int:
        text = self.engine.render_chat(messages)
        return len(self.engine.backend.tokenize(text, parse_special=True))

    def fit(self) -> int:
        """Drop the oldest turns until the conversation plus max_tokens fits the
        context; return how many turns were dropped. The newest user message
        (the one to answer) is never dropped: if it alone does not fit, raise."""
        n_ctx = self.engine.backend.n_ctx
        limit = n_ctx
        dropped = 0
        while True:
            n = self._prompt_len(self.messages())
            if n + self.max_tokens <= limit:
                return dropped
            if len(self.history) <= 1:
                if n + self.max_tokens <= n_ctx:
                    return dropped
                raise ContextOverflowError(
                    f"this message needs {n} prompt tokens + {self.max_tokens} to generate, "
                    f"more than the context of {n_ctx} (shorten it, lower --max-tokens or raise --ctx)")
            # Once dropping, leave a quarter of the context free: the next few
            # turns then extend the cached prefix instead of re-evaluating it all.
            limit = n_ctx - n_ctx // 4
            # one turn = a user message and the assistant answers after it
            del self.history[0]
            while len(self.history) > 1 and self.history[0]["role"] != "user":
                del self.history[0]
            dropped += 1

    def reset(self) -> None:
        self.history.clear()
        self.last = None

    def save(self, path: str) -> None:
        data = {"model": self.engine.model_ref, "messages": self.messages()}
        try:
            Path(path).write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
        except OSError as e:
            raise InvalidArgumentError(f"cannot write {path}: {e}") from None

    # -- answering --------------------------------------------------------------

    def ask(self, text: str) -> bool:
        """Answer one user message, streaming it to ``out``. Return False when
        the answer was interrupted (Ctrl-C)."""
        self.history.append({"role": "user", "content": text})
        try:
            dropped = self.fit()
        except EdgespecError:
            self.history.pop()
            raise
        if dropped:
            self._note(f"(context full: dropped the oldest {dropped} turn{'s' * (dropped > 1)} "
                       "from the conversation)")
        engine = self.engine
        printed: list[str] = []
        interrupted = False
        pieces = None
        try:
            pieces = engine.stream(messages=self.messages(), max_tokens=self.max_tokens,
                                   drafter=self.drafter, **self.sampling)
            for piece in pieces:
                printed.append(piece)
                self.out.write(piece)
                self.out.flush()
        except KeyboardInterrupt:
            interrupted = True
        except EdgespecError:
            self.history.pop()
            raise
        finally:
            if pieces is not None:
                pieces.close()  # stops the generation; its stats are kept
        result = pieces.result if pieces is not None else None
        answer = result.text if result is not None and not interrupted else "".join(printed)
        if answer:
            self.history.append({"role": "assistant", "content": answer})
        else:
            self.history.pop()  # nothing said: forget the question too (keeps roles alternating)
        self.out.write("\n")
        self.last = result
        if result is not None:
            s = result.stats
            if s.spec is None and s.n_tokens >= 8 and s.decode_s > 0 and not interrupted:
                self.plain_rates.append(s.tokens_per_s)
        if interrupted:
            self._note("[interrupted]")
        if result is not None:
            self._footer(result)
        self.out.flush()
        return not interrupted

    def measure_plain(self) -> None:
        """Plain decoding's tokens/s on this machine, from one short generation
        (only needed when this session speculates)."""
        if self.drafter == "none":
            return
        r = self.engine.generate(messages=[{"role": "user", "content": CALIBRATION_PROMPT}],
                                 max_tokens=CALIBRATION_TOKENS, temperature=0.0, seed=0, drafter="none")
        if r.stats.decode_s > 0 and r.stats.n_tokens:
            self.startup_rate = r.stats.tokens_per_s

    def baseline(self) -> float | None:
        if self.plain_rates:
            return statistics.median(self.plain_rates)
        return self.startup_rate

    # -- output ---------------------------------------------------------------

    def _dim(self, text: str) -> str:
        return f"\x1b[2m{text}\x1b[0m" if self.colour else text

    def _note(self, text: str) -> None:
        """A one-line notice: on screen in a terminal, on stderr from a pipe."""
        if self.interactive:
            self.out.write(self._dim(text) + "\n")
            self.out.flush()
        else:
            self.err.write(text + "\n")
            self.err.flush()

    def footer_text(self, result) -> str:
        s = result.stats
        parts = [f"{s.n_tokens} tokens", f"{s.tokens_per_s:.1f} tokens/s"]
        if s.spec is not None:
            parts.append(f"drafter {s.drafter}" + (f" ({s.spec.specialized})" if s.spec.specialized else ""))
            if s.spec.drafted:
                parts.append(f"accepted {100 * s.spec.acceptance_rate:.0f}%")
                parts.append(f"{s.spec.mean_accepted:.2f} per step")
            else:
                parts.append("no drafts")
            base = self.baseline()
            if base and s.tokens_per_s > 0:
                parts.append(f"{s.tokens_per_s / base:.2f}x vs plain ({base:.1f} tokens/s)")
        else:
            parts.append("plain decoding")
        cached = s.cached_tokens
        parts.append(f"prompt {s.prompt_tokens}" + (f" ({cached} cached)" if cached else ""))
        if s.experts is not None:
            x = s.experts
            parts.append(f"experts {100 * x['hit_rate']:.0f}% hits, {x['bytes_read'] / 1e6:.1f} MB read, "
                         f"stall {x['stall_ms_per_token']:.2f} ms/token")
        return " · ".join(parts) if self.interactive else ", ".join(parts)

    def _footer(self, result) -> None:
        if self.interactive:
            self.out.write(self._dim(self.footer_text(result)) + "\n")
        else:
            self.err.write(self.footer_text(result) + "\n")
            self.err.flush()

    def stats_text(self) -> str:
        if self.last is None:
            return "no answer yet"
        s = self.last.stats
        cached = s.cached_tokens
        lines = [
            f"prompt: {s.prompt_tokens} tokens ({cached} cached, {s.prompt_tokens - cached} evaluated) "
            f"in {s.prefill_s:.3f} s",
            f"answer: {s.n_tokens} tokens in {s.decode_s:.2f} s, {s.tokens_per_s:.1f} tokens/s, "
            f"stop: {s.stop_reason or 'interrupted'}",
            f"drafter: {s.drafter}",
        ]
        if s.spec is not None:
            lines.append(f"speculation: drafted {s.spec.drafted}, accepted {s.spec.accepted} "
                         f"({100 * s.spec.acceptance_rate:.0f}%), {s.spec.mean_accepted:.2f} accepted "
                         f"per step over {s.spec.target_steps} target steps")
        base = self.baseline()
        if base:
            lines.append(f"plain decoding here: {base:.1f} tokens/s"
                         + (f" (speedup {s.tokens_per_s / base:.2f}x)" if s.spec is not None else ""))
        lines.append(f"conversation: {len(self.history)} messages")
        return "\n".join(lines)

    # -- commands ---------------------------------------------------------------

    def command(self, line: str) -> bool:
        """Run a /command; return False for /exit."""
        name, _, arg = line[1:].partition(" ")
        arg = arg.strip()
        say = self._say
        if name in ("exit", "quit"):
            return False
        if name == "help":
            say(HELP)
        elif name == "reset":
            self.reset()
            say("conversation cleared" + (" (system prompt kept)" if self.system else ""))
        elif name == "system":
            self.system = arg or None
            say("system prompt set" if arg else "system prompt removed")
        elif name == "stats":
            say(self.stats_text())
        elif name == "save":
            if not arg:
                say("usage: /save FILE")
            else:
                self.save(arg)
                say(f"saved {len(self.messages())} messages to {arg}")
        elif name == "drafter":
            from ..drafters import check_name
            if not arg:
                say(f"drafter: {self.drafter}")
            else:
                self.drafter = check_name(arg)
                say(f"drafter: {self.drafter}")
        else:
            say(f"unknown command /{name}; /help lists the commands")
        return True

    def _say(self, text: str) -> None:
        stream = self.out if self.interactive else self.err
        stream.write(text + "\n")
        stream.flush()


# -- the loops ----------------------------------------------------------------


def _interactive(session: ChatSession) -> int:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    out = session.out
    e = session.engine
    out.write(session._dim(f"edgespec chat · {e.model_ref} · drafter {session.drafter} · "
                           "/help for commands, Ctrl-D to leave") + "\n")
    out.flush()
    while True:
        try:
            line = input("> ")
        except KeyboardInterrupt:
            out.write("\n")  # Ctrl-C at the prompt: drop the line, ask again
            continue
        except EOFError:
            out.write("\n")
            return 0
        line = line.strip()
        if not line:
            continue
        try:
            utf8_text(line, "input")
            if line.startswith("/"):
                if not session.command(line):
                    return 0
            else:
                session.ask(line)
        except KeyboardInterrupt:
            out.write("\n")
        except EdgespecError as err:
            out.write(f"error: {err}\n")
        out.flush()


def _piped(session: ChatSession, stdin: TextIO) -> int:
    status = 0
    for number, raw in enumerate(stdin, 1):
        line = raw.strip()
        if not line:
            continue
        try:
            utf8_text(raw, f"input line {number}")
            if line.startswith("/"):
                if not session.command(line):
                    break
            else:
                session.ask(line)
        except EdgespecError as err:
            session.err.write(f"error: {err}\n")
            session.err.flush()
            status = 2
    return status


def run_chat(engine, *, system: str | None = None, template: str | None = None,
             max_tokens: int = 512, stdin: TextIO | None = None, stdout: TextIO | None = None,
             stderr: TextIO | None = None, **sampling) -> int:
    """Chat on a terminal, or answer each line of piped stdin; return the exit status.
    ``sampling``: as ChatSession's."""
    if stdin is None:
        stdin = sys.stdin
        # Bytes that are not UTF-8 reach the loops as lone surrogates, which
        # they report as an error, instead of failing inside the reader.
        if hasattr(stdin, "reconfigure"):
            stdin.reconfigure(errors="surrogateescape")
    stdout = stdout or sys.stdout
    interactive = stdin.isatty()
    colour = interactive and stdout.isatty() and not os.environ.get("NO_COLOR")
    if interactive and threading.current_thread() is threading.main_thread():
        # Ctrl-C must stop an answer even when we were started with SIGINT
        # ignored (as background jobs of a non-interactive shell are).
        signal.signal(signal.SIGINT, signal.default_int_handler)
    session = ChatSession(engine, system=system, template=template, max_tokens=max_tokens,
                          interactive=interactive, colour=colour, out=stdout, err=stderr or sys.stderr,
                          **sampling)
    try:
        session.measure_plain()
    except KeyboardInterrupt:
        return 130
    if interactive:
        return _interactive(session)
    try:
        return _piped(session, stdin)
    except KeyboardInterrupt:
        return 130
