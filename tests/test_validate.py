"""The validation pass over a GGUF before any engine loads it
(edgespec.models.gguf.check_gguf over csrc/native/validate.c).

Damaged copies of the tiny llama, each once through the CLI with both GGUF
backends: llama.cpp asserted (exit 134) on the first three kinds; every one
must now end in exit 2 and one `error:` line naming the problem. Then a
property test: random mutations of the same file (byte flips, truncation,
changed keys, tensor types and shapes) are either refused with a
ModelFormatError or load and decode in both engines, in a worker process
whose death would be a crash that validation let through.
"""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from edgespec.errors import ModelFormatError
from edgespec.models import registry
from edgespec.models.gguf import check_gguf as validate_gguf
from edgespec.models.gguf_write import field_value

Q = gguf.GGMLQuantizationType


# ---- where things are in the tiny file ---------------------------------------------------

class Layout:
    """Byte offsets of the tiny llama's keys, tokens, merges and tensor infos,
    found once with gguf-py's reader (its parts are views into the file)."""

    def __init__(self, path: Path):
        r = gguf.GGUFReader(path)
        base = r.data.ctypes.data

        def at(part) -> int:
            return part.ctypes.data - base

        self.data = path.read_bytes()
        # key -> (offset of the value, numpy dtype of the value)
        self.scalars = {k: (at(f.parts[-1]), f.parts[-1].dtype) for k, f in r.fields.items()
                        if len(f.parts) == 4 and f.types[0] != gguf.GGUFValueType.STRING}
        tokens = r.fields["tokenizer.ggml.tokens"]
        # (offset, bytes) of each token and merge
        self.tokens = [(at(tokens.parts[i]), bytes(tokens.parts[i])) for i in tokens.data]
        merges = r.fields["tokenizer.ggml.merges"]
        self.merges = [(at(merges.parts[i]), bytes(merges.parts[i])) for i in merges.data]
        # tensor name -> (offset of its dims, offset of its type)
        self.tensors = {t.name: (at(t.field.parts[3]), at(t.field.parts[4])) for t in r.tensors}
        self.header_end = min(int(t.data_offset) for t in r.tensors)

    def with_scalar(self, key: str, value) -> bytes:
        offset, dtype = self.scalars[key]
        return _patched(self.data, offset, np.array([value], dtype=dtype).tobytes())

    def with_tensor_type(self, name: str, type_id: int) -> bytes:
        return _patched(self.data, self.tensors[name][1], struct.pack("<I", type_id))

    def with_tensor_dim(self, name: str, dim: int, value: int) -> bytes:
        return _patched(self.data, self.tensors[name][0] + 8 * dim, struct.pack("<Q", value))

    def duplicate_token(self) -> tuple[bytes, int, int]:
        """A copy in which one byte of token j makes it token i; (data, i, j)."""
        seen: dict[bytes, int] = {}
        for j, (_, tok) in enumerate(self.tokens[:5000]):
            for p in range(len(tok)):
                pattern = tok[:p] + b"\0" + tok[p + 1:] + bytes([p])
                i = seen.setdefault(pattern, j)
                if i != j:
                    return _patched(self.data, self.tokens[j][0], self.tokens[i][1]), i, j
        raise AssertionError("no two tokens differ in one byte")


def _patched(data: bytes, offset: int, new: bytes) -> bytes:
    return data[:offset] + new + data[offset + len(new):]


def _rewrite(src: Path, dst: Path, *, n_vocab: int | None = None,
             change: tuple[str, Callable[[np.ndarray], np.ndarray]] | None = None,
             merges: Callable[[list], list] | None = None) -> Path:
    """src copied through gguf-py, a well-formed file: with n_vocab, its
    vocabulary cut to the first n_vocab tokens (merges of kept tokens only,
    embedding rows to match), a small model that loads fast; with change =
    (name, fn), tensor `name` (a float tensor) replaced by fn(its values),
    stored in fn's dtype; with merges, the merges (bytes) replaced by
    merges(them)."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), bytes(r.fields["general.architecture"].parts[-1]).decode())
    keep = None
    if n_vocab is not None:
        keep = set(field_value(r.fields["tokenizer.ggml.tokens"])[:n_vocab])
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field_value(field)
        if keep is not None and key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                        "tokenizer.ggml.scores"):
            value = value[:n_vocab]
        elif keep is not None and key == "tokenizer.ggml.merges":
            value = [m for m in value if all(p in keep for p in (*m.split(b" ", 1), m.replace(b" ", b"", 1)))]
        elif keep is not None and key.endswith(".vocab_size"):
            value = n_vocab
        if merges is not None and key == "tokenizer.ggml.merges":
            value = merges(value)
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, field.types[0], sub_type)
    for t in r.tensors:
        data, qtype = np.array(t.data), Q(t.tensor_type)
        if keep is not None and t.name in ("token_embd.weight", "output.weight"):
            data = data[:n_vocab]
        if change and t.name == change[0]:
            data = change[1](data)
            qtype = Q.F16 if data.dtype == np.float16 else Q.F32
        w.add_tensor(t.name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def layout(tiny_llama_path) -> Layout:
    return Layout(Path(tiny_llama_path))


@pytest.fixture(scope="module")
def rewritten(tiny_llama_path, tmp_path_factory) -> dict[str, bytes]:
    """Damage that changes a tensor's size, written whole by gguf-py (so that
    only the validator, not the container checks, finds it)."""
    directory = tmp_path_factory.mktemp("rewritten")
    changes = {"norm-f16": ("blk.0.attn_norm.weight", lambda w: w.astype(np.float16)),
               "shape-mismatch": ("blk.1.attn_k.weight", lambda w: w[:16])}
    files = {name: _rewrite(Path(tiny_llama_path), directory / f"{name}.gguf", change=change).read_bytes()
             for name, change in changes.items()}
    # A BPE tokenizer without merges (it would spell every word byte by
    # byte), and merges naming what the vocabulary lacks.
    tokens = set(field_value(gguf.GGUFReader(tiny_llama_path).fields["tokenizer.ggml.tokens"]))
    unjoined = next(f"{a} {b}".encode() for a in "QXZ" for b in "qxz" if f"{a}{b}".encode() not in tokens)
    merge_changes = {"empty-merges": lambda m: [ONE_MERGE],
                     "merge-unknown-part": lambda m: [*m[:5], "Ġzzqq zz".encode(), *m[5:]],
                     "merge-unknown-join": lambda m: [*m[:5], unjoined, *m[5:]]}
    files.update({name: _rewrite(Path(tiny_llama_path), directory / f"{name}.gguf", merges=fn).read_bytes()
                  for name, fn in merge_changes.items()})
    files["empty-merges"] = _emptied_merges(files["empty-merges"])
    return files


ONE_MERGE = b"a" * 12 + b" " + b"b" * 11   # 8 + 24 bytes in the file: the tensor data's alignment (32)


def _emptied_merges(data: bytes) -> bytes:
    """A file whose merges are [ONE_MERGE] with them emptied (gguf-py writes
    no empty array): the count 0 and the merge's 32 bytes cut, which moves
    the tensor data by the alignment and keeps every offset in it valid."""
    key = b"tokenizer.ggml.merges"
    count_at = data.index(key) + len(key) + 4 + 4   # after the value type and the element type
    assert struct.unpack_from("<QQ", data, count_at) == (1, len(ONE_MERGE))
    return data[:count_at] + struct.pack("<Q", 0) + data[count_at + 8 + 8 + len(ONE_MERGE):]


@pytest.fixture(scope="module")
def small_layout(tiny_llama_path, tmp_path_factory) -> Layout:
    """The tiny llama with its first 400 tokens only: both engines load it in
    a fraction of the time, which the mutation test spends on 100 files."""
    return Layout(_rewrite(Path(tiny_llama_path), tmp_path_factory.mktemp("small") / "small.gguf",
                           n_vocab=400))


# ---- one damaged file per rule, through the CLI with both backends ---------------------------

def _damaged(layout: Layout, rewritten: dict[str, bytes]) -> dict[str, tuple[bytes, str]]:
    """name -> (file contents, what the error line must contain)."""
    dup, i, j = layout.duplicate_token()
    n_vocab = len(layout.tokens)
    special = "tokenizer.ggml.eos_token_id"
    m_off, merge = layout.merges[10]
    bad_merge = merge.replace(b" ", b"x", 1)
    return {
        "duplicate-token": (dup, f"tokenizer.ggml.tokens: token {j} "),
        "block-count-0": (layout.with_scalar("llama.block_count", 0),
                          "llama.block_count = 0 is out of range"),
        "block-count-1000": (layout.with_scalar("llama.block_count", 1000),
                             "llama.block_count = 1000 is out of range"),
        "norm-f16": (rewritten["norm-f16"], "tensor blk.0.attn_norm.weight: expected F32 (a norm weight), found F16"),
        "bad-special-id": (layout.with_scalar(special, n_vocab),
                           f"{special} = {n_vocab} is out of range [0, {n_vocab - 1}]"),
        "bad-merge": (_patched(layout.data, m_off, bad_merge),
                      "tokenizer.ggml.merges: merge 10 "),
        "shape-mismatch": (rewritten["shape-mismatch"],
                           "tensor blk.1.attn_k.weight has shape (64, 16, 1, 1), expected (64, 32, 1, 1)"),
        "rope-base-below-1": (layout.with_scalar("llama.rope.freq_base", 1e-38),
                              "llama.rope.freq_base = 1e-38 is below 1"),
        "rwkv-tokenizer": (_with_tokenizer_model(layout.data, b"gpt2", b"rwkv"),
                           "tokenizer.ggml.model is 'rwkv', RWKV's tokenizer, in a llama model"),
        "empty-merges": (rewritten["empty-merges"],
                         "tokenizer.ggml.merges is empty, which the BPE ('gpt2') tokenizer cannot be"),
        "merge-unknown-part": (rewritten["merge-unknown-part"], "tokenizer.ggml.merges: merge 5 "
                               "'\\xc4\\xa0zzqq zz' names a token the vocabulary lacks (its left part)"),
        "merge-unknown-join": (rewritten["merge-unknown-join"],
                               "names a token the vocabulary lacks (the two parts joined)"),
    }


def _with_tokenizer_model(data: bytes, old: bytes, new: bytes) -> bytes:
    """``data`` with tokenizer.ggml.model's value ``old`` replaced by ``new`` (as long)."""
    at = data.index(old, data.index(b"tokenizer.ggml.model"))
    return _patched(data, at, new)


DAMAGE = ["duplicate-token", "block-count-0", "block-count-1000", "norm-f16", "bad-special-id",
          "bad-merge", "shape-mismatch", "rope-base-below-1", "rwkv-tokenizer", "empty-merges",
          "merge-unknown-part", "merge-unknown-join"]


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_file_is_one_error_line_on_both_backends(tmp_path, layout, rewritten, damage):
    data, want = _damaged(layout, rewritten)[damage]
    path = tmp_path / f"{damage}.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelFormatError) as e:
        validate_gguf(path)
    assert want in str(e.value) and str(path) in str(e.value), str(e.value)
    for backend in ("llama", "native"):
        r = subprocess.run([sys.executable, "-m", "edgespec", "generate", "hello", "--model", str(path),
                            "--backend", backend, "--max-tokens", "2"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (backend, r.returncode, r.stderr[-2000:])
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and want in lines[0], (backend, r.stderr)


def test_models_info_reports_a_file_failing_validation(tmp_path, layout):
    path = tmp_path / "dup.gguf"
    path.write_bytes(layout.duplicate_token()[0])
    r = subprocess.run([sys.executable, "-m", "edgespec", "models", "info", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error:") and "repeats token" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""


def test_valid_files_pass(tiny_llama_path, smollm2_path, gemma_path):
    for path in (tiny_llama_path, smollm2_path, gemma_path):
        validate_gguf(path)
        assert registry.model_path_checked(str(path)) == Path(path)


def test_model_path_checked_refuses_a_damaged_file(tmp_path, layout):
    path = tmp_path / "bc.gguf"
    path.write_bytes(layout.with_scalar("llama.block_count", 0))
    with pytest.raises(ModelFormatError, match="llama.block_count = 0 is out of range"):
        registry.model_path_checked(str(path))


# ---- property: mutations are refused or load ------------------------------------------------

# Loads each path it reads from stdin with both engines and decodes two tokens;
# answers one JSON line: per backend "ok" or the ModelFormatError's text. A
# mutation validation let through that crashes an engine, or fails it with
# another exception, ends the worker: the test sees its exit status.
_WORKER = r"""
import json, sys
from edgespec import Engine
from edgespec.errors import ModelFormatError
for line in sys.stdin:
    out = {}
    for backend in ("llama", "native"):
        try:
            with Engine(line.strip(), backend=backend, n_ctx=64, threads=1) as e:
                e.generate("hi", max_tokens=2, temperature=0)
            out[backend] = "ok"
        except ModelFormatError as err:
            out[backend] = str(err)
    print(json.dumps(out), flush=True)
"""


class Loader:
    """The worker process, restarted after a crash (Hypothesis then shrinks
    the failing mutation)."""

    def __init__(self):
        self.start()

    def start(self):
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def load(self, path: Path, what: str) -> dict:
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            self.start()
            raise AssertionError(f"an engine crashed (exit {rc}) on a file validation passed: {what}")
        return json.loads(line)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def loader():
    w = Loader()
    yield w
    w.close()


_EDGE_INTS = [0, 1, 2, 3, 4, 7, 16, 31, 32, 63, 64, 65, 128, 399, 400, 513, 1000, 2**31 - 1, 2**32 - 1]
_EDGE_FLOATS = [0.0, -1.0, 1e-30, 1e30, float("nan"), float("inf"), 0.5]


@st.composite
def mutations(draw, layout: Layout):
    """(description, mutated bytes)."""
    kind = draw(st.sampled_from(["flip", "truncate", "int-key", "float-key", "type", "dim"]))
    data = layout.data
    if kind == "flip":
        pos = draw(st.integers(0, layout.header_end - 1))
        x = draw(st.integers(1, 255))
        return f"byte {pos} ^= {x}", _patched(data, pos, bytes([data[pos] ^ x]))
    if kind == "truncate":
        n = draw(st.integers(0, len(data) - 1))
        return f"truncated to {n} bytes", data[:n]
    if kind == "int-key":
        keys = sorted(k for k, (_, dt) in layout.scalars.items() if dt.kind in "iu")
        key = draw(st.sampled_from(keys))
        dtype = layout.scalars[key][1]
        value = draw(st.sampled_from(_EDGE_INTS)) % (1 << (8 * dtype.itemsize))
        return f"{key} = {value}", layout.with_scalar(key, value)
    if kind == "float-key":
        keys = sorted(k for k, (_, dt) in layout.scalars.items() if dt.kind == "f")
        key = draw(st.sampled_from(keys))
        value = draw(st.sampled_from(_EDGE_FLOATS))
        return f"{key} = {value}", layout.with_scalar(key, value)
    name = draw(st.sampled_from(sorted(layout.tensors)))
    if kind == "type":
        t = draw(st.sampled_from([0, 1, 2, 8, 12, 14, 24, 26, 28, 30]))
        return f"{name} type {t}", layout.with_tensor_type(name, t)
    dim = draw(st.integers(0, 1))
    value = draw(st.sampled_from([1, 2, 16, 32, 63, 64, 128]))
    return f"{name} ne[{dim}] = {value}", layout.with_tensor_dim(name, dim, value)


def test_mutations_are_refused_or_load(tmp_path_factory, small_layout, loader):
    layout = small_layout
    directory = tmp_path_factory.mktemp("mutations")
    outcomes = {"refused": 0, "loaded": 0}

    @settings(max_examples=100, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.data())
    def check(data):
        what, contents = data.draw(mutations(layout))
        path = directory / "mutated.gguf"
        path.write_bytes(contents)
        try:
            validate_gguf(path)
        except ModelFormatError as e:
            assert "\n" not in str(e)
            outcomes["refused"] += 1
            return
        results = loader.load(path, what)  # both engines: loaded or a ModelFormatError, never a crash
        outcomes["loaded"] += sum(r == "ok" for r in results.values())

    check()
    assert outcomes["refused"] > 0 and outcomes["loaded"] > 0, outcomes
