"""The QDQ form of the ONNX export (--weights qdq, for NPU execution providers):
its structure, its logits against the float graph on the CPU provider, exact
speculation on it, and the QNN provider's HTP backend (emulated on x86 by the
onnxruntime-qnn package) placing and running it."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from edgespec.backends import open_backend
from edgespec.onnx import export as onnx_export

TINY = {"llama": "tiny_llama_path", "qwen2": "tiny_qwen2_path", "gemma3": "tiny_gemma3_path"}
# not the calibration text: the ranges must hold on text they were not taken from
HELD_OUT = "The quick brown fox jumps over the lazy dog; 10, 9, 8, 7, 6, 5, 4, 3, 2, 1. for i in range(3): print(i)"


def _rows(address: int, n: int, n_vocab: int) -> np.ndarray:
    return np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctypes.c_float)), shape=(n, n_vocab)).copy()


@pytest.fixture(scope="module")
def tiny_pairs(request, tmp_path_factory):
    """arch -> (its float static export, its QDQ export), exported once per module."""
    made = {}

    def get(arch):
        if arch not in made:
            gguf_path = request.getfixturevalue(TINY[arch])
            root = tmp_path_factory.mktemp(f"qdq-{arch}")
            made[arch] = (onnx_export.export(gguf_path, root / "fp32", weights="fp32", static_shapes=True,
                                             cache_len=128, progress=False),
                          onnx_export.export(gguf_path, root / "qdq", weights="qdq", cache_len=128, progress=False))
        return made[arch]
    return get


def _logits(folder, text: str, n: int = 40, ep: str = "cpu") -> np.ndarray:
    backend = open_backend("onnx", folder, threads=1, ep=ep)
    try:
        tokens = backend.tokenize(text)[:n]
        return _rows(backend.decode(tokens, logits_from=0), len(tokens), backend.n_vocab)
    finally:
        backend.close()


def test_qdq_graph_is_integer_weights_and_quantized_activations(tiny_pairs):
    """Every weight matrix is int8 with one scale per output channel behind a
    DequantizeLinear, every MatMul reads a dequantized uint16 activation, no
    contrib op is left, and the shapes are fixed."""
    _, folder = tiny_pairs("llama")
    meta = onnx_export.load_export(folder)
    assert meta["weights"] == "qdq" and meta["static"] == {"seq": onnx_export.STATIC_SEQ, "ctx": 128}
    model = onnx.load(str(folder / "model.onnx"))
    onnx.checker.check_model(model)
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}
    assert not [n.op_type for n in graph.node if n.domain not in ("", "ai.onnx")]
    assert not [i.name for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) == 2
                and i.dims[0] * i.dims[1] > 4096]  # no float matrix is left
    matmuls = [n for n in graph.node if n.op_type == "MatMul"]
    weights = [n for n in matmuls if producer[n.input[1]].input[0] in inits]
    assert len(weights) == 2 * 4 + 1  # QKV, output, gate+up, down per layer; the head
    for node in weights:
        dq = producer[node.input[1]]
        q, scale = inits[dq.input[0]], numpy_helper.to_array(inits[dq.input[1]])
        assert dq.op_type == "DequantizeLinear" and q.data_type == onnx.TensorProto.INT8
        axis = next(a.i for a in dq.attribute if a.name == "axis")
        assert scale.shape == (q.dims[axis],) and (scale > 0).all()
    for node in matmuls:
        act = producer[node.input[0]]
        assert act.op_type == "DequantizeLinear" and producer[act.input[0]].op_type == "QuantizeLinear"
        assert inits[act.input[2]].data_type == onnx.TensorProto.UINT16
    for value in list(graph.input) + list(graph.output):
        assert all(d.HasField("dim_value") for d in value.type.tensor_type.shape.dim), value.name


@pytest.mark.parametrize("arch", list(TINY))
def test_qdq_logits_follow_the_float_graph(tiny_pairs, arch):
    """On the CPU provider, on text the calibration never saw: the QDQ graph's
    logits stay near the float graph's and mostly pick the same token (random
    tiny models have flat logits, which makes top-1 a hard measure)."""
    fp32, qdq = tiny_pairs(arch)
    a, b = _logits(fp32, HELD_OUT), _logits(qdq, HELD_OUT)
    rms = float(np.sqrt(((a - b) ** 2).mean()))
    spread = float(a.std())
    assert rms < 0.08 * spread, (rms, spread)
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.85
    assert not np.array_equal(a, b)  # quantized indeed


def test_qdq_speculation_is_exact(tiny_pairs):
    """Plain and speculative greedy output are the same tokens on the QDQ graph
    (every call has the static graph's rows, whatever is verified)."""
    from edgespec import Engine

    _, folder = tiny_pairs("llama")
    prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3,"
    with Engine(str(folder), backend="onnx", threads=1) as engine:
        plain = engine.generate(prompt, max_tokens=24, drafter="none")
        spec = engine.generate(prompt, max_tokens=24, drafter="ngram")
    assert spec.tokens == plain.tokens
    assert spec.stats.spec.drafted > 0


# -- the QNN provider (onnxruntime-qnn: a plugin package beside onnxruntime) --


def _qnn() -> None:
    """Skip when .ci/run could not install onnxruntime-qnn here (its reason in
    EDGESPEC_QNN_SKIP) or it is not installed."""
    reason = os.environ.get("EDGESPEC_QNN_SKIP")
    if reason:
        pytest.skip(f"onnxruntime-qnn could not be installed: {reason}")
    try:
        import onnxruntime_qnn  # noqa: F401
    except ImportError:
        pytest.skip("onnxruntime-qnn is not installed (pip install 'edgespec[qnn]'; .ci/run installs it)")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "edgespec", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("arch", list(TINY))
def test_qnn_places_the_qdq_graph_and_runs_it(tiny_pairs, arch):
    """QNN's HTP backend takes every node of the QDQ graph but the boundary's
    input quantization and output dequantization (ONNX Runtime's part), and
    its logits (integer arithmetic, emulated) pick the CPU provider's token."""
    _qnn()
    _, folder = tiny_pairs(arch)
    proc = _cli("onnx-placement", str(folder), "--ep", "qnn")
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.strip().splitlines()
    n_nodes = len(onnx.load(str(folder / "model.onnx")).graph.node)
    assert len(first) == 1 and "on QNNExecutionProvider; " in first[0] and "(the provider's boundary)" in first[0]
    placed, boundary = int(first[0].split()[0]), int(first[0].split("; ")[1].split()[0])
    assert placed + boundary == n_nodes and placed > 0.95 * n_nodes
    cpu, qnn = _logits(folder, HELD_OUT, ep="cpu"), _logits(folder, HELD_OUT, ep="qnn")
    assert (cpu.argmax(-1) == qnn.argmax(-1)).mean() >= 0.85
    assert float(np.sqrt(((cpu - qnn) ** 2).mean())) < 0.08 * float(cpu.std())


def test_qnn_rejects_a_float_graph_in_one_line(tmp_path, tiny_llama_path):
    """A static graph that is not QDQ (MatMulNBits and float operators): QNN's
    HTP backend cannot build it, and says so in one line."""
    _qnn()
    folder = onnx_export.export(tiny_llama_path, tmp_path / "int4", weights="int4", static_shapes=True,
                                cache_len=64, progress=False)
    proc = _cli("generate", "hi", "--backend", "onnx", "--model", str(folder), "--ep", "qnn", "-n", "2")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: onnxruntime could not load") and "on qnn" in lines[0]
