"""ONNX Runtime against llama.cpp on the same model and machine: export time
and size, the fraction of the graph's nodes the execution provider runs,
plain greedy decode tokens/s of the onnx backend (CPU provider by default)
and the llama backend, interleaved round by round in one process so that
machine drift cancels, and the logits agreement of the two.

    python benchmarks/bench_onnx.py --model smollm2-135m --threads 2 --tokens 128 --rounds 3 [--ep cpu]
        [--static 4 16]
    python benchmarks/bench_onnx.py --export-only smollm2-135m gemma3-270m qwen2.5-coder-0.5b qwen2.5-coder-1.5b
    python benchmarks/bench_onnx.py --model smollm2-135m --parity qdq [--ep qnn]

--static N... also times static-shape exports (--static-shapes --call-size N,
the NPU form of the graph) in the same rounds: every decode step runs N rows.

--parity FORM compares the logits of the FORM export (e.g. qdq, the NPU form)
with the int4 graph's and llama.cpp's, teacher-forced on llama's greedy text
(FORM on --ep, the int4 graph on the CPU provider).

The OpenVINO provider's figures come from the interpreter that has
onnxruntime-openvino (a virtualenv of its own, see .ci/run):
``$EDGESPEC_OPENVINO_PYTHON benchmarks/bench_onnx.py --ep openvino``.

Decode speed is the engine's own: generated tokens / time after the first
token (prefill excluded), the same for both backends. Logits agreement is
teacher-forced on llama's greedy text: max and rms absolute difference, and
how often the two argmax tokens agree.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from edgespec import Engine
from edgespec.backends import onnx as onnx_backend
from edgespec.onnx import export as onnx_export
from edgespec.models import registry

PROMPTS = [
    "The history of the printing press begins",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Here is a short story about a lighthouse keeper who",
]


def _rows(address: int, n: int, n_vocab: int) -> np.ndarray:
    return np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctypes.c_float)), shape=(n, n_vocab)).copy()


def logits_agreement(llama: Engine, onnx: Engine, n_tokens: int) -> dict:
    diffs, agree, total, max_abs = [], 0, 0, 0.0
    for prompt in PROMPTS:
        result = llama.generate(prompt, max_tokens=n_tokens, drafter="none")
        prompt_tokens = llama.tokenize(prompt)
        seq = prompt_tokens + result.tokens
        n, v = len(result.tokens) + 1, llama.backend.n_vocab
        rows = []
        for engine in (llama, onnx):
            engine.backend.clear()
            rows.append(_rows(engine.backend.decode(seq, logits_from=len(prompt_tokens) - 1), n, v))
        a, b = rows
        max_abs = max(max_abs, float(np.abs(a - b).max()))
        diffs.append(((a - b) ** 2).mean())
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += n
    return {"max_abs": max_abs, "rms": float(np.sqrt(np.mean(diffs))), "top1": agree / total, "rows": total}


def _teacher_forced(backends: dict, seq: list[int], first: int) -> dict:
    rows = {}
    for name, backend in backends.items():
        backend.clear()
        rows[name] = _rows(backend.decode(seq, logits_from=first), len(seq) - first, backend.n_vocab)
    return rows


def parity_figures(model: str, form: str, ep: str, threads: int, n_tokens: int, tmp: Path) -> None:
    """The logits of the ``form`` export against the int4 graph's and llama.cpp's."""
    from edgespec.backends import open_backend

    gguf = registry.model_path_checked(model)
    folders = {"int4": export_figures(model, "int4", tmp / "int4"), form: export_figures(model, form, tmp / form)}
    placement_figures(folders[form], ep)
    with Engine(str(gguf), backend="llama", threads=threads, n_ctx=512) as llama:
        backends = {"llama.cpp": llama.backend,
                    "int4": open_backend("onnx", folders["int4"], n_ctx=512, threads=threads),
                    form: open_backend("onnx", folders[form], threads=threads, ep=ep)}
        pairs = [(form, "int4"), (form, "llama.cpp"), ("int4", "llama.cpp")]
        diffs = {p: [] for p in pairs}
        try:
            for prompt in PROMPTS:
                result = llama.generate(prompt, max_tokens=n_tokens, drafter="none")
                prompt_tokens = llama.tokenize(prompt)
                rows = _teacher_forced(backends, prompt_tokens + result.tokens, len(prompt_tokens) - 1)
                for a, b in pairs:
                    diffs[(a, b)].append((rows[a], rows[b]))
        finally:
            for name in ("int4", form):
                backends[name].close()
    print(f"logits over {sum(len(a) for a, _ in diffs[pairs[0]])} teacher-forced rows ({form} on {ep}):")
    for (a, b), rows in diffs.items():
        x, y = np.concatenate([r[0] for r in rows]), np.concatenate([r[1] for r in rows])
        print(f"  {a:>5} vs {b:<9}  max |diff| {np.abs(x - y).max():6.3f}  rms {np.sqrt(((x - y) ** 2).mean()):6.3f}"
              f"  top-1 agreement {100 * (x.argmax(-1) == y.argmax(-1)).mean():5.1f}%")


def export_figures(model: str, weights: str, folder: Path, static: bool = False,
                   call_size: int = onnx_export.STATIC_SEQ) -> Path:
    t0 = time.perf_counter()
    folder = onnx_export.export(registry.model_path_checked(model), folder, weights=weights,
                                static_shapes=static, call_size=call_size, progress=False)
    size = (folder / onnx_export.MODEL_FILE).stat().st_size
    print(f"export {model} ({weights}{f', static shapes, calls of {call_size}' if static else ''}): "
          f"{time.perf_counter() - t0:.1f} s, model.onnx {size / 1e6:.1f} MB")
    return folder


def placement_figures(folder: Path, ep: str) -> None:
    report = onnx_backend.placement(folder / onnx_export.MODEL_FILE, ep)
    ops = sorted({op for _, op in report["fallback"]})
    boundary = len(report["boundary"])
    print(f"  nodes on {report['provider']}: {report['on_provider']} of {report['nodes']} "
          f"({100 * report['on_provider'] / report['nodes']:.1f}%)"
          + (f"; {boundary} quantizing inputs / dequantizing outputs on the CPU" if boundary else "")
          + (f"; left to the CPU: {', '.join(ops)}" if ops else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--ep", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--static", type=int, nargs="*", default=[], metavar="N",
                    help="Also time static-shape exports with calls of N tokens (NPU graphs on --ep).")
    ap.add_argument("--export-only", nargs="+", metavar="MODEL",
                    help="Only export each model (dynamic and static shapes): time, size, node placement.")
    ap.add_argument("--parity", metavar="FORM", help="Only compare the logits of the FORM export (e.g. qdq) "
                                                      "with the int4 graph's and llama.cpp's.")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-onnx-") as tmp:
        if args.parity:
            parity_figures(args.model, args.parity, args.ep, args.threads, min(args.tokens, 64), Path(tmp))
            return
        if args.export_only:
            for model in args.export_only:
                for static in (False, True):
                    folder = export_figures(model, args.weights, Path(tmp) / f"{model}-{static}", static)
                    placement_figures(folder, args.ep)
            return
        gguf = registry.model_path_checked(args.model)
        folders = {"onnx": export_figures(args.model, args.weights, Path(tmp) / "export")}
        placement_figures(folders["onnx"], args.ep)
        for n in args.static:
            folders[f"static {n}"] = export_figures(args.model, args.weights, Path(tmp) / f"static-{n}", True, n)
            placement_figures(folders[f"static {n}"], args.ep)

        with contextlib.ExitStack() as stack:
            engines = {"llama": stack.enter_context(Engine(str(gguf), backend="llama", threads=args.threads,
                                                           n_ctx=1024))}
            for name, folder in folders.items():
                engines[name] = stack.enter_context(Engine(str(folder), backend="onnx", ep=args.ep,
                                                           threads=args.threads, n_ctx=1024 if name == "onnx" else None))
            for engine in engines.values():  # warm up
                engine.generate(PROMPTS[0], max_tokens=8, drafter="none")
            speed = {name: [] for name in engines}
            ratios = {name: [] for name in folders}
            order = list(engines)
            for r in range(args.rounds):
                for prompt in PROMPTS:
                    tps = {}
                    for name in order[r % len(order):] + order[:r % len(order)]:  # rotated each round
                        engines[name].forget_prefix()
                        result = engines[name].generate(prompt, max_tokens=args.tokens, drafter="none")
                        tps[name] = result.stats.tokens_per_s
                        speed[name].append(tps[name])
                    for name in folders:
                        ratios[name].append(tps[name] / tps["llama"])
            agreement = logits_agreement(engines["llama"], engines["onnx"], min(args.tokens, 64))

    runs = len(ratios["onnx"])
    print(f"decode tokens/s (median of {runs} runs, {args.threads} threads, {args.tokens} tokens; "
          "ratio: paired median against llama.cpp):")
    print(f"  {'llama.cpp (llama backend)':<44} {statistics.median(speed['llama']):7.1f}")
    for name in folders:
        label = f"onnxruntime {args.ep} ({'dynamic shapes' if name == 'onnx' else name.replace('static', 'static, calls of')})"
        print(f"  {label:<44} {statistics.median(speed[name]):7.1f}   {statistics.median(ratios[name]):6.3f}x")
    print(f"logits vs llama.cpp over {agreement['rows']} teacher-forced rows: max abs diff "
          f"{agreement['max_abs']:.3f}, rms {agreement['rms']:.3f}, top-1 agreement {100 * agreement['top1']:.1f}%")


if __name__ == "__main__":
    main()
