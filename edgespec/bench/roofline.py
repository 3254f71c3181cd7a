"""The roofline: how fast decoding could go if reading the weights were all
a token cost, how cheap a batch of k tokens could be if multiplying were all
it cost, and how close each backend comes.

Decoding one token reads every weight matrix once (of the token embedding
only the token's row; with tied embeddings the whole table again as the
output matrix; of MoE expert tensors the used experts' share) and the KV
cache of every earlier position (F16 keys and values, in both engines; a
sliding-window layer only its window). This machine's read bandwidth
(costs.bandwidth) over those bytes is the roofline in tokens/s, and the
memory floor of a batch (which reads the weights once, as one token does).

A token also multiplies by every matrix it reads once: macs_per_token
multiply-accumulates (attention's, a few per cached position, left out).
k tokens' MACs over this machine's int8 peak (costs.int8_peak, in the
native engine's kernel set) is a batch's compute floor; a batch's measured
time against it is the fraction of the peak the kernels reach.

    bytes_per_token(path, context)          {"weights", "kv_cache", "total", "context"}
    macs_per_token(path)                    multiply-accumulates of the matrices
    measure_roofline(path, backends, ...)   results.json "roofline"
"""
from __future__ import annotations

import time
from pathlib import Path

from ..backends import open_backend
from ..backends.native import select_kernels
from ..config import EngineConfig
from ..costs import bandwidth, int8_peak
from ..errors import EdgespecError
from ..models.gguf import GGUFFile

BATCH_SIZES = (1, 2, 4, 8, 16)
KV_BYTES = 2       # F16 keys and values
PREFIX = 64        # context before the timed decode steps and batches
DECODE_TOKENS = 32  # tokens of a timed decode run


def bytes_per_token(path: str | Path, context: int) -> dict:
    """Bytes one decoded token reads at ``context`` cached positions."""
    with GGUFFile(path) as f:
        arch = f.get("general.architecture")

        def key(name, default=None):
            return f.get(f"{arch}.{name}", default)

        n_embd, n_head = key("embedding_length"), key("attention.head_count")
        n_head_kv = key("attention.head_count_kv", n_head)
        head_dim = key("attention.key_length", n_embd // n_head)
        n_expert, n_used = key("expert_count", 0), key("expert_used_count", 0)
        tied = f.tensor("output.weight") is None
        weights = 0
        for t in f.tensors:
            if t.name == "token_embd.weight":
                weights += t.n_bytes // t.shape[1] + (t.n_bytes if tied else 0)  # a row (+ the output)
            elif "_exps." in t.name and n_expert:
                weights += t.n_bytes * n_used // n_expert
            else:
                weights += t.n_bytes
        traits = f.arch_traits()   # which layers slide, as the engine resolves them
        kv = sum(min(context, traits.n_swa) if layer.swa else context for layer in traits.layers) \
            * 2 * n_head_kv * head_dim * KV_BYTES
    return {"weights": weights, "kv_cache": kv, "total": weights + kv, "context": context}


def macs_per_token(path: str | Path) -> int:
    """Multiply-accumulates of one token through every matrix: each 2-D
    weight's elements (the token embedding's only as the tied output
    matrix; of MoE experts the used share); vectors (norms, biases) none."""
    with GGUFFile(path) as f:
        arch = f.get("general.architecture")
        n_expert = f.get(f"{arch}.expert_count", 0)
        n_used = f.get(f"{arch}.expert_used_count", 0)
        tied = f.tensor("output.weight") is None
        macs = 0
        for t in f.tensors:
            if len(t.shape) < 2 or (t.name == "token_embd.weight" and not tied):
                continue
            macs += t.n_elements * n_used // n_expert if "_exps." in t.name and n_expert else t.n_elements
    return macs


def _decode_speed(backend, tokens: list[int], n: int, reps: int = 2) -> float:
    """Tokens/s of one-token steps over tokens[PREFIX:PREFIX + n], the best of ``reps``."""
    best = float("inf")
    for _ in range(reps):
        backend.clear()
        backend.decode(tokens[:PREFIX])
        t0 = time.perf_counter()
        for t in tokens[PREFIX:PREFIX + n]:
            backend.decode([t])
        best = min(best, time.perf_counter() - t0)
    backend.clear()
    return n / best


def measure_backend(name: str, path: Path, threads: int, n_decode: int) -> dict:
    """One backend's plain decode speed and batch cost curve on ``path``."""
    from ..costs import time_batches

    try:
        with open_backend(name, path, n_ctx=PREFIX + max(n_decode, max(BATCH_SIZES)) + 16,
                          threads=threads) as b:
            tokens = b.tokenize("The quick brown fox jumps over the lazy dog. " * 64)
            speed = _decode_speed(b, tokens, n_decode)
            times = time_batches(b, BATCH_SIZES, prefix=PREFIX)
    except EdgespecError as e:
        return {"backend": name, "status": "failed", "error": str(e)}
    return {"backend": name, "status": "ok", "error": None, "decode_tokens_per_s": speed,
            "batch_cost": [times[k] / times[1] for k in BATCH_SIZES],
            "batch_seconds": [times[k] for k in BATCH_SIZES]}


def measure_roofline(path: str | Path, backends: list[str], threads: int, *,
                     n_decode: int = DECODE_TOKENS, remeasure_bandwidth: bool = False) -> dict:
    """results.json "roofline": the bandwidth and int8 peak, bytes and MACs
    per token, the roofline, each batch size's memory and compute floors,
    and each backend's decode speed (and its share of the roofline), batch
    cost curve and fraction of the int8 peak per batch size."""
    bw = bandwidth(threads, remeasure=remeasure_bandwidth)
    select_kernels(EngineConfig.default("kernels"))   # the set the native backend will run, measured at its peak
    peak, kernels = int8_peak(threads, remeasure=remeasure_bandwidth)
    need = bytes_per_token(path, PREFIX + n_decode // 2)
    macs = macs_per_token(path)
    roof = bw / need["total"]
    rows = []
    for name in dict.fromkeys(backends):
        r = measure_backend(name, Path(path), threads, n_decode)
        if r["status"] == "ok":
            r["fraction_of_roofline"] = r["decode_tokens_per_s"] / roof
            r["fraction_of_int8_peak"] = [k * macs / peak / t for k, t in zip(BATCH_SIZES, r["batch_seconds"])]
        rows.append(r)
    return {"bandwidth_bytes_per_s": bw, "threads": threads, "bytes_per_token": need,
            "roofline_tokens_per_s": roof, "int8_peak_macs_per_s": peak, "kernels": kernels,
            "macs_per_token": macs, "batch_sizes": list(BATCH_SIZES),
            "memory_floor_s": [need["total"] / bw for _ in BATCH_SIZES],
            "compute_floor_s": [k * macs / peak for k in BATCH_SIZES], "backends": rows}
