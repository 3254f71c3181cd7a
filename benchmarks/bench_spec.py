"""Speculative decoding against edgespec's own plain decoding and against
llama-cpp-python's prompt-lookup drafter, side by side in one run.

Two prompt sets, both through the model's chat template:
  edit  rewrite / edit a given text or code (much copied content)
  chat  open-ended questions
Configurations run interleaved per prompt and round, so machine drift
cancels; the first round only warms up. Decode speed for every configuration
is (generated tokens - 1) / (time from the first streamed piece to the end).
Greedy outputs of every edgespec configuration are compared with plain
decoding; the first divergent context position of each differing run is
reported. (llama.cpp's CPU kernels are not batch-invariant once the KV cache
passes 256 cells: single-token flash attention then splits the KV range over
threads, so a verification batch and a lone decode round differently and a
near-tie can flip. Below that, outputs are bit-identical; see README.)

The machine ceiling is the best speedup this hardware allows for this model:
max over k of (k + 1) / cost(k + 1), every draft token accepted, from the
measured batch cost curve.

    python benchmarks/bench_spec.py --model smollm2-135m --threads 2 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import llama_cpp
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from edgespec import Engine, registry

EDIT_TEXT = (
    "Our team met on monday to discuss the the new release schedule. Everyone agreed that "
    "the beta should ship in two weeks, but the documentation is not ready yet and several "
    "bugs in the installer still needs fixing. We will meet again on friday to review progress.\n\n"
    "The marketing group has prepared a short video that explains the main features of the "
    "product. It will be published on our website and on social media the same day as the beta. "
    "Customers who signed up for early access will recieve an email with a download link and a "
    "short survey about there experience.\n\n"
    "Finally, the support team asked for more time to train new staff before the launch, because "
    "the number of questions is expected to grow quickly once the beta is available to everyone."
)
EDIT_CODE = '''def total_price(items, tax):
    total = 0
    for item in items:
        total = total + item["price"] * item["qty"]
    total = total + total * tax
    return total


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best


def group_by_category(items):
    groups = {}
    for item in items:
        category = item["category"]
        if category not in groups:
            groups[category] = []
        groups[category].append(item)
    return groups
'''
PROMPTS = {
    "edit": [
        f"Fix the spelling and grammar mistakes in this text and return the corrected text only:\n\n{EDIT_TEXT}",
        f"Add type hints to this Python code and return the full code:\n\n{EDIT_CODE}",
        f"Add a comment above each loop in this Python code and return the full code:\n\n{EDIT_CODE}",
        f"Rewrite this text in British English, changing nothing else:\n\n{EDIT_TEXT}",
    ],
    "chat": [
        "What are three good habits for staying healthy?",
        "Explain how a rainbow forms.",
        "Give me some tips for learning a new language.",
        "Why do cats purr?",
    ],
}
EDGESPEC_CONFIGS = ("none", "ngram", "auto")


def timed_stream(pieces):
    t_first = None
    for _ in pieces:
        if t_first is None:
            t_first = time.perf_counter()
    return t_first, time.perf_counter()


def run_edgespec(engine, messages, drafter, n):
    t_first, t_end = timed_stream(engine.stream(messages=messages, max_tokens=n, drafter=drafter))
    r = engine.last_result
    return r, (len(r.tokens) - 1) / (t_end - t_first)


def run_lookup(llm, prompt_text, n):
    t_first = None
    count = 0
    text = []
    for chunk in llm.create_completion(prompt_text, max_tokens=n, temperature=0.0, stream=True):
        count += 1
        text.append(chunk["choices"][0]["text"])
        if t_first is None:
            t_first = time.perf_counter()
    return "".join(text), (count - 1) / (time.perf_counter() - t_first)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()

    path = registry.model_path_checked(args.model)
    engine = Engine(str(path), threads=args.threads, n_ctx=2048)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=2048, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False,
                          draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))
    costs = engine.batch_costs()
    ceiling = max((k + 1) / costs[k + 1] for k in range(1, len(costs) - 1))

    configs = [f"edgespec:{d}" for d in EDGESPEC_CONFIGS] + ["llama-cpp-python:prompt-lookup"]
    speed = {s: {c: [] for c in configs} for s in PROMPTS}
    ratio = {s: {c: [] for c in configs} for s in PROMPTS}
    accept = {s: {c: [] for c in configs} for s in PROMPTS}
    divergences: list[int] = []   # context position of each run's first differing token
    for rnd in range(args.rounds + 1):
        for suite, prompts in PROMPTS.items():
            for prompt in prompts:
                messages = [{"role": "user", "content": prompt}]
                got = {}
                for d in EDGESPEC_CONFIGS:
                    got[d] = run_edgespec(engine, messages, d, args.tokens)
                text, s_lookup = run_lookup(llm, engine.render_chat(messages), args.tokens)
                plain, s_plain = got["none"]
                for r, _ in got.values():
                    if r.tokens != plain.tokens:
                        k = next(i for i, (a, b) in enumerate(zip(r.tokens + [-1], plain.tokens + [-2])) if a != b)
                        divergences.append(r.stats.prompt_tokens + k)
                if not rnd:
                    continue
                for d, (r, s) in got.items():
                    c = f"edgespec:{d}"
                    speed[suite][c].append(s)
                    ratio[suite][c].append(s / s_plain)
                    if r.stats.spec is not None:
                        accept[suite][c].append(r.stats.spec.mean_accepted)
                speed[suite][configs[-1]].append(s_lookup)
                ratio[suite][configs[-1]].append(s_lookup / s_plain)

    print(f"model {args.model}, {args.threads} threads, {args.tokens} tokens, {args.rounds} rounds, "
          f"greedy; machine ceiling {ceiling:.2f}x (batch cost of 2/4/8/16 tokens: "
          f"{costs[2]:.2f} {costs[4]:.2f} {costs[8]:.2f} {costs[16]:.2f})")
    report = {"model": args.model, "threads": args.threads, "ceiling": ceiling, "suites": {},
              "divergences": sorted(divergences)}
    for suite in PROMPTS:
        print(f"\n[{suite}] {'configuration':<32} {'tok/s':>8} {'x plain':>8} {'of ceiling':>10} {'acc/step':>9}")
        report["suites"][suite] = {}
        for c in configs:
            med_s = statistics.median(speed[suite][c])
            med_r = statistics.median(ratio[suite][c])
            acc = statistics.mean(accept[suite][c]) if accept[suite][c] else float("nan")
            print(f"[{suite}] {c:<32} {med_s:>8.1f} {med_r:>8.3f} {med_r / ceiling:>10.0%} {acc:>9.2f}")
            report["suites"][suite][c] = {"tokens_per_s": med_s, "speedup": med_r, "mean_accepted": acc}
    early = [p for p in divergences if p < 256]
    print(f"\ngreedy runs differing from plain decoding: {len(divergences)} "
          f"(first divergent context positions: {sorted(divergences)}; below 256: {len(early)})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    engine.close()
    llm.close()
    raise SystemExit(1 if early else 0)


if __name__ == "__main__":
    main()
