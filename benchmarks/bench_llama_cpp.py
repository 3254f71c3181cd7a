"""edgespec against llama.cpp's own n-gram lookup example (`llama-lookup`),
prompt by prompt in one run.

Build the peer from the llama.cpp sources inside llama-cpp-python's source
distribution (pip download --no-deps --no-binary :all: llama-cpp-python):

    cmake -S vendor/llama.cpp -B build -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_CURL=OFF
    cmake --build build -j2 --target llama-lookup

then

    python benchmarks/bench_llama_cpp.py --llama-cpp-bin build/bin --rounds 2

Both sides get the same chat-rendered prompt, greedy sampling, threads,
context size and token budget. llama-lookup's figure is its own "decoded N
tokens in T seconds"; edgespec's is generated tokens / decode time.
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
from pathlib import Path

from bench_spec import PROMPTS

from edgespec import Engine, registry

DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
ACCEPT = re.compile(r"accept\s+=\s+([\d.]+)%")


def run_lookup(binary: Path, model: Path, prompt: str, n: int, threads: int, draft_max: int) -> tuple[float, float]:
    """(decode tokens/s, acceptance %) of one llama-lookup run."""
    p = subprocess.run([str(binary), "-m", str(model), "-p", prompt, "-n", str(n), "-t", str(threads),
                        "-c", "2048", "--temp", "0", "--spec-draft-n-max", str(draft_max)],
                       capture_output=True, text=True, timeout=600)
    log = p.stdout + p.stderr
    m = DECODED.search(log)
    if p.returncode != 0 or not m:
        raise RuntimeError(f"llama-lookup failed ({p.returncode}): {log.strip().splitlines()[-1:]}")
    a = ACCEPT.search(log)
    return int(m.group(1)) / float(m.group(2)), float(a.group(1)) if a else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp-bin", required=True, type=Path, help="folder holding llama-lookup")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--draft-max", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    lookup = args.llama_cpp_bin / "llama-lookup"
    path = registry.model_path_checked(args.model)
    engine = Engine(str(path), threads=args.threads, n_ctx=2048)
    engine.batch_costs()
    speeds: dict[str, dict[str, list[float]]] = {}
    for rnd in range(args.rounds + 1):  # round 0 warms up
        for suite, prompts in PROMPTS.items():
            for prompt in prompts:
                messages = [{"role": "user", "content": prompt}]
                row = {}
                for d in ("none", "auto"):
                    r = engine.generate(messages=messages, max_tokens=args.tokens, drafter=d)
                    row[f"edgespec:{d}"] = r.stats.tokens_per_s
                row["llama.cpp:lookup"], _ = run_lookup(lookup, path, engine.render_chat(messages),
                                                        args.tokens, args.threads, args.draft_max)
                if rnd:
                    for k, v in row.items():
                        speeds.setdefault(suite, {}).setdefault(k, []).append(v)

    print(f"model {args.model}, {args.threads} threads, {args.tokens} tokens, {args.rounds} rounds, greedy")
    for suite, table in speeds.items():
        base = table["edgespec:none"]
        print(f"\n[{suite}] {'configuration':<20} {'tok/s':>8} {'x edgespec plain':>17}")
        for k, v in table.items():
            ratio = statistics.median(a / b for a, b in zip(v, base))
            print(f"[{suite}] {k:<20} {statistics.median(v):>8.1f} {ratio:>17.3f}")
    engine.close()


if __name__ == "__main__":
    main()
