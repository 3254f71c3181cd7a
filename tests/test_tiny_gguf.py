"""The tiny random llama and qwen2 (tests/tiny_gguf.py) are models llama.cpp
accepts: they load, tokenize exactly like the model they took their tokenizer
from, and produce finite, varied logits."""
import llama_cpp
import numpy as np
import pytest

TEXTS = ["Hello world", " Héllo, wörld!\n\t 12345 ", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def tiny(arch, tiny_llama_path, tiny_qwen2_path):
    path = tiny_llama_path if arch == "llama" else tiny_qwen2_path
    return llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False)


@pytest.fixture(scope="module")
def source(smollm2_path):
    return llama_cpp.Llama(model_path=str(smollm2_path), n_ctx=256, vocab_only=True,
                           verbose=False)


def test_loads_as_its_architecture(tiny, source, arch):
    assert tiny.metadata["general.architecture"] == arch
    assert tiny.n_vocab() == source.n_vocab()
    assert tiny.n_ctx() == 256


def test_tokenizer_metadata_copied(tiny, source):
    def tokenizer_keys(m):
        return {k: v for k, v in m.metadata.items() if k.startswith("tokenizer.")}

    assert tokenizer_keys(tiny) == tokenizer_keys(source)
    assert (tiny.token_bos(), tiny.token_eos()) == (source.token_bos(), source.token_eos())


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("special", [False, True])
def test_tokenizes_like_source(tiny, source, text, special):
    data = text.encode()
    tokens = tiny.tokenize(data, add_bos=True, special=special)
    assert tokens == source.tokenize(data, add_bos=True, special=special)
    assert tiny.detokenize(tokens) == source.detokenize(tokens)


def test_logits_finite_and_varied(tiny):
    tiny.reset()
    tokens = tiny.tokenize(b"Hello world")
    tiny.eval(tokens)
    logits = np.asarray(tiny.scores[:tiny.n_tokens])     # (n_tokens, n_vocab)
    assert logits.shape == (len(tokens), tiny.n_vocab())
    assert np.isfinite(logits).all()
    assert (logits.std(axis=1) > 1.0).all()
    assert len(set(logits.argmax(axis=1))) == len(tokens)  # each position prefers another token


def test_greedy_generation_runs(tiny):
    tiny.reset()
    out = tiny.create_completion("Hello world", max_tokens=6, temperature=0.0)
    assert out["usage"]["completion_tokens"] == 6
    again = tiny.create_completion("Hello world", max_tokens=6, temperature=0.0)
    assert again["choices"][0]["text"] == out["choices"][0]["text"]
