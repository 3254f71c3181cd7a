"""Token rankings: a tokenizer's ids ordered by how often text uses them.

A draft model's head trimmed to the top of the ranking (``--draft-vocab N``:
FR-Spec, Zhao et al. 2025) reads only those N rows of its output layer per
drafted token; the target still verifies every token, so output stays exact.
A ranking is a file ``<fingerprint>.npy`` (int32 ids, most used first; the
fingerprint is ``specialized.vocab_fingerprint``'s first 16 hex digits): the
ones shipped for the built-in models' tokenizers (``models/token-ranks/``,
package data), then the user's (``$EDGESPEC_HOME/token-ranks/``), made by
``edgespec drafter rank`` (edgespec.training.ranking).
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np

from ..errors import InvalidArgumentError
from ..models import registry

MIN_KEPT = 256   # fewer kept rows than this drafts almost nothing the target would


def rank_name(fingerprint: str) -> str:
    return f"{fingerprint[:16]}.npy"


def user_folder() -> Path:
    return registry.home() / "token-ranks"


def find_ranking(fingerprint: str) -> Path | None:
    """The ranking file for a vocabulary fingerprint: the user's first, then the shipped one."""
    for folder in (user_folder(), Path(str(resources.files("edgespec.builtin") / "token-ranks"))):
        path = folder / rank_name(fingerprint)
        if path.is_file():
            return path
    return None


def top_tokens(fingerprint: str, n: int, n_vocab: int, model: str) -> np.ndarray:
    """The ``n`` most used token ids of the vocabulary (``n_vocab`` tokens) with
    this fingerprint, int32. InvalidArgumentError when no ranking exists (naming
    the command that makes one) or ``n`` is out of range."""
    if not MIN_KEPT <= n <= n_vocab:
        raise InvalidArgumentError(f"draft_vocab (--draft-vocab) must be in [{MIN_KEPT}, {n_vocab}] for "
                                   f"{model}, got {n}")
    path = find_ranking(fingerprint)
    if path is None:
        raise InvalidArgumentError(f"no token ranking for {model}'s vocabulary: make one with "
                                   f"`edgespec drafter rank --model {model}`")
    ranking = np.load(path, allow_pickle=False)
    if ranking.dtype != np.int32 or ranking.ndim != 1 or len(ranking) < n or \
            (len(ranking) and (ranking.min() < 0 or ranking.max() >= n_vocab)):
        raise InvalidArgumentError(f"{path}: not a token ranking of {n_vocab} ids (make it again with "
                                   f"`edgespec drafter rank --model {model}`)")
    return ranking[:n]
