"""MoE models larger than the memory given to them: the native engine's
expert cache against llama.cpp's memory map, under a real memory limit.

Two parts (both by default):

  speed    a synthetic Mixtral-style MoE (edgespec.training.moe_tools.synth; written once
           into --work) about 2x the limit. Every engine runs as its own
           process in a cgroup-v1 memory group (memory.limit_in_bytes, as
           root) sized to hold the non-expert weights plus half the experts,
           the page cache dropped before each run: llama.cpp (memory-mapped:
           without its CPU repacking, which copies Q4_0 weights out of the
           map; and as it loads by default),
           the native engine with the expert cache (adaptive and LRU policy,
           prefetch on and off; the cache gets half the experts) and, for
           reference, the native engine without a cache. Decode tokens/s side
           by side, ratios to llama.cpp, and the cache's counters (hit rate,
           MB read, prefetch accuracy, stall per token); with the model's
           sidecar (--low-type, written once) also `balanced` and `fast`
           precision, which read 2-3-bit copies on misses. --drafter adds a
           speculative run (drafter ngram) on the cached engine: a
           verification batch needs the union of its tokens' experts.
  quality  built-in dense models (--upcycle) upcycled to MoEs
           (edgespec.training.moe_tools.upcycle, exact experts compute the dense model) and
           their --low-type sidecars (Q2_K or Q3_K; Q4_0 where rows are no
           whole 256-value super-block, as smollm2's 576-wide and
           qwen2.5-coder-0.5b's 896-wide gate and up): `balanced` and `fast`
           against the same MoE served `exact`, each with a cache of
           --cache-fraction of the experts, over real text (this
           repository's README and docs, --positions tokens decoded one at a
           time, every engine in turn): top-1 agreement, mean and p99
           KL(exact || low), expert bytes read, median ms per token. `exact`
           against the dense model is context only (the same weights through
           other kernels). The page cache is dropped for the model and its
           sidecar first (posix_fadvise), and the cache drops what it reads.

    sudo python benchmarks/bench_moe.py --limit-mb 3000             # a ~6 GB synthetic MoE
    python benchmarks/bench_moe.py --part quality --positions 1000   # qwen2.5-coder-0.5b, smollm2
    python benchmarks/bench_moe.py --limit-mb 300 --tokens 16      # a small smoke run

Without root (or without /sys/fs/cgroup/memory) the speed part refuses to
run rather than measure without a limit. Results: a markdown table on stdout
and --out (JSON).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CGROUP = Path("/sys/fs/cgroup/memory")
PROMPT = "Here is a short story about a lighthouse keeper who"


# ---- one engine in one process -------------------------------------------------------------

def worker(args) -> None:
    """Runs in the limited group: one generation, its figures as JSON on stdout."""
    from edgespec import Engine

    if args.no_repack:
        # llama.cpp repacks Q4_0/Q8_0 weights for its AVX kernels into
        # anonymous memory, which takes the whole model off the memory map;
        # without the extra buffer types every weight stays mapped.
        import llama_cpp.llama_cpp as lc  # what edgespec's llama backend calls

        default = lc.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = False
            return p

        lc.llama_model_default_params = params
    kw = dict(backend=args.backend, threads=args.threads, n_ctx=1024, drafter=args.drafter)
    if args.cache_mb:
        kw.update(expert_cache_mb=args.cache_mb, expert_policy=args.policy,
                  expert_prefetch=args.prefetch, expert_precision=args.precision)
    t0 = time.perf_counter()
    with Engine(args.model, **kw) as e:
        load_s = time.perf_counter() - t0
        r = e.generate(PROMPT, max_tokens=args.tokens, temperature=0.0)
    peak = 0
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            peak = int(line.split()[1]) // 1024
    print(json.dumps({"tokens": r.stats.n_tokens, "tokens_per_s": r.stats.tokens_per_s, "load_s": load_s,
                      "prefill_s": r.stats.prefill_s, "peak_rss_mib": peak, "experts": r.stats.experts,
                      "spec": r.stats.spec.to_dict() if r.stats.spec else None}))


def run_limited(name: str, limit_bytes: int, argv: list[str], timeout: int) -> dict:
    """argv as a process of a fresh memory group of limit_bytes; its JSON or an error."""
    group = CGROUP / f"edgespec-bench-moe-{os.getpid()}-{name.replace(':', '-')}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
        swap = group / "memory.memsw.limit_in_bytes"
        if swap.exists():
            swap.write_text(str(limit_bytes))  # no escape into swap either
        try:
            Path("/proc/sys/vm/drop_caches").write_text("1")  # every engine starts cold
        except OSError:
            pass

        def enter():
            (group / "cgroup.procs").write_text(str(os.getpid()))

        t0 = time.perf_counter()
        p = subprocess.run(argv, preexec_fn=enter, capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - t0
        failcnt = int((group / "memory.failcnt").read_text())
        if p.returncode != 0:
            return {"error": (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1][:300],
                    "wall_s": wall}
        out = json.loads(p.stdout.strip().splitlines()[-1])
        out.update(wall_s=wall, limit_hits=failcnt)
        return out
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    finally:
        group.rmdir()


# ---- speed --------------------------------------------------------------------------------

def sidecar_for(model: Path, low_type: str) -> Path:
    """The model's sidecar of low_type copies, (re)written when absent or of
    another type."""
    from edgespec import moe
    from edgespec.training import moe_tools
    import gguf

    path = moe.sidecar_path(model)
    want = int(getattr(gguf.GGMLQuantizationType, low_type.upper()))
    head = path.read_bytes()[:88] if path.exists() else b""
    types = {int.from_bytes(head[12:16], "little"), int.from_bytes(head[72:76], "little")} if head else set()
    if want not in types:
        moe_tools.prepare(model, qtype=low_type)
    return path

def sizes(path: Path) -> tuple[int, int]:
    """(bytes of expert weights, bytes of everything else) of a GGUF."""
    import gguf

    r = gguf.GGUFReader(str(path))
    experts = sum(int(t.n_bytes) for t in r.tensors if "_exps." in t.name)
    return experts, sum(int(t.n_bytes) for t in r.tensors) - experts


def synth_for(limit_mb: int, work: Path, tokenizer: str) -> Path:
    """A synthetic MoE whose experts are about 2x limit_mb (8 experts, top 2,
    Q4_0, Mixtral's 4096 x 14336; 1024 x 3584 when that gives fewer than 2 layers)."""
    from edgespec.training import moe_tools
    from edgespec.models import registry

    embd, ff, experts = 4096, 14336, 8
    per_layer = 3 * embd * ff * experts * 18 // 32
    layers = max(1, round(2 * limit_mb * 1e6 / per_layer))
    if layers < 2:  # small runs: narrower layers
        embd, ff = 1024, 3584
        per_layer = 3 * embd * ff * experts * 18 // 32
        layers = max(2, round(2 * limit_mb * 1e6 / per_layer))
    path = work / f"synth-{experts}x{layers}-{embd}-{ff}-q4_0.gguf"
    if not path.exists():
        moe_tools.synth(path, registry.resolve(tokenizer), experts=experts, top_k=2, layers=layers, embd=embd,
                  ff=ff, qtype="q4_0")
    return path


def speed(args) -> dict:
    if os.geteuid() != 0 or not (CGROUP / "memory.limit_in_bytes").exists():
        sys.exit("error: the speed part needs root and cgroup v1's memory controller at "
                 f"{CGROUP} (a real memory limit); run it with sudo, or --part quality")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else synth_for(args.limit_mb, work, args.tokenizer)
    expert_bytes, other_bytes = sizes(model)
    limit = args.limit_mb * 1_000_000
    # The group holds the non-expert weights, the process's own memory and
    # the cache: half the experts, or what is left of the limit.
    room = limit - other_bytes - args.overhead_mb * 1_000_000
    cache_mb = min(expert_bytes // 2, room) // 1_000_000
    if cache_mb < 1:
        sys.exit(f"error: a limit of {args.limit_mb} MB leaves no room for an expert cache beside "
                 f"{other_bytes / 1e6:.0f} MB of other weights and {args.overhead_mb} MB of overhead")
    print(f"model {model.name}: {expert_bytes / 1e6:.0f} MB of experts + {other_bytes / 1e6:.0f} MB other; "
          f"limit {args.limit_mb} MB; expert cache {cache_mb} MB", file=sys.stderr)
    base = [sys.executable, __file__, "_worker", "--model", str(model), "--threads", str(args.threads),
            "--tokens", str(args.tokens)]
    runs = {} if args.native_only else {
        "llama.cpp (mmap)": base + ["--backend", "llama", "--no-repack"],
        "llama.cpp (default: repacked)": base + ["--backend", "llama"],
    }
    runs.update({
        "native (mmap)": base + ["--backend", "native"],
        "native cache adaptive": base + ["--backend", "native", "--cache-mb", str(cache_mb)],
        "native cache lru": base + ["--backend", "native", "--cache-mb", str(cache_mb), "--policy", "lru"],
        "native cache no prefetch": base + ["--backend", "native", "--cache-mb", str(cache_mb),
                                            "--prefetch", "0"],
    })
    if args.low_type:
        sidecar_for(model, args.low_type)
        for precision in ("balanced", "fast"):
            runs[f"native cache {precision}"] = runs["native cache adaptive"] + ["--precision", precision]
    if args.drafter:
        runs["native cache + ngram drafts"] = runs["native cache adaptive"] + ["--drafter", "ngram"]
    # Rounds in alternating order (ABC.., ..CBA), so that a machine's drift
    # touches every setting alike; each setting's run of median speed is
    # kept (of two, the faster), every round's speed beside it.
    rounds: dict[str, list[dict]] = {name: [] for name in runs}
    for i in range(args.rounds):
        for name in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
            print(f"  {name} (round {i + 1}) ...", file=sys.stderr, flush=True)
            rounds[name].append(run_limited(name, limit, runs[name], args.timeout))
    results = {}
    for name, rs in rounds.items():
        ok = sorted((r for r in rs if "error" not in r), key=lambda r: r["tokens_per_s"])
        results[name] = dict(ok[len(ok) // 2], rounds_tokens_per_s=[r["tokens_per_s"] for r in ok]) if ok else rs[0]
    ref = results.get("llama.cpp (mmap)", {}).get("tokens_per_s")
    lines = ["| engine | decode tok/s | x llama.cpp | peak RSS MiB | hit rate | MB read/token | "
             "prefetch used | by depth 1, 2, ... | depth at end | stall ms/token | drafts accepted |",
             "|" + " --- |" * 11]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} |" + " |" * 9)
            continue
        x, spec = r.get("experts"), r.get("spec")
        ratio = f"{r['tokens_per_s'] / ref:.2f}" if ref else "–"
        cache = (f"{100 * x['hit_rate']:.0f}% | {x['bytes_read'] / 1e6 / max(1, x['tokens']):.1f} | "
                 f"{100 * x['prefetch_accuracy']:.0f}% | "
                 f"{', '.join(f'{100 * a:.0f}%' for a in x['prefetch_accuracy_by_depth']) or '–'} | "
                 f"{x['prefetch_depth']} | {x['stall_ms_per_token']:.1f}") if x else "– | – | – | – | – | –"
        drafts = (f"{spec['accepted']}/{spec['drafted']}" if spec and spec.get("drafted") else "–")
        lines.append(f"| {name} | {r['tokens_per_s']:.2f} | {ratio} | {r['peak_rss_mib']} | {cache} | {drafts} |")
    nopf, pf = results.get("native cache no prefetch", {}), results.get("native cache adaptive", {})
    hidden = None
    if nopf.get("experts") and pf.get("experts") and nopf["experts"]["stall_ns"]:
        hidden = 1 - pf["experts"]["stall_ms_per_token"] / nopf["experts"]["stall_ms_per_token"]
        lines.append(f"\nprefetch hides {100 * hidden:.0f}% of the stall time per token")
    return {"model": str(model), "expert_bytes": expert_bytes, "other_bytes": other_bytes,
            "limit_bytes": limit, "cache_mb": cache_mb, "runs": results, "stall_hidden": hidden,
            "table": "\n".join(lines)}


# ---- quality ------------------------------------------------------------------------------

def text_tokens(backend, n: int) -> list[int]:
    text = "\n\n".join((ROOT / p).read_text() for p in ("README.md", "docs/ARCHITECTURE.md", "CHANGELOG.md")
                       if (ROOT / p).exists())
    tokens = backend.tokenize(text)
    if len(tokens) < n:
        sys.exit(f"error: the docs give {len(tokens)} tokens, fewer than --positions {n}")
    return tokens[:n]


def log_softmax(x: np.ndarray) -> np.ndarray:
    """(n_vocab,) logits -> float64 log-probabilities."""
    x = x.astype(np.float64)
    x -= x.max()
    return x - np.log(np.exp(x).sum())


def kl(ref: np.ndarray, got: np.ndarray) -> float:
    """KL(ref || got) of two log-probability rows."""
    return float((np.exp(ref) * (ref - got)).sum())


def drop_page_cache(*paths: Path) -> None:
    """Takes paths' pages out of the page cache (written back first, as
    DONTNEED leaves dirty pages), so the next reads come from the disk."""
    for path in paths:
        if path.exists():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


QUALITY_RUNS = ("exact", "balanced", "fast")


def quality_one(args, name: str) -> dict:
    """One built-in model upcycled: the three precisions side by side, one
    token at a time (as generation reads experts), each position decoded
    by every engine in turn (the order rotating) and timed; `balanced` and
    `fast` against `exact`, `exact` against the dense model as context."""
    from edgespec import moe
    from edgespec.training import moe_tools
    from edgespec.backends import open_backend
    from edgespec.models import registry

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    dense = registry.resolve(name)
    up = work / f"{dense.stem}-moe{args.experts}-top{args.top_k}-r{args.router_scale:g}.gguf"
    if not up.exists():
        moe_tools.upcycle(dense, up, experts=args.experts, top_k=args.top_k, router_scale=args.router_scale)
    sidecar = sidecar_for(up, args.low_type or "q3_k")
    expert_bytes, _ = sizes(up)
    cache_mb = max(1, int(expert_bytes * args.cache_fraction) // 1_000_000)
    opts = dict(n_ctx=args.positions + 8, n_batch=256, threads=args.threads)
    drop_page_cache(up, sidecar)
    engines = {"dense": open_backend("native", dense, **opts)}
    try:
        for precision in QUALITY_RUNS:
            engines[precision] = open_backend("native", up, experts=moe.ExpertCache(cache_mb, precision),
                                              **opts)
        tokens = text_tokens(engines["dense"], args.positions)
        n_vocab = engines["dense"].n_vocab
        top1 = {k: [] for k in engines if k != "exact"}
        kls = {k: [] for k in engines if k != "exact"}
        ms = {k: [] for k in QUALITY_RUNS}
        for b in engines.values():
            b.clear()
            if b is not engines["dense"]:
                b.expert_stats(reset=True)
        order = list(engines)
        for i, t in enumerate(tokens):
            rows = {}
            for k in order[i % len(order):] + order[:i % len(order)]:
                t0 = time.perf_counter()
                addr = engines[k].decode([t], logits_from=0)
                if k in ms:
                    ms[k].append(1e3 * (time.perf_counter() - t0))
                rows[k] = log_softmax(np.ctypeslib.as_array((ctypes.c_float * n_vocab).from_address(addr)))
            ref = rows["exact"]
            for k in top1:
                # dense is the context: exact against it, the others against exact
                a, b = (rows[k], ref) if k == "dense" else (ref, rows[k])
                top1[k].append(a.argmax() == b.argmax())
                kls[k].append(kl(a, b))
        stats = {k: engines[k].expert_stats() for k in QUALITY_RUNS}
    finally:
        for b in engines.values():
            b.close()
    exact_read, exact_ms = stats["exact"]["bytes_read"], float(np.median(ms["exact"]))
    out = {"model": str(up), "dense": str(dense), "positions": len(tokens), "cache_mb": cache_mb,
           "expert_mb": expert_bytes / 1e6, "low_type": args.low_type or "q3_k", "runs": {}}
    lines = ["| precision | top-1 vs exact | mean KL | p99 KL | expert MB read | vs exact | "
             "substitutions | hit rate | ms/token (median) | speed vs exact |", "|" + " --- |" * 10]
    for k in QUALITY_RUNS:
        st, med = stats[k], float(np.median(ms[k]))
        run = {"ms_per_token_median": med, "speedup_vs_exact": exact_ms / med, "stats": st}
        if k != "exact":
            run.update(top1=float(np.mean(top1[k])), mean_kl=float(np.mean(kls[k])),
                       p99_kl=float(np.percentile(kls[k], 99)))
        q = (f"{100 * run['top1']:.2f}% | {run['mean_kl']:.5f} | {run['p99_kl']:.5f}" if k != "exact"
             else "(reference) | – | –")
        lines.append(f"| {k} | {q} | {st['bytes_read'] / 1e6:.0f} | {st['bytes_read'] / exact_read:.2f} | "
                     f"{st['substitutions']} | {100 * st['hit_rate']:.0f}% | {med:.1f} | "
                     f"{exact_ms / med:.2f}x |")
        out["runs"][k] = run
    out["exact_vs_dense"] = {"top1": float(np.mean(top1["dense"])), "mean_kl": float(np.mean(kls["dense"])),
                             "p99_kl": float(np.percentile(kls["dense"], 99))}
    d = out["exact_vs_dense"]
    lines.append(f"\ncontext: `exact` against the dense {dense.name} (other kernels, same weights): "
                 f"top-1 {100 * d['top1']:.2f}%, mean KL {d['mean_kl']:.5f}, p99 KL {d['p99_kl']:.5f}")
    out["table"] = "\n".join(lines)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = sys.argv[1:2] == ["_worker"]
    if sub:
        ap.add_argument("_worker")
        ap.add_argument("--model", required=True)
        ap.add_argument("--backend", default="native")
        ap.add_argument("--threads", type=int, default=2)
        ap.add_argument("--tokens", type=int, default=64)
        ap.add_argument("--cache-mb", type=int, default=0)
        ap.add_argument("--policy", default="adaptive")
        ap.add_argument("--prefetch", type=int, default=3)
        ap.add_argument("--precision", default="exact")
        ap.add_argument("--drafter", default="none")
        ap.add_argument("--no-repack", action="store_true")
        worker(ap.parse_args())
        return
    ap.add_argument("--part", choices=("speed", "quality", "both"), default="both")
    ap.add_argument("--limit-mb", type=int, default=3000, help="memory limit of each engine's group (MB)")
    ap.add_argument("--model", help="a MoE GGUF for the speed part (default: a synthetic one of ~2x the limit)")
    ap.add_argument("--overhead-mb", type=int, default=200,
                    help="memory of the process beside weights and cache (interpreter, KV cache, vocabulary)")
    ap.add_argument("--tokenizer", default="smollm2-135m", help="tokenizer of the synthetic model")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per speed run")
    ap.add_argument("--drafter", action="store_true", help="also a speculative (ngram) run on the cache")
    ap.add_argument("--rounds", type=int, default=1, help="speed: runs of every setting, in alternating "
                    "order; the median is reported")
    ap.add_argument("--native-only", action="store_true", help="speed: no llama.cpp runs (the native "
                    "engine's settings against each other)")
    ap.add_argument("--low-type", default="q3_k", choices=("q2_k", "q3_k", ""),
                    help="type of the sidecar's copies (balanced/fast runs; '': none in the speed part)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per speed run")
    ap.add_argument("--upcycle", default="qwen2.5-coder-0.5b,smollm2-135m",
                    help="the dense built-in models of the quality part, comma-separated")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--router-scale", type=float, default=8.0,
                    help="upcycled routers' scale: sharper routing gives balanced low-weight experts")
    ap.add_argument("--cache-fraction", type=float, default=0.5, help="quality: cache size / expert bytes")
    ap.add_argument("--positions", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=str(Path.home() / ".cache/edgespec/bench-moe"))
    ap.add_argument("--out", default="bench-moe.json")
    args = ap.parse_args()
    doc = {}
    if args.part in ("speed", "both"):
        doc["speed"] = speed(args)
        print("## Speed under a memory limit\n\n" + doc["speed"]["table"] + "\n")
    if args.part in ("quality", "both"):
        doc["quality"] = {}
        for name in args.upcycle.split(","):
            q = doc["quality"][name] = quality_one(args, name)
            print(f"## Mixed precision on {Path(q['model']).name}, {q['positions']} positions, "
                  f"{q['cache_mb']} MB cache of {q['expert_mb']:.0f} MB of experts, {q['low_type']} "
                  f"copies\n\n" + q["table"] + "\n", flush=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
