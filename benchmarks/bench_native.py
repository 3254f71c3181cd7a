"""The native C engine against llama.cpp (the llama backend), side by side in one run.

Two modes (and ``speed-one``, the worker process ``speed`` runs per engine
and round):

  speed   decode and prefill tokens/s of both backends on each model, each
          engine in a process of its own per round, the rounds interleaved so
          machine drift cancels; prints native / llama.cpp ratios.
  parity  logits of both backends for every position of one long real text
          (this repository's README and ARCHITECTURE, >= 512 tokens, fed in
          chunks of n_batch with every row kept): max and mean absolute
          difference, top-1 agreement; and the greedy continuations of the
          test prompts, compared token for token.

    python benchmarks/bench_native.py speed --threads 2 --rounds 5
    python benchmarks/bench_native.py parity --positions 600
    python benchmarks/bench_native.py parity --models smollm2-135m path/to/moe.gguf
    python benchmarks/bench_native.py parity --moe-fixtures

Models are built-in names or GGUF paths; --moe-fixtures adds the tiny random
MoE files of tests/tiny_gguf.py (MOE_FIXTURES: qwen3moe and Mixtral-style,
float and quantized experts), written to a temporary directory. Parity also
prints llama.cpp against itself (batches of 16 vs n_batch): with quantized
weights that spread is the floor any other implementation can reach.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from edgespec.models import registry
from edgespec.backends import open_backend

ROOT = Path(__file__).resolve().parent.parent
SPEED_PROMPT = "Here is a short story about a lighthouse keeper who"
GREEDY_PROMPTS = [
    "The history of the printing press begins",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Here is a short story about a lighthouse keeper who",
]


def logits_rows(backend, addr: int, n_rows: int) -> np.ndarray:
    buf = (ctypes.c_float * (n_rows * backend.n_vocab)).from_address(addr)
    return np.ctypeslib.as_array(buf).reshape(n_rows, backend.n_vocab).copy()


def all_logits(backend, tokens: list[int], n_chunk: int | None = None) -> np.ndarray:
    """(len(tokens), n_vocab) logits, every position, in chunks of n_chunk
    (default n_batch)."""
    backend.clear()
    rows = []
    n_chunk = n_chunk or backend.n_batch
    for start in range(0, len(tokens), n_chunk):
        chunk = tokens[start:start + n_chunk]
        rows.append(logits_rows(backend, backend.decode(chunk, logits_from=0), len(chunk)))
    return np.concatenate(rows)


def greedy(backend, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens after prompt, and at each step the gap between the
    best two logits (how near a tie the choice was)."""
    backend.clear()
    row = logits_rows(backend, backend.decode(prompt), 1)[0]
    out, gaps = [], []
    while True:
        top2 = np.partition(row, -2)[-2:]
        out.append(int(row.argmax()))
        gaps.append(float(abs(top2[1] - top2[0])))
        if len(out) == n:
            return out, gaps
        row = logits_rows(backend, backend.decode(out[-1:]), 1)[0]


def parity_text() -> str:
    return "\n\n".join((ROOT / p).read_text() for p in ("README.md", "docs/ARCHITECTURE.md"))


def parity(models: list[str], threads: int, positions: int, n_greedy: int) -> None:
    text = parity_text()
    for ref in models:
        path = registry.model_path_checked(ref)
        with open_backend("llama", path, n_ctx=positions + 64, threads=threads) as lb, \
             open_backend("native", path, n_ctx=positions + 64, threads=threads) as nb:
            tokens = lb.tokenize(text)[:positions]
            if len(tokens) < positions:  # a tokenizer that packs text tightly: repeat it
                tokens = (tokens * (positions // max(1, len(tokens)) + 1))[:positions]
            a, b = all_logits(lb, tokens), all_logits(nb, tokens)
            diff = np.abs(a - b)
            agree = float((a.argmax(1) == b.argmax(1)).mean())
            name = Path(ref).stem if Path(ref).suffix == ".gguf" else ref
            print(f"{name} ({nb.arch}): {len(tokens)} positions: max |dlogit| {diff.max():.4f}, "
                  f"mean {diff.mean():.5f}, top-1 agreement {agree * 100:.2f}%")
            c = all_logits(lb, tokens, 16)
            own = np.abs(a - c)
            own_agree = float((a.argmax(1) == c.argmax(1)).mean())
            print(f"  llama.cpp vs itself (batches of 16 vs {lb.n_batch}): max |dlogit| "
                  f"{own.max():.4f}, mean {own.mean():.5f}, top-1 agreement {own_agree * 100:.2f}%")
            for prompt in GREEDY_PROMPTS:
                p = lb.tokenize(prompt)
                (ga, gaps), (gb, _) = greedy(lb, p, n_greedy), greedy(nb, p, n_greedy)
                first = next((i for i, (x, y) in enumerate(zip(ga, gb)) if x != y), None)
                verdict = ("identical" if first is None else f"differ from token {first}, where "
                           f"llama.cpp's best two logits are {gaps[first]:.3f} apart")
                print(f"  greedy {n_greedy} tokens, {prompt[:32]!r}...: {verdict}")


def time_backend(backend, prompt: list[int], n_decode: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of one greedy run."""
    backend.clear()
    t0 = time.perf_counter()
    row = logits_rows(backend, backend.decode(prompt), 1)[0]
    t1 = time.perf_counter()
    tok = int(row.argmax())
    for i in range(n_decode):
        row = logits_rows(backend, backend.decode([tok]), 1)[0]
        tok = int(row.argmax())
    t2 = time.perf_counter()
    return len(prompt) / (t1 - t0), n_decode / (t2 - t1)


def speed_one(ref: str, backend: str, threads: int, n_decode: int, n_prefill: int) -> None:
    """One round on one backend, in a process of its own: prints
    {"prefill": tok/s, "decode": tok/s} as JSON."""
    import json

    path = registry.model_path_checked(ref)
    with open_backend(backend, path, n_ctx=n_prefill + n_decode + 16, threads=threads) as b:
        prompt = b.tokenize(parity_text())[:n_prefill]
        short = b.tokenize(SPEED_PROMPT)
        time_backend(b, short, 2)   # warm: pages of the file, the threads
        pf, _ = time_backend(b, prompt, 1)
        _, dec = time_backend(b, short, n_decode)
    print(json.dumps({"prefill": pf, "decode": dec}))


def speed(models: list[str], threads: int, rounds: int, n_decode: int, n_prefill: int) -> None:
    """Each round runs each engine in a fresh process (two engines in one
    process slow each other: their idle threads spin on the same cores),
    alternating which goes first."""
    import json
    import subprocess

    for ref in models:
        res = {name: {"prefill": [], "decode": []} for name in ("llama", "native")}
        for r in range(rounds):
            order = ["llama", "native"] if r % 2 else ["native", "llama"]
            for name in order:
                out = subprocess.run([sys.executable, __file__, "speed-one", "--models", ref, "--backend", name,
                                      "--threads", str(threads), "--decode", str(n_decode),
                                      "--prefill", str(n_prefill)], capture_output=True, text=True, check=True)
                for kind, value in json.loads(out.stdout.strip().splitlines()[-1]).items():
                    res[name][kind].append(value)
        med = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in res.items()}
        print(f"{ref}, {threads} threads, median of {rounds} rounds (one process per engine and round):")
        for kind, n_tok in (("decode", n_decode), ("prefill", n_prefill)):
            l, n = med["llama"][kind], med["native"][kind]
            print(f"  {kind:7s} ({n_tok} tokens): llama.cpp {l:8.1f} tok/s   native {n:8.1f} tok/s"
                  f"   ratio {n / l:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("speed", "parity", "speed-one"))
    ap.add_argument("--backend", default="native", help="speed-one: the backend to time")
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"],
                    help="built-in names or GGUF paths (default: smollm2-135m gemma3-270m)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="speed: timed rounds after one warm-up")
    ap.add_argument("--decode", type=int, default=64, help="speed: tokens decoded per run")
    ap.add_argument("--prefill", type=int, default=256, help="speed: prompt tokens per prefill run")
    ap.add_argument("--positions", type=int, default=600, help="parity: positions compared (>= 512)")
    ap.add_argument("--greedy", type=int, default=48, help="parity: greedy tokens per test prompt")
    ap.add_argument("--moe-fixtures", action="store_true",
                    help="add the tiny random MoE files of tests/tiny_gguf.py to --models")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        models = list(args.models)
        if args.moe_fixtures:
            sys.path.insert(0, str(ROOT / "tests"))
            from tiny_gguf import MOE_FIXTURES, write_moe_fixture

            source = registry.model_path_checked("smollm2-135m")  # the tokenizer
            models += [str(write_moe_fixture(name, tmp, source)) for name in MOE_FIXTURES]
        if args.mode == "speed-one":
            speed_one(models[0], args.backend, args.threads, args.decode, args.prefill)
        elif args.mode == "parity":
            parity(models, args.threads, args.positions, args.greedy)
        else:
            speed(models, args.threads, args.rounds, args.decode, args.prefill)


if __name__ == "__main__":
    main()
