"""Engine lifecycle and bounds on every backend: calls after close() raise
EngineClosedError (never read freed memory), an abandoned stream never lets
the next prompt continue the other prompt's text, and out-of-range sizes are
refused with a message naming the limit before anything is allocated."""
from __future__ import annotations

import gc
import os

import pytest

from edgespec import Engine
from edgespec.errors import EngineClosedError, InvalidArgumentError


@pytest.fixture(params=["llama", "native", "onnx"])
def model(request, tiny_llama_path):
    """(model reference, backend) for the tiny llama on each backend."""
    if request.param == "onnx":
        return str(request.getfixturevalue("tiny_onnx_dir")), "onnx"
    return str(tiny_llama_path), request.param


def test_calls_after_close_raise_engine_closed(model):
    ref, backend = model
    engine = Engine(ref, backend=backend, threads=1, n_ctx=256, draft_max=4)
    pending = engine.stream("Hello", max_tokens=3)
    engine.close()
    for call in (lambda: engine.generate("Hello", max_tokens=3), lambda: engine.stream("Hello"),
                 lambda: next(pending), lambda: engine.tokenize("Hello"), lambda: engine.chat_template,
                 lambda: engine.detokenize([1, 2]), lambda: engine.forget_prefix()):
        with pytest.raises(EngineClosedError):
            call()
    engine.close()


def test_an_abandoned_stream_is_finalized_by_the_next_call(model):
    ref, backend = model
    a, b = "The lighthouse keeper climbed the stairs", "Numbers: 1, 2, 3, 4,"
    with Engine(ref, backend=backend, threads=1, n_ctx=256, draft_max=4) as fresh:
        want_a = fresh.generate(a, max_tokens=12).tokens
        want_b = fresh.generate(b, max_tokens=12).tokens
    with Engine(ref, backend=backend, threads=1, n_ctx=256, draft_max=4, drafter="ngram") as engine:
        stream = engine.stream(a, max_tokens=12)
        next(stream)
        next(stream)
        assert engine.generate(b, max_tokens=12).tokens == want_b
        del stream
        gc.collect()            # the abandoned generator is collected after the later generation
        assert engine.generate(a, max_tokens=12).tokens == want_a
        assert engine.generate(b, max_tokens=12).tokens == want_b


@pytest.mark.parametrize("options, message", [
    ({"n_ctx": 7}, r"n_ctx must be in \[16, "),
    ({"n_ctx": 4294967360}, r"n_ctx must be in \[16, "),
    ({"n_ctx": 100000}, "exceeds the model's training context of 512"),
    ({"threads": 4 * (os.cpu_count() or 1) + 1}, "force_threads"),
    ({"threads": 0}, "threads must be >= 1"),
    ({"gpu_layers": -5}, "gpu_layers must be >= 0"),
    ({"n_batch": "8"}, "n_batch must be a whole number"),
])
def test_sizes_out_of_range_are_refused_naming_the_limit(model, options, message):
    ref, backend = model
    with pytest.raises(InvalidArgumentError, match=message):
        Engine(ref, backend=backend, **options)


def test_extending_the_context_is_explicit_and_checked_against_memory(tiny_llama_path):
    with Engine(str(tiny_llama_path), threads=1, n_ctx=1024, ctx_extend=True) as engine:
        assert engine.backend.n_ctx >= 1024
    with pytest.raises(InvalidArgumentError, match="GiB of memory is available"):
        Engine(str(tiny_llama_path), threads=1, n_ctx=2**31 - 1, ctx_extend=True)


def test_default_context_is_capped_at_the_training_context(tiny_llama_path):
    with Engine(str(tiny_llama_path), threads=1, backend="native") as engine:
        assert engine.backend.n_ctx == 512


@pytest.mark.parametrize("call, message", [
    (lambda e: e.generate(b"hi"), "prompt must be a str, not bytes"),
    (lambda e: e.generate("hi", stop=5), "stop must be a string or a list of strings"),
    (lambda e: e.generate("\ud800 hi"), r"prompt is not valid UTF-8 \(lone surrogate U\+D800"),
    (lambda e: e.chat([{"role": "user", "content": "\udfff"}]), "the chat is not valid UTF-8"),
    (lambda e: e.chat("hi"), "messages must be a list of objects, not str"),
    (lambda e: e.chat([{"role": ["user"], "content": "hi"}]), "message 0 has role"),
    (lambda e: e.chat(5), "messages must be a list"),
    (lambda e: e.generate("hi", max_tokens=2.5), "max_tokens must be a whole number"),
    (lambda e: e.generate("hi", temperature="hot"), "temperature must be a number"),
    (lambda e: e.generate("hi", top_k=2**40), r"top_k must be in \[0, 2\*\*31\)"),
    (lambda e: e.generate("hi", seed="x"), "seed must be a whole number"),
])
def test_bad_arguments_are_typed_errors(tiny_llama_path, call, message):
    with Engine(str(tiny_llama_path), threads=1, n_ctx=256) as engine:
        with pytest.raises(InvalidArgumentError, match=message):
            call(engine)
        assert engine.generate("Hello", max_tokens=2).stats.n_tokens == 2


def test_export_into_an_unwritable_folder_is_one_line(tiny_llama_path):
    from edgespec.onnx import export as onnx_export

    with pytest.raises(InvalidArgumentError, match=r"^/proc(/edgespec-export: cannot write the export there| is not writable)"):
        onnx_export.export(tiny_llama_path, "/proc/edgespec-export", weights="fp32", progress=False)


def test_a_misspelt_or_backend_foreign_option_is_refused_naming_it(tiny_llama_path):
    """An option is never dropped silently: one that does not exist, or one the
    chosen backend does not take, is an error naming it (and who takes it)."""
    with pytest.raises(InvalidArgumentError, match="unknown engine option 'treads'"):
        Engine(str(tiny_llama_path), treads=2)
    with pytest.raises(InvalidArgumentError, match="gpu_layers does not apply to the native backend "
                                                   r"\(it applies to the llama backend\)"):
        Engine(str(tiny_llama_path), backend="native", gpu_layers=8)
    from edgespec.backends import open_backend
    with pytest.raises(InvalidArgumentError, match="experts does not apply to the llama backend"):
        open_backend("llama", tiny_llama_path, experts=object())
    with open_backend("llama", tiny_llama_path, n_ctx=64, threads=1, gpu_layers=0, experts=None) as b:
        assert b.n_ctx >= 64     # options at their "nothing asked" values pass


def test_the_command_line_refuses_a_backend_foreign_option(tiny_llama_path):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "edgespec", "generate", "hi", "--model", str(tiny_llama_path),
                        "--backend", "native", "--gpu-layers", "8"], capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["error: gpu_layers does not apply to the native backend "
                                             "(it applies to the llama backend)"]


def test_a_misspelt_generation_option_is_refused_naming_it(tiny_llama_path):
    with Engine(str(tiny_llama_path), threads=1, n_ctx=64) as engine:
        with pytest.raises(InvalidArgumentError, match="unknown generation option 'temprature'"):
            engine.generate("hi", max_tokens=2, temprature=0.5)


def test_a_small_context_ends_where_it_was_asked_to_on_both_backends(tiny_llama_path):
    # llama.cpp pads its cache to 256 cells; the context is still the 64 asked for.
    ends = {}
    for backend in ("llama", "native"):
        with Engine(str(tiny_llama_path), backend=backend, threads=1, n_ctx=64) as engine:
            assert engine.backend.n_ctx == 64
            r = engine.generate("Once upon a time", max_tokens=500, drafter="none")
            assert r.stats.stop_reason == "context"
            ends[backend] = r.stats.prompt_tokens + r.stats.n_tokens
    assert ends["llama"] == ends["native"] <= 64, ends
