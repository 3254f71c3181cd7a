"""The HTTP server's own cost: edgespec's server on Starlette + uvicorn
(edgespec.server) against the standard-library server it replaced
(edgespec/server.py of a git revision, loaded from git), on the same Engine.

Measured, interleaved round by round so that machine drift cancels:

* request overhead: GET /v1/models on a kept-alive connection (no engine
  work), and POST /v1/completions with max_tokens 1 (parse, tokenize, one
  token), median and p90 wall time per request;
* streaming latency: a streamed /v1/completions of --tokens tokens read off
  a raw socket: time to the first SSE event carrying text, and the gap
  between text events (median, p90).

    python benchmarks/bench_server.py --model smollm2-135m --threads 2 --rounds 5

With ``--clients N``, several users at once instead (issue 30): N greedy
clients streaming different prompts at the same moment against the same N
requests served one after another, on a server of ``--parallel`` (default N:
their steps decoded together, one batch per step), interleaved round by
round: aggregate tokens/s of each way, their ratio, each client's time to
its first token, and whether every concurrent answer equals its serial one;
beside them the ceiling that batching the N streams' steps could reach on
this machine (N / the measured cost of an N-token batch in units of a
one-token step, edgespec.costs). Also, in the same rounds, the N clients at
once on a ``--parallel 1`` server of the same model (one at a time, as
before), and one client alone on each server: what serving several costs a
lone user. ``--drafter auto,none`` serves the same clients through one
server per drafter in the same rounds (the first drafter's server also
answers the lone and ``--parallel 1`` ways): what drafting adds, or costs,
when several users share the batch.

    python benchmarks/bench_server.py --model qwen2.5-coder-0.5b --clients 4 --drafter auto,none --rounds 3
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

from edgespec import Engine

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "1, 2, 3, 4, 5, 6, 7, 8,"


def baseline_module(rev: str | None):
    """edgespec/server.py as of ``rev`` (default: the revision before its removal)."""
    if rev is None:
        removed = subprocess.run(["git", "log", "-n1", "--diff-filter=D", "--format=%H", "--",
                                  "edgespec/server.py"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        if not removed:
            sys.exit("error: no revision removed edgespec/server.py; pass --baseline REV")
        rev = removed + "^"
    source = subprocess.run(["git", "show", f"{rev}:edgespec/server.py"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout
    module = types.ModuleType("edgespec._baseline_server")
    module.__package__ = "edgespec"          # its relative imports: edgespec.errors
    exec(compile(source, f"{rev}:edgespec/server.py", "exec"), module.__dict__)
    return module, rev


def start(make_server, engine):
    server = make_server(engine, port=0, quiet=True, model_name="m")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


def quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_ms": round(1000 * statistics.median(xs), 3),
            "p90_ms": round(1000 * xs[min(len(xs) - 1, int(0.9 * len(xs)))], 3), "n": len(xs)}


def request_times(server, n: int, method: str, path: str, body: dict | None = None) -> list[float]:
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=120)
    data = json.dumps(body) if body else None
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        out.append(time.perf_counter() - t0)
        assert resp.status == 200, resp.status
        if resp.getheader("Connection", "").lower() == "close":
            conn.close()
            conn = http.client.HTTPConnection(*server.server_address[:2], timeout=120)
    conn.close()
    return out


def stream_times(server, tokens: int) -> tuple[float, list[float]]:
    """(seconds to the first text event, the gaps between text events) of one streamed completion."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True}).encode()
    sock = socket.create_connection(server.server_address[:2], timeout=120)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t0 = time.perf_counter()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    arrivals, buf = [], b""
    while True:
        more = sock.recv(65536)
        if not more:
            break
        now = time.perf_counter()
        buf += more
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            start = event.find(b"data: ")
            if start < 0:
                continue
            data = event[start + 6:]
            if data == b"[DONE]":
                sock.close()
                first = arrivals[0] - t0
                return first, [b - a for a, b in zip(arrivals, arrivals[1:])]
            if json.loads(data)["choices"][0]["text"]:
                arrivals.append(now)
    raise RuntimeError("the stream ended without [DONE]")


CLIENT_PROMPTS = ("def fibonacci(n):", "class Stack:\n    def __init__(self):", "def quicksort(items):",
                  "def is_prime(n):", "def merge(a, b):", "class Queue:", "def gcd(a, b):", "def flatten(xs):")


def stream_client(server, prompt: str, tokens: int, t0: float, out: dict) -> None:
    """One client: a streamed greedy completion; ``out`` gets its first-token
    time (from ``t0``), its text and its token count (from the final usage)."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=600)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    text = []
    for line in resp:
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        if chunk["choices"] and chunk["choices"][0]["text"]:
            out.setdefault("first_s", time.perf_counter() - t0)
            text.append(chunk["choices"][0]["text"])
        if chunk.get("usage"):
            out["tokens"] = chunk["usage"]["completion_tokens"]
    out["text"] = "".join(text)
    conn.close()


def clients(server, prompts: list[str], tokens: int, together: bool) -> dict:
    """The prompts' streams, all at once or one after another: aggregate
    tokens/s, each client's first-token time and text."""
    outs = [{} for _ in prompts]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=stream_client, args=(server, p, tokens, t0, o)) for p, o in zip(prompts, outs)]
    for t in threads:
        t.start()
        if not together:
            t.join()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"tokens_per_s": sum(o["tokens"] for o in outs) / wall, "first_s": [o["first_s"] for o in outs],
            "texts": [o["text"] for o in outs]}


def concurrency(args) -> None:
    """N clients at once against the same requests one after another (see the
    module docstring), for each of ``--drafter``'s drafters, side by side."""
    from edgespec.server import make_server

    n = args.clients
    drafters = args.drafter.split(",")
    prompts = [CLIENT_PROMPTS[i % len(CLIENT_PROMPTS)] for i in range(n)]
    ways = [f"{way} ({d})" for d in drafters for way in ("serial", "concurrent")]
    ways += [f"{way} ({drafters[0]})" for way in ("concurrent, --parallel 1", "one client", "one client, --parallel 1")]
    rows = {way: [] for way in ways}
    options = dict(threads=args.threads, n_ctx=1024, slots=n)
    with contextlib.ExitStack() as stack:
        many = {d: stack.enter_context(Engine(args.model, parallel=args.parallel or n, drafter=d, **options))
                for d in drafters}
        lone = stack.enter_context(Engine(args.model, parallel=1, drafter=drafters[0], **options))
        costs = many[drafters[0]].batch_costs()
        running = [start(make_server, e) for e in (*many.values(), lone)]
        stack.callback(stop, running)
        servers = dict(zip(drafters, (server for server, _ in running)))
        single = running[-1][0]
        for server in (*servers.values(), single):   # warm-up: pages, every prompt's prefix in some slot
            for p in prompts:
                stream_client(server, p, 4, time.perf_counter(), {})
        for i in range(args.rounds):
            for d in drafters if i % 2 == 0 else drafters[::-1]:   # either first in turn
                rows[f"serial ({d})"].append(clients(servers[d], prompts, args.tokens, together=False))
                rows[f"concurrent ({d})"].append(clients(servers[d], prompts, args.tokens, together=True))
            first = drafters[0]
            rows[f"concurrent, --parallel 1 ({first})"].append(clients(single, prompts, args.tokens, together=True))
            alone = [(f"one client ({first})", servers[first]), (f"one client, --parallel 1 ({first})", single)]
            for way, server in alone if i % 2 == 0 else alone[::-1]:
                rows[way].append(clients(server, prompts[:1], args.tokens, together=True))
    ceiling = n / costs[min(n, len(costs) - 1)]

    def per_round(a: str, b: str) -> list[float]:
        return [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(rows[a], rows[b])]

    texts = [tuple(r["texts"]) for rs in rows.values() for r in rs if len(r["texts"]) == n]
    same = len(set(texts)) == 1 and all(r["texts"] == list(texts[0][:1]) for way, rs in rows.items()
                                        if way.startswith("one client") for r in rs)
    print(f"model {args.model}, {args.threads} threads, {n} clients x {args.tokens} tokens, "
          f"--parallel {args.parallel or n}, {args.rounds} rounds (medians)")
    for way, rs in rows.items():
        firsts = [statistics.median(r["first_s"][i] for r in rs) for i in range(len(rs[0]["first_s"]))]
        print(f"  {way:<34} {statistics.median(r['tokens_per_s'] for r in rs):7.1f} tok/s aggregate; "
              f"first token per client (s): {', '.join(f'{f:.2f}' for f in firsts)}")
    ratios = {}
    for d in drafters:
        ratios[f"concurrent / serial ({d})"] = per_round(f"concurrent ({d})", f"serial ({d})")
    for d in drafters[1:]:
        ratios[f"concurrent ({drafters[0]}) / concurrent ({d})"] = per_round(f"concurrent ({drafters[0]})",
                                                                             f"concurrent ({d})")
    ratios[f"one client, --parallel {args.parallel or n} / --parallel 1"] = per_round(
        f"one client ({drafters[0]})", f"one client, --parallel 1 ({drafters[0]})")
    for name, rs in ratios.items():
        print(f"  {name}: {statistics.median(rs):.2f}x (rounds: {', '.join(f'{r:.2f}' for r in rs)})")
    print(f"  greedy answers identical every way: {same}")
    print(f"  ceiling of batching {n} streams' steps: {ceiling:.2f}x "
          f"(an {n}-token batch costs {costs[min(n, len(costs) - 1)]:.2f} one-token steps here)")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "threads": args.threads, "clients": n,
                                         "tokens": args.tokens, "rounds": rows, "ratios": ratios, "identical": same,
                                         "batch_costs": costs, "ceiling": ceiling}, indent=1))


def stop(running) -> None:
    for server, thread in running:
        server.shutdown()
        server.server_close()
        thread.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=50, help="requests per kind per round")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per streamed completion")
    ap.add_argument("--baseline", default=None, help="git revision of the old edgespec/server.py")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here too")
    ap.add_argument("--clients", type=int, default=0, help="several users at once: this many concurrent clients "
                    "against the same requests one after another (see above)")
    ap.add_argument("--drafter", default="none", help="with --clients: the engines' drafter, or several "
                    "(auto,none: each its own server, side by side in the same rounds; default none)")
    ap.add_argument("--parallel", type=int, default=None, help="with --clients: the server's --parallel "
                    "(default: the number of clients)")
    args = ap.parse_args()
    if args.clients:
        return concurrency(args)

    from edgespec.server import make_server as asgi_make_server

    old, rev = baseline_module(args.baseline)
    servers = {"http.server (" + rev[:12] + ")": old.make_server, "starlette+uvicorn": asgi_make_server}
    results = {name: {"models": [], "completion_1": [], "first_event": [], "token_gap": []} for name in servers}
    with Engine(args.model, threads=args.threads, n_ctx=1024) as engine:
        engine.generate(PROMPT, max_tokens=4)   # warm-up: the model's pages, the prefix
        running = {name: start(make, engine) for name, make in servers.items()}
        try:
            for _ in range(args.rounds):
                for name, (server, _) in running.items():
                    r = results[name]
                    r["models"] += request_times(server, args.requests, "GET", "/v1/models")
                    r["completion_1"] += request_times(server, max(args.requests // 5, 1), "POST", "/v1/completions",
                                                       {"prompt": PROMPT, "max_tokens": 1, "temperature": 0})
                    first, gaps = stream_times(server, args.tokens)
                    r["first_event"].append(first)
                    r["token_gap"] += gaps
        finally:
            stop(running.values())
    summary = {name: {kind: quantiles(xs) for kind, xs in r.items()} for name, r in results.items()}
    print(f"model {args.model}, {args.threads} threads, {args.rounds} rounds; median / p90 in ms")
    print(f"{'server':<28} {'GET /v1/models':>18} {'completion, 1 tok':>18} {'first SSE event':>18} "
          f"{'token gap':>18}")
    for name, s in summary.items():
        cells = [f"{s[k]['median_ms']:.2f} / {s[k]['p90_ms']:.2f}"
                 for k in ("models", "completion_1", "first_event", "token_gap")]
        print(f"{name:<28} " + " ".join(f"{c:>18}" for c in cells))
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "threads": args.threads, "rounds": args.rounds,
                                         "tokens": args.tokens, "servers": summary}, indent=1))


if __name__ == "__main__":
    main()
