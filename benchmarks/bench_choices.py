"""``n`` choices in one request against the same number of concurrent
requests, on one ``--parallel N`` server (both decode the N generations in
one batch per step), interleaved round by round: the wall time of each way,
its aggregate tokens/s, and their ratio (n / concurrent, higher is better).
Which way goes first alternates from round to round.

    python benchmarks/bench_choices.py --model qwen2.5-coder-0.5b --n 4 --rounds 3
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time

from edgespec import Engine
from edgespec.server import make_server

PROMPT = "Write a short story about a robot who learns to paint."


def post(server, body: dict) -> dict:
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=600)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = json.loads(resp.read())
        if resp.status != 200:
            raise SystemExit(f"error: {resp.status} {data}")
        return data
    finally:
        conn.close()


def one_request(server, n: int, tokens: int, seed: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = post(server, {"prompt": PROMPT, "n": n, "max_tokens": tokens, "temperature": 0.8, "seed": seed})
    return time.perf_counter() - t0, out["usage"]["completion_tokens"]


def concurrent(server, n: int, tokens: int, seed: int) -> tuple[float, int]:
    counts = [0] * n

    def client(i: int) -> None:
        counts[i] = post(server, {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0.8,
                                  "seed": seed + i})["usage"]["completion_tokens"]
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, sum(counts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafter", default="none")
    args = ap.parse_args()
    with Engine(args.model, threads=args.threads, parallel=args.n, drafter=args.drafter) as engine:
        server = make_server(engine, port=0, quiet=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            one_request(server, args.n, 8, 0)   # warm: the slots made, the prefix cached
            ways = {"n in one request": one_request, "concurrent requests": concurrent}
            rates: dict[str, list[float]] = {w: [] for w in ways}
            for r in range(args.rounds):
                order = list(ways.items())   # which goes first alternates: the first of a round pays more
                for way, run in (order if r % 2 == 0 else order[::-1]):
                    seconds, tokens = run(server, args.n, args.tokens, 100 * r)
                    rates[way].append(tokens / seconds)
                    print(f"round {r + 1} {way:>20}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s",
                          flush=True)
        finally:
            server.shutdown()
            server.server_close()
    medians = {w: statistics.median(v) for w, v in rates.items()}
    print(f"{args.model}, n={args.n}, {args.tokens} tokens each, parallel {args.n}, drafter {args.drafter}: "
          f"n in one request {medians['n in one request']:.1f} tok/s, concurrent {medians['concurrent requests']:.1f} "
          f"tok/s, ratio {medians['n in one request'] / medians['concurrent requests']:.2f} (median of {args.rounds})")


if __name__ == "__main__":
    main()
