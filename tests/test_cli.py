"""The command line: JSON output, and one-line errors with exit code 2."""
from __future__ import annotations

import json
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
    assert out["backend"] == "llama"


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
