"""``edgespec chat``: the REPL driven through a pseudo-terminal (pexpect), piped
stdin, and the session logic (template, context trimming, footer) in-process."""
from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from edgespec import Engine
from edgespec.chat.repl import ChatSession, read_template
from edgespec.results import GenerationStats, Result, SpecStats
from edgespec.errors import ContextOverflowError, InvalidArgumentError

pexpect = pytest.importorskip("pexpect")

PROMPT = "> "
FOOTER = re.compile(r"\d+ tokens · [\d.]+ tokens/s")

# A ChatML template of our own, marked so that its use shows in the rendered text.
CUSTOM_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\nCUSTOM:{% endif %}")


def spawn(model, *args):
    child = pexpect.spawn(sys.executable, ["-m", "edgespec", "chat", "--model", str(model),
                                           "--drafter", "none", "--threads", "1", *args],
                          encoding="utf-8", timeout=120, dimensions=(40, 200))
    child.expect_exact("/help for commands")
    child.expect_exact(PROMPT)
    return child


def answer(child, question):
    child.sendline(question)
    child.expect(FOOTER)
    child.expect_exact(PROMPT)


def test_chat_session_on_a_terminal(smollm2_path):
    child = spawn(smollm2_path, "--max-tokens", "24")
    try:
        # Ctrl-C at the prompt drops the half-typed line: /stats runs as a command
        child.send("half a line")
        child.expect_exact("half a line")  # echoed: the line editor holds it before the interrupt
        child.sendintr()
        child.expect_exact(PROMPT)
        child.sendline("/stats")
        child.expect_exact("no answer yet")
        child.expect_exact(PROMPT)

        answer(child, "What is 2+2?")
        answer(child, "Name a color.")
        # the second turn extends the first: its prompt reuses the cached K/V
        child.sendline("/stats")
        child.expect(r"prompt: (\d+) tokens \((\d+) cached, (\d+) evaluated\)")
        total, cached, evaluated = map(int, child.match.groups())
        assert cached > 0 and evaluated < total
        child.expect_exact("conversation: 4 messages")
        child.expect_exact(PROMPT)

        child.sendline("/frobnicate")
        child.expect_exact("unknown command /frobnicate")
        child.expect_exact(PROMPT)
        child.sendline("/reset")
        child.expect_exact("conversation cleared")
        child.expect_exact(PROMPT)
        child.sendline("/stats")
        child.expect_exact("no answer yet")
        child.expect_exact(PROMPT)

        child.sendeof()  # Ctrl-D at the prompt leaves
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_an_answer_and_keeps_the_session(smollm2_path):
    child = spawn(smollm2_path, "--max-tokens", "200")
    try:
        question = "Write a long story about a dragon who learns to bake bread."
        child.sendline(question)
        child.expect_exact(question + "\r\n")   # the terminal's echo
        child.expect(r"\w\w")                   # the answer has started
        child.sendintr()
        child.expect_exact("[interrupted]")
        child.expect(FOOTER)
        child.expect_exact(PROMPT)
        child.sendline("/stats")
        child.expect(r"answer: (\d+) tokens")
        assert int(child.match.group(1)) < 200
        child.expect_exact("conversation: 2 messages")  # the partial answer is kept
        child.expect_exact(PROMPT)
        answer(child, "What is 2+2?")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_piped_stdin_answers_each_line(smollm2_path):
    p = subprocess.run([sys.executable, "-m", "edgespec", "chat", "--model", str(smollm2_path),
                        "--drafter", "none", "--max-tokens", "16", "--threads", "1"],
                       input="What is 2+2?\nName a color.\n", capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip()
    assert "\x1b[" not in p.stdout + p.stderr and not p.stdout.startswith(PROMPT)
    stats = [line for line in p.stderr.splitlines() if "tokens/s" in line]
    assert len(stats) == 2, p.stderr


def test_unreadable_template_file_is_a_one_line_error(tmp_path):
    p = subprocess.run([sys.executable, "-m", "edgespec", "chat", "--template", str(tmp_path / "nope.jinja")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.startswith("error: cannot read template file") and p.stderr.count("\n") == 1


# -- in-process ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_llama_path):
    with Engine(str(tiny_llama_path), threads=1, n_ctx=256) as engine:
        yield engine


def fake_engine(template="{{ messages }}", drafter="none"):
    return SimpleNamespace(chat_template=template, model_ref="fake", drafter=drafter)


def test_no_chat_template_needs_template_option():
    with pytest.raises(InvalidArgumentError, match="--template"):
        ChatSession(fake_engine(template=None))


def test_custom_template_is_used(tiny, tmp_path):
    path = tmp_path / "chatml.jinja"
    path.write_text(CUSTOM_TEMPLATE)
    out = io.StringIO()
    session = ChatSession(tiny, template=read_template(path), max_tokens=4, seed=0,
                          interactive=False, out=out, err=io.StringIO())
    try:
        assert tiny.render_chat([{"role": "user", "content": "hi"}]).endswith("assistant\nCUSTOM:")
        session.ask("hi")
        assert session.last.stats.n_tokens == 4
        assert [m["role"] for m in session.history] == ["user", "assistant"]
        save = tmp_path / "chat.json"
        session.command(f"/save {save}")
        assert json.loads(save.read_text())["messages"] == session.messages()
    finally:
        tiny.chat_template = None  # back to the model's own template for other tests


def test_sampling_options_apply_to_every_answer(tiny):
    def answers(**sampling):
        session = ChatSession(tiny, template=CUSTOM_TEMPLATE, max_tokens=12, interactive=False,
                              out=io.StringIO(), err=io.StringIO(), **sampling)
        results = []
        for question in ("hi", "again"):
            session.ask(question)
            results.append(session.last)
        return results

    try:
        greedy = [r.text for r in answers(seed=0)]
        # top_k=1 leaves one candidate: sampling at any temperature decodes greedily
        assert [r.text for r in answers(temperature=0.9, top_k=1, seed=3)] == greedy
        assert [r.text for r in answers(temperature=0.9, seed=7)] != greedy
        stop = greedy[0][5:7]
        stopped = answers(seed=0, stop=[stop])
        assert stopped[0].text == greedy[0][:greedy[0].index(stop)]
        assert stopped[0].stats.stop_reason == "stop"
        assert all(stop not in r.text for r in stopped)
    finally:
        tiny.chat_template = None


def test_oldest_turns_are_dropped_to_fit_the_context(tiny):
    session = ChatSession(tiny, system="Be brief.", max_tokens=64, interactive=False)
    for i in range(12):
        session.history += [{"role": "user", "content": f"question {i} " * 4},
                            {"role": "assistant", "content": f"answer {i} " * 4}]
    session.history.append({"role": "user", "content": "last question"})
    dropped = session.fit()
    assert dropped > 0
    assert session.messages()[0] == {"role": "system", "content": "Be brief."}
    assert session.history[0]["role"] == "user" and session.history[-1]["content"] == "last question"
    # dropping leaves a quarter of the context free, so the next turns extend the cached prefix
    assert session._prompt_len(session.messages()) + 64 <= tiny.backend.n_ctx * 3 // 4
    session.history = [{"role": "user", "content": "word " * 300}]
    with pytest.raises(ContextOverflowError):
        session.fit()


def test_footer_speedup_against_plain_answers():
    session = ChatSession(fake_engine(drafter="ngram"), interactive=True)
    spec = SpecStats(drafted=10, accepted=6, target_steps=5)
    result = Result("x", [1] * 40, GenerationStats(prompt_tokens=20, n_tokens=40, decode_s=1.0,
                                                   drafter="ngram", spec=spec))
    session.startup_rate = 25.0
    assert "1.60x vs plain (25.0 tokens/s)" in session.footer_text(result)
    session.plain_rates = [10.0, 20.0, 30.0]  # the session's own plain answers win over startup's
    footer = session.footer_text(result)
    assert "40.0 tokens/s" in footer and "accepted 60%" in footer and "1.20 per step" in footer
    assert "2.00x vs plain (20.0 tokens/s)" in footer
    assert "drafter ngram ·" in footer
    # auto with a specialized drafter routed to: the footer names it
    spec.drafters = {"ngram": {}, "specialized:deu": {"specialized": "deu"}}
    assert "drafter ngram (deu) ·" in session.footer_text(result)


# -- bounded rendering: a chat template is code from the model file -------------------

# 4 KiB a turn, so that the text budget stops it long before the time budget
# would (a character a turn takes about the 5 s budget on a slow machine)
LOOPS = '{% for i in range(100000) %}{% for j in range(100000) %}{{ "x" * 4096 }}{% endfor %}{% endfor %}'
SILENT_LOOPS = ("{% set r = range(100000)|list %}{% for i in r %}{% for j in r %}{% endfor %}"
                "{% endfor %}{{ messages[0].content }}")
DOUBLING = ('{% set s = namespace(v="ab") %}{% for i in range(40) %}{% set s.v = s.v ~ s.v %}'
            "{% endfor %}{{ s.v|length }}")


@pytest.mark.parametrize("template, budget", [(LOOPS, "MiB of text"), (SILENT_LOOPS, "s to render"),
                                              (DOUBLING, "memory")])
def test_a_runaway_template_is_stopped_within_its_budget(template, budget):
    from edgespec.chat.template import RENDER_SECONDS, TemplateBudgetError, render

    hi = [{"role": "user", "content": "hi"}]
    t0 = time.monotonic()
    with pytest.raises(TemplateBudgetError, match=budget):
        render(template, hi)
    assert time.monotonic() - t0 < RENDER_SECONDS + 3
    assert render("{{ messages[0].content }}!", hi) == "hi!"   # the next render is served


def test_piped_chat_with_a_runaway_template_exits_2(tiny_llama_path, tmp_path):
    path = tmp_path / "loops.jinja"
    path.write_text(SILENT_LOOPS)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "edgespec", "chat", "--model", str(tiny_llama_path),
                        "--template", str(path), "--drafter", "none", "--threads", "1"],
                       input="hello\n", capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "error: chat template took more than" in p.stderr
    assert time.monotonic() - t0 < 60
