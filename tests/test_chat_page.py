"""The chat page at / in a real headless Chromium (Debian's chromium and
chromium-driver, driven by selenium), on the tiny random llama: a question
typed and sent, the answer streamed in, the stats line under it; Markdown
(a fenced code block as <pre><code> with a copy button), a system prompt, a
"stopped" mark, conversations that survive a reload. A screenshot is saved
in $EDGESPEC_TEST_ARTIFACTS (else the test's tmp_path).

Without Chromium the test is skipped, unless EDGESPEC_REQUIRE_BROWSER=1 (CI
installs it and sets that)."""
from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import pytest

from edgespec import Engine
from edgespec.server import make_server

QUESTION = "What is the capital of France?"
MAX_TOKENS = 12


def browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (chromium and driver):
        if os.environ.get("EDGESPEC_REQUIRE_BROWSER") == "1":
            pytest.fail("chromium and chromedriver are required (EDGESPEC_REQUIRE_BROWSER=1)")
        pytest.skip("no chromium / chromedriver (apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1000,720"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


@pytest.fixture
def server(tiny_llama_path):
    with Engine(str(tiny_llama_path), threads=1, n_ctx=2048, ctx_extend=True, drafter="ngram") as engine:
        server = make_server(engine, port=0, quiet=True, model_name="tiny")
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield server
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_chat_page_streams_an_answer_with_stats(server, tmp_path):
    from selenium.webdriver.common.by import By

    with server.engine_lock:
        ref = server.engine.generate(messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX_TOKENS,
                                     temperature=0.0)
    driver = browser()
    try:
        wait = _page(driver, server)
        _ask(driver, wait, QUESTION)
        answer = "document.querySelector('.message.assistant .content')"
        wait.until(lambda d: d.execute_script(f"return {answer} && {answer}.dataset.text.length > 0"))
        stats = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".message.assistant .stats"))[0].text
        text = driver.execute_script(f"return {answer}.dataset.text")   # the raw text; shown as Markdown
        assert text == ref.text
        assert driver.find_element(By.CSS_SELECTOR, ".message.user .content").text == QUESTION
        assert re.fullmatch(r"\d+\.\d tok/s · acceptance \d+% · ≈\d+\.\d\d× \(estimated\) · drafter ngram( \(.+\))?"
                            rf" · {ref.stats.n_tokens} tokens, first after \d+\.\d\d s", stats), stats
        assert driver.find_element(By.ID, "send").is_enabled()
        artifacts = Path(os.environ.get("EDGESPEC_TEST_ARTIFACTS") or tmp_path)
        artifacts.mkdir(parents=True, exist_ok=True)
        shot = artifacts / "chat-page.png"
        assert driver.save_screenshot(str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 2000
    finally:
        driver.quit()


def _page(driver, server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, 60)
    driver.get(server.url + "/")
    wait.until(lambda d: d.find_element(By.ID, "model").get_attribute("value") == "tiny")
    return wait


def _ask(driver, wait, question, max_tokens=MAX_TOKENS):
    from selenium.webdriver.common.by import By

    for field, value in (("temperature", "0"), ("max-tokens", str(max_tokens))):
        box = driver.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    driver.find_element(By.ID, "prompt").send_keys(question)
    driver.find_element(By.ID, "send").click()


def test_markdown_code_blocks_and_a_conversation_that_survives_a_reload(server):
    from selenium.webdriver.common.by import By

    driver = browser()
    try:
        wait = _page(driver, server)
        # a conversation as the page keeps it, with an answer holding Markdown
        answer = "Here:\n\n```python\nprint('<b>hi</b>')\n```\n\n**done** and `x`"
        store = {"current": "c1", "list": [{"id": "c1", "title": "code", "system": "Be brief.", "turns": [
            {"role": "user", "content": "show code"}, {"role": "assistant", "content": answer, "stats": "1.0 tok/s"}]}]}
        driver.execute_script("localStorage.setItem('edgespec-conversations', arguments[0])", json.dumps(store))
        driver.refresh()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".message.assistant pre > code"))
        code = driver.find_element(By.CSS_SELECTOR, ".message.assistant pre > code")
        assert code.text == "print('<b>hi</b>')" and code.get_attribute("class") == "language-python"
        assert driver.find_elements(By.CSS_SELECTOR, ".message.assistant b") == []   # text, never markup
        assert driver.find_element(By.CSS_SELECTOR, ".message.assistant strong").text == "done"
        copy = driver.find_element(By.CSS_SELECTOR, ".message.assistant .code button.copy")
        copy.click()
        wait.until(lambda d: copy.text == "Copied")
        assert driver.find_element(By.ID, "system").get_attribute("value") == "Be brief."
        # a new question in this conversation goes with its system prompt and earlier turns
        _ask(driver, wait, QUESTION)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".message.assistant .stats")) == 2)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "show code"},
                    {"role": "assistant", "content": answer}, {"role": "user", "content": QUESTION}]
        with server.engine_lock:
            ref = server.engine.generate(messages=messages, max_tokens=MAX_TOKENS, temperature=0.0)
        last = "document.querySelectorAll('.message.assistant .content')[1].dataset.text"
        assert driver.execute_script(f"return {last}") == ref.text
        driver.refresh()   # the conversation survives a reload
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".message")) == 4)
        assert driver.execute_script(f"return {last}") == ref.text
        assert [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".message.user .content")] == \
            ["show code", QUESTION]
        assert driver.find_element(By.CSS_SELECTOR, "#conversations li.active").text == "code"
    finally:
        driver.quit()


class _Slow:
    """A generation that yields a piece every 20 ms: the tiny model answers
    1900 tokens in half a second, before a click could stop it."""

    def __init__(self, gen):
        self._gen = gen

    def __getattr__(self, name):
        return getattr(self._gen, name)

    def __iter__(self):
        return self

    def __next__(self):
        time.sleep(0.02)
        return next(self._gen)


def test_a_stopped_answer_is_marked_with_what_came(server, monkeypatch):
    from selenium.webdriver.common.by import By

    start = server.engine.start   # what the server runs each request's generation with
    monkeypatch.setattr(server.engine, "start", lambda *a, **kw: _Slow(start(*a, **kw)))
    driver = browser()
    try:
        wait = _page(driver, server)
        _ask(driver, wait, QUESTION, max_tokens=1900)
        answer = "document.querySelector('.message.assistant .content')"
        wait.until(lambda d: d.execute_script(f"return {answer} && {answer}.dataset.text.length > 0"))
        driver.find_element(By.ID, "stop").click()
        mark = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".message.assistant .stopped"))[0].text
        assert re.fullmatch(r"stopped · \d+ pieces in \d+\.\d\d s, first after \d+\.\d\d s", mark), mark
        assert not driver.find_elements(By.CSS_SELECTOR, ".message.assistant .stats")
        driver.refresh()   # kept with the conversation
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".message.assistant .stopped"))
    finally:
        driver.quit()
