"""``edgespec moe``: the files the expert cache works with (made by
edgespec.training.moe_tools; the cache's settings are edgespec.moe): an
upcycled MoE of a dense model, a synthetic MoE of any shape, and the
low-precision sidecar of a MoE model."""
from __future__ import annotations

import time
from pathlib import Path

import typer

from .base import moe_app
from ..config import MODEL_HELP


def _done(what: str, path: Path, t0: float) -> None:
    typer.echo(f"wrote {what} {path} ({path.stat().st_size / 1e6:.1f} MB) in "
               f"{time.perf_counter() - t0:.1f} s", err=True)
    typer.echo(str(path))


@moe_app.command()
def upcycle(
    model: str = typer.Argument(..., help=MODEL_HELP + " A dense llama or qwen2 model."),
    experts: int = typer.Option(..., "--experts", help="Experts per layer, [1, 256]: each a copy of the "
                                "layer's FFN."),
    top_k: int = typer.Option(2, "--top-k", help="Experts per token, [1, --experts]."),
    seed: int = typer.Option(0, "--seed", help="Seed of the routers' random projections."),
    router_scale: float = typer.Option(1.0, "--router-scale", help="Scale of the routers' projections: "
                                       "larger routes more sharply (unequal expert weights)."),
    out: Path = typer.Option(..., "--out", help="The GGUF file to write."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress on stderr."),
):
    """A MoE GGUF made of a dense model: with exact experts it computes the dense model."""
    from ..training import moe_tools
    from ..models import registry

    path = registry.model_path_checked(model)
    t0 = time.perf_counter()
    _done("upcycled MoE", moe_tools.upcycle(path, out, experts=experts, top_k=top_k, seed=seed,
                                      router_scale=router_scale, progress=not quiet), t0)


@moe_app.command()
def synth(
    experts: int = typer.Option(8, "--experts", help="Experts per layer, [1, 256]."),
    top_k: int = typer.Option(2, "--top-k", help="Experts per token, [1, --experts]."),
    layers: int = typer.Option(..., "--layers", help="Decoder layers, >= 1."),
    embd: int = typer.Option(..., "--embd", help="Embedding width, a multiple of 32 (64 per head)."),
    ff: int = typer.Option(..., "--ff", help="One expert's hidden width, a multiple of 32."),
    weight_type: str = typer.Option("q4_0", "--type", help="Type of every matrix: f32, f16, q4_0, q4_1, "
                                    "q5_0, q5_1, q8_0 (norms and routers are f32)."),
    tokenizer: str = typer.Option("smollm2-135m", "--tokenizer", help="Model whose tokenizer to copy: "
                                  + MODEL_HELP),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights."),
    arch: str = typer.Option("llama", "--arch", help="Tensor layout: llama (Mixtral-style) or qwen3moe "
                             "(per-head query and key norms, NEOX RoPE, expert_feed_forward_length)."),
    out: Path = typer.Option(..., "--out", help="The GGUF file to write."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress on stderr."),
):
    """A random MoE GGUF of the given shape and layout (for speed measurements)."""
    from ..training import moe_tools
    from ..models import registry

    t0 = time.perf_counter()
    tok = registry.resolve(tokenizer)  # only its tokenizer.* keys are read
    _done("synthetic MoE", moe_tools.synth(out, tok, experts=experts, top_k=top_k, layers=layers, embd=embd,
                                     ff=ff, qtype=weight_type, seed=seed, arch=arch, progress=not quiet), t0)


@moe_app.command()
def prepare(
    model: str = typer.Argument(..., help="A MoE GGUF file (or built-in name)."),
    weight_type: str = typer.Option("q3_k", "--type", help="Type of the copies: q3_k (3.4 bits per "
                                    "weight) or q2_k (2.6, coarser); rows that are not whole 256-value "
                                    "super-blocks take q4_0."),
    out: Path = typer.Option(None, "--out", help="Where to write the sidecar (default: beside the model, "
                             "MODEL.experts-low, where the engine looks for it)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress on stderr."),
):
    """Write the low-precision (Q2_K / Q3_K) copies of every expert that --expert-precision balanced
    and fast serve cache misses from."""
    from ..training import moe_tools
    from ..models import registry

    path = registry.model_path_checked(model)
    t0 = time.perf_counter()
    _done("expert sidecar", moe_tools.prepare(path, out, qtype=weight_type, progress=not quiet), t0)
