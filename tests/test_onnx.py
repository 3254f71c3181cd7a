"""ONNX export and the onnxruntime backend: GGUF blocks mapped exactly, logits
and greedy output against the llama backend, speculative decoding on it (also
with the draft model and the target on different backends), static shapes,
and bad input."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import gguf
import numpy as np
import onnx
import pytest

from edgespec import Engine
from edgespec.onnx import export as onnx_export
from edgespec.backends import open_backend
from edgespec.errors import InvalidArgumentError, ModelFormatError

PARITY_PROMPTS = [  # (prompt, chat)
    ("1, 2, 3, 4, 5, 6, 7, 8,", False),
    ("Repeat this list exactly: apples, pears, plums, cherries, apples, pears, plums, cherries,", False),
    ("1, 2, 3, 4, 5, 6, 7, 8,", True),
]
OPEN_PROMPTS = [("The capital of France is", False), ("def fibonacci(n):\n", True),
                ("Write a short story about a robot who learns to paint.", True)]


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, smollm2_path):
    """smollm2-135m (Q4_1) exported once as int4 (about 10 s on 2 cores)."""
    return onnx_export.export(smollm2_path, tmp_path_factory.mktemp("onnx") / "smollm2-int4",
                              weights="int4", progress=False)


@pytest.fixture(scope="module")
def static_export_dir(tmp_path_factory, smollm2_path):
    """The same model exported with --static-shapes."""
    return onnx_export.export(smollm2_path, tmp_path_factory.mktemp("onnx") / "smollm2-static",
                              static_shapes=True, progress=False)


@pytest.fixture(scope="module")
def llama_engine(smollm2_path):
    with Engine(str(smollm2_path), backend="llama", threads=2, n_ctx=1024) as engine:
        yield engine


@pytest.fixture(scope="module")
def onnx_engine(export_dir):
    with Engine(str(export_dir), backend="onnx", threads=2, n_ctx=1024) as engine:
        yield engine


def _rows(address: int, n: int, n_vocab: int) -> np.ndarray:
    return np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctypes.c_float)), shape=(n, n_vocab)).copy()


# -- weights: GGUF blocks -> MatMulNBits blocks ---------------------------------


def _unpack(w: onnx_export.NBits) -> np.ndarray:
    """MatMulNBits blocks back to (N, K) floats (element 2i: low nibble of byte i)."""
    if w.bits == 4:
        q = np.stack([w.blocks & 0x0F, w.blocks >> 4], axis=-1).reshape(*w.blocks.shape[:2], 32)
        zero = 0 if w.mins is not None else 8
    else:
        q, zero = w.blocks, 128
    vals = (q.astype(np.float32) - zero) * w.scales.reshape(q.shape[0], -1, 1)
    if w.mins is not None:
        vals = vals + w.mins[..., None]
    return vals.reshape(q.shape[0], -1)


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
                                   gguf.GGMLQuantizationType.Q8_0])
def test_gguf_blocks_map_exactly(qtype):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 96)).astype(np.float32)
    w[3, :32] = 0.25                       # a flat block: Q4_1 stores d = 0
    data = gguf.quants.quantize(w, qtype)
    ref = gguf.quants.dequantize(data, qtype).reshape(8, 96)
    mapped = {gguf.GGMLQuantizationType.Q4_0: onnx_export.q4_0_blocks,
              gguf.GGMLQuantizationType.Q4_1: onnx_export.q4_1_blocks,
              gguf.GGMLQuantizationType.Q8_0: onnx_export.q8_0_blocks}[qtype](data, 8, 96)
    np.testing.assert_allclose(_unpack(mapped), ref, rtol=0, atol=1e-6)


def test_requantize8_is_close():
    w = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    back = _unpack(onnx_export.requantize8(w))
    assert np.abs(back - w).max() <= np.abs(w).max() / 127


# -- every architecture, on tiny fixtures (fast tier) ---------------------------

TINY = {"llama": "tiny_llama_path", "qwen2": "tiny_qwen2_path", "gemma3": "tiny_gemma3_path"}
TINY_PROMPT = "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"


@pytest.fixture(scope="module")
def tiny_exports(request, tmp_path_factory):
    """arch -> (GGUF, its fp32 export), exported once per module."""
    made = {}

    def get(arch):
        if arch not in made:
            gguf_path = request.getfixturevalue(TINY[arch])
            made[arch] = (gguf_path, onnx_export.export(gguf_path, tmp_path_factory.mktemp("onnx") / arch,
                                                        weights="fp32", progress=False))
        return made[arch]
    return get


@pytest.mark.parametrize("arch", list(TINY))
def test_every_architecture_matches_the_native_engine(tiny_exports, arch):
    """A prompt, a step of several tokens after it and a draft tree: the same
    logits as the native engine (which keeps F16 weights and an F16 cache,
    hence the tolerance) and the same argmax."""
    gguf_path, folder = tiny_exports(arch)
    native = open_backend("native", gguf_path, n_ctx=256, threads=1)
    backend = open_backend("onnx", folder, n_ctx=256, threads=1)
    try:
        v = native.n_vocab
        tokens = native.tokenize(TINY_PROMPT)
        if arch == "gemma3":  # the prompt outruns layer 0's window
            assert len(tokens) > onnx_export.load_export(folder)["config"]["n_swa"]
        n = len(tokens)
        pairs = [(_rows(native.decode(tokens, logits_from=0), n, v), _rows(backend.decode(tokens, logits_from=0), n, v)),
                 (_rows(native.decode(tokens[:5], logits_from=0), 5, v),
                  _rows(backend.decode(tokens[:5], logits_from=0), 5, v))]
        for be in (native, backend):
            be.truncate(10)
        tree = ([tokens[10]], [5, 6, 7], [-1, 0, -1], [1, 2, 1])
        pairs.append((_rows(native.decode_tree(*tree), 4, v), _rows(backend.decode_tree(*tree), 4, v)))
        for ref, got in pairs:
            assert np.abs(ref - got).max() < 0.05
            assert (ref.argmax(-1) == got.argmax(-1)).all()
    finally:
        native.close()
        backend.close()


def test_gemma3_window_is_applied(tiny_exports):
    """Without its sliding window (every slot treated as near) the gemma3 graph
    parts from the native engine: the window, not luck, makes the parity above."""
    gguf_path, folder = tiny_exports("gemma3")
    native = open_backend("native", gguf_path, n_ctx=256, threads=1)
    backend = open_backend("onnx", folder, n_ctx=256, threads=1)
    try:
        tokens = native.tokenize(TINY_PROMPT)
        n, v = len(tokens), native.n_vocab
        ref = _rows(native.decode(tokens, logits_from=0), n, v)
        backend._n_swa = 1 << 30
        got = _rows(backend.decode(tokens, logits_from=0), n, v)
        assert np.abs(ref - got).max() > 0.5
    finally:
        native.close()
        backend.close()


def _cache(backend) -> list[np.ndarray]:
    return [a.copy() for a in backend._cache]


def test_cache_is_written_in_place_only_at_the_new_rows(tiny_onnx_dir):
    """The KV cache stays in the buffers bound to the session: a step writes its
    own slot (and the slot after it, which takes the graph's copy of the last
    row and is written again by the next step) and nothing else; a rollback
    moves nothing, and evaluating the same tokens again gives the same logits."""
    backend = open_backend("onnx", tiny_onnx_dir, n_ctx=64, threads=1)
    try:
        addresses = [a.ctypes.data for a in backend._cache]
        tokens = backend.tokenize(TINY_PROMPT)[:20]
        v = backend.n_vocab
        backend.decode(tokens[:12])
        before = _cache(backend)
        first = _rows(backend.decode(tokens[12:15], logits_from=0), 3, v)
        after = _cache(backend)
        for a, b in zip(before, after):
            changed = np.flatnonzero((a != b).any(axis=(0, 1, 3)))
            assert changed.min() == 12 and changed.max() <= 15
        backend.truncate(12)
        assert _cache(backend)[0].tobytes() == after[0].tobytes()  # nothing moved
        again = _rows(backend.decode(tokens[12:15], logits_from=0), 3, v)
        assert np.array_equal(first, again)
        assert [a.ctypes.data for a in backend._cache] == addresses
    finally:
        backend.close()


@pytest.mark.parametrize("arch", list(TINY))
def test_static_shapes_pad_calls_and_match_the_dynamic_graph(tiny_exports, tmp_path, arch):
    """--static-shapes: every input and output has fixed dimensions, calls are
    padded to the fixed width (two calls for a longer prompt), draft trees go
    through the same mask, and the logits are the dynamic graph's (float16
    cache against float32: a tolerance)."""
    gguf_path, dynamic_dir = tiny_exports(arch)
    folder = onnx_export.export(gguf_path, tmp_path / "static", weights="fp32", static_shapes=True,
                                cache_len=64, progress=False)
    model = onnx.load(str(folder / "model.onnx"))
    for value in list(model.graph.input) + list(model.graph.output):
        assert all(d.HasField("dim_value") for d in value.type.tensor_type.shape.dim), value.name
    static = open_backend("onnx", folder, threads=1)
    dynamic = open_backend("onnx", dynamic_dir, n_ctx=256, threads=1)
    try:
        assert static.n_ctx == 64 - onnx_export.STATIC_SEQ
        tokens = dynamic.tokenize(TINY_PROMPT)[:24]
        assert len(tokens) > onnx_export.STATIC_SEQ
        n, v = len(tokens), dynamic.n_vocab
        a = _rows(dynamic.decode(tokens, logits_from=0), n, v)
        b = _rows(static.decode(tokens, logits_from=0), n, v)
        np.testing.assert_allclose(a, b, atol=0.02)
        for be in (static, dynamic):
            be.truncate(10)
        tree = ([tokens[10]], [5, 6, 7], [-1, 0, -1], [1, 2, 1])
        np.testing.assert_allclose(_rows(dynamic.decode_tree(*tree), 4, v), _rows(static.decode_tree(*tree), 4, v),
                                   atol=0.02)
    finally:
        static.close()
        dynamic.close()


def _tiny_q4_1(tmp_path, tiny_vocab_path, arch: str):
    """A tiny random model of ``arch`` in Q4_1 blocks (4-bit MatMulNBits once exported)."""
    import tiny_gguf

    gguf_path = tmp_path / f"{arch}-q4_1.gguf"
    write = {"llama": tiny_gguf.write_tiny_llama, "qwen2": tiny_gguf.write_tiny_qwen2,
             "gemma3": tiny_gguf.write_tiny_gemma3}[arch]
    write(gguf_path, tiny_vocab_path, dtype=tiny_gguf.Q.Q4_1)
    return gguf_path


@pytest.mark.parametrize("arch", list(TINY))
def test_tiny_logits_do_not_depend_on_the_call(tmp_path, tiny_vocab_path, arch):
    """The row invariance exact speculation rests on, on 4-bit blocks (MatMulNBits,
    whose one-row and several-row kernels round differently) and on the window
    and global layers: a token's logits are bit-identical alone, in a k-row
    call and as a one-path tree (a tree with siblings is not: see
    OnnxBackend.exact_trees)."""
    folder = onnx_export.export(_tiny_q4_1(tmp_path, tiny_vocab_path, arch), tmp_path / "int4", weights="int4",
                                progress=False)
    assert any(n.op_type == "MatMulNBits" for n in onnx.load(str(folder / "model.onnx")).graph.node)
    backend = open_backend("onnx", folder, n_ctx=128, threads=1)
    try:
        _check_row_invariance(backend)
    finally:
        backend.close()


@pytest.mark.parametrize("arch", list(TINY))
def test_static_call_size_is_the_shape_of_every_call(tmp_path, tiny_vocab_path, arch):
    """--call-size 4: a static int4 graph whose inputs take 4 tokens, a context
    4 slots short of the cache, and exact row invariance through it: plain
    steps, verifications of 2-8 tokens (two calls past 4) and a one-path tree
    give every token the same logits bit for bit."""
    folder = onnx_export.export(_tiny_q4_1(tmp_path, tiny_vocab_path, arch), tmp_path / "static4", weights="int4",
                                static_shapes=True, call_size=4, cache_len=64, progress=False)
    inputs = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim]
              for i in onnx.load(str(folder / "model.onnx")).graph.input}
    assert inputs["input_ids"] == [1, 4] and inputs["cache_slots"] == [4]
    assert inputs["attention_bias"] == [1, 1, 4, 64]
    backend = open_backend("onnx", folder, threads=1)
    try:
        assert backend.n_ctx == 60
        _check_row_invariance(backend)
    finally:
        backend.close()


def _check_row_invariance(backend) -> None:
    v = backend.n_vocab
    prompt = backend.tokenize("The capital of France is Paris, and the capital of")
    following = backend.tokenize(" Germany is Berlin. The capital of Italy is Rome.")[:8]
    n = len(prompt)
    backend.decode(prompt)
    alone = np.concatenate([_rows(backend.decode([t]), 1, v) for t in following])
    for k in range(2, len(following) + 1):
        backend.truncate(n)
        rows = _rows(backend.decode(following[:k], logits_from=0), k, v)
        assert np.array_equal(rows, alone[:k]), f"{k} rows: max |diff| {np.abs(rows - alone[:k]).max()}"
    backend.truncate(n)  # a one-path tree is a chain: no holes, the same rows
    rows = _rows(backend.decode_tree([following[0]], following[1:3], [-1, 0], [1, 2]), 3, v)
    assert np.array_equal(rows, alone[:3])


def test_first_path_of_a_tree():
    from edgespec.drafters import Draft

    tree = Draft(tokens=[10, 11, 12, 13, 14], parents=[-1, -1, 0, 0, 2], source="recycle")
    chain = tree.first_path()
    assert chain.tokens == [10, 12, 14] and chain.parents is None and chain.source == "recycle"
    assert Draft(tokens=[1, 2]).first_path().tokens == [1, 2]


def test_tree_drafts_are_verified_as_chains(tiny_onnx_dir, monkeypatch):
    """On the onnx backend the recycling drafter's trees become their first
    paths: no tree call reaches the backend, drafts are made, and the output is
    plain decoding's."""
    from edgespec.backends.onnx import OnnxBackend

    trees = []
    original = OnnxBackend.decode_tree
    monkeypatch.setattr(OnnxBackend, "decode_tree", lambda self, *a: trees.append(a) or original(self, *a))
    prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3,"
    with Engine(str(tiny_onnx_dir), backend="onnx", threads=1, n_ctx=256) as engine:
        plain = engine.generate(prompt, max_tokens=24, drafter="none")
        spec = engine.generate(prompt, max_tokens=24, drafter="recycle")
    assert spec.tokens == plain.tokens
    assert spec.stats.spec.drafted > 0 and trees == []


# -- the OpenVINO provider (its own virtualenv: the package replaces onnxruntime's module) --


def _openvino_python() -> str:
    """The interpreter .ci/run installs onnxruntime-openvino into; the tests skip
    only when that install failed (EDGESPEC_OPENVINO_SKIP holds pip's reason)
    or no such interpreter is named here."""
    reason = os.environ.get("EDGESPEC_OPENVINO_SKIP")
    if reason:
        pytest.skip(f"onnxruntime-openvino could not be installed: {reason}")
    python = os.environ.get("EDGESPEC_OPENVINO_PYTHON")
    if not python:
        pytest.skip("EDGESPEC_OPENVINO_PYTHON names no interpreter with onnxruntime-openvino "
                    "(.ci/run makes one)")
    return python


def _generate(python: str, folder, ep: str) -> dict:
    proc = subprocess.run([python, "-m", "edgespec", "generate", TINY_PROMPT[:20], "--backend", "onnx",
                           "--model", str(folder), "--ep", ep, "-n", "16", "--drafter", "none", "--threads", "1",
                           "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("shapes", ["dynamic", "static"])
@pytest.mark.parametrize("arch", list(TINY))
def test_openvino_greedy_output_equals_the_cpu_provider(tiny_exports, tmp_path, arch, shapes):
    """The same float graph on OpenVINO's CPU device and on ONNX Runtime's CPU
    provider: the same greedy text (8-bit blocks are not compared: the CPU
    provider quantizes activations to int8 for them, OpenVINO does not); a
    static graph runs wholly on OpenVINO."""
    python = _openvino_python()
    gguf_path, folder = tiny_exports(arch)
    if shapes == "static":
        for weights in ("int4", "fp32"):  # MatMulNBits blocks and float matrices alike
            folder = onnx_export.export(gguf_path, tmp_path / weights, weights=weights, static_shapes=True,
                                        cache_len=64, progress=False)
            proc = subprocess.run([python, "-m", "edgespec", "onnx-placement", str(folder), "--ep", "openvino"],
                                  capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr
            assert "(100.0%) on OpenVINOExecutionProvider" in proc.stdout, proc.stdout
    else:  # OpenVINO has no GroupQueryAttention: each one is named, left to the CPU
        proc = subprocess.run([python, "-m", "edgespec", "onnx-placement", str(folder), "--ep", "openvino"],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        left = [line for line in proc.stdout.splitlines() if line.startswith("  on the CPU: ")]
        assert sum("(GroupQueryAttention)" in line for line in left) == 2, proc.stdout
    cpu = _generate(sys.executable, folder, "cpu")
    assert cpu["n_tokens"] == 16
    assert _generate(python, folder, "openvino")["text"] == cpu["text"]


def test_openvino_device_that_is_missing_is_one_line(tiny_onnx_dir):
    python = _openvino_python()
    devices = subprocess.run([python, "-c", "import onnxruntime.capi._pybind_state as s; "
                              "print(' '.join(s.get_available_openvino_device_ids()))"],
                             capture_output=True, text=True, timeout=600).stdout.split()
    missing = next((d for d in ("NPU", "GPU") if d not in devices), None)
    if missing is None:
        pytest.skip(f"this machine has every OpenVINO device ({', '.join(devices)})")
    for ep, message in ((f"openvino:{missing}", f"is installed but could not open its device {missing}"),
                        ("openvino:TPU", "unknown OpenVINO device 'TPU'")):
        proc = subprocess.run([python, "-m", "edgespec", "generate", "hi", "--backend", "onnx", "--model",
                               str(tiny_onnx_dir), "--ep", ep, "-n", "2"], capture_output=True, text=True, timeout=600)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr


# -- the exported folder --------------------------------------------------------


def test_export_is_a_checked_graph_with_contrib_ops(export_dir, smollm2_path):
    meta = onnx_export.load_export(export_dir)
    assert meta["weights"] == "int4" and meta["static"] is None
    assert meta["source"]["gguf"] == str(smollm2_path.resolve())
    assert meta["config"]["n_layer"] == 30 and meta["config"]["n_vocab"] == 49152
    model = onnx.load(str(export_dir / "model.onnx"))
    onnx.checker.check_model(model)
    ops = {n.op_type for n in model.graph.node}
    assert {"MatMulNBits", "GroupQueryAttention", "SkipSimplifiedLayerNormalization"} <= ops
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    bits = {a.i for n in nbits for a in n.attribute if a.name == "bits"}
    assert bits == {4, 8}  # Q4_1 layers in 4 bits, the Q8_0 output matrix in 8
    names = [i.name for i in model.graph.input]
    assert names[:4] == ["input_ids", "position_ids", "attention_bias", "logits_rows"]
    assert "past.29.value" in names and "present.0.key" in [o.name for o in model.graph.output]


def test_interrupted_export_leaves_nothing(tmp_path, smollm2_path, monkeypatch):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(onnx, "save_model", interrupt)
    with pytest.raises(KeyboardInterrupt):
        onnx_export.export(smollm2_path, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_a_killed_exports_folder_is_removed_by_the_next_export(tmp_path, tiny_llama_path):
    import fcntl
    import os
    import signal
    import subprocess
    import sys
    import time

    # An export killed (-9) while it writes: its .part folder stays, locked by nobody.
    script = ("import sys, time, onnx; onnx.save_model = lambda *a, **k: time.sleep(600); "
              "from edgespec.onnx import export as onnx_export; "
              "onnx_export.export(sys.argv[1], sys.argv[2], weights='fp32', progress=False)")
    proc = subprocess.Popen([sys.executable, "-c", script, str(tiny_llama_path), str(tmp_path / "out")])
    try:
        while not list(tmp_path.glob(".out.*.part/" + onnx_export.EXPORT_LOCK)):
            assert proc.poll() is None
            time.sleep(0.05)
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    killed = next(tmp_path.glob(".out.*.part"))
    # One whose export still runs (its lock held) and one that is no export's stay.
    running = tmp_path / ".other.x1.part"
    running.mkdir()
    fd = os.open(running / onnx_export.EXPORT_LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    foreign = tmp_path / ".notes.part"
    foreign.mkdir()
    try:
        onnx_export.export(tiny_llama_path, tmp_path / "out2", weights="fp32", progress=False)
        assert not killed.exists() and running.exists() and foreign.exists()
        assert sorted(p.name for p in (tmp_path / "out2").iterdir()) == ["edgespec-onnx.json", "model.onnx"]
    finally:
        os.close(fd)


def test_model_name_is_exported_once_into_the_cache(tmp_path, smollm2_path, export_dir, monkeypatch):
    from edgespec.models import resolve_model

    calls = []

    def fake_export(gguf_path, out_dir, **kwargs):  # copy the session's export instead of redoing it
        calls.append(out_dir)
        import shutil
        shutil.copytree(export_dir, out_dir)
        return out_dir
    monkeypatch.setattr(onnx_export, "cache_dir", lambda: tmp_path / "onnx")
    monkeypatch.setattr(onnx_export, "export", fake_export)
    first = resolve_model("onnx", str(smollm2_path))
    second = resolve_model("onnx", str(smollm2_path))
    assert first == second == tmp_path / "onnx" / f"{smollm2_path.stem}-int4"
    assert len(calls) == 1


# -- parity with the llama backend ---------------------------------------------


def test_logits_agree_with_llama(llama_engine, export_dir):
    """Teacher-forced on llama's greedy text: the top-1 token agrees wherever
    llama.cpp's own top-2 margin is clear (over 1). (Bit-equality is out of reach:
    llama.cpp's quantized dot products make its output jump on ulp-level
    differences, e.g. in its approximate SiLU, and its flash attention
    accumulates in float16. The export no longer emulates llama.cpp's
    activation rounding, which cost a dozen operators per product: an rms
    difference of about 0.9 in smollm2's logits.)"""
    backend = open_backend("onnx", export_dir, n_ctx=1024, threads=2)
    target = llama_engine.backend
    n_vocab = target.n_vocab
    agree = total = 0
    try:
        for prompt, chat in PARITY_PROMPTS + OPEN_PROMPTS:
            result = llama_engine.generate(prompt, chat=chat, max_tokens=32, drafter="none")
            prompt_tokens = llama_engine.prompt_tokens(None if chat else prompt,
                                                        [{"role": "user", "content": prompt}] if chat else None)
            seq = prompt_tokens + result.tokens
            n = len(result.tokens) + 1
            target.clear()
            ref = _rows(target.decode(seq, logits_from=len(prompt_tokens) - 1), n, n_vocab)
            backend.clear()
            got = _rows(backend.decode(seq, logits_from=len(prompt_tokens) - 1), n, n_vocab)
            top2 = np.sort(ref, axis=-1)[:, -2:]
            clear = top2[:, 1] - top2[:, 0] > 1.0
            same = ref.argmax(-1) == got.argmax(-1)
            assert same[clear].all(), f"{prompt!r}: top-1 differs where llama's margin is clear"
            assert np.sqrt(((ref - got) ** 2).mean()) < 1.5
            agree += same.sum()
            total += n
    finally:
        backend.close()
    assert agree / total > 0.9


@pytest.mark.parametrize("prompt,chat", PARITY_PROMPTS)
def test_greedy_output_equals_llama(llama_engine, onnx_engine, prompt, chat):
    ref = llama_engine.generate(prompt, chat=chat, max_tokens=40, drafter="none")
    got = onnx_engine.generate(prompt, chat=chat, max_tokens=40, drafter="none")
    assert len(ref.tokens) >= 32
    assert got.tokens == ref.tokens


# -- speculative decoding on it -----------------------------------------------


@pytest.mark.models  # its exports (of smollm2) are fetched by name, which conftest cannot see
@pytest.mark.parametrize("shapes", ["dynamic", "static"])
def test_a_token_s_logits_do_not_depend_on_its_call(request, shapes):
    """What exact speculation rests on, checked on this machine's kernels: a
    token's logits are bit-identical whether it is evaluated alone (a plain
    step) or as row i of a k-row call (a verification batch)."""
    folder = request.getfixturevalue("export_dir" if shapes == "dynamic" else "static_export_dir")
    backend = open_backend("onnx", folder, n_ctx=256, threads=2)
    try:
        _check_row_invariance(backend)
    finally:
        backend.close()


@pytest.mark.parametrize("drafter", ["ngram", "recycle"])
def test_speculation_on_onnx_is_exact(onnx_engine, drafter):
    for prompt, chat in PARITY_PROMPTS[1:2] + OPEN_PROMPTS[:1]:
        plain = onnx_engine.generate(prompt, chat=chat, max_tokens=32, drafter="none")
        spec = onnx_engine.generate(prompt, chat=chat, max_tokens=32, drafter=drafter)
        assert spec.tokens == plain.tokens
        assert spec.stats.spec.drafted > 0
        if (prompt, chat) in PARITY_PROMPTS:  # the list to copy: drafts are made, and some kept
            assert spec.stats.spec.accepted > 0
            assert spec.stats.spec.target_steps < len(spec.tokens)


def test_draft_model_on_onnx_target_on_llama(smollm2_path, export_dir, llama_engine):
    prompt = PARITY_PROMPTS[1][0]
    plain = llama_engine.generate(prompt, max_tokens=40, drafter="none")
    with Engine(str(smollm2_path), backend="llama", threads=2, n_ctx=1024, drafter="model", draft_model=str(export_dir),
                draft_backend="onnx", ep="cpu", draft_max=4) as engine:
        spec = engine.generate(prompt, max_tokens=40)
        assert engine.lanes[0].drafters["model"].backend.name == "onnx"
    assert spec.tokens == plain.tokens
    assert spec.stats.spec.accepted > 0.8 * spec.stats.spec.drafted  # the same model, other numerics


def test_draft_model_on_llama_target_on_onnx(smollm2_path, export_dir, onnx_engine):
    prompt = PARITY_PROMPTS[0][0]
    plain = onnx_engine.generate(prompt, max_tokens=40, drafter="none")
    with Engine(str(export_dir), backend="onnx", threads=2, n_ctx=1024, drafter="model",
                draft_model=str(smollm2_path), draft_backend="llama", draft_max=4) as engine:
        spec = engine.generate(prompt, max_tokens=40)
    assert spec.tokens == plain.tokens
    assert spec.stats.spec.accepted > 0


# -- static shapes ----------------------------------------------------------------


def test_static_shapes_export_runs_like_the_dynamic_one(static_export_dir, export_dir):
    """smollm2 with fixed shapes (float16 cache, plain-operator attention) against
    the dynamic graph (float32 cache, GroupQueryAttention): the same top-1 token
    wherever the dynamic graph's margin is clear, over two padded calls and a
    draft tree. MatMulNBits rounds activations to 8 bits per block, which turns
    the cache's float16 rounding into logit differences of rms 0.3-0.7 and up to
    3.5 (measured on AVX2 and AVX-512 CPUs, whose kernels differ; each graph is
    as far from llama.cpp's logits), so a clear margin is one above 2.5."""
    static = open_backend("onnx", static_export_dir, n_ctx=512, threads=2)
    dynamic = open_backend("onnx", export_dir, n_ctx=512, threads=2)
    try:
        tokens = dynamic.tokenize("The capital of France is Paris, and the capital of Germany is Berlin. "
                                  "The capital of Italy is")
        assert len(tokens) > onnx_export.STATIC_SEQ  # two padded calls
        n, v = len(tokens), dynamic.n_vocab
        pairs = [(_rows(dynamic.decode(tokens, logits_from=0), n, v), _rows(static.decode(tokens, logits_from=0), n, v))]
        for be in (static, dynamic):
            be.truncate(10)
        tree = ([tokens[10]], [5, 6, 7], [-1, 0, -1], [1, 2, 1])
        pairs.append((_rows(dynamic.decode_tree(*tree), 4, v), _rows(static.decode_tree(*tree), 4, v)))
        checked = 0
        for a, b in pairs:
            top2 = np.sort(a, axis=-1)[:, -2:]
            clear = top2[:, 1] - top2[:, 0] > 2.5
            assert (a.argmax(-1) == b.argmax(-1))[clear].all()
            checked += int(clear.sum())
            # a row's constant shift (up to 1.4 here) changes no probability: compare centred rows
            d = (a - a.mean(-1, keepdims=True)) - (b - b.mean(-1, keepdims=True))
            assert np.sqrt((d ** 2).mean()) < 1.0
        assert checked >= 3  # the top-1 check covers rows (7 of 24 on the CPUs measured)
    finally:
        static.close()
        dynamic.close()


# -- bad input ------------------------------------------------------------------


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "edgespec", *args], capture_output=True, text=True, timeout=300)


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, smollm2_path, export_dir):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cases = [
        (["export-onnx", str(smollm2_path), str(tmp_path / "a"), "--weights", "int3"], "unknown --weights 'int3'"),
        (["export-onnx", str(smollm2_path), str(tmp_path / "full")], "is not empty"),
        (["export-onnx", str(smollm2_path), str(tmp_path / "no" / "out")], "does not exist"),
        (["generate", "hi", "--backend", "onnx", "--model", str(tmp_path / "full")], "not an edgespec ONNX export"),
        (["generate", "hi", "--backend", "onnx", "--model", str(export_dir), "--ep", "npu"],
         "unknown execution provider 'npu' (known: cpu, cuda, qnn, openvino, dml, coreml)"),
        (["generate", "hi", "--backend", "onnx", "--model", str(export_dir), "--ep", "dml"], "available: cpu"),
        (["generate", "hi", "--model", str(smollm2_path), "--ep", "cpu"], "applies to the onnx backend"),
        (["generate", "hi", "--backend", "tpu"], "unknown backend 'tpu'"),
    ]
    for args, message in cases:
        proc = _cli(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (args, proc.stderr)
    assert not (tmp_path / "a").exists()


def test_tiny_bad_input_is_one_line_and_exit_2(tmp_path, tiny_llama_path, tiny_onnx_dir):
    cases = [
        (["export-onnx", str(tiny_llama_path), str(tmp_path / "a"), "--static-shapes", "--cache-len", "8"],
         "--cache-len must be 32 to 8192 (twice --call-size at least), got 8"),
        (["export-onnx", str(tiny_llama_path), str(tmp_path / "a"), "--static-shapes", "--call-size", "1"],
         "--call-size must be 2 to 64, got 1"),
        (["export-onnx", str(tiny_llama_path), str(tmp_path / "a"), "--static-shapes", "--call-size", "40",
          "--cache-len", "64"], "--cache-len must be 80 to 8192 (twice --call-size at least), got 64"),
        (["export-onnx", str(tiny_llama_path), str(tmp_path / "a"), "--call-size", "4"],
         "--call-size applies to --static-shapes (and --weights qdq) exports"),
        (["generate", "hi", "--backend", "onnx", "--model", str(tiny_onnx_dir), "--ep", "cpu:NPU"],
         "a device is chosen for openvino only"),
        (["onnx-placement", str(tmp_path)], "not an edgespec ONNX export"),
    ]
    for args, message in cases:
        proc = _cli(*args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], (args, proc.stderr)


def test_static_graph_of_another_call_shape_is_refused(tmp_path, tiny_llama_path):
    """A static export whose model.onnx was made for another cache length or
    call size than its config says is refused, naming both shapes."""
    small = onnx_export.export(tiny_llama_path, tmp_path / "small", weights="fp32", static_shapes=True,
                               cache_len=64, progress=False)
    large = onnx_export.export(tiny_llama_path, tmp_path / "large", weights="fp32", static_shapes=True,
                               cache_len=128, progress=False)
    narrow = onnx_export.export(tiny_llama_path, tmp_path / "narrow", weights="fp32", static_shapes=True,
                                cache_len=64, call_size=4, progress=False)
    (small / "model.onnx").replace(tmp_path / "small.onnx")
    (large / "model.onnx").replace(small / "model.onnx")
    with pytest.raises(ModelFormatError, match=r"takes .*128.* says calls of 16 tokens over 64 cache slots"):
        open_backend("onnx", small, threads=1)
    (narrow / "model.onnx").replace(small / "model.onnx")  # the same cache, calls of 4 tokens
    with pytest.raises(ModelFormatError, match=r"takes .*\[1, 1, 4, 64\].* says calls of 16 tokens over 64"):
        open_backend("onnx", small, threads=1)


def test_placement_report_names_every_node(tiny_onnx_dir):
    proc = _cli("onnx-placement", str(tiny_onnx_dir), "--ep", "cpu")
    n_nodes = len(onnx.load(str(tiny_onnx_dir / "model.onnx")).graph.node)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{n_nodes} of {n_nodes} nodes (100.0%) on CPUExecutionProvider"


def test_cli_export_and_generate(tmp_path, smollm2_path):
    out = tmp_path / "cli-export"
    proc = _cli("export-onnx", str(smollm2_path), str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    proc = _cli("generate", "1, 2, 3, 4,", "--backend", "onnx", "--model", str(out), "--ep", "cpu",
                "-n", "8", "--drafter", "ngram", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["backend"] == "onnx" and result["n_tokens"] == 8 and "5" in result["text"]


def test_backend_errors_are_typed(export_dir, tmp_path):
    with pytest.raises(ModelFormatError):
        open_backend("onnx", tmp_path)
    with pytest.raises(InvalidArgumentError):
        open_backend("onnx", export_dir, ep="coreml")
