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
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from .. import drafters as drafting
from ..models import registry
from ..config import EngineConfig
from ..engine import Engine
from ..errors import InvalidArgumentError
from ..planner import speedup_ceiling
from ..progress import Progress
from . import prompts as suite_data
from .hardware import PeakRSS, fingerprint
from .peers import PEERS, PeerError, RunResult, open_peer
from .roofline import measure_roofline

SCHEMA = "edgespec.bench/1"
MODES = ("greedy", "sampled")
QUICK = {"suites": ["edit", "chat", "code", "multilingual"], "limit": 1, "max_tokens": 48, "repeats": 1,
         "drafters": ["none", "ngram", "auto"]}
WARMUP_TOKENS = 16
DEFAULT_LIMIT = 4


@dataclass
class BenchOptions:
    engine: EngineConfig = field(default_factory=EngineConfig)   # every configuration's, but its drafter
    suites: list[str] = field(default_factory=lambda: list(suite_data.SUITES))
    langs: list[str] | None = None
    limit: int | None = None            # None: DEFAULT_LIMIT per shipped suite, every prompt of a --prompts file
    prompts_file: Path | None = None
    drafters: list[str] = field(default_factory=lambda: ["none", "ngram", "auto"])
    modes: list[str] = field(default_factory=lambda: ["greedy"])
    max_tokens: int = 256
    repeats: int = 2
    warmup: bool = True
    peers: list[str] | None = None      # None: every peer that can run here
    llama_cpp_bin: Path | None = None
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = 0
    remeasure_costs: bool = True        # measure the batch cost curve (and bandwidth) now, not the cached ones
    quick: bool = False

    def check(self) -> None:
        if self.limit is not None and self.limit <= 0:
            raise InvalidArgumentError(f"--limit must be > 0, got {self.limit}")
        if self.max_tokens <= 0:
            raise InvalidArgumentError(f"--max-tokens must be > 0, got {self.max_tokens}")
        if self.repeats <= 0:
            raise InvalidArgumentError(f"--repeats must be > 0, got {self.repeats}")
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
        if "model" in self.drafters and not (self.engine.draft_model or registry.paired_draft(self.engine.model or "")):
            raise InvalidArgumentError("drafter 'model' needs --draft-model (this model has no paired draft model)")

    def open_engine(self, drafter: str, ngram_cache: str | None) -> Engine:
        """The Engine of one edgespec configuration: these options with ``drafter``."""
        return Engine(config=self.engine.but(drafter=drafter, ngram_cache=ngram_cache))


class Configuration:
    """One edgespec drafter with its own Engine."""

    kind = "edgespec"
    greedy_only = False

    def __init__(self, drafter: str, options: BenchOptions, ngram_cache: str | None, rss: PeakRSS):
        self.name = f"edgespec:{drafter}"
        self.drafter = drafter
        self.rss = rss
        self.engine = options.open_engine(drafter, ngram_cache)
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
                         by_length=dict(spec.by_length) if spec else {}, experts=s.experts,
                         specialized=spec.specialized if spec else None)

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
# The plan: what a run does
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """The caller's options with --quick and the default limit applied (a
    copy: the caller's object is left as it was), the prompts, and the
    edgespec drafters with plain decoding ("none", the baseline) first."""

    options: BenchOptions
    prompts: list[suite_data.Prompt]
    drafters: list[str]

    def sampling(self, mode: str, seed: int) -> dict:
        """The sampling settings of ``mode`` with ``seed``."""
        if mode == "greedy":
            return {"temperature": 0.0, "top_p": 1.0, "seed": seed}
        return {"temperature": self.options.temperature, "top_p": self.options.top_p, "seed": seed}

    def seed(self, repeat: int, prompt_index: int) -> int:
        """A measured run's seed: it varies per prompt and repeat."""
        return self.options.seed + 1000 * repeat + prompt_index


def plan_bench(options: BenchOptions) -> Plan:
    """What ``options`` ask for; InvalidArgumentError names an option out of range."""
    if options.quick:
        options = replace(options, **QUICK)
    options.check()
    if options.limit is None and options.prompts_file is None:
        options = replace(options, limit=DEFAULT_LIMIT)
    prompts = suite_data.select(options.suites, langs=options.langs, limit=options.limit,
                                prompts_file=options.prompts_file)
    return Plan(options, prompts, list(dict.fromkeys(["none", *options.drafters])))


# ---------------------------------------------------------------------------
# The lineup: the configurations, opened
# ---------------------------------------------------------------------------


class Lineup:
    """The configurations of a run (edgespec's, plain decoding first, then the
    peers) and how the peers fared."""

    def __init__(self, bar: Progress):
        self.bar = bar
        self.configs: list = []
        self.peers: dict[str, dict] = {}   # peer name -> {"status": "ok" | "failed", "error"}
        self.failed: dict[str, str] = {}   # configuration that failed while running -> why

    @property
    def plain(self) -> Configuration:
        return self.configs[0]

    def open_edgespec(self, plan: Plan, rss: PeakRSS, scratch: Path, notes: list[str]) -> None:
        """One Configuration per drafter. Without --ngram-cache, the cache
        drafter gets one built from the shipped suite texts into ``scratch``."""
        options = plan.options
        self.configs.append(Configuration("none", options, options.engine.ngram_cache, rss))
        ngram_cache = options.engine.ngram_cache
        if "cache" in plan.drafters and not ngram_cache:
            ngram_cache = _build_suite_cache(self.plain.engine, scratch)
            notes.append("drafter cache: n-gram cache built from every shipped suite prompt "
                         "(benchmark prompts included), no --ngram-cache given")
        for d in plan.drafters[1:]:
            self.configs.append(Configuration(d, options, ngram_cache, rss))

    def open_peers(self, plan: Plan, rss: PeakRSS) -> None:
        """The peers asked for (default: those that can run here); one that
        cannot is recorded with its reason."""
        options = plan.options
        model_path = self.plain.engine.model_path
        wanted = options.peers if options.peers is not None else \
            [p for p in PEERS if p.startswith("llama-cpp-python") or options.llama_cpp_bin is not None]
        draft = options.engine.draft_model or registry.paired_draft(options.engine.model or registry.default_model())
        draft_path = registry.model_path_checked(draft) if draft else None
        for name in wanted:
            try:
                if model_path.suffix != ".gguf":
                    raise PeerError(f"peers need a GGUF model, not {model_path}")
                peer = open_peer(name, model_path=model_path, threads=self.plain.threads,
                                 n_ctx=self.plain.engine.backend.n_ctx,
                                 rss=rss, bin_dir=Path(options.llama_cpp_bin) if options.llama_cpp_bin else None,
                                 draft_model=draft_path)
            except PeerError as e:
                self._peer_failed(name, e)
                continue
            self.configs.append(PeerConfiguration(peer, self.plain.render))
            self.peers[name] = {"status": "ok", "error": None}

    def slots(self, modes: list[str]) -> list[tuple]:
        """(configuration, mode) pairs to measure: greedy-only peers skip sampled mode."""
        return [(c, m) for m in modes for c in self.configs if m == "greedy" or not c.greedy_only]

    def run(self, c, prompt: suite_data.Prompt, max_tokens: int, sampling: dict) -> RunResult | None:
        """Run configuration ``c`` on ``prompt``; None when it is a peer that failed, now or before."""
        if c.name in self.failed:
            return None
        try:
            return c.run(prompt, max_tokens, sampling)
        except PeerError as e:
            self.failed[c.name] = str(e)
            self._peer_failed(c.name, e)
            return None

    def _peer_failed(self, name: str, error: PeerError) -> None:
        self.peers[name] = {"status": "failed", "error": str(error)}
        self.bar.note(f"peer {name} failed: {error}")

    def close(self) -> None:
        for c in self.configs:
            c.close()


def measure_ceiling(engine: Engine, remeasure: bool, bar: Progress) -> dict:
    """The best speedup this machine's batch cost curve allows (results' "ceiling")."""
    if remeasure:
        bar.note("measuring the batch cost curve")
    costs = engine.batch_costs(remeasure=remeasure)
    ceiling, ceiling_k = speedup_ceiling(costs)
    return {"speedup": ceiling, "draft_length": ceiling_k, "batch_cost": costs[1:],
            "all_accepted_speedup": [(k + 1) / costs[k + 1] for k in range(1, len(costs) - 1)]}


def sampling_notes(modes: list[str], configs: list) -> list[str]:
    if "sampled" not in modes:
        return []
    return ["sampled runs are not compared token by token with plain decoding: speculative "
            "sampling keeps the target's distribution, not plain decoding's exact draws"] + \
        [f"{c.name} runs greedy only (the binary has no sampling options)" for c in configs if c.greedy_only]


# ---------------------------------------------------------------------------
# Measuring and collecting
# ---------------------------------------------------------------------------


@dataclass
class Tally:
    """What the measured runs produced."""

    runs: list[dict] = field(default_factory=list)          # results.json "runs"
    divergences: list[dict] = field(default_factory=list)   # greedy runs that differ from plain decoding
    checked: dict[str, int] = field(default_factory=dict)   # greedy edgespec config id -> runs compared


def warm_up(plan: Plan, lineup: Lineup, slots: list[tuple]) -> None:
    """Every slot once on the first prompt, not measured: loads pages, JIT
    caches and the planner's first steps."""
    max_tokens = min(WARMUP_TOKENS, plan.options.max_tokens)
    for c, mode in slots:
        lineup.run(c, plan.prompts[0], max_tokens, plan.sampling(mode, plan.options.seed))


def measure(plan: Plan, lineup: Lineup, slots: list[tuple], bar: Progress) -> Tally:
    """Every slot on every prompt, ``repeats`` times; within a round (one
    prompt, mode and repeat) the order of the configurations rotates."""
    options, tally = plan.options, Tally()
    bar.total = options.repeats * len(plan.prompts) * len(slots)
    for rep in range(options.repeats):
        for i, prompt in enumerate(plan.prompts):
            for mode in options.modes:
                group = [c for c, m in slots if m == mode]
                shift = (rep + i) % len(group)
                got = run_round(lineup, group[shift:] + group[:shift], prompt, mode, options.max_tokens,
                                plan.sampling(mode, plan.seed(rep, i)), bar)
                collect(tally, group, got, prompt, mode, rep)
    bar.done()
    return tally


def run_round(lineup: Lineup, order: list, prompt: suite_data.Prompt, mode: str, max_tokens: int,
              sampling: dict, bar: Progress) -> dict[str, RunResult]:
    """Each configuration of ``order`` on ``prompt``, one after another; their results by name."""
    got: dict[str, RunResult] = {}
    for c in order:
        bar.update(0, f"{prompt.suite}/{prompt.id} {c.name} {mode}")
        r = lineup.run(c, prompt, max_tokens, sampling)
        bar.update(1)
        if r is not None:
            got[c.name] = r
    return got


def collect(tally: Tally, group: list, got: dict[str, RunResult], prompt: suite_data.Prompt,
            mode: str, rep: int) -> None:
    """Record a round's runs (in ``group`` order), each against plain decoding's run of the round."""
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
               "stop_reason": r.stop_reason, "same_as_plain": None,
               **({"experts": r.experts} if r.experts is not None else {}),
               **({"specialized": r.specialized} if r.specialized else {})}
        if mode == "greedy" and base is not None and c.name != "edgespec:none":
            _compare_with_plain(tally, rec, c, r, base)
        tally.runs.append(rec)


def _compare_with_plain(tally: Tally, rec: dict, c, r: RunResult, base: RunResult) -> None:
    """Greedy speculation must reproduce plain decoding: edgespec's runs token by
    token (a difference becomes a divergence), peers' by text."""
    if c.kind == "edgespec":
        k = _first_difference(r.tokens, base.tokens)
        tally.checked[rec["config"]] = tally.checked.get(rec["config"], 0) + 1
        rec["same_as_plain"] = k is None
        if k is not None:
            tally.divergences.append({"config": rec["config"], "prompt": rec["prompt"], "repeat": rec["repeat"],
                                      "output_position": k, "context_position": base.prompt_tokens + k})
    elif r.text is not None:
        rec["same_as_plain"] = r.text == base.text


# ---------------------------------------------------------------------------
# The run and its report
# ---------------------------------------------------------------------------


def run_bench(options: BenchOptions, *, progress: bool = True,
              command: str | None = None) -> dict:
    """Run the benchmark; returns the results document (schema SCHEMA).
    ``options`` is left as it was."""
    plan = plan_bench(options)
    load_start = _load_average()
    rss = PeakRSS()
    notes: list[str] = []
    bar = Progress("bench", 1, enabled=progress, lines=True)
    lineup = Lineup(bar)
    with tempfile.TemporaryDirectory(prefix="edgespec-bench-") as scratch:
        try:  # the configurations close before the scratch folder (the n-gram cache) goes
            bar.note(f"loading {plan.options.engine.model or registry.default_model()} "
                     f"for {len(plan.drafters)} edgespec configurations")
            lineup.open_edgespec(plan, rss, Path(scratch), notes)
            ceiling = measure_ceiling(lineup.plain.engine, plan.options.remeasure_costs, bar)
            lineup.open_peers(plan, rss)
            slots = lineup.slots(plan.options.modes)
            notes += sampling_notes(plan.options.modes, lineup.configs)
            if plan.options.warmup:
                warm_up(plan, lineup, slots)
            tally = measure(plan, lineup, slots, bar)
        finally:
            lineup.close()
    model_path, backend = lineup.plain.engine.model_path, lineup.plain.engine.backend.name
    roofline = None
    if model_path.suffix == ".gguf":
        bar.note("measuring the memory roofline")
        roofline = measure_roofline(model_path, [backend, "llama"], lineup.plain.threads,
                                    remeasure_bandwidth=plan.options.remeasure_costs)
    else:
        notes.append(f"no memory roofline: it reads a GGUF file's tensors, not {model_path}")
    doc = {
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command or shlex.join(sys.argv),
        "settings": settings(plan, lineup.plain),
        "hardware": fingerprint(lineup.plain.threads),
        "peak_rss_method": rss.method + "; in-process configurations share one process, so their "
                           "figure includes every model loaded in it; binaries: the child's own peak",
        "ceiling": ceiling,
        "roofline": roofline,
        "peers": lineup.peers,
        "prompts": [p.to_dict() for p in plan.prompts],
        "runs": tally.runs,
        "divergences": tally.divergences,
        "notes": notes,
    }
    doc["configurations"] = summarize(tally.runs, slots, ceiling["speedup"], tally.checked, lineup.failed)
    doc["greedy_mismatches"] = {c["id"]: c["greedy_mismatches"] for c in doc["configurations"]
                                if c["greedy_mismatches"] is not None}
    doc["hardware"]["load_average_start"] = load_start
    doc["hardware"]["load_average_end"] = _load_average()
    return doc


def run_roofline(options: BenchOptions, *, command: str | None = None) -> dict:
    """Only the memory roofline (``edgespec bench --roofline``): bandwidth,
    bytes per token, decode speed and batch cost curve of the backend asked
    for (default: native) beside llama.cpp's."""
    from ..backends import default_threads

    options.check()
    ref = options.engine.model or registry.default_model()
    path = registry.model_path_checked(ref)
    threads = options.engine.threads or default_threads()
    load_start = _load_average()
    roofline = measure_roofline(path, [options.engine.backend or "native", "llama"], threads,
                                remeasure_bandwidth=options.remeasure_costs)
    hardware = fingerprint(threads)
    hardware["load_average_start"], hardware["load_average_end"] = load_start, _load_average()
    return {"schema": SCHEMA, "kind": "roofline",
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": command or shlex.join(sys.argv),
            "settings": {"model": ref, "model_path": str(path), "threads": threads},
            "hardware": hardware, "roofline": roofline, "notes": []}


def settings(plan: Plan, plain: Configuration) -> dict:
    """results.json "settings": what was run, as run."""
    o, e = plan.options, plan.options.engine
    built_cache = "cache" in plan.drafters and not e.ngram_cache
    return {
        "model": e.model or registry.default_model(), "model_path": str(plain.engine.model_path),
        "backend": plain.engine.backend.name, "ep": e.ep, "draft_backend": e.draft_backend,
        "threads": plain.threads, "suites": o.suites if not o.prompts_file else [],
        "prompts_file": str(o.prompts_file) if o.prompts_file else None,
        "langs": o.langs, "limit": o.limit, "drafters": plan.drafters,
        "draft_model": e.draft_model, "draft_max": e.draft_max,
        "ngram_cache": "(built from the shipped suites)" if built_cache else e.ngram_cache,
        "modes": o.modes, "max_tokens": o.max_tokens, "repeats": o.repeats, "warmup": o.warmup,
        "warmup_tokens": WARMUP_TOKENS if o.warmup else 0,
        "sampling": {"temperature": o.temperature, "top_p": o.top_p, "seed": o.seed},
        "n_ctx": plain.engine.backend.n_ctx, "gpu_layers": e.gpu_layers, "quick": o.quick, "remeasured_costs": o.remeasure_costs,
        "llama_cpp_bin": str(o.llama_cpp_bin) if o.llama_cpp_bin else None,
    }


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
