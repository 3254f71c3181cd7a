"""The native engine's q8_0 KV cache against its f16 cache (EngineConfig
cache_type_k / cache_type_v), side by side in one run.

Two modes:

  agreement  logits of both caches at every position of one long real text
             (this repository's README and ARCHITECTURE, fed in chunks of
             n_batch with every row kept): top-1 agreement and the mean
             KL(f16 || q8_0) over the positions (tests/test_kv_quant.py holds
             them to >= 92% and <= 0.01 on qwen2.5-coder-0.5b; the issue's
             99% top-1 is not met, nor by llama.cpp's q8_0 cache).
  speed      decode tokens/s of both caches after a long context (--ctx
             tokens of that text, repeated), both engines open at once and
             their rounds interleaved so machine drift cancels; prints the
             KV cache's bytes per token of each and the q8_0 / f16 ratio.

    python benchmarks/bench_kv.py agreement --model qwen2.5-coder-0.5b --positions 1000
    python benchmarks/bench_kv.py speed --model smollm2-135m --ctx 4096 --threads 2 --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench_native import logits_rows, parity_text
from edgespec.backends import open_backend
from edgespec.models import registry

TYPES = {"f16": {}, "q8_0": {"cache_type_k": "q8_0", "cache_type_v": "q8_0"}}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def agreement(model, positions: int, threads: int) -> tuple[float, float]:
    """(top-1 agreement, mean KL(f16 || q8_0)) of the two caches' logits over
    the first ``positions`` tokens of the text, both engines fed the same
    chunks (one chunk's rows at a time: a 150k vocabulary makes 1,000 rows 600 MB)."""
    path = registry.model_path_checked(str(model))
    with open_backend("native", path, threads=threads, n_ctx=positions, **TYPES["f16"]) as f16, \
            open_backend("native", path, threads=threads, n_ctx=positions, **TYPES["q8_0"]) as q8:
        tokens = f16.tokenize(parity_text())[:positions]
        if len(tokens) < positions:
            raise SystemExit(f"the text has {len(tokens)} tokens, fewer than {positions}")
        same, kl = 0, 0.0
        for start in range(0, positions, f16.n_batch):
            chunk = tokens[start:start + f16.n_batch]
            p = _log_softmax(logits_rows(f16, f16.decode(chunk, logits_from=0), len(chunk)))
            q = _log_softmax(logits_rows(q8, q8.decode(chunk, logits_from=0), len(chunk)))
            same += int((p.argmax(1) == q.argmax(1)).sum())
            kl += float((np.exp(p) * (p - q)).sum())
    return same / positions, kl / positions


def speed(model, ctx: int, n_decode: int, threads: int, rounds: int) -> None:
    path = registry.model_path_checked(str(model))
    backends = {name: open_backend("native", path, threads=threads, n_ctx=ctx + n_decode + 1, **types)
                for name, types in TYPES.items()}
    try:
        text = backends["f16"].tokenize(parity_text())
        context = (text * (ctx // len(text) + 1))[:ctx]
        for b in backends.values():
            b.clear()
            b.decode(context)
        speeds = {name: [] for name in backends}
        for _ in range(rounds):
            for name, b in backends.items():
                b.truncate(ctx)
                token = context[-1]
                t0 = time.perf_counter()
                for _ in range(n_decode):
                    token = int(logits_rows(b, b.decode([token]), 1)[0].argmax())
                speeds[name].append(n_decode / (time.perf_counter() - t0))
        print(f"{model}: decode after {ctx} tokens of context, {threads} threads, {rounds} rounds of {n_decode}")
        for name, b in backends.items():
            print(f"  {name:5s} {statistics.median(speeds[name]):7.1f} tok/s  KV cache {b.kv_bytes_per_token} "
                  f"bytes/token ({b.kv_bytes_per_token * ctx / 2**20:.1f} MiB at {ctx})")
        ratios = [q / f for q, f in zip(speeds["q8_0"], speeds["f16"])]
        print(f"  q8_0 / f16 speed: {statistics.median(ratios):.3f} (rounds: "
              f"{', '.join(f'{r:.3f}' for r in ratios)}); bytes/token "
              f"{backends['q8_0'].kv_bytes_per_token / backends['f16'].kv_bytes_per_token:.3f}")
    finally:
        for b in backends.values():
            b.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["agreement", "speed"])
    ap.add_argument("--model", default=None, help="built-in name or GGUF path (default: qwen2.5-coder-0.5b "
                                                  "for agreement, smollm2-135m for speed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--positions", type=int, default=1000, help="agreement: positions compared")
    ap.add_argument("--ctx", type=int, default=4096, help="speed: context before the timed decodes")
    ap.add_argument("--decode", type=int, default=32, help="speed: tokens decoded per round")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if a.mode == "agreement":
        model = a.model or "qwen2.5-coder-0.5b"
        top1, kl = agreement(model, a.positions, a.threads)
        print(f"{model}: q8_0 KV cache vs f16 over {a.positions} positions: top-1 agreement {top1:.2%}, "
              f"mean KL {kl:.5f}")
    else:
        speed(a.model or "smollm2-135m", a.ctx, a.decode, a.threads, a.rounds)


if __name__ == "__main__":
    main()
