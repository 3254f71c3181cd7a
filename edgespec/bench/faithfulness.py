"""Faithfulness: how close an engine's logits are to the exact evaluation of
the same quantized weights (edgespec.bench.reference), teacher-forced over
real text.

Agreeing with llama.cpp token by token is the wrong yardstick: llama.cpp
agrees with itself between batch sizes only ~94.5% top-1 on quantized models.
Instead each backend is compared with the float64 reference: mean
KL(reference || engine) in nats and top-1 agreement, over every position.

    text_tokens(backend, n)                  n tokens of the shipped suites' text
    measure(path, backends, positions, ...)  {backend: {"mean_kl", "top1", ...}}
"""
from __future__ import annotations

import ctypes
import itertools
import time
from pathlib import Path

import numpy as np

from ..backends import open_backend
from . import prompts
from .reference import Reference, kl_rows

CHUNK = 128   # positions whose logits (reference and engine) are held at once


def real_text() -> str:
    """The shipped suites' prompts taken round-robin (code, multilingual, edit,
    chat, code, ...): real text of every kind the benchmark measures."""
    per_suite = [prompts.load_suite(name) for name in prompts.SUITES]
    return "\n\n".join(p.prompt for group in itertools.zip_longest(*per_suite) for p in group if p)


def text_tokens(backend, n: int) -> list[int]:
    """The first ``n`` tokens of real_text() (with the model's BOS where it has one)."""
    tokens = backend.tokenize(real_text())
    if len(tokens) < n:
        raise ValueError(f"the suites' text is only {len(tokens)} tokens for this model, {n} asked")
    return tokens[:n]


def engine_logits(backend, tokens: list[int]):
    """(positions, n_vocab) float32 logits of ``tokens`` teacher-forced from an
    empty cache, fed in chunks of the backend's batch: yields (start, rows)."""
    backend.clear()
    for start in range(0, len(tokens), backend.n_batch):
        chunk = tokens[start:start + backend.n_batch]
        addr = backend.decode(chunk, logits_from=0)
        buf = (ctypes.c_float * (len(chunk) * backend.n_vocab)).from_address(addr)
        yield start, np.ctypeslib.as_array(buf).reshape(len(chunk), backend.n_vocab).copy()


def measure(path: str | Path, backends: list[str], positions: int, *, threads: int | None = None,
            tokens: list[int] | None = None) -> dict:
    """Mean KL(reference || backend) and top-1 agreement of each backend over
    ``positions`` teacher-forced positions of real text (or ``tokens``)."""
    ref = Reference(path)
    result: dict = {"arch": ref.arch, "positions": positions, "backends": {}}
    hidden = None
    for name in backends:
        with open_backend(name, Path(path), n_ctx=positions + 16, threads=threads) as b:
            if tokens is None:
                tokens = text_tokens(b, positions)
            if hidden is None:
                t0 = time.perf_counter()
                hidden = ref.hidden(tokens)
                result["reference_s"] = round(time.perf_counter() - t0, 1)
            kl, same = [], []
            for start, rows in engine_logits(b, tokens):
                for a in range(0, len(rows), CHUNK):
                    want = ref.logits(hidden[start + a:start + a + CHUNK])
                    got = rows[a:a + CHUNK]
                    kl.append(kl_rows(want, got))
                    same.append(want.argmax(axis=1) == got.argmax(axis=1))
            kl_all, same_all = np.concatenate(kl), np.concatenate(same)
            result["backends"][name] = {"mean_kl": float(kl_all.mean()), "max_kl": float(kl_all.max()),
                                        "top1": float(same_all.mean())}
    result["positions"] = len(tokens)
    return result
