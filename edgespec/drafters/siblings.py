"""Sibling leaves for a greedy chain: where a drafter is unsure of a token,
its runner-up added as a leaf beside it (a small tree), when the planner's
cost curve says the wider batch pays (``Planner.widen``). Verification
accepts whichever the target chose, so greedy output stays exact; a draft
model and a draft head both widen their chains this way."""
from __future__ import annotations

import numpy as np

from ..capi import ffi
from . import Draft

UNCERTAIN = 0.8     # top-1 draft probability below which a sibling may be added


def wanted(planner, name: str, n: int) -> bool:
    """Whether runner-ups of a chain of ``n`` are worth finding: only where
    even a certain leaf would pay on this cost curve."""
    return planner is not None and planner.widen(name, n, [1.0]) > 0


def _row(logits: int, n_vocab: int, rows: np.ndarray | None) -> np.ndarray:
    """A drafter's logits row at address ``logits``, read in place: (n_vocab,),
    or (len(rows),) of the ids ``rows`` it computes alone (the others -inf)."""
    row = np.frombuffer(ffi.buffer(ffi.cast("float *", logits), 4 * n_vocab), dtype=np.float32)
    return row if rows is None else row[rows]


def probability(logits: int, n_vocab: int, tok: int, rows: np.ndarray | None = None) -> float:
    """The drafter's probability of its token ``tok`` (its largest logit, but
    where a penalty, a bias or a grammar chose another)."""
    full = _row(logits, n_vocab, None)
    row = full if rows is None else full[rows]
    top = row.max()
    return float(np.exp(full[tok] - top) / np.exp(row - top).sum())


def runner_up(logits: int, n_vocab: int, tok: int, rows: np.ndarray | None = None) -> tuple[int, float, float]:
    """Of a drafter's logits row at address ``logits`` (n_vocab floats, read
    in place) whose chosen token is ``tok``: the second token, and the
    drafter's probabilities of both. ``rows``: the ids a drafter computes
    alone (the others -inf), searched instead of the whole row."""
    row = _row(logits, n_vocab, rows)
    if rows is not None:
        tok = int(np.argmax(row))       # tok's place among them
    top2 = np.argpartition(row, -2)[-2:]
    second = int(top2[0] if top2[1] == tok else top2[1])
    z = np.exp(row[[tok, second]] - row[tok])
    total = float(np.exp(row - row[tok]).sum())
    return (second if rows is None else int(rows[second])), float(z[0] / total), float(z[1] / total)


def widen(planner, name: str, tokens: list[int], runners: list[tuple[int, float, float]]) -> tuple[Draft, bool]:
    """A greedy chain with the runner-up leaves (``runner_up`` per position)
    the planner says pay, and whether any was added."""
    chain = Draft(tokens=tokens, source=name)
    if planner is None or not runners:
        return chain, False
    reach, gains = 1.0, []
    for i, (second, p1, p2) in enumerate(runners):
        if p1 < UNCERTAIN:
            gains.append((reach * p2, i, second))
        reach *= p1
    gains.sort(reverse=True)
    chosen = planner.widen(name, len(tokens), [g for g, _, _ in gains])
    if not chosen:
        return chain, False
    leaves = sorted(gains[:chosen], key=lambda x: x[1])
    parents = list(range(-1, len(tokens) - 1)) + [i - 1 for _, i, _ in leaves]
    return Draft(tokens=tokens + [t for _, _, t in leaves], parents=parents, source=name), True
