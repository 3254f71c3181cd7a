"""The server beyond OpenAI's completions, on the tiny random llama (fast
tier): Ollama's API over plain HTTP, CORS, /metrics, the chat page's files,
the official openai client streaming; and the command line's --version,
config file and environment variables.

Generations are greedy, so each answer is compared with the engine's own
answer to the same request."""
from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from edgespec import Engine
from edgespec.models import registry
from edgespec.server import make_server
from edgespec.server.ollama import DEFAULTS

from test_registry import fake_model, home  # noqa: F401  (fixtures: a built-in model pulled from local wheels)

MODEL = "tiny"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    with Engine(str(tiny_llama_path), threads=1, n_ctx=256, drafter="ngram") as e:
        yield e


def start(engine, **kw):
    server = make_server(engine, port=0, quiet=True, model_name=MODEL, **kw)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


def stop(server, thread):
    server.shutdown()
    server.server_close()
    thread.join(10)


@pytest.fixture(scope="module")
def server(engine):
    server, thread = start(engine)
    yield server
    stop(server, thread)


def request(server, method, path, body=None, headers=None):
    """(status, headers, body bytes) of one plain HTTP request (a body as JSON)."""
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
    try:
        data = json.dumps(body) if isinstance(body, dict) else body
        json_type = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers={**json_type, **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.headers, resp.read()
    finally:
        conn.close()


def post(server, path, body, **kw):
    status, headers, data = request(server, "POST", path, body, **kw)
    return status, headers, data


def ndjson(data: bytes) -> list[dict]:
    assert data.endswith(b"\n")
    return [json.loads(line) for line in data.decode().splitlines()]


def reference(server, **request):
    """The engine's greedy answer under Ollama's default options."""
    opts = {**DEFAULTS, "temperature": 0.0, **request}
    with server.engine_lock:
        return server.engine.generate(**opts)


# -- Ollama's API ----------------------------------------------------------------------------

def test_ollama_models(server, tiny_llama_path):
    status, _, data = request(server, "GET", "/api/version")
    assert status == 200 and isinstance(json.loads(data)["version"], str)
    tags = json.loads(request(server, "GET", "/api/tags")[2])["models"]
    assert [m["name"] for m in tags] == ["tiny:latest"]
    assert tags[0]["size"] == tiny_llama_path.stat().st_size
    assert tags[0]["details"]["format"] == "gguf" and tags[0]["details"]["family"] == "llama"
    assert len(tags[0]["digest"]) == 64
    ps = json.loads(request(server, "GET", "/api/ps")[2])["models"]
    assert ps[0]["name"] == "tiny:latest" and "expires_at" in ps[0]
    for name in ("tiny", "tiny:latest"):
        status, _, data = post(server, "/api/show", {"model": name})
        show = json.loads(data)
        assert status == 200 and show["model_info"]["general.architecture"] == "llama"
        assert "<|im_start|>" in show["template"] and show["details"] == tags[0]["details"]
    status, _, data = post(server, "/api/show", {"model": "llama3"})
    assert status == 404 and "tiny" in json.loads(data)["error"]


def test_ollama_generate(server):
    opts = {"temperature": 0, "num_predict": 8}
    ref = reference(server, messages=[{"role": "user", "content": PROMPT}], max_tokens=8)
    # streamed (the default): a line per piece, then the final one with the counts
    status, headers, data = post(server, "/api/generate", {"model": MODEL, "prompt": PROMPT, "options": opts})
    assert status == 200 and headers["Content-Type"] == "application/x-ndjson"
    lines = ndjson(data)
    *pieces, final = lines
    assert all(p["done"] is False and p["model"] == MODEL and p["created_at"].endswith("Z") for p in pieces)
    assert "".join(p["response"] for p in pieces) == ref.text
    assert final["done"] is True and final["response"] == "" and final["done_reason"] == "length"
    assert final["eval_count"] == ref.stats.n_tokens == 8
    assert final["prompt_eval_count"] == ref.stats.prompt_tokens
    assert final["eval_duration"] > 0 and final["total_duration"] >= final["eval_duration"]
    assert final["edgespec"]["drafter"] == "ngram" and final["edgespec"]["estimated_speedup"] > 0
    # one object
    status, _, data = post(server, "/api/generate", {"model": MODEL, "prompt": PROMPT, "options": opts,
                                                     "stream": False})
    whole = json.loads(data)
    assert status == 200 and whole["response"] == ref.text and whole["done"] is True
    # raw: the prompt as it is, no template
    raw_ref = reference(server, prompt=PROMPT, max_tokens=8)
    whole = json.loads(post(server, "/api/generate", {"model": MODEL, "prompt": PROMPT, "raw": True,
                                                      "options": opts, "stream": False})[2])
    assert whole["response"] == raw_ref.text
    # an empty prompt loads the model
    whole = json.loads(post(server, "/api/generate", {"model": MODEL})[2])
    assert whole["done"] is True and whole["done_reason"] == "load"


def test_ollama_chat(server):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello!"}]
    opts = {"temperature": 0, "num_predict": 6, "stop": ["\n\n"]}
    ref = reference(server, messages=messages, max_tokens=6, stop=["\n\n"])
    status, _, data = post(server, "/api/chat", {"model": "tiny:latest", "messages": messages, "options": opts})
    *pieces, final = ndjson(data)
    assert status == 200 and all(p["message"]["role"] == "assistant" for p in pieces)
    assert "".join(p["message"]["content"] for p in pieces) == ref.text
    assert final["done"] is True and final["eval_count"] == ref.stats.n_tokens
    whole = json.loads(post(server, "/api/chat", {"model": MODEL, "messages": messages, "options": opts,
                                                  "stream": False})[2])
    assert whole["message"] == {"role": "assistant", "content": ref.text} and whole["done"] is True


@pytest.mark.parametrize("body, status, words", [
    ({"prompt": "x"}, 400, "model is required"),
    ({"model": "llama3", "prompt": "x"}, 404, "tiny"),
    ({"model": MODEL, "prompt": "x", "format": "xml"}, 400, "format"),
    ({"model": MODEL, "prompt": "x", "format": {"type": "object", "properties": {"a": {"not": {}}}}}, 400, "not"),
    ({"model": MODEL, "prompt": "x", "images": ["aGk="]}, 400, "images"),
    ({"model": MODEL, "prompt": "x", "options": {"mirostat": 2}}, 400, "mirostat"),
    ({"model": MODEL, "prompt": "x", "options": {"temperature": "hot"}}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "options": {"top_p": 1.5}}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "options": {"num_predict": 0}}, 400, "num_predict"),
    ({"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"model": MODEL, "prompt": 5}, 400, "prompt"),
])
def test_ollama_refusals(server, body, status, words):
    got, _, data = post(server, "/api/generate", body)
    err = json.loads(data)
    assert got == status and isinstance(err["error"], str) and words in err["error"], err


def test_ollama_chat_refusals(server):
    for messages, words in (("hi", "messages"), ([{"role": "robot", "content": "x"}], "messages[0]"),
                            ([{"role": "user", "content": 5}], "messages[0].content")):
        status, _, data = post(server, "/api/chat", {"model": MODEL, "messages": messages})
        assert status == 400 and words in json.loads(data)["error"]
    # the server's own settings may be named at their value; any other is refused, naming it
    x = [{"role": "user", "content": "x"}]
    threads = server.engine.backend.threads
    status, _, data = post(server, "/api/chat", {"model": MODEL, "messages": x, "stream": False,
                                                 "options": {"num_thread": threads, "num_gpu": -1, "num_predict": 1}})
    assert status == 200 and json.loads(data)["eval_count"] <= 1
    for options, words in (({"num_thread": threads + 7}, "num_thread"), ({"num_ctx": 10 ** 7}, "context of 10000000"),
                           ({"use_mmap": False}, "use_mmap"), ({"num_gpux": 1}, "num_gpux")):
        status, _, data = post(server, "/api/chat", {"model": MODEL, "messages": x, "options": options})
        assert status == 400 and words in json.loads(data)["error"], data


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_ollama_tool_messages_and_refusals(server):
    """A tool round trip's messages are accepted (the assistant's call with
    object arguments, the tool's answer); misshapen calls and tools on
    /api/generate are 400s naming the problem."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]  # fits 256
    messages = [{"role": "user", "content": "f?"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
                {"role": "tool", "content": "1"}]
    status, _, data = post(server, "/api/chat", {"model": MODEL, "messages": messages, "tools": tools,
                                                 "stream": False, "options": {"num_predict": 4}})
    assert status == 200, data
    assert json.loads(data)["message"]["role"] == "assistant"
    for body, words in (
            ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]},
             "messages[0].tool_calls"),
            ({"messages": [{"role": "assistant", "content": "", "tool_calls": "f()"}]}, "messages[0].tool_calls"),
            ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools")):
        status, _, data = post(server, "/api/chat", {"model": MODEL, **body})
        assert status == 400 and words in json.loads(data)["error"], data
    status, _, data = post(server, "/api/generate", {"model": MODEL, "prompt": "x", "tools": WEATHER})
    assert status == 400 and "tools are for /api/chat" in json.loads(data)["error"]


def test_ollama_tool_calls_from_a_real_model(qwen_coder_05b_path):
    """Qwen2.5-Coder answers a tool question with a JSON call: Ollama's reply
    carries it as message.tool_calls (arguments as an object), streamed as
    one line with no JSON text shown before it."""
    with Engine(str(qwen_coder_05b_path), threads=2, n_ctx=512) as e:
        server, thread = start(e)
        try:
            body = {"model": MODEL, "tools": WEATHER, "options": {"temperature": 0, "num_predict": 60},
                    "messages": [{"role": "user", "content": "What is the weather in Paris right now?"}]}
            status, _, data = post(server, "/api/chat", {**body, "stream": False})
            assert status == 200, data
            message = json.loads(data)["message"]
            assert message["tool_calls"] == [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
            assert "get_weather" not in message["content"]
            status, _, data = post(server, "/api/chat", body)
            lines = ndjson(data)
            assert status == 200 and lines[-1]["done"] is True
            calls = [ln["message"]["tool_calls"] for ln in lines if ln["message"].get("tool_calls")]
            assert calls == [message["tool_calls"]]
            assert "get_weather" not in "".join(ln["message"]["content"] for ln in lines)
        finally:
            stop(server, thread)


def test_ollama_pull(server, fake_model):  # noqa: F811
    status, headers, data = post(server, "/api/pull", {"model": "fake-tiny"})
    lines = ndjson(data)
    assert status == 200 and lines[0] == {"status": "pulling manifest"} and lines[-1] == {"status": "success"}
    progress = [line for line in lines if "completed" in line]
    assert progress and progress[-1]["completed"] == progress[-1]["total"] == len(fake_model)
    assert all(a["completed"] <= b["completed"] for a, b in zip(progress, progress[1:]))
    entry = registry.builtin_models()["fake-tiny"]
    assert registry.cached_path(entry).read_bytes() == fake_model
    # pulled already: one object
    status, _, data = post(server, "/api/pull", {"name": "fake-tiny:latest", "stream": False})
    assert status == 200 and json.loads(data) == {"status": "success"}
    status, _, data = post(server, "/api/pull", {"model": "llama3"})
    assert status == 404 and "fake-tiny" in json.loads(data)["error"]


# -- the API key, CORS, /metrics, the page -----------------------------------------------------

def test_api_key_on_every_api(engine):
    keyed, thread = start(engine, api_key="sekrit")
    try:
        for method, path in (("GET", "/api/tags"), ("POST", "/api/generate"), ("GET", "/metrics"),
                             ("GET", "/v1/models")):
            status, _, data = request(keyed, method, path, b"{}" if method == "POST" else None)
            assert status == 401, path
            err = json.loads(data)["error"]
            assert isinstance(err, str) if path.startswith("/api/") else err["code"] == "invalid_api_key"
        assert json.loads(request(keyed, "GET", "/api/tags", headers={"Authorization": "Bearer sekrit"})[2])
        for path in ("/health", "/api/version", "/", "/page/chat.js"):   # open
            assert request(keyed, "GET", path)[0] == 200, path
    finally:
        stop(keyed, thread)


def preflight(server, origin, path="/v1/chat/completions"):
    return request(server, "OPTIONS", path, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_default_allows_this_machine(server):
    for origin in ("http://localhost:5173", "http://127.0.0.1:8000", "http://localhost"):
        status, headers, _ = preflight(server, origin)
        assert status == 200 and headers["Access-Control-Allow-Origin"] == origin, origin
        assert "POST" in headers["Access-Control-Allow-Methods"]
        assert "authorization" in headers["Access-Control-Allow-Headers"].lower()
    status, headers, _ = preflight(server, "https://evil.example")
    assert status == 400 and "Access-Control-Allow-Origin" not in headers
    # an answer carries the header for an allowed origin only
    _, headers, _ = request(server, "GET", "/v1/models", headers={"Origin": "http://localhost:3000"})
    assert headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
    _, headers, _ = request(server, "GET", "/v1/models", headers={"Origin": "http://localhost.evil.example"})
    assert "Access-Control-Allow-Origin" not in headers


def test_cors_origins_setting(engine):
    custom, thread = start(engine, cors_origins=("https://app.example",), api_key="k")
    try:
        status, headers, _ = preflight(custom, "https://app.example", "/api/chat")
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "https://app.example"
        assert preflight(custom, "http://localhost:5173")[0] == 400
        # a refusal (no key) still carries the header, so the page can read it
        status, headers, _ = request(custom, "GET", "/v1/models", headers={"Origin": "https://app.example"})
        assert status == 401 and headers["Access-Control-Allow-Origin"] == "https://app.example"
    finally:
        stop(custom, thread)
    anyone, thread = start(engine, cors_origins=("*",))
    try:
        status, headers, _ = preflight(anyone, "https://any.example")
        assert status == 200 and headers["Access-Control-Allow-Origin"] in ("*", "https://any.example")
    finally:
        stop(anyone, thread)


def metrics(server) -> dict:
    """{(name, labels as a sorted tuple): value} of /metrics."""
    status, headers, data = request(server, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(data.decode()) for s in family.samples}


def test_metrics(server):
    m = (("model", MODEL),)
    body = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "raw": True, "stream": False,
            "options": {"temperature": 0, "num_predict": 12}}
    post(server, "/api/generate", body)        # the prefix is cached from now on
    before = metrics(server)
    answer = json.loads(post(server, "/api/generate", body)[2])
    after = metrics(server)

    def delta(name, labels=m):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    gen = (("endpoint", "/api/generate"), ("status", "200"))
    assert delta("edgespec_requests_total", gen) == 1
    assert delta("edgespec_generations_total") == 1
    assert delta("edgespec_generated_tokens_total") == answer["eval_count"] > 0
    assert delta("edgespec_prompt_tokens_total") == answer["prompt_eval_count"]
    assert delta("edgespec_prefix_cache_hits_total") == 1          # the same prompt again
    assert delta("edgespec_prefix_cache_tokens_total") > 0
    assert delta("edgespec_decode_seconds_total") > 0
    spec = answer["edgespec"]["spec"]
    assert delta("edgespec_draft_tokens_total") == spec["drafted"]
    assert delta("edgespec_accepted_tokens_total") == spec["accepted"]
    assert after[("edgespec_last_estimated_speedup", m)] == pytest.approx(answer["edgespec"]["estimated_speedup"], abs=1e-3)
    assert after[("edgespec_last_tokens_per_second", m)] > 0
    assert 0 <= after[("edgespec_last_acceptance_rate", m)] <= 1
    assert ("edgespec_requests_total", (("endpoint", "/metrics"), ("status", "200"))) in after


def test_page_files(server):
    status, headers, data = request(server, "GET", "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    page = data.decode()
    assert '<script src="/page/chat.js">' in page and "/page/chat.css" in page
    assert "http" not in page.replace("http-equiv", "")   # nothing from elsewhere (no CDN)
    for name, kind in (("chat.js", "text/javascript"), ("chat.css", "text/css")):
        status, headers, data = request(server, "GET", f"/page/{name}")
        assert status == 200 and headers["Content-Type"].startswith(kind) and data
        assert b"https://" not in data
    assert request(server, "GET", "/page/secret.txt")[0] == 404
    assert request(server, "GET", "/page/../app.py")[0] == 404


def test_openai_client_stream(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    chat = [{"role": "user", "content": "Hi"}]
    with server.engine_lock:
        ref = server.engine.generate(messages=chat, max_tokens=6, temperature=0.0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=chat, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == ref.stats.n_tokens
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert final.model_extra["edgespec"]["drafter"] == "ngram" and final.model_extra["edgespec"]["estimated_speedup"] > 0


# -- the command line ---------------------------------------------------------------------------

def cli(*args, env=None, timeout=120):
    import os
    return subprocess.run([sys.executable, "-m", "edgespec", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_ctrl_c_ends_the_running_generation_and_exits(tiny_llama_path):
    """`edgespec serve` and Ctrl-C while it generates: the answer ends at its
    next piece with an error line saying it was cut (not a clean done line),
    the log says so, the process exits with 0."""
    import re
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "edgespec", "serve", "--model", str(tiny_llama_path), "--port", "0",
                             "--threads", "1", "--ctx", "4096", "--ctx-extend", "--drafter", "none", "-q",
                             "--model-name", MODEL],
                            stderr=subprocess.PIPE, text=True)
    try:
        # notices first (a first load measures this machine's costs), then the address
        while not (found := re.search(r"http://([\d.]+):(\d+)", line := proc.stderr.readline())):
            assert line, "serve ended before listening"
        host, port = found.groups()
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/api/generate", body=json.dumps(     # the random model never ends by itself
            {"model": MODEL, "prompt": "x", "raw": True, "options": {"num_predict": -2, "temperature": 0}}),
            headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert json.loads(resp.readline())["done"] is False
        proc.send_signal(signal.SIGINT)
        *_, last = [json.loads(x) for x in resp.read().decode().splitlines()]
        assert re.fullmatch(r"the server shut down mid-generation, after \d+ tokens", last["error"]), last
        assert proc.wait(60) == 0
        log = proc.stderr.read().strip()
        assert re.search(rf"shutdown: a generation of {MODEL} was cut after \d+ tokens", log), log
        assert log.endswith("stopped")
    finally:
        proc.kill()
        proc.wait()


def test_version():
    from edgespec import __version__
    p = cli("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"edgespec {__version__}"


def invoke(*args, env=None):
    """The command line in-process: (exit code, stdout, stderr, the EdgespecError raised or None)."""
    from typer.testing import CliRunner

    import edgespec.cli.serve  # noqa: F401  (registers `serve`)
    from edgespec import cli as cli_app
    from edgespec.errors import EdgespecError

    result = CliRunner().invoke(cli_app.app, list(args), env=env)
    error = result.exception if isinstance(result.exception, EdgespecError) else None
    assert error is not None or result.exception is None or isinstance(result.exception, SystemExit), result
    return result.exit_code, result.stdout, result.stderr, error


def test_shell_completion_is_enabled(monkeypatch):
    # The shell named, not detected: pytest's parent may be sh, which typer does not complete.
    monkeypatch.setenv("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION", "1")
    code, stdout, _, _ = invoke("--show-completion", "bash")
    assert code == 0 and "COMPREPLY" in stdout and "_completion" in stdout


def test_config_env_and_flags_precedence(tmp_path, tiny_llama_path):
    """A port out of range shows which value won: the flag, else the
    environment variable, else the config file."""
    config = tmp_path / "config.toml"
    config.write_text(f'[serve]\nmodel = "{tiny_llama_path}"\nport = 70001\nmax-request-bytes = 5\n')
    env = {"EDGESPEC_CONFIG": str(config), "EDGESPEC_PORT": None}
    for extra_env, args, got in (({}, [], "70001"), ({"EDGESPEC_PORT": "70002"}, [], "70002"),
                                 ({"EDGESPEC_PORT": "70002"}, ["--port", "70003"], "70003")):
        code, _, stderr, _ = invoke("serve", *args, env={**env, **extra_env})
        assert code == 2 and stderr.strip() == f"error: --port must be in [0, 65535], got {got}", stderr


@pytest.mark.parametrize("text, words", [
    ('[serve]\nbogus = 1\n', "unknown key serve.bogus"),
    ('[serve]\nport = "eighty"\n', "serve.port"),
    ('[serve]\ncors-origin = [1, {}]\n', "serve.cors-origin"),
    ('[serve\n', "not valid TOML"),
    ('[nothing]\nx = 1\n', "[nothing] is not a command's table"),
])
def test_bad_config_names_file_and_key(tmp_path, text, words):
    config = tmp_path / "config.toml"
    config.write_text(text)
    _, _, _, error = invoke("serve", "--help", env={"EDGESPEC_CONFIG": str(config)})
    assert error is not None and str(error).startswith(f"{config}: ") and words in str(error), error
    assert "\n" not in str(error)


def test_bad_config_is_one_line_exit_2(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text("[serve]\nport = 'eighty'\n")
    p = cli("models", "list", env={"EDGESPEC_CONFIG": str(config)})
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and p.stderr.startswith(f"error: {config}: serve.port")
    p = cli("models", "list", env={"EDGESPEC_CONFIG": str(tmp_path / "missing.toml")})
    assert p.returncode == 2 and "no such config file" in p.stderr


def test_metrics_carry_llama_servers_names(server):
    """Dashboards made for llama-server read its unlabelled llamacpp:* names."""
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3, 4,", "raw": True, "stream": False,
            "options": {"temperature": 0, "num_predict": 8}}
    before = metrics(server)
    answer = json.loads(post(server, "/api/generate", body)[2])
    after = metrics(server)

    def delta(name):
        return after.get((name, ()), 0) - before.get((name, ()), 0)

    spec = answer["edgespec"]["spec"]
    assert delta("llamacpp:tokens_predicted_total") == answer["eval_count"] > 0
    cached = answer["prompt_eval_count"] - delta("llamacpp:prompt_tokens_total")
    assert delta("llamacpp:prompt_tokens_cached_total") == cached >= 0
    assert delta("llamacpp:tokens_predicted_seconds_total") > 0
    assert delta("llamacpp:spec_decode_num_draft_tokens_total") == spec["drafted"]
    assert delta("llamacpp:spec_decode_num_accepted_tokens_total") == spec["accepted"]
    assert delta("llamacpp:n_decode_total") == 1 + spec["target_steps"]
    assert after[("llamacpp:predicted_tokens_seconds", ())] > 0
    assert after[("llamacpp:requests_processing", ())] == 0 and after[("llamacpp:requests_deferred", ())] == 0
    assert after[("llamacpp:n_tokens_max", ())] >= answer["prompt_eval_count"] + answer["eval_count"]
