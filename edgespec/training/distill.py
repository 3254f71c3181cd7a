"""`edgespec drafter distill`: the target's own next-token distributions over
real text (teacher forcing), kept as top-k soft labels for `drafter train`.

The text (see ``corpus``) is tokenized with the target's tokenizer and cut
into sequences of ``ctx`` tokens; each sequence is evaluated by the target in
one batch and every position keeps the target's ``top_k`` likeliest next
tokens with their probabilities. One teacher-forced pass costs about what a
prefill costs, far less than generating the same number of tokens.

On disk, a folder:

    distill.json          the manifest: target (name, vocabulary fingerprint), lang,
                          sources, top_k, ctx, the shards written, and how many
                          sequences are done (where a resumed run goes on)
    shard-NNNNN.bin       records, each written whole (temporary file, then rename):
                          32 sequences, or what a minute labelled, so a run killed
                          (even with -9) resumes from its last shard

A record, little endian:

    b"ESDR" | n uint32 | k uint32 | crc32 uint32 of the payload | payload
    payload: tokens int32 (n,) | ids int32 (n, k) | probs float16 (n, k)
    row i of ids / probs: the target's k likeliest tokens after tokens[:i + 1],
    likeliest first, with their probabilities at temperature 1.

The manifest also keeps each shard's sha256, so a truncated or altered shard
is reported with its file and the record and byte where it goes wrong.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from ..errors import DrafterError, InvalidArgumentError
from ..files import sha256_file, write_atomic
from ..progress import Progress
from . import corpus

MANIFEST = "distill.json"
FORMAT = 1
RECORD_MAGIC = b"ESDR"
_HEAD = struct.Struct("<4sIII")
SEQUENCES_PER_SHARD = 32
CHECKPOINT_SECONDS = 60   # a shard at least this often: a killed run (-9) loses at most this much
MIN_SEQUENCE = 16   # a document's tail shorter than this is left out
SHUFFLE_SEED = 0


@dataclass
class Record:
    tokens: np.ndarray  # (n,) int32
    ids: np.ndarray     # (n, k) int32
    probs: np.ndarray   # (n, k) float16


# -- the shard format ------------------------------------------------------------

def encode_record(rec: Record) -> bytes:
    n, k = rec.ids.shape
    payload = (rec.tokens.astype("<i4").tobytes() + rec.ids.astype("<i4").tobytes()
               + rec.probs.astype("<f2").tobytes())
    return _HEAD.pack(RECORD_MAGIC, n, k, zlib.crc32(payload)) + payload


def read_shard(path: Path) -> Iterator[Record]:
    """The records of one shard, each checked; DrafterError names the file,
    the record and its byte offset where the data is damaged."""
    data = path.read_bytes()
    pos, index = 0, 0
    while pos < len(data):
        where = f"{path}: record {index} at byte {pos}"
        if len(data) - pos < _HEAD.size:
            raise DrafterError(f"{where}: truncated (header cut short)")
        magic, n, k, crc = _HEAD.unpack_from(data, pos)
        if magic != RECORD_MAGIC or n == 0 or k == 0:
            raise DrafterError(f"{where}: not a distillation record")
        size = n * 4 + n * k * 6
        payload = data[pos + _HEAD.size:pos + _HEAD.size + size]
        if len(payload) != size:
            raise DrafterError(f"{where}: truncated ({len(payload)} of {size} payload bytes)")
        if zlib.crc32(payload) != crc:
            raise DrafterError(f"{where}: checksum mismatch")
        tokens = np.frombuffer(payload, "<i4", n)
        ids = np.frombuffer(payload, "<i4", n * k, n * 4).reshape(n, k)
        probs = np.frombuffer(payload, "<f2", n * k, n * 4 + n * k * 4).reshape(n, k)
        yield Record(tokens, ids, probs)
        pos += _HEAD.size + size
        index += 1


class DistillSet:
    """A distillation folder: its manifest, checked, and its records."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        path = self.folder / MANIFEST
        if not path.is_file():
            raise DrafterError(f"{self.folder}: no {MANIFEST} (not a folder written by edgespec drafter distill)")
        try:
            self.manifest = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise DrafterError(f"{path}: unreadable manifest ({e})") from None
        if not isinstance(self.manifest, dict) or self.manifest.get("format") != FORMAT:
            raise DrafterError(f"{path}: not a distillation manifest of format {FORMAT}")

    def __getattr__(self, key: str):
        try:
            return self.manifest[key]
        except KeyError:
            raise AttributeError(key) from None

    def verify(self) -> None:
        """Check every shard's size and sha256 against the manifest."""
        for shard in self.manifest["shards"]:
            path = self.folder / shard["file"]
            if not path.is_file():
                raise DrafterError(f"{path}: missing (listed in {MANIFEST})")
            size = path.stat().st_size
            if size != shard["bytes"]:
                raise DrafterError(f"{path}: {size} bytes, the manifest says {shard['bytes']} "
                                   f"(truncated or altered at byte {min(size, shard['bytes'])})")
            if sha256_file(path) != shard["sha256"]:
                list(read_shard(path))  # names the damaged record when the damage is inside one
                raise DrafterError(f"{path}: sha256 differs from the manifest's")

    def records(self) -> Iterator[Record]:
        for shard in self.manifest["shards"]:
            yield from read_shard(self.folder / shard["file"])


# -- distillation ---------------------------------------------------------------------

@dataclass
class DistillParams:
    lang: str
    sources: Sequence[str]
    top_k: int = 16
    ctx: int = 256
    max_tokens: int | None = None    # stop after this many labelled tokens (None: all the text)
    minutes: float | None = None     # stop after this long (None: no limit)
    held_out: bool = True            # leave out text shared with the benchmark suites
    mode: str = "text"               # "text": label the text itself; "generate": the target's own
                                     # continuations of each sequence's first prompt_tokens
    prompt_tokens: int = 64          # generate mode: the prompt taken from each sequence
    temperature: float = 0.0         # generate mode: 0 = greedy, else sampled (seeded per sequence)


def check_lang(lang: str) -> None:
    if not lang or not lang.replace("-", "").replace("_", "").isalnum():
        raise InvalidArgumentError(f"--lang must be a language or domain tag such as python or deu, got {lang!r}")


def check_params(p: DistillParams) -> None:
    check_lang(p.lang)
    if not 1 <= p.top_k <= 64:
        raise InvalidArgumentError(f"--top-k must be in [1, 64], got {p.top_k}")
    if not MIN_SEQUENCE <= p.ctx <= 4096:
        raise InvalidArgumentError(f"--ctx must be in [{MIN_SEQUENCE}, 4096], got {p.ctx}")
    if p.max_tokens is not None and p.max_tokens < 1:
        raise InvalidArgumentError(f"--tokens must be positive, got {p.max_tokens}")
    if p.minutes is not None and not p.minutes > 0:
        raise InvalidArgumentError(f"--minutes must be positive, got {p.minutes}")
    if not p.sources:
        raise InvalidArgumentError("give at least one --source")
    if p.mode not in ("text", "generate"):
        raise InvalidArgumentError(f"--mode must be text or generate, got {p.mode!r}")
    if p.mode == "generate" and not 1 <= p.prompt_tokens < p.ctx - 1:
        raise InvalidArgumentError(f"--prompt-tokens must be in [1, {p.ctx - 2}] (below --ctx), got {p.prompt_tokens}")
    if not 0 <= p.temperature <= 2:
        raise InvalidArgumentError(f"--temperature must be in [0, 2], got {p.temperature}")


def sequences(tokenize: Callable[[str], list[int]], docs: Sequence[corpus.Document], ctx: int,
              bos: int | None) -> list[list[int]]:
    """Each document's tokens cut into pieces of at most ``ctx`` (BOS first
    when the target adds one), tails under MIN_SEQUENCE tokens left out."""
    out = []
    step = ctx - (bos is not None)
    for doc in docs:
        toks = tokenize(doc.text)
        for a in range(0, len(toks), step):
            piece = toks[a:a + step]
            if len(piece) >= MIN_SEQUENCE:
                out.append(([bos] if bos is not None else []) + piece)
    return out


def top_k_rows(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, probs) of the k likeliest tokens of each row of ``logits`` (n, V), likeliest first."""
    ids = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    picked = np.take_along_axis(logits, ids, axis=1)
    order = np.argsort(-picked, axis=1, kind="stable")
    ids, picked = np.take_along_axis(ids, order, axis=1), np.take_along_axis(picked, order, axis=1)
    top = logits.max(axis=1, keepdims=True)
    log_z = top + np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
    return ids.astype(np.int32), np.exp(picked - log_z).astype(np.float16)


def distill(backend, target_name: str, out: str | os.PathLike, params: DistillParams, *,
            fingerprint: str, progress: bool = True,
            continue_: Callable[[list[int], int, int], list[int]] | None = None) -> dict:
    """Label the text of ``params`` with ``backend`` (the target) into the
    folder ``out``, going on from where an earlier run on the same folder
    stopped. Returns the manifest. In generate mode, ``continue_(prompt,
    max_tokens, seed)`` returns the target's continuation of a prompt (an
    engine on the same backend), and the prompt plus it is what is labelled."""
    from ..capi import ffi

    check_params(params)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    docs, dropped, text_sha256 = shuffled_documents(params.lang, params.sources, params.held_out, progress)
    config = {"format": FORMAT, "target": target_name, "target_vocab": fingerprint,
              "target_n_vocab": backend.n_vocab, "lang": params.lang, "sources": list(params.sources),
              "top_k": params.top_k, "ctx": params.ctx, "held_out": params.held_out,
              "text_sha256": text_sha256, "mode": params.mode}
    if params.mode == "generate":
        if continue_ is None:
            raise InvalidArgumentError("generate mode needs the target's engine (distill_model opens one)")
        config.update(prompt_tokens=params.prompt_tokens, temperature=params.temperature)
    manifest = _resume(out, config)
    bos = backend.bos_token if backend.adds_bos else None
    seqs = sequences(lambda t: backend.tokenize(t, add_special=False), docs, params.ctx, bos)
    if not seqs:
        raise InvalidArgumentError(f"the sources of --lang {params.lang} hold no text to distil")
    manifest.update(documents=len(docs), held_out_paragraphs=dropped, sequences_total=len(seqs),
                    tokens_total=sum(len(s) for s in seqs))
    start = goal = manifest["sequences"]
    if params.max_tokens is None:
        goal = len(seqs)
    else:   # whole sequences until --tokens is reached
        budget = params.max_tokens - manifest["tokens"]
        while goal < len(seqs) and budget > 0:
            budget -= len(seqs[goal])
            goal += 1
    deadline = time.monotonic() + params.minutes * 60 if params.minutes else None
    bar = _TokenProgress("distil", sum(len(s) for s in seqs[start:goal]), enabled=progress)
    pending: list[bytes] = []
    pending_tokens = 0
    t0 = time.monotonic()
    try:
        for i, seq in enumerate(seqs[start:goal], start):
            if deadline is not None and time.monotonic() > deadline:
                break
            if params.mode == "generate":
                prompt = seq[:params.prompt_tokens]
                seq = prompt + continue_(prompt, params.ctx - len(prompt), i)
            backend.clear()
            addr = backend.decode(seq, logits_from=0)
            logits = np.frombuffer(ffi.buffer(ffi.cast("float *", addr), 4 * len(seq) * backend.n_vocab),
                                   dtype=np.float32).reshape(len(seq), backend.n_vocab)
            ids, probs = top_k_rows(logits, params.top_k)
            pending.append(encode_record(Record(np.asarray(seq, np.int32), ids, probs)))
            pending_tokens += len(seq)
            if len(pending) == SEQUENCES_PER_SHARD or time.monotonic() - t0 >= CHECKPOINT_SECONDS:
                _flush(out, manifest, pending, pending_tokens, time.monotonic() - t0)
                pending, pending_tokens, t0 = [], 0, time.monotonic()
            bar.update(len(seqs[i]), f"{bar.rate():.0f} tok/s")
    finally:
        # An interruption keeps what was labelled: the records so far become a shard.
        _flush(out, manifest, pending, pending_tokens, time.monotonic() - t0)
        bar.done()
    return manifest


def distill_model(model: str | None, out: str | os.PathLike, params: DistillParams, *, backend: str | None = None,
                  threads: int | None = None, progress: bool = True) -> dict:
    """``distill`` with the target opened from a model reference (a built-in
    name, a GGUF path, hf:...; default: the built-in default) on the native
    or llama backend. Returns the manifest."""
    from ..backends import default_backend, open_backend
    from ..models import registry
    from ..drafters.model import target_fingerprint

    check_params(params)
    ref = model or registry.default_model()
    path = registry.model_path_checked(ref)
    name = backend or default_backend(ref)
    if name not in ("native", "llama"):
        raise InvalidArgumentError(f"distillation runs on the native or llama backend, not {name}")
    if params.mode == "text":
        with open_backend(name, path, n_ctx=params.ctx, n_batch=params.ctx, threads=threads) as target:
            return distill(target, registry.model_name(ref), out, params, fingerprint=target_fingerprint(target),
                           progress=progress)
    from ..engine import Engine

    # Self-distillation: the target continues each prompt (speculating with prompt lookup
    # to go faster; the output is the target's own either way), then labels it.
    with Engine(ref, backend=name, threads=threads, n_ctx=params.ctx + 64, n_batch=max(params.ctx, 64),
                drafter="ngram" if params.temperature == 0 else "none") as engine:
        def continue_(prompt: list[int], max_tokens: int, seed: int) -> list[int]:
            return engine.generate(prompt, max_tokens=max_tokens, temperature=params.temperature,
                                   seed=seed).tokens
        return distill(engine.backend, registry.model_name(ref), out, params,
                       fingerprint=target_fingerprint(engine.backend), progress=progress, continue_=continue_)


def _resume(out: Path, config: dict) -> dict:
    path = out / MANIFEST
    if not path.exists():
        return {**config, "shards": [], "sequences": 0, "tokens": 0, "seconds": 0.0}
    done = DistillSet(out)
    for key, value in config.items():
        # The target is known by its vocabulary; its name (a path, a built-in name) may differ.
        if key != "target" and done.manifest.get(key) != value:
            raise InvalidArgumentError(f"{out} holds a distillation with {key} {done.manifest.get(key)!r}, "
                                       f"not {value!r}: use another --out folder")
    done.verify()
    return done.manifest


def _flush(out: Path, manifest: dict, pending: list[bytes], tokens: int, seconds: float) -> None:
    if pending:
        append_shard(out, MANIFEST, manifest, "bin", b"".join(pending), len(pending), tokens, seconds)


def shuffled_documents(lang: str, sources: Sequence[str], held_out: bool,
                       progress: bool) -> tuple[list[corpus.Document], int, str]:
    """The documents of ``sources`` (the suites' paragraphs left out when
    ``held_out``), shuffled once, deterministically, so that any prefix of a
    run samples every source; how many paragraphs were left out; the sha256
    of their text, which a resumed run must find again."""
    texts = corpus.source_texts(lang, sources, progress=progress)
    docs, dropped = corpus.documents(texts, corpus.HeldOut.suites() if held_out else None)
    random.Random(SHUFFLE_SEED).shuffle(docs)
    digest = hashlib.sha256()
    for doc in docs:
        digest.update(doc.text.encode("utf-8", "surrogatepass"))
    return docs, dropped, digest.hexdigest()


def append_shard(out: Path, manifest_file: str, manifest: dict, ext: str, data: bytes, sequences: int,
                 tokens: int, seconds: float) -> None:
    """``data`` as the folder's next shard, then the manifest listing it
    (each written whole): a run killed between the two leaves a shard no
    manifest lists, which the next run writes over."""
    name = f"shard-{len(manifest['shards']):05d}.{ext}"
    write_atomic(out / name, data)
    manifest["shards"].append({"file": name, "sequences": sequences, "bytes": len(data),
                               "sha256": hashlib.sha256(data).hexdigest()})
    manifest["sequences"] += sequences
    manifest["tokens"] += tokens
    manifest["seconds"] = round(manifest["seconds"] + seconds, 1)
    write_atomic(out / manifest_file, json.dumps(manifest, indent=1, ensure_ascii=False).encode())


class _TokenProgress(Progress):
    """Tokens labelled, and the time left at the rate so far."""

    def __init__(self, name: str, total: int, enabled: bool):
        super().__init__(name, total, enabled=enabled, lines=True)
        self.t0 = time.monotonic()

    def rate(self) -> float:
        return self.count / max(time.monotonic() - self.t0, 1e-9)

    def counter(self) -> str:
        left = int((self.total - self.count) / max(self.rate(), 1e-9)) if self.count else 0
        return f"{self.count}/{self.total} tokens  ETA {left // 60}:{left % 60:02d}"
