"""``edgespec export-onnx``: a GGUF model as an ONNX decoder graph for ONNX Runtime
(see edgespec.backends.onnx_export); run it with ``--backend onnx --model OUT_DIR``."""
from __future__ import annotations

import time

import typer

from . import app
from .options import MODEL_HELP


@app.command("export-onnx")
def export_onnx(
    model: str = typer.Argument(..., help=MODEL_HELP),
    out_dir: str = typer.Argument(..., help="New or empty folder to write model.onnx and edgespec-onnx.json into."),
    weights: str = typer.Option("int4", help="int4 (GGUF 4-bit blocks kept as they are, other types "
                                             "8-bit), int8, fp16 or fp32."),
    static_shapes: bool = typer.Option(False, "--static-shapes",
                                       help="Fixed shapes for NPU compilers: 16 tokens per call, "
                                            "a 1024-slot KV cache written through cache_slots."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress on stderr."),
):
    """Export a GGUF llama-architecture model to ONNX (contrib ops: MatMulNBits,
    RotaryEmbedding, SkipSimplifiedLayerNormalization) with explicit KV-cache inputs."""
    from ..backends import onnx_export
    from ..models import registry

    onnx_export.check_weights(weights)  # before fetching or reading anything
    onnx_export.check_out_dir(out_dir)
    path = registry.model_path_checked(model)
    t0 = time.perf_counter()
    folder = onnx_export.export(path, out_dir, weights=weights, static_shapes=static_shapes,
                                model_ref=model, progress=not quiet)
    typer.echo(f"exported {model} ({weights}{', static shapes' if static_shapes else ''}) to {folder} "
               f"in {time.perf_counter() - t0:.1f} s", err=True)
    typer.echo(str(folder))
