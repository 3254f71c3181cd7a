"""Inference backends, one module each, found by name: ``edgespec.backends.<name>``.

Each module's ``BACKEND`` subclasses ``base.Backend``, which owns the KV-cache
protocol; a backend supplies only evaluation and truncation. Everything above
(sampling, verification, drafting) is backend-agnostic.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from pathlib import Path

from ..config import BACKENDS  # noqa: F401  (re-exported: one list, the config's)
from ..errors import ExtraNotInstalledError, InvalidArgumentError
from .base import Backend, GroupStep, Interrupted, default_threads  # noqa: F401  (the contract, re-exported)

# Architectures the native engine decodes at least as fast as llama.cpp
# (benchmarks/bench_native.py speed, 2 threads, native / llama.cpp: llama
# (smollm2-135m) 1.14x, qwen2 0.5B 1.05x and 1.5B 1.11x on a quiet machine;
# gemma3-270m faster too, measured on a busy one): there it is the default
# backend, and its bit-exact speculation is what users get unasked.
# Mixture-of-experts files (qwen3moe, llama with experts) stay on llama.cpp.
NATIVE_DEFAULT_ARCHS = ("llama", "qwen2", "gemma3")


def default_backend(model: str | os.PathLike, gpu_layers: int = 0) -> str:
    """The backend a model runs on when none is named: native for the
    architectures of NATIVE_DEFAULT_ARCHS, onnx for an exported folder, llama
    (llama.cpp) for everything else and whenever layers go to a GPU (without
    the llama extra: native for any architecture it reads).
    ``model`` is a model reference (resolved, and downloaded if it must be)."""
    from ..models import registry
    from ..models.gguf import GGUFFile, architectures

    if gpu_layers > 0:
        return "llama"
    if Path(model).expanduser().is_dir():
        return "onnx"
    with GGUFFile(registry.resolve(str(model))) as f:
        arch = f.get("general.architecture")
        dense = not f.get(f"{arch}.expert_count", 0)
    if arch in NATIVE_DEFAULT_ARCHS and dense:
        return "native"
    # without the llama extra, what the native engine reads (MoE files) runs on it
    if arch in architectures() and importlib.util.find_spec("llama_cpp") is None:
        return "native"
    return "llama"


def _lacks_llama(e: ModuleNotFoundError) -> bool:
    """Whether an import failed for want of llama-cpp-python (the llama extra)."""
    return (e.name or "").partition(".")[0] == "llama_cpp"


def _module(name: str):
    if name not in BACKENDS:
        raise InvalidArgumentError(f"unknown backend '{name}' (available: {', '.join(BACKENDS)})")
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if not _lacks_llama(e):
            raise
        raise ExtraNotInstalledError(f"the {name} backend runs on llama.cpp, which is not installed: "
                                     "pip install 'edgespec[llama]'") from None


def check_model(ref: str) -> Path:
    """The file of ``ref``, checked as the backends check it before reading
    weights, so that `edgespec models info` gives the verdict `generate`
    would: the GGUF validated (registry.model_path_checked), its tokenizer
    built and tried on a text of letters, digits, punctuation and a non-ASCII
    letter, then, with the llama extra, read by llama.cpp without its
    tensors' data (llama.check_loadable). ModelFormatError otherwise."""
    from ..models import registry
    from .vocab import Vocab

    path = registry.model_path_checked(ref)
    with Vocab.load(path) as vocab:
        vocab.tokenize("Hello, world: 42 caf\u00e9!")
    try:
        from .llama import check_loadable
    except ModuleNotFoundError as e:
        if not _lacks_llama(e):
            raise
        return path   # the native engine validates the whole file as it loads it
    check_loadable(path)
    return path


def open_backend(name: str, path: Path, **options) -> Backend:
    """Open backend ``name`` on ``path`` with ``options`` (its keyword
    arguments). An option the backend does not take is an InvalidArgumentError
    naming the backends that do (``gpu_layers`` on native: only llama.cpp
    offloads layers), unless it asks for nothing (None, 0, False, one slot)."""
    cls = _module(name).BACKEND
    params = inspect.signature(cls).parameters
    for key, value in options.items():
        if key not in params and value not in (None, 0, False) and not (key == "slots" and value == 1):
            takers = [b for b in BACKENDS if b != name and key in inspect.signature(_module(b).BACKEND).parameters]
            raise InvalidArgumentError(f"{key} does not apply to the {name} backend"
                                       + (f" (it applies to the {' and '.join(takers)} backend"
                                          f"{'s' if len(takers) > 1 else ''})" if takers else ""))
    return cls(path, **{k: v for k, v in options.items() if k in params})