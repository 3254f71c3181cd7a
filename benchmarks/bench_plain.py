"""Plain greedy decoding: edgespec against a bare llama_decode + argmax loop and
against llama-cpp-python's high-level Llama.create_completion.

All three run on the same model file, prompt, thread count and context size,
interleaved round by round in one process so that machine drift cancels.
Decode speed is generated tokens after the first / time from the first token
to the last (prefill excluded), the same definition for all three.

    python benchmarks/bench_plain.py --model smollm2-135m --threads 2 --tokens 128 --rounds 5
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy as np
import llama_cpp
import llama_cpp.llama_cpp as lc

from edgespec import Engine
from edgespec.backends.llama_vocab import model_params
from edgespec.models import registry

PROMPTS = [
    "The history of the printing press begins",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Here is a short story about a lighthouse keeper who",
]


class BareLoop:
    """The floor: llama_decode one token at a time, argmax on a zero-copy view."""

    def __init__(self, path, n_ctx, threads):
        self.model = lc.llama_model_load_from_file(str(path).encode(), model_params())
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = cp.n_ubatch = 512
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        cp.swa_full = True
        self.ctx = lc.llama_init_from_model(self.model, cp)
        self.mem = lc.llama_get_memory(self.ctx)

    def tokenize(self, text):
        data = text.encode()
        buf = (lc.llama_token * (len(data) + 8))()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, len(buf), True, False)
        return list(buf[:n])

    def run(self, prompt, n_tokens):
        lc.llama_memory_clear(self.mem, True)
        toks = self.tokenize(prompt)
        arr = (lc.llama_token * len(toks))(*toks)
        lc.llama_decode(self.ctx, lc.llama_batch_get_one(arr, len(toks)))
        one = (lc.llama_token * 1)()
        out = []
        t_first = None
        for _ in range(n_tokens):
            row = np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,))
            tok = int(row.argmax())
            if t_first is None:
                t_first = time.perf_counter()
            if lc.llama_vocab_is_eog(self.vocab, tok):
                break
            out.append(tok)
            if len(out) == n_tokens:
                break
            one[0] = tok
            lc.llama_decode(self.ctx, lc.llama_batch_get_one(one, 1))
        return out, (len(out) - 1) / (time.perf_counter() - t_first)

    def close(self):
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)


def run_edgespec(engine, prompt, n_tokens):
    t_first = None
    for _ in engine.stream(prompt, max_tokens=n_tokens, temperature=0.0):
        if t_first is None:
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    r = engine.last_result
    return r.tokens, (len(r.tokens) - 1) / (t_end - t_first)


def run_high_level(llm, prompt, n_tokens):
    t_first = None
    n = 0
    for _ in llm.create_completion(prompt, max_tokens=n_tokens, temperature=0.0, stream=True):
        n += 1
        if t_first is None:
            t_first = time.perf_counter()
    return None, (n - 1) / (time.perf_counter() - t_first)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ctx", type=int, default=2048)
    args = ap.parse_args()

    path = registry.model_path_checked(args.model)
    engine = Engine(str(path), threads=args.threads, n_ctx=args.ctx)
    bare = BareLoop(path, args.ctx, args.threads)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=args.ctx, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False)

    speeds = {"bare": [], "edgespec": [], "llama-cpp-python": []}
    mismatches = 0
    for rnd in range(args.rounds + 1):  # round 0 warms caches and is not counted
        for prompt in PROMPTS:
            ref, s_bare = bare.run(prompt, args.tokens)
            got, s_es = run_edgespec(engine, prompt, args.tokens)
            _, s_hl = run_high_level(llm, prompt, args.tokens)
            mismatches += got != ref
            if rnd:
                speeds["bare"].append(s_bare)
                speeds["edgespec"].append(s_es)
                speeds["llama-cpp-python"].append(s_hl)

    med = {k: statistics.median(v) for k, v in speeds.items()}
    ratios = [e / b for e, b in zip(speeds["edgespec"], speeds["bare"])]
    print(f"model {args.model}, {args.threads} threads, {args.tokens} tokens, "
          f"{args.rounds} rounds x {len(PROMPTS)} prompts")
    print(f"{'configuration':<20} {'decode tok/s (median)':>22}")
    for k, v in med.items():
        print(f"{k:<20} {v:>22.1f}")
    print(f"edgespec / bare loop: {statistics.median(ratios):.3f} (median of paired ratios)")
    print(f"edgespec / llama-cpp-python: {med['edgespec'] / med['llama-cpp-python']:.3f}")
    print(f"greedy token mismatches vs bare loop: {mismatches}")
    engine.close()
    bare.close()
    llm.close()
    raise SystemExit(1 if mismatches else 0)


if __name__ == "__main__":
    main()
