"""The native C engine (backend "native") on the built-in models and tiny
random ones (llama, and qwen2 with its Q/K/V biases and NEOX RoPE; bad files
and float models on the tiny ones, which need no download).

Parity with llama.cpp: the engine quantizes activations to 8 bits before
every product, as llama.cpp does, so a rounding difference far below any
tolerance can flip an int8 value and travel on. llama.cpp's own logits differ
that much between its batched and one-token-at-a-time paths, and that spread
is the bar the native engine is held to (on a float model it must agree
outright). Batch invariance, rollback and speculative decoding are exact.
"""
from __future__ import annotations

import ctypes
import subprocess
import sys

import gguf
import numpy as np
import pytest

from edgespec import Engine
from edgespec.backends import open_backend
from edgespec.bench.reference import forward_reference, kl_rows
from edgespec.capi import ffi, lib
from edgespec.config import EngineConfig
from edgespec.drafters import Draft
from edgespec.errors import InvalidArgumentError, ModelFormatError, ModelNotFoundError, UnsupportedModelError
from tiny_gguf import Q, copy_gguf, write_tiny_llama

N_CTX = 512
TEXT = ("The lighthouse keeper climbed the narrow stairs every evening to light the lamp. "
        "Ships passing the rocky coast depended on its beam, and in forty years he had never "
        "missed a night. One winter a storm cut the island off from the mainland for weeks, ")
PROMPTS = ["The history of the printing press begins",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]
# Largest |logit difference| from the float64 reference a tiny F32 model may
# show: the F16 rounding of cached keys, values and queries (logits ~ N(0, 4^2);
# observed 0.0055 on the qwen2, 0.0074 on the llama; a NORM RoPE or a missing
# bias in the qwen2 gives 8 and 23).
TOL_F64 = 0.05


def rows(b, addr: int, n: int) -> np.ndarray:
    buf = (ctypes.c_float * (n * b.n_vocab)).from_address(addr)
    return np.ctypeslib.as_array(buf).reshape(n, b.n_vocab).copy()


def batched(b, tokens: list[int]) -> np.ndarray:
    b.clear()
    return rows(b, b.decode(tokens, logits_from=0), len(tokens))


def one_by_one(b, tokens: list[int]) -> np.ndarray:
    b.clear()
    return np.concatenate([rows(b, b.decode([t]), 1) for t in tokens])


def greedy(b, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    b.clear()
    logits = [rows(b, b.decode(prompt), 1)[0]]
    out = [int(logits[-1].argmax())]
    while len(out) < n:
        logits.append(rows(b, b.decode(out[-1:]), 1)[0])
        out.append(int(logits[-1].argmax()))
    return out, logits


def top1(a: np.ndarray, b: np.ndarray) -> float:
    return float((a.argmax(1) == b.argmax(1)).mean())


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def pair(request, smollm2_path, gemma_path):
    """(llama backend, native backend) on one built-in model."""
    path = smollm2_path if request.param == "smollm2" else gemma_path
    with open_backend("llama", path, n_ctx=N_CTX, threads=2) as lb, \
         open_backend("native", path, n_ctx=N_CTX, threads=2) as nb:
        yield lb, nb


@pytest.fixture(scope="module")
def native_smollm2(smollm2_path):
    with open_backend("native", smollm2_path, n_ctx=N_CTX, threads=2) as nb:
        yield nb


# -- parity with llama.cpp ------------------------------------------------------

def test_logits_match_llama_cpp(pair):
    """Within the spread llama.cpp shows against itself on these quantized
    models (batched vs one token at a time over 600 positions: top-1 93.7%,
    mean |dlogit| 0.16 on smollm2; 93.8%, 0.22 on gemma3; see
    benchmarks/bench_native.py parity). A wrong block scores far below."""
    lb, nb = pair
    assert nb.n_vocab == lb.n_vocab and nb.tokenize(TEXT) == lb.tokenize(TEXT)
    tokens = lb.tokenize(TEXT * 2)[:128]
    ref, mine = batched(lb, tokens), batched(nb, tokens)
    diff = np.abs(ref - mine)
    assert top1(ref, mine) >= 0.9 and diff.mean() <= 0.3, (top1(ref, mine), diff.mean(), diff.max())


def test_greedy_follows_llama_cpp_up_to_a_near_tie(pair):
    """Greedy text equals llama.cpp's, or leaves it only where llama.cpp's
    best two tokens are closer than that spread."""
    lb, nb = pair
    p = lb.tokenize(PROMPTS[0])
    ref, ref_logits = greedy(lb, p, 48)
    mine, _ = greedy(nb, p, 48)
    first = next((i for i, (a, b) in enumerate(zip(ref, mine)) if a != b), None)
    if first is not None:
        top2 = np.sort(ref_logits[first])[-2:]
        assert top2[1] - top2[0] < 0.5, (first, top2)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_float(request, tmp_path_factory, tiny_vocab_path, tiny_qwen2_path):
    """A tiny random model with F32 weights, one per architecture family."""
    if request.param == "qwen2":
        return tiny_qwen2_path
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama-f32.gguf"
    write_tiny_llama(path, tiny_vocab_path, dtype=Q.F32)
    return path


def test_tiny_float_model_matches_llama_cpp(tiny_float):
    """F32 weights: no activation rounding, llama.cpp's paths agree, and so must we."""
    path = tiny_float
    with open_backend("llama", path, n_ctx=N_CTX, threads=2) as lb, \
         open_backend("native", path, n_ctx=N_CTX, threads=2) as nb:
        tokens = lb.tokenize(TEXT * 2)[:128]
        ref, mine = batched(lb, tokens), batched(nb, tokens)
        assert top1(ref, mine) >= 0.99
        p = lb.tokenize(PROMPTS[0])
        assert greedy(nb, p, 48)[0] == greedy(lb, p, 48)[0]


def test_tiny_float_model_matches_float64_reference(tiny_float):
    """The forward pass against edgespec.bench.reference's float64 numpy over the
    file's own weights: only the F16 KV cache and F16 queries round here."""
    with open_backend("native", tiny_float, n_ctx=N_CTX, threads=2) as nb:
        tokens = nb.tokenize(TEXT * 2)[:128]
        mine = batched(nb, tokens)
    ref = forward_reference(tiny_float, tokens)
    diff = np.abs(ref - mine)
    assert top1(ref, mine) >= 0.99 and diff.max() <= TOL_F64, (top1(ref, mine), diff.max())


# -- exactness -----------------------------------------------------------------

def test_batch_invariance_chain_and_tree(native_smollm2):
    """A token's logits are bit-identical alone, in a batch and in a tree."""
    nb = native_smollm2
    tokens = nb.tokenize(TEXT)[:24]
    alone = one_by_one(nb, tokens)
    assert np.array_equal(batched(nb, tokens), alone)
    # A tree below tokens[15]: the true continuation as one branch, with
    # decoy siblings and a decoy subtree interleaved in node order.
    pre, cont = tokens[:16], tokens[16:20]
    decoy = [t + 1 for t in cont]
    nodes = [decoy[0], cont[0], decoy[1], cont[1], cont[2], decoy[2], cont[3]]
    parents = [-1, -1, 0, 1, 3, 3, 4]
    nb.clear()
    depths = Draft(nodes, parents).node_depths()
    tree = rows(nb, nb.decode_tree(pre, nodes, parents, depths), len(nodes) + 1)
    nb.drop_tree()
    assert nb.n_past == len(pre)
    assert np.array_equal(tree[0], alone[15])
    for node, pos in ((1, 16), (3, 17), (4, 18), (6, 19)):
        assert np.array_equal(tree[node + 1], alone[pos])


def test_prefill_in_chunks_of_n_batch(native_smollm2, smollm2_path):
    tokens = native_smollm2.tokenize(TEXT)[:24]
    whole = batched(native_smollm2, tokens)
    with open_backend("native", smollm2_path, n_ctx=N_CTX, n_batch=8, threads=2) as small:
        assert np.array_equal(rows(small, small.decode(tokens), 1)[0], whole[-1])
        small.clear()
        assert np.array_equal(rows(small, small.decode(tokens, logits_from=17), 7), whole[17:])
        small.clear()
        with pytest.raises(InvalidArgumentError, match="16 logits rows do not fit one batch of 8"):
            small.decode(tokens, logits_from=8)
        assert small.n_past == 0  # a refused call leaves the cache as it was


def test_truncate_rolls_back_exactly(native_smollm2):
    nb = native_smollm2
    a, b, c = nb.tokenize(TEXT)[:12], nb.tokenize(" storm winter ships"), nb.tokenize(" lamp beam")
    fresh = batched(nb, a + c)[len(a):]
    nb.clear()
    nb.decode(a + b)
    nb.truncate(len(a))
    again = rows(nb, nb.decode(c, logits_from=0), len(c))
    assert np.array_equal(fresh, again)


SPEC_PROMPT = TEXT * 4  # ~220 tokens: generation crosses 256 positions


@pytest.fixture(scope="module", params=["smollm2", "tiny-qwen2"])
def plain_past_256(request, smollm2_path, tiny_qwen2_path):
    """Plain greedy decoding on the native backend from a prompt of ~220 tokens
    (SPEC_PROMPT, cut to fit the tiny model's small tokenizer) to position 300:
    (model path, prompt, prompt length, tokens)."""
    path = smollm2_path if request.param == "smollm2" else tiny_qwen2_path
    with Engine(path, backend="native", threads=2, n_ctx=N_CTX) as plain:
        prompt = plain.detokenize(plain.tokenize(SPEC_PROMPT, add_special=False)[:220])
        n_prompt = len(plain.tokenize(prompt))
        assert 150 < n_prompt < 256
        return path, prompt, n_prompt, plain.generate(prompt, max_tokens=300 - n_prompt).tokens


@pytest.mark.parametrize("drafter", ["ngram", "recycle"])
def test_speculative_equals_plain_past_256_positions(plain_past_256, drafter):
    """Exact speculative decoding on this backend at any context length
    (llama.cpp's kernels stop being batch invariant past 256 cells)."""
    path, prompt, n_prompt, ref = plain_past_256
    with Engine(path, backend="native", threads=2, n_ctx=N_CTX, drafter=drafter) as spec:
        out = spec.generate(prompt, max_tokens=300 - n_prompt)
    assert n_prompt + len(ref) > 256
    assert out.tokens == ref
    assert out.stats.spec.accepted > 0


# -- bad inputs ------------------------------------------------------------------

def truncated(tmp_path, path):
    """The first half of the file at `path`, as tmp_path/cut.gguf."""
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    return cut


def test_missing_and_truncated_files(tmp_path, tiny_llama_path):
    with pytest.raises(ModelNotFoundError) as e:
        open_backend("native", tmp_path / "absent.gguf")
    assert "absent.gguf" in str(e.value) and "\n" not in str(e.value)
    cut = truncated(tmp_path, tiny_llama_path)
    with pytest.raises(ModelFormatError) as e:
        open_backend("native", cut)
    assert "cut.gguf" in str(e.value) and "\n" not in str(e.value)


def test_native_load_checks_the_file_once(tmp_path, smollm2_path, monkeypatch):
    """The native backend resolves a model without the Python-side check:
    es_model_load validates the whole file (and still names it)."""
    from edgespec.models import resolve_model
    from edgespec.models import gguf as gguf_reader

    opened = []
    monkeypatch.setattr(gguf_reader.GGUFFile, "__init__",
                        lambda self, path: opened.append(path) or pytest.fail("checked twice"))
    assert resolve_model("native", str(smollm2_path)) == smollm2_path
    assert not opened
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2_path.read_bytes()[:3_000_000])
    with pytest.raises(ModelFormatError, match="cut.gguf: .*truncated"):
        Engine(str(cut), backend="native")


def test_native_switches_are_engine_config_fields(tiny_llama_path, monkeypatch):
    """EDGESPEC_KERNELS, _REPACK and _EXPERTS are the defaults of EngineConfig's
    kernels, repack and expert_weights, read when a config is made; a value
    given wins over the environment, and is checked like any option."""
    monkeypatch.setenv("EDGESPEC_KERNELS", "scalar")
    monkeypatch.setenv("EDGESPEC_REPACK", "0")
    monkeypatch.delenv("EDGESPEC_EXPERTS", raising=False)
    config = EngineConfig()
    assert (config.kernels, config.repack, config.expert_weights) == ("scalar", "off", "mapped")
    assert config.native_options == {"kernels": "scalar", "repack": "off", "expert_weights": "mapped"}
    assert EngineConfig(repack="memory").repack == "memory"
    with pytest.raises(InvalidArgumentError, match="unknown repack 'yes' \\(available: cached, memory, off\\)"):
        EngineConfig(repack="yes")
    best = ffi.string(lib.es_kernels_available(0)).decode()
    try:
        with open_backend("native", tiny_llama_path, n_ctx=64, threads=1, kernels=best) as b:
            assert b.kernels == best
        with pytest.raises(InvalidArgumentError, match="unknown kernels 'sse9'"):
            open_backend("native", tiny_llama_path, n_ctx=64, kernels="sse9")
    finally:
        lib.es_kernels_select(b"auto")   # the set is the process's: leave the best one in use


def test_kernels_from_the_environment(tiny_llama_path, monkeypatch):
    """EDGESPEC_KERNELS picks the C kernels for the process; the scalar set
    agrees with the best one within float rounding; a set the CPU lacks is
    an InvalidArgumentError naming the ones it has."""
    tokens = list(range(1, 17))
    best = ffi.string(lib.es_kernels_available(0)).decode()  # whatever the suite runs under
    monkeypatch.setenv("EDGESPEC_KERNELS", best)
    with open_backend("native", tiny_llama_path, n_ctx=64, threads=1) as b:
        want = batched(b, tokens)
    monkeypatch.setenv("EDGESPEC_KERNELS", "scalar")
    with open_backend("native", tiny_llama_path, n_ctx=64, threads=1) as b:
        assert ffi.string(lib.es_kernels_name()) == b"scalar"
        got = batched(b, tokens)
    assert np.allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max())
    available = [ffi.string(lib.es_kernels_available(i)).decode() for i in range(4)
                 if lib.es_kernels_available(i) != ffi.NULL]
    lacking = next(k for k in ("neon", "avx2", "avx512") if k not in available)
    monkeypatch.setenv("EDGESPEC_KERNELS", lacking)
    with pytest.raises(InvalidArgumentError, match=f"EDGESPEC_KERNELS={lacking}: .*available: auto, .*scalar"):
        open_backend("native", tiny_llama_path, n_ctx=64)
    monkeypatch.delenv("EDGESPEC_KERNELS")
    with open_backend("native", tiny_llama_path, n_ctx=64, threads=1):
        assert ffi.string(lib.es_kernels_name()).decode() == best


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 16), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="architecture 'mamba' is not supported"):
        open_backend("native", path)


def test_qwen2_variants(tmp_path, tiny_qwen2_path):
    """A qwen2 file without one of its Q/K/V biases runs as llama.cpp reads it
    (the bias adds nothing: the same logits as a zero bias); one with a tensor
    the engine would ignore (here a bias on the attention output) fails with
    one line naming the tensor."""
    no_bias, zero_bias = tmp_path / "no-bias.gguf", tmp_path / "zero-bias.gguf"
    copy_gguf(tiny_qwen2_path, no_bias, drop=["blk.1.attn_k.bias"])
    copy_gguf(tiny_qwen2_path, zero_bias, drop=["blk.1.attn_k.bias"],
              add={"blk.1.attn_k.bias": np.zeros(32, dtype=np.float32)})
    got = []
    for path in (no_bias, zero_bias):
        with open_backend("native", path, n_ctx=64, threads=1) as b:
            got.append(rows(b, b.decode([1, 2, 3, 4], logits_from=0), 4).copy())
    assert np.array_equal(got[0], got[1])
    extra = tmp_path / "extra.gguf"
    copy_gguf(tiny_qwen2_path, extra, add={"blk.0.attn_output.bias": np.zeros(64)})
    with pytest.raises(UnsupportedModelError, match=r"tensor blk\.0\.attn_output\.bias is not used"):
        open_backend("native", extra)


def test_cli_bad_model_exits_2(tmp_path, tiny_llama_path):
    cut = truncated(tmp_path, tiny_llama_path)
    for cmd in ("generate", "chat"):
        args = [cmd, "hello"] if cmd == "generate" else [cmd]
        r = subprocess.run([sys.executable, "-m", "edgespec", *args, "-m", str(cut), "--backend", "native"],
                           capture_output=True, text=True, input="", timeout=120)
        assert r.returncode == 2, (cmd, r.stderr)
        assert r.stderr.startswith("error:") and len(r.stderr.strip().splitlines()) == 1
