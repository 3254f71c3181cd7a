"""Each architecture is one C file holding its tensor table and its traits
(csrc/native/arch/<name>.c): the native loader binds by the table and its
layer computes what the traits say, validation checks files against the
table, and Python reads both (edgespec.models.gguf): the ONNX exporter, the
float64 reference and the training network compute from them."""
from __future__ import annotations

import math
import pathlib
from dataclasses import replace

import gguf
import numpy as np
import pytest

from edgespec.backends import open_backend
from edgespec.bench.faithfulness import engine_logits
from edgespec.bench.reference import Reference, forward_reference, kl_rows
from edgespec.errors import InvalidArgumentError, ModelFormatError, UnsupportedModelError
from edgespec.models.gguf import DIMS, GGUFFile, arch_tensors, arch_traits, architectures
from edgespec.models.gguf_write import copy_keys
from edgespec.onnx import export as onnx_export
from edgespec.training import moe_tools
from edgespec.onnx.export import read_config
from edgespec.training import network

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_architecture_has_a_table_starting_with_its_embeddings():
    assert architectures() == ["llama", "gemma3", "qwen2", "qwen3", "qwen3moe"]
    for arch in architectures():
        table = arch_tensors(arch)
        assert table[0].name == "token_embd.weight" and table[0].dims == ("n_embd", "n_vocab")
        assert {"attn_norm.weight", "attn_output.weight", "ffn_norm.weight"} <= {t.name for t in table}
        assert all(set(t.dims) <= set(DIMS) for t in table)
    assert arch_tensors("phi3") == []
    qwen2 = {t.name: t for t in arch_tensors("qwen2")}
    assert qwen2["attn_q.bias"].dims == ("n_q",) and qwen2["attn_q.bias"].layer and not qwen2["attn_q.bias"].required
    moe_rows = {t.name for t in arch_tensors("qwen3moe")}
    assert "ffn_gate_exps.weight" in moe_rows and "ffn_gate.weight" not in moe_rows


@pytest.fixture
def moe_path(tmp_path, tiny_vocab_path):
    return moe_tools.synth(tmp_path / "synth.gguf", tiny_vocab_path, experts=4, top_k=2, layers=2, embd=64, ff=64,
                     qtype="q8_0", progress=False)


@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_qwen2_path", "tiny_gemma3_path", "moe_path"])
def test_the_resolved_table_is_what_each_file_holds(fixture, request):
    """For every built-in architecture's fixture: each row that applies, in
    every layer, has exactly the shape the file's tensor has, and every
    required one is in the file."""
    with GGUFFile(request.getfixturevalue(fixture)) as f:
        shapes = f.arch_shapes()
        arch = f.get("general.architecture")
        n_layer = f.get(f"{arch}.block_count")
        held = {t.name: t.shape for t in f.tensors}
    layered = {name.split(".", 2)[2] for name in shapes if name.startswith("blk.")}
    assert all(f"blk.{il}.{row}" in shapes for il in range(n_layer) for row in layered)
    for name, shape in shapes.items():
        if name in held:
            assert held[name] == shape, name
    arch_rows = {t.name: t for t in arch_tensors(arch)}
    for name in shapes:
        row = arch_rows[name.split(".", 2)[2] if name.startswith("blk.") else name]
        if row.required and row.name not in ("attn_q.weight", "attn_k.weight", "attn_v.weight"):
            assert name in held, name


def test_python_readers_take_their_widths_from_the_table(tiny_qwen2_path, tiny_gemma3_path):
    for path in (tiny_qwen2_path, tiny_gemma3_path):
        with GGUFFile(path) as f:
            shapes = f.arch_shapes()
            cfg = read_config(f)
        ref = Reference(path)
        assert (cfg.n_embd, cfg.n_vocab) == shapes["token_embd.weight"] == (ref.n_embd, ref.n_vocab)
        assert cfg.n_ff == shapes["blk.0.ffn_up.weight"][1]
        assert cfg.head_dim == ref.head_dim == shapes["blk.0.attn_k.weight"][1] // cfg.n_head_kv
        assert cfg.qkv_bias == ("blk.0.attn_q.bias" in shapes)


def test_an_architecture_without_a_table_has_no_shapes(tmp_path):
    import gguf

    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with GGUFFile(path) as f, pytest.raises(UnsupportedModelError, match="mamba"):
        f.arch_shapes()


# -- traits ----------------------------------------------------------------------------------


def test_every_architecture_has_its_traits():
    t = {arch: arch_traits(arch) for arch in architectures()}
    assert arch_traits("phi3") is None
    assert [a for a in t if t[a].rope_neox] == ["gemma3", "qwen2", "qwen3", "qwen3moe"]
    assert [a for a in t if t[a].qk_norm] == ["gemma3", "qwen3", "qwen3moe"]
    g = t["gemma3"]
    assert (g.activation, g.post_norms, g.embd_scale, g.final_softcap, g.attn_scale_on_q, g.sliding_window) == \
        ("gelu_tanh", True, True, True, True, True)
    assert all(t[a].activation == "silu" and not t[a].post_norms and not t[a].sliding_window
               for a in t if a != "gemma3")
    # The training network computes the plain decoders, in either RoPE layout.
    assert [a for a in t if network.computes(t[a])] == ["llama", "qwen2"]


def _with_pattern(source, path, pattern) -> None:
    """A copy of gemma3 file ``source`` whose attention.sliding_window_pattern
    is ``pattern`` (a period, or one flag per layer)."""
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(path), "gemma3")
    key = "gemma3.attention.sliding_window_pattern"
    copy_keys(reader, writer, keep=lambda k: k != key)
    if isinstance(pattern, list):
        writer.add_array(key, pattern)
    else:
        writer.add_uint32(key, pattern)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_traits_resolve_per_file(tiny_gemma3_path, tiny_qwen2_path, tmp_path):
    """gemma3's numbers from its keys, each layer's window and RoPE; the same
    sliding window in the exporter's config and the reference."""
    with GGUFFile(tiny_gemma3_path) as f:
        t = f.arch_traits()
        cfg = read_config(f)
    assert (t.embd_scale, t.n_swa, t.final_softcap) == (8.0, 8, 0.0)          # sqrt(64); no soft-cap key
    assert t.attn_scale == pytest.approx(1 / math.sqrt(32))                    # 1/sqrt(head_dim)
    assert [(layer.swa, layer.rope_base, layer.rope_scale) for layer in t.layers] == \
        [(True, 10000.0, 1.0), (False, 1e6, 1.0)]                               # period 2: the last layer global
    assert cfg.swa_layers == [True, False] and cfg.rope == [(10000.0, 1.0), (1e6, 1.0)]
    assert Reference(tiny_gemma3_path).traits == t
    with GGUFFile(tiny_qwen2_path) as f:
        t = f.arch_traits()
    assert (t.embd_scale, t.n_swa) == (1.0, 0) and not any(layer.swa for layer in t.layers)

    flags = tmp_path / "flags.gguf"
    _with_pattern(tiny_gemma3_path, flags, [False, True])
    with GGUFFile(flags) as f:
        assert [layer.swa for layer in f.arch_traits().layers] == [False, True]
    # Flags that are not one per layer: refused alike by every reader (the
    # reference's own copy of the rule had no length check).
    short = tmp_path / "short.gguf"
    _with_pattern(tiny_gemma3_path, short, [True, False, True])
    with GGUFFile(short) as f, pytest.raises(ModelFormatError, match="expected 2 flags"):
        f.arch_traits()
    for read in (Reference, lambda path: open_backend("native", path, n_ctx=64, threads=1)):
        with pytest.raises(ModelFormatError, match="sliding_window_pattern"):
            read(short)


def test_the_training_network_refuses_what_it_does_not_compute(tiny_qwen3_path):
    with GGUFFile(tiny_qwen3_path) as f, pytest.raises(InvalidArgumentError,
                                                       match="cannot be grown from a qwen3 model"):
        network.read_shape(f)


# -- an architecture is its C file and one registry line ---------------------------------------


def test_an_architecture_is_its_file_and_one_registry_line(tiny_qwen3_path, tmp_path):
    """qwen3 (per-head Q/K norms, NEOX RoPE, heads wider than the model, a dense
    SwiGLU FFN) was added as csrc/native/arch/qwen3.c and its line in
    arch/registry.c, nothing in Python: the native engine, the ONNX export and
    the float64 reference all compute it from its table and traits, and agree."""
    sources = [p for p in (ROOT / "edgespec").rglob("*.py") if '"qwen3"' in p.read_text()]
    assert sources == []
    assert (ROOT / "csrc/native/arch/qwen3.c").exists()
    registry = (ROOT / "csrc/native/arch/registry.c").read_text().splitlines()
    assert sum(line.strip() == "&es__arch_qwen3," for line in registry) == 1

    folder = onnx_export.export(tiny_qwen3_path, tmp_path / "qwen3", weights="fp32", progress=False)
    with open_backend("native", tiny_qwen3_path, n_ctx=256, threads=1) as native, \
            open_backend("onnx", folder, n_ctx=256, threads=1) as ort:
        tokens = native.tokenize("The lighthouse keeper climbed the narrow stairs every evening. " * 3)
        (_, mine), = engine_logits(native, tokens)
        (_, theirs), = engine_logits(ort, tokens)
    ref = forward_reference(tiny_qwen3_path, tokens)
    kl = kl_rows(ref, mine)
    assert kl.mean() <= 1e-4, kl.mean()                          # as tight as llama and qwen2 (test_faithfulness)
    assert (ref.argmax(1) == mine.argmax(1)).mean() >= 0.99
    assert np.abs(mine - theirs).max() < 0.05                    # test_onnx's bound: F16 cache against float32
    assert (mine.argmax(1) == theirs.argmax(1)).all()
    # Without its head norms the file computes something else: the traits, not luck, make the agreement.
    plain = Reference(tiny_qwen3_path)
    plain.traits = replace(plain.traits, arch=replace(plain.traits.arch, qk_norm=False))
    assert kl_rows(plain.logits(plain.hidden(tokens)), mine).mean() > 100 * kl.mean()
