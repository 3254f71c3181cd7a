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
                                             "8-bit), int8, fp16, fp32, or qdq (for NPU providers such as "
                                             "QNN: int8 weights, uint16 activations, calibrated here; "
                                             "implies --static-shapes)."),
    static_shapes: bool = typer.Option(False, "--static-shapes",
                                       help="Fixed shapes for NPU compilers: 16 tokens per call, "
                                            "a --cache-len-slot KV cache written through cache_slots."),
    cache_len: int = typer.Option(1024, "--cache-len", help="KV cache slots of a --static-shapes graph "
                                                            "(the context is 16 fewer)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress on stderr."),
):
    """Export a GGUF model (llama, qwen2, gemma3) to ONNX with explicit KV-cache
    inputs (contrib ops: MatMulNBits, GroupQueryAttention, SkipSimplifiedLayerNormalization)."""
    from ..backends import onnx_export
    from ..models import registry

    onnx_export.check_weights(weights)  # before fetching or reading anything
    static_shapes = static_shapes or weights == "qdq"
    if static_shapes:
        onnx_export.check_cache_len(cache_len)
    onnx_export.check_out_dir(out_dir)
    path = registry.model_path_checked(model)
    t0 = time.perf_counter()
    folder = onnx_export.export(path, out_dir, weights=weights, static_shapes=static_shapes,
                                cache_len=cache_len, model_ref=model, progress=not quiet)
    typer.echo(f"exported {model} ({weights}{', static shapes' if static_shapes else ''}) to {folder} "
               f"in {time.perf_counter() - t0:.1f} s", err=True)
    typer.echo(str(folder))


@app.command("onnx-placement")
def onnx_placement(
    folder: str = typer.Argument(..., help="A folder from `edgespec export-onnx`."),
    ep: str = typer.Option("cpu", "--ep", help="Execution provider (as --ep of generate)."),
):
    """Where an exported graph's nodes run on an execution provider: the fraction
    placed on it, and each node it leaves to the CPU (name and operator). A QDQ
    graph's input quantization and output dequantization run on the CPU by
    design (counted as placed, and said)."""
    from pathlib import Path

    from ..backends import onnx, onnx_export

    meta = onnx_export.load_export(Path(folder))
    report = onnx.placement(Path(folder) / meta["model"], ep)
    n, placed, boundary = report["nodes"], report["on_provider"], len(report["boundary"])
    typer.echo(f"{placed} of {n} nodes ({100 * placed / n:.1f}%) on {report['provider']}"
               + (f"; {boundary} more quantize the graph's inputs and dequantize its outputs on the CPU "
                  "(the provider's boundary)" if boundary else ""))
    for node, op in report["fallback"]:
        typer.echo(f"  on the CPU: {node} ({op})")
