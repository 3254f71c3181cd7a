"""The tiny random llama and qwen2 (tests/tiny_gguf.py) are models llama.cpp
accepts: they load, tokenize exactly like the file they took their tokenizer
from, and produce finite, varied logits. The generated tokenizer
(write_tiny_vocab) is a working byte-level BPE, and a real one (SmolLM2's)
survives the copy."""
import llama_cpp
import numpy as np
import pytest

from tiny_gguf import SPECIAL_TOKENS, write_tiny_llama

TEXTS = ["Hello world", " Héllo, wörld!\n\t 12345 ", "<|im_start|>user\nhi<|im_end|>"]


def load(path, **kwargs):
    return llama_cpp.Llama(model_path=str(path), n_ctx=256, verbose=False, **kwargs)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def tiny(arch, tiny_llama_path, tiny_qwen2_path):
    return load(tiny_llama_path if arch == "llama" else tiny_qwen2_path, logits_all=True)


@pytest.fixture(scope="module")
def source(tiny_vocab_path):
    return load(tiny_vocab_path, vocab_only=True)


@pytest.fixture(scope="module")
def smollm2_copy(tmp_path_factory, smollm2_path):
    """A tiny llama with SmolLM2's tokenizer, and SmolLM2's vocabulary."""
    path = tmp_path_factory.mktemp("copy") / "tiny-smollm2.gguf"
    write_tiny_llama(path, smollm2_path)
    return load(path), load(smollm2_path, vocab_only=True)


def check_copy(tiny, source, arch="llama"):
    def tokenizer_keys(m):
        return {k: v for k, v in m.metadata.items() if k.startswith("tokenizer.")}

    assert tiny.metadata["general.architecture"] == arch
    assert tiny.n_vocab() == source.n_vocab()
    assert tokenizer_keys(tiny) == tokenizer_keys(source)
    assert (tiny.token_bos(), tiny.token_eos()) == (source.token_bos(), source.token_eos())
    for text in TEXTS:
        for special in (False, True):
            tokens = tiny.tokenize(text.encode(), add_bos=True, special=special)
            assert tokens == source.tokenize(text.encode(), add_bos=True, special=special)
            assert tiny.detokenize(tokens) == source.detokenize(tokens)


def test_copies_the_generated_tokenizer(tiny, source, arch):
    assert tiny.n_ctx() == 256
    check_copy(tiny, source, arch)


def test_copies_a_real_tokenizer(smollm2_copy):
    check_copy(*smollm2_copy)


def test_generated_tokenizer_round_trips_and_merges(source):
    n_vocab = source.n_vocab()
    assert len(SPECIAL_TOKENS) + 256 + 200 <= n_vocab <= len(SPECIAL_TOKENS) + 256 + 256
    for text in TEXTS + ["".join(map(chr, range(1, 0x250))), "🙂 世界"]:
        tokens = source.tokenize(text.encode(), add_bos=False, special=False)
        assert source.detokenize(tokens).decode() == text
    # learned pieces: words of the corpus are one token each, a space joins the word after it
    pieces = [source.detokenize([t]) for t in source.tokenize(b"The quick brown fox", add_bos=False)]
    assert pieces == [b"The", b" quick", b" brown", b" fox"]
    # the ChatML tokens are one token each, and only as special text
    assert source.tokenize(b"<|im_start|>", add_bos=False, special=True) == [SPECIAL_TOKENS.index("<|im_start|>")]
    assert len(source.tokenize(b"<|im_start|>", add_bos=False, special=False)) > 1
    assert source.token_eos() == SPECIAL_TOKENS.index("<|im_end|>")
    assert source.metadata["tokenizer.chat_template"].startswith("{% for message in messages %}")


def test_logits_finite_and_varied(tiny):
    tiny.reset()
    tokens = tiny.tokenize(b"Hello world, once upon a time")
    tiny.eval(tokens)
    logits = np.asarray(tiny.scores[:tiny.n_tokens])     # (n_tokens, n_vocab)
    assert logits.shape == (len(tokens), tiny.n_vocab())
    assert np.isfinite(logits).all()
    assert (logits.std(axis=1) > 1.0).all()
    assert len(np.unique(logits, axis=0)) == len(tokens)  # every position's logits its own


def test_greedy_generation_runs(tiny):
    def greedy(n):
        tiny.reset()
        tokens = tiny.generate(tiny.tokenize(b"Hello world"), temp=0.0)
        return [next(tokens) for _ in range(n)]

    out = greedy(6)
    assert len(set(out)) > 1
    assert greedy(6) == out
