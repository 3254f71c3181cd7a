"""Models: the built-in registry and cache (``registry``, ``manifest.json``),
reading and validating GGUF files (``gguf``, ``validate``), and
``resolve_model``: what a backend opens for a model reference."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..errors import InvalidArgumentError

GGUF_BACKENDS = ("llama", "native")   # the backends that open a GGUF file themselves
_EXTENSIONS: dict[str, Callable[[str], Path]] = {}   # backend -> its own resolver (extend_resolve_model)


def extend_resolve_model(backend: str, resolve: Callable[[str], Path]) -> None:
    """Let a package above this one say what ``backend`` opens for a model
    reference (edgespec.onnx: an exported folder, made on first use)."""
    _EXTENSIONS[backend] = resolve


def resolve_model(backend: str, ref: str) -> Path:
    """What ``backend`` opens for model reference ``ref`` (a built-in name,
    pulled on first use; a path; ``hf:...``): for llama.cpp the GGUF file,
    checked; for the native engine the file unchecked, since es_model_load
    validates all of it before anything (llama.cpp's vocabulary load
    included) reads it; for another backend what its extension says."""
    from . import registry

    if backend in _EXTENSIONS:
        return _EXTENSIONS[backend](ref)
    if backend not in GGUF_BACKENDS:
        raise InvalidArgumentError(f"no model resolver for the {backend} backend (available: "
                                   f"{', '.join(GGUF_BACKENDS + tuple(_EXTENSIONS))})")
    return registry.resolve(ref) if backend == "native" else registry.model_path_checked(ref)
