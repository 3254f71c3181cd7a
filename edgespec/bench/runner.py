"""The benchmark loop: every configuration on every prompt, interleaved.

Configurations (edgespec with each drafter, and the peers) run one after
another on the same prompt, in an order rotated per prompt and repeat, so
that machine drift (heat, other processes) hits all of them alike; speedups
are medians of per-prompt ratios to edgespec's plain decoding of the same
prompt, mode and repeat. Each edgespec configuration has its own Engine, so a
drafter's learned state (planner acceptance, recycling matrix) never helps
another configuration; the weights are memory-mapped, so the copies share
their pages. Every greedy edgespec run is compared token by token with plain
decoding: a difference counts in ``greedy_mismatches`` with its position.
"""
from __future__ import annotations

import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from .. import drafters as drafting
from ..models import registry
from ..engine import Engine
from ..errors import InvalidArgumentError
from ..planner import speedup_ceiling
from ..progress import Progress
from . import suites as suite_data
from .hardware import PeakRSS, fingerprint
from .peers import PEERS, PeerError, RunResult, open_peer

SCHEMA = "edgespec.bench/1"
MODES = ("greedy", "sampled")
QUICK = {"suites": ["edit", "chat", "code", "multilingual"], "limit": 1, "max_tokens": 48, "repeats": 1,
         "drafters": ["none", "ngram", "auto"]}
WARMUP_TOKENS = 16
DEFAULT_LIMIT = 4


@dataclass
class BenchOptions:
    model: str | None = None
    backend: str = "llama"
    ep: str | None = None               # onnx backend's execution provider
    draft_backend: str | None = None    # the draft model's backend (default: the target's)
    threads: int | None = None
    suites: list[str] = field(default_factory=lambda: list(suite_data.SUITES))
    langs: list[str] | None = None
    limit: int | None = None            # None: DEFAULT_LIMIT per shipped suite, every prompt of a --prompts file
    prompts_file: Path | None = None
    drafters: list[str] = field(default_factory=lambda: ["none", "ngram", "recycle", "auto"])
    draft_model: str | None = None
    ngram_cache: str | None = None
    modes: list[str] = field(default_factory=lambda: ["greedy"])
    max_tokens: int = 256
    repeats: int = 2
    warmup: bool = True
    peers: list[str] | None = None      # None: every peer that can run here
    llama_cpp_bin: Path | None = None
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = 0
    n_ctx: int = 4096
    remeasure_costs: bool = True        # measure the batch cost curve now instead of using the cached one
    quick: bool = False

    def check(self) -> None:
        if self.limit is not None and self.limit <= 0:
            raise InvalidArgumentError(f"--limit must be > 0, got {self.limit}")
        if self.max_tokens <= 0:
            raise InvalidArgumentError(f"--max-tokens must be > 0, got {self.max_tokens}")
        if self.repeats <= 0:
            raise InvalidArgumentError(f"--repeats must be > 0, got {self.repeats}")
        if self.threads is not None and self.threads <= 0:
            raise InvalidArgumentError(f"--threads must be > 0, got {self.threads}")
        for s in self.suites:
            if s not in suite_data.SUITES:
                raise InvalidArgumentError(f"unknown suite '{s}' (available: {', '.join(suite_data.SUITES)})")
        for d in self.drafters:
            drafting.check_name(d)
        for m in self.modes:
            if m not in MODES:
                raise InvalidArgumentError(f"unknown mode '{m}' (available: {', '.join(MODES)})")
        for p in self.peers or ():
            if p not in PEERS:
                raise InvalidArgumentError(f"unknown peer '{p}' (available: {', '.join(PEERS)})")
        if not (self.temperature > 0 and 0 < self.top_p <= 1):
            raise InvalidArgumentError("sampled mode needs --temperature > 0 and --top-p in (0, 1]")
        if self.llama_cpp_bin is not None and not Path(self.llama_cpp_bin).is_dir():
            raise InvalidArgumentError(f"--llama-cpp-bin {self.llama_cpp_bin}: no such directory")
        if "model" in self.drafters and not self.draft_model:
            raise InvalidArgumentError("drafter 'model' needs --draft-model")


class Configuration:
    """One edgespec drafter with its own Engine."""

    kind = "edgespec"
    greedy_only = False

    def __init__(self, drafter: str, options: BenchOptions, ngram_cache: str | None, rss: PeakRSS):
        self.name = f"edgespec:{drafter}"
        self.drafter = drafter
        self.rss = rss
        self.engine = Engine(options.model, backend=options.backend, ep=options.ep, threads=options.threads,
                             n_ctx=options.n_ctx, drafter=drafter, draft_model=options.draft_model,
                             draft_backend=options.draft_backend, ngram_cache=ngram_cache)
        self.threads = self.engine.backend.threads

    def run(self, prompt: suite_data.Prompt, max_tokens: int, sampling: dict) -> RunResult:
        engine = self.engine
        engine.forget_prefix()  # every run evaluates its whole prompt: prefill is measured alike
        kw = dict(max_tokens=max_tokens, temperature=sampling["temperature"], seed=sampling["seed"],
                  top_p=sampling["top_p"] if sampling["temperature"] else 1.0)
        use_chat = prompt.chat and engine.chat_template is not None
        self.rss.reset()
        t0 = time.perf_counter()
        t_first = None
        pieces = engine.stream(messages=[{"role": "user", "content": prompt.prompt}], **kw) if use_chat \
            else engine.stream(prompt.prompt, **kw)
        for _ in pieces:
            if t_first is None:
                t_first = time.perf_counter()
        peak = self.rss.read()
        r = engine.last_result
        s, spec = r.stats, r.stats.spec
        return RunResult(n_tokens=s.n_tokens, prompt_tokens=s.prompt_tokens, decode_tps=s.tokens_per_s,
                         ttft_s=(t_first or time.perf_counter()) - t0,
                         prefill_tps=s.prefill_tokens_per_s or None, peak_rss_mib=peak, text=r.text,
                         tokens=r.tokens, stop_reason=s.stop_reason,
                         drafted=spec.drafted if spec else None, accepted=spec.accepted if spec else None,
                         target_steps=spec.target_steps if spec else None,
                         by_length=dict(spec.by_length) if spec else {})

    def render(self, prompt: suite_data.Prompt) -> str:
        """The text a peer is given: the chat-rendered prompt, or the raw one."""
        if prompt.chat and self.engine.chat_template is not None:
            return self.engine.render_chat([{"role": "user", "content": prompt.prompt}])
        return prompt.prompt

    def close(self) -> None:
        self.engine.close()


class PeerConfiguration:
    """A peer behind the configuration interface: it is given rendered text."""

    kind = "peer"
    drafter = None

    def __init__(self, peer, render):
        self.peer, self.render = peer, render
        self.name, self.greedy_only, self.threads = peer.name, peer.greedy_only, peer.threads

    def run(self, prompt, max_tokens, sampling) -> RunResult:
        return self.peer.run(self.render(prompt), max_tokens, sampling)

    def close(self) -> None:
        self.peer.close()


def _build_suite_cache(engine: Engine, folder: Path) -> str:
    """An n-gram cache of every shipped prompt, for `cache` without --ngram-cache."""
    from ..drafters.cache import build_ngram_cache

    corpus = folder / "suite-texts.txt"
    corpus.write_text(suite_data.corpus_text(), encoding="utf-8")
    path = folder / "suite-texts.ngram"
    build_ngram_cache(lambda text: engine.tokenize(text, add_special=False), [corpus], path, progress=False)
    return str(path)


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------


def run_bench(options: BenchOptions, *, progress: bool = True,
              command: str | None = None) -> dict:
    """Run the benchmark; returns the results document (schema SCHEMA)."""
    if options.quick:
        for k, v in QUICK.items():
            setattr(options, k, v)
    options.check()
    if options.limit is None and options.prompts_file is None:
        options.limit = DEFAULT_LIMIT
    prompts = suite_data.select(options.suites, langs=options.langs, limit=options.limit,
                                prompts_file=options.prompts_file)
    drafters = list(dict.fromkeys(["none"] + options.drafters))  # plain decoding is the baseline
    load_start = _load_average()
    rss = PeakRSS()
    notes: list[str] = []
    bar = Progress("bench", 1, enabled=progress, lines=True)

    configs: list = []
    peers_status: dict[str, dict] = {}
    scratch = tempfile.TemporaryDirectory(prefix="edgespec-bench-")
    try:
        bar.note(f"loading {options.model or registry.default_model()} for {len(drafters)} edgespec configurations")
        configs.append(Configuration("none", options, options.ngram_cache, rss))
        plain = configs[0]
        ngram_cache = options.ngram_cache
        if "cache" in drafters and not ngram_cache:
            ngram_cache = _build_suite_cache(plain.engine, Path(scratch.name))
            notes.append("drafter cache: n-gram cache built from every shipped suite prompt "
                         "(benchmark prompts included), no --ngram-cache given")
        for d in drafters[1:]:
            configs.append(Configuration(d, options, ngram_cache, rss))
        if options.remeasure_costs:
            bar.note("measuring the batch cost curve")
        costs = plain.engine.batch_costs(remeasure=options.remeasure_costs)
        ceiling, ceiling_k = speedup_ceiling(costs)

        model_path = plain.engine.model_path
        wanted = options.peers if options.peers is not None else \
            [p for p in PEERS if p.startswith("llama-cpp-python") or options.llama_cpp_bin is not None]
        draft_path = registry.model_path_checked(options.draft_model) if options.draft_model else None
        for name in wanted:
            try:
                if model_path.suffix != ".gguf":
                    raise PeerError(f"peers need a GGUF model, not {model_path}")
                peer = open_peer(name, model_path=model_path, threads=plain.threads, n_ctx=options.n_ctx,
                                 rss=rss, bin_dir=Path(options.llama_cpp_bin) if options.llama_cpp_bin else None,
                                 draft_model=draft_path)
                configs.append(PeerConfiguration(peer, plain.render))
                peers_status[name] = {"status": "ok", "error": None}
            except PeerError as e:
                peers_status[name] = {"status": "failed", "error": str(e)}
                bar.note(f"peer {name} failed: {e}")

        samplings = {"greedy": {"temperature": 0.0, "top_p": 1.0},
                     "sampled": {"temperature": options.temperature, "top_p": options.top_p}}
        slots = [(c, m) for m in options.modes for c in configs if m == "greedy" or not c.greedy_only]
        if "sampled" in options.modes:
            notes.append("sampled runs are not compared token by token with plain decoding: speculative "
                         "sampling keeps the target's distribution, not plain decoding's exact draws")
        for c in configs:
            if c.greedy_only and "sampled" in options.modes:
                notes.append(f"{c.name} runs greedy only (the binary has no sampling options)")
        failed: dict[str, str] = {}

        def attempt(c, prompt, mode, max_tokens, seed):
            try:
                return c.run(prompt, max_tokens, {**samplings[mode], "seed": seed})
            except PeerError as e:
                failed[c.name] = str(e)
                peers_status[c.name] = {"status": "failed", "error": str(e)}
                bar.note(f"peer {c.name} failed: {e}")
                return None

        if options.warmup:  # load pages, JIT caches, the planner's first steps: not measured
            for c, mode in slots:
                if c.name not in failed:
                    attempt(c, prompts[0], mode, min(WARMUP_TOKENS, options.max_tokens), options.seed)

        bar.total = options.repeats * len(prompts) * len(slots)
        runs: list[dict] = []
        divergences: list[dict] = []
        checked: dict[str, int] = {}
        for rep in range(options.repeats):
            for i, prompt in enumerate(prompts):
                for mode in options.modes:
                    group = [c for c, m in slots if m == mode]
                    shift = (rep + i) % len(group)
                    order = group[shift:] + group[:shift]
                    got: dict[str, RunResult] = {}
                    for c in order:
                        bar.update(0, f"{prompt.suite}/{prompt.id} {c.name} {mode}")
                        seed = options.seed + 1000 * rep + i
                        if c.name in failed:
                            bar.update(1)
                            continue
                        r = attempt(c, prompt, mode, options.max_tokens, seed)
                        bar.update(1)
                        if r is not None:
                            got[c.name] = r
                    base = got.get("edgespec:none")
                    for c in group:
                        r = got.get(c.name)
                        if r is None:
                            continue
                        rec = {"config": f"{c.name}/{mode}", "prompt": prompt.id, "suite": prompt.suite,
                               "lang": prompt.lang, "repeat": rep, "mode": mode,
                               "n_tokens": r.n_tokens, "prompt_tokens": r.prompt_tokens,
                               "decode_tokens_per_s": r.decode_tps, "ttft_s": r.ttft_s,
                               "prefill_tokens_per_s": r.prefill_tps, "peak_rss_mib": r.peak_rss_mib,
                               "speedup": r.decode_tps / base.decode_tps if base and base.decode_tps else None,
                               "drafted": r.drafted, "accepted": r.accepted, "target_steps": r.target_steps,
                               "by_length": {str(k): v for k, v in sorted(r.by_length.items())},
                               "stop_reason": r.stop_reason, "same_as_plain": None}
                        if mode == "greedy" and base is not None and c.name != "edgespec:none":
                            if c.kind == "edgespec":
                                k = _first_difference(r.tokens, base.tokens)
                                checked[rec["config"]] = checked.get(rec["config"], 0) + 1
                                rec["same_as_plain"] = k is None
                                if k is not None:
                                    divergences.append({"config": rec["config"], "prompt": prompt.id,
                                                        "repeat": rep, "output_position": k,
                                                        "context_position": base.prompt_tokens + k})
                            elif r.text is not None:
                                rec["same_as_plain"] = r.text == base.text
                        runs.append(rec)
        bar.done()
    finally:
        for c in configs:
            c.close()
        scratch.cleanup()
    if ngram_cache and not options.ngram_cache:
        ngram_cache = "(built from the shipped suites)"

    doc = {
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command or shlex.join(sys.argv),
        "settings": {
            "model": options.model or registry.default_model(), "model_path": str(model_path),
            "backend": options.backend, "ep": options.ep, "draft_backend": options.draft_backend,
            "threads": plain.threads, "suites": options.suites if not options.prompts_file else [],
            "prompts_file": str(options.prompts_file) if options.prompts_file else None,
            "langs": options.langs, "limit": options.limit, "drafters": drafters,
            "draft_model": options.draft_model, "ngram_cache": ngram_cache, "modes": options.modes,
            "max_tokens": options.max_tokens, "repeats": options.repeats, "warmup": options.warmup,
            "warmup_tokens": WARMUP_TOKENS if options.warmup else 0,
            "sampling": {"temperature": options.temperature, "top_p": options.top_p, "seed": options.seed},
            "n_ctx": options.n_ctx, "quick": options.quick, "remeasured_costs": options.remeasure_costs,
            "llama_cpp_bin": str(options.llama_cpp_bin) if options.llama_cpp_bin else None,
        },
        "hardware": fingerprint(plain.threads),
        "peak_rss_method": rss.method + "; in-process configurations share one process, so their "
                           "figure includes every model loaded in it; binaries: the child's own peak",
        "ceiling": {"speedup": ceiling, "draft_length": ceiling_k, "batch_cost": costs[1:],
                    "all_accepted_speedup": [(k + 1) / costs[k + 1] for k in range(1, len(costs) - 1)]},
        "peers": peers_status,
        "prompts": [p.to_dict() for p in prompts],
        "runs": runs,
        "divergences": divergences,
        "notes": notes,
    }
    doc["configurations"] = summarize(runs, [(c, m) for c, m in slots], ceiling, checked, failed)
    doc["greedy_mismatches"] = {c["id"]: c["greedy_mismatches"] for c in doc["configurations"]
                                if c["greedy_mismatches"] is not None}
    doc["hardware"]["load_average_start"] = load_start
    doc["hardware"]["load_average_end"] = _load_average()
    return doc


def _group(runs: list[dict], key: str) -> dict:
    out: dict[str, dict] = {}
    for value in sorted({r[key] for r in runs}):
        sub = [r for r in runs if r[key] == value]
        out[value] = {"runs": len(sub), "speedup": _median(r["speedup"] for r in sub),
                      "decode_tokens_per_s": _median(r["decode_tokens_per_s"] for r in sub)}
    return out


def summarize(runs: list[dict], slots, ceiling: float, checked: dict, failed: dict) -> list[dict]:
    out = []
    for c, mode in slots:
        cid = f"{c.name}/{mode}"
        rs = [r for r in runs if r["config"] == cid]
        drafted = sum(r["drafted"] or 0 for r in rs)
        accepted = sum(r["accepted"] or 0 for r in rs)
        steps = sum(r["target_steps"] or 0 for r in rs)
        has_spec = any(r["drafted"] is not None for r in rs)
        by_len: dict[str, dict] = {}
        for r in rs:
            for k, v in r["by_length"].items():
                d = by_len.setdefault(k, {"steps": 0, "accepted": 0})
                d["steps"] += v["steps"]
                d["accepted"] += v["accepted"]
        for k, d in by_len.items():
            d["acceptance_rate"] = d["accepted"] / (d["steps"] * int(k))
        speedup = _median(r["speedup"] for r in rs)
        greedy_edgespec = c.kind == "edgespec" and mode == "greedy" and c.name != "edgespec:none"
        out.append({
            "id": cid, "name": c.name, "kind": c.kind, "drafter": c.drafter, "mode": mode,
            "threads": c.threads,
            "status": "failed" if c.name in failed else "ok", "error": failed.get(c.name),
            "runs": len(rs),
            "decode_tokens_per_s": _median(r["decode_tokens_per_s"] for r in rs),
            "speedup": speedup,
            "fraction_of_ceiling": speedup / ceiling if speedup is not None else None,
            "acceptance_rate": accepted / drafted if drafted else (0.0 if has_spec else None),
            "mean_accepted": (accepted / steps if steps else 0.0) if c.kind == "edgespec" and has_spec else None,
            "drafted": drafted if has_spec else None, "accepted": accepted if has_spec else None,
            "ttft_s": _median(r["ttft_s"] for r in rs),
            "prefill_tokens_per_s": _median(r["prefill_tokens_per_s"] for r in rs),
            "peak_rss_mib": max((r["peak_rss_mib"] for r in rs if r["peak_rss_mib"] is not None), default=None),
            "greedy_runs_checked": checked.get(cid, 0) if greedy_edgespec else None,
            "greedy_mismatches": sum(1 for r in rs if r["same_as_plain"] is False) if greedy_edgespec else None,
            "differs_from_plain_text": sum(1 for r in rs if r["same_as_plain"] is False) if c.kind == "peer" else None,
            "by_suite": _group(rs, "suite"),
            "by_lang": _group(rs, "lang"),
            "acceptance_by_length": dict(sorted(by_len.items(), key=lambda kv: int(kv[0]))),
        })
    return out
