"""Each architecture is one C file holding its tensor table
(csrc/native/arch/<name>.c): the native loader binds by it, validation checks
files against it, and Python reads it (edgespec.models.gguf)."""
from __future__ import annotations

import pytest

from edgespec.training import moe_tools
from edgespec.bench.reference import Reference
from edgespec.errors import UnsupportedModelError
from edgespec.models.gguf import DIMS, GGUFFile, arch_tensors, architectures
from edgespec.onnx.export import read_config


def test_every_architecture_has_a_table_starting_with_its_embeddings():
    assert architectures() == ["llama", "gemma3", "qwen2", "qwen3moe"]
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
