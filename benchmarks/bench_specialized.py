"""Specialized drafters against generic ones, per language, side by side in one run.

    python benchmarks/bench_specialized.py --model qwen2.5-coder-1.5b --langs python --limit 6 --tokens 96
    python benchmarks/bench_specialized.py --model gemma3-270m --langs deu,fra,jpn --drafters DIR

For each language, on the benchmark prompts of that language (python: the
HumanEval suite; a human language: the multilingual suite's continuation and
translation prompts), greedy, every configuration on the same prompt one after
another so machine drift cancels:

    plain               no drafting
    prompt lookup       --drafter ngram
    generic: <model>    --drafter model with the target's paired draft model and with
                        smollm2-135m across tokenizers (those the target can use);
                        with --draft-vocab N also the paired one with its output
                        trimmed to the N most used tokens
    specialized         --drafter model with the target's drafter for that language
    auto                --drafter auto with the target's drafter set (routed)
    auto, no set        --drafter auto without specialized drafters

Prints per language: acceptance (accepted / drafted), accepted tokens per
target step, a draft model's cost per drafted token in target tokens (its
DraftCost, measured when it opens and corrected from its timed drafts; the
last run's), tokens/s and the ratio to plain decoding (total tokens over total
decode time), and checks that every run's output equals plain decoding. The
drafters come from --drafters DIR (files DIR/*.gguf and DIR/<target>/*.gguf),
else the target's shipped set. The prompts are the suites', which `edgespec
drafter distill` never trains on.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from edgespec import Engine
from edgespec.backends.vocab import Vocab
from edgespec.bench import prompts
from edgespec.drafters import routed
from edgespec.errors import InvalidArgumentError
from edgespec.models import registry

GENERIC = ("smollm2-135m",)


def prompts_of(lang: str, limit: int) -> list[prompts.Prompt]:
    if lang == "python":
        return prompts.spread(prompts.load_suite("code"), limit)
    picked = [p for p in prompts.load_suite("multilingual") if p.lang == lang]
    if not picked:
        raise SystemExit(f"no multilingual prompts for language {lang}")
    return picked[:limit]


def configurations(model: str, lang: str, drafter_dir: str | None, empty: str,
                   draft_vocab: int | None = None) -> dict[str, dict]:
    name = registry.model_name(model)
    with Vocab.load(registry.model_path_checked(model)) as vocab:
        infos = [i for i in routed.find_set(vocab, routed.set_files(name, drafter_dir)) if i.problem is None]
    special = [i for i in infos if lang in i.langs]
    configs = {"plain": dict(drafter="none"), "prompt lookup": dict(drafter="ngram", drafter_dir=empty)}
    paired = registry.paired_draft(model)
    for generic in ([paired] if paired else []) + [g for g in GENERIC if g != name]:
        configs[f"generic: {generic}"] = dict(drafter="model", draft_model=generic, drafter_dir=empty)
    if paired and draft_vocab:
        configs[f"generic: {paired}, --draft-vocab {draft_vocab}"] = dict(
            drafter="model", draft_model=paired, draft_vocab=draft_vocab, drafter_dir=empty)
    if special:
        configs[f"specialized: {special[0].path.name}"] = dict(drafter="model", draft_model=str(special[0].path),
                                                               drafter_dir=empty)
    configs["auto (specialized set)"] = dict(drafter="auto", drafter_dir=drafter_dir)
    configs["auto, no specialized"] = dict(drafter="auto", drafter_dir=empty)
    return configs


def run_lang(args, lang: str, empty: str) -> dict[str, dict]:
    configs = configurations(args.model, lang, args.drafters, empty, args.draft_vocab)
    engines = {label: Engine(args.model, threads=args.threads, n_ctx=2048, **kw) for label, kw in configs.items()}
    totals = {label: {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0, "steps": 0, "cost": None}
              for label in configs}
    mismatches = []
    prompts = prompts_of(lang, args.limit)
    try:
        engines["plain"].render_chat([{"role": "user", "content": "hi"}])
    except InvalidArgumentError:   # a model without a chat template (gemma3-270m): completion prompts only
        prompts = [p for p in prompts if not p.chat]
        print(f"{args.model} has no chat template: its chat prompts are left out")
    try:
        for engine in engines.values():   # warm-up: pages in, drafters opened, costs measured
            engine.generate(prompts[0].prompt, max_tokens=8, temperature=0)
        for _ in range(args.rounds):
            for p in prompts:
                plain = None
                for label, engine in engines.items():
                    r = engine.generate(p.prompt, chat=p.chat, max_tokens=args.tokens, temperature=0)
                    plain = plain or r
                    if r.tokens != plain.tokens:
                        mismatches.append((label, p.id))
                    t = totals[label]
                    t["tokens"] += r.stats.n_tokens
                    t["seconds"] += r.stats.decode_s
                    if r.stats.spec is not None:
                        t["drafted"] += r.stats.spec.drafted
                        t["accepted"] += r.stats.spec.accepted
                        t["steps"] += r.stats.spec.target_steps
                        t["cost"] = r.stats.spec.planner.get("draft_cost", {}).get("model", [t["cost"]])[0]
    finally:
        for engine in engines.values():
            engine.close()
    base = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    print(f"\n{lang}: {args.model}, {args.threads} threads, greedy, {args.tokens} tokens, "
          f"{len(prompts)} prompts x {args.rounds} rounds")
    print("| configuration | acceptance | tokens / step | cost / drafted token | tokens/s | x plain |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, t in totals.items():
        speed = t["tokens"] / t["seconds"]
        acc = f"{t['accepted'] / t['drafted']:.0%}" if t["drafted"] else "-"
        per_step = f"{t['tokens'] / t['steps']:.2f}" if t["steps"] else "1.00"
        cost = f"{t['cost']:.3f}" if t["cost"] is not None else "-"
        print(f"| {label} | {acc} | {per_step} | {cost} | {speed:.2f} | {speed / base:.2f}x |")
    print("greedy output identical to plain decoding:", "yes" if not mismatches else f"NO {mismatches}")
    return {label: {"x_plain": (t["tokens"] / t["seconds"]) / base,
                    "acceptance": t["accepted"] / t["drafted"] if t["drafted"] else None} for label, t in totals.items()}


def agreement(args, lang: str, empty: str) -> None:
    """Teacher-forced: how often the specialized drafter's top token is the
    target's next token over the target's own greedy output, and how many of
    those tokens it does not keep (the ceiling its vocabulary sets)."""
    import numpy as np

    from edgespec.backends import open_backend
    from edgespec.capi import ffi
    from edgespec.drafters import specialized
    from edgespec.models.gguf import GGUFFile

    special = [c["draft_model"] for k, c in configurations(args.model, lang, args.drafters, empty).items()
               if k.startswith("specialized")]
    if not special:
        print(f"{lang}: no specialized drafter")
        return
    with GGUFFile(special[0]) as f:
        keep, unk = f.get(specialized.KEY_TOKEN_MAP), f.get(specialized.KEY_UNK)
    to_draft = {t: i for i, t in enumerate(keep)}
    with Engine(args.model, threads=args.threads, n_ctx=2048) as engine:
        runs = [(engine.backend.tokenize(p.prompt, add_special=False),
                 engine.generate(p.prompt, max_tokens=args.tokens, temperature=0).tokens)
                for p in prompts_of(lang, args.limit) if not p.chat]
    hit = n = missing = 0
    with open_backend("native", special[0], n_ctx=2048, n_batch=2048, threads=args.threads) as drafter:
        for prompt, generated in runs:
            seq = prompt + generated
            drafter.clear()
            addr = drafter.decode([to_draft.get(t, unk) for t in seq], logits_from=0)
            logits = np.frombuffer(ffi.buffer(ffi.cast("float *", addr), 4 * len(seq) * drafter.n_vocab),
                                   dtype=np.float32).reshape(len(seq), -1)
            top = np.asarray(keep)[logits.argmax(1)]
            hit += int((top[len(prompt) - 1:-1] == np.asarray(generated)).sum())
            n += len(generated)
            missing += sum(t not in to_draft for t in generated)
    print(f"{lang}: {Path(special[0]).name} predicts the target's next token on {hit / n:.0%} of {n} generated "
          f"tokens (teacher-forced); {missing / n:.0%} of them are outside its vocabulary")


def plot(results: dict[str, dict[str, dict]], path: str, title: str) -> None:
    """One panel per language: speedup over plain decoding of each configuration, acceptance on the bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 4), squeeze=False)
    for ax, (lang, rows) in zip(axes[0], results.items()):
        labels = [k for k in rows if k != "plain"]
        bars = ax.barh(labels, [rows[k]["x_plain"] for k in labels], color="#4c72b0")
        for bar, k in zip(bars, labels):
            acc = rows[k]["acceptance"]
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                    f" {acc:.0%}" if acc is not None else "", va="center", fontsize=8)
        ax.axvline(1.0, color="grey", lw=1, ls="--")
        ax.set_title(lang)
        ax.set_xlabel("x plain decoding (label: acceptance)")
        ax.invert_yaxis()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--langs", default="python", help="comma-separated language tags")
    ap.add_argument("--drafters", default=None, metavar="DIR", help="the drafter set (default: the target's)")
    ap.add_argument("--limit", type=int, default=4, help="prompts per language")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                    help="also the paired draft model with its output trimmed to N tokens")
    ap.add_argument("--plot", default=None, metavar="PNG", help="also draw the speedups per language")
    ap.add_argument("--agreement", action="store_true", help="only the specialized drafter's teacher-forced "
                    "agreement with the target's greedy output (completion prompts)")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as empty:
        for lang in [x for x in args.langs.split(",") if x]:
            if args.agreement:
                agreement(args, lang, empty)
            else:
                results[lang] = run_lang(args, lang, empty)
    if args.plot:
        plot(results, args.plot, f"{args.model}, {args.threads} threads, greedy, {args.tokens} tokens")


if __name__ == "__main__":
    main()
