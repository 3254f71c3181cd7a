"""Inference backends, one module each, found by name: ``edgespec.backends.<name>``.

A backend evaluates tokens into a KV cache and exposes logits rows by address;
everything above it (sampling, verification, drafting) is backend-agnostic.
"""
from __future__ import annotations

import importlib
import inspect
import os
from pathlib import Path
from typing import Protocol

from ..errors import InvalidArgumentError

BACKENDS = ("llama", "native", "onnx")


def default_threads() -> int:
    """Physical cores are what matters for decoding; on SMT machines with many
    logical CPUs use half of them."""
    n = os.cpu_count() or 1
    return n if n <= 4 else n // 2


class Backend(Protocol):
    """What the engine needs from a backend.

    Logits are exposed by address: ``decode`` returns where the first row of
    (n_rows, n_vocab) float32 logits lies, valid until the next ``decode``.
    """

    name: str
    n_vocab: int
    n_ctx: int
    n_batch: int
    threads: int

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]: ...
    def piece(self, token: int) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...
    def token_text(self, token: int) -> str: ...
    def metadata(self, key: str) -> str | None: ...
    bos_token: int
    eos_token: int
    def decode(self, tokens: list[int], start: int, *, logits_from: int | None = None,
               seq_id: int = 0) -> int: ...
    def decode_tree(self, prefix: list[int], tokens: list[int], parents: list[int], start: int) -> int: ...
    def drop_tree(self, n_keep: int) -> None: ...
    def truncate(self, n_keep: int, seq_id: int = 0) -> None: ...
    def clear(self) -> None: ...
    def close(self) -> None: ...


def _module(name: str):
    if name not in BACKENDS:
        raise InvalidArgumentError(f"unknown backend '{name}' (available: {', '.join(BACKENDS)})")
    return importlib.import_module(f"{__name__}.{name}")


def resolve_model(name: str, ref: str) -> Path:
    """What backend ``name`` opens for model reference ``ref``: a GGUF file
    (checked), or what the backend's own ``resolve_model`` makes of it (the
    onnx backend: an exported folder, exporting on first use)."""
    module = _module(name)
    if hasattr(module, "resolve_model"):
        return module.resolve_model(ref)
    from ..models import registry

    return registry.model_path_checked(ref)


def open_backend(name: str, path: Path, **kwargs) -> Backend:
    """Open backend ``name`` on ``path``. Options a backend does not take
    (``gpu_layers`` for onnx, ``ep`` for llama, ...) are left out, so one set
    of options serves a target and a draft model on different backends."""
    cls = _module(name).BACKEND
    params = inspect.signature(cls).parameters
    return cls(path, **{k: v for k, v in kwargs.items() if k in params})
