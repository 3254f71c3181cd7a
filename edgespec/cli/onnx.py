"""``edgespec export-onnx``: a GGUF model as an ONNX decoder graph for ONNX Runtime
(see edgespec.onnx.export); run it with ``--backend onnx --model OUT_DIR``."""
from __future__ import annotations

import time
from typing import Optional

import typer

from ..errors import InvalidArgumentError
from .base import app
from ..config import MODEL_HELP


@app.command("export-onnx")
def export_onnx(
    model: str = typer.Argument(..., help=MODEL_HELP),
    out_dir: str = typer.Argument(..., help="New or empty folder to write model.onnx and edgespec-onnx.json into."),
    weights: str = typer.Option("int4", help="int4 (GGUF 4-bit blocks kept as they are, other types "
                                             "8-bit), int8, fp16, fp32, or qdq (for NPU providers such as "
                                             "QNN: int8 weights, uint16 activations, calibrated here; "
                                             "implies --static-shapes)."),
    static_shapes: bool = typer.Option(False, "--static-shapes",
                                       help="Fixed shapes for NPU compilers: --call-size tokens per call, "
                                            "a --cache-len-slot KV cache written through cache_slots."),
    call_size: Optional[int] = typer.Option(None, "--call-size", help="Tokens per call of a --static-shapes graph (2-64): "
                                                          "plain steps, verification of up to N-1 drafted "
                                                          "tokens and prefill chunks all take this shape; "
                                                          "smaller is cheaper per decoded token [default: 16]."),
    cache_len: int = typer.Option(1024, "--cache-len", help="KV cache slots of a --static-shapes graph "
                                                            "(the context is --call-size fewer)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress on stderr."),
):
    """Export a GGUF model (llama, qwen2, gemma3) to ONNX with explicit KV-cache
    inputs (contrib ops: MatMulNBits, GroupQueryAttention, SkipSimplifiedLayerNormalization)."""
    from ..onnx import export as onnx_export
    from ..models import registry

    onnx_export.check_weights(weights)  # before fetching or reading anything
    static_shapes = static_shapes or weights == "qdq"
    if call_size is not None and not static_shapes:
        raise InvalidArgumentError("--call-size applies to --static-shapes (and --weights qdq) exports")
    call_size = onnx_export.STATIC_SEQ if call_size is None else call_size
    if static_shapes:
        onnx_export.check_cache_len(cache_len, onnx_export.check_call_size(call_size))
    onnx_export.check_out_dir(out_dir)
    path = registry.model_path_checked(model)
    t0 = time.perf_counter()
    folder = onnx_export.export(path, out_dir, weights=weights, static_shapes=static_shapes,
                                cache_len=cache_len, call_size=call_size, model_ref=model, progress=not quiet)
    shapes = f", static shapes: {call_size} tokens per call" if static_shapes else ""
    typer.echo(f"exported {model} ({weights}{shapes}) to {folder} "
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

    from ..backends import onnx
    from ..onnx import export as onnx_export

    meta = onnx_export.load_export(Path(folder))
    report = onnx.placement(Path(folder) / meta["model"], ep)
    n, placed, boundary = report["nodes"], report["on_provider"], len(report["boundary"])
    typer.echo(f"{placed} of {n} nodes ({100 * placed / n:.1f}%) on {report['provider']}"
               + (f"; {boundary} more quantize the graph's inputs and dequantize its outputs on the CPU "
                  "(the provider's boundary)" if boundary else ""))
    for node, op in report["fallback"]:
        typer.echo(f"  on the CPU: {node} ({op})")
