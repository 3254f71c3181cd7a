"""Prompt lookup: propose the continuation of the latest earlier occurrence of
the text's longest suffix, searched over prompt + output.

Train-free and nearly free to run; it shines where the output repeats its
input (summaries, code edits, extraction, quoting). The index lives in the C
core (es_ngram_index): O(n_max) per appended token, one hash probe per
suffix length per draft.
"""
from __future__ import annotations

from typing import Sequence

from ..capi import Owned, check, ffi, lib
from ..sampling import SamplingParams
from . import Draft, Drafter, DrafterConfig, Verified

N_MIN = 1  # one-token matches are noisy, but the planner learns their acceptance apart
N_MAX = 8
KEY_MAX_MATCH = 6  # acceptance is tracked per match length 1, 2, ..., 6+
# Acceptance expected of a match length before any evidence: a longer matched
# suffix is likelier to be a copied run (the prompt-lookup observation).
PRIOR_BY_MATCH = {1: 0.35, 2: 0.5, 3: 0.6, 4: 0.7, 5: 0.75, 6: 0.8}


class NgramIndex(Owned):
    """Owns one ``es_ngram_index``: the n-grams (n_min <= n <= n_max) of a growing token sequence."""

    _free = lib.es_ngram_index_free

    def __init__(self, n_min: int = N_MIN, n_max: int = N_MAX):
        params = lib.es_ngram_index_default_params()
        params.n_min = n_min
        params.n_max = n_max
        out = ffi.new("es_ngram_index **")
        check(lib.es_ngram_index_init(ffi.addressof(params), out), "es_ngram_index_init")
        self._ptr = out[0]
        self._match = ffi.new("int32_t *")
        self._out = ffi.new("es_token[]", 0)

    def __len__(self) -> int:
        return lib.es_ngram_index_size(self._ptr)

    def append(self, tokens: Sequence[int]) -> None:
        if tokens:
            check(lib.es_ngram_index_append(self._ptr, ffi.new("es_token[]", list(tokens)), len(tokens)),
                  "es_ngram_index_append")

    def reset(self) -> None:
        lib.es_ngram_index_reset(self._ptr)

    def draft(self, max_tokens: int) -> tuple[list[int], int]:
        """(up to ``max_tokens`` continuation tokens, length of the suffix that matched; 0: none)."""
        if len(self._out) < max_tokens:
            self._out = ffi.new("es_token[]", max_tokens)
        n = check(lib.es_ngram_index_draft(self._ptr, self._out, max_tokens, self._match),
                  "es_ngram_index_draft")
        return ffi.unpack(self._out, n), self._match[0]


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, config: DrafterConfig):
        self.index = NgramIndex()
        self._reset_counters()

    def _reset_counters(self) -> None:
        """Counters of one generation (stats() is reported per result)."""
        self.n_drafts = 0         # draft() calls that were asked for tokens
        self.n_matches = 0        # of those, the ones that found an earlier occurrence
        self.match_len_sum = 0    # sum of the matched suffix lengths
        self.n_drafted = 0        # tokens proposed

    def begin(self, prompt: Sequence[int], sampling: SamplingParams) -> None:
        self._reset_counters()
        self.index.reset()
        self.index.append(prompt)

    def draft(self, context: Sequence[int], max_tokens: int) -> Draft:
        if max_tokens <= 0:
            return Draft(source=self.name)
        # The index follows the text through begin() and accept(); the token
        # sampled from the prompt's own row reaches it only here, as the tail
        # of context the index has not seen. A context shorter than the index
        # is a new text: index it afresh.
        n = len(self.index)
        if n > len(context):
            self.index.reset()
            n = 0
        self.index.append(context[n:])
        self.n_drafts += 1
        tokens, match_len = self.index.draft(max_tokens)
        if match_len:
            self.n_matches += 1
            self.match_len_sum += match_len
            self.n_drafted += len(tokens)
        # A longer matched suffix predicts a longer copied run: the planner
        # learns acceptance per match length.
        bucket = min(match_len, KEY_MAX_MATCH)
        return Draft(tokens=tokens, source=self.name, key=f"ngram:{bucket}", prior=PRIOR_BY_MATCH.get(bucket))

    def accept(self, step: Verified) -> None:
        self.index.append(step.tokens)

    def stats(self) -> dict:
        return {
            "drafts": self.n_drafts,
            "matches": self.n_matches,
            "mean_match_len": round(self.match_len_sum / self.n_matches, 3) if self.n_matches else 0.0,
            "drafted_tokens": self.n_drafted,
        }

    def close(self) -> None:
        self.index.close()


DRAFTER = NgramDrafter
