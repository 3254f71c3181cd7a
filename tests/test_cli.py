"""The command line: JSON output, and one-line errors with exit code 2."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "edgespec", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_json(tiny_llama_path):
    p = run("generate", "Hello", "--model", str(tiny_llama_path), "--threads", "1", "--max-tokens", "7", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    for key in ("text", "tokens", "n_tokens", "prompt_tokens", "prefill_s", "decode_s",
                "tokens_per_s", "model", "backend"):
        assert key in out
    assert out["n_tokens"] == len(out["tokens"]) == 7
    assert out["backend"] == "native"  # the default for a llama model


def test_generate_json_with_drafter(smollm2_path):
    p = run("generate", "1, 2, 3, 4, 5, 6, 7, 8,", "--model", str(smollm2_path), "--max-tokens", "24",
            "--drafter", "ngram", "--json")
    assert p.returncode == 0, p.stderr
    spec = json.loads(p.stdout.strip().splitlines()[-1])["spec"]
    assert {"drafted", "accepted", "acceptance_rate", "mean_accepted"} <= spec.keys()
    assert spec["drafted"] > 0


def test_generate_streams_text(tiny_llama_path):
    p = run("generate", "Hello", "--model", str(tiny_llama_path), "--threads", "1", "--max-tokens", "5")
    assert p.returncode == 0, p.stderr
    assert "tokens/s" in p.stderr


@pytest.mark.parametrize("args, message", [
    (["--max-tokens", "0"], "max_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "1.5"], "top_p"),
    (["--top-p", "0"], "top_p"),
    (["--model", "no-such-model"], "unknown model"),
    (["--drafter", "magic"], "unknown drafter"),
])
def test_bad_input_is_one_line_and_exit_2(tiny_llama_path, args, message):
    argv = ["generate", "Hello", "--model", str(tiny_llama_path), *args]
    if "--model" in args:
        argv = ["generate", "Hello", *args]
    p = run(*argv)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], p.stderr


def test_empty_prompt_exit_2(tiny_llama_path):
    p = run("generate", "", "--model", str(tiny_llama_path))
    assert p.returncode == 2 and "prompt is empty" in p.stderr


def test_corrupt_model_exit_2(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    p = run("generate", "Hello", "--model", str(bad))
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1


# -- the shared engine and sampling options (edgespec.cli.options) ---------------

ENGINE_COMMANDS = [["generate", "Hello"], ["demo"], ["chat"], ["serve"], ["bench"]]


def one_line_error(p, message):
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], p.stderr


@pytest.mark.parametrize("command", ENGINE_COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("args, message", [
    (["--gpu-layers", "-5"], "--gpu-layers must be >= 0, got -5"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
])
def test_every_engine_command_checks_engine_options_before_loading(tmp_path, command, args, message):
    # A model that does not exist: were the options not checked first, the error would name the model.
    one_line_error(run(*command, "--model", str(tmp_path / "absent.gguf"), *args), message)


@pytest.mark.parametrize("command, args, message", [
    (["generate", "Hello"], ["--threads", "-3"], "--threads must be >= 1, got -3"),
    (["generate", "Hello"], ["--draft-max", "64"], "--draft-max must be in [1, 63], got 64"),
    (["chat"], ["--top-p", "0"], "top_p"),  # chat takes the sampling options generate takes
    (["chat"], ["--min-p", "1"], "min_p"),
    (["serve"], ["--draft-max", "0"], "--draft-max must be in [1, 63], got 0"),
    (["serve"], ["--parallel", "0"], "--parallel must be in [1, 16], got 0"),
    (["serve"], ["--parallel", "17"], "--parallel must be in [1, 16], got 17"),
])
def test_shared_options_out_of_range(tmp_path, command, args, message):
    one_line_error(run(*command, "--model", str(tmp_path / "absent.gguf"), *args), message)


@pytest.mark.parametrize("args, message", [
    (["--max-connections", "0"], "--max-connections must be >= 1, got 0"),
    (["--max-slot-files", "-1"], "--max-slot-files must be >= 0, got -1"),
    (["--max-slot-bytes", "-1"], "--max-slot-bytes must be >= 0, got -1"),
    (["--request-timeout", "0"], "--request-timeout must be > 0, got 0.0"),
    (["--max-request-bytes", "0"], "--max-request-bytes must be >= 1, got 0"),
])
def test_serve_limits_checked_before_loading(tmp_path, args, message):
    one_line_error(run("serve", "--model", str(tmp_path / "absent.gguf"), *args), message)


def test_t_is_threads_and_temp_is_temperature(tmp_path):
    """-t is --threads on every command that takes it (llama.cpp's meaning);
    the temperature is --temp (llama.cpp's name) or --temperature."""
    absent = str(tmp_path / "absent.gguf")
    one_line_error(run("generate", "Hello", "--model", absent, "-t", "0"), "--threads must be >= 1, got 0")
    for flag in ("--temp", "--temperature"):
        one_line_error(run("generate", "Hello", "--model", absent, flag, "-1"),
                       "temperature must be 0 (greedy) or in [1e-6, inf), got -1")
    for command in (["chat"], ["drafter", "distill"], ["drafter", "train"]):
        p = run(*command, "--help")
        assert p.returncode == 0 and re.search(r"--threads\s*-t\b|-t,\s*--threads", p.stdout), command


# -- bytes that are not UTF-8 ------------------------------------------------------


def run_bytes(*args, stdin=b"", timeout=300):
    p = subprocess.run([sys.executable, "-m", "edgespec", *args], input=stdin, capture_output=True,
                       timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, p.stdout.decode("utf-8", "replace"),
                                       p.stderr.decode("utf-8", "replace"))


def test_prompt_that_is_not_utf8_is_one_line_exit_2(tmp_path):
    p = run_bytes("generate", b"Hi \xff there", "--model", str(tmp_path / "absent.gguf"))
    one_line_error(p, "prompt is not valid UTF-8 (byte 0xff at offset 3)")
    p = run_bytes("generate", "Hello", "--stop", b"caf\xc3", "--model", str(tmp_path / "absent.gguf"))
    one_line_error(p, "--stop is not valid UTF-8 (byte 0xc3 at offset 3)")


def test_piped_chat_line_that_is_not_utf8_is_one_line_exit_2(smollm2_path):
    p = run_bytes("chat", "--model", str(smollm2_path), "--drafter", "none", "--max-tokens", "4",
                  "--threads", "1", stdin=b"ab\xfe\xffcd\n")
    one_line_error(p, "input line 1 is not valid UTF-8 (byte 0xfe at offset 2)")
    assert p.stdout == ""


# -- structured output ---------------------------------------------------------------

def test_generate_with_json_schema_and_grammar(tiny_llama_path, tmp_path):
    import jsonschema

    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "n"], "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    p = run("generate", "Hello", "--model", str(tiny_llama_path), "--threads", "1", "--max-tokens", "40",
            "--json-schema", str(tmp_path / "s.json"), "--json")
    assert p.returncode == 0, p.stderr
    jsonschema.validate(json.loads(json.loads(p.stdout.strip().splitlines()[-1])["text"]), schema)
    (tmp_path / "g.gbnf").write_text('root ::= "yes" | "no"\n')
    p = run("generate", "Hello", "--model", str(tiny_llama_path), "--threads", "1", "--max-tokens", "9",
            "--grammar", str(tmp_path / "g.gbnf"), "--temperature", "1", "--seed", "4", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1])["text"] in ("yes", "no")


@pytest.mark.parametrize("command", [["generate", "Hello"], ["chat"]], ids=["generate", "chat"])
@pytest.mark.parametrize("content, flag, message", [
    ('{"type": "object", "properties": {"a": {"not": {}}}}', "--json-schema", 'Unimplemented keys: ["not"]'),
    ("{oops", "--json-schema", "not valid JSON"),
    ('root ::= "a" missing', "--grammar", "missing"),
])
def test_bad_schema_or_grammar_is_one_line_before_loading(tmp_path, command, content, flag, message):
    (tmp_path / "f").write_text(content)
    one_line_error(run(*command, "--model", str(tmp_path / "absent.gguf"), flag, str(tmp_path / "f")), message)


def test_demo_shows_plain_and_speculative_side_by_side(tiny_llama_path):
    p = run("demo", "--model", str(tiny_llama_path), "--threads", "1", timeout=600)
    assert p.returncode == 0, p.stderr
    assert "plain vs speculative decoding (--drafter auto)" in p.stdout
    rows = [line for line in p.stdout.splitlines() if line.startswith("  edit:") or line.startswith("  rewrite:")]
    assert len(rows) == 3 and all(" yes " in row for row in rows), p.stdout
    # A tiny random model gets every edit wrong: each row says so, and no best case is offered.
    assert all(" WRONG (" in row for row in rows), p.stdout
    assert "no answer was both right and identical to plain decoding" in p.stdout and "best:" not in p.stdout
