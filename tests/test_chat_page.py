"""The chat page at / in a real headless Chromium (Debian's chromium and
chromium-driver, driven by selenium), on the tiny random llama: a question
typed and sent, the answer streamed in, the stats line under it. A
screenshot is saved in $EDGESPEC_TEST_ARTIFACTS (else the test's tmp_path).

Without Chromium the test is skipped, unless EDGESPEC_REQUIRE_BROWSER=1 (CI
installs it and sets that)."""
from __future__ import annotations

import os
import re
import shutil
import threading
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
    with Engine(str(tiny_llama_path), threads=1, n_ctx=256, drafter="ngram") as engine:
        server = make_server(engine, port=0, quiet=True, model_name="tiny")
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield server
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_chat_page_streams_an_answer_with_stats(server, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with server.engine_lock:
        ref = server.engine.generate(messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX_TOKENS,
                                     temperature=0.0)
    driver = browser()
    try:
        wait = WebDriverWait(driver, 60)
        driver.get(server.url + "/")
        wait.until(lambda d: d.find_element(By.ID, "model").get_attribute("value") == "tiny")
        for field, value in (("temperature", "0"), ("max-tokens", str(MAX_TOKENS))):
            box = driver.find_element(By.ID, field)
            box.clear()
            box.send_keys(value)
        driver.find_element(By.ID, "prompt").send_keys(QUESTION)
        driver.find_element(By.ID, "send").click()
        answer = "document.querySelector('.message.assistant .content')"
        wait.until(lambda d: d.execute_script(f"return {answer} && {answer}.textContent.length > 0"))
        stats = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".message.assistant .stats"))[0].text
        text = driver.execute_script(f"return {answer}.textContent")
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
