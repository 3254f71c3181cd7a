"""Faithfulness of the native engine and llama.cpp to the exact evaluation of
the same quantized weights (edgespec.bench.faithfulness): mean KL(reference ||
engine) and top-1 agreement over real text, teacher-forced, for every model.

    python benchmarks/bench_faithfulness.py                         # every built-in model, 1,000 positions
    python benchmarks/bench_faithfulness.py --models smollm2-135m --positions 256
    python benchmarks/bench_faithfulness.py --json faithfulness.json

The float64 reference of qwen2.5-coder-1.5b over 1,000 positions takes a few
minutes and about 3 GB of memory.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from edgespec.bench.faithfulness import measure
from edgespec.models import registry

MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=MODELS, help="built-in names or GGUF paths")
    ap.add_argument("--positions", type=int, default=1000, help="teacher-forced positions per model")
    ap.add_argument("--backends", default="native,llama")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    out = {}
    for ref in args.models:
        t0 = time.perf_counter()
        r = measure(registry.model_path_checked(ref), backends, args.positions, threads=args.threads)
        r["seconds"] = round(time.perf_counter() - t0, 1)
        out[ref] = r
        print(f"{ref} ({r['arch']}), {r['positions']} positions, reference {r['reference_s']} s, "
              f"all {r['seconds']} s:")
        for name, f in r["backends"].items():
            print(f"  {name:<7} mean KL {f['mean_kl']:.6f} nats (max {f['max_kl']:.4f}), "
                  f"top-1 agreement {f['top1'] * 100:.2f}%")
        sys.stdout.flush()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
