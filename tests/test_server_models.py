"""The server over an EnginePool (tiny random models, fast tier): several
models by name, loaded on first request, LRU under a memory budget, 404s
naming the served models; /v1/embeddings (the official openai client, float
and base64) and Ollama's /api/embed; two concurrent conversations keeping
their prefixes in their own KV-cache slots (usage.prompt_tokens_details)."""
from __future__ import annotations

import base64
import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from edgespec.pool import EnginePool, model_bytes
from edgespec.server import make_server

from test_server_platform import invoke, post, request

OPTIONS = dict(threads=1, n_ctx=256, slots=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_llama_path, tiny_qwen2_path):
    d = tmp_path_factory.mktemp("served")
    shutil.copy(tiny_llama_path, d / "alpha.gguf")
    shutil.copy(tiny_qwen2_path, d / "beta.gguf")
    return [str(d / "alpha.gguf"), str(d / "beta.gguf")]


def serving(pool):
    server = make_server(pool, port=0, quiet=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


@pytest.fixture(scope="module")
def served(models):
    with EnginePool(models, max_loaded_bytes=0, pull=False, **OPTIONS) as pool:
        server, thread = serving(pool)
        yield server, pool
        server.shutdown()
        server.server_close()
        thread.join(10)


def get_json(server, path):
    status, _, body = request(server, "GET", path)
    return status, json.loads(body)


def chat(server, model, messages, **kw):
    status, _, body = post(server, "/v1/chat/completions",
                           {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0, **kw})
    assert status == 200, body
    return json.loads(body)


def test_models_are_listed_and_loaded_on_first_request(served):
    server, pool = served
    pool.unload("beta")
    status, listing = get_json(server, "/v1/models")
    assert status == 200 and [m["id"] for m in listing["data"]] == ["alpha", "beta"]
    assert next(m for m in listing["data"] if m["id"] == "beta")["loaded"] is False
    reply = chat(server, "beta", [{"role": "user", "content": "Hi"}])
    assert reply["model"] == "beta" and reply["usage"]["completion_tokens"] == 4
    assert get_json(server, "/v1/models/beta")[1]["loaded"] is True
    _, tags = get_json(server, "/api/tags")
    assert {m["name"] for m in tags["models"]} == {"alpha:latest", "beta:latest"}


def test_an_unknown_model_is_a_404_naming_the_served_ones(served):
    server, _ = served
    for path, body in (("/v1/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/embeddings", {"model": "gpt-4o", "input": "x"})):
        status, _, data = post(server, path, body)
        error = json.loads(data)["error"]
        assert status == 404 and error["code"] == "model_not_found" and error["param"] == "model"
        assert "gpt-4o" in error["message"] and "alpha, beta" in error["message"]
    status, _, data = request(server, "GET", "/v1/models/gpt-4o")
    assert status == 404 and "alpha, beta" in json.loads(data)["error"]["message"]
    status, _, data = post(server, "/api/chat", {"model": "gpt-4o", "messages": []})
    assert status == 404 and "alpha, beta" in json.loads(data)["error"]


def test_embeddings_with_the_openai_client(served):
    openai = pytest.importorskip("openai")
    server, pool = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    texts = ["The cat sat on the mat.", "def f(x): return x", "Hello"]
    got = client.embeddings.create(model="alpha", input=texts)   # the client asks for base64
    vectors = np.array([d.embedding for d in got.data])
    with pool.engine("alpha") as engine:
        expected = engine.embed(texts)
        n_tokens = sum(len(t) for t in engine.embedding_inputs(texts))
    assert vectors.shape == (3, engine.backend.n_embd)
    assert np.allclose(vectors, expected, atol=1e-6)
    assert got.usage.prompt_tokens == got.usage.total_tokens == n_tokens
    again = client.embeddings.create(model="alpha", input=texts, encoding_format="float")
    assert np.allclose(np.array([d.embedding for d in again.data]), vectors, atol=1e-6)
    one = client.embeddings.create(model="alpha", input="Hello")
    assert np.allclose(one.data[0].embedding, vectors[2], atol=1e-6)


def test_embeddings_over_plain_http(served):
    server, pool = served
    status, _, data = post(server, "/v1/embeddings", {"model": "alpha", "input": ["a b c"], "encoding_format": "base64"})
    body = json.loads(data)
    assert status == 200 and body["object"] == "list" and body["data"][0]["index"] == 0
    v = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert abs(np.linalg.norm(v) - 1) < 1e-5
    status, _, data = post(server, "/api/embed", {"model": "alpha:latest", "input": ["a b c", "d"]})
    body = json.loads(data)
    assert status == 200 and len(body["embeddings"]) == 2 and body["prompt_eval_count"] > 0
    assert np.allclose(body["embeddings"][0], v, atol=1e-6)
    status, _, data = post(server, "/api/embeddings", {"model": "alpha", "prompt": "a b c"})
    assert status == 200 and np.allclose(json.loads(data)["embedding"], v, atol=1e-6)
    # dimensions: the first so many, at unit length again (OpenAI's and Ollama's)
    with pool.engine("alpha") as engine:
        whole = engine.embed(["a b c"], normalize=False)[0]
    short = whole[:3] / np.linalg.norm(whole[:3])
    for path, body, key in (("/v1/embeddings", {"input": "a b c"}, lambda b: b["data"][0]["embedding"]),
                            ("/api/embed", {"input": "a b c"}, lambda b: b["embeddings"][0])):
        status, _, data = post(server, path, {"model": "alpha", "dimensions": 3, **body})
        assert status == 200 and np.allclose(key(json.loads(data)), short, atol=1e-6)
    for bad, param in (({"model": "alpha"}, "input"), ({"model": "alpha", "input": ""}, "input"),
                       ({"model": "alpha", "input": [[1, 2, 10**7]]}, "input"),
                       ({"model": "alpha", "input": "x", "encoding_format": "int8"}, "encoding_format"),
                       ({"model": "alpha", "input": "x", "dimensions": 10 ** 6}, "dimensions"),
                       ({"model": "alpha", "input": "x", "dimensions": 0}, "dimensions"),
                       ({"model": "alpha", "input": "word " * 300}, "input")):
        status, _, data = post(server, "/v1/embeddings", bad)
        assert status == 400 and json.loads(data)["error"]["param"] == param, data


def test_two_concurrent_conversations_keep_their_prefixes(served):
    server, _ = served
    system = {"role": "system", "content": "You answer briefly."}
    turns: dict[int, list] = {}
    go = threading.Barrier(2)

    def conversation(k):
        history = [system, {"role": "user", "content": f"Topic number {k}: tell me about {'seas' if k else 'hills'}."}]
        go.wait()
        replies = []
        for follow_up in ("Why?", "And then?"):
            reply = chat(server, "alpha", history)
            replies.append(reply)
            history += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                        {"role": "user", "content": follow_up}]
        turns[k] = replies

    threads = [threading.Thread(target=conversation, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for replies in turns.values():
        first, second = replies
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    assert {turns[0][1]["edgespec"]["slot"], turns[1][1]["edgespec"]["slot"]} == {0, 1}


def test_least_recently_used_model_is_unloaded_under_the_budget(models):
    a, b = (model_bytes(Path(m), OPTIONS["n_ctx"], OPTIONS["slots"] + 1) for m in models)
    budget = max(a, b) + min(a, b) // 2   # either fits, not both
    with EnginePool(models, max_loaded_bytes=budget, pull=False, **OPTIONS) as pool:
        server, thread = serving(pool)
        try:
            chat(server, "alpha", [{"role": "user", "content": "Hi"}])
            chat(server, "beta", [{"role": "user", "content": "Hi"}])
            _, listing = get_json(server, "/v1/models")
            assert [m["loaded"] for m in listing["data"]] == [False, True]
            _, ps = get_json(server, "/api/ps")
            assert [m["name"] for m in ps["models"]] == ["beta:latest"]
        finally:
            server.shutdown()
            server.server_close()
            thread.join(10)


@pytest.mark.parametrize("args, words", [
    (["--slots", "0"], "--slots must be in [1, 64], got 0"),
    (["--max-loaded-bytes", "-1"], "--max-loaded-bytes must be >= 0, got -1"),
])
def test_serve_options_are_checked(args, words):
    code, _, stderr, _ = invoke("serve", *args, env={})
    assert code == 2 and stderr.strip() == f"error: {words}", stderr


def test_serve_loads_its_first_model_at_start(tmp_path, models):
    code, _, stderr, _ = invoke("serve", "--model", models[0], "--model", str(tmp_path / "missing.gguf"),
                             "--host", "256.0.0.1", env={})   # the second is not read before it is asked for
    # Loading may first measure this machine (one "edgespec: measuring ..." notice).
    errors = [line for line in stderr.splitlines() if not line.startswith("edgespec: ")]
    assert code == 2 and errors == [errors[0]] and errors[0].startswith("error: cannot listen on 256.0.0.1"), stderr
    _, _, _, error = invoke("serve", "--model", str(tmp_path / "missing.gguf"), "--model", models[0], env={})
    assert error is not None and "missing.gguf" in str(error)


def test_a_built_in_model_is_added_when_asked_for(models, smollm2_path):
    with EnginePool(models[:1], max_loaded_bytes=0, **OPTIONS) as pool:
        server, thread = serving(pool)
        try:
            reply = chat(server, "smollm2-135m", [{"role": "user", "content": "Hi"}])
            assert reply["model"] == "smollm2-135m"
            _, listing = get_json(server, "/v1/models")
            assert [(m["id"], m["loaded"]) for m in listing["data"]] == [("alpha", False), ("smollm2-135m", True)]
        finally:
            server.shutdown()
            server.server_close()
            thread.join(10)
