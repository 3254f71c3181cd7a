"""One request through each surface (the Python API, the CLI, the server):
its prompt is rendered and tokenized once, checked once, then run."""
from __future__ import annotations

import http.client
import json
import sys
import threading

import pytest

from edgespec import Engine
from edgespec.backends.native import NativeBackend
from edgespec.server import make_server

PROMPT = "Once upon a time there was a"
CHAT = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture
def tokenized(monkeypatch):
    """The texts the native backend tokenizes, as they are asked for."""
    calls: list[str] = []
    real = NativeBackend.tokenize

    def counting(self, text, **options):
        calls.append(text)
        return real(self, text, **options)

    monkeypatch.setattr(NativeBackend, "tokenize", counting)
    return calls


def test_the_python_api_tokenizes_a_prompt_once(tiny_llama_path, tokenized):
    with Engine(str(tiny_llama_path), threads=1, n_ctx=256) as engine:
        tokenized.clear()
        r = engine.generate(PROMPT, max_tokens=4, temperature=0)
        assert tokenized == [PROMPT] and r.stats.prompt_tokens == len(engine.tokenize(PROMPT))


def test_the_cli_tokenizes_a_prompt_once(tiny_llama_path, tokenized, monkeypatch, capsys):
    from edgespec.cli import main

    monkeypatch.setattr(sys, "argv", ["edgespec", "generate", PROMPT, "--model", str(tiny_llama_path),
                                      "--threads", "1", "--max-tokens", "4", "--drafter", "none", "--json"])
    with pytest.raises(SystemExit) as end:
        main()
    assert end.value.code in (0, None), capsys.readouterr().err
    assert tokenized.count(PROMPT) == 1
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["n_tokens"] == 4


@pytest.mark.parametrize("path, body, text", [
    ("/v1/completions", {"prompt": PROMPT}, PROMPT),
    ("/v1/chat/completions", {"messages": CHAT}, CHAT[0]["content"]),
])
def test_the_server_tokenizes_a_request_once(tiny_llama_path, tokenized, path, body, text):
    with Engine(str(tiny_llama_path), threads=1, n_ctx=256) as engine:
        server = make_server(engine, port=0, quiet=True, model_name="tiny")
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            tokenized.clear()
            host, port = server.server_address[:2]
            conn = http.client.HTTPConnection(host, port, timeout=60)
            conn.request("POST", path, body=json.dumps({**body, "max_tokens": 4, "temperature": 0}),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            answer = json.loads(resp.read())
            conn.close()
        finally:
            server.shutdown()
            server.server_close()
            thread.join(10)
        assert resp.status == 200, answer
        # A chat is tokenized in pieces (its template's text, each message's
        # content apart): each piece once.
        assert sum(text in t for t in tokenized) == 1, tokenized
        assert answer["usage"]["completion_tokens"] == 4
