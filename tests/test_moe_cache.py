"""MoE models larger than memory: the native engine's expert cache, its
low-precision sidecar, and the files `edgespec moe` writes.

``exact`` precision must reproduce the unlimited engine bit for bit whatever
the budget (logits, greedy, seeded sampling, speculative decoding); the
cache's own counters must stay within the budget, and so must the process's
peak RSS; ``balanced``/``fast`` read fewer bytes from a sidecar that is
refused when it does not match; an upcycled model computes its dense source.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from edgespec import Engine, moe
from edgespec.training import moe_tools
from edgespec.backends import open_backend
from edgespec.errors import BackendError, InvalidArgumentError, ModelFormatError, UnsupportedModelError
from tiny_gguf import Q, write_moe_fixture, write_tiny_llama, write_tiny_qwen2

N_CTX = 512
# The synthetic test model: 4 layers of 8 Q8_0 experts of 128 x 256, top 2.
# One expert is 104,448 bytes: a 1 MB cache holds 9 of its 32.
SYNTH = dict(experts=8, top_k=2, layers=4, embd=128, ff=256, qtype="q8_0")
EXPERT_BYTES = 3 * 256 * 128 * 34 // 32


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("moe-cache")


@pytest.fixture(scope="module")
def synth_path(moe_dir, tiny_vocab_path):
    return moe_tools.synth(moe_dir / "synth.gguf", tiny_vocab_path, **SYNTH, progress=False)


@pytest.fixture(scope="module")
def sidecar(synth_path):
    return moe_tools.prepare(synth_path, progress=False)


def backend(path, experts=None, n_batch=64):
    return open_backend("native", path, n_ctx=N_CTX, n_batch=n_batch, threads=2, experts=experts)


def logits(b, tokens: list[int], chunk: int) -> np.ndarray:
    """Logits of every token, decoded `chunk` tokens a batch from an empty cache."""
    b.truncate(0)
    rows = []
    for i in range(0, len(tokens), chunk):
        part = tokens[i:i + chunk]
        addr = b.decode(part, logits_from=0)
        rows.append(np.ctypeslib.as_array((ctypes.c_float * (len(part) * b.n_vocab)).from_address(addr))
                    .reshape(len(part), b.n_vocab).copy())
    return np.concatenate(rows)


def prompt_then_steps(b, n_prompt=40, n_steps=40, seed=0) -> np.ndarray:
    """A prompt batch, then token-by-token decoding (as generation does)."""
    tokens = np.random.default_rng(seed).integers(0, b.n_vocab, n_prompt + n_steps).tolist()
    head = logits(b, tokens[:n_prompt], chunk=n_prompt)
    rows = [head]
    for t in tokens[n_prompt:]:
        addr = b.decode([t], logits_from=0)
        rows.append(np.ctypeslib.as_array((ctypes.c_float * b.n_vocab).from_address(addr)).copy()[None])
    return np.concatenate(rows)


# ---- exact precision is the unlimited engine -------------------------------------------------

@pytest.mark.parametrize("name", ["synth", "qwen3moe-q8_0", "mixtral-q4_k"])
@pytest.mark.parametrize("budget_mb,policy", [(1, "adaptive"), (1, "lru"), (3, "adaptive")])
def test_exact_cache_is_bit_identical(name, budget_mb, policy, moe_dir, tiny_vocab_path, synth_path):
    path = synth_path if name == "synth" else write_moe_fixture(name, moe_dir, tiny_vocab_path)
    with backend(path) as b:
        want = prompt_then_steps(b)
        assert b.expert_stats() is None
    cache = moe.ExpertCache(budget_mb, policy=policy)
    with backend(path, cache) as b:
        got = prompt_then_steps(b)
        st = b.expert_stats()
    assert np.array_equal(got, want)
    assert st["budget_bytes"] == budget_mb * 1_000_000
    assert 0 < st["cache_bytes"] <= st["budget_bytes"]
    assert st["lookups"] > 0 and st["loads"] > 0 and st["substitutions"] == 0
    assert st["tokens"] == 80
    if name == "synth" and budget_mb == 1:      # 9 slots for 32 experts
        assert st["n_slots"] == 1_000_000 // EXPERT_BYTES
        assert st["evictions"] > 0
        assert st["bytes_read"] > 32 * EXPERT_BYTES


def generate(path, prompt, **kw):
    cache = {k: kw.pop(k) for k in ("expert_cache_mb", "expert_policy") if k in kw}
    drafter = kw.pop("drafter", "none")
    with Engine(path, backend="native", n_ctx=N_CTX, threads=2, drafter=drafter, **cache) as e:
        r = e.generate(prompt, max_tokens=48, **kw)
    return r.tokens, r.stats


SAMPLED = dict(temperature=0.9, top_p=0.95, seed=7)


@pytest.mark.parametrize("budget_mb", [1, 3])
@pytest.mark.parametrize("mode", ["greedy", "sampled", "speculative", "speculative sampled"])
def test_engine_exact_cache_same_tokens(synth_path, mode, budget_mb):
    prompt = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"
    kw = {"greedy": {}, "sampled": SAMPLED, "speculative": dict(drafter="ngram"),
          "speculative sampled": dict(drafter="ngram", **SAMPLED)}[mode]
    want, _ = generate(synth_path, prompt, **kw)
    got, stats = generate(synth_path, prompt, expert_cache_mb=budget_mb, **kw)
    assert got == want
    x = stats.experts
    assert x is not None and x["cache_bytes"] <= budget_mb * 1_000_000 and x["substitutions"] == 0
    # The cache's accounting: every lookup that missed and every prefetch is one
    # read of one expert, and every token the generation evaluated passed the
    # first MoE layer (the prompt, then one per plain step, or the step's
    # token and its draft).
    assert x["loads"] == x["lookups"] - x["hits"] + x["prefetches"] > 0
    # (the last layers' prefetches may still be reading)
    assert x["bytes_read"] % EXPERT_BYTES == 0
    assert 0 <= x["loads"] - x["bytes_read"] // EXPERT_BYTES <= x["n_slots"]
    assert x["hit_rate"] == x["hits"] / x["lookups"]
    # prefetches counted by depth, as deep as the cache went
    assert sum(x["prefetches_by_depth"]) == x["prefetches"]
    assert sum(x["prefetch_used_by_depth"]) == x["prefetch_used"]
    assert 1 <= len(x["prefetches_by_depth"]) <= moe.DEFAULT_PREFETCH
    if mode.startswith("speculative"):
        assert stats.spec.drafted > 0 and stats.spec.accepted > 0   # it did speculate
        evaluated = stats.spec.target_steps + stats.spec.drafted
    else:
        evaluated = stats.n_tokens - 1 + (stats.stop_reason == "eos")   # the last token is never evaluated
    assert x["tokens"] == stats.prompt_tokens + evaluated


def test_planner_costs_a_cache_of_its_own(synth_path):
    """The planner's batch-cost curve is measured per expert-cache setting
    (a batch reads the union of its tokens' experts from disk), on batches
    of fresh tokens that miss the cache as verification batches do."""
    from edgespec import costs

    with backend(synth_path) as b:
        plain = costs.cost_key(b)
    keys = set()
    for cache in (moe.ExpertCache(1), moe.ExpertCache(2), moe.ExpertCache(1, policy="lru")):
        with backend(synth_path, cache) as b:
            keys.add(costs.cost_key(b))
            times = costs.time_batches(b, [1, 4], reps=2, prefix=8)
            st = b.expert_stats()
    assert plain not in keys and len(keys) == 3
    assert set(times) == {1, 4} and all(t > 0 for t in times.values())
    assert st["loads"] > st["n_slots"]      # the repetitions kept missing: 9 slots, 32 experts


# ---- bad settings ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wide_path(moe_dir, tiny_vocab_path):
    """Experts of 835,584 bytes: two (top 2) need 1.68 MB."""
    return moe_tools.synth(moe_dir / "wide.gguf", tiny_vocab_path, experts=4, top_k=2, layers=2, embd=256,
                     ff=1024, qtype="q8_0", progress=False)


def test_budget_below_one_layers_experts(wide_path):
    with pytest.raises(InvalidArgumentError, match=r"below the minimum of 1\.68 MB \(one layer's 2 active"):
        Engine(wide_path, backend="native", expert_cache_mb=1)
    with Engine(wide_path, backend="native", expert_cache_mb=2) as e:
        assert e.generate("hello", max_tokens=4).stats.experts["n_slots"] == 2


@pytest.mark.parametrize("kwargs,match", [
    (dict(backend="llama", expert_cache_mb=10), "needs the native backend"),
    (dict(backend="native", expert_cache_mb=0), "expert_cache_mb must be >= 1"),
    (dict(backend="native", expert_precision="balanced"), "applies to an expert cache"),
    (dict(backend="native", expert_cache_mb=4, expert_precision="best"), "available: exact, balanced, fast"),
    (dict(backend="native", expert_cache_mb=4, expert_policy="lfu"), "available: adaptive, lru"),
    (dict(backend="native", expert_cache_mb=4, expert_prefetch=-1), r"\[0, 64\]"),
])
def test_bad_expert_settings(synth_path, kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        Engine(synth_path, **kwargs)


def test_an_expert_cache_on_a_dense_model_is_refused_naming_its_architecture(tiny_llama_path):
    with pytest.raises(InvalidArgumentError, match="dense llama model"):
        Engine(str(tiny_llama_path), expert_cache_mb=8)


def test_balanced_needs_the_sidecar(moe_dir, tiny_vocab_path):
    path = moe_tools.synth(moe_dir / "bare.gguf", tiny_vocab_path, **SYNTH, seed=3, progress=False)
    with pytest.raises(InvalidArgumentError, match="edgespec moe prepare"):
        Engine(path, backend="native", expert_cache_mb=2, expert_precision="balanced")


# ---- the low-precision sidecar --------------------------------------------------------------

def test_sidecar_layout(synth_path, sidecar):
    assert sidecar == moe.sidecar_path(synth_path)
    data = sidecar.read_bytes()
    assert data[:8] == moe.SIDECAR_MAGIC
    n_copies = SYNTH["layers"] * SYNTH["experts"]
    stride = int.from_bytes(data[56:64], "little")
    start = int.from_bytes(data[64:72], "little")
    # Rows of 128 (gate, up) are no whole Q3_K super-block: Q4_0 (18 bytes
    # per 32 values); rows of 256 (down) Q3_K (110 bytes per 256).
    assert int.from_bytes(data[12:16], "little") == Q.Q4_0 and int.from_bytes(data[72:76], "little") == Q.Q3_K
    assert stride == -(-(2 * 256 * 128 * 18 // 32 + 128 * 110) // 64) * 64
    assert len(data) == start + n_copies * stride
    sums = np.frombuffer(data[88:88 + 8 * n_copies], dtype="<u8")
    assert [moe_tools.checksum(data[start + i * stride:start + (i + 1) * stride]) for i in range(n_copies)] == \
        sums.tolist()
    assert not list(synth_path.parent.glob(".*tmp*"))          # written atomically


@pytest.mark.parametrize("precision", ["balanced", "fast"])
def test_low_precision_reads_fewer_bytes(synth_path, sidecar, precision):
    with backend(synth_path, moe.ExpertCache(1, prefetch=0)) as b:
        exact = prompt_then_steps(b)
        exact_st = b.expert_stats()
    with backend(synth_path, moe.ExpertCache(1, precision, prefetch=0)) as b:
        got = prompt_then_steps(b)
        st = b.expert_stats()
    assert st["substitutions"] > 0
    assert st["bytes_read"] < exact_st["bytes_read"]
    assert np.isfinite(got).all()
    # Q4_0 / Q3_K copies of Q8_0 experts change the logits, not the model:
    # on this random model (flat logits over ~500 tokens) many top-1 choices
    # stay (fast: every expert of every token a copy), where experts read
    # wrongly would keep next to none.
    assert (got.argmax(axis=1) == exact.argmax(axis=1)).mean() >= {"balanced": 0.6, "fast": 0.4}[precision]
    if precision == "fast":   # every lookup: no full-precision expert is ever read
        assert st["substitutions"] == st["lookups"]
    # Low-precision copies take smaller slots: more experts in the same
    # budget, which the slots fill to within one full expert.
    assert 1_000_000 - EXPERT_BYTES < st["cache_bytes"] <= 1_000_000
    assert st["n_slots"] > exact_st["n_slots"]


@pytest.fixture(scope="module", params=["q2_k", "q3_k"])
def wide_sidecar(request, wide_path, moe_dir):
    return request.param, moe_tools.prepare(wide_path, moe_dir / f"wide.{request.param}", qtype=request.param,
                                      progress=False)


def test_k_quant_copies_are_gguf_blocks(wide_path, wide_sidecar):
    """Rows of whole super-blocks get Q2_K / Q3_K copies in GGUF's layout:
    gguf-py's reference dequantization (llama.cpp's format) reads them as
    es_dequantize_row does, close to the model's own weights."""
    import gguf

    from edgespec.capi import ffi, lib
    qtype, path = wide_sidecar
    t = getattr(Q, qtype.upper())
    data = path.read_bytes()
    assert int.from_bytes(data[12:16], "little") == t == int.from_bytes(data[72:76], "little")
    start = int.from_bytes(data[64:72], "little")
    reader = gguf.GGUFReader(str(wide_path))
    gate = next(x for x in reader.tensors if x.name == "blk.1.ffn_gate_exps.weight")
    w = gguf.quants.dequantize(np.asarray(gate.data)[3], Q.Q8_0)   # layer 1, expert 3: (1024, 256)
    stride = int.from_bytes(data[56:64], "little")
    off = start + (1 * 4 + 3) * stride
    nbytes = 1024 * 256 // 256 * (84 if qtype == "q2_k" else 110)
    ref = gguf.quants.dequantize(np.frombuffer(data[off:off + nbytes], np.uint8).reshape(1024, -1), t)
    ours = np.empty(1024 * 256, np.float32)
    assert lib.es_dequantize_row(t, ffi.from_buffer(data[off:off + nbytes]), ffi.from_buffer("float[]", ours),
                                 ours.size) == lib.ES_OK
    np.testing.assert_allclose(ours.reshape(1024, 256), ref, rtol=1e-6, atol=1e-7)
    rel = np.sqrt(((ref - w) ** 2).mean() / (w ** 2).mean())
    assert 0 < rel < {"q2_k": 0.4, "q3_k": 0.2}[qtype]


@pytest.mark.parametrize("precision", ["balanced", "fast"])
def test_k_quant_copies_read_fewer_bytes(wide_path, wide_sidecar, precision, tmp_path):
    """On experts of whole super-blocks the copies are 2.6 or 3.4 bits a
    weight against Q8_0's 8.5: balanced and fast read far fewer bytes than
    exact at the same budget, whose output stays the unlimited engine's."""
    qtype, path = wide_sidecar
    model = tmp_path / "w.gguf"
    os.symlink(wide_path, model)
    shutil.copyfile(path, moe.sidecar_path(model))
    with backend(model) as b:
        want = prompt_then_steps(b, n_prompt=16, n_steps=24)
    with backend(model, moe.ExpertCache(3, prefetch=0)) as b:
        exact = prompt_then_steps(b, n_prompt=16, n_steps=24)
        exact_st = b.expert_stats()
    assert np.array_equal(exact, want)
    with backend(model, moe.ExpertCache(3, precision, prefetch=0)) as b:
        got = prompt_then_steps(b, n_prompt=16, n_steps=24)
        st = b.expert_stats()
    assert st["substitutions"] > 0 and np.isfinite(got).all()
    ratio = st["bytes_read"] / exact_st["bytes_read"]
    assert ratio < {"balanced": 0.9, "fast": 0.6}[precision], ratio
    assert (got.argmax(axis=1) == exact.argmax(axis=1)).mean() >= 0.5


def copy_model(src, dst):
    shutil.copyfile(src, dst)
    return dst


def test_mismatched_sidecar_is_refused(moe_dir, tiny_vocab_path, synth_path, sidecar):
    other = moe_tools.synth(moe_dir / "other.gguf", tiny_vocab_path, **{**SYNTH, "experts": 4}, progress=False)
    shutil.copyfile(sidecar, moe.sidecar_path(other))
    with pytest.raises(ModelFormatError, match="made for another model: experts 8, this model has 4"):
        Engine(other, backend="native", expert_cache_mb=2, expert_precision="balanced")
    # Same shapes and metadata, other weights: the routers' checksums differ.
    same_shape = moe_tools.synth(moe_dir / "same-shape.gguf", tiny_vocab_path, **SYNTH, seed=5, progress=False)
    assert os.path.getsize(same_shape) == os.path.getsize(synth_path)
    shutil.copyfile(sidecar, moe.sidecar_path(same_shape))
    # both checksums named: the sidecar's model's (header offset 48) and this one's
    own = moe_tools.prepare(same_shape, moe_dir / "same-shape.own", progress=False)
    want, got = (int.from_bytes(p.read_bytes()[48:56], "little") for p in (sidecar, own))
    with pytest.raises(ModelFormatError, match=f"checksum {want:016x} of its model's metadata and "
                                               f"routers, this model's {got:016x}"):
        Engine(same_shape, backend="native", expert_cache_mb=2, expert_precision="balanced")


def test_damaged_sidecar(moe_dir, synth_path, sidecar):
    model = copy_model(synth_path, moe_dir / "damaged.gguf")
    side = moe.sidecar_path(model)
    data = bytearray(sidecar.read_bytes())
    side.write_bytes(bytes(data[:-100]))
    with pytest.raises(ModelFormatError, match="truncated"):
        Engine(model, backend="native", expert_cache_mb=2, expert_precision="balanced")
    bad = bytearray(data)
    bad[8] = 1                                # a version 1 sidecar (Q4_0 copies)
    side.write_bytes(bytes(bad))
    with pytest.raises(ModelFormatError, match="version 1 is not supported"):
        Engine(model, backend="native", expert_cache_mb=2, expert_precision="balanced")
    bad = bytearray(data)
    bad[20] ^= 1                              # the header's expert count
    side.write_bytes(bytes(bad))
    with pytest.raises(ModelFormatError, match="header fails its checksum"):
        Engine(model, backend="native", expert_cache_mb=2, expert_precision="balanced")
    bad = bytearray(data)
    start = int.from_bytes(data[64:72], "little")
    stride = int.from_bytes(data[56:64], "little")
    for i in range(len(bad[start:]) // stride):
        bad[start + i * stride + 5] ^= 0xFF   # every copy
    side.write_bytes(bytes(bad))
    with Engine(model, backend="native", expert_cache_mb=1, expert_precision="fast") as e:
        with pytest.raises(BackendError, match="fails its checksum"):
            e.generate("hello there", max_tokens=8)


def test_model_changed_on_disk(moe_dir, synth_path):
    model = copy_model(synth_path, moe_dir / "changing.gguf")
    with backend(model, moe.ExpertCache(1)) as b:
        prompt_then_steps(b, n_steps=2)
        st = os.stat(model)
        os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        with pytest.raises(BackendError, match="changed on disk"):
            prompt_then_steps(b, seed=1)


# ---- memory ------------------------------------------------------------------------------

PEAK_RSS = textwrap.dedent("""
    import json, sys
    import numpy as np
    from edgespec import moe
    from edgespec.backends import open_backend

    def hwm_kib():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])

    path, mb = sys.argv[1], int(sys.argv[2])
    experts = moe.ExpertCache(mb) if mb else None
    with open("/proc/self/clear_refs", "w") as f:   # the peak so far (imports) is forgotten
        f.write("5")
    before = hwm_kib()
    with open_backend("native", path, n_ctx=256, n_batch=64, threads=2, experts=experts) as b:
        tokens = np.random.default_rng(0).integers(0, b.n_vocab, 96).tolist()
        b.decode(tokens[:64], logits_from=63)
        for t in tokens[64:]:
            b.decode([t], logits_from=0)
        st = b.expert_stats()
        peak = hwm_kib()
    print(json.dumps({"before_kib": before, "peak_kib": peak, "stats": st}))
""")


def peak_rss(path, mb: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.run([sys.executable, "-c", PEAK_RSS, str(path), str(mb)], capture_output=True,
                       text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_peak_rss_stays_within_the_budget(moe_dir, tiny_vocab_path):
    """53 MB of experts, an 8 MB cache: the process grows by the cache and
    the non-expert weights, not the experts (which the mapped engine reads
    into memory)."""
    path = moe_tools.synth(moe_dir / "rss.gguf", tiny_vocab_path, experts=16, top_k=2, layers=4, embd=256,
                     ff=1024, qtype="q8_0", progress=False)
    experts_mb = 16 * 4 * 3 * 1024 * 256 * 34 / 32 / 1e6
    mapped, cached = peak_rss(path, 0), peak_rss(path, 8)
    assert cached["stats"]["cache_bytes"] <= 8_000_000
    assert cached["stats"]["loads"] > cached["stats"]["n_slots"]   # it had to evict
    grown_mapped = (mapped["peak_kib"] - mapped["before_kib"]) / 1000
    grown_cached = (cached["peak_kib"] - cached["before_kib"]) / 1000
    print(f"\npeak RSS growth: mapped {grown_mapped:.1f} MB, 8 MB cache {grown_cached:.1f} MB "
          f"({experts_mb:.1f} MB of experts)")
    assert grown_mapped > experts_mb * 0.9
    others = grown_mapped - experts_mb      # non-expert weights, KV cache, vocabulary, scratch
    assert grown_cached < others + 8 + 6    # those, the 8 MB cache and a little slack


# ---- upcycle and synth ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dense_f32(moe_dir, tiny_vocab_path):
    path = moe_dir / "dense-f32.gguf"
    write_tiny_llama(path, tiny_vocab_path, n_ctx=N_CTX, dtype=Q.F32)
    return path


@pytest.mark.parametrize("top_k", [1, 2])
def test_upcycled_model_computes_the_dense_one(moe_dir, dense_f32, top_k):
    out = moe_tools.upcycle(dense_f32, moe_dir / f"upcycled-{top_k}.gguf", experts=4, top_k=top_k,
                      progress=False)
    with backend(dense_f32) as b:
        want = prompt_then_steps(b)
    with backend(out) as b:
        got = prompt_then_steps(b)
        assert b.metadata("llama.expert_count") == "4"
    with backend(out, moe.ExpertCache(1)) as b:
        cached = prompt_then_steps(b)
    assert np.array_equal(cached, got)
    if top_k == 1:     # one expert of weight exactly 1: the dense FFN bit for bit
        assert np.array_equal(got, want)
    else:              # weights that sum to 1 within a rounding
        assert np.abs(got - want).max() < 1e-3
        assert (got.argmax(axis=1) == want.argmax(axis=1)).all()


def test_upcycled_qwen2_computes_the_dense_one(moe_dir, tiny_vocab_path):
    """A qwen2 model becomes a llama one: biases kept, query and key rows
    reordered for llama's RoPE pairs. The same scores summed in another
    order: equal within rounding, on both engines."""
    dense = moe_dir / "dense-qwen2.gguf"
    write_tiny_qwen2(dense, tiny_vocab_path, n_ctx=N_CTX, dtype=Q.F32)
    up = moe_tools.upcycle(dense, moe_dir / "upcycled-qwen2.gguf", experts=4, top_k=1, progress=False)
    for name in ("native", "llama"):
        with open_backend(name, dense, n_ctx=N_CTX, n_batch=64, threads=1) as b:
            want = logits(b, list(range(1, 65)), chunk=64)
        with open_backend(name, up, n_ctx=N_CTX, n_batch=64, threads=1) as b:
            assert b.metadata("general.architecture") == "llama"
            got = logits(b, list(range(1, 65)), chunk=64)
        assert np.abs(got - want).max() < 1e-3, name


def test_llama_cpp_loads_upcycled_and_synthetic(moe_dir, dense_f32, synth_path):
    up = moe_tools.upcycle(dense_f32, moe_dir / "upcycled-llama.gguf", experts=4, top_k=1, progress=False)
    with open_backend("llama", dense_f32, n_ctx=N_CTX, n_batch=64, threads=1) as b:
        want = logits(b, list(range(1, 65)), chunk=64)
    with open_backend("llama", up, n_ctx=N_CTX, n_batch=64, threads=1) as b:
        got = logits(b, list(range(1, 65)), chunk=64)
    assert np.abs(got - want).max() < 1e-3
    with open_backend("llama", synth_path, n_ctx=N_CTX, n_batch=64, threads=1) as b:
        ref = logits(b, list(range(1, 65)), chunk=64)
        assert int(b.metadata("llama.expert_count")) == 8
    with backend(synth_path) as b:
        ours = logits(b, list(range(1, 65)), chunk=64)
    assert np.isfinite(ref).all()
    assert (ours.argmax(axis=1) == ref.argmax(axis=1)).mean() >= 0.9


@pytest.mark.parametrize("arch", moe_tools.SYNTH_ARCHS)
def test_synth_layouts_decode_alike_on_both_engines(moe_dir, tiny_vocab_path, arch):
    """Each layout `moe synth` writes loads in llama.cpp and the native
    engine (through an expert cache too) with the same greedy text (F32
    weights: no activation rounding between the two)."""
    path = moe_tools.synth(moe_dir / f"synth-{arch}.gguf", tiny_vocab_path, experts=8, top_k=2, layers=2,
                     embd=128, ff=64, qtype="f32", arch=arch, progress=False)
    texts = []
    for name, kw in (("llama", {}), ("native", {}), ("native", dict(expert_cache_mb=1))):
        with Engine(path, backend=name, threads=1, n_ctx=N_CTX, drafter="none", **kw) as e:
            assert e.backend.metadata("general.architecture") == arch
            texts.append(e.generate("the cat sat on", max_tokens=24, temperature=0.0).tokens)
    assert texts[0] == texts[1] == texts[2]


def test_upcycle_and_prepare_refuse(moe_dir, dense_f32, synth_path, tiny_vocab_path):
    with pytest.raises(UnsupportedModelError, match="not a MoE model"):
        moe_tools.prepare(dense_f32, moe_dir / "x.sidecar", progress=False)
    with pytest.raises(InvalidArgumentError, match="already a MoE model"):
        moe_tools.upcycle(synth_path, moe_dir / "x.gguf", experts=2, progress=False)
    with pytest.raises(InvalidArgumentError, match="--arch must be one of llama, qwen3moe"):
        moe_tools.synth(moe_dir / "x.gguf", tiny_vocab_path, experts=2, top_k=1, layers=1, embd=64, ff=64,
                  arch="olmoe", progress=False)
    with pytest.raises(InvalidArgumentError, match=r"--top-k must be in \[1, --experts\]"):
        moe_tools.upcycle(dense_f32, moe_dir / "x.gguf", experts=2, top_k=3, progress=False)
    assert not (moe_dir / "x.gguf").exists() and not (moe_dir / "x.sidecar").exists()


def test_upcycled_smollm2_matches_dense(smollm2_path, tmp_path):
    """The upcycled built-in model greedy-decodes as the dense one (top 1:
    bit for bit), through a cache smaller than its experts too."""
    up = moe_tools.upcycle(smollm2_path, tmp_path / "smollm2-moe.gguf", experts=2, top_k=1, progress=False)
    prompt = "Write a haiku about the sea."
    with Engine(smollm2_path, backend="native", threads=2, n_ctx=N_CTX) as e:
        want = e.generate(prompt, max_tokens=24).tokens
    with Engine(up, backend="native", threads=2, n_ctx=N_CTX, expert_cache_mb=60) as e:
        r = e.generate(prompt, max_tokens=24)
    assert r.tokens == want
    assert r.stats.experts["cache_bytes"] <= 60_000_000 and r.stats.experts["evictions"] > 0


def test_upcycled_qwen_coder_matches_dense(qwen_coder_05b_path, tmp_path):
    """Qwen2.5-coder upcycled (a llama MoE, its down matrices of two types
    as Q4_K_M gives them) greedy-decodes as the dense model on both engines."""
    up = moe_tools.upcycle(qwen_coder_05b_path, tmp_path / "qwen-moe.gguf", experts=2, top_k=1,
                     progress=False)
    prompt = "def fibonacci(n):"
    for name, kw in (("native", dict(expert_cache_mb=60)), ("llama", {})):
        with Engine(qwen_coder_05b_path, backend=name, threads=2, n_ctx=N_CTX, drafter="none") as e:
            want = e.generate(prompt, max_tokens=24).tokens
        with Engine(up, backend=name, threads=2, n_ctx=N_CTX, drafter="none", **kw) as e:
            assert e.generate(prompt, max_tokens=24).tokens == want, name


# ---- the command line -------------------------------------------------------------------------

def cli(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-m", "edgespec", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=300)


def test_cli_moe_commands(tmp_path, tiny_vocab_path):
    out = tmp_path / "cli.gguf"
    p = cli("moe", "synth", "--experts", 4, "--top-k", 2, "--layers", 2, "--embd", 64, "--ff", 64,
            "--type", "q8_0", "--tokenizer", tiny_vocab_path, "--out", out, "-q")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(out)
    p = cli("moe", "prepare", out, "-q")
    assert p.returncode == 0, p.stderr
    assert moe.sidecar_path(out).exists()
    p = cli("generate", "hello", "-n", 8, "--backend", "native", "-m", out, "--drafter", "none",
            "--expert-cache", 1, "--expert-precision", "balanced", "--json")
    assert p.returncode == 0, p.stderr
    x = json.loads(p.stdout.strip().splitlines()[-1])["experts"]
    assert x["cache_bytes"] <= 1_000_000 and x["lookups"] > 0
    p = cli("generate", "hello", "-n", 8, "--backend", "native", "-m", out, "--expert-cache", 1)
    assert p.returncode == 0, p.stderr
    assert "experts:" in p.stderr and "% hits" in p.stderr


@pytest.mark.parametrize("args,match", [
    (["generate", "hi", "--backend", "llama", "--expert-cache", 8], "needs the native backend"),
    (["generate", "hi", "--backend", "native", "--expert-cache", 8, "--expert-policy", "mru"],
     "available: adaptive, lru"),
    (["moe", "synth", "--layers", 1, "--embd", 100, "--ff", 64, "--out", "x.gguf"], "multiple of 32"),
])
def test_cli_bad_input(args, match, tmp_path):
    p = cli(*args)
    assert p.returncode == 2
    assert p.stderr.startswith("error: ") and match in p.stderr
