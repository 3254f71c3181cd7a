"""Draft models and auto's overhead, measured side by side in one run.

    python benchmarks/bench_draft.py pairs --threads 2 --tokens 128 --rounds 2
    python benchmarks/bench_draft.py overhead --model smollm2-135m --threads 2 --tokens 128

``pairs``: qwen2.5-coder-1.5b on the native backend, greedy, one prompt per
suite (edit, chat, code), each round decoding plainly, with ``--drafter auto``
(n-gram + the paired qwen2.5-coder-0.5b), with the paired draft model alone
and with smollm2-135m drafting across tokenizers, interleaved so that machine
drift cancels. Prints tokens/s, the ratio to plain decoding (median of paired
rounds), acceptance and which drafter carried the accepted tokens, and
checks that every greedy run equals plain decoding.

``overhead``: auto on a model and prompts where no drafter pays (no paired
draft model, prose prompts): the time auto spends choosing and learning
(drafting, planning, the drafters' bookkeeping) as a fraction of decode time,
with plain vs auto tokens/s.

Figures taken on a machine that runs other work are unreliable: re-measure
on a quiet one.
"""
from __future__ import annotations

import argparse
import statistics
import time

from edgespec import Engine
from edgespec.bench import prompts

SUITES = ("edit", "chat", "code")
PROSE = ["Write a short paragraph about the history of lighthouses.",
         "Describe a walk through a forest in autumn.",
         "Explain how a bicycle gear works."]


def _prompts(names) -> list[prompts.Prompt]:
    """The first prompt of each suite."""
    return [prompts.load_suite(name)[0] for name in names]


def pairs(args) -> None:
    configs = {  # label -> (drafter, draft model)
        "auto": ("auto", None),
        "model (0.5b, paired)": ("model", None),
        "model (smollm2, cross-tokenizer)": ("model", "smollm2-135m"),
    }
    engines = {label: Engine(args.model, backend=args.backend, threads=args.threads, n_ctx=2048,
                             drafter=d, draft_model=m)
               for label, (d, m) in configs.items()}
    plain_engine = next(iter(engines.values()))
    ratios = {label: {} for label in configs}
    speeds = {label: [] for label in ["plain", *configs]}
    carried = {label: {} for label in configs}
    accepted = {label: [0, 0] for label in configs}
    mismatches = []
    for rnd in range(args.rounds):
        for p in _prompts(args.suites):
            suite, prompt = p.suite, p.prompt
            plain = plain_engine.generate(prompt, chat=p.chat, max_tokens=args.tokens, drafter="none")
            speeds["plain"].append(plain.stats.tokens_per_s)
            for label, engine in engines.items():
                r = engine.generate(prompt, chat=p.chat, max_tokens=args.tokens)
                if r.tokens != plain.tokens:
                    mismatches.append((label, suite))
                speeds[label].append(r.stats.tokens_per_s)
                ratios[label].setdefault(suite, []).append(r.stats.tokens_per_s / plain.stats.tokens_per_s)
                accepted[label][0] += r.stats.spec.accepted
                accepted[label][1] += r.stats.spec.drafted
                for name, d in r.stats.spec.per_drafter.items():
                    carried[label][name] = carried[label].get(name, 0) + d["accepted"]
        print(f"round {rnd + 1}/{args.rounds} done", flush=True)
    print(f"\n{args.model}, {args.backend}, {args.threads} threads, greedy, {args.tokens} tokens, "
          f"{args.rounds} rounds (x plain: median of paired rounds)")
    print(f"{'configuration':<34} {'tok/s':>7} " + " ".join(f"{s:>6}" for s in args.suites)
          + f" {'accept':>7}  accepted by")
    print(f"{'plain':<34} {statistics.median(speeds['plain']):>7.2f}")
    for label in configs:
        acc = accepted[label][0] / accepted[label][1] if accepted[label][1] else 0.0
        print(f"{label:<34} {statistics.median(speeds[label]):>7.2f} "
              + " ".join(f"{statistics.median(ratios[label][s]):>5.2f}x" for s in args.suites)
              + f" {100 * acc:>6.0f}%  " + ", ".join(f"{k} {v}" for k, v in carried[label].items()))
    print("greedy output identical to plain decoding:", "yes" if not mismatches else f"NO {mismatches}")
    for engine in engines.values():
        engine.close()


def overhead(args) -> None:
    with Engine(args.model, backend=args.backend, threads=args.threads, n_ctx=2048, drafter="auto") as engine:
        spent = [0.0]

        def timed(fn):
            def wrapper(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    spent[0] += time.perf_counter() - t0
            return wrapper

        engine.generate(PROSE[0], max_tokens=8)  # a first generation, as every other one
        for d in engine.lanes[0].open_drafters("auto"):
            d.accept = timed(d.accept)
        planner = engine.lanes[0].planner
        for name in ("choose", "record", "record_step_time"):
            setattr(planner, name, timed(getattr(planner, name)))
        fractions, per_step, plain_speed, auto_speed, drafted = [], [], [], [], 0
        for rnd in range(args.rounds):
            for prompt in PROSE:
                p = engine.generate(prompt, max_tokens=args.tokens, drafter="none", chat=True)
                spent[0] = 0.0
                a = engine.generate(prompt, max_tokens=args.tokens, chat=True)
                fractions.append(spent[0] / a.stats.decode_s)
                per_step.append(spent[0] / a.stats.spec.target_steps)
                plain_speed.append(p.stats.tokens_per_s)
                auto_speed.append(a.stats.tokens_per_s)
                drafted += a.stats.spec.drafted
        print(f"{args.model}, {args.backend}, {args.threads} threads, {args.tokens} tokens, "
              f"{len(fractions)} runs, auto drafted {drafted} tokens in all")
        print(f"auto's own time (drafting, planning, bookkeeping) / decode time: "
              f"median {100 * statistics.median(fractions):.2f}%, max {100 * max(fractions):.2f}% "
              f"({1e6 * statistics.median(per_step):.0f} us per step)")
        print(f"tokens/s: plain {statistics.median(plain_speed):.1f}, auto {statistics.median(auto_speed):.1f} "
              f"({statistics.median(a / p for a, p in zip(auto_speed, plain_speed)):.3f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["pairs", "overhead"])
    ap.add_argument("--model", default=None, help="pairs: qwen2.5-coder-1.5b; overhead: smollm2-135m")
    ap.add_argument("--backend", default="native")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--suites", default=",".join(SUITES), help="pairs: comma-separated suites (first prompt of each)")
    args = ap.parse_args()
    args.suites = [x for x in args.suites.split(",") if x]
    if args.model is None:
        args.model = "qwen2.5-coder-1.5b" if args.what == "pairs" else "smollm2-135m"
    (pairs if args.what == "pairs" else overhead)(args)


if __name__ == "__main__":
    main()
