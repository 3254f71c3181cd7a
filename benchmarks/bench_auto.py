"""`--drafter auto` against plain decoding as a user runs it: one
`edgespec generate` process per generation, the two interleaved, per prompt.

    python benchmarks/bench_auto.py --models qwen2.5-coder-1.5b smollm2-135m --per-suite 3 --repeats 3

For each model and each prompt (held-out prompts of every shipped suite:
never the TUNED ones the planner was developed on; and two suites made here
from them: ``translate``, the multilingual suite's requests to translate
dataset-build text into English from TRANSLATE_FROM, and ``short-chat``,
the chat questions asking for an answer of a sentence or two), each repeat runs
`edgespec generate -m MODEL --drafter none|auto --temperature 0 -n TOKENS
--json PROMPT` once each, alternating which goes first. It prints per prompt
the decode speed ratio auto / plain (median and lowest over the paired
repeats), the whole-process ratio (wall time, model load and prefill
included) and whether the texts were identical; then per suite and overall
the median and the lowest prompt. ``--cold`` drops the page cache before
every run (root), ``--first-run`` gives each prompt's first auto run an empty
measurement cache (as on the first run after install: the machine is
measured at load, before the generation). Exit status 1 when any auto run's
text differs from plain decoding's.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from edgespec.bench import prompts
from edgespec.models import registry

SUITES = ("code", "chat", "edit", "multilingual", "translate", "short-chat")
# Prompts the planner was tuned on while it was developed: left out here.
TUNED = {"humaneval-0", "humaneval-120", "humaneval-131", "humaneval-143"}
# Languages of the translation prompts, in the order they are taken (different scripts first).
TRANSLATE_FROM = ("deu", "zho", "rus", "fra", "jpn", "spa", "ara", "pol")
SHORT = " Answer in one or two sentences."


def suite_prompts(suite: str) -> list:
    """The prompts of ``suite``: a shipped one, or one made here from them."""
    if suite == "translate":
        by_id = {p.id: p for p in prompts.load_suite("multilingual")}
        return [replace(by_id[f"translate-{lang}"], suite=suite) for lang in TRANSLATE_FROM]
    if suite == "short-chat":
        return [replace(p, id=f"{p.id}-short", suite=suite, prompt=p.prompt + SHORT)
                for p in prompts.load_suite("chat")]
    return prompts.load_suite(suite)


def held_out(suite: str, n: int) -> list:
    """``n`` prompts of ``suite`` spread evenly over it, none of TUNED
    (translations: the first ``n`` languages of TRANSLATE_FROM)."""
    kept = [p for p in suite_prompts(suite) if p.id not in TUNED]
    if suite == "translate":
        return kept[:n]
    step = max(1, len(kept) // n)
    return kept[step // 2::step][:n]


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def fresh_home() -> Path:
    """An EDGESPEC_HOME with the models of the real one and no measurements."""
    home = Path(tempfile.mkdtemp(prefix="edgespec-first-run-"))
    (home / "models").symlink_to(registry.home() / "models")
    return home


def run(model: str, drafter: str, prompt, tokens: int, threads: int | None, home: Path | None) -> dict:
    cmd = [sys.executable, "-m", "edgespec", "generate", "-m", model, "--drafter", drafter,
           "--temperature", "0", "-n", str(tokens), "--json"]
    if prompt.chat:
        cmd.append("--chat")
    if threads:
        cmd += ["--threads", str(threads)]
    env = dict(os.environ, **({"EDGESPEC_HOME": str(home)} if home else {}))
    t0 = time.perf_counter()
    out = subprocess.run(cmd + ["--", prompt.prompt], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:8])} ... failed ({out.returncode}): {out.stderr.strip()[-400:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    return result


def bench_model(model: str, args) -> tuple[list[dict], bool]:
    rows, same = [], True
    for suite in args.suites:
        for p in held_out(suite, args.per_suite):
            ratios, walls, identical, accepted = [], [], True, []
            home = fresh_home() if args.first_run else None
            for r in range(args.repeats):
                order = ("none", "auto") if r % 2 == 0 else ("auto", "none")
                got = {}
                for d in order:
                    if args.cold:
                        drop_caches()
                    got[d] = run(model, d, p, args.tokens, args.threads, home if d == "auto" else None)
                if home is not None:
                    shutil.rmtree(home, ignore_errors=True)
                    home = None
                plain, auto = got["none"], got["auto"]
                ratios.append(auto["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens_per_s"] else 0.0)
                walls.append(plain["wall_s"] / auto["wall_s"])
                identical &= auto["tokens"] == plain["tokens"]
                spec = auto.get("spec") or {}
                accepted.append(", ".join(f"{k} {v['accepted']}/{v['drafted']}"
                                          for k, v in (spec.get("per_drafter") or {}).items()) or "-")
            same &= identical
            row = {"model": model, "suite": suite, "id": p.id, "n_tokens": plain["n_tokens"],
                   "plain_tok_s": plain["tokens_per_s"], "ratio_median": statistics.median(ratios),
                   "ratio_min": min(ratios), "wall_ratio_median": statistics.median(walls),
                   "identical": identical, "accepted": accepted[-1]}
            rows.append(row)
            print(f"  {suite:<13} {p.id:<22} {row['n_tokens']:>4} tok  plain {row['plain_tok_s']:6.1f} tok/s  "
                  f"auto/plain {row['ratio_median']:.3f} (min {row['ratio_min']:.3f})  "
                  f"whole process {row['wall_ratio_median']:.3f}  {'same' if identical else 'DIFFERS'}  "
                  f"[{row['accepted']}]", flush=True)
    return rows, same


def summary(rows: list[dict]) -> None:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(f"{r['model']} {r['suite']}", []).append(r)
        groups.setdefault(f"{r['model']} all", []).append(r)
    print(f"\n{'model suite':<34} {'prompts':>7} {'median':>7} {'lowest':>7} {'whole-process median':>21}")
    for name, g in groups.items():
        print(f"{name:<34} {len(g):>7} {statistics.median(r['ratio_median'] for r in g):>7.3f} "
              f"{min(r['ratio_min'] for r in g):>7.3f} {statistics.median(r['wall_ratio_median'] for r in g):>21.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-1.5b", "smollm2-135m"])
    ap.add_argument("--suites", default=",".join(SUITES))
    ap.add_argument("--per-suite", type=int, default=3, help="held-out prompts per suite")
    ap.add_argument("--repeats", type=int, default=3, help="paired plain/auto runs per prompt")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every run (root)")
    ap.add_argument("--first-run", action="store_true",
                    help="each prompt's first auto run starts with no measurement cache")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    args.suites = [s for s in args.suites.split(",") if s]
    if args.cold and not drop_caches():
        raise SystemExit("--cold needs root (it writes /proc/sys/vm/drop_caches)")
    all_rows, all_same = [], True
    for model in args.models:
        print(f"{model}: {args.per_suite} held-out prompts per suite, {args.repeats} paired repeats, greedy, "
              f"{args.tokens} tokens, one process per run{', cold page cache' if args.cold else ''}"
              f"{', first auto run measures the machine' if args.first_run else ''}", flush=True)
        rows, same = bench_model(model, args)
        all_rows += rows
        all_same &= same
    summary(all_rows)
    print("greedy output identical to plain decoding:", "yes" if all_same else "NO")
    if args.json:
        args.json.write_text(json.dumps(all_rows, indent=1))
    sys.exit(0 if all_same else 1)


if __name__ == "__main__":
    main()
