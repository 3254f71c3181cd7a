"""Token recycling: a draft tree from the candidates the target already produced.

Every target step computes logits rows whose runners-up verification throws
away. The C core (es_recycle) keeps, for each token, the top-k of the most
recent row computed right after it, an (n_vocab, k) int32 matrix, and grows a
breadth-first tree from the text's last token. Train-free and model-free;
it needs a few steps of text before it knows anything.

Defaults: k = 8 candidates kept per token; the root gets 4 children, level d
max(1, 4 >> d) each (4, 2, 1, 1, ...); depth and node count are both capped
by the ``max_tokens`` the engine asks for.
"""
from __future__ import annotations

from typing import Sequence

from ..capi import Owned, check, ffi, lib
from ..sampling import SamplingParams
from . import Draft, Drafter, DrafterConfig, Verified

TOP_K = 8    # candidates kept per token
BRANCH = 4   # children of the root; deeper levels halve it, down to chains


class Recycle(Owned):
    """Owns one ``es_recycle``: the (n_vocab, k) matrix of recycled candidates."""

    _free = lib.es_recycle_free

    def __init__(self, n_vocab: int, k: int = TOP_K):
        out = ffi.new("es_recycle **")
        check(lib.es_recycle_init(n_vocab, k, out), "es_recycle_init")
        self._ptr = out[0]
        self.n_vocab = n_vocab
        self._tokens = ffi.new("es_token[]", 0)
        self._parents = ffi.new("int32_t[]", 0)

    def update(self, row_tokens: Sequence[int], logits_addr: int) -> None:
        """Learn from (len(row_tokens), n_vocab) float32 logits rows at ``logits_addr``
        (no copy); row i was computed right after ``row_tokens[i]``."""
        n = len(row_tokens)
        if n:
            check(lib.es_recycle_update(self._ptr, ffi.new("es_token[]", list(row_tokens)),
                                        ffi.cast("const float *", logits_addr), n),
                  "es_recycle_update")

    def draft(self, root: int, branch: int, max_depth: int, max_nodes: int) -> tuple[list[int], list[int]]:
        """(tokens, parents) of a breadth-first tree below ``root`` (see es_recycle_draft)."""
        if len(self._tokens) < max_nodes:
            self._tokens = ffi.new("es_token[]", max_nodes)
            self._parents = ffi.new("int32_t[]", max_nodes)
        n = check(lib.es_recycle_draft(self._ptr, root, branch, max_depth, max_nodes,
                                       self._tokens, self._parents), "es_recycle_draft")
        return ffi.unpack(self._tokens, n), ffi.unpack(self._parents, n)


class RecycleDrafter(Drafter):
    name = "recycle"

    def __init__(self, config: DrafterConfig):
        # The matrix outlives generations: what followed a token in one text
        # is still a fair guess in the next.
        self.recycle = Recycle(config.n_vocab)
        self._reset_counters()

    def _reset_counters(self) -> None:
        """Counters of one generation (stats() is reported per result)."""
        self.n_drafts = 0      # drafts with at least one node
        self.n_nodes = 0       # nodes proposed in them
        self.n_updates = 0     # logits rows learned from

    def begin(self, prompt: Sequence[int], sampling: SamplingParams) -> None:
        self._reset_counters()  # the matrix itself is learned from verification steps only

    def draft(self, context: Sequence[int], max_tokens: int) -> Draft:
        if max_tokens <= 0 or not context:
            return Draft(source=self.name)
        tokens, parents = self.recycle.draft(context[-1], BRANCH, max_tokens, max_tokens)
        if not tokens:
            return Draft(source=self.name)
        self.n_drafts += 1
        self.n_nodes += len(tokens)
        return Draft(tokens=tokens, parents=parents, source=self.name)

    def accept(self, step: Verified) -> None:
        self.recycle.update(step.row_tokens, step.logits)
        self.n_updates += len(step.row_tokens)

    def stats(self) -> dict:
        return {
            "drafts": self.n_drafts,
            "mean_nodes": round(self.n_nodes / self.n_drafts, 3) if self.n_drafts else 0.0,
            "rows_learned": self.n_updates,
        }

    def close(self) -> None:
        self.recycle.close()


DRAFTER = RecycleDrafter
