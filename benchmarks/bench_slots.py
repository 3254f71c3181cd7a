"""Second-turn time to first token: two interleaved conversations against one.

An editor's completion and its chat, or two chat clients, alternate requests
on one server. With one KV-cache slot each request evicts the other's prefix
and its second turn evaluates its whole history again; with a slot each,
both keep their prefixes. Measured on one Engine, the way the server uses it:

  single        turn 1, turn 2 of one conversation: TTFT of turn 2
  interleaved   A1, B1, A2, B2 (each request after the previous one ended):
                TTFT of A2 and B2; the goal is <= 1.2 x single
  concurrent    A1, B1, then A2 and B2 sent at the same time from two threads:
                generations run one at a time, so one of them waits for the
                other's whole answer (reported, not part of the goal)

for ``--slots`` (default 2) and, as the reference, 1 slot. Each conversation
opens with a long shared document (~640 tokens, the issue's editor prompt)
and a question; turn 2 asks a follow-up. Greedy, ``--max-tokens`` per answer.

    python benchmarks/bench_slots.py --model smollm2-135m --threads 2 --rounds 3

Prints one JSON object: per slot count, the median TTFT (seconds) of each
mode, the ratios to single, and the cached prompt tokens of the second turns.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

from edgespec import Engine

ROOT = Path(__file__).resolve().parents[1]


def document(n_chars: int) -> str:
    """Real text of about n_chars characters: this repository's architecture notes."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    return text[:n_chars]


def ttft(engine: Engine, history: list[dict], question: str, max_tokens: int) -> tuple[float, int]:
    """Ask ``question`` after ``history``; returns (seconds to the first piece,
    cached prompt tokens) and appends the turn to the history."""
    history.append({"role": "user", "content": question})
    t0 = time.perf_counter()
    gen = engine.stream(messages=history, max_tokens=max_tokens, temperature=0)
    first = None
    pieces = []
    for piece in gen:
        if first is None:
            first = time.perf_counter() - t0
        pieces.append(piece)
    history.append({"role": "assistant", "content": "".join(pieces)})
    return (first if first is not None else time.perf_counter() - t0), gen.result.stats.cached_tokens


def conversation(doc: str) -> list[dict]:
    return [{"role": "system", "content": f"Answer questions about this document.\n\n{doc}"}]


def first_turn(engine: Engine, conv: list[dict], topic: str, max_tokens: int) -> None:
    ttft(engine, conv, f"In one sentence: what does the document say about {topic}?", max_tokens)


def run(engine: Engine, doc_a: str, doc_b: str, max_tokens: int) -> dict:
    engine.forget_prefix()
    single = conversation(doc_a)
    first_turn(engine, single, "backends", max_tokens)
    t_single, c_single = ttft(engine, single, "And how are they tested?", max_tokens)

    engine.forget_prefix()
    a, b = conversation(doc_a), conversation(doc_b)
    first_turn(engine, a, "backends", max_tokens)
    first_turn(engine, b, "drafters", max_tokens)
    t_a, c_a = ttft(engine, a, "And how are they tested?", max_tokens)
    t_b, c_b = ttft(engine, b, "And how are they tested?", max_tokens)

    engine.forget_prefix()
    a, b = conversation(doc_a), conversation(doc_b)
    first_turn(engine, a, "backends", max_tokens)
    first_turn(engine, b, "drafters", max_tokens)
    out: dict[str, tuple[float, int]] = {}
    go = threading.Barrier(2)

    def second(name, conv):
        go.wait()
        out[name] = ttft(engine, conv, "And how are they tested?", max_tokens)

    threads = [threading.Thread(target=second, args=(n, c)) for n, c in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"single": t_single, "interleaved": (t_a + t_b) / 2,
            "concurrent": (out["a"][0] + out["b"][0]) / 2,
            "cached": {"single": c_single, "interleaved": [c_a, c_b],
                       "concurrent": [out["a"][1], out["b"][1]]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--backend", default="llama")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--doc-chars", type=int, default=2600, help="characters of each conversation's document")
    args = ap.parse_args()
    text = document(2 * args.doc_chars)
    doc_a, doc_b = text[:args.doc_chars], text[args.doc_chars:]
    report = {"model": args.model, "backend": args.backend, "threads": args.threads,
              "max_tokens": args.max_tokens, "rounds": args.rounds, "results": {}}
    for slots in sorted({1, args.slots}):
        with Engine(args.model, backend=args.backend, threads=args.threads, slots=slots) as engine:
            report["prompt_tokens"] = len(engine.prompt_tokens(messages=conversation(doc_a)))
            runs = [run(engine, doc_a, doc_b, args.max_tokens) for _ in range(args.rounds)]
        med = {k: statistics.median(r[k] for r in runs) for k in ("single", "interleaved", "concurrent")}
        report["results"][f"slots={slots}"] = {
            "ttft_s": {k: round(v, 4) for k, v in med.items()},
            "interleaved_vs_single": round(med["interleaved"] / med["single"], 3),
            "concurrent_vs_single": round(med["concurrent"] / med["single"], 3),
            "cached_second_turn": runs[-1]["cached"],
        }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
