"""Draft heads on held-out prompts: what each head's drafts are worth.

    python benchmarks/bench_heads.py --model qwen2.5-coder-1.5b \\
        --head chat=eng.gguf --head translate=deu.gguf --per-suite 3 --tokens 128

For each ``SUITE=HEAD`` pair and each held-out prompt of that suite (the
prompts bench_auto.py uses: never those the planner was tuned on; the
``translate`` suite is the multilingual suite's translation requests), one
engine (Python API, loaded once) runs the prompt greedily with ``--drafter
none``, then with ``--drafter head`` (the head alone, chains of
``--draft-max``, the planner deciding when to draft) and ``--drafter auto``
with the head in the target's drafter set, alternating which goes first. It
prints per prompt the head's acceptance per drafted token, the tokens each
target step produced, and each decode speed over plain; per suite the
medians and the lowest; and each head's cost per drafted token beside a
target token (``measure_head_cost``). Exit status 1 when a greedy
speculative text differs from plain decoding's.
"""
from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_auto import held_out  # noqa: E402  (the held-out prompt choice, shared)

from edgespec import Engine  # noqa: E402
from edgespec.drafters.head import measure_head_cost  # noqa: E402
from edgespec.planner import CONFIDENCE_BINS  # noqa: E402


def cpu_flags() -> str:
    flags, name = set(), platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    shown = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8") if f in flags]
    return f"{name} [{' '.join(shown)}]"


def head_pairs(ap: argparse.ArgumentParser, heads: list[str]) -> list[tuple[str, str]]:
    """--head's SUITE=FILE pairs (an argparse error when one is not, or its FILE is missing)."""
    pairs = [h.split("=", 1) for h in heads]
    if any(len(p) != 2 or not Path(p[1]).is_file() for p in pairs):
        ap.error("--head takes SUITE=FILE with an existing FILE")
    return [(suite, path) for suite, path in pairs]


def run(engine: Engine, prompt, drafter: str, tokens: int):
    kw = dict(max_tokens=tokens, temperature=0.0, drafter=drafter)
    if prompt.chat:
        return engine.generate(messages=[{"role": "user", "content": prompt.prompt}], **kw)
    return engine.generate(prompt.prompt, **kw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--head", action="append", required=True, metavar="SUITE=FILE",
                    help="a suite (code, chat, multilingual, translate, short-chat) and the head for it")
    ap.add_argument("--per-suite", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-max", type=int, default=4)
    args = ap.parse_args()
    pairs = head_pairs(ap, args.head)
    print(f"# {args.model}, {args.threads} threads, greedy, {args.tokens} tokens, draft-max {args.draft_max}; "
          f"{cpu_flags()}")
    failed = False
    for suite, path in pairs:
        drafters = Path(tempfile.mkdtemp(prefix="bench-heads-"))
        shutil.copy(path, drafters / Path(path).name)
        rows = []
        with Engine(args.model, threads=args.threads, head=path, draft_max=args.draft_max,
                    drafter_dir=str(drafters)) as engine:
            print(f"\n## {suite}: {Path(path).name}")
            print("| prompt | head acceptance | tokens a step | head / plain | auto / plain | auto routed to |")
            print("| --- | --- | --- | --- | --- | --- |")
            for i, prompt in enumerate(held_out(suite, args.per_suite)):
                order = ("none", "head", "auto") if i % 2 == 0 else ("auto", "head", "none")
                got = {d: run(engine, prompt, d, args.tokens) for d in order}
                for d in ("head", "auto"):
                    if got[d].tokens != got["none"].tokens:
                        failed = True
                        print(f"  !! {prompt.id}: {d} differs from plain decoding")
                spec = got["head"].stats.spec
                tps = {d: got[d].stats.tokens_per_s for d in got}
                row = (spec.acceptance_rate, got["head"].stats.n_tokens / max(spec.target_steps, 1),
                       tps["head"] / tps["none"], tps["auto"] / tps["none"])
                rows.append(row)
                print(f"| {prompt.id} | {row[0]:.1%} ({spec.accepted}/{spec.drafted}) | {row[1]:.2f} | "
                      f"{row[2]:.2f} | {row[3]:.2f} | {got['auto'].stats.spec.specialized} |")
            if rows:
                cols = list(zip(*rows))
                print(f"| median (lowest) | {statistics.median(cols[0]):.1%} ({min(cols[0]):.1%}) | "
                      f"{statistics.median(cols[1]):.2f} | {statistics.median(cols[2]):.2f} ({min(cols[2]):.2f}) | "
                      f"{statistics.median(cols[3]):.2f} ({min(cols[3]):.2f}) | |")
            # What the head's own probability of a token said of its acceptance, over
            # every chain it drafted (cut or not): what the planner cuts drafts by.
            planner = engine.lanes[0].planner
            cal = planner.calibration.get("head") if planner is not None else None
            for depth, what in enumerate(("a chain's first", "later") if cal is not None else ()):
                bins = [f"{b / CONFIDENCE_BINS:.1f}-{(b + 1) / CONFIDENCE_BINS:.1f}: {h / t:.0%} of {t:.0f}"
                        for b, (h, t) in enumerate(zip(cal.hits[depth], cal.trials[depth])) if t >= 1]
                print(f"\n{what} drafted tokens accepted, by the head's probability of them (decayed counts): "
                      f"{'; '.join(bins)}")
            # the head the drafter opened (its output trimmed as it drafts), timed beside the target
            cost = measure_head_cost(engine.backend, engine.lanes[0].drafters["head"].head)
            print(f"\ncost of a drafted token: {cost.per_token:.3f} of a target token "
                  f"(catch-up {cost.catch_up:.3f} a row)")
        shutil.rmtree(drafters, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
