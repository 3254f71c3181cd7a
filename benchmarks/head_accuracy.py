"""Draft heads' accuracy by depth on held-out prompts, teacher-forced: what a
head knows, apart from how the planner spends it (bench_heads.py).

    python benchmarks/head_accuracy.py --model qwen2.5-coder-1.5b \\
        --head chat=eng-head.gguf --head chat=new.gguf --per-suite 6 --tokens 64

For each ``SUITE=HEAD`` pair the target answers each held-out prompt of the
suite greedily (bench_auto.py's choice of prompts; ``translate``: its
translation requests); its features over prompt and answer come from one
pass. From every answer position p the head, given the real rows up to p
(as its cache holds them after a verified step), drafts ``--depth`` tokens
on its own guesses, through its trained output rows (``eagle.draft_vocab``).
Printed per prompt and per head: the share of first drafted tokens that are
the target's, then of the second given the first right, and so on (the
counts in brackets). Exit status 0; nothing here is timed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_auto import held_out  # noqa: E402  (the held-out prompt choice, shared)
from bench_heads import cpu_flags, head_pairs, run  # noqa: E402

from edgespec import Engine  # noqa: E402
from edgespec.capi import ffi  # noqa: E402
from edgespec.drafters import head as head_file, ranks  # noqa: E402
from edgespec.drafters.model import target_fingerprint  # noqa: E402


def accuracy(engine, path: Path, prompt, tokens: int, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """(hits, trials) by depth of the head at ``path`` on the target's answer to ``prompt``."""
    backend = engine.backend
    answer = run(engine, prompt, "none", tokens).tokens
    context = list(engine.prompt_tokens(messages=[{"role": "user", "content": prompt.prompt}]) if prompt.chat
                   else engine.prompt_tokens(prompt.prompt))
    full, n_prompt = context + list(answer), len(context)
    backend.clear()
    backend.keep_features(True)
    backend.decode(full, logits_from=n_prompt - 1)
    features = backend.features()                 # (len(answer) + 1, n_embd): positions n_prompt - 1 ..
    n_vocab = backend.n_vocab
    hits, trials = np.zeros(depth), np.zeros(depth)
    head = backend.open_head(path)
    try:
        trained = head_file.trained_draft_vocab(path)
        if trained and trained < n_vocab:
            head.restrict_output(ranks.top_tokens(target_fingerprint(backend), trained, n_vocab, path.name))
        for p in range(n_prompt - 1, len(full) - depth - 1):
            head.truncate(0)
            k = p - n_prompt + 2                  # real rows: positions n_prompt - 1 .. p
            logits = head.decode(features[:k], full[n_prompt:p + 2], k - 1)
            for j in range(depth):
                row = np.frombuffer(ffi.buffer(ffi.cast("float *", logits), 4 * n_vocab), dtype=np.float32)
                guess = int(np.argmax(row))
                trials[j] += 1
                if guess != full[p + 2 + j]:
                    break
                hits[j] += 1
                logits = head.decode(head.hidden(), [guess], 0)
    finally:
        head.close()
    return hits, trials


def shown(hits: np.ndarray, trials: np.ndarray) -> str:
    return " ".join(f"{h / t:.0%} ({int(h)}/{int(t)})" if t else "-" for h, t in zip(hits, trials))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--head", action="append", required=True, metavar="SUITE=FILE",
                    help="a held-out suite and a head file to measure on it (repeatable)")
    ap.add_argument("--per-suite", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    pairs = [(suite, Path(path)) for suite, path in head_pairs(ap, args.head)]
    print(f"# {args.model}, {args.threads} threads, greedy answers of {args.tokens} tokens; {cpu_flags()}")
    with Engine(args.model, backend="native", threads=args.threads) as engine:
        for suite, path in pairs:
            print(f"\n## {suite}: {path.name} (depth 1..{args.depth}: given the ones before right)")
            total_h, total_t = np.zeros(args.depth), np.zeros(args.depth)
            for prompt in held_out(suite, args.per_suite):
                h, t = accuracy(engine, path, prompt, args.tokens, args.depth)
                total_h += h
                total_t += t
                print(f"{prompt.id:24s} {shown(h, t)}")
            print(f"{'all':24s} {shown(total_h, total_t)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
