"""The native engine's repacked weights kept in the cache between loads
(es_model_params.repack_cache): the first load writes them, later loads map
them, and the logits are bit-identical to repacking in memory and to no
repacking at all; a file written for another model or layout, cut short or
damaged is never used but written again; a cache that cannot be written
costs nothing but the repack."""
from __future__ import annotations

import ctypes
import os
import time

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from edgespec.backends import open_backend
from edgespec.capi import ffi, lib
from edgespec.models import registry
from tiny_gguf import write_tiny_qwen2

TEXT = "def add(a, b):\n    return a + b\n"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("EDGESPEC_REPACK", raising=False)
    return tmp_path / "home"


@pytest.fixture(scope="module")
def q4k_model(tmp_path_factory, tiny_vocab_path):
    path = tmp_path_factory.mktemp("repack") / "qwen2-q4k.gguf"
    write_tiny_qwen2(path, tiny_vocab_path, n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, dtype=Q.Q4_K)
    return path


def run(path, repack: str | None = None):
    """(where the repacked weights came from, the logits of TEXT in batches of 4)."""
    if repack is not None:
        os.environ["EDGESPEC_REPACK"] = repack
    try:
        with open_backend("native", path, n_ctx=64, threads=2) as b:
            tokens = b.tokenize(TEXT)[:16]
            rows = []
            for i in range(0, len(tokens), 4):
                addr = b.decode(tokens[i:i + 4], logits_from=0)
                n = len(tokens[i:i + 4])
                rows.append(np.ctypeslib.as_array((ctypes.c_float * (n * b.n_vocab)).from_address(addr))
                            .reshape(n, b.n_vocab).copy())
            return b.packed_from, np.concatenate(rows)
    finally:
        os.environ.pop("EDGESPEC_REPACK", None)


def packs(home) -> list:
    return sorted((home / registry.REPACKED_DIR).glob("*.pack"))


def test_written_once_then_mapped_with_the_same_logits(home, q4k_model):
    written, first = run(q4k_model)
    assert written == lib.ES_PACKED_WRITTEN and len(packs(home)) == 1
    assert packs(home)[0].with_suffix(".source").read_bytes() == os.fsencode(q4k_model.resolve())
    mapped, again = run(q4k_model)
    assert mapped == lib.ES_PACKED_MAPPED
    in_memory, memory_logits = run(q4k_model, "memory")
    unpacked, plain = run(q4k_model, "0")
    assert (in_memory, unpacked) == (lib.ES_PACKED_REPACKED, lib.ES_PACKED_NONE)
    assert np.array_equal(first, again) and np.array_equal(first, memory_logits) and np.array_equal(first, plain)
    assert len(packs(home)) == 1


def resident_bytes(path) -> int:
    """Bytes of ``path``'s mappings in this process's resident memory (Linux)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc")
@pytest.mark.parametrize("repack", [None, "memory"])
def test_the_source_rows_a_repack_serves_leave_resident_memory(home, q4k_model, repack, monkeypatch):
    """The checks at open read every block's scales; the rows the repacked
    copy serves (mapped from the cache, or repacked in memory) are then
    released, leaving the few the engine still reads (embeddings, norms)."""
    run(q4k_model)  # the cache file written: the next load maps it
    path = q4k_model.resolve()
    if repack is not None:
        monkeypatch.setenv("EDGESPEC_REPACK", repack)
    with open_backend("native", path, n_ctx=64, threads=2) as b:
        assert b.packed_from == (lib.ES_PACKED_MAPPED if repack is None else lib.ES_PACKED_REPACKED)
        weights = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors
                      if t.name.startswith("blk.") and "norm" not in t.name)
        assert weights > 0.5 * path.stat().st_size
        assert resident_bytes(path) < path.stat().st_size - 0.9 * weights, (resident_bytes(path), weights)


@pytest.mark.parametrize("damage", ["flip a weight byte", "cut short", "another model's file"])
def test_a_file_not_whole_or_not_this_models_is_written_again(home, q4k_model, tmp_path, tiny_vocab_path, damage):
    _, expected = run(q4k_model)
    pack = packs(home)[0]
    if damage == "flip a weight byte":
        data = bytearray(pack.read_bytes())
        data[len(data) // 2] ^= 0x40
        pack.write_bytes(bytes(data))
    elif damage == "cut short":
        with open(pack, "r+b") as f:
            f.truncate(pack.stat().st_size - 4096)
    else:   # the same shapes, other weights: the file of another model under this one's name
        other = tmp_path / "other.gguf"
        write_tiny_qwen2(other, tiny_vocab_path, n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                         dtype=Q.Q4_K, seed=7)
        run(other)
        theirs = next(p for p in packs(home) if p != pack)
        os.replace(theirs, pack)
    source, got = run(q4k_model)
    assert source == lib.ES_PACKED_WRITTEN
    assert np.array_equal(got, expected)
    assert run(q4k_model)[0] == lib.ES_PACKED_MAPPED


def test_a_cache_that_cannot_be_written_only_costs_the_repack(home, q4k_model):
    # A folder where the file would go: the rename over it fails, whoever runs this.
    blocker = registry.repacked_file(q4k_model, lib_kernels())
    (blocker / "x").mkdir(parents=True)
    source, got = run(q4k_model)
    assert source == lib.ES_PACKED_REPACKED
    assert np.array_equal(got, run(q4k_model, "0")[1])
    assert sorted(p.name for p in (home / registry.REPACKED_DIR).iterdir()) == [blocker.name]


def lib_kernels() -> str:
    return ffi.string(lib.es_kernels_name()).decode()


def test_files_of_models_that_are_gone_or_unused_are_pruned(home, q4k_model, tmp_path, tiny_vocab_path):
    gone = tmp_path / "gone.gguf"
    write_tiny_qwen2(gone, tiny_vocab_path, n_layer=1, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, dtype=Q.Q4_K)
    run(gone)
    run(q4k_model)
    assert len(packs(home)) == 2
    gone.unlink()
    old = next(p for p in packs(home) if p.name.startswith("qwen2-q4k"))
    past = time.time() - registry.REPACKED_UNUSED_S - 60
    os.utime(old, (past, past))
    part = home / registry.REPACKED_DIR / "x.pack.part-abcdef"
    part.write_bytes(b"half")
    os.utime(part, (past, past))
    registry.repacked_file(q4k_model, "scalar")
    assert packs(home) == [] and not part.exists()
    assert not list((home / registry.REPACKED_DIR).glob("*.source"))


def test_removing_a_model_removes_its_repacked_weights(home, q4k_model):
    run(q4k_model)
    assert packs(home)
    registry.remove_repacked(q4k_model)
    assert not list((home / registry.REPACKED_DIR).iterdir())
