"""Mutated GGUF files, and the verdict of edgespec's CLI on each.

    with Workbench(model_path, workdir) as bench:          # one padded working copy
        for mutant in mutants(model_path, seed, n):        # seeded, reproducible
            with bench.applied(mutant) as path:            # the copy, mutated in place
                ...                                        # run it; restored on exit
    runs = probe(model_path, workdir, seed, n)             # the same, through the CLI

A mutant changes the header (the header counts, metadata keys and values,
tensor infos), small stretches of tensor data (norm weights, the F16 scales of
quantized blocks) or cuts the file short. A real model's data section is
gigabytes, so mutants are not written as new files: the working copy holds
the original with a padding key (``edgespec.probe.pad``) that puts the data
section at a fixed offset; each mutant rewrites the header in place, the pad
absorbing the size change, patches its data bytes and restores them
afterwards. A cut file is written apart (its data is cut off anyway).

``probe`` runs every mutant through ``edgespec models info`` and ``edgespec
generate`` on the native and the llama backend, each command in a worker
process (tests/gguf_mutants.py run as a script: the CLI's application on
each line it reads, as ``edgespec.cli.main`` runs it), which the supervisor
replaces when it dies or hangs. A
``Run`` holds the three exit statuses; ``problems`` lists what must never
happen: an exit status other than 0 or 2 (an abort, a crash, a traceback), a
hang, or verdicts that disagree (``models info`` accepting a file that a
backend then refuses as damaged, one backend answering where the other
refuses).
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import shutil
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# GGUF metadata value types.
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
           U64: "<Q", I64: "<q", F64: "<d"}
_INTS = (U8, I8, U16, I16, U32, I32, U64, I64)
PAD_KEY = "edgespec.probe.pad"
PAD_SLACK = 1 << 20        # bytes the header may grow by before a mutant is skipped
DATA_ALIGN = 4096          # the working copy's data offset: a multiple of every alignment a mutant sets

# ggml types and their (block elements, block bytes, offsets of the F16 scales in a block).
GGML = {0: ("F32", 1, 4, ()), 1: ("F16", 1, 2, ()), 2: ("Q4_0", 32, 18, (0,)), 3: ("Q4_1", 32, 20, (0, 2)),
        6: ("Q5_0", 32, 22, (0,)), 7: ("Q5_1", 32, 24, (0, 2)), 8: ("Q8_0", 32, 34, (0,)),
        10: ("Q2_K", 256, 84, (80, 82)), 11: ("Q3_K", 256, 110, (108,)), 12: ("Q4_K", 256, 144, (0, 2)),
        13: ("Q5_K", 256, 176, (0, 2)), 14: ("Q6_K", 256, 210, (208,)), 30: ("BF16", 1, 2, ())}


# ---- the layout of a GGUF file ---------------------------------------------------------

@dataclass
class Value:
    type: int
    value: object                 # int / float / bool / bytes, or a list for an array
    elem: int | None = None       # an array's element type


@dataclass
class TensorInfo:
    name: bytes
    dims: list[int]
    type: int
    offset: int                   # from the start of the data section


@dataclass
class Layout:
    """A GGUF's header, decoded: what mutants change."""

    version: int
    kvs: list[tuple[bytes, Value]]
    tensors: list[TensorInfo]
    n_tensors: int | None = None  # header counts, when a mutant makes them lie
    n_kv: int | None = None
    magic: bytes = b"GGUF"

    def get(self, key: str) -> Value | None:
        return next((v for k, v in self.kvs if k == key.encode()), None)

    @property
    def alignment(self) -> int:
        a = self.get("general.alignment")
        return a.value if a is not None and a.type == U32 and a.value else 32

    def copy(self) -> "Layout":
        return Layout(self.version, [(k, Value(v.type, list(v.value) if isinstance(v.value, list) else v.value,
                                               v.elem)) for k, v in self.kvs],
                      [TensorInfo(t.name, list(t.dims), t.type, t.offset) for t in self.tensors],
                      self.n_tensors, self.n_kv, self.magic)


class _Reader:
    def __init__(self, data: bytes | memoryview):
        self.data, self.pos = data, 0

    def take(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> bytes:
        n = self.take("<Q")
        s = bytes(self.data[self.pos:self.pos + n])
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype == STR:
            return self.string()
        if vtype == ARR:
            elem, n = self.take("<I"), self.take("<Q")
            if elem in _SCALAR and elem != BOOL:   # numeric arrays in one go
                dt = np.dtype(_SCALAR[elem])
                out = np.frombuffer(self.data, dtype=dt, count=n, offset=self.pos).tolist()
                self.pos += n * dt.itemsize
                return Value(ARR, out, elem)
            return Value(ARR, [self.value(elem) for _ in range(n)], elem)
        return self.take(_SCALAR[vtype])


def read_layout(path: Path) -> tuple[Layout, int]:
    """(the header, the data section's offset in the file)."""
    with open(path, "rb") as f:
        data = memoryview(f.read(64 << 20))    # headers of the built-in models are under 10 MB
    r = _Reader(data)
    assert bytes(data[:4]) == b"GGUF", path
    r.pos = 4
    version, n_tensors, n_kv = r.take("<I"), r.take("<Q"), r.take("<Q")
    kvs = []
    for _ in range(n_kv):
        key, vtype = r.string(), r.take("<I")
        v = r.value(vtype)
        kvs.append((key, v if isinstance(v, Value) else Value(vtype, v)))
    tensors = []
    for _ in range(n_tensors):
        name, n_dims = r.string(), r.take("<I")
        dims = [r.take("<Q") for _ in range(n_dims)]
        tensors.append(TensorInfo(name, dims, r.take("<I"), r.take("<Q")))
    layout = Layout(version, kvs, tensors)
    a = layout.alignment
    return layout, r.pos + (a - r.pos % a) % a


def tensor_bytes(t: TensorInfo) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.type)]
    return int(np.prod(t.dims)) // block * size


def _value_bytes(v: Value) -> bytes:
    if v.type == STR:
        return struct.pack("<Q", len(v.value)) + v.value
    if v.type == ARR:
        head = struct.pack("<IQ", v.elem, len(v.value))
        if v.elem in _SCALAR and v.elem != BOOL and all(isinstance(x, (int, float)) for x in v.value):
            return head + np.asarray(v.value, dtype=np.dtype(_SCALAR[v.elem])).tobytes()
        return head + b"".join(_value_bytes(x if isinstance(x, Value) else Value(v.elem, x)) for x in v.value)
    return struct.pack(_SCALAR[v.type], v.value)


def header_bytes(layout: Layout, pad: int | None = None) -> bytes:
    """The header as written; ``pad``: the padding key's string length (None: no key)."""
    kvs = list(layout.kvs)
    if pad is not None:   # first: a position in the unpadded header past the counts moves by its size
        kvs.insert(0, (PAD_KEY.encode(), Value(STR, b" " * pad)))
    n_kv = layout.n_kv if layout.n_kv is not None else len(kvs)
    n_tensors = layout.n_tensors if layout.n_tensors is not None else len(layout.tensors)
    out = [layout.magic, struct.pack("<IQQ", layout.version, n_tensors, n_kv)]
    for key, v in kvs:
        out.append(struct.pack("<Q", len(key)) + key + struct.pack("<I", v.type) + _value_bytes(v))
    for t in layout.tensors:
        out.append(struct.pack("<Q", len(t.name)) + t.name + struct.pack("<I", len(t.dims))
                   + b"".join(struct.pack("<Q", d & (2**64 - 1)) for d in t.dims)
                   + struct.pack("<IQ", t.type, t.offset & (2**64 - 1)))
    return b"".join(out)


# ---- mutants -------------------------------------------------------------------------

@dataclass
class Mutant:
    """One change to a model file: a new header, data patches, or a cut."""

    name: str                                   # what it does, e.g. "int llama.context_length=3"
    layout: Layout | None = None                # the header (None: the original's)
    patches: list[tuple[int, bytes]] = field(default_factory=list)   # (offset in the data section, bytes)
    flips: list[tuple[int, int]] = field(default_factory=list)       # (offset in the unpadded header, byte)
    relaid: bool = False                        # the data moved to the layout's tensor offsets
    cut: tuple[str, int] | None = None          # ("header", n): the file ends after the header's
                                                # first n bytes; ("data", n): n bytes into the data
                                                # (n < 0: -n bytes before the end)


_F16 = {"nan": b"\x00\x7e", "inf": b"\x00\x7c", "-inf": b"\x00\xfc"}
_F32 = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "1e30": 1e30, "-1e30": -1e30}
_INT_VALUES = [0, 1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 63, 255, 256, 513, 4095, 65535, 2**31 - 1, 2**31,
               2**32 - 1, 2**32, 2**62, -1, -2**31]
_ARCHS = [b"llama", b"qwen2", b"gemma3", b"qwen3moe", b"gemma2", b"bert", b"phi3", b"mamba", b"", b"x" * 65,
          b"llama\x00x", b"\xff\xfe"]


def _int_in(vtype: int, v: int) -> int:
    """v as a value of integer type vtype (wrapped as a C cast would)."""
    bits = struct.calcsize(_SCALAR[vtype]) * 8
    v &= (1 << bits) - 1
    return v - (1 << bits) if vtype in (I8, I16, I32, I64) and v >= 1 << (bits - 1) else v


class _Mutator:
    def __init__(self, layout: Layout, data_start: int, file_size: int, rng: random.Random):
        self.base, self.data_start, self.size, self.rng = layout, data_start, file_size, rng
        self.ints = [k for k, v in layout.kvs if v.type in _INTS]
        self.floats = [k for k, v in layout.kvs if v.type in (F32, F64)]
        self.arrays = [k for k, v in layout.kvs if v.type == ARR]
        self.norms = [t for t in layout.tensors if t.name.endswith(b"_norm.weight") and t.type == 0]
        self.quants = [t for t in layout.tensors if GGML.get(t.type, ("", 1, 1, ()))[3]]
        self.tokens = layout.get("tokenizer.ggml.tokens")
        self.header_size = len(header_bytes(layout))

    def pick(self, seq):
        return seq[self.rng.randrange(len(seq))]

    def one(self) -> Mutant:
        ops = [(self.int_key, 10), (self.float_key, 4), (self.string_key, 3), (self.type_swap, 3),
               (self.drop_kv, 3), (self.dup_kv, 1), (self.alignment, 3), (self.vocab, 8),
               (self.special_id, 3), (self.tensor_dims, 5), (self.tensor_type, 4), (self.tensor_offset, 3),
               (self.tensor_name, 3), (self.drop_tensor, 2), (self.norm_values, 5), (self.quant_scale, 5),
               (self.header, 2), (self.byte_flip, 4), (self.cut, 2)]
        if not self.quants:
            ops = [(o, w) for o, w in ops if o != self.quant_scale]
        op = self.rng.choices([o for o, _ in ops], weights=[w for _, w in ops])[0]
        return op()

    def _layout(self, name: str, change) -> Mutant:
        layout = self.base.copy()
        name = change(layout) or name
        return Mutant(name, layout)

    def int_key(self) -> Mutant:
        key = self.pick(self.ints)

        def change(layout):
            v = next(v for k, v in layout.kvs if k == key)
            new = self.rng.choice(_INT_VALUES + [v.value + 1, v.value - 1, v.value * 2, v.value // 2])
            v.value = _int_in(v.type, new)
            return f"int {key.decode()}={v.value}"
        return self._layout("", change)

    def float_key(self) -> Mutant:
        key = self.pick(self.floats)

        def change(layout):
            v = next(v for k, v in layout.kvs if k == key)
            v.value = self.rng.choice([float("nan"), float("inf"), float("-inf"), 0.0, -1.0, 1e30, 1e-38])
            return f"float {key.decode()}={v.value}"
        return self._layout("", change)

    def string_key(self) -> Mutant:
        key, values = self.rng.choice([
            (b"general.architecture", _ARCHS),
            (b"tokenizer.ggml.model", [b"gpt2", b"llama", b"none", b"no_vocab", b"bert", b"t5", b"rwkv", b"x", b""]),
            (b"tokenizer.ggml.pre", [b"default", b"qwen2", b"smollm", b"", b"llama-bpe", b"unknown"])])

        def change(layout):
            v = next((v for k, v in layout.kvs if k == key), None)
            new = self.rng.choice(values)
            if v is None:
                layout.kvs.append((key, Value(STR, new)))
            else:
                v.type, v.value, v.elem = STR, new, None
            return f"string {key.decode()}={new!r}"
        return self._layout("", change)

    def type_swap(self) -> Mutant:
        i = self.rng.randrange(len(self.base.kvs))

        def change(layout):
            key, v = layout.kvs[i]
            to = self.rng.choice([U8, I8, U16, I32, U32, U64, F32, BOOL, STR])
            if to == STR:
                layout.kvs[i] = (key, Value(STR, b"7"))
            elif to == F32:
                layout.kvs[i] = (key, Value(F32, 7.0))
            elif to == BOOL:
                layout.kvs[i] = (key, Value(BOOL, True))
            elif v.type == ARR and v.elem in _INTS:
                v.elem = to         # an array of another element type, same values
                v.value = [_int_in(to, x) for x in v.value]
            else:
                layout.kvs[i] = (key, Value(to, _int_in(to, v.value if v.type in _INTS else 7)))
            return f"type {key.decode()} -> {layout.kvs[i][1].type}/{layout.kvs[i][1].elem}"
        return self._layout("", change)

    def drop_kv(self) -> Mutant:
        i = self.rng.randrange(len(self.base.kvs))

        def change(layout):
            key, _ = layout.kvs.pop(i)
            return f"drop key {key.decode()}"
        return self._layout("", change)

    def dup_kv(self) -> Mutant:
        i = self.rng.randrange(len(self.base.kvs))

        def change(layout):
            layout.kvs.append(layout.kvs[i])
            return f"duplicate key {layout.kvs[i][0].decode()}"
        return self._layout("", change)

    def alignment(self) -> Mutant:
        a = self.rng.choice([1, 2, 4, 8, 16, 64, 128, 0, 3, 48, 2**31])

        def change(layout):
            layout.kvs = [(k, v) for k, v in layout.kvs if k != b"general.alignment"]
            layout.kvs.insert(0, (b"general.alignment", Value(U32, a)))
            return f"alignment {a}"
        mutant = self._layout("", change)
        if a and not a & (a - 1) and self.rng.random() < 0.5:
            # The data laid out again at that alignment: tensors at offsets
            # (and the data section at a file position) that are multiples of
            # it only, as a writer honouring it would place them.
            mutant.relaid = True
            offset = 0
            for t in sorted(mutant.layout.tensors, key=lambda t: t.offset):
                t.offset = offset
                offset = -(-(offset + tensor_bytes(t)) // a) * a
            mutant.name += " relaid"
        return mutant

    def vocab(self) -> Mutant:
        kind = self.rng.choice(["dup", "nul-dup", "nul", "empty", "utf8", "drop-last", "append",
                                "types", "byte-type", "scores", "merges", "merges-empty", "merges-drop",
                                "merge-unknown-part", "merge-unjoined"])
        tokens = self.tokens.value
        i, j = self.rng.randrange(len(tokens)), self.rng.randrange(len(tokens))

        def change(layout):
            toks = layout.get("tokenizer.ggml.tokens").value
            if kind == "dup":
                toks[i] = toks[j]
            elif kind == "nul-dup":      # equal to token j once cut at the NUL, as llama.cpp stores it
                toks[i] = toks[j] + b"\x00" + toks[i][:3]
            elif kind == "nul":
                toks[i] = b"\x00" + toks[i]
            elif kind == "empty":
                toks[i] = b""
            elif kind == "utf8":
                toks[i] = b"\xff\xfe" + toks[i]
            elif kind == "drop-last":
                toks.pop()
            elif kind == "append":
                toks.append(b"<extra-probe-token>")
            elif kind in ("types", "byte-type"):
                types = layout.get("tokenizer.ggml.token_type")
                if types is None:
                    return "vocab no-op"
                types.value[i] = 6 if kind == "byte-type" else self.rng.choice([-1, 0, 3, 4, 5, 7, 100])
            elif kind == "scores":
                scores = layout.get("tokenizer.ggml.scores")
                if scores is None:
                    layout.kvs.append((b"tokenizer.ggml.scores", Value(ARR, [0.0] * (len(toks) - 1), F32)))
                else:
                    scores.value[i] = self.rng.choice([float("nan"), float("inf"), -1e30])
            elif kind == "merges":
                merges = layout.get("tokenizer.ggml.merges")
                if merges is None or not merges.value:
                    return "vocab no-op"
                merges.value[i % len(merges.value)] = self.rng.choice([b"", b"a", b" a", b"a ", b"\x00 \x00",
                                                                       b"zzqq xxyy"])
            elif kind.startswith("merge"):
                # A BPE tokenizer's merges emptied or dropped (it would spell
                # words byte by byte), or one naming a token the vocabulary
                # lacks: a part, or the two parts joined (token i then j).
                merges = layout.get("tokenizer.ggml.merges")
                if merges is None or not merges.value:
                    return "vocab no-op"
                if kind == "merges-empty":
                    merges.value.clear()
                elif kind == "merges-drop":
                    layout.kvs = [(k, v) for k, v in layout.kvs if k != b"tokenizer.ggml.merges"]
                else:
                    pair = (b"zzqq\xc4\xa0probe " + toks[j] if kind == "merge-unknown-part"
                            else toks[i].split(b" ")[0] + b" " + toks[j].split(b" ")[0])
                    merges.value[i % len(merges.value)] = pair
            return f"vocab {kind} token {i} ({j})"
        return self._layout("", change)

    def special_id(self) -> Mutant:
        key = self.rng.choice([b"tokenizer.ggml.bos_token_id", b"tokenizer.ggml.eos_token_id",
                               b"tokenizer.ggml.padding_token_id", b"tokenizer.ggml.eot_token_id",
                               b"tokenizer.ggml.unknown_token_id"])
        n = len(self.tokens.value)
        value = self.rng.choice([n, n - 1, n + 5, 2**31 - 1, 0])

        def change(layout):
            layout.kvs = [(k, v) for k, v in layout.kvs if k != key] + [(key, Value(U32, value))]
            return f"special {key.decode()}={value}"
        return self._layout("", change)

    def tensor_dims(self) -> Mutant:
        i = self.rng.randrange(len(self.base.tensors))

        def change(layout):
            t = layout.tensors[i]
            kind = self.rng.choice(["+1", "-1", "swap", "x2", "0", "huge", "add-dim", "drop-dim"])
            d = self.rng.randrange(len(t.dims))
            if kind == "+1":
                t.dims[d] += 1
            elif kind == "-1":
                t.dims[d] -= 1
            elif kind == "swap" and len(t.dims) > 1:
                t.dims[0], t.dims[1] = t.dims[1], t.dims[0]
            elif kind == "x2":
                t.dims[d] *= 2
            elif kind == "0":
                t.dims[d] = 0
            elif kind == "huge":
                t.dims[d] = 2**62
            elif kind == "add-dim":
                t.dims.append(self.rng.choice([1, 2]))
            elif kind == "drop-dim" and len(t.dims) > 1:
                t.dims.pop()
            return f"dims {t.name.decode()} {kind} -> {t.dims}"
        return self._layout("", change)

    def tensor_type(self) -> Mutant:
        i = self.rng.randrange(len(self.base.tensors))
        to = self.rng.choice(list(GGML) + [4, 5, 16, 20, 24, 28, 39, 40, 1000])

        def change(layout):
            layout.tensors[i].type = to
            return f"type {layout.tensors[i].name.decode()} -> {to}"
        return self._layout("", change)

    def tensor_offset(self) -> Mutant:
        i = self.rng.randrange(len(self.base.tensors))

        def change(layout):
            t = layout.tensors[i]
            a = layout.alignment
            t.offset = self.rng.choice([t.offset + a, t.offset - a, t.offset + 1, 0,
                                        self.size - self.data_start, 2**63, layout.tensors[-1].offset])
            return f"offset {t.name.decode()} -> {t.offset}"
        return self._layout("", change)

    def tensor_name(self) -> Mutant:
        i, j = self.rng.randrange(len(self.base.tensors)), self.rng.randrange(len(self.base.tensors))

        def change(layout):
            t = layout.tensors[i]
            t.name = self.rng.choice([layout.tensors[j].name, b"blk.999." + t.name.split(b".")[-2] + b".weight",
                                      t.name + b".x", b"", b"x" * 64, t.name.replace(b"weight", b"bias"),
                                      b"blk.-1.attn_norm.weight"])
            return f"name {self.base.tensors[i].name.decode()} -> {t.name!r}"
        return self._layout("", change)

    def drop_tensor(self) -> Mutant:
        i = self.rng.randrange(len(self.base.tensors))

        def change(layout):
            return f"drop tensor {layout.tensors.pop(i).name.decode()}"
        return self._layout("", change)

    def norm_values(self) -> Mutant:
        t = self.pick(self.norms)
        value = self.rng.choice(list(_F32))
        n = int(np.prod(t.dims))
        patches = [(t.offset + 4 * self.rng.randrange(n), struct.pack("<f", _F32[value]))
                   for _ in range(self.rng.choice([1, 1, 4]))]
        return Mutant(f"norm {t.name.decode()} {value}", patches=patches)

    def quant_scale(self) -> Mutant:
        t = self.pick(self.quants)
        name, block, size, scales = GGML[t.type]
        n_blocks = int(np.prod(t.dims)) // block
        value = self.rng.choice(list(_F16))
        b = self.rng.randrange(n_blocks)
        return Mutant(f"scale {t.name.decode()} block {b} {value}",
                      patches=[(t.offset + b * size + self.rng.choice(scales), _F16[value])])

    def header(self) -> Mutant:
        def change(layout):
            kind = self.rng.choice(["version", "n_tensors", "n_kv", "magic"])
            if kind == "version":
                layout.version = self.rng.choice([0, 1, 2, 4, 0x03000000, 2**32 - 1])
                return f"version {layout.version}"
            if kind == "magic":
                layout.magic = self.rng.choice([b"GGUG", b"FUGG", b"\x00GUF"])
                return f"magic {layout.magic!r}"
            delta = self.rng.choice([-1, 1, 2**40])
            if kind == "n_tensors":
                layout.n_tensors = len(layout.tensors) + delta
            else:
                layout.n_kv = len(layout.kvs) + 1 + delta   # + 1: the padding key
            return f"{kind} {delta:+d}"
        return self._layout("", change)

    def byte_flip(self) -> Mutant:
        flips = [(self.rng.randrange(self.header_size), self.rng.randrange(256)) for _ in range(self.rng.choice([1, 2, 8]))]
        return Mutant(f"flip {sorted(flips)}", flips=flips)

    def cut(self) -> Mutant:
        where = self.rng.choice([("header", self.rng.randrange(self.header_size)),
                                 ("data", self.rng.randrange(1 << 20)), ("data", -self.rng.randrange(1, 1 << 20))])
        return Mutant(f"cut {where[0]} {where[1]}", cut=where)


def mutants(path: Path, seed: int, n: int) -> list[Mutant]:
    """``n`` mutants of the model at ``path``, the same for the same seed."""
    layout, data_start = read_layout(path)
    m = _Mutator(layout, data_start, path.stat().st_size, random.Random(seed))
    return [m.one() for _ in range(n)]


# ---- the working copy -----------------------------------------------------------------

class Workbench:
    """A padded working copy of a model, mutated in place one mutant at a
    time (see the module docstring)."""

    def __init__(self, source: Path, workdir: Path):
        self.source, self.workdir = Path(source), Path(workdir)
        self.layout, self.src_data_start = read_layout(self.source)
        self.data_start = -(-(len(header_bytes(self.layout, 0)) + PAD_SLACK) // DATA_ALIGN) * DATA_ALIGN
        self.path = self.workdir / ("probe-" + self.source.name)
        self.cut_path = self.workdir / ("probe-cut-" + self.source.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.source, "rb") as src, open(self.path, "wb") as dst:
            self._write_header(dst, self.layout)
            src.seek(self.src_data_start)
            shutil.copyfileobj(src, dst, 16 << 20)
        self.size = self.path.stat().st_size

    def _header(self, layout: Layout) -> tuple[bytearray, int] | None:
        """``layout``'s header padded to end at ``data_start`` and the padding
        key's size; None when it does not fit."""
        bare = len(header_bytes(layout, 0))
        if bare > self.data_start:
            return None
        head = header_bytes(layout, self.data_start - bare)
        return bytearray(head), len(head) - len(header_bytes(layout))

    def _write_header(self, f, layout: Layout) -> None:
        f.seek(0)
        f.write(self._header(layout)[0])

    @contextlib.contextmanager
    def applied(self, mutant: Mutant):
        """The path of the mutated file (None when its header outgrows the
        padding); the working copy is restored afterwards."""
        padded = self._header(mutant.layout or self.layout)
        if padded is None:
            yield None
            return
        head, pad = padded
        for pos, byte in mutant.flips:
            head[pos if pos < 24 else pos + pad] = byte   # 24: magic, version and the two counts
        if mutant.cut is not None:
            with self._cut(head, pad, *mutant.cut) as path:
                yield path
            return
        if mutant.relaid:
            with self._relaid(mutant.layout) as path:
                yield path
            return
        saved = []
        with open(self.path, "r+b") as f:
            f.write(head)
            for offset, data in mutant.patches:
                f.seek(self.data_start + offset)
                saved.append((self.data_start + offset, f.read(len(data))))
                f.seek(self.data_start + offset)
                f.write(data)
        try:
            yield self.path
        finally:
            with open(self.path, "r+b") as f:
                for at, data in reversed(saved):
                    f.seek(at)
                    f.write(data)
                self._write_header(f, self.layout)

    @contextlib.contextmanager
    def _relaid(self, layout: Layout):
        """A new file: ``layout``'s header unpadded, each tensor's data copied to its offset."""
        head = header_bytes(layout)
        a = layout.alignment
        start = -(-len(head) // a) * a
        old = {t.name: t.offset for t in self.layout.tensors}
        with open(self.path, "rb") as src, open(self.cut_path, "wb") as dst:
            dst.write(head + bytes(start - len(head)))
            for t in sorted(layout.tensors, key=lambda t: t.offset):
                dst.seek(start + t.offset)
                src.seek(self.data_start + old[t.name])
                dst.write(src.read(tensor_bytes(t)))
        try:
            yield self.cut_path
        finally:
            self.cut_path.unlink(missing_ok=True)

    @contextlib.contextmanager
    def _cut(self, head: bytearray, pad: int, where: str, n: int):
        if where == "data" and n < 0:   # the copy itself, cut short, its tail put back after
            with open(self.path, "r+b") as f:
                f.seek(n, os.SEEK_END)
                tail = f.read()
                f.truncate(self.size + n)
            try:
                yield self.path
            finally:
                with open(self.path, "ab") as f:
                    f.write(tail)
            return
        with open(self.path, "rb") as src, open(self.cut_path, "wb") as dst:
            if where == "header":
                dst.write(head[:n if n < 24 else n + pad])
            else:
                dst.write(head)
                src.seek(self.data_start)
                dst.write(src.read(n))
        try:
            yield self.cut_path
        finally:
            self.cut_path.unlink(missing_ok=True)

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        self.cut_path.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- running mutants through the CLI ------------------------------------------------------

PROMPT = "The capital of France is"
NO_LOGITS = "computed no usable logits"   # a backend's refusal of logits that are all NaN (sampling.py)
COMMANDS = {   # what each mutant goes through: models info, and generate on each backend
    "info": ["models", "info", "{path}"],
    "native": ["generate", "{path}", "-m", "{path}", "--backend", "native"],
    "llama": ["generate", "{path}", "-m", "{path}", "--backend", "llama"],
}


def _command(name: str, path: Path, threads: int) -> list[str]:
    argv = [a.replace("{path}", str(path)) for a in COMMANDS[name]]
    if name != "info":
        argv[1] = PROMPT
        argv += ["--max-tokens", "4", "--drafter", "none", "--threads", str(threads), "--json"]
    return argv


@dataclass
class Outcome:
    """One command's ending."""

    code: int | None         # exit status (negative: killed by that signal); None: it hung
    error: str = ""          # the error's type and line, a traceback's last line, or the worker's last words
    text: str | None = None  # what generate answered

    @property
    def failure(self) -> str | None:
        """What must never happen, or None."""
        if self.code is None:
            return "hang"
        if self.code < 0:
            return f"killed by signal {-self.code}: {self.error}"
        if self.code not in (0, 2):
            return f"exit {self.code}: {self.error}"
        return None


@dataclass
class Run:
    mutant: str
    outcomes: dict[str, Outcome] = field(default_factory=dict)   # command name -> outcome

    @property
    def problems(self) -> list[str]:
        out = [f"{name}: {o.failure}" for name, o in self.outcomes.items() if o.failure]
        if out:
            return out
        info, native, llama = (self.outcomes.get(n) for n in ("info", "native", "llama"))
        # The native engine may not read a valid variant (llama.cpp runs it): not a disagreement.
        native_declines = native is not None and native.error.startswith("UnsupportedModelError")
        for name, o in (("native", native), ("llama", llama)):
            # Weights whose arithmetic goes non-finite are found only by computing.
            computed = o is not None and NO_LOGITS in o.error
            if info is not None and o is not None and info.code == 0 and o.code == 2 \
                    and not (name == "native" and native_declines) and not computed:
                out.append(f"models info accepted what {name} refused: {o.error}")
        if native is not None and llama is not None and native.code != llama.code and not native_declines:
            out.append(f"backends disagree: native {native.code} ({native.error}), "
                       f"llama {llama.code} ({llama.error})")
        return out


def _worker(reply_fd: int) -> None:
    """Run CLI commands read from stdin (one JSON list per line) as ``edgespec``
    would (edgespec.cli.main), answering one JSON object per command on ``reply_fd``."""
    import io
    import traceback

    from edgespec.cli import app
    from edgespec.cli import bench, chat, drafter, generate, models, moe, onnx, serve  # noqa: F401  (as main)
    from edgespec.errors import EdgespecError

    replies = os.fdopen(reply_fd, "w")
    for line in sys.stdin:
        argv = json.loads(line)
        out, err = io.StringIO(), io.StringIO()
        code, error = 0, ""
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                app(args=argv, prog_name="edgespec")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except EdgespecError as e:     # edgespec.cli.main: one line, exit 2
                code, error = 2, f"{type(e).__name__}: {e}"
            except BaseException as e:     # noqa: BLE001  (a traceback: what must never happen)
                code, error = 1, f"{type(e).__name__}: {e} | " + traceback.format_exc().strip().splitlines()[-3]
        if code and not error:
            error = (err.getvalue().strip().splitlines() or [""])[-1]
        text = None
        if code == 0 and argv[0] == "generate":
            text = json.loads(out.getvalue().strip().splitlines()[-1])["text"]
        replies.write(json.dumps({"code": code, "error": error[:300], "text": text}) + "\n")
        replies.flush()


class _Supervisor:
    """A worker process (see _worker), replaced when it dies or hangs."""

    RESTART_EVERY = 200   # commands: a fresh process now and then keeps any slow leak bounded

    def __init__(self, workdir: Path, timeout: float):
        self.workdir, self.timeout = workdir, timeout
        self.proc = None
        self.served = 0

    def _start(self) -> None:
        read_fd, write_fd = os.pipe()
        self.log = open(self.workdir / "worker.log", "w+b")
        # Every mutant is a file of its own: repacked in memory, not kept in
        # the cache (a mapped copy per mutant would only churn the disk).
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", str(write_fd)],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=self.log,
                                     pass_fds=(write_fd,), cwd=self.workdir,
                                     env={**os.environ, "EDGESPEC_REPACK": "memory"})
        os.close(write_fd)
        self.replies = os.fdopen(read_fd, "r")
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda r=self.replies, q=self.lines: [q.put(x) for x in r] + [q.put(None)],
                         daemon=True).start()
        self.served = 0

    def run(self, argv: list[str]) -> Outcome:
        if self.proc is None or self.served >= self.RESTART_EVERY:
            self.stop()
            self._start()
        self.served += 1
        self.log.seek(0)
        self.log.truncate()
        self.proc.stdin.write((json.dumps(argv) + "\n").encode())
        self.proc.stdin.flush()
        try:
            reply = self.lines.get(timeout=self.timeout)
        except queue.Empty:
            self.stop()
            return Outcome(None, f"no answer in {self.timeout:.0f} s")
        if reply is None:   # the worker died: its exit status, and what it printed last
            code = self.proc.wait()
            self.log.seek(0)
            last = [ln for ln in self.log.read().decode("utf-8", "replace").splitlines() if ln.strip()]
            self.proc = None
            return Outcome(code if code < 0 else code or 1, " | ".join(last[-3:])[:300])
        r = json.loads(reply)
        return Outcome(r["code"], r["error"], r["text"])

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            self.replies.close()
            self.log.close()


def probe(model: Path, workdir: Path, seed: int, n: int, *, commands=tuple(COMMANDS), threads: int = 1,
          timeout: float = 120, progress=None) -> list[Run]:
    """``n`` seeded mutants of ``model`` through each of ``commands`` (see the module docstring)."""
    runs = []
    sup = _Supervisor(Path(workdir), timeout)
    try:
        with Workbench(model, workdir) as bench:
            for i, m in enumerate(mutants(Path(model), seed, n)):
                run = Run(m.name)
                with bench.applied(m) as path:
                    if path is not None:
                        for name in commands:
                            t0 = time.perf_counter()
                            run.outcomes[name] = sup.run(_command(name, path, threads))
                            if progress:
                                progress(i, m, name, run.outcomes[name], time.perf_counter() - t0)
                runs.append(run)
    finally:
        sup.stop()
    return runs


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(int(sys.argv[2]))
