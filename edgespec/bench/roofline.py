"""The memory roofline: how fast decoding could go if reading the weights
were all a token cost, and how close each backend comes.

Decoding one token reads every weight matrix once (of the token embedding
only the token's row; with tied embeddings the whole table again as the
output matrix; of MoE expert tensors the used experts' share) and the KV
cache of every earlier position (F16 keys and values, in both engines; a
sliding-window layer only its window). This machine's read bandwidth
(hardware.bandwidth) over those bytes is the roofline in tokens/s.

    bytes_per_token(path, context)          {"weights", "kv_cache", "total", "context"}
    measure_roofline(path, backends, ...)   results.json "roofline"
"""
from __future__ import annotations

import time
from pathlib import Path

from ..backends import open_backend
from ..errors import EdgespecError
from ..models.gguf import GGUFFile
from .hardware import bandwidth
from .reference import sliding_layers

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
        window = key("attention.sliding_window", 0)
        kv = sum(min(context, window) if swa else context for swa in sliding_layers(f)) \
            * 2 * n_head_kv * head_dim * KV_BYTES
    return {"weights": weights, "kv_cache": kv, "total": weights + kv, "context": context}


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
            "batch_cost": [times[k] / times[1] for k in BATCH_SIZES]}


def measure_roofline(path: str | Path, backends: list[str], threads: int, *,
                     n_decode: int = DECODE_TOKENS, remeasure_bandwidth: bool = False) -> dict:
    """results.json "roofline": the bandwidth, bytes per token, the roofline
    and each backend's decode speed (and its share of the roofline) and
    batch cost curve."""
    bw = bandwidth(threads, remeasure=remeasure_bandwidth)
    need = bytes_per_token(path, PREFIX + n_decode // 2)
    roof = bw / need["total"]
    rows = []
    for name in dict.fromkeys(backends):
        r = measure_backend(name, Path(path), threads, n_decode)
        if r["status"] == "ok":
            r["fraction_of_roofline"] = r["decode_tokens_per_s"] / roof
        rows.append(r)
    return {"bandwidth_bytes_per_s": bw, "threads": threads, "bytes_per_token": need,
            "roofline_tokens_per_s": roof, "batch_sizes": list(BATCH_SIZES), "backends": rows}
