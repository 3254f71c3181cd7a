"""Inference backends, one module each, found by name: ``edgespec.backends.<name>``.

Each module's ``BACKEND`` subclasses ``base.Backend``, which owns the KV-cache
protocol; a backend supplies only evaluation and truncation. Everything above
(sampling, verification, drafting) is backend-agnostic.
"""
from __future__ import annotations

import importlib
import inspect
import os
from pathlib import Path

from ..errors import InvalidArgumentError
from .base import Backend, Interrupted  # noqa: F401  (the contract, re-exported)

BACKENDS = ("llama", "native", "onnx")


def default_threads() -> int:
    """Physical cores are what matters for decoding; on SMT machines with many
    logical CPUs use half of them."""
    n = os.cpu_count() or 1
    return n if n <= 4 else n // 2


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
