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

import gguf
import numpy as np
import pytest

from edgespec.backends import open_backend
from edgespec.errors import EdgespecError
from tiny_gguf import Q, write_tiny_llama, write_tiny_qwen3moe

N_CTX = 1024
N_POSITIONS = 600      # logits compared per flavour
N_GREEDY = 48

FLAVOURS = {
    # Qwen3-30B-A3B in miniature: QK norms, head_dim 64 on n_embd 128,
    # 8 Q8_0 experts of width 64, top 2 renormalized; F16 elsewhere.
    "qwen3moe": (write_tiny_qwen3moe, {}),
    # Mixtral in miniature: 4 Q4_K experts (K-quants need rows of 256), top 2;
    # Q8_0 elsewhere.
    "mixtral": (write_tiny_llama, dict(n_embd=256, n_ff=256, n_head=8, n_head_kv=4, n_expert=4,
                                       n_expert_used=2, dtype=Q.Q8_0, expert_dtype=Q.Q4_K,
                                       n_ctx=N_CTX, norm_noise=0.1)),
}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("moe")


@pytest.fixture(scope="module", params=sorted(FLAVOURS))
def flavour(request, moe_dir, smollm2_path):
    """(name, writer, keyword arguments, path) of one MoE flavour's file."""
    write, kwargs = FLAVOURS[request.param]
    path = moe_dir / f"{request.param}.gguf"
    write(path, smollm2_path, **kwargs)
    return request.param, write, kwargs, path


def backend(name: str, path, n_batch: int = 128):
    return open_backend(name, path, n_ctx=N_CTX, n_batch=n_batch, threads=2)


def logits_rows(b, tokens: list[int], start: int = 0, chunk: int | None = None) -> np.ndarray:
    """(len(tokens), n_vocab) logits of `tokens` at positions start..., decoded
    `chunk` tokens a batch (default: the backend's n_batch)."""
    chunk = chunk or b.n_batch
    out = []
    for i in range(0, len(tokens), chunk):
        part = tokens[i:i + chunk]
        addr = b.decode(part, start + i, logits_from=0)
        rows = (ctypes.c_float * (len(part) * b.n_vocab)).from_address(addr)
        out.append(np.ctypeslib.as_array(rows).reshape(len(part), b.n_vocab).copy())
    return np.concatenate(out)


def random_tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 49152, n).tolist()


def greedy(b, prompt: list[int], n: int) -> list[int]:
    out = []
    row = logits_rows(b, prompt)[-1]
    for i in range(n):
        out.append(int(row.argmax()))
        row = logits_rows(b, out[-1:], len(prompt) + i)[0]
    return out


@pytest.fixture(scope="module")
def native_logits(flavour):
    with backend("native", flavour[3]) as b:
        return logits_rows(b, random_tokens(N_POSITIONS))


# ---- the fixtures are models llama.cpp runs -----------------------------------------------

def test_llama_cpp_loads_moe_fixture(flavour):
    name, _, kwargs, path = flavour
    arch = "qwen3moe" if name == "qwen3moe" else "llama"
    with backend("llama", path) as b:
        assert b.metadata("general.architecture") == arch
        assert int(b.metadata(f"{arch}.expert_count")) == kwargs.get("n_expert", 8)
        assert int(b.metadata(f"{arch}.expert_used_count")) == kwargs.get("n_expert_used", 2)
        logits = logits_rows(b, random_tokens(64))
    assert np.isfinite(logits).all()
    assert (logits.std(axis=1) > 1.0).all()
    assert len(set(logits.argmax(axis=1))) > 48   # positions prefer different tokens


def test_fixture_stores_quantized_experts(flavour):
    _, _, kwargs, path = flavour
    types = {t.name.split(".")[-2]: t.tensor_type for t in gguf.GGUFReader(path).tensors
             if t.name.startswith("blk.0.")}
    expected = kwargs.get("expert_dtype", Q.Q8_0)
    assert types["ffn_gate_exps"] == types["ffn_up_exps"] == types["ffn_down_exps"] == expected
    assert types["ffn_gate_inp"] == Q.F32


# ---- parity with llama.cpp ------------------------------------------------------------------

def test_logits_match_llama_cpp(flavour, native_logits):
    with backend("llama", flavour[3]) as b:
        ref = logits_rows(b, random_tokens(N_POSITIONS))
    diff = np.abs(native_logits - ref)
    top1 = (native_logits.argmax(axis=1) == ref.argmax(axis=1)).mean()
    print(f"\n{flavour[0]}: {N_POSITIONS} positions, max |native - llama.cpp| = {diff.max():.4g}, "
          f"99th percentile of row maxima = {np.percentile(diff.max(axis=1), 99):.4g}, "
          f"top-1 agreement = {top1:.2%}")
    assert top1 >= 0.99
    # Logits spread over ~4 units; rounding (activation formats, summation
    # order) leaves differences well below that, except where a near-tie of
    # two experts' router scores goes the other way in one of the engines.
    assert np.median(diff.max(axis=1)) < 0.05


def test_greedy_matches_llama_cpp(flavour):
    path = flavour[3]
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
def test_identical_experts_compute_the_dense_model(moe_dir, smollm2_path, n_expert_used):
    """Every expert a copy of the dense FFN: whichever experts the router
    picks, their weights sum to one, so the MoE model is the dense one."""
    dense, moe = moe_dir / "dense.gguf", moe_dir / f"dense-as-moe-{n_expert_used}.gguf"
    write_tiny_llama(dense, smollm2_path, n_ctx=N_CTX)
    write_tiny_llama(moe, smollm2_path, n_ctx=N_CTX, n_expert=4, n_expert_used=n_expert_used,
                     identical_experts=True)
    tokens = random_tokens(96, seed=1)
    with backend("native", dense) as b:
        want = logits_rows(b, tokens)
    with backend("native", moe) as b:
        got = logits_rows(b, tokens)
    assert np.abs(got - want).max() < 1e-3
    assert (got.argmax(axis=1) == want.argmax(axis=1)).all()


def test_expert_order_does_not_matter(flavour, moe_dir, smollm2_path):
    """The same experts stored in another order: the same model, bit for bit
    (routing picks by score, and adds the chosen experts best first)."""
    name, write, kwargs, path = flavour
    n_expert = kwargs.get("n_expert", 8)
    order = np.random.default_rng(2).permutation(n_expert).tolist()
    permuted = moe_dir / f"{name}-permuted.gguf"
    write(permuted, smollm2_path, **kwargs, expert_order=order)
    tokens = random_tokens(64, seed=2)
    with backend("native", path) as b:
        want = logits_rows(b, tokens)
    with backend("native", permuted) as b:
        got = logits_rows(b, tokens)
    assert np.array_equal(got, want)


# ---- the per-expert access path and batch invariance ---------------------------------------

def test_experts_served_as_f32_copies(flavour, native_logits, monkeypatch):
    """EDGESPEC_EXPERTS=f32 serves every expert matrix as an F32 copy made
    on demand, as a cache of experts would hand out a buffer of its own: the
    model is the same up to the rounding of quantized activations."""
    monkeypatch.setenv("EDGESPEC_EXPERTS", "f32")
    with backend("native", flavour[3]) as b:
        got = logits_rows(b, random_tokens(N_POSITIONS))
    assert (got.argmax(axis=1) == native_logits.argmax(axis=1)).mean() >= 0.99
    assert np.median(np.abs(got - native_logits).max(axis=1)) < 0.05


def test_unknown_expert_provider_is_an_error(flavour, monkeypatch):
    monkeypatch.setenv("EDGESPEC_EXPERTS", "fp8")
    with pytest.raises(EdgespecError, match="EDGESPEC_EXPERTS=fp8"):
        backend("native", flavour[3])


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_batch_invariance(flavour, native_logits, chunk):
    """A token's logits do not depend on which other tokens share its batch."""
    with backend("native", flavour[3]) as b:
        got = logits_rows(b, random_tokens(N_POSITIONS)[:64], chunk=chunk)
    assert np.array_equal(got, native_logits[:64])
