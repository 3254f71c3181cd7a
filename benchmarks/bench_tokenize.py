"""Tokenizing 1 MB of text: the GGUF-built tokenizer (edgespec.backends.vocab)
against llama.cpp's (backends/llama_vocab.py, the llama extra), per model, and
each one's load. CPU seconds (process time), best of --runs: the machine may
be shared.

    python benchmarks/bench_tokenize.py [-m MODEL ...] [--mb 1] [--runs 3]

The text: the bench suites' prompts (code, chat, edits, several languages)
repeated to the size asked. Prints both figures and llama.cpp / edgespec.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from edgespec.backends.llama_vocab import LlamaVocab
from edgespec.backends.vocab import Vocab
from edgespec.models import registry

SUITES = Path(__file__).resolve().parent.parent / "edgespec" / "bench" / "suites"


def text_of(size: int) -> str:
    parts = [json.dumps(json.loads(line), ensure_ascii=False)
             for suite in sorted(SUITES.glob("*.jsonl")) for line in suite.read_text().splitlines()]
    unit = "\n".join(parts)
    return (unit * (size // len(unit.encode()) + 1))[:size]


def best(fn, runs: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(runs):
        start = time.process_time()
        out = fn()
        times.append(time.process_time() - start)
    return min(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", action="append", help="model reference (default: every built-in model)")
    ap.add_argument("--mb", type=float, default=1.0, help="megabytes of text (default 1)")
    ap.add_argument("--runs", type=int, default=3, help="runs per figure, the best kept (default 3)")
    args = ap.parse_args()
    text = text_of(int(args.mb * 1e6))
    print(f"{len(text.encode()) / 1e6:.2f} MB of text; CPU seconds, best of {args.runs}")
    print(f"{'model':28} {'load es':>8} {'load llama':>10} {'tok es':>8} {'tok llama':>10} {'llama/es':>9}")
    for name in args.model or sorted(registry.builtin_models()):
        path = registry.resolve(name)
        load_new, new = best(lambda: Vocab.load(path), args.runs)
        load_old, _ = best(lambda: LlamaVocab.load(path).close(), args.runs)
        old = LlamaVocab.load(path)
        t_new, ids_new = best(lambda: new.tokenize(text, add_special=False), args.runs)
        t_old, ids_old = best(lambda: old.tokenize(text, add_special=False), args.runs)
        same = "" if ids_new == ids_old else "  (tokens differ!)"
        print(f"{name:28} {load_new:8.2f} {load_old:10.2f} {t_new:8.2f} {t_old:10.2f} {t_old / t_new:8.2f}x{same}")
        old.close()


if __name__ == "__main__":
    main()
