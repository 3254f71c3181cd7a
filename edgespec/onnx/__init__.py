"""ONNX exports of GGUF models, for ONNX Runtime and the NPUs behind it.

* ``export``: a GGUF model as an ONNX decoder graph (dynamic, or static
  shapes for NPUs), the folder format the onnx backend reads
  (edgespec.backends.onnx), and the cache of exports made on first use;
* ``qdq``: the QDQ form NPU providers take (calibrated through the onnx
  backend itself).

This package sits above the backends: the exporter runs the onnx backend to
calibrate, the backend never runs the exporter. Importing it extends
edgespec.models.resolve_model to the onnx backend (``resolve_export``:
exporting a GGUF model on first use).
"""
from __future__ import annotations

from pathlib import Path

from ..backends.onnx import load_export
from ..models import extend_resolve_model, registry


def resolve_export(ref: str, *, weights: str = "int4") -> Path:
    """What the onnx backend opens for model reference ``ref`` (a built-in
    name, a path, ``hf:...``): an exported folder, or a GGUF model exported
    into the cache on first use (``weights``)."""
    path = Path(ref).expanduser()
    if path.is_dir():
        load_export(path)  # fails clearly on a folder that is not an export
        return path
    from .export import cached_export, check_weights   # the exporter (and onnx) only when exporting

    return cached_export(registry.model_path_checked(ref), check_weights(weights), model_ref=ref)


extend_resolve_model("onnx", resolve_export)
