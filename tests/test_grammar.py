"""Structured output, tool calls, logprobs and penalties through the Engine.

A grammar makes any model's output valid, so the tiny random fixtures (no
download) generate JSON that jsonschema checks; sampling with several seeds
walks many paths through each schema."""
from __future__ import annotations

import json
import math

import jsonschema
import pytest

from edgespec import Engine
from edgespec.chat import tools as chat_tools
from edgespec.errors import GrammarError, InvalidArgumentError
from edgespec.grammar import Grammar

S = {"type": "string", "maxLength": 6}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["color", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
    {"type": "object", "additionalProperties": False, "required": ["user"], "properties": {
        "user": {"type": "object", "additionalProperties": False, "required": ["id", "tags"], "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}}},
    {"type": "object", "additionalProperties": False, "required": ["x", "y"], "properties": {
        "x": {"type": "number", "minimum": 0, "maximum": 1}, "y": {"anyOf": [{"type": "null"}, S]}}},
    {"enum": ["yes", "no", 3]},
    {"type": "object", "additionalProperties": False, "required": ["items"], "properties": {
        "items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "additionalProperties": False, "required": ["k", "v"],
            "properties": {"k": S, "v": {"type": "integer", "exclusiveMinimum": 0, "maximum": 50}}}}}},
]


@pytest.fixture(scope="module")
def tiny(tiny_llama_path):
    with Engine(str(tiny_llama_path), threads=1, n_ctx=2048, ctx_extend=True) as e:  # tool notes are long in the tiny vocabulary
        yield e


@pytest.mark.parametrize("schema", SCHEMAS, ids=[str(i) for i in range(len(SCHEMAS))])
def test_outputs_validate_against_the_schema(tiny, schema):
    for seed in range(3):
        r = tiny.generate("Data:", json_schema=schema, max_tokens=200, temperature=1.0, seed=seed)
        assert r.stats.stop_reason == "eos", r.text
        jsonschema.validate(json.loads(r.text), schema)
    r = tiny.generate("Data:", json_schema=json.dumps(schema), max_tokens=200)  # greedy, schema as text
    jsonschema.validate(json.loads(r.text), schema)


@pytest.mark.parametrize("drafter", ["ngram", "recycle"])
def test_speculative_greedy_equals_plain_under_a_grammar(tiny, drafter):
    schema = SCHEMAS[6]
    prompt = 'Data: {"items": [{"k": "ab", "v": 3}, {"k": "ab", "v": 3}]} again:'
    plain = tiny.generate(prompt, json_schema=schema, max_tokens=120, drafter="none")
    spec = tiny.generate(prompt, json_schema=schema, max_tokens=120, drafter=drafter)
    assert spec.tokens == plain.tokens
    assert spec.stats.spec.drafted > 0  # speculation stays on under the grammar
    jsonschema.validate(json.loads(spec.text), schema)


def test_grammar_text_lark_and_gbnf(tiny):
    for text in ['root ::= ("yes" | "no") " because " [a-z]{1,5}',
                 'start: ("yes" | "no") " because " /[a-z]{1,5}/']:
        for seed in range(3):
            r = tiny.generate("Answer:", grammar=text, max_tokens=40, temperature=1.0, seed=seed)
            assert r.stats.stop_reason == "eos"
            head, _, tail = r.text.partition(" because ")
            assert head in ("yes", "no") and 1 <= len(tail) <= 5 and tail.isalpha()


@pytest.mark.parametrize("schema, construct", [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
    ({"type": "frobnicate"}, "frobnicate"),
    ({"$ref": "#/definitions/missing"}, "missing"),
])
def test_a_schema_the_engine_cannot_compile_names_the_construct(tiny, schema, construct):
    with pytest.raises(GrammarError, match=construct):
        tiny.generate("x", json_schema=schema, max_tokens=4)
    with pytest.raises(GrammarError, match=construct):
        Grammar.json_schema(schema)


def test_bad_grammar_arguments(tiny):
    with pytest.raises(GrammarError, match="undefined_rule|not found"):
        tiny.generate("x", grammar='root ::= undefined_rule', max_tokens=4)
    with pytest.raises(GrammarError, match="not valid JSON"):
        tiny.generate("x", json_schema="{nope", max_tokens=4)
    with pytest.raises(InvalidArgumentError, match="not both"):
        tiny.generate("x", json_schema={}, grammar='start: "a"', max_tokens=4)


# -- logprobs and penalties --------------------------------------------------------

def test_logprobs_shape(tiny):
    r = tiny.generate("Once upon a time", max_tokens=8, logprobs=3)
    assert len(r.logprobs) == len(r.tokens) == 8
    for lp, tok in zip(r.logprobs, r.tokens):
        assert lp.token == tok and lp.logprob <= 0
        assert len(lp.top) == 3
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert lp.top[0][0] == tok  # greedy: the chosen token is the most likely one
        assert math.isclose(lp.top[0][1], lp.logprob, abs_tol=1e-6)
    assert tiny.generate("Once upon a time", max_tokens=4).logprobs is None
    with pytest.raises(InvalidArgumentError, match="logprobs"):
        tiny.generate("x", max_tokens=2, logprobs=21)


@pytest.mark.parametrize("drafter", ["ngram", "recycle"])
def test_logprobs_follow_the_rows_of_accepted_draft_tokens(tiny, drafter):
    prompt = "44, 44, 44, 44"  # the tiny model goes on repeating: drafts get accepted
    plain = tiny.generate(prompt, max_tokens=48, logprobs=0, drafter="none")
    spec = tiny.generate(prompt, max_tokens=48, logprobs=0, drafter=drafter)
    assert spec.tokens == plain.tokens and spec.stats.spec.accepted > 0
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-2)


def test_presence_penalty_forbids_repeats_within_the_window(tiny):
    plain = tiny.generate("a a a a", max_tokens=24)
    assert len(set(plain.tokens)) < len(plain.tokens)  # the tiny model repeats itself
    r = tiny.generate("a a a a", max_tokens=24, presence_penalty=1e4, repeat_last_n=64)
    assert len(set(r.tokens)) == len(r.tokens)


@pytest.mark.parametrize("drafter", ["ngram", "recycle"])
def test_speculative_greedy_equals_plain_under_penalties(tiny, drafter):
    kw = dict(max_tokens=48, repeat_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3, repeat_last_n=16)
    prompt = "one two three one two three one two three"
    assert tiny.generate(prompt, drafter=drafter, **kw).tokens == tiny.generate(prompt, drafter="none", **kw).tokens


# -- tool calls -----------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": S, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
TAGS_TEMPLATE = (  # the Hermes / Qwen2.5 way of rendering tools, reduced
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "\nCall with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


def _check_call(call, tools=TOOLS):
    fn = next(t["function"] for t in tools if t["function"]["name"] == call.name)
    jsonschema.validate(json.loads(call.arguments), fn["parameters"])


@pytest.mark.parametrize("template", [None, TAGS_TEMPLATE], ids=["json-form", "tags-form"])
def test_required_tool_call_is_constrained_and_parsed(tiny, template):
    tiny.chat_template = template
    try:
        msgs = [{"role": "user", "content": "Weather in Paris?"}]
        for seed in range(3):
            r = tiny.chat(msgs, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=1.0, seed=seed)
            assert r.tool_calls and r.parsed.warning is None, r.text
            for c in r.tool_calls:
                _check_call(c)
        r = tiny.chat(msgs, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                      max_tokens=120)
        assert [c.name for c in r.tool_calls][:1] == ["add"]
        _check_call(r.tool_calls[0])
        # The round trip: the call and its result go back into the chat.
        msgs += [{"role": "assistant", "content": None,
                  "tool_calls": [r.tool_calls[0].to_openai()]},
                 {"role": "tool", "tool_call_id": r.tool_calls[0].id, "content": "7"}]
        text = tiny.render_chat(msgs, tools=chat_tools.check_tools(TOOLS))
        assert "7" in text and "add" in text
        assert tiny.chat(msgs, tools=TOOLS, max_tokens=8).stats.n_tokens > 0
    finally:
        tiny.chat_template = None


def test_tool_arguments_errors(tiny):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidArgumentError, match="not among the tools"):
        tiny.chat(msgs, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(InvalidArgumentError, match="tools"):
        tiny.chat(msgs, tools=[{"type": "retrieval"}])
    with pytest.raises(InvalidArgumentError, match="needs tools"):
        tiny.chat(msgs, tool_choice="required")


# -- the parser, on plain text --------------------------------------------------------

def test_parse_tags_and_json_forms():
    tools = chat_tools.check_tools(TOOLS)
    p = chat_tools.parse('Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
                         "tags", tools)
    assert p.content == "Sure." and [(c.name, json.loads(c.arguments)) for c in p.tool_calls] == [("add", {"a": 1, "b": 2})]
    p = chat_tools.parse('{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}', "json", tools)
    assert p.content is None and p.tool_calls[0].name == "get_weather"
    assert chat_tools.parse('{"answer": 42}', "json", tools).tool_calls == []  # JSON, not a call
    assert chat_tools.parse("plain words", "tags", tools).content == "plain words"
    # A model told to use tags that answers in the JSON form (Qwen2.5-Coder): a call when it
    # names a known tool, else the text as it is, with no warning.
    p = chat_tools.parse('```json\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n```', "tags", tools)
    assert p.content is None and [c.name for c in p.tool_calls] == ["add"]
    p = chat_tools.parse('{"name": "rm_rf", "arguments": {}}', "tags", tools)
    assert p.tool_calls == [] and p.warning is None and p.content == '{"name": "rm_rf", "arguments": {}}'


@pytest.mark.parametrize("text, style", [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1\n</tool_call>', "tags"),
    ('<tool_call>\n{"name": "add", "arguments"', "tags"),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "tags"),
    ('{"name": "add", "arguments": [1, 2]}', "json"),
    ('{"name": "add", "argum', "json"),
])
def test_a_call_that_fails_to_parse_is_text_with_a_warning(text, style):
    p = chat_tools.parse(text, style, chat_tools.check_tools(TOOLS))
    assert p.tool_calls == [] and p.content == text and p.warning


def test_stream_holds_back_only_what_may_be_a_call():
    tools = chat_tools.check_tools(TOOLS)
    s = chat_tools.ToolCallStream("tags", tools)
    reply = 'Let me check. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    shown = "".join(s.push(reply[i:i + 3]) for i in range(0, len(reply), 3))
    assert shown == "Let me check. "
    tail, parsed = s.finish()
    assert tail == "" and parsed.tool_calls[0].name == "add"
    s = chat_tools.ToolCallStream("tags", tools)
    shown = "".join(s.push(c) for c in "a <tool b")
    tail, parsed = s.finish()
    assert shown + tail == "a <tool b" and not parsed.tool_calls


# -- a real model --------------------------------------------------------------------

def test_smollm2_json_outputs_and_speculation(smollm2_path):
    with Engine(str(smollm2_path), threads=2, n_ctx=1024) as e:
        msgs = [{"role": "user", "content": 'Write JSON like {"name":"Ada","age":36,"color":"red","ok":true,'
                                            '"user":{"id":7,"tags":["a","b"]}} for Ada Lovelace.'}]
        drafted = 0
        for schema in SCHEMAS[:4]:
            plain = e.chat(msgs, json_schema=schema, max_tokens=150, drafter="none")
            assert plain.stats.stop_reason == "eos", plain.text
            jsonschema.validate(json.loads(plain.text), schema)
            spec = e.chat(msgs, json_schema=schema, max_tokens=150, drafter="ngram")
            assert spec.tokens == plain.tokens
            drafted += spec.stats.spec.drafted
        assert drafted > 0  # the prompt's JSON is drafted from, under the grammar


# -- the server's request fields ---------------------------------------------------------

from edgespec.server import fields as openai_fields  # noqa: E402
from edgespec.server.errors import ApiError  # noqa: E402


@pytest.mark.parametrize("body, chat, param", [
    ({"presence_penalty": 2.5}, True, "presence_penalty"),
    ({"frequency_penalty": -3}, False, "frequency_penalty"),
    ({"top_k": -1}, True, "top_k"),
    ({"top_k": 1.5}, True, "top_k"),
    ({"min_p": 1}, True, "min_p"),
    ({"repeat_penalty": 0}, True, "repeat_penalty"),
    ({"logprobs": 3}, True, "logprobs"),
    ({"top_logprobs": 2}, True, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, True, "top_logprobs"),
    ({"logprobs": 6}, False, "logprobs"),
    ({"top_logprobs": 1}, False, "top_logprobs"),
    ({"response_format": {"type": "xml"}}, True, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     True, "response_format"),
    ({"response_format": {"type": "json_schema"}}, True, "response_format"),
    ({"grammar": 'root ::= nothing'}, False, "grammar"),
    ({"grammar": "start: \"a\"", "response_format": {"type": "json_object"}}, True, "grammar"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, True, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, True, "tool_choice"),
    ({"tool_choice": "required"}, True, "tool_choice"),
    ({"tools": TOOLS}, False, "tools"),
    ({"parallel_tool_calls": "yes", "tools": TOOLS}, True, "parallel_tool_calls"),
])
def test_request_fields_out_of_range_name_the_field(body, chat, param):
    with pytest.raises(ApiError) as e:
        openai_fields.engine_options(body, chat)
    assert e.value.param == param


def test_request_fields_map_to_engine_options():
    opts = openai_fields.engine_options(
        {"presence_penalty": 0.5, "frequency_penalty": -1, "top_k": 40, "min_p": 0.05, "logprobs": True,
         "top_logprobs": 3, "response_format": {"type": "json_object"}}, True)
    assert opts["presence_penalty"] == 0.5 and opts["frequency_penalty"] == -1.0 and opts["top_k"] == 40
    assert opts["min_p"] == 0.05 and opts["logprobs"] == 3 and opts["grammar"].source == "json_object"
    assert openai_fields.engine_options({"logprobs": False}, True) == {}
    assert openai_fields.engine_options({"logprobs": 2}, False) == {"logprobs": 2}
    assert openai_fields.engine_options({"response_format": {"type": "text"}}, True) == {}


def test_draft_model_chains_under_a_grammar(tiny_llama_path):
    """The draft model samples without the grammar: its chain is cut after the
    first token the grammar rejects, and verification keeps the output valid
    (greedy: identical to plain decoding)."""
    schema = SCHEMAS[3]
    with Engine(str(tiny_llama_path), threads=1, n_ctx=512, draft_model=str(tiny_llama_path)) as e:
        plain = e.generate("Data:", json_schema=schema, max_tokens=120, drafter="none")
        spec = e.generate("Data:", json_schema=schema, max_tokens=120, drafter="model")
        assert spec.tokens == plain.tokens and spec.stats.spec.drafted > 0
        for seed in range(3):
            r = e.generate("Data:", json_schema=schema, max_tokens=120, drafter="model", temperature=1.0, seed=seed)
            assert r.stats.stop_reason == "eos" and r.stats.spec.drafted > 0
            jsonschema.validate(json.loads(r.text), schema)


# -- several calls in one reply (parallel tool calls) -------------------------------------

def _block(call: dict) -> str:
    return f"<tool_call>\n{json.dumps(call, separators=(',', ':'))}\n</tool_call>"


@pytest.mark.parametrize("most, n_calls, fits", [(8, 1, True), (8, 2, True), (8, 8, True), (8, 9, False),
                                                 (1, 1, True), (1, 2, False)])
def test_a_required_call_grammar_takes_up_to_most_calls(tiny_llama_path, most, n_calls, fits):
    from edgespec.grammar import Constraint, tokenizer_for

    call = {"name": "add", "arguments": {"a": 1, "b": 2}}
    text = "\n".join(_block(call) for _ in range(n_calls))
    with Engine(str(tiny_llama_path), threads=1) as engine:
        grammar = Grammar.from_text(chat_tools.call_grammar(TOOLS, "required", "tags", most=most))
        constraint = Constraint(grammar, tokenizer_for(engine.backend), engine.backend.n_vocab)
        tokens = engine.tokenize(text, add_special=False) + [engine.backend.eos_token]
        if fits:
            constraint.advance(tokens)   # every token in the grammar, the end of generation too
        else:
            with pytest.raises(GrammarError):
                constraint.advance(tokens)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_follow_parallel_tool_calls(tiny_llama_path, parallel):
    with Engine(str(tiny_llama_path), threads=1, n_ctx=2048, ctx_extend=True) as engine:
        engine.chat_template = TAGS_TEMPLATE
        for seed in range(3):
            r = engine.generate(messages=[{"role": "user", "content": "Add 1 and 2, and 3 and 4"}], tools=TOOLS,
                                tool_choice="required", parallel_tool_calls=parallel, temperature=0.8, seed=seed,
                                max_tokens=600)
            assert 1 <= len(r.tool_calls) <= (chat_tools.MAX_CALLS if parallel else 1), r.text
            for call in r.tool_calls:
                _check_call(call)


# -- a drafted end of generation --------------------------------------------------------

@pytest.mark.parametrize("shape", ["chain", "tree", "lookahead"])
def test_a_drafted_end_of_generation_leaves_the_grammar_where_the_text_is(tiny, shape):
    """Where the grammar may end or go on, a draft holding the end-of-generation
    token is checked but leaves the matcher at the text, however llguidance
    counts that token in a rollback (versions differ): the text then goes on
    past it. The chain drops what follows the end; the tree keeps it as a
    leaf and drops its children."""
    from edgespec.drafters import Draft
    from edgespec.grammar import Constraint, tokenizer_for

    backend = tiny.backend
    eos = backend.eos_token
    ab, nl = tiny.tokenize("ab", add_special=False), tiny.tokenize("\n", add_special=False)
    constraint = Constraint(Grammar.from_text('root ::= "ab" | "ab\\nab"'), tokenizer_for(backend), backend.n_vocab)
    constraint.advance(ab)
    if shape == "chain":
        kept, _ = constraint.masks(Draft(nl + [eos] + nl))          # "\n" then an end the grammar rejects
        assert kept.tokens == nl
        kept, _ = constraint.masks(Draft([eos] + nl))
        assert kept.tokens == [eos]                                   # nothing after the end
    elif shape == "tree":
        kept, _ = constraint.masks(Draft([eos, nl[0], eos], [-1, -1, 0]))
        assert (kept.tokens, kept.parents) == ([eos, nl[0]], [-1, -1])
    else:
        with constraint.lookahead() as look:
            assert not look.push(eos)                                 # the chain ends at the end
    constraint.advance(nl + ab)                                       # the text goes on from "ab"
    assert constraint.done
