"""OpenAI request fields beyond the basics: structured
output (``response_format``, and llama.cpp's ``grammar`` / ``json_schema``),
``tools`` / ``tool_choice``, ``logprobs`` / ``top_logprobs``, the penalties,
``logit_bias``, ``top_k`` and ``min_p``, turned into Engine.stream keyword
arguments; and the reply-side shapes (``logprobs`` objects, ``tool_calls``).

Validation follows OpenAI's ranges; a bad value is a 400 naming the field.
Nothing is accepted and ignored.
"""
from __future__ import annotations

from ..chat import tools as chat_tools
from ..errors import GrammarError, InvalidArgumentError
from ..grammar import Grammar
from .errors import bad, is_int, is_number

MAX_TOP_LOGPROBS = 20        # chat completions
MAX_COMPLETION_LOGPROBS = 5  # legacy completions
MAX_BIAS = 100.0             # OpenAI's logit_bias range: [-100, 100]
MAX_BIASED = 1024            # tokens one logit_bias may name
MAX_STOP = 16                # stop strings per request (OpenAI's stop, Ollama's options.stop, llama-server's)
MIN_TEMPERATURE = 1e-6       # the sampler's smallest; below it is greedy
MIN_TOP_P = 1e-6             # the sampler's top_p is in (0, 1]; this keeps the top token only


def _number(body: dict, name: str, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False):
    v = body.get(name)
    if v is None:
        return None
    ok = is_number(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        lb, rb = "(" if lo_open else "[", ")" if hi_open else "]"
        raise bad(name, f"{name} must be a number in {lb}{lo:g}, {hi:g}{rb}, got {str(v)[:40]}")
    return float(v)


def engine_options(body: dict, chat: bool) -> dict:
    """The Engine.stream keyword arguments of these fields in a request body."""
    opts: dict = {}
    for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
        v = _number(body, name, lo, hi)
        if v is not None:
            opts[name] = v
    v = _number(body, "repeat_penalty", 0.0, 10.0, lo_open=True)   # llama.cpp's extension
    if v is not None:
        opts["repeat_penalty"] = v
    v = _number(body, "min_p", 0.0, 1.0, hi_open=True)
    if v is not None:
        opts["min_p"] = v
    top_k = body.get("top_k")
    if top_k is not None:
        if not is_int(top_k) or not 0 <= top_k < 2**31:
            raise bad("top_k", f"top_k must be an integer >= 0, got {str(top_k)[:40]}")
        opts["top_k"] = top_k
    opts.update(_logprobs(body, chat))
    opts.update(logit_bias(body))
    grammar = structured(body)
    if chat:
        opts.update(tool_options(body, grammar))
    elif body.get("tools") is not None or body.get("tool_choice") is not None:
        raise bad("tools", "tools are for /v1/chat/completions")
    if grammar is not None:
        opts["grammar"] = grammar
    return opts


def _logprobs(body: dict, chat: bool) -> dict:
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if lp is not None and not isinstance(lp, bool):
            raise bad("logprobs", "logprobs must be a boolean")
        if top is not None:
            if not is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
                raise bad("top_logprobs", f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]")
            if not lp:
                raise bad("top_logprobs", "top_logprobs needs logprobs: true")
        return {"logprobs": top or 0} if lp else {}
    if top is not None:
        raise bad("top_logprobs", "top_logprobs is for /v1/chat/completions; use logprobs")
    if lp is None:
        return {}
    if not is_int(lp) or not 0 <= lp <= MAX_COMPLETION_LOGPROBS:
        raise bad("logprobs", f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}]")
    return {"logprobs": lp}


def logit_bias(body: dict) -> dict:
    """``logit_bias``: OpenAI's {"token id": bias in [-100, 100]}, or
    llama.cpp's [[token id, bias], ...] where a bias of false bans the token."""
    value = body.get("logit_bias")
    if value in (None, {}, []):
        return {}
    items = value.items() if isinstance(value, dict) else value if isinstance(value, list) else None
    if items is None or len(value) > MAX_BIASED:
        raise bad("logit_bias", f"logit_bias must map at most {MAX_BIASED} token ids to biases")
    out = {}
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise bad("logit_bias", "logit_bias as a list holds [token id, bias] pairs")
        token, bias = item
        if isinstance(token, str) and token.strip().lstrip("-").isdigit():
            token = int(token)
        if not is_int(token) or token < 0:
            raise bad("logit_bias", f"logit_bias keys must be token ids, got {str(token)[:40]}")
        if bias is False:
            bias = float("-inf")
        elif not is_number(bias) or not -MAX_BIAS <= bias <= MAX_BIAS:
            raise bad("logit_bias", f"logit_bias values must be numbers in [-100, 100], got {str(bias)[:40]}")
        out[token] = float(bias)
    return {"logit_bias": out}


def structured(body: dict) -> Grammar | None:
    """``response_format`` (OpenAI), or llama.cpp's ``json_schema`` / ``grammar`` fields."""
    given = [k for k in ("response_format", "json_schema", "grammar") if body.get(k) is not None]
    if len(given) > 1:
        raise bad(given[1], f"give one of response_format, json_schema, grammar, not {' and '.join(given)}")
    if not given:
        return None
    name = given[0]
    value = body[name]
    try:
        if name == "grammar":
            if not isinstance(value, str):
                raise bad("grammar", "grammar must be a string (Lark, or GBNF with ::=)")
            return Grammar.from_text(value)
        if name == "json_schema":
            return Grammar.json_schema(value)
        if not isinstance(value, dict):
            raise bad(name, "response_format must be an object")
        kind = value.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            schema = value.get("schema")  # llama.cpp's extension
            return Grammar.json_schema(schema) if schema is not None else Grammar.json_object()
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise bad(name, "response_format.json_schema must be an object with a name and a schema")
            schema = spec.get("schema", {"type": "object"})
            return Grammar.json_schema(schema)
        raise bad(name, f"response_format.type must be text, json_object or json_schema, got {str(kind)[:40]}")
    except GrammarError as e:
        raise bad(name, str(e)) from None


def tool_options(body: dict, grammar: Grammar | None) -> dict:
    """The engine's tools and tool_choice of OpenAI's fields (checked; 400 naming the field)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    ptc = body.get("parallel_tool_calls")
    if ptc is not None and not isinstance(ptc, bool):
        raise bad("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    if tools is None and choice is None:
        return {}
    try:
        checked = chat_tools.check_tools(tools) if tools is not None else None
    except InvalidArgumentError as e:
        raise bad("tools", str(e)) from None
    try:
        chosen = chat_tools.check_tool_choice(choice, checked)
    except InvalidArgumentError as e:
        raise bad("tool_choice", str(e)) from None
    if grammar is not None and chosen not in (None, "none", "auto"):
        raise bad("tool_choice", "a required tool call cannot be combined with response_format")
    return {"tools": checked, "tool_choice": choice, **({"parallel_tool_calls": ptc} if ptc is not None else {})}


# -- replies ----------------------------------------------------------------------------

def _token(engine, token: int) -> tuple[str, list[int]]:
    raw = engine.backend.piece(token)
    return raw.decode("utf-8", "replace"), list(raw)


def token_probabilities(engine, lps) -> list[dict]:
    """llama-server's ``completion_probabilities`` (n_probs): per token its
    id, text, bytes and logprob, and the most likely alternatives as ``top_logprobs``."""
    def entry(token: int, logprob: float) -> dict:
        text, raw = _token(engine, token)
        return {"id": token, "token": text, "bytes": raw, "logprob": logprob}
    return [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]


def chat_logprobs(engine, lps) -> dict:
    """Chat completions' ``logprobs``: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for lp in lps:
        text, raw = _token(engine, lp.token)
        top = []
        for t, v in lp.top:
            tt, tb = _token(engine, t)
            top.append({"token": tt, "logprob": v, "bytes": tb})
        content.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(engine, lps, offset: int = 0) -> dict:
    """Legacy completions' ``logprobs``: parallel lists, text offsets from ``offset``."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in lps:
        text, _ = _token(engine, lp.token)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append({_token(engine, t)[0]: v for t, v in lp.top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def tool_message(parsed: chat_tools.Parsed) -> tuple[dict, str | None]:
    """The assistant message of a reply with tools, and its finish_reason when
    calls were made ("tool_calls"; None: the ordinary one)."""
    if parsed.tool_calls:
        return ({"role": "assistant", "content": parsed.content,
                 "tool_calls": [c.to_openai() for c in parsed.tool_calls]}, "tool_calls")
    return {"role": "assistant", "content": parsed.content}, None
