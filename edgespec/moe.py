"""Mixture-of-experts models larger than memory, at run time: the expert
cache's settings and counters, and where its low-precision sidecar lies.

- ``ExpertCache``: ``expert_cache_mb`` and friends as the native backend
  takes them (es_model_params); ``stats_dict``: its es_expert_stats.
- ``sidecar_path``: the file of low-precision expert copies beside a MoE
  GGUF, which ``balanced`` and ``fast`` precision serve cache misses from
  (written offline by edgespec.training.moe_tools.prepare).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .capi import lib
from .errors import InvalidArgumentError

PRECISIONS = ("exact", "balanced", "fast")   # enum es_expert_precision, in order
POLICIES = ("adaptive", "lru")                # enum es_expert_policy, in order
DEFAULT_PREFETCH = int(lib.es_model_default_params().prefetch_depth)
SIDECAR_SUFFIX = ".experts-low"
SIDECAR_MAGIC = b"ESMOELP1"                   # es_native.h ES_SIDECAR_MAGIC


@dataclass(frozen=True)
class ExpertCache:
    """How the native engine keeps a MoE model's experts: at most
    ``budget_mb`` MB (10^6 bytes) in memory, read from disk on demand."""

    budget_mb: int
    precision: str = "exact"
    policy: str = "adaptive"
    prefetch: int = DEFAULT_PREFETCH

    @property
    def budget_bytes(self) -> int:
        return self.budget_mb * 1_000_000

    def sidecar(self, model: os.PathLike | str) -> Path | None:
        """The sidecar the cache reads substitutes from: None for exact
        precision, which never substitutes."""
        if self.precision == "exact":
            return None
        path = sidecar_path(model)
        if not path.is_file():
            raise InvalidArgumentError(f"--expert-precision {self.precision} needs the low-precision "
                                       f"expert copies {path}: run `edgespec moe prepare {model}`")
        return path


def stats_dict(st) -> dict:
    """An es_expert_stats as a dict, with hit rate, prefetch accuracy (and
    by depth) and stall per token worked out."""
    fields = ("budget_bytes", "cache_bytes", "n_slots", "prefetch_depth", "tokens", "lookups",
              "hits", "loads", "bytes_read", "substitutions", "prefetches", "prefetch_used",
              "evictions", "stall_ns")
    d = {f: int(getattr(st, f)) for f in fields}
    d["hit_rate"] = d["hits"] / d["lookups"] if d["lookups"] else 0.0
    d["prefetch_accuracy"] = d["prefetch_used"] / d["prefetches"] if d["prefetches"] else 0.0
    # by depth, 1 layer ahead first, up to the deepest prefetched
    at = [(int(n), int(u)) for n, u in zip(st.prefetches_at, st.prefetch_used_at)]
    while at and at[-1][0] == 0:
        at.pop()
    d["prefetches_by_depth"] = [n for n, _ in at]
    d["prefetch_used_by_depth"] = [u for _, u in at]
    d["prefetch_accuracy_by_depth"] = [u / n if n else 0.0 for n, u in at]
    d["stall_ms_per_token"] = d["stall_ns"] / 1e6 / d["tokens"] if d["tokens"] else 0.0
    return d


def sidecar_path(model: os.PathLike | str) -> Path:
    model = Path(model)
    return model.with_name(model.name + SIDECAR_SUFFIX)
