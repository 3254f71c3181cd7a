"""N-gram cache drafter: next-token counts from a corpus, plus the session's own text.

A static cache (a file made by ``edgespec drafter ngram``, see
``build_ngram_cache``) holds, for every context of 1..n_max tokens of a
corpus, its most frequent next tokens. A dynamic cache learns the text of the
current generation (prompt + output) as it grows and is consulted first.
Drafting walks the most frequent continuation of the longest known context
and stops when its share of the context's count falls below MIN_SHARE. The
counting and the file format are the C core's (es_ngram_cache).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from ..capi import Owned, check, ffi, lib
from ..errors import DrafterError, InvalidArgumentError
from ..files import atomic_output
from ..sampling import SamplingParams
from . import Draft, Drafter, DrafterConfig, Verified

N_MAX_LIMIT = 8        # es_ngram_cache_init accepts n_max in [1, 8]
DYNAMIC_N_MAX = 4      # context lengths the session's own cache counts
MIN_SHARE = 0.3        # stop drafting where the best guess follows its context < 30% of the time
CHUNK_CHARS = 8192     # corpus text is tokenized in paragraphs, split further past this size


class NgramCache(Owned):
    """Owns one ``es_ngram_cache``."""

    _free = lib.es_ngram_cache_free

    def __init__(self, n_max: int = DYNAMIC_N_MAX, *, _ptr=None):
        if _ptr is None:
            out = ffi.new("es_ngram_cache **")
            check(lib.es_ngram_cache_init(n_max, out), "es_ngram_cache_init")
            _ptr = out[0]
        self._ptr = _ptr
        self._out = ffi.new("es_token[]", 0)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "NgramCache":
        """Load a cache file; DrafterError when it is missing, unreadable or damaged."""
        out = ffi.new("es_ngram_cache **")
        rc = lib.es_ngram_cache_load(os.fsencode(path), out)
        if rc == lib.ES_ERR_IO:
            why = "no such file" if not os.path.exists(path) else "cannot be read"
            raise DrafterError(f"n-gram cache {path}: {why}")
        if rc == lib.ES_ERR_FORMAT:
            raise DrafterError(f"n-gram cache {path} is not an edgespec n-gram cache or is damaged "
                               "(rebuild it with `edgespec drafter ngram`)")
        check(rc, "es_ngram_cache_load")
        return cls(_ptr=out[0])

    def save(self, path: str | os.PathLike) -> None:
        """Write the cache to ``path`` as given (callers write a temporary name and rename)."""
        rc = lib.es_ngram_cache_save(self._ptr, os.fsencode(path))
        if rc == lib.ES_ERR_IO:
            raise DrafterError(f"cannot write the n-gram cache {path}")
        check(rc, "es_ngram_cache_save")

    def __len__(self) -> int:
        """Distinct contexts held."""
        return lib.es_ngram_cache_size(self._ptr)

    def add(self, tokens: Sequence[int]) -> None:
        """Count every (context, next token) pair inside ``tokens``."""
        if len(tokens) > 1:
            check(lib.es_ngram_cache_add(self._ptr, ffi.new("es_token[]", list(tokens)), len(tokens)),
                  "es_ngram_cache_add")

    def draft(self, context: Sequence[int], max_tokens: int, min_share: float = MIN_SHARE,
              primary: "NgramCache | None" = None) -> list[int]:
        """Up to ``max_tokens`` tokens after ``context`` (its last N_MAX_LIMIT tokens
        are all that is read), ``primary`` consulted first at each context length."""
        if len(self._out) < max_tokens:
            self._out = ffi.new("es_token[]", max_tokens)
        tail = list(context[-N_MAX_LIMIT:])
        n = check(lib.es_ngram_cache_draft(self._ptr, primary._ptr if primary else ffi.NULL,
                                           ffi.new("es_token[]", tail), len(tail),
                                           self._out, max_tokens, min_share),
                  "es_ngram_cache_draft")
        return ffi.unpack(self._out, n)


# ---------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------


class CacheDrafter(Drafter):
    name = "cache"

    def __init__(self, config: DrafterConfig):
        if not config.options.ngram_cache:
            raise InvalidArgumentError("the cache drafter needs an n-gram cache: --ngram-cache FILE "
                                       "(build one with `edgespec drafter ngram CORPUS... --out FILE`)")
        self.static = NgramCache.load(config.options.ngram_cache)
        self.dynamic = NgramCache(DYNAMIC_N_MAX)
        self.n_vocab = config.n_vocab
        self._text: list[int] = []   # prompt + output that the dynamic cache has learned
        self._buf = ffi.new("es_token[]", 0)
        self.n_drafts = 0            # drafts with at least one token, this generation
        self.n_drafted = 0           # tokens proposed in them

    def _learn(self, start: int) -> None:
        """Count the pairs whose next token is at position >= ``start`` of the text.

        es_ngram_cache_add counts every pair inside what it is given, so the
        tail cannot be handed over with its left context without counting
        that context's own pairs again. Instead each position j is added as
        the window text[j - n_max .. j]: a pair (context of m tokens, next)
        is counted by n_max - m + 1 windows once the text has grown past it,
        the same factor for every pair of one context length, so the shares
        that drafting reads (count / total of one context) are those of
        plain counting, but for the last few pairs still coming in.
        """
        text, n_max = self._text, DYNAMIC_N_MAX
        if len(self._buf) < len(text):  # _buf mirrors the text: (capacity) tokens
            self._buf = ffi.new("es_token[]", max(len(text), 2 * len(self._buf)))
            start_copy = 0
        else:
            start_copy = start
        self._buf[start_copy:len(text)] = text[start_copy:]
        for j in range(max(start, 1), len(text)):
            lo = max(0, j - n_max)
            check(lib.es_ngram_cache_add(self.dynamic.handle, self._buf + lo, j + 1 - lo), "es_ngram_cache_add")

    def begin(self, prompt: Sequence[int], sampling: SamplingParams) -> None:
        self.n_drafts = self.n_drafted = 0
        self.dynamic.close()
        self.dynamic = NgramCache(DYNAMIC_N_MAX)
        self._text = list(prompt)
        self._learn(0)

    def draft(self, context: Sequence[int], max_tokens: int) -> Draft:
        if max_tokens <= 0 or not context:
            return Draft(source=self.name)
        # The token sampled from the prompt's own row reaches the drafter only
        # as the tail of context that the text has not seen.
        if len(context) > len(self._text):
            start = len(self._text)
            self._text.extend(context[start:])
            self._learn(start)
        tokens = self.static.draft(context, max_tokens, MIN_SHARE, primary=self.dynamic)
        # A cache built with another tokenizer may hold ids this vocabulary lacks.
        for i, t in enumerate(tokens):
            if t >= self.n_vocab:
                del tokens[i:]
                break
        if not tokens:
            return Draft(source=self.name)
        self.n_drafts += 1
        self.n_drafted += len(tokens)
        return Draft(tokens=tokens, source=self.name)

    def accept(self, step: Verified) -> None:
        start = len(self._text)
        self._text.extend(step.tokens)
        self._learn(start)

    def stats(self) -> dict:
        return {
            "drafts": self.n_drafts,
            "mean_draft_len": round(self.n_drafted / self.n_drafts, 3) if self.n_drafts else 0.0,
            "static_contexts": len(self.static),
            "session_contexts": len(self.dynamic),
        }

    def close(self) -> None:
        self.dynamic.close()
        self.static.close()


DRAFTER = CacheDrafter


# ---------------------------------------------------------------------------
# Building a static cache from a corpus
# ---------------------------------------------------------------------------


def _chunks(lines: Iterable[str]) -> Iterator[str]:
    """Paragraphs (a run of lines with the blank lines after it), split further
    once one reaches CHUNK_CHARS, so that no tokenizer call gets a whole file."""
    chunk: list[str] = []
    size = 0
    after_blank = False
    for line in lines:
        blank = not line.strip()
        if chunk and ((after_blank and not blank) or size >= CHUNK_CHARS):
            yield "".join(chunk)
            chunk, size = [], 0
        chunk.append(line)
        size += len(line)
        after_blank = blank
    if chunk:
        yield "".join(chunk)


def build_ngram_cache(tokenize: Callable[[str], list[int]], corpus_paths: Sequence[str | os.PathLike],
                      out_path: str | os.PathLike, n_max: int = 4, progress: bool = True) -> dict:
    """Count the n-grams of UTF-8 text files and save them as a static cache.

    ``tokenize`` turns text into the target model's token ids (no BOS). The
    cache is written to a temporary file beside ``out_path`` and renamed into
    place, so an interrupted build never leaves a half-written cache.
    Returns {"path", "files", "tokens", "contexts", "bytes", "n_max"}.
    """
    if not 1 <= n_max <= N_MAX_LIMIT:
        raise InvalidArgumentError(f"n_max must be in [1, {N_MAX_LIMIT}], got {n_max}")
    if not corpus_paths:
        raise InvalidArgumentError("no corpus files given")
    paths = [Path(p) for p in corpus_paths]
    for p in paths:
        if not p.is_file():
            raise InvalidArgumentError(f"corpus file {p}: " + ("is a directory" if p.is_dir() else "no such file"))

    n_tokens = 0
    with NgramCache(n_max) as cache:
        for p in paths:
            n_file = 0
            try:
                with open(p, encoding="utf-8") as f:
                    for chunk in _chunks(f):
                        tokens = tokenize(chunk)
                        cache.add(tokens)
                        n_file += len(tokens)
            except UnicodeDecodeError as e:
                raise DrafterError(f"corpus file {p} is not UTF-8 text ({e.reason} at byte {e.start})") from e
            except OSError as e:
                raise DrafterError(f"corpus file {p}: {e.strerror or e}") from e
            n_tokens += n_file
            if progress:
                print(f"{p}: {n_file} tokens, {len(cache)} contexts so far", file=sys.stderr)

        out = Path(out_path)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            with atomic_output(out) as tmp:
                cache.save(str(tmp))
        except OSError as e:
            raise DrafterError(f"cannot write {out}: {e.strerror or e}") from e
        n_contexts = len(cache)
    return {"path": str(out), "files": len(paths), "tokens": n_tokens, "contexts": n_contexts,
            "bytes": out.stat().st_size, "n_max": n_max}
