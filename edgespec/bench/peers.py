"""Other runtimes measured in the same run: llama-cpp-python's high-level API
(plain and its prompt-lookup drafter) and llama.cpp's own example binaries.

A peer is set up once and then run prompt by prompt like an edgespec
configuration. Set-up or run failures raise PeerError; the runner records the
message and reports the peer as failed instead of dropping it.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .hardware import process_peak_rss_mib

PEERS = ("llama-cpp-python", "llama-cpp-python:prompt-lookup", "llama.cpp", "llama.cpp:lookup",
         "llama.cpp:speculative")
DRAFT_MAX = 8          # draft tokens per step for the peers' drafters (llama.cpp's examples' own default range)
RUN_TIMEOUT_S = 600


class PeerError(Exception):
    pass


@dataclass
class RunResult:
    """One generation, measured the same way for every configuration."""

    n_tokens: int
    prompt_tokens: int
    decode_tps: float                 # generated tokens / decode time (prefill excluded)
    ttft_s: float | None              # call to first token (prefill + first sample)
    prefill_tps: float | None         # prompt tokens / prefill time
    peak_rss_mib: float | None
    text: str | None = None
    tokens: list[int] | None = None   # edgespec only: compared with plain decoding
    drafted: int | None = None
    accepted: int | None = None
    target_steps: int | None = None
    by_length: dict = field(default_factory=dict)   # draft length -> {steps, accepted}
    stop_reason: str = ""
    experts: dict | None = None       # edgespec with an expert cache: its counters (edgespec.moe.stats_dict)
    specialized: str | None = None    # edgespec: the specialized drafter routed to (auto with a set)


# ---------------------------------------------------------------------------
# llama-cpp-python, in process
# ---------------------------------------------------------------------------


class LlamaCppPython:
    """``Llama.create_completion`` streaming, plain or with LlamaPromptLookupDecoding."""

    kind = "peer"
    greedy_only = False

    def __init__(self, name: str, model_path: Path, *, threads: int, n_ctx: int, rss):
        try:
            import llama_cpp
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError:
            raise PeerError("llama-cpp-python is not installed: pip install 'edgespec[llama]'") from None
        self._criteria = llama_cpp.StoppingCriteriaList
        self.name = name
        self.rss = rss
        self.threads = threads
        draft = LlamaPromptLookupDecoding(num_pred_tokens=DRAFT_MAX) if name.endswith("prompt-lookup") else None
        try:
            self.llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=n_ctx, n_threads=threads,
                                       n_threads_batch=threads, verbose=False, draft_model=draft)
        except Exception as e:
            raise PeerError(f"cannot load {model_path.name}: {e}") from e

    def run(self, text: str, max_tokens: int, sampling: dict) -> RunResult:
        stamps: list[float] = []

        def stamp(_ids, _logits) -> bool:  # called once per sampled token
            stamps.append(time.perf_counter())
            return False

        self.llm.reset()  # no prefix reuse: every run evaluates its whole prompt
        greedy = sampling["temperature"] == 0
        self.rss.reset()
        t0 = time.perf_counter()
        try:
            out = self.llm.create_completion(
                text, max_tokens=max_tokens, temperature=sampling["temperature"],
                top_p=1.0 if greedy else sampling["top_p"], top_k=0, min_p=0.0,
                seed=sampling["seed"], repeat_penalty=1.0, stopping_criteria=self._criteria([stamp]))
        except Exception as e:
            raise PeerError(f"create_completion failed: {e}") from e
        peak = self.rss.read()
        n_prompt = out["usage"]["prompt_tokens"]
        n = out["usage"]["completion_tokens"]
        ttft = stamps[0] - t0 if stamps else None
        decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
        return RunResult(n_tokens=n, prompt_tokens=n_prompt, decode_tps=decode, ttft_s=ttft,
                         prefill_tps=n_prompt / ttft if ttft else None, peak_rss_mib=peak,
                         text=out["choices"][0]["text"], stop_reason=out["choices"][0]["finish_reason"] or "")

    def close(self) -> None:
        self.llm.close()


# ---------------------------------------------------------------------------
# llama.cpp's example binaries, as child processes
# ---------------------------------------------------------------------------

ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) s")
N_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
N_ACCEPT = re.compile(r"n_accept\s*=\s*(\d+)")
PERF_PROMPT = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
PERF_EVAL = re.compile(r"_print:\s+eval time =\s*([\d.]+) ms /\s*(\d+) runs")


def _run_child(argv: list[str], timeout: float) -> tuple[int, str, float]:
    """(exit code, stdout + stderr, peak RSS of the child in MiB). The peak is
    the child's own high-water mark, read while it runs (the last reading
    before it exits); where /proc has none, wait4's figure, which on Linux
    would include this process's own peak."""
    with tempfile.TemporaryFile() as out:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        peak = None
        while True:
            peak = process_peak_rss_mib(p.pid) or peak
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                p.kill()
                os.wait4(p.pid, 0)
                p.returncode = -9
                raise PeerError(f"{Path(argv[0]).name} ran past {timeout:.0f} s")
            time.sleep(0.02)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        log = out.read().decode("utf-8", "replace")
    return p.returncode, log, peak if peak is not None else usage.ru_maxrss / 1024


class LlamaCppBinary:
    """One of llama.cpp's examples: plain decoding (llama-completion, else
    llama-simple), llama-lookup (prompt lookup) or llama-speculative-simple
    (a draft model). Figures are the binary's own printed timings."""

    kind = "peer"

    def __init__(self, name: str, bin_dir: Path, model_path: Path, *, threads: int, n_ctx: int,
                 draft_model: Path | None = None):
        self.name = name
        self.threads = threads
        self.model_path, self.n_ctx, self.draft_model = model_path, n_ctx, draft_model
        if name == "llama.cpp":
            names = ["llama-completion", "llama-simple"]
        elif name == "llama.cpp:lookup":
            names = ["llama-lookup"]
        else:
            names = ["llama-speculative-simple"]
            if draft_model is None:
                raise PeerError("llama-speculative-simple needs a draft model: pass --draft-model")
        found = [bin_dir / n for n in names if (bin_dir / n).is_file()]
        if not found:
            raise PeerError(f"{' or '.join(names)} not found in {bin_dir}")
        self.binary = found[0]
        # llama-simple takes neither threads nor sampling options: greedy, llama.cpp's default threads.
        self.greedy_only = self.binary.name == "llama-simple"
        if self.greedy_only:
            self.threads = None

    def _argv(self, text: str, max_tokens: int, sampling: dict) -> list[str]:
        b = self.binary.name
        if b == "llama-simple":
            return [str(self.binary), "-m", str(self.model_path), "-n", str(max_tokens), text]
        argv = [str(self.binary), "-m", str(self.model_path), "-p", text, "-n", str(max_tokens),
                "-t", str(self.threads), "-c", str(self.n_ctx), "--temp", str(sampling["temperature"]),
                "--top-p", str(sampling["top_p"]), "--top-k", "0", "-s", str(sampling["seed"]),
                "--repeat-penalty", "1.0"]
        if b == "llama-completion":
            argv += ["-no-cnv", "--no-display-prompt"]
        else:
            argv += ["--spec-draft-n-max", str(DRAFT_MAX)]
        if b == "llama-speculative-simple":
            argv += ["-md", str(self.draft_model), "-td", str(self.threads), "--spec-type", "draft-simple"]
        return argv

    def run(self, text: str, max_tokens: int, sampling: dict) -> RunResult:
        try:
            rc, log, peak = _run_child(self._argv(text, max_tokens, sampling), RUN_TIMEOUT_S)
        except OSError as e:
            raise PeerError(f"cannot run {self.binary}: {e.strerror or e}") from e
        tail = " | ".join(line.strip() for line in log.strip().splitlines()[-2:])
        if rc != 0:
            raise PeerError(f"{self.binary.name} exited with {rc}: {tail}")
        enc, dec = ENCODED.search(log), DECODED.search(log)
        pp, ev = PERF_PROMPT.search(log), PERF_EVAL.search(log)
        if enc and dec:  # lookup / speculative-simple: their own encode and decode timers
            n_prompt, t_prompt = int(enc.group(1)), float(enc.group(2))
            n, t_dec = int(dec.group(1)), float(dec.group(2))
        elif pp and ev:  # completion / simple: llama.cpp's context timers
            n_prompt, t_prompt = int(pp.group(2)), float(pp.group(1)) / 1e3
            n, t_dec = int(ev.group(2)), float(ev.group(1)) / 1e3
        else:
            raise PeerError(f"{self.binary.name}: no timings found in its output: {tail}")
        drafted, accepted = N_DRAFTED.search(log), N_ACCEPT.search(log)
        return RunResult(n_tokens=n, prompt_tokens=n_prompt, decode_tps=n / t_dec if t_dec > 0 else 0.0,
                         ttft_s=t_prompt, prefill_tps=n_prompt / t_prompt if t_prompt > 0 else None,
                         peak_rss_mib=peak,
                         drafted=int(drafted.group(1)) if drafted else None,
                         accepted=int(accepted.group(1)) if accepted else None)

    def close(self) -> None:
        pass


def open_peer(name: str, *, model_path: Path, threads: int, n_ctx: int, rss,
              bin_dir: Path | None, draft_model: Path | None):
    """Set up peer ``name``; PeerError says why it cannot run."""
    if name.startswith("llama-cpp-python"):
        return LlamaCppPython(name, model_path, threads=threads, n_ctx=n_ctx, rss=rss)
    if bin_dir is None:
        raise PeerError("needs --llama-cpp-bin DIR (a folder with llama.cpp's binaries)")
    return LlamaCppBinary(name, bin_dir, model_path, threads=threads, n_ctx=n_ctx, draft_model=draft_model)
