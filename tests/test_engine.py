"""Plain generation through the C core on real and tiny models (the tiny
random llama on both the llama and the native backend)."""
from __future__ import annotations

import numpy as np
import pytest

import edgespec
from edgespec import Engine
from edgespec.backends import default_backend
from edgespec.errors import ContextOverflowError, InvalidArgumentError, ModelFormatError, ModelNotFoundError
from edgespec.text import TextStream
from reference import greedy_reference
from tiny_gguf import copy_gguf, write_tiny_llama

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Water boils at",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    # llama.cpp: the greedy tests below compare with a bare llama.cpp loop.
    with Engine(str(smollm2_path), backend="llama", threads=2, n_ctx=1024) as engine:
        yield engine


@pytest.fixture(scope="module", params=["llama", "native"])
def tiny(request, tiny_llama_path):
    with Engine(str(tiny_llama_path), backend=request.param, threads=1, n_ctx=256) as engine:
        yield engine


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_bare_llama_cpp_loop(smollm2, smollm2_path, prompt):
    result = smollm2.generate(prompt, max_tokens=40)
    assert result.tokens == greedy_reference(smollm2_path, prompt, 40)
    assert result.text == smollm2.detokenize(result.tokens)


def test_gemma_greedy_matches_bare_llama_cpp_loop(gemma_path):
    with Engine(str(gemma_path), backend="llama", threads=2, n_ctx=512) as engine:
        result = engine.generate("The three primary colors are", max_tokens=24)
    assert result.tokens == greedy_reference(gemma_path, "The three primary colors are", 24)
    assert result.stats.n_tokens == len(result.tokens) > 0


def test_stream_pieces_join_to_result(tiny):
    pieces = list(tiny.stream("Once upon a time", max_tokens=24))
    assert "".join(pieces) == tiny.last_result.text
    assert tiny.last_result.stats.n_tokens == 24
    assert tiny.last_result.stats.stop_reason == "length"


def test_stop_string_ends_generation_before_it(tiny):
    full = tiny.generate("The capital of France is", max_tokens=40).text
    stop = full.split()[2]  # a word from the middle of the greedy continuation
    cut = tiny.generate("The capital of France is", max_tokens=40, stop=[stop])
    assert cut.stats.stop_reason == "stop"
    assert cut.text == full[:full.index(stop)]


def test_chat_template_and_end_of_generation(smollm2):
    result = smollm2.generate("What is 2+2? Answer with one number.", chat=True, max_tokens=64)
    assert result.stats.stop_reason == "eos"
    assert "4" in result.text
    rendered = smollm2.render_chat([{"role": "user", "content": "hi"}])
    assert "<|im_start|>user\nhi<|im_end|>" in rendered


def test_sampling_is_seeded(tiny):
    a = tiny.generate("Hello", max_tokens=30, temperature=1.0, seed=3)
    b = tiny.generate("Hello", max_tokens=30, temperature=1.0, seed=3)
    c = tiny.generate("Hello", max_tokens=30, temperature=1.0, seed=4)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_top_k_one_is_greedy(tiny):
    greedy = tiny.generate("Hello", max_tokens=20)
    k1 = tiny.generate("Hello", max_tokens=20, temperature=0.9, top_k=1, seed=1)
    assert k1.tokens == greedy.tokens


def test_stats_are_consistent(tiny):
    s = tiny.generate("Hello there", max_tokens=8).stats
    assert s.prompt_tokens == len(tiny.tokenize("Hello there"))
    assert s.prefill_s > 0 and s.decode_s > 0
    assert s.tokens_per_s == pytest.approx(s.n_tokens / s.decode_s)


@pytest.mark.parametrize("options, message", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": 1.0}, "min_p"),
    ({"repeat_penalty": 0.0}, "repeat_penalty"),
])
def test_bad_options_raise_typed_errors(tiny, options, message):
    with pytest.raises(InvalidArgumentError, match=message):
        tiny.generate("Hello", **options)


def test_empty_prompt(tiny):
    with pytest.raises(InvalidArgumentError, match="prompt is empty"):
        tiny.generate("")


def test_prompt_longer_than_context(tiny):
    with pytest.raises(ContextOverflowError, match="context holds 256"):
        tiny.generate("word " * 400)


def test_context_fills_up(tiny_llama_path):
    with Engine(str(tiny_llama_path), threads=1, n_ctx=256) as engine:
        result = engine.generate("Hello " * 20, max_tokens=1000)
        n_ctx = engine.backend.n_ctx
    assert result.stats.stop_reason == "context"
    assert result.stats.prompt_tokens + result.stats.n_tokens == n_ctx


def test_default_backend_per_architecture(tiny_llama_path, tiny_qwen2_path, tiny_vocab_path, tmp_path):
    """Native where it decodes at least as fast as llama.cpp (llama, qwen2),
    llama for MoE files and with GPU layers, onnx for an exported folder;
    Engine follows it."""
    assert default_backend(tiny_llama_path) == default_backend(tiny_qwen2_path) == "native"
    assert default_backend(tiny_llama_path, gpu_layers=1) == "llama"
    assert default_backend(tmp_path) == "onnx"
    moe = tmp_path / "moe.gguf"
    write_tiny_llama(moe, tiny_vocab_path, n_expert=4, n_expert_used=2)
    assert default_backend(moe) == "llama"
    with Engine(str(tiny_qwen2_path), threads=1, n_ctx=64) as engine:
        assert engine.backend.name == "native"


def test_default_backend_falls_back_on_a_variant_native_does_not_read(tiny_llama_path, tmp_path):
    """Llama 3.1's RoPE frequency factors: llama.cpp reads them, the native engine refuses them."""
    extra = tmp_path / "rope-freqs.gguf"
    copy_gguf(tiny_llama_path, extra, add={"rope_freqs.weight": np.ones(8)})  # (head_dim / 2)
    with Engine(str(extra), threads=1, n_ctx=64) as engine:
        assert engine.backend.name == "llama"
        assert engine.generate("Hello", max_tokens=4).stats.n_tokens == 4


def test_unknown_model():
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        Engine("no-such-model")


def test_truncated_model_is_rejected_before_llama_cpp(tmp_path, tiny_llama_path):
    bad = tmp_path / "cut.gguf"
    data = tiny_llama_path.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFormatError, match="truncated"):
        Engine(str(bad))


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"hello world" * 100)
    with pytest.raises(ModelFormatError, match="not a GGUF"):
        Engine(str(bad))


def test_text_stream_never_splits_utf8():
    text = "héllo 世界 🙂 done"
    stream = TextStream()
    pieces = [stream.push(bytes([b])) for b in text.encode()] + [stream.finish()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_text_stream_holds_back_stop_prefix():
    stream = TextStream(stop=["STOP"])
    assert stream.push(b"abc ST") == "abc "
    assert stream.push(b"OP more") == ""
    assert stream.stopped and stream.text == "abc "


def test_lazy_public_api():
    assert edgespec.Engine is Engine
    with pytest.raises(AttributeError):
        edgespec.NoSuchThing


def test_prompt_prefix_is_reused_from_the_cache(tiny):
    first = tiny.generate("The capital of France is", max_tokens=12)
    again = tiny.generate("The capital of France is", max_tokens=12)
    assert again.stats.cached_tokens == again.stats.prompt_tokens - 1
    assert again.tokens == first.tokens
    longer = tiny.generate("The capital of France is Paris. The capital of Spain is", max_tokens=8)
    assert longer.stats.cached_tokens >= len(tiny.tokenize("The capital of France is")) - 1


def test_chat_turns_reuse_earlier_turns(smollm2):
    messages = [{"role": "user", "content": "Name a fruit."}]
    first = smollm2.generate(messages=messages, max_tokens=16)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And a vegetable?"}]
    second = smollm2.generate(messages=messages, max_tokens=16)
    assert second.stats.cached_tokens >= first.stats.prompt_tokens
    assert second.stats.prompt_tokens - second.stats.cached_tokens < 30  # only the new turn is evaluated


def test_small_context_prefills_long_prompts_in_chunks(tiny_llama_path):
    with Engine(str(tiny_llama_path), backend="llama", threads=1, n_ctx=200, n_batch=64) as engine:
        assert engine.backend.n_ctx == 200 and engine.backend.n_batch == 64   # not llama.cpp's padded 256
        result = engine.generate("word " * 180, max_tokens=4)
    assert result.stats.prompt_tokens > 150 and result.stats.n_tokens > 0
