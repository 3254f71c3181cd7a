"""`edgespec bench`: suites, the user's prompts file, a real tiny run validated
against the results schema, the greedy check and failing peers."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jsonschema
import pytest
from typer.testing import CliRunner

from edgespec.bench import prompts, report
from edgespec.bench.peers import LlamaCppPython, PeerError
from edgespec.bench.runner import Configuration
from edgespec.errors import InvalidArgumentError

PNG = b"\x89PNG\r\n\x1a\n"


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "edgespec", "bench", *args], capture_output=True, text=True,
                          timeout=timeout)


# -- suites -------------------------------------------------------------------


def test_suites_load_with_sources_and_languages():
    for name in prompts.SUITES:
        suite = prompts.load_suite(name)
        assert suite and all(p.suite == name and p.prompt.strip() and p.source for p in suite)
        assert len({p.id for p in suite}) == len(suite)
    multi = prompts.load_suite("multilingual")
    human = {p.lang for p in multi if p.lang.isalpha() and len(p.lang) == 3 and p.id.startswith("translate-")}
    code = {p.lang for p in multi if not p.chat and not p.id[len("continue-"):] in human}
    assert len(human) >= 38 and len(code) >= 20
    assert {p.lang for p in prompts.load_suite("code")} == {"python"}


def test_select_filters_languages_and_spreads_the_limit():
    got = prompts.select(["multilingual"], langs=["deu", "jpn"])
    assert {p.lang for p in got} == {"deu", "jpn"} and len(got) == 4
    spread = prompts.select(["multilingual", "chat"], limit=3)
    assert [p.suite for p in spread] == ["multilingual"] * 3 + ["chat"] * 3
    assert len({p.lang for p in spread if p.suite == "multilingual"}) == 3  # not the first 3 of one language
    with pytest.raises(InvalidArgumentError, match="unknown language 'xx'"):
        prompts.select(["chat"], langs=["xx"])
    with pytest.raises(InvalidArgumentError, match="unknown suite 'poems'"):
        prompts.select(["poems"])
    with pytest.raises(InvalidArgumentError, match="--limit must be > 0"):
        prompts.select(["chat"], limit=0)


def test_prompts_file(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "Hello there", "lang": "eng"}\n\n{"prompt": "def f(x):", "chat": false, "id": "f"}\n')
    got = prompts.select([], prompts_file=f)
    assert [(p.id, p.lang, p.chat) for p in got] == [("line-1", "eng", True), ("f", "und", False)]
    assert [p.id for p in prompts.select([], prompts_file=f, langs=["eng"])] == ["line-1"]
    f.write_text('{"prompt": "ok"}\n{"prompt": ""}\n')
    with pytest.raises(InvalidArgumentError, match="line 2"):
        prompts.load_prompts_file(f)


@pytest.mark.parametrize("args, message", [
    (["--suite", "poems"], "unknown suite 'poems'"),
    (["--drafters", "none,magic"], "unknown drafter 'magic'"),
    (["--langs", "klingon"], "unknown language 'klingon'"),
    (["--limit", "0"], "--limit must be > 0"),
    (["--prompts", "/nonexistent/p.jsonl"], "no such file"),
    (["--drafters", "model"], "needs --draft-model"),
])
def test_bad_input_is_one_line_exit_2(args, message):
    p = run_cli(*args, "--out", "/nonexistent-never-written")
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().startswith("error: ") and len(p.stderr.strip().splitlines()) == 1
    assert message in p.stderr


def test_bad_jsonl_names_the_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "fine"}\n{"prompt": "broken"\n')
    p = run_cli("--prompts", str(f), "--out", str(tmp_path / "out"))
    assert p.returncode == 2
    assert p.stderr.startswith("error: ") and "line 2" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


# -- real runs on smollm2-135m -------------------------------------------------

TINY = ["--model", "smollm2-135m", "--suite", "chat", "--limit", "1", "--max-tokens", "6", "--repeats", "1",
        "--drafters", "none,ngram", "--threads", "2", "--cached-costs", "--no-progress"]


def test_tiny_run_writes_valid_results(smollm2_path, tmp_path):
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    out = tmp_path / "out"
    p = run_cli(*TINY, "--peers", "llama-cpp-python,llama.cpp:lookup", "--llama-cpp-bin", str(empty_bin),
                "--out", str(out))
    assert p.returncode == 0, p.stderr
    doc = json.loads((out / "results.json").read_text())
    jsonschema.validate(doc, report.schema())
    ids = [c["id"] for c in doc["configurations"]]
    assert ids == ["edgespec:none/greedy", "edgespec:ngram/greedy", "llama-cpp-python/greedy"]
    ngram = doc["configurations"][1]
    assert ngram["runs"] == 1 and ngram["greedy_runs_checked"] == 1 and ngram["speedup"] > 0
    assert doc["greedy_mismatches"] == {"edgespec:ngram/greedy": 0}
    assert doc["configurations"][2]["decode_tokens_per_s"] > 0
    # A peer that cannot run is reported with its reason, not dropped.
    assert doc["peers"]["llama.cpp:lookup"]["status"] == "failed"
    assert "llama-lookup not found" in doc["peers"]["llama.cpp:lookup"]["error"]
    assert doc["ceiling"]["speedup"] > 1 and doc["hardware"]["threads"] == 2
    md = (out / "results.md").read_text()
    assert "| edgespec:ngram | greedy |" in md and "llama.cpp:lookup: " in md
    for name in report.PLOTS:
        assert (out / name).read_bytes().startswith(PNG)


def test_mismatch_and_failing_peer_exit_nonzero(smollm2_path, tmp_path, monkeypatch):
    real_run = Configuration.run

    def corrupt(self, prompt, max_tokens, sampling):
        r = real_run(self, prompt, max_tokens, sampling)
        if self.drafter == "ngram":
            r.tokens = r.tokens[:3] + [r.tokens[3] + 1] + r.tokens[4:]
        return r

    def broken(self, text, max_tokens, sampling):
        raise PeerError("create_completion failed: boom")

    monkeypatch.setattr(Configuration, "run", corrupt)
    monkeypatch.setattr(LlamaCppPython, "run", broken)
    from edgespec.cli import bench as cli_bench  # noqa: F401  (registers the command)
    from edgespec.cli import app
    result = CliRunner().invoke(app, ["bench", *TINY, "--peers", "llama-cpp-python", "--out", str(tmp_path)])
    assert result.exit_code == 1, result.output
    doc = json.loads((tmp_path / "results.json").read_text())
    jsonschema.validate(doc, report.schema())
    assert doc["greedy_mismatches"] == {"edgespec:ngram/greedy": 1}
    (d,) = doc["divergences"]
    assert d["output_position"] == 3 and d["context_position"] == doc["runs"][0]["prompt_tokens"] + 3
    peer = doc["configurations"][-1]
    assert peer["status"] == "failed" and "boom" in peer["error"] and peer["runs"] == 0
    assert doc["peers"]["llama-cpp-python"] == {"status": "failed", "error": "create_completion failed: boom"}


def _fake_binary(folder, name, body):
    path = folder / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def test_llama_cpp_binary_output_is_parsed_and_failures_named(tmp_path):
    from edgespec.bench.peers import LlamaCppBinary

    _fake_binary(tmp_path, "llama-lookup",
                 'echo "some generated text"\n'
                 'echo "main: encoded  120 tokens in    0.500 seconds, speed:  240.0 t/s" >&2\n'
                 'echo "main: decoded   48 tokens in    0.800 seconds, speed:   60.0 t/s" >&2\n'
                 'echo "n_drafted    = 30" >&2\necho "n_accept     = 12" >&2\n')
    peer = LlamaCppBinary("llama.cpp:lookup", tmp_path, tmp_path / "m.gguf", threads=2, n_ctx=512)
    r = peer.run("prompt", 48, {"temperature": 0.0, "top_p": 1.0, "seed": 0})
    assert (r.n_tokens, r.prompt_tokens, r.drafted, r.accepted) == (48, 120, 30, 12)
    assert r.decode_tps == pytest.approx(60.0) and r.prefill_tps == pytest.approx(240.0)
    assert r.ttft_s == pytest.approx(0.5) and r.peak_rss_mib > 0

    _fake_binary(tmp_path, "llama-lookup", 'echo "error: failed to load model m.gguf" >&2\nexit 1\n')
    with pytest.raises(PeerError, match="llama-lookup exited with 1: error: failed to load model"):
        peer.run("prompt", 48, {"temperature": 0.0, "top_p": 1.0, "seed": 0})
    # Plain decoding: llama.cpp's own perf timers.
    _fake_binary(tmp_path, "llama-completion",
                 'echo "0.10.8 I common_perf_print: prompt eval time =  100.00 ms /    20 tokens (5 ms per token)" >&2\n'
                 'echo "0.10.8 I common_perf_print:        eval time =  500.00 ms /    25 runs   (20 ms per token)" >&2\n')
    plain = LlamaCppBinary("llama.cpp", tmp_path, tmp_path / "m.gguf", threads=2, n_ctx=512)
    r = plain.run("prompt", 25, {"temperature": 0.0, "top_p": 1.0, "seed": 0})
    assert (r.n_tokens, r.prompt_tokens, r.drafted) == (25, 20, None)
    assert r.decode_tps == pytest.approx(50.0) and r.prefill_tps == pytest.approx(200.0)
    with pytest.raises(PeerError, match="needs a draft model"):
        LlamaCppBinary("llama.cpp:speculative", tmp_path, tmp_path / "m.gguf", threads=2, n_ctx=512)


@pytest.mark.skipif(not pathlib.Path("/proc/self/status").exists(), reason="reads Linux's /proc")
def test_a_peer_binarys_peak_memory_is_its_own(tmp_path):
    from edgespec.bench.peers import _run_child

    # This process reaches a 600 MB peak; Linux carries that peak into a child's
    # getrusage figure across vfork and exec, the binary's own is a few MB.
    ballast = bytearray(600 * 2**20)
    ballast[::4096] = b"\1" * len(ballast[::4096])
    del ballast
    _fake_binary(tmp_path, "peer", "sleep 0.3\necho done\n")
    rc, log, peak = _run_child([str(tmp_path / "peer")], timeout=30)
    assert (rc, log) == (0, "done\n")
    assert 0 < peak < 100, peak


# -- what the harness reads from the engine ----------------------------------------


def test_speedup_ceiling_and_acceptance_by_length():
    from edgespec.results import SpecStats
    from edgespec.planner import speedup_ceiling

    # cost[k] of a k-token batch: 3 tokens for the price of 1.5 is the best deal.
    costs = [0.0, 1.0, 1.6, 1.5 + 1e-9, 3.0, 5.0]
    assert speedup_ceiling(costs) == (pytest.approx(3 / 1.5), 2)
    s = SpecStats()
    for drafted, accepted in ((3, 2), (3, 3), (1, 0), (0, 0)):
        s.count("ngram", drafted, accepted)
    assert s.by_length == {3: {"steps": 2, "accepted": 5}, 1: {"steps": 1, "accepted": 0}}


def test_forget_prefix_makes_the_next_run_evaluate_its_whole_prompt(tiny_llama_path):
    from edgespec import Engine

    with Engine(tiny_llama_path, threads=1, n_ctx=256) as engine:
        engine.generate("Hello there, how are you", max_tokens=2, temperature=0)
        assert engine.generate("Hello there, how are you", max_tokens=2, temperature=0).stats.cached_tokens > 0
        engine.forget_prefix()
        assert engine.generate("Hello there, how are you", max_tokens=2, temperature=0).stats.cached_tokens == 0


# -- the memory roofline -------------------------------------------------------


def test_bandwidth_is_measured_in_c_and_cached(tmp_path, monkeypatch):
    from edgespec import costs
    from edgespec.capi import ffi, lib

    assert lib.es_measure_bandwidth(ffi.NULL, ffi.NULL) == lib.ES_ERR_INVALID_ARG
    assert costs.measure_bandwidth(2, n_bytes=8 << 20, passes=2) > 1e8   # > 0.1 GB/s anywhere
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    measured = []
    monkeypatch.setattr(costs, "measure_bandwidth", lambda threads: measured.append(threads) or 5e9)
    assert costs.bandwidth(2) == costs.bandwidth(2) == 5e9
    assert measured == [2]                                  # the second call read the cache
    assert costs.bandwidth(2, remeasure=True) == 5e9 and measured == [2, 2]


def test_int8_peak_is_measured_in_c_and_cached(tmp_path, monkeypatch):
    from edgespec import costs
    from edgespec.capi import ffi, lib

    assert lib.es_measure_int8_peak(ffi.NULL, ffi.NULL) == lib.ES_ERR_INVALID_ARG
    assert costs.measure_int8_peak(1) > 1e8   # > 0.1 GMAC/s anywhere, the scalar set included
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    assert lib.es_kernels_select(b"scalar") == lib.ES_OK
    measured = []
    monkeypatch.setattr(costs, "measure_int8_peak", lambda threads: measured.append(threads) or 7e9)
    assert costs.int8_peak(2) == costs.int8_peak(2) == (7e9, "scalar")
    assert measured == [2]                                  # the second call read the cache
    lib.es_kernels_select(b"auto")


def test_macs_per_token_count_every_matrix_once(tiny_llama_path, tmp_path, tiny_vocab_path):
    from edgespec.bench.roofline import macs_per_token
    from edgespec.models.gguf import GGUFFile
    from tiny_gguf import write_tiny_llama

    with GGUFFile(tiny_llama_path) as f:
        tied = f.tensor("output.weight") is None
        want = sum(t.n_elements for t in f.tensors if len(t.shape) == 2 and (tied or t.name != "token_embd.weight"))
    assert macs_per_token(tiny_llama_path) == want
    moe = tmp_path / "moe.gguf"
    write_tiny_llama(moe, tiny_vocab_path, n_expert=4, n_expert_used=2)
    with GGUFFile(moe) as f:
        tied = f.tensor("output.weight") is None
        matrices = [t for t in f.tensors if len(t.shape) >= 2 and (tied or t.name != "token_embd.weight")]
        want = sum(t.n_elements // 2 if "_exps." in t.name else t.n_elements for t in matrices)
    assert macs_per_token(moe) == want


def test_bytes_per_token_count_what_a_token_reads(tiny_llama_path, tmp_path, tiny_vocab_path):
    from edgespec.bench.roofline import bytes_per_token
    from edgespec.models.gguf import GGUFFile
    from tiny_gguf import write_tiny_llama

    with GGUFFile(tiny_llama_path) as f:
        embd = f.tensor("token_embd.weight")
        tied = f.tensor("output.weight") is None
        rest = sum(t.n_bytes for t in f.tensors if t.name != "token_embd.weight")
    # 2 layers x keys and values x 2 KV heads x head size 16 x 2 bytes (F16), per position
    per_position = 2 * 2 * 2 * 16 * 2
    got = bytes_per_token(tiny_llama_path, 100)
    assert got["weights"] == rest + embd.n_bytes // embd.shape[1] + (embd.n_bytes if tied else 0)
    assert got["kv_cache"] == 100 * per_position and got["total"] == got["weights"] + got["kv_cache"]
    # MoE: only the used experts' share of the expert tensors.
    moe = tmp_path / "moe.gguf"
    write_tiny_llama(moe, tiny_vocab_path, n_expert=4, n_expert_used=2)
    with GGUFFile(moe) as f:
        experts = sum(t.n_bytes for t in f.tensors if "_exps." in t.name)
        total = sum(t.n_bytes for t in f.tensors)
        embd = f.tensor("token_embd.weight")
        tied = f.tensor("output.weight") is None
    want = total - experts // 2 - embd.n_bytes + embd.n_bytes // embd.shape[1] + (embd.n_bytes if tied else 0)
    assert bytes_per_token(moe, 1)["weights"] == want


def test_roofline_run_writes_valid_results(tiny_llama_path, tmp_path):
    out = tmp_path / "out"
    p = run_cli("--roofline", "--model", str(tiny_llama_path), "--threads", "1", "--out", str(out))
    assert p.returncode == 0, p.stderr
    doc = json.loads((out / "results.json").read_text())
    jsonschema.validate(doc, report.schema())
    r = doc["roofline"]
    assert [x["backend"] for x in r["backends"]] == ["native", "llama"]
    assert r["bandwidth_bytes_per_s"] > 0 and r["batch_sizes"] == [1, 2, 4, 8, 16]
    for x in r["backends"]:
        assert x["status"] == "ok" and x["batch_cost"][0] == 1.0 and len(x["batch_cost"]) == 5
        assert x["fraction_of_roofline"] == pytest.approx(x["decode_tokens_per_s"] / r["roofline_tokens_per_s"])
    assert r["roofline_tokens_per_s"] == pytest.approx(r["bandwidth_bytes_per_s"] / r["bytes_per_token"]["total"])
    macs, peak = r["macs_per_token"], r["int8_peak_macs_per_s"]
    assert macs > 0 and peak > 0 and r["kernels"] in ("avx512", "avx2", "neon", "scalar")
    assert r["compute_floor_s"] == pytest.approx([k * macs / peak for k in r["batch_sizes"]])
    for x in r["backends"]:
        assert x["fraction_of_int8_peak"] == pytest.approx(
            [k * macs / peak / t for k, t in zip(r["batch_sizes"], x["batch_seconds"])])
    text = (out / "results.md").read_text()
    assert "## Memory roofline" in text and "## Compute roofline" in text
    assert [f.name for f in out.glob("*.png")] == list(report.ROOFLINE_PLOTS)
    assert (out / "roofline.png").read_bytes().startswith(PNG)
