"""Ollama's API, so that tools written for Ollama work unchanged:
``GET /api/version``, ``GET /api/tags``, ``GET /api/ps``, ``POST /api/show``,
``POST /api/generate`` and ``POST /api/chat`` (NDJSON streaming by default,
``"stream": false`` for one object), ``POST /api/pull`` (built-in names, NDJSON
progress), ``POST /api/create`` (a name for a GGUF file on this machine, with
a Modelfile's SYSTEM, PARAMETERs and TEMPLATE kept for it: modelfile.py),
``POST /api/copy``, ``DELETE /api/delete``, ``POST /api/embed`` (and the
older ``/api/embeddings``). Refusals
are Ollama's ``{"error": message}``. /api/tags lists the served models whose
files are on this machine, /api/ps the loaded ones.

Names: the served model is listed as ``NAME:latest``; ``NAME`` is accepted
too. Sampling ``options`` default to Ollama's (temperature 0.8, top_k 40,
top_p 0.9, repeat_penalty 1.1 over the last 64 tokens, num_predict -1 = as
much as fits). Every option is applied or refused with a 400 naming it:
``num_ctx`` runs the request in a KV-cache slot of that context (refused
before anything is allocated when memory or the budget cannot hold it); the
server's own settings (num_thread, num_batch, num_gpu) may be named at their
value; options whose one value here is what the server does (mirostat 0,
typical_p 1, use_mmap true, ...) are taken at it; mirostat_tau, mirostat_eta
tune only what the server never does and are taken (see docs/server.md).
A full context is shifted as Ollama does (``shift``, default true: the
prompt's first ``num_keep`` tokens, default 4, are kept, the oldest half of
the rest dropped; ``shift: false`` ends the generation there). ``keep_alive`` (seconds or "5m"; 0 unloads, a negative
value keeps the model loaded) sets when an idle model unloads; /api/ps shows
that time. ``logprobs`` / ``top_logprobs`` as Ollama's. ``format`` ("json"
or a JSON schema) constrains the output through the grammar engine.
``tools`` (on /api/chat) go through
the model's chat template as on the OpenAI path; the calls the model makes
come back as ``message.tool_calls`` (arguments as objects, as Ollama sends
them; streamed in one line once the reply ends), and ``tool`` messages and an
assistant's ``tool_calls`` are accepted. ``suffix`` on /api/generate asks for
the text between ``prompt`` and it (fill-in-the-middle, as editors send for
code completion) from the model's own FIM tokens; the chat template, ``system``
and ``raw`` play no part then, and a model without FIM tokens is refused.
``raw`` prompts read special-token text as those tokens, as Ollama's do.
``images`` (these models read text only), ``template``, ``context``, think
and truncate (on generations) are refused with a 400 naming the field.
/api/embed takes ``truncate`` (default true), ``dimensions`` and ``options``
(``num_ctx`` applied; null values and the generation options, which mean
nothing for embeddings, taken without effect, as Ollama does).
Durations are nanoseconds; the final object also carries ``edgespec``
(drafter, tokens/s, estimated_speedup, speculative stats).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import time
from datetime import datetime, timezone
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import anyio

from .. import __version__
from ..chat import gotemplate
from ..chat import tools as chat_tools
from ..errors import EdgespecError, GrammarError, InvalidArgumentError
from ..grammar import Grammar
from ..models import registry
from ..pool import keep_alive_seconds
from ..progress import Progress
from ..sampling import SamplingParams
from . import fields, modelfile
from .request import Stream, endpoint, note, pick_runner, read_json, runners_of, stream_pieces
from .errors import OLLAMA, ApiError, is_int, is_number, show
from .runner import FINISH_REASON, Completion, Job

# The Ollama API version whose shapes are served (clients check it for features).
OLLAMA_VERSION = "0.9.0"
NDJSON = "application/x-ndjson"
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "repeat_penalty": 1.1,
            "repeat_last_n": 64, "presence_penalty": 0.0, "frequency_penalty": 0.0}
WHOLE = ("top_k", "repeat_last_n", "seed", "num_predict", "num_ctx")   # options that are integers
# Options whose one value here is what this server does anyway: taken at it, refused otherwise.
FIXED = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0, "penalize_newline": True, "use_mmap": True,
         "use_mlock": False, "numa": False, "low_vram": False, "vocab_only": False, "f16_kv": True,
         "logits_all": False, "embedding_only": False, "main_gpu": 0}
# Options that tune only what this server never does (mirostat, which is off): taken, changing nothing.
INERT = ("mirostat_tau", "mirostat_eta")
NUM_KEEP = 4   # Ollama's default num_keep: the prompt tokens a context shift keeps
# The server's own settings: a request may name them at the value they have (or Ollama's "auto").
SERVER = {"num_thread": (lambda e: e.backend.threads, 0, "--threads"),
          "num_batch": (lambda e: e.backend.n_batch, None, None),
          "num_gpu": (lambda e: e.config.gpu_layers, -1, "--gpu-layers")}
UNSERVED = ("template", "context", "width", "height", "steps")   # a 400 naming them unless empty
# Fields this server serves only at one value (what it does): think off (no reasoning models),
# no prompt truncation (a 400 instead).
ONLY = {"think": False, "truncate": False}
CHAT_ROLES = ("system", "user", "assistant", "tool")
PULL_REPORT_S = 0.25      # at most this often a progress line while pulling


def routes() -> list[Route]:
    def ollama(handler, keyed=True):
        return endpoint(handler, OLLAMA, keyed)

    return [
        Route("/api/version", ollama(version, keyed=False), methods=["GET"]),
        Route("/api/tags", ollama(tags), methods=["GET"]),
        Route("/api/ps", ollama(ps), methods=["GET"]),
        Route("/api/show", ollama(show_model), methods=["POST"]),
        Route("/api/generate", ollama(generate), methods=["POST"]),
        Route("/api/chat", ollama(chat), methods=["POST"]),
        Route("/api/pull", ollama(pull), methods=["POST"]),
        Route("/api/create", ollama(create), methods=["POST"]),
        Route("/api/copy", ollama(copy), methods=["POST"]),
        Route("/api/delete", ollama(delete), methods=["DELETE"]),
        Route("/api/embed", ollama(embed), methods=["POST"]),
        Route("/api/embeddings", ollama(embeddings_legacy), methods=["POST"]),
    ]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _bad(message: str) -> ApiError:
    return ApiError(400, message)


# -- the model's description ----------------------------------------------------------

def _describe(runner) -> tuple[dict, dict]:
    """(the /api/tags entry, model_info) of a runner's model, read once."""
    if "ollama" not in runner.cache:
        from ..models.gguf import model_info

        path = Path(runner.model_path)
        st = path.stat()
        builtin = registry.builtin_models().get(runner.name)
        digest = builtin.sha256 if builtin else hashlib.sha256(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
        try:
            info = model_info(path) if path.is_file() else None
        except EdgespecError:
            info = None
        arch = (info.architecture if info else None) or "onnx"
        n = info.n_params if info else 0
        size_label = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
        details = {"parent_model": "", "format": "gguf" if info else "onnx", "family": arch, "families": [arch],
                   "parameter_size": size_label, "quantization_level": (info.file_type if info else None) or ""}
        card = {"name": f"{runner.name}:latest", "model": f"{runner.name}:latest", "modified_at": _iso(st.st_mtime),
                "size": st.st_size, "digest": digest, "details": details}
        model_info_ = {"general.architecture": arch, "general.parameter_count": n}
        if info:
            for key, value in (("context_length", info.context_length), ("embedding_length", info.embedding_length),
                               ("block_count", info.n_layers), ("attention.head_count", info.n_heads),
                               ("attention.head_count_kv", info.n_kv_heads)):
                if value is not None:
                    model_info_[f"{arch}.{key}"] = value
            model_info_["tokenizer.ggml.bos_token_id"] = info.bos_token_id
            model_info_["tokenizer.ggml.eos_token_id"] = info.eos_token_id
        runner.cache["ollama"] = (card, model_info_)
    return runner.cache["ollama"]


def _model(body: dict):
    """The model a request names ("model", or the older "name")."""
    model = body.get("model", body.get("name"))
    if not isinstance(model, str) or not model:
        raise _bad("model is required (a string)")
    return model


# -- endpoints: models ------------------------------------------------------------------

async def version(request: Request):
    return JSONResponse({"version": OLLAMA_VERSION, "edgespec": __version__})


async def tags(request: Request):
    runners = [r for r in runners_of(request) if r.model_path is not None]
    return JSONResponse({"models": [_describe(r)[0] for r in runners]})


FOREVER = "2318-01-01T00:00:00Z"   # Ollama's expiry of a model kept loaded (keep_alive -1)


async def ps(request: Request):
    """The loaded models, each with the time it unloads if it stays idle."""
    models = []
    for r in runners_of(request):
        if not r.loaded:
            continue
        expires = r.pool.expires_at(r.name) if r.pool is not None else None
        card = _describe(r)[0]
        models.append({**card, "expires_at": _iso(expires) if expires is not None else FOREVER,
                       "size_vram": 0, "context_length": r.n_ctx})
    return JSONResponse({"models": models})


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


async def show_model(request: Request):
    """The model's card: its capabilities found by trying them (completion;
    tools when its template renders tools; insert when it has FIM tokens;
    embedding), a Go template carrying Ollama's markers, the sampling defaults."""
    body = await read_json(request)
    runner = pick_runner(request, _model(body))
    await runner.ready()
    card, info = _describe(runner)
    engine = runner.engine
    capabilities = await anyio.to_thread.run_sync(lambda: engine.capabilities)
    settings = registry.local_settings(runner.name)
    parameters = {**DEFAULTS, **settings.get("parameters", {})}
    extra = {k: settings[k] for k in ("system", "license") if settings.get(k)}
    return JSONResponse({
        **extra,
        "modelfile": f"# served by edgespec\nFROM {engine.model_path}\n{modelfile.lines(settings)}\n",
        "parameters": "\n".join(f"{k:<30} {json.dumps(x) if isinstance(x, str) else x}"
                                 for k, v in parameters.items() for x in (v if isinstance(v, list) else [v])),
        "template": settings.get("template") or _go_template(engine, capabilities),
        "details": card["details"], "model_info": {**info, f"{info['general.architecture']}.context_length":
                                                   runner.n_ctx},
        "capabilities": list(capabilities), "modified_at": card["modified_at"]})


def _go_template(engine, capabilities) -> str:
    """Ollama's ``template`` (a Go template) for a model whose chats are
    rendered here by its own Jinja template: the branches Ollama-aware
    clients look for (``.Suffix`` where the model fills in the middle,
    ``.Tools`` where its template renders tools, ``.Messages``), and the
    Jinja template itself in a comment."""
    out = []
    if "insert" in capabilities:
        b = engine.backend
        pre, suf, mid = (b.token_text(t) for t in b.fim_tokens)
        out.append(f"{{{{- if .Suffix }}}}{pre}{{{{ .Prompt }}}}{suf}{{{{ .Suffix }}}}{mid}\n{{{{- else }}}}")
    tools = "{{- if .Tools }}{{ .Tools }}{{ end }}" if "tools" in capabilities else ""
    out.append(f"{{{{- if .Messages }}}}{tools}{{{{- range .Messages }}}}{{{{ .Role }}}}: {{{{ .Content }}}}\n"
               "{{ end }}{{- else }}{{ .Prompt }}{{ end }}")
    if "insert" in capabilities:
        out.append("{{- end }}")
    jinja = (engine.chat_template or "").replace("*/", "* /")
    if jinja:
        out.append(f"{{{{- /* edgespec renders chats with the model's own Jinja template:\n{jinja}\n*/ -}}}}")
    return "\n".join(out)


# -- endpoints: generation ------------------------------------------------------------------

def _options(body: dict, runner, settings: dict | None = None) -> dict:
    """Engine.stream's keyword arguments from a request's ``options`` over
    the model's own PARAMETERs (``settings``; see the module docstring: every
    option is applied, or refused naming it)."""
    opts = body.get("options") or {}
    if not isinstance(opts, dict):
        raise _bad("options must be an object")
    opts = {**(settings or {}).get("parameters", {}), **opts}
    engine = runner.engine
    out = dict(DEFAULTS)
    for key, value in opts.items():
        if value is None or key in INERT:
            continue
        if key in WHOLE or key in DEFAULTS:
            if not (is_int(value) if key in WHOLE else is_number(value)):
                raise _bad(f"option {key} must be {'an integer' if key in WHOLE else 'a number'}, got {show(value)}")
        if key in FIXED:
            if value != FIXED[key]:
                raise _bad(f"option {key} is not supported (only {json.dumps(FIXED[key])})")
        elif key in SERVER:
            have, auto, flag = SERVER[key]
            if value not in (have(engine), auto):
                raise _bad(f"option {key} is the server's setting"
                           + (f" (edgespec serve {flag})" if flag else "") + f": {have(engine)} here, "
                           f"not {show(value)}")
        elif key in DEFAULTS or key == "seed":
            out[key] = value
        elif key == "num_predict":
            if value == 0 or value < -2:
                raise _bad(f"option num_predict must be an integer > 0, -1 or -2, got {show(value)}")
            out["max_tokens"] = value
        elif key == "num_ctx":
            out["n_ctx"] = value
        elif key == "num_keep":
            out["n_keep"] = value
        elif key == "stop":
            if not (isinstance(value, list) and len(value) <= fields.MAX_STOP
                    and all(isinstance(s, str) and s for s in value)):
                raise _bad(f"option stop must be a list of at most {fields.MAX_STOP} non-empty strings")
            out["stop"] = value
        else:
            raise _bad(f"option {show(key)} is not an option this server knows (docs/server.md lists them)")
    n_ctx = out.get("n_ctx") or runner.n_ctx
    if out.get("max_tokens", -1) < 0:   # -1: until the end of text or the context; -2: fill the context
        out["max_tokens"] = n_ctx
    if out["temperature"] < 1e-6:
        out["temperature"] = 0.0
    try:
        SamplingParams(**{k: out[k] for k in (*DEFAULTS, "seed") if k in out})
    except InvalidArgumentError as e:
        raise _bad(f"options: {e}")
    out.update(_logprobs(body))
    shift = body.get("shift", True)   # Ollama shifts a full context by default
    if not isinstance(shift, bool):
        raise _bad("shift must be a boolean")
    out["context_shift"] = shift
    out.setdefault("n_keep", NUM_KEEP)
    return out


def _logprobs(body: dict) -> dict:
    """``logprobs`` (a boolean) and ``top_logprobs`` (0-20), as Ollama's."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise _bad("logprobs must be a boolean")
    if top is not None and not (is_int(top) and 0 <= top <= 20):
        raise _bad("top_logprobs must be an integer in [0, 20]")
    if top and not lp:
        raise _bad("top_logprobs needs logprobs: true")
    return {"logprobs": top or 0} if lp else {}


def _format(body: dict) -> dict:
    """``format``: "json" (any JSON object) or a JSON schema, as a grammar."""
    fmt = body.get("format")
    if fmt in (None, ""):
        return {}
    try:
        if fmt == "json":
            return {"grammar": Grammar.json_object()}
        if isinstance(fmt, dict):
            return {"grammar": Grammar.json_schema(fmt)}
    except GrammarError as e:
        raise _bad(f"format: {e}")
    raise _bad('format must be "json" or a JSON schema object')


def _check_served(body: dict) -> None:
    if body.get("images") not in (None, []):
        raise _bad("images are not supported: the models this server runs read text only")
    for field in UNSERVED:
        if body.get(field) not in (None, "", [], {}, 0):
            raise _bad(f"{field} is not supported by this server")
    for field, value in ONLY.items():
        if body.get(field) not in (None, value):
            raise _bad(f"{field} is not supported by this server (only {json.dumps(value)})")


def _stream_flag(body: dict) -> bool:
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise _bad("stream must be a boolean")
    return stream


def _text(value, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _bad(f"{what} must be a string")
    return value


async def generate(request: Request):
    body = await read_json(request)
    model = _model(body)
    runner = pick_runner(request, model)
    _check_served(body)
    stream = _stream_flag(body)
    keep_alive = _keep_alive(body, runner)
    prompt, system = _text(body.get("prompt"), "prompt"), _text(body.get("system"), "system")
    suffix = _text(body.get("suffix"), "suffix")
    if not prompt and not suffix:   # Ollama's "load the model" (or, with keep_alive 0, unload it)
        return JSONResponse({"model": model, "created_at": _now(), "response": "", "done": True,
                             "done_reason": await _load(runner, keep_alive)})
    await runner.ready()
    if body.get("tools") not in (None, []):
        raise _bad("tools are for /api/chat")
    raw = body.get("raw", False)
    if not isinstance(raw, bool):
        raise _bad("raw must be a boolean")
    settings = registry.local_settings(runner.name)
    system = system or settings.get("system", "")
    opts = {**_options(body, runner, settings), **_format(body)}
    if suffix:
        c = Completion(prompt=prompt, suffix=suffix)
    elif raw:   # the prompt as the model reads it: special-token text is those tokens (as Ollama's)
        c = Completion(prompt=prompt, parse_special=True)
    elif not runner.engine.chat_template:
        c = Completion(prompt=(system + "\n\n" if system else "") + prompt)
    else:
        c = Completion(messages=([{"role": "system", "content": system}] if system else [])
                       + [{"role": "user", "content": prompt}])
    c.options, c.keep_alive = opts, keep_alive
    return await _answer(request, runner, c, model, stream, chat=False)


async def chat(request: Request):
    body = await read_json(request)
    model = _model(body)
    runner = pick_runner(request, model)
    _check_served(body)
    stream = _stream_flag(body)
    keep_alive = _keep_alive(body, runner)
    messages = body.get("messages")
    if messages is None:
        messages = []
    if not isinstance(messages, list):
        raise _bad("messages must be a list of {role, content} objects")
    if not messages:   # Ollama's "load the model" (or, with keep_alive 0, unload it)
        return JSONResponse({"model": model, "created_at": _now(), "message": {"role": "assistant", "content": ""},
                             "done": True, "done_reason": await _load(runner, keep_alive)})
    await runner.ready()
    msgs = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise _bad(f"messages[{i}] must be an object with role system, user, assistant or tool")
        if m.get("images"):
            raise _bad(f"messages[{i}]: images are not supported: the models this server runs read text only")
        msg = {"role": m["role"], "content": _text(m.get("content"), f"messages[{i}].content")}
        if m.get("tool_calls") not in (None, []):
            msg["tool_calls"] = _calls_in(m, i)
        msgs.append(msg)
    settings = registry.local_settings(runner.name)
    if settings.get("system") and not any(m["role"] == "system" for m in msgs):
        msgs.insert(0, {"role": "system", "content": settings["system"]})
    opts = {**_options(body, runner, settings), **_format(body), **_tools(body)}
    c = Completion(messages=msgs)
    c.options, c.keep_alive = opts, keep_alive
    return await _answer(request, runner, c, model, stream, chat=True)


def _keep_alive(body: dict, runner) -> float | None:
    """``keep_alive``: seconds (a number) or a Go duration ("5m", "1h30m",
    "-1"); None when absent (the server's). A server over one Engine it does
    not own cannot unload it: 0 is refused there."""
    value = body.get("keep_alive")
    if value is None:
        return None
    try:
        seconds = keep_alive_seconds(value)
    except InvalidArgumentError as e:
        raise _bad(str(e)) from None
    if seconds == 0 and runner.pool is None:
        raise _bad("keep_alive 0 unloads a model, and this server serves one Engine it cannot unload")
    return seconds


async def _load(runner, keep_alive: float | None) -> str:
    """Ollama's request without a prompt: the model loaded (kept for
    ``keep_alive``), or unloaded with keep_alive 0; the done_reason."""
    return "load" if await runner.keep(keep_alive) else "unload"


def _calls_in(m: dict, i: int) -> list[dict]:
    """An assistant message's Ollama tool calls ({"function": {"name",
    "arguments": object}}) in the OpenAI shape the chat templates render."""
    calls = m["tool_calls"]
    if m["role"] != "assistant" or not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str) for c in calls):
        raise _bad(f'messages[{i}].tool_calls: tool calls belong to assistant messages, each '
                   '{"function": {"name": ..., "arguments": {...}}}')
    out = []
    for k, c in enumerate(calls):
        args = c["function"].get("arguments", {})
        out.append({"id": f"call_{i}_{k}", "type": "function",
                    "function": {"name": c["function"]["name"],
                                 "arguments": args if isinstance(args, str) else json.dumps(args)}})
    return out


def _tools(body: dict) -> dict:
    tools = body.get("tools")
    if tools in (None, []):
        return {}
    try:
        return {"tools": chat_tools.check_tools(tools)}
    except InvalidArgumentError as e:
        raise _bad(f"tools: {e}") from None


def _ollama_call(call: chat_tools.ToolCall) -> dict:
    try:
        args = json.loads(call.arguments)
    except json.JSONDecodeError:
        args = call.arguments
    return {"function": {"name": call.name, "arguments": args}}


async def _answer(request: Request, runner, c: Completion, model: str, stream: bool, chat: bool):
    job = await runner.start(c, request)

    def piece_obj(text: str) -> dict:
        out = {"model": model, "created_at": _now()}
        if chat:
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["response"] = text
        out["done"] = False
        return out

    if stream:
        style = chat_tools.style_of(runner.engine.chat_template or "")
        calls = chat_tools.ToolCallStream(style, c.tools) if c.tools else None
        return Stream(_lines(request, job, piece_obj, calls), NDJSON)
    text = await job.text()
    obj = piece_obj(text)
    if job.result.logprobs is not None:
        obj["logprobs"] = fields.chat_logprobs(runner.engine, job.result.logprobs)["content"]
    parsed = job.result.parsed   # the engine's split of the reply into text and calls
    if parsed is not None:
        if parsed.tool_calls:
            obj["message"] = {"role": "assistant", "content": parsed.content or "",
                              "tool_calls": [_ollama_call(t) for t in parsed.tool_calls]}
        elif parsed.warning:
            obj["warning"] = parsed.warning
    return JSONResponse(_final(request, job, obj))


def _final(request: Request, job: Job, obj: dict) -> dict:
    s = job.result.stats
    note(request, f"{s.n_tokens} tokens {s.tokens_per_s:.1f} tok/s")
    return {**obj, "done": True, "done_reason": FINISH_REASON.get(s.stop_reason, "stop"),
            "total_duration": int((time.time() - job.created) * 1e9), "load_duration": 0,
            "prompt_eval_count": s.prompt_tokens, "prompt_eval_duration": int(s.prefill_s * 1e9),
            "eval_count": s.n_tokens, "eval_duration": int(s.decode_s * 1e9),
            "edgespec": {"drafter": s.drafter, "tokens_per_s": round(s.tokens_per_s, 3),
                         "estimated_speedup": round(job.estimated_speedup, 3),
                         "spec": s.spec.to_dict() if s.spec is not None else None}}


def _line(obj: dict) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")


async def _lines(request: Request, job: Job, piece_obj, calls: chat_tools.ToolCallStream | None):
    """NDJSON lines: the pieces (with tools: never text that may start a tool
    call), then the calls in one message line, then the final object."""
    want_logprobs = job.completion.options.get("logprobs") is not None
    sent = 0   # logprobs entries sent

    def with_logprobs(obj: dict) -> dict:
        nonlocal sent
        if want_logprobs and len(job.logprobs) > sent:
            obj["logprobs"] = fields.chat_logprobs(job.runner.engine, job.logprobs[sent:])["content"]
            sent = len(obj["logprobs"]) + sent
        return obj

    try:
        async for piece in stream_pieces(request, job):
            if isinstance(piece, ApiError):
                yield _line(piece.body(OLLAMA))
                return
            text = calls.push(piece) if calls else piece
            if text or (want_logprobs and len(job.logprobs) > sent):
                yield _line(with_logprobs(piece_obj(text)))
        if job.client_gone:
            return
        final = piece_obj("")
        if calls:
            tail, parsed = calls.finish()
            if tail:
                yield _line(piece_obj(tail))
            if parsed.tool_calls:
                line = piece_obj("")
                line["message"]["tool_calls"] = [_ollama_call(t) for t in parsed.tool_calls]
                yield _line(line)
            elif parsed.warning:
                final["warning"] = parsed.warning
        yield _line(_final(request, job, with_logprobs(final)))
    finally:
        job.close()


# -- endpoints: pull ------------------------------------------------------------------------

class _Report(Progress):
    """Download progress posted to the event loop, at most every PULL_REPORT_S."""

    def __init__(self, name: str, total: int, post):
        super().__init__(name, total, enabled=False)
        self.post, self.last = post, 0.0

    def update(self, n: int = 1, status: str = "") -> None:
        super().update(n, status)
        now = time.monotonic()
        if now - self.last >= PULL_REPORT_S or self.count >= self.total:
            self.last = now
            self.post(self.count)


async def pull(request: Request):
    body = await read_json(request)
    name = _model(body).removesuffix(":latest")
    stream = _stream_flag(body)
    models = registry.builtin_models()
    if name not in models:
        raise ApiError(404, f"model {show(name)} is not a built-in model (known: {', '.join(models)})")
    entry = models[name]
    digest = f"sha256:{entry.sha256}"
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()

    def post(item) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, item)

    def fetch() -> None:
        try:
            registry.pull_entry(entry, bar=_Report(name, entry.size, post))
            post(None)
        except EdgespecError as e:
            post(e)

    loop.run_in_executor(None, fetch)   # goes on if the client leaves (as Ollama's does)

    async def progress():
        """The bytes fetched so far, until the pull ends (ModelFetchError if it failed)."""
        while (item := await queue.get()) is not None:
            if isinstance(item, Exception):
                raise item
            yield item

    async def lines():
        yield _line({"status": "pulling manifest"})
        try:
            async for done in progress():
                yield _line({"status": f"pulling {name} ({entry.size / 1e6:.1f} MB)", "digest": digest,
                             "total": entry.size, "completed": done})
        except EdgespecError as e:
            yield _line({"error": str(e)})
            return
        for status in ("verifying sha256 digest", "writing manifest", "success"):
            yield _line({"status": status})

    if stream:
        return Stream(lines(), NDJSON)
    try:
        async for _ in progress():
            pass
    except EdgespecError as e:
        raise ApiError(500, str(e), type="server_error")
    return JSONResponse({"status": "success"})


# -- endpoints: create, copy, delete ------------------------------------------------------

# What a create request may carry besides its source: a 400 naming any of these (edgespec
# serves a GGUF as it is: no quantizing, adapters, Go templates, default prompts or parameters).
CREATE_UNSERVED = ("quantize", "adapters", "messages")
SETTINGS = ("system", "template", "license", "parameters")   # what a create keeps with the model


def _create_settings(body: dict) -> dict:
    """What a create keeps with the model (registry.local_settings): a
    Modelfile's SYSTEM, PARAMETER, TEMPLATE and LICENSE, or the request's
    own ``system``, ``parameters``, ``template`` and ``license``; the
    template translated into Jinja now (a construct it cannot take is a 400
    naming it), the parameters checked as a request's options are."""
    found = modelfile.parse(body["modelfile"]) if isinstance(body.get("modelfile"), str) else {}
    found.pop("from", None)
    for key in SETTINGS:
        if body.get(key) not in (None, "", {}, []):
            if key in found:
                raise _bad(f"{key} is given twice: in the modelfile and as a field")
            found[key] = body[key]
    for key in ("system", "template"):
        if key in found and not isinstance(found[key], str):
            raise _bad(f"{key} must be a string")
    if isinstance(found.get("license"), list) and all(isinstance(x, str) for x in found["license"]):
        found["license"] = "\n".join(found["license"])
    if "license" in found and not isinstance(found["license"], str):
        raise _bad("license must be a string or a list of strings")
    if "parameters" in found:
        found["parameters"] = _check_parameters(found["parameters"])
    if "template" in found:
        try:
            found["chat_template"] = gotemplate.to_jinja(found["template"])
        except InvalidArgumentError as e:
            raise _bad(str(e)) from None
    return found


def _check_parameters(params) -> dict:
    """A model's PARAMETERs: each an option a request may send, of its type
    (the server's own settings, num_thread and the like, are not a model's)."""
    if not isinstance(params, dict):
        raise _bad("parameters must be an object")
    for key, value in params.items():
        if key in SERVER:
            raise _bad(f"PARAMETER {key} is the server's setting, not a model's")
        if key == "stop":
            if not (isinstance(value, list) and len(value) <= fields.MAX_STOP and all(isinstance(v, str) and v for v in value)):
                raise _bad(f"PARAMETER stop must be at most {fields.MAX_STOP} non-empty strings")
        elif key in WHOLE or key == "num_keep":
            if not is_int(value):
                raise _bad(f"PARAMETER {key} must be an integer, got {show(value)}")
        elif key in DEFAULTS or key in INERT:
            if not is_number(value):
                raise _bad(f"PARAMETER {key} must be a number, got {show(value)}")
        elif key in FIXED:
            if value != FIXED[key]:
                raise _bad(f"PARAMETER {key} is not supported (only {json.dumps(FIXED[key])})")
        else:
            raise _bad(f"PARAMETER {show(key)} is not an option this server knows (docs/server.md lists them)")
    return dict(params)


def _create_source(request: Request, body: dict) -> Path:
    """The GGUF file a create request names: ``from`` (a path, or a model
    this server has), ``files`` (one .gguf, by path or by the sha256 of a
    model file it has), or a Modelfile's ``FROM``."""
    given = [k for k in ("from", "files", "modelfile") if body.get(k) not in (None, "", {})]
    if len(given) != 1:
        raise _bad("create needs exactly one of from, files or modelfile (FROM /path/to/model.gguf)")
    value = body[given[0]]
    if given[0] == "modelfile":
        if not isinstance(value, str):
            raise _bad("modelfile must be a string")
        value = modelfile.parse(value).get("from")
        if not value:
            raise _bad("modelfile needs a FROM line")
    elif given[0] == "files":
        if not (isinstance(value, dict) and len(value) == 1 and all(isinstance(v, str) for v in value.values())):
            raise _bad('files must name one GGUF file: {"model.gguf": "/path/to/model.gguf" or "sha256:<digest>"}')
        (value,) = value.values()
        if value.startswith("sha256:"):
            known = [registry.cached_path(e) for e in registry.builtin_models().values()
                     if e.sha256 == value[7:].lower() and registry.cached_path(e).is_file()]
            if not known:
                raise _bad(f"no model file with {value[:80]} is on this server (it takes no uploads: give the "
                           "file's path)")
            return known[0]
    if not isinstance(value, str):
        raise _bad(f"{given[0]} must be a path to a GGUF file")
    path = Path(value).expanduser()
    if path.is_file():
        return path
    try:
        return _model_here(request, value)
    except EdgespecError:
        raise _bad(f"{given[0]}: no GGUF file at {value[:200]} and no model of that name here") from None


def _model_here(request: Request, ref: str) -> Path:
    """The file of ``ref``, a model this machine has (a local name, a
    downloaded built-in one, a path); ModelNotFoundError else. A Hugging Face
    reference (registry.resolve's ``hf:``) is fetched only when the server was
    started with --allow-pull-from-hub: else any client, a web page's too,
    could make it download whatever it names."""
    if ref.startswith("hf:") and not request.app.state.settings.allow_pull_from_hub:
        raise ApiError(403, f"{ref[:200]} is on the Hugging Face Hub: this server fetches from it only when started "
                       "with --allow-pull-from-hub (the command line fetches it: edgespec models path REF)",
                       code="hub_not_allowed")
    return registry.resolve(ref.removesuffix(":latest"), pull_missing=False)


async def create(request: Request):
    """Serve a GGUF file on this machine under a name (Ollama's create; the
    file stays where it is)."""
    body = await read_json(request)
    name = _model(body).removesuffix(":latest")
    stream = _stream_flag(body)
    for field in CREATE_UNSERVED:
        if body.get(field) not in (None, "", [], {}):
            raise _bad(f"{field} is not supported by create here (a GGUF file is served as it is)")
    settings = _create_settings(body)
    source = await anyio.to_thread.run_sync(_create_source, request, body)   # a Hub fetch may take minutes
    try:
        path = await anyio.to_thread.run_sync(registry.add_local, name, source, settings)
    except EdgespecError as e:   # a bad name, a file that is not a model
        raise _bad(str(e)) from None
    runners_of(request).get(name)   # served from now on (by a pool)
    note(request, f"created {name} from {path}")
    if stream:
        async def lines():
            for status in (f"using {path}", "writing manifest", "success"):
                yield _line({"status": status})
        return Stream(lines(), NDJSON)
    return JSONResponse({"status": "success"})


async def copy(request: Request):
    """Another name for a model this server has (its file is not copied)."""
    body = await read_json(request)
    source, destination = body.get("source"), body.get("destination")
    if not (isinstance(source, str) and source and isinstance(destination, str) and destination):
        raise _bad("copy needs source and destination model names")
    try:
        path = await anyio.to_thread.run_sync(_model_here, request, source)
    except EdgespecError:
        raise ApiError(404, f"model {show(source)} does not exist here") from None
    try:
        await anyio.to_thread.run_sync(registry.add_local, destination.removesuffix(":latest"), path,
                                       registry.local_settings(source.removesuffix(":latest")))
    except EdgespecError as e:
        raise _bad(str(e)) from None
    runners_of(request).get(destination)
    return JSONResponse({})


async def delete(request: Request):
    """Forget a model: a created name is dropped (its file stays where it
    is); a built-in model's cached copy is deleted. Never a file outside the
    edgespec cache; 404 for an unknown name."""
    body = await read_json(request)
    name = _model(body).removesuffix(":latest")
    cached = name in registry.builtin_models() and registry.cached_path(registry.builtin_model(name)).is_file()
    if name not in registry.local_models() and not cached:
        raise ApiError(404, f"model {show(name)} does not exist here (or was not made by create or pull)")
    runners_of(request).remove(name)
    await anyio.to_thread.run_sync(registry.remove, name)
    note(request, f"deleted {name}")
    return JSONResponse({})


# -- endpoints: embeddings ----------------------------------------------------------------

async def embed(request: Request):
    """``input``: a string or a list of strings; unit-length vectors, as
    Ollama's. ``truncate`` (default true, as Ollama's): an input longer than
    the context is cut to it (false: refused); ``dimensions``: the first so
    many of each vector, at unit length again."""
    body = await read_json(request)
    model = _model(body)
    runner = pick_runner(request, model)
    inputs = body.get("input")
    if not (isinstance(inputs, str) or (isinstance(inputs, list) and all(isinstance(t, str) for t in inputs))):
        raise _bad("input must be a string or a list of strings")
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise _bad("truncate must be a boolean")
    dimensions = body.get("dimensions")
    if dimensions is not None and not (is_int(dimensions) and dimensions > 0):
        raise _bad(f"dimensions must be an integer > 0, got {show(dimensions)}")
    n_ctx = _embed_options(body)
    keep_alive = _keep_alive(body, runner)
    t0 = time.perf_counter()
    vectors, n_tokens = await anyio.to_thread.run_sync(
        lambda: runner.embed(inputs, truncate=truncate, dimensions=dimensions, keep_alive=keep_alive, n_ctx=n_ctx))
    note(request, f"{len(vectors)} embeddings, {n_tokens} tokens")
    return JSONResponse({"model": model, "embeddings": vectors.tolist(),
                         "total_duration": int((time.perf_counter() - t0) * 1e9), "load_duration": 0,
                         "prompt_eval_count": n_tokens})


def _embed_options(body: dict) -> int | None:
    """An embeddings request's ``options``: ``num_ctx`` (the context its inputs
    are cut to or checked against; None: the server's); null values and the
    generation options, which mean nothing for embeddings, are taken without
    effect, as Ollama takes them (LangChain's OllamaEmbeddings sends them all);
    an option Ollama does not have is refused."""
    opts = body.get("options") or {}
    if not isinstance(opts, dict):
        raise _bad("options must be an object")
    known = {*DEFAULTS, *WHOLE, *FIXED, *INERT, *SERVER, "num_keep", "stop"}
    for key, value in opts.items():
        if value is not None and key not in known:
            raise _bad(f"option {show(key)} is not an option this server knows (docs/server.md lists them)")
    n_ctx = opts.get("num_ctx")
    if n_ctx is not None and not (is_int(n_ctx) and n_ctx > 0):
        raise _bad(f"option num_ctx must be an integer > 0, got {show(n_ctx)}")
    return n_ctx


async def embeddings_legacy(request: Request):
    """The older endpoint: ``prompt`` (one string) -> ``embedding``; ``options`` as /api/embed's."""
    body = await read_json(request)
    runner = pick_runner(request, _model(body))
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise _bad("prompt must be a non-empty string")
    n_ctx = _embed_options(body)
    vectors, _ = await anyio.to_thread.run_sync(lambda: runner.embed(prompt, n_ctx=n_ctx))
    return JSONResponse({"embedding": vectors[0].tolist()})
