"""Mixture-of-experts models on the native engine.

The tiny random MoE files of tests/tiny_gguf.py, in both flavours (qwen3moe,
Mixtral-style llama), load in llama.cpp, and the native engine's logits and
greedy text match llama.cpp's on them. Routing is checked on files whose
output is known another way (every expert a copy of a dense FFN; the same
experts stored in another order), the per-expert access path by serving F32
copies made on demand (EDGESPEC_EXPERTS=f32), and batch invariance by
evaluating one sequence in batches of different sizes.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from edgespec.backends import open_backend
from edgespec.errors import EdgespecError
from edgespec.models.gguf import GGUFFile
from tiny_gguf import MOE_FIXTURES, Q, write_moe_fixture, write_tiny_llama

N_CTX = 1024
N_POSITIONS = 600      # logits compared per fixture
N_GREEDY = 48

# Float weights: llama.cpp agrees with itself whatever the batch size, so the
# native engine must agree with it as closely. Quantized experts: activations
# are quantized to 8 bits before every product (in llama.cpp as here), so a
# rounding difference far below any tolerance can flip an int8 value or a
# near-tied expert choice, and the difference travels on: llama.cpp's own
# logits differ as much between batch sizes (its kernels reduce in another
# order for a batch of 16 than of 128, or token by token), and that is the bar.
FLOAT = ("qwen3moe-f32", "mixtral-f16")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("moe")


def _write(name, moe_dir, source):
    path = write_moe_fixture(name, moe_dir, source)
    return name, *MOE_FIXTURES[name], path


@pytest.fixture(scope="module", params=sorted(MOE_FIXTURES))
def fixture(request, moe_dir, tiny_vocab_path):
    """(name, writer, keyword arguments, path) of one MoE file."""
    return _write(request.param, moe_dir, tiny_vocab_path)


@pytest.fixture(scope="module", params=FLOAT)
def float_fixture(request, moe_dir, tiny_vocab_path):
    return _write(request.param, moe_dir, tiny_vocab_path)


def backend(name: str, path, n_batch: int = 128):
    return open_backend(name, path, n_ctx=N_CTX, n_batch=n_batch, threads=2)


def logits_rows(b, tokens: list[int], start: int = 0, chunk: int | None = None) -> np.ndarray:
    """(len(tokens), n_vocab) logits of `tokens` at positions start... (the
    cache is cut back to `start` first), decoded `chunk` tokens a batch
    (default: the backend's n_batch)."""
    chunk = chunk or b.n_batch
    b.truncate(start)
    out = []
    for i in range(0, len(tokens), chunk):
        part = tokens[i:i + chunk]
        addr = b.decode(part, logits_from=0)
        rows = (ctypes.c_float * (len(part) * b.n_vocab)).from_address(addr)
        out.append(np.ctypeslib.as_array(rows).reshape(len(part), b.n_vocab).copy())
    return np.concatenate(out)


def random_tokens(b, n: int, seed: int = 0) -> list[int]:
    """n random tokens of backend b's vocabulary."""
    return np.random.default_rng(seed).integers(0, b.n_vocab, n).tolist()


def greedy(b, prompt: list[int], n: int) -> list[int]:
    out = []
    row = logits_rows(b, prompt)[-1]
    for i in range(n):
        out.append(int(row.argmax()))
        row = logits_rows(b, out[-1:], len(prompt) + i)[0]
    return out


def agreement(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    """Top-1 agreement, median and maximum over rows of max |a - b|."""
    row_max = np.abs(a - b).max(axis=1)
    return float((a.argmax(axis=1) == b.argmax(axis=1)).mean()), float(np.median(row_max)), \
        float(row_max.max())


_native_logits: dict[str, np.ndarray] = {}


def native_logits(fixture) -> np.ndarray:
    """The native engine's logits of the N_POSITIONS random tokens, once per file."""
    name, path = fixture[0], fixture[3]
    if name not in _native_logits:
        with backend("native", path) as b:
            _native_logits[name] = logits_rows(b, random_tokens(b, N_POSITIONS))
    return _native_logits[name]


# ---- the fixtures are models llama.cpp runs -----------------------------------------------

def test_llama_cpp_loads_moe_fixture(fixture):
    name, _, kwargs, path = fixture
    arch = name.split("-")[0].replace("mixtral", "llama")
    with backend("llama", path) as b:
        assert b.metadata("general.architecture") == arch
        assert int(b.metadata(f"{arch}.expert_count")) == kwargs.get("n_expert", 8)
        assert int(b.metadata(f"{arch}.expert_used_count")) == kwargs.get("n_expert_used", 2)
        logits = logits_rows(b, random_tokens(b, 64))
    assert np.isfinite(logits).all()
    assert (logits.std(axis=1) > 1.0).all()
    assert len(set(logits.argmax(axis=1))) > 48   # positions prefer different tokens
    with GGUFFile(path) as f:
        types = {t.name.split(".")[-2]: t.ggml_type for t in f.tensors if t.name.startswith("blk.0.")}
    expected = kwargs.get("expert_dtype", kwargs.get("dtype", Q.Q8_0 if arch == "qwen3moe"
                                                              else Q.F16))
    if not isinstance(expected, tuple):
        expected = (expected,) * 3
    assert (types["ffn_gate_exps"], types["ffn_up_exps"], types["ffn_down_exps"]) == expected
    assert types["ffn_gate_inp"] == Q.F32


# ---- parity with llama.cpp ------------------------------------------------------------------

def test_logits_match_llama_cpp(fixture):
    name, path = fixture[0], fixture[3]
    ours = native_logits(fixture)
    with backend("llama", path) as b:
        tokens = random_tokens(b, N_POSITIONS)
        ref = logits_rows(b, tokens)
        if name not in FLOAT:
            b.clear()
            ref_small_batches = logits_rows(b, tokens, chunk=16)
    top1, median, worst = agreement(ours, ref)
    print(f"\n{name}: {N_POSITIONS} positions, native vs llama.cpp: top-1 {top1:.2%}, "
          f"max |diff| median {median:.3g}, worst {worst:.3g}")
    if name in FLOAT:
        assert top1 >= 0.99
        assert median < 0.02          # logits spread over ~4 units
        return
    floor_top1, floor_median, floor_worst = agreement(ref_small_batches, ref)
    print(f"{name}: llama.cpp in batches of 16 vs 128: top-1 {floor_top1:.2%}, "
          f"max |diff| median {floor_median:.3g}, worst {floor_worst:.3g}")
    assert top1 >= floor_top1 - 0.01
    assert median <= 1.5 * floor_median


def test_greedy_matches_llama_cpp(float_fixture):
    path = float_fixture[3]
    with backend("llama", path) as ref:
        prompt = ref.tokenize("The quick brown fox jumps over the lazy dog. Once upon a time")
        expected = greedy(ref, prompt, N_GREEDY)
        expected_text = b"".join(ref.piece(t) for t in expected)
    with backend("native", path) as b:
        got = greedy(b, prompt, N_GREEDY)
        assert b"".join(b.piece(t) for t in got) == expected_text
    assert got == expected


# ---- routing ------------------------------------------------------------------------------

@pytest.mark.parametrize("n_expert_used", [2, 4])
def test_identical_experts_compute_the_dense_model(moe_dir, tiny_vocab_path, n_expert_used):
    """Every expert a copy of the dense FFN: whichever experts the router
    picks, their weights sum to one, so the MoE model is the dense one. (F32
    weights: with F16 ones, a last-bit difference of the weights' sum can
    flip the half rounding of the next matmul's input, which travels on.)"""
    dense, moe = moe_dir / "dense.gguf", moe_dir / f"dense-as-moe-{n_expert_used}.gguf"
    write_tiny_llama(dense, tiny_vocab_path, n_ctx=N_CTX, dtype=Q.F32)
    write_tiny_llama(moe, tiny_vocab_path, n_ctx=N_CTX, dtype=Q.F32, n_expert=4,
                     n_expert_used=n_expert_used, identical_experts=True)
    with backend("native", dense) as b:
        want = logits_rows(b, random_tokens(b, 96, seed=1))
    with backend("native", moe) as b:
        got = logits_rows(b, random_tokens(b, 96, seed=1))
    assert np.abs(got - want).max() < 1e-3
    assert (got.argmax(axis=1) == want.argmax(axis=1)).all()


def test_expert_order_does_not_matter(fixture, moe_dir, tiny_vocab_path):
    """The same experts stored in another order: the same model, bit for bit
    (routing picks by score, and adds the chosen experts best first)."""
    name, write, kwargs, path = fixture
    order = np.random.default_rng(2).permutation(kwargs.get("n_expert", 8)).tolist()
    permuted = moe_dir / f"{name}-permuted.gguf"
    write(permuted, tiny_vocab_path, **kwargs, expert_order=order)
    with backend("native", permuted) as b:
        got = logits_rows(b, random_tokens(b, 64))
    assert np.array_equal(got, native_logits(fixture)[:64])


# ---- the per-expert access path and batch invariance ---------------------------------------

def test_experts_served_as_f32_copies(float_fixture, monkeypatch):
    """EDGESPEC_EXPERTS=f32 serves every expert matrix as an F32 copy made
    on demand, as a cache of experts hands out buffers of its own: F32
    experts give the same logits bit for bit, F16 ones within rounding."""
    name, _, kwargs, path = float_fixture
    monkeypatch.setenv("EDGESPEC_EXPERTS", "f32")
    with backend("native", path) as b:
        got = logits_rows(b, random_tokens(b, N_POSITIONS))
    want = native_logits(float_fixture)
    if kwargs.get("expert_dtype") == Q.F32:
        assert np.array_equal(got, want)
    else:
        top1, median, _ = agreement(got, want)
        assert top1 >= 0.99 and median < 0.02


def test_unknown_expert_provider_is_an_error(monkeypatch, moe_dir, tiny_vocab_path):
    path = _write("qwen3moe-q8_0", moe_dir, tiny_vocab_path)[3]
    monkeypatch.setenv("EDGESPEC_EXPERTS", "fp8")
    with pytest.raises(EdgespecError, match="EDGESPEC_EXPERTS=fp8"):
        backend("native", path)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_batch_invariance(fixture, chunk):
    """A token's logits do not depend on which other tokens share its batch."""
    with backend("native", fixture[3]) as b:
        got = logits_rows(b, random_tokens(b, N_POSITIONS)[:64], chunk=chunk)
    assert np.array_equal(got, native_logits(fixture)[:64])
