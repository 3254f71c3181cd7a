"""ONNX export and the onnxruntime backend: GGUF blocks mapped exactly, logits
and greedy output against the llama backend, speculative decoding on it (also
with the draft model and the target on different backends), static shapes,
and bad input."""
from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import gguf
import numpy as np
import onnx
import pytest

from edgespec import Engine
from edgespec.backends import onnx_export
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


# -- the exported folder --------------------------------------------------------


def test_export_is_a_checked_graph_with_contrib_ops(export_dir, smollm2_path):
    meta = onnx_export.load_export(export_dir)
    assert meta["weights"] == "int4" and meta["static"] is None
    assert meta["source"]["gguf"] == str(smollm2_path.resolve())
    assert meta["config"]["n_layer"] == 30 and meta["config"]["n_vocab"] == 49152
    model = onnx.load(str(export_dir / "model.onnx"))
    onnx.checker.check_model(model)
    ops = {n.op_type for n in model.graph.node}
    assert {"MatMulNBits", "RotaryEmbedding", "SkipSimplifiedLayerNormalization"} <= ops
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


def test_model_name_is_exported_once_into_the_cache(tmp_path, smollm2_path, export_dir, monkeypatch):
    from edgespec.backends import onnx as onnx_backend

    calls = []

    def fake_export(gguf_path, out_dir, **kwargs):  # copy the session's export instead of redoing it
        calls.append(out_dir)
        import shutil
        shutil.copytree(export_dir, out_dir)
        return out_dir
    monkeypatch.setattr(onnx_export, "cache_dir", lambda: tmp_path / "onnx")
    monkeypatch.setattr(onnx_export, "export", fake_export)
    first = onnx_backend.resolve_model(str(smollm2_path))
    second = onnx_backend.resolve_model(str(smollm2_path))
    assert first == second == tmp_path / "onnx" / f"{smollm2_path.stem}-int4"
    assert len(calls) == 1


# -- parity with the llama backend ---------------------------------------------


def test_logits_agree_with_llama(llama_engine, export_dir):
    """Teacher-forced on llama's greedy text: the top-1 token agrees wherever
    llama.cpp's own top-2 margin is clear. (Bit-equality is out of reach:
    llama.cpp's quantized dot products make its output jump on ulp-level
    differences, e.g. in its approximate SiLU, and its flash attention
    accumulates in float16; the export emulates its activation rounding.)"""
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
            clear = top2[:, 1] - top2[:, 0] > 0.5
            same = ref.argmax(-1) == got.argmax(-1)
            assert same[clear].all(), f"{prompt!r}: top-1 differs where llama's margin is clear"
            assert np.sqrt(((ref - got) ** 2).mean()) < 0.5
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
    step), as row i of a k-row call (a verification batch) or as a node of a
    draft tree beside a sibling."""
    folder = request.getfixturevalue("export_dir" if shapes == "dynamic" else "static_export_dir")
    backend = open_backend("onnx", folder, n_ctx=256, threads=2)
    try:
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
        sibling = following[5]  # node 0 beside the chain following[1] <- following[2]
        backend.truncate(n)
        rows = _rows(backend.decode_tree([following[0]], [sibling, following[1], following[2]], [-1, -1, 1],
                                         [1, 1, 2]), 4, v)
        assert np.array_equal(rows[[0, 2, 3]], alone[:3])
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
        assert engine._drafters["model"].backend.name == "onnx"
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
    folder = static_export_dir
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    for value in list(model.graph.input) + list(model.graph.output):
        assert all(d.HasField("dim_value") for d in value.type.tensor_type.shape.dim), value.name
    static = open_backend("onnx", folder, n_ctx=512, threads=2)
    dynamic = open_backend("onnx", export_dir, n_ctx=512, threads=2)
    try:
        tokens = dynamic.tokenize("The capital of France is Paris, and the capital of Germany is Berlin. "
                                  "The capital of Italy is")
        assert len(tokens) > onnx_export.STATIC_SEQ  # two padded calls
        n, v = len(tokens), dynamic.n_vocab
        a = _rows(dynamic.decode(tokens, logits_from=0), n, v)
        b = _rows(static.decode(tokens, logits_from=0), n, v)
        np.testing.assert_allclose(a, b, atol=1e-4)
        for be in (static, dynamic):
            be.truncate(10)
        a = _rows(dynamic.decode_tree([tokens[10]], [5, 6, 7], [-1, 0, -1], [1, 2, 1]), 4, v)
        b = _rows(static.decode_tree([tokens[10]], [5, 6, 7], [-1, 0, -1], [1, 2, 1]), 4, v)
        np.testing.assert_allclose(a, b, atol=1e-4)
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
        (["generate", "hi", "--backend", "onnx", "--model", str(export_dir), "--ep", "qnn"], "available: cpu"),
        (["generate", "hi", "--model", str(smollm2_path), "--ep", "cpu"], "applies to the onnx backend"),
        (["generate", "hi", "--backend", "tpu"], "unknown backend 'tpu'"),
    ]
    for args, message in cases:
        proc = _cli(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (args, proc.stderr)
    assert not (tmp_path / "a").exists()


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
