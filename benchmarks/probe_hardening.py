"""Hostile inputs against the built-in models and the server, counted.

    python benchmarks/probe_hardening.py gguf --mutants 2000     # mutated GGUFs, both backends
    python benchmarks/probe_hardening.py repack                  # faults at the repack cache's files
    python benchmarks/probe_hardening.py server                  # server RSS after hostile requests

``gguf``: seeded mutants (tests/gguf_mutants.py) of each built-in model,
split evenly between them, each through ``edgespec models info`` and
``edgespec generate`` on the native and the llama backend (worker
processes, replaced when one dies or hangs). Counted per model: aborts and
crashes (killed by a signal), hangs, tracebacks (any other exit status than
0 and 2), verdicts that disagree (models info accepting a file a backend
refuses as damaged; one backend answering where the other refuses: a silent
wrong output), and refusals of weights that compute NaN (found only by
computing, on both backends alike). Goal: 0 of the first four. The
mutations include a BPE tokenizer's merges emptied or dropped and merges
naming tokens the vocabulary lacks (a part, or the two joined).

``repack``: each fault the native engine's repack cache may meet (a symlink,
a FIFO, a group-writable or another user's file at a pack's path; a flipped
weight, a file cut short, altered weights with the digest recomputed
without the cache's secret; the GGUF changed in place with its times set
back; a part left by a killed load), a load of a built-in model after it in
a process of its own under a timeout. Goal: every one repacked (in memory
where the file is not the user's own, and said once), none hung, none
mapping what it was given.

``server``: ``edgespec serve`` on a tiny generated model (its cache in a
temporary EDGESPEC_HOME); its RSS at idle, then after each class of hostile
request (a 200 MB header, a chat template that renders without end, a
foreign Host, many disconnecting streams, cross-site POSTs, Hub references
on /api/create, slot saves past the cap, a slowloris flood of
``--slowloris`` connections dripping a byte every 2 s), each class
repeated, with the answers each got; goals: within 10% of idle after every
class, every cross-site POST, Hub reference and save past the cap refused,
every slowloris connection dropped by the request deadline or refused with
503, /health answered again within a few seconds of the flood's end, and no
accept() error in the server's log.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from gguf_mutants import NO_LOGITS, probe  # noqa: E402

MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")


def classify(run) -> Counter:
    """What one mutant's run counts as (see the module docstring)."""
    c = Counter(mutants=1)
    if not run.outcomes:
        c["skipped"] += 1          # its header outgrew the working copy's padding
        return c
    for o in run.outcomes.values():
        if o.code is None:
            c["hangs"] += 1
        elif o.code < 0:
            c["aborts"] += 1
        elif o.code not in (0, 2):
            c["tracebacks"] += 1
    if any(not p.startswith(("info:", "native:", "llama:")) for p in run.problems):
        c["disagreements"] += 1
    if all(o.code == 0 for o in run.outcomes.values()):
        c["accepted"] += 1
    if any(NO_LOGITS in o.error for o in run.outcomes.values()):
        c["nan_refusals"] += 1
    return c


def gguf(args) -> int:
    from edgespec.models import registry

    per_model = -(-args.mutants // len(args.models))
    totals, rows, findings = Counter(), [], []
    for i, name in enumerate(args.models):
        path = registry.resolve(name)
        t0 = time.perf_counter()
        runs = probe(path, args.workdir / name, seed=args.seed + i, n=per_model, threads=args.threads,
                     timeout=args.timeout)
        counts = sum((classify(r) for r in runs), Counter())
        counts["seconds"] = round(time.perf_counter() - t0)
        rows.append((name, counts))
        totals += counts
        findings += [{"model": name, "mutant": r.mutant, "problems": r.problems} for r in runs if r.problems]
        print(f"{name}: {dict(counts)}", flush=True)
    keys = ("mutants", "accepted", "aborts", "hangs", "tracebacks", "disagreements", "nan_refusals", "skipped")
    print("\n| model | " + " | ".join(keys) + " |\n|" + " --- |" * (len(keys) + 1))
    for name, c in rows + [("all", totals)]:
        print(f"| {name} | " + " | ".join(str(c[k]) for k in keys) + " |")
    for f in findings:
        print(f"{f['model']}: {f['mutant']}: {f['problems']}")
    if args.out:
        args.out.write_text(json.dumps({"rows": {n: dict(c) for n, c in rows}, "findings": findings}, indent=1))
    return 1 if any(totals[k] for k in ("aborts", "hangs", "tracebacks", "disagreements")) else 0


REPACK_FAULTS = ("symlink", "fifo", "group-writable", "another user's", "flipped weight", "cut short",
                 "plain digest", "another secret's digest", "GGUF changed in place, times restored",
                 "part of a killed load")


def repack(args) -> int:
    import os
    import shutil
    import subprocess
    import tempfile

    from edgespec.capi import lib
    from edgespec.models import registry
    model = registry.resolve(args.model)
    # One load in a process of its own: where its weights came from, its notices.
    load = ("import sys\nfrom edgespec.cli import _show_notices\nfrom edgespec.backends.native import NativeModel\n"
            "_show_notices()\nprint(NativeModel(sys.argv[1]).packed_from)\n")
    names = {lib.ES_PACKED_WRITTEN: "written again", lib.ES_PACKED_MAPPED: "MAPPED", lib.ES_PACKED_FOREIGN:
             "repacked in memory", lib.ES_PACKED_REPACKED: "repacked in memory (not written)"}
    expected = {kind: "repacked in memory" if kind in REPACK_FAULTS[:4] else "written again"
                for kind in REPACK_FAULTS}
    expected["part of a killed load"] = "MAPPED"   # the part goes; the file is whole
    failures = 0
    print("| fault | load | notices | seconds |\n| --- | --- | --- | --- |")
    for kind in REPACK_FAULTS:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            gguf_path, env = tmp / model.name, {**os.environ, "EDGESPEC_HOME": str(tmp / "home")}
            shutil.copyfile(model, gguf_path)

            def run(timeout=args.timeout):
                done = subprocess.run([sys.executable, "-c", load, str(gguf_path)], capture_output=True, text=True,
                                      timeout=timeout, env=env)
                return done.stdout.strip(), [line for line in done.stderr.splitlines() if ".pack" in line]
            run()
            [pack] = (tmp / "home" / registry.REPACKED_DIR).glob("*.pack")
            part = pack.with_name(pack.name + ".part-999999999-abcdef")
            _repack_fault(kind, pack, part, gguf_path, tmp)
            t0 = time.perf_counter()
            try:
                source, notices = run()
                got = names.get(int(source), source) if source.lstrip("-").isdigit() else f"failed: {source}"
            except subprocess.TimeoutExpired:
                got, notices = "HUNG", []
            if kind == "part of a killed load" and part.exists():
                got += ", part kept"
            failures += got != expected[kind] or len(notices) > 1
            print(f"| {kind} | {got} | {len(notices)} | {time.perf_counter() - t0:.1f} |", flush=True)
    return 1 if failures else 0


def _repack_fault(kind, pack, part, gguf_path, tmp) -> None:
    """Puts fault ``kind`` at the repack cache file ``pack`` (of ``gguf_path``)."""
    import os

    from test_repack_cache import HEADER, keyed_digest, plain_digest, put_foreign

    if kind in REPACK_FAULTS[:4]:
        put_foreign(pack, kind, tmp)
    elif kind == "cut short":
        with open(pack, "r+b") as f:
            f.truncate(pack.stat().st_size - 4096)
    elif kind == "GGUF changed in place, times restored":
        st = gguf_path.stat()
        with open(gguf_path, "r+b") as f:   # a byte at the file's middle, between sampled pages
            f.seek(st.st_size // 2 + 2048)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
        os.utime(gguf_path, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif kind == "part of a killed load":
        part.write_bytes(b"half")
    else:   # a flipped weight, with the digest left, or recomputed without the secret
        data = bytearray(pack.read_bytes())
        data[HEADER + 100] ^= 0x01
        if kind != "flipped weight":
            weights = bytes(data[HEADER:])
            digest = plain_digest(weights) if kind == "plain digest" else keyed_digest(bytes(32), weights)
            data[32:40] = digest.to_bytes(8, "little")
        pack.write_bytes(bytes(data))


def server(args) -> int:
    import os
    import resource
    import socket
    import tempfile
    import threading

    from edgespec.models import registry
    from hostile_server import (RUNAWAY_TEMPLATE, chat, huge_header, request, rss, serving, slowloris,
                                with_template)

    def disconnecting_streams(host, port):
        for _ in range(20):   # a stream left after its first event
            with socket.create_connection((host, port)) as s:
                body = json.dumps({"prompt": "Once upon a time", "max_tokens": 200, "stream": True})
                s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
                          f"\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
                s.recv(4096)

    def concurrent_runaway_templates(host, port):
        threads = [threading.Thread(target=chat, args=(host, port, f"hi {i}")) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def normal(host, port):
        for _ in range(5):
            request(host, port, "POST", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 16})

    def statuses(answers) -> str:
        return ", ".join(f"{n}x {status}" for status, n in sorted(Counter(answers).items(), key=str))

    def cross_site(host, port):   # the requests: a page's simple POSTs, with and without Origin
        evil = {"Origin": "https://evil.example", "Content-Type": "text/plain"}
        answers = []
        for path, body in (("/slots/0?action=save", {"filename": "x1.bin"}), ("/api/pull", {"model": MODELS[0]}),
                           ("/api/create", {"model": "x", "from": "/etc/hostname"}),
                           ("/api/copy", {"source": "x", "destination": "y"}), ("/v1/completions", {"prompt": "hi"})):
            for headers in (evil, {"Content-Type": "text/plain"}, {"Origin": "https://evil.example"}):
                answers += [request(host, port, "POST", path, body, headers=headers)[0] for _ in range(10)]
        return statuses(answers), all(a in (403, 415) for a in answers)

    def hub(host, port):
        answers = [request(host, port, "POST", "/api/create", {"model": "h", "from": "hf:a/b/c.gguf", "stream": False})[0]
                   for _ in range(10)]
        return statuses(answers), all(a == 403 for a in answers)

    def slot_saves(host, port):   # served with --max-slot-files 4
        request(host, port, "POST", "/completion", {"prompt": "Once upon a time", "n_predict": 8})
        answers = [request(host, port, "POST", "/slots/0?action=save", {"filename": f"s{i}.bin"})[0] for i in range(20)]
        kept = len(list((Path(os.environ["EDGESPEC_HOME"]) / "slots").glob("*/*")))
        return f"{statuses(answers)}; {kept} files kept", answers == [200] * 4 + [409] * 16 and kept == 4

    def flood(host, port):
        health = []   # (seconds since the flood began, status or None: no answer within 5 s)
        done = threading.Event()

        def ask():
            while not done.is_set():
                t = time.monotonic() - t0
                try:
                    health.append((t, request(host, port, "GET", "/health", timeout=5)[0]))
                except OSError:
                    health.append((t, None))
                done.wait(1)

        t0 = time.monotonic()
        asker = threading.Thread(target=ask)
        asker.start()
        ends = slowloris(host, port, args.slowloris, every=2, seconds=60)
        flood_s = max(s for _, s in ends if s is not None) if any(s for _, s in ends) else None
        time.sleep(3)
        done.set()
        asker.join()
        back = next((t for t, status in health if status == 200 and flood_s is not None and t >= flood_s), None)
        held = max((s for status, s in ends if status == 408), default=0)
        text = (f"{statuses(st for st, _ in ends)}; held at most {held:.1f} s; /health during: "
                f"{statuses(st for t, st in health if flood_s is None or t < flood_s)}, 200 again "
                f"{'never' if back is None else f'{back - flood_s:+.1f} s after the last one ended'}")
        ok = (all(st in (408, 503) and s is not None for st, s in ends) and back is not None
              and back - flood_s < 5)
        return text, ok

    classes = [
        ("200 MB header x3", lambda h, p: [huge_header(h, p, 200 << 20) for _ in range(3)]),
        ("runaway chat template x3", lambda h, p: [chat(h, p, "hi") for _ in range(3)]),
        ("runaway chat template, 4 at once", concurrent_runaway_templates),
        ("foreign Host x200", lambda h, p: [request(h, p, "GET", "/v1/models", headers={"Host": "evil.example"})
                                            for _ in range(200)]),
        ("streams left after one event x20", disconnecting_streams),
        ("normal completions x5", normal),
        ("cross-site POSTs x150", cross_site),
        ("/api/create from the Hub x10", hub),
        ("slot saves x20 (cap 4)", slot_saves),
        (f"slowloris x{args.slowloris}, a byte every 2 s", flood),
    ]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)   # this process holds the flood's sockets
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, args.slowloris + 256)), hard))
    worst, failed = 0.0, []
    with tempfile.TemporaryDirectory() as tmp, \
            with_template(registry.resolve(args.model), RUNAWAY_TEMPLATE, Path(tmp)) as model:
        os.environ["EDGESPEC_HOME"] = str(Path(tmp) / "home")   # the server's slot files and names
        with serving(model, "--threads", str(args.threads), "--drafter", "none",
                     "--max-slot-files", "4") as (proc, host, port):
            normal(host, port)
            idle = rss(proc.pid)
            print(f"| request class | answers | RSS after (MB) | / idle |\n| --- | --- | --- | --- |\n"
                  f"| idle | | {idle / 1e6:.0f} | 1.00 |")
            for name, send in classes:
                t0 = time.perf_counter()
                outcome = send(host, port)
                text, ok = outcome if isinstance(outcome, tuple) else ("", True)
                if not ok:
                    failed.append(name)
                time.sleep(1)   # answers sent, connections closed
                now = rss(proc.pid)
                worst = max(worst, now / idle)
                print(f"| {name} ({time.perf_counter() - t0:.1f} s) | {text} | {now / 1e6:.0f} | {now / idle:.2f} |",
                      flush=True)
            proc.kill()
            accept_errors = proc.stderr.read().count("Too many open files")
    print(f"\naccept() errors in the server's log: {accept_errors}; classes short of their goal: {failed or 'none'}")
    return 0 if worst <= 1.1 and not failed and not accept_errors else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    g = sub.add_parser("gguf", help="mutated GGUFs through models info and both backends")
    g.add_argument("--mutants", type=int, default=2000, help="in all, split between the models (2000)")
    g.add_argument("--models", nargs="+", default=list(MODELS))
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=2)
    g.add_argument("--timeout", type=float, default=300, help="seconds one command may take (300)")
    g.add_argument("--workdir", type=Path, default=Path("probe-work"), help="the working copies (probe-work)")
    g.add_argument("--out", type=Path, help="a JSON file for the counts and every finding")
    r = sub.add_parser("repack", help="faults at the repack cache's files, a load after each")
    r.add_argument("--model", default="smollm2-135m", help="a built-in model whose repacked file is faulted "
                                                           "(smollm2-135m)")
    r.add_argument("--timeout", type=float, default=120, help="seconds a load may take (120)")
    v = sub.add_parser("server", help="the server's RSS after each class of hostile request")
    v.add_argument("--model", default="smollm2-135m", help="served with a runaway chat template (smollm2-135m)")
    v.add_argument("--threads", type=int, default=2)
    v.add_argument("--slowloris", type=int, default=1100, help="connections of the slowloris flood (1100)")
    args = ap.parse_args()
    return {"gguf": gguf, "repack": repack, "server": server}[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
