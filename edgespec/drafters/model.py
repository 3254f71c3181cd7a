"""Draft model: a small GGUF model proposes a chain (or a small tree).

Three modes, chosen by the token map a specialized drafter carries and by the
tokenizer check (``check_tokenizers``):

* same-vocabulary: the draft model shares the target's token ids; it drafts
  them directly and, under sampling, hands its distributions q to
  verification. Under greedy decoding it adds the second-best token as a
  sibling leaf at uncertain positions when the planner's cost curve says the
  wider tree pays (``Planner.widen``).
* trimmed-vocabulary: a specialized drafter (``specialized.py``) keeps only
  the target tokens its language uses; it is fed its own ids for the
  target's (``unk_id`` for the others) and its proposals, and under sampling
  its distributions q (zero outside the kept tokens), are mapped back to
  target ids, so verification stays exact. A drafter trained for another
  target's vocabulary is refused.
* cross-tokenizer: the draft model has a tokenizer of its own. The target's
  text is re-tokenized into draft tokens (incrementally, from a safe
  boundary), the draft model continues it as text, and that text is
  re-tokenized into target tokens after an anchor of the context's last
  tokens; the last target token, which may be a piece of a longer one, is
  dropped. Verification sees a deterministic proposal (a point mass), so
  greedy output stays identical and sampling exact.

Either way the draft model's KV cache persists across steps: a draft only
evaluates what the text gained since the last one, and what the target
rejected is rolled back (``accept`` truncates exactly the rejected tail in
same-vocabulary mode; the prefix match of ``Backend.reuse_prefix`` does it
for re-tokenized text).
"""
from __future__ import annotations

import hashlib
import math
import time
import warnings
import weakref
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np

from ..backends import open_backend
from .. import onnx  # noqa: F401  (extends resolve_model to the onnx backend)
from ..models import resolve_model
from ..backends.base import common_prefix
from ..costs import cached_measurement, draft_cost, open_seconds
from ..errors import IncompatibleDraftModelError, InvalidArgumentError, ModelFetchError
from ..models import registry
from ..models.gguf import GGUFFile
from ..sampling import Sampler, SamplingParams
from ..text import complete_utf8
from . import Draft, Drafter, DrafterConfig, Verified, ranks, siblings, specialized

DRAFT_SEED_XOR = 0x5EED_D4AF_7000_0001  # keeps the draft's draws independent of the target's

SAME_VOCAB, TRIMMED, CROSS_TOKENIZER = "same-vocabulary", "trimmed-vocabulary", "cross-tokenizer"

# Texts a cross-tokenizer draft model must turn into tokens whose pieces give
# the same bytes back (with a sample of the target's own vocabulary).
ROUND_TRIP_PROBES = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\n\tif x != 0:  # tabs, two spaces\n",
    "  leading spaces, trailing spaces   ",
    "Zürich, São Paulo, Kraków, naïve café: déjà vu",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🙂🚀 and symbols ∑ ≤ ≥ → ← ✓",
    "{\"json\": [1, 2.5, -3e10], \"ok\": true}\r\n",
)
ROUND_TRIP_VOCAB_SAMPLE = 512   # target vocabulary entries checked (evenly spaced)

SAFE_BOUNDARY = 4   # draft tokens re-tokenized again before the first changed byte
ANCHOR = 3          # target tokens of the context re-tokenized with the draft's text


# What must agree between draft and target, beyond the tokens, for ids to mean the same.
_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id",
                   "tokenizer.ggml.eos_token_id")


class _Vocabulary:
    """A backend's vocabulary entries in id order, and the tokenizer settings
    that give ids their meaning, as its GGUF file stores them (read once:
    llama.cpp returns the same texts for every file the validator accepts,
    at a hundredth of the time of asking for 150k tokens one by one); token
    by token for a backend without a GGUF file of its own (an ONNX graph).
    ``joined`` is every entry's bytes followed by a NUL: two vocabularies are
    the same exactly when theirs are, and a valid UTF-8 one hashes to the
    fingerprint directly; ``texts`` are decoded only when asked for."""

    def __init__(self, backend):
        path = Path(getattr(backend, "path", None) or "")
        self._texts: list[str] | None = None
        if path.suffix == ".gguf" and path.is_file():
            self._path = path
            with GGUFFile(path) as f:
                self.joined = f.strings_nul_joined("tokenizer.ggml.tokens") or b""
                self.settings = {k: f.get(k) for k in _TOKENIZER_KEYS}
        else:
            self._path = None
            self._texts = [backend.token_text(t) for t in range(backend.n_vocab)]
            self.joined = b"".join(t.encode("utf-8", "surrogatepass") + b"\0" for t in self._texts)
            self.settings = {"tokenizer.ggml.model": backend.metadata("tokenizer.ggml.model"),
                             "tokenizer.ggml.pre": backend.metadata("tokenizer.ggml.pre"),
                             "tokenizer.ggml.bos_token_id": backend.bos_token,
                             "tokenizer.ggml.eos_token_id": backend.eos_token}
        self._fingerprint: str | None = None

    @property
    def texts(self) -> list[str]:
        if self._texts is None:
            with GGUFFile(self._path) as f:
                self._texts = f.get("tokenizer.ggml.tokens") or []
        return self._texts

    @property
    def fingerprint(self) -> str:
        """``specialized.vocab_fingerprint`` of the texts."""
        if self._fingerprint is None:
            try:
                self.joined.decode("utf-8")   # every entry valid UTF-8 (a NUL ends no character)
                self._fingerprint = hashlib.sha256(self.joined).hexdigest()
            except UnicodeDecodeError:        # the texts carry replacement characters
                self._fingerprint = specialized.vocab_fingerprint(self.texts)
        return self._fingerprint


_VOCABULARIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def vocabulary(backend) -> _Vocabulary:
    """``_Vocabulary`` of a backend (or a Vocab), read once per object."""
    v = _VOCABULARIES.get(backend)
    if v is None:
        v = _VOCABULARIES[backend] = _Vocabulary(backend)
    return v


def _vocab_difference(target, draft, draft_ref: str) -> str | None:
    """Why the draft's token ids do not mean the target's (None: they do)."""
    if draft.n_vocab != target.n_vocab:
        return f"draft model {draft_ref} has a vocabulary of {draft.n_vocab} tokens, the target {target.n_vocab}"
    t, d = vocabulary(target), vocabulary(draft)
    for key in _TOKENIZER_KEYS:
        a, b = t.settings[key], d.settings[key]
        if a != b:
            return f"draft model {draft_ref} has {key} = {b!r}, the target {a!r}"
    if t.joined != d.joined:
        i = next(i for i, (a, b) in enumerate(zip(t.texts, d.texts)) if a != b)
        return f"draft model {draft_ref}: token {i} is {d.texts[i]!r} but the target's is {t.texts[i]!r}"
    return None


def _round_trip_failure(target, draft) -> str | None:
    """A text the draft tokenizer cannot give back byte for byte, with what it gave."""
    texts = list(ROUND_TRIP_PROBES)
    step = max(1, target.n_vocab // ROUND_TRIP_VOCAB_SAMPLE)
    for t in range(0, target.n_vocab, step):
        try:
            text = target.piece(t).decode("utf-8")
        except UnicodeDecodeError:
            continue  # a byte token: part of a character
        if text.strip():
            texts.append(text)
    for text in texts:
        got = b"".join(draft.piece(t) for t in draft.tokenize(text, add_special=False, parse_special=False))
        if got != text.encode("utf-8"):
            return f"{text!r} re-tokenizes to {got.decode('utf-8', 'replace')!r}"
    return None


def check_tokenizers(target, draft, draft_ref: str) -> tuple[str, str | None]:
    """The drafting mode for this pair, SAME_VOCAB or CROSS_TOKENIZER, and why
    the vocabularies differ (None in same-vocabulary mode). Raises
    IncompatibleDraftModelError when the draft tokenizer cannot round-trip
    the target's text."""
    difference = _vocab_difference(target, draft, draft_ref)
    if difference is None:
        return SAME_VOCAB, None
    failure = _round_trip_failure(target, draft)
    if failure is not None:
        raise IncompatibleDraftModelError(
            f"{difference}, and its tokenizer cannot stand in for the target's in cross-tokenizer mode: "
            f"{failure}")
    return CROSS_TOKENIZER, difference


class _File:
    """A GGUF draft model's vocabulary as its file says, without opening the
    model: what the vocabulary checks read of a backend (``path``, ``n_vocab``)."""

    def __init__(self, path):
        self.path = Path(path)
        with GGUFFile(self.path) as f:
            self.n_vocab = f.array_length("tokenizer.ggml.tokens") or 0


class _Deferred:
    """A draft model's backend as the cost cache sees it: what its key reads
    (backend name, file, output rows, execution provider) known without
    opening it; anything else (a measurement's decoding) opens it."""

    def __init__(self, drafter, name: str, path, output_rows: int, ep: str | None):
        self._drafter = drafter
        self.name, self.path, self.output_rows, self.ep = name, path, output_rows, ep

    def __getattr__(self, attr):
        return getattr(self._drafter.backend, attr)


class TokenMap:
    """A specialized drafter's ids against the target's."""

    def __init__(self, to_target: np.ndarray, unk: int, n_target: int):
        self.n_draft = len(to_target)
        self.to_target = to_target                          # (n_draft,) drafter id -> target id
        self.to_draft = np.full(n_target, unk, np.int32)    # (n_target,) target id -> drafter id
        self.to_draft[to_target] = np.arange(len(to_target), dtype=np.int32)

    def drafter_ids(self, tokens: Sequence[int]) -> list[int]:
        return self.to_draft[np.asarray(tokens, dtype=np.int64)].tolist() if len(tokens) else []

    def target_ids(self, tokens: Sequence[int]) -> list[int]:
        return self.to_target[np.asarray(tokens, dtype=np.int64)].tolist() if len(tokens) else []


def target_fingerprint(target) -> str:
    """``specialized.vocab_fingerprint`` of a target's vocabulary (a backend or
    a Vocab), computed once per object (a set of drafters checks it often)."""
    return vocabulary(target).fingerprint


VOCAB_CHECK_FILE = "vocab-checks.json"


def _file_id(path) -> str:
    st = Path(path).stat()
    return f"{Path(path).name}:{st.st_size}:{st.st_mtime_ns}"


def checked_once(what: str, target, draft_path, check):
    """``check()``'s result (a JSON list: what the vocabulary check ``what``
    of the draft file at ``draft_path`` against ``target`` found), kept per
    check and pair of files (name, size, modification time) in
    ``VOCAB_CHECK_FILE``: a later load of the same pair need not read and
    compare two vocabularies again. A check that raises is not kept."""
    target_path = getattr(target, "path", None)
    if not target_path or not Path(target_path).is_file() or not Path(draft_path).is_file():
        return check()
    return cached_measurement(VOCAB_CHECK_FILE, f"{what}:{_file_id(target_path)}|{_file_id(draft_path)}",
                              "check", check, lambda v: isinstance(v, list))


def token_map(target, draft_path, n_draft: int, draft_ref: str, *, checked: bool = False) -> TokenMap | None:
    """The id map of a specialized drafter (None for any other draft model, an
    ONNX export folder included), checked: every key present and in range, and
    the vocabulary it was trained for the ``target`` backend's (else
    IncompatibleDraftModelError saying which; ``checked``: that comparison
    passed at an earlier load of the same files, ``checked_once``)."""
    if not Path(draft_path).is_file():
        return None
    with GGUFFile(draft_path) as f:
        if specialized.KEY_TOKEN_MAP not in f:
            return None
        ids, unk = f.get(specialized.KEY_TOKEN_MAP), f.get(specialized.KEY_UNK)
        trained_for, fingerprint = f.get(specialized.KEY_TARGET), f.get(specialized.KEY_TARGET_VOCAB)
    n_target = target.n_vocab
    if not checked and fingerprint != target_fingerprint(target):
        target_path = getattr(target, "path", None)
        raise IncompatibleDraftModelError(
            f"draft model {draft_ref} was trained for {trained_for or 'another model'}, whose vocabulary "
            f"differs from the target's, {registry.model_name(target_path) if target_path else 'this one'} "
            f"({specialized.KEY_TARGET_VOCAB} does not match)")
    if not isinstance(ids, list) or len(ids) != n_draft or not all(isinstance(i, int) for i in ids):
        raise IncompatibleDraftModelError(f"draft model {draft_ref}: {specialized.KEY_TOKEN_MAP} must list "
                                          f"a target id for each of its {n_draft} tokens")
    to_target = np.asarray(ids, dtype=np.int64)
    if n_draft and (to_target.min() < 0 or to_target.max() >= n_target):
        raise IncompatibleDraftModelError(f"draft model {draft_ref}: {specialized.KEY_TOKEN_MAP} names a "
                                          f"token outside the target's vocabulary [0, {n_target})")
    if len(np.unique(to_target)) != n_draft:
        raise IncompatibleDraftModelError(f"draft model {draft_ref}: {specialized.KEY_TOKEN_MAP} names a "
                                          "target token twice")
    if not isinstance(unk, int) or not 0 <= unk < n_draft:
        raise IncompatibleDraftModelError(f"draft model {draft_ref}: {specialized.KEY_UNK} must be one of "
                                          f"its token ids [0, {n_draft})")
    return TokenMap(to_target, unk, n_target)


def _valid_prefix(data: bytes) -> str:
    """The longest prefix of ``data`` that is valid UTF-8, as text."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        return data[:e.start].decode("utf-8")


class _TextBridge:
    """The target's context as the draft model's tokens, kept in step with it.

    The target's tokens are turned into text piece by piece; the text is
    re-tokenized for the draft model from a safe boundary: SAFE_BOUNDARY draft
    tokens before the first byte that changed (merges can reach back over a
    boundary), at a character boundary."""

    def __init__(self, target, draft):
        self.target, self.draft = target, draft
        self.t_tokens: list[int] = []    # target tokens converted
        self.t_ends: list[int] = []      # (len t_tokens) byte end of each in text
        self.text = bytearray()          # their text
        self.d_tokens: list[int] = []    # the text as draft tokens
        self.d_ends: list[int] = []      # (len d_tokens) byte end of each in text

    def _target_piece(self, t: int) -> bytes:
        piece = self.target.piece(t)
        if not piece and t != self.target.bos_token:   # a control token, e.g. ChatML's markers
            piece = self.target.token_text(t).encode("utf-8")
        return piece

    def update(self, context: Sequence[int]) -> bool:
        """Bring both conversions up to ``context``; False when the text ends
        inside a character (nothing to draft from this step)."""
        keep, limit = 0, min(len(self.t_tokens), len(context))
        while keep < limit and self.t_tokens[keep] == context[keep]:
            keep += 1
        del self.t_tokens[keep:], self.t_ends[keep:]
        changed = self.t_ends[-1] if self.t_ends else 0
        del self.text[changed:]
        for t in context[keep:]:
            self.text += self._target_piece(t)
            self.t_tokens.append(t)
            self.t_ends.append(len(self.text))
        end = complete_utf8(bytes(self.text[-4:])) + max(0, len(self.text) - 4)
        if end != len(self.text):
            return False
        # Draft tokens ending at or before the first changed byte stay, less a margin.
        n = 0
        while n < len(self.d_ends) and self.d_ends[n] <= changed:
            n += 1
        n = max(0, n - SAFE_BOUNDARY)
        while n > 0 and self.d_ends[n - 1] < len(self.text) and 0x80 <= self.text[self.d_ends[n - 1]] < 0xC0:
            n -= 1   # the boundary splits a character (the byte after it continues one)
        start = self.d_ends[n - 1] if n else 0
        # Bytes that are not UTF-8 (a model's stray byte tokens) reach the
        # draft model as U+FFFD; they shift its view of the text a little.
        tail = bytes(self.text[start:]).decode("utf-8", "replace")
        del self.d_tokens[n:], self.d_ends[n:]
        new = self.draft.tokenize(tail, add_special=n == 0, parse_special=True) if tail else []
        for t in new:
            start += len(self.draft.piece(t))
            self.d_tokens.append(t)
            self.d_ends.append(start)
        return bool(self.d_tokens)

    def target_tokens(self, draft_text: bytes) -> list[int]:
        """The target tokens of ``draft_text`` continuing the context: the text
        re-tokenized after the context's last ANCHOR tokens (which must come
        back unchanged), cut before an incomplete character. Empty when the
        draft's text would change how the context itself tokenizes."""
        text = _valid_prefix(draft_text)
        if not text or not self.t_tokens:
            return []
        a = max(0, len(self.t_tokens) - ANCHOR)
        while True:
            try:
                anchor = bytes(self.text[self.t_ends[a - 1] if a else 0:]).decode("utf-8")
                break
            except UnicodeDecodeError:   # the anchor starts inside a character
                if a == 0:
                    return []
                a -= 1
        anchor_tokens = self.t_tokens[a:]
        tokens = self.target.tokenize(anchor + text, add_special=False, parse_special=True)
        if tokens[:len(anchor_tokens)] != anchor_tokens:
            return []
        return tokens[len(anchor_tokens):]


class ModelDrafter(Drafter):
    name = "model"
    costly = True

    def __init__(self, config: DrafterConfig):
        ref = config.options.draft_model or config.paired_draft
        if not ref:
            raise InvalidArgumentError("the model drafter needs a draft model (--draft-model NAME|PATH); "
                                       "this target has no paired draft model in the registry")
        self.ref = ref
        # The draft model may run on another backend and device than the target
        # (e.g. on an NPU through onnxruntime while llama.cpp runs the target).
        name = config.options.draft_backend or config.target.name
        try:
            path = resolve_model(name, ref)
        except ModelFetchError as e:
            raise ModelFetchError(f"draft model {ref} is not downloaded and could not be fetched ({e}); "
                                  f"get it with: edgespec models pull {ref}") from e
        # Its cache follows the target's text, also past its own training context
        # (an ONNX export's cache length is fixed when it is exported: ep instead).
        extra = ({"ep": config.options.ep} if name == "onnx" else
                 {"ctx_extend": True, **(config.options.native_options if name == "native" else {})})
        self._open_args = (name, path, dict(n_ctx=config.n_ctx, threads=config.options.threads, **extra))
        self._backend = None
        self._open_s = open_seconds(path)   # what opening it is expected to take (opening())
        self._rows = None   # draft_vocab: the output rows kept (FR-Spec), set on the backend when it opens
        self.target = config.target
        # A GGUF draft model opens when the planner first asks it for a draft
        # (a short answer never may): its vocabulary checks are read from the
        # files (once per pair of files: checked_once), and its cost from the
        # cache, without opening it. A draft model of another tokenizer
        # (drafting re-tokenizes with it), of unmeasured cost, or an ONNX
        # export opens now.
        gguf = Path(path).suffix == ".gguf" and Path(path).is_file()
        try:
            self.mode, self.difference, n_vocab = (checked_once("mode", config.target, path, lambda: self._check(path))
                                                   if gguf else self._check(path))
            self._map = token_map(config.target, path, n_vocab, ref, checked=True) if self.mode == TRIMMED else None
            if config.options.draft_vocab:
                self._trim_head(config.options.draft_vocab, name, n_vocab)
            # What drafting costs beside this target, measured at load (once
            # per machine) so that the planner charges it before the first try.
            self.cost = draft_cost(config.target, _Deferred(self, name, path, config.options.draft_vocab or 0,
                                                            extra.get("ep")))
        except BaseException:
            self.close()
            raise
        target_path = Path(config.target.path)
        if Path(path).is_file() and Path(path).stat().st_size > target_path.stat().st_size:
            warnings.warn(f"draft model {ref} is larger than the target {target_path.name}: "
                          "it is used only where the planner measures that it pays", stacklevel=2)
        # A fresh machine's guess, cautious: a small model of the target's
        # family agrees on 60-86% of its tokens (qwen2.5-coder 0.5B beside
        # the 1.5B: prose and code), yet at half a target step per drafted
        # token even 60% does not pay, so the planner's default (0.5) until
        # drafts on this kind of text say otherwise (edgespec.learned keeps
        # what they said); text re-tokenized across vocabularies loses some
        # more at the boundary.
        self.prior = None if self.mode == SAME_VOCAB else 0.4
        # q rows handed to verification, over the target's vocabulary (trimmed mode).
        self._q = np.empty((0, config.target.n_vocab), dtype=np.float32)
        self.planner = None               # set by the engine: decides on draft trees
        self.n_vocab = n_vocab
        self._bridge = _TextBridge(config.target, self.backend) if self.mode == CROSS_TOKENIZER else None
        self._sampler: Sampler | None = None
        self._constraint = None   # the generation's grammar, drafted inside (same vocabulary)
        self._probs = np.empty((0, self.n_vocab), dtype=np.float32)  # (max_draft, n_vocab) q rows
        self._base = 0                    # cells the cache held before the last chain was drafted
        self._chain: list[int] = []       # the last chain drafted (same-vocabulary mode)
        self._seen = 0                    # context length (target tokens) at the last draft
        self.n_drafts = 0
        self.n_evaluated = 0
        self.n_trees = 0
        self.n_boundary_misses = 0        # cross-tokenizer drafts lost to the context boundary

    def _check(self, path) -> list:
        """[mode, why the vocabularies differ (None: they do not), the draft
        model's vocabulary size] of the draft model at ``path`` (the GGUF
        file read, else the model opened)."""
        target, ref = self.target, self.ref
        file = _File(path) if Path(path).suffix == ".gguf" and Path(path).is_file() else None
        n_vocab = file.n_vocab if file else self.backend.n_vocab
        if token_map(target, path, n_vocab, ref) is not None:
            return [TRIMMED, f"draft model {ref} keeps {n_vocab} of the target's {target.n_vocab} tokens", n_vocab]
        difference = _vocab_difference(target, file, ref) if file else "not a GGUF file"
        mode, difference = (SAME_VOCAB, None) if difference is None else check_tokenizers(target, self.backend, ref)
        return [mode, difference, n_vocab]

    @property
    def backend(self):
        """The draft model's backend, opened on first use."""
        if self._backend is None:
            name, path, options = self._open_args
            self._backend = open_backend(name, path, **options)
            if self._rows is not None:
                self._backend.restrict_output(self._rows)
        return self._backend

    def _trim_head(self, n: int, backend: str, n_vocab: int) -> None:
        """Compute only the ``n`` most used tokens' logits (FR-Spec): the
        others are -inf, so greedy drafts among them and a sampled draft's q
        is zero outside them; verification is exact for any q. Checked now,
        set on the backend when it opens."""
        if self.mode != SAME_VOCAB:
            raise InvalidArgumentError(f"draft_vocab (--draft-vocab) trims a draft model that shares the "
                                       f"target's vocabulary; {self.ref} is a {self.mode} draft")
        if backend != "native":
            raise InvalidArgumentError(f"draft_vocab (--draft-vocab) needs the draft model on the native "
                                       f"backend, not {backend}")
        self._rows = ranks.top_tokens(target_fingerprint(self.target), n, n_vocab, self.ref)
        if self._backend is not None:
            self._backend.restrict_output(self._rows)

    def begin(self, prompt: Sequence[int], sampling: SamplingParams) -> None:
        """Draft with the target's sampling settings on an RNG stream of its own."""
        if self._sampler is not None:
            self._sampler.close()
        # The target's logit_bias names target ids: kept in the same vocabulary
        # only (elsewhere the drafts merely come without it; verification applies it).
        same = self._map is None and self._bridge is None
        self._sampler = Sampler(replace(sampling, seed=sampling.seed ^ DRAFT_SEED_XOR,
                                        logit_bias=tuple((t, b) for t, b in sampling.logit_bias
                                                         if same and t < self.n_vocab)), self.n_vocab)
        self._chain = []
        # What the cache holds of this prompt (a prefix shared with the last
        # generation's text stays; the bridge keeps no such record; a draft
        # model not opened yet holds nothing).
        self._seen = 0 if self._bridge is not None or self._backend is None else common_prefix(
            self._backend.cached_tokens, self._drafter_ids(prompt), len(prompt))

    def _drafter_ids(self, tokens: Sequence[int]) -> list[int]:
        return list(tokens) if self._map is None else self._map.drafter_ids(tokens)

    def backlog(self, context: Sequence[int]) -> int:
        return max(0, len(context) - self._seen)

    def opening(self) -> float:
        return 0.0 if self._backend is not None else self._open_s

    def open(self) -> None:
        self.backend   # the property opens it

    def constrain(self, constraint) -> None:
        self._constraint = constraint

    def _sync(self, context: Sequence[int], per_step: int) -> int:
        """Bring the cache up to ``context``; returns the last row's logits
        address. Of the time, what goes beyond the ``per_step`` tokens a
        drafter asked at every step would evaluate is backlog_seconds."""
        keep = self.backend.reuse_prefix(context)
        n = len(context) - keep
        self.n_evaluated += n
        t0 = time.perf_counter()
        logits = self.backend.decode(context[keep:])
        if n > per_step:
            self.backlog_seconds = (time.perf_counter() - t0) * (n - per_step) / n
        return logits

    def _chain_from(self, logits: int, n: int, stop_at_control: bool,
                    look=None) -> tuple[list[int], list[tuple], list[float]]:
        """Sample up to ``n`` tokens after the row at ``logits``, evaluating all
        but the last. Returns them and, under greedy decoding, for each the
        runner-up token with the draft's probabilities of both (where the
        planner may widen the chain) and the draft's probability of it (same
        vocabulary only: only a cross-tokenizer chain stops at a control
        token, so each token has its probability). With a
        grammar's lookahead ``look``, q is drawn inside the grammar as p is,
        and the chain ends after the first token the grammar rejects (kept:
        verification needs its q row to stay exact)."""
        greedy = self._sampler.params.greedy
        # A cross-tokenizer chain is re-tokenized: its probabilities say nothing of the target's tokens.
        confident = greedy and self._bridge is None
        want_runners = confident and siblings.wanted(self.planner, self.name, n)
        tokens: list[int] = []
        runners: list[tuple] = []
        confidence: list[float] = []
        for i in range(n):
            mask = look.mask() if look else None
            if greedy:
                tok = self._sampler.sample(logits, mask)
                if want_runners:
                    runners.append(siblings.runner_up(logits, self.n_vocab, tok))
                    confidence.append(runners[-1][1])
                elif confident:
                    confidence.append(siblings.probability(logits, self.n_vocab, tok))
            else:
                if self._bridge is None:
                    self._probs[i] = self._sampler.probs(logits, mask)
                tok = self._sampler.sample(logits, mask)
            if stop_at_control and (self.backend.is_eog(tok) or not self.backend.piece(tok)):
                break
            self._sampler.accept(tok)
            tokens.append(tok)
            if look and not look.push(tok):
                break
            if i + 1 < n:
                logits = self.backend.decode([tok])
                self.n_evaluated += 1
        return tokens, runners, confidence

    def _refill_penalty(self, context: Sequence[int]) -> None:
        params = self._sampler.params
        if params.penalized:
            # Refill the penalty window with the text's tail (drafts are not text).
            for t in context[-params.repeat_last_n:]:
                self._sampler.accept(t)

    def draft(self, context: Sequence[int], max_tokens: int) -> Draft:
        if max_tokens <= 0 or len(context) + max_tokens >= self.backend.n_ctx:
            return Draft(source=self.name)
        self.n_drafts += 1
        self.backlog_seconds = 0.0
        self._seen = len(context)
        if self._bridge is not None:
            return self._draft_text(context, max_tokens)
        greedy = self._sampler.params.greedy
        if self._map is not None and self._constraint is not None and not greedy:
            # q would have to be drawn inside the grammar's mask of target ids.
            return Draft(source=self.name)
        if not greedy and self._probs.shape[0] < max_tokens:
            self._probs = np.empty((max_tokens, self.n_vocab), dtype=np.float32)
        d_context = self._drafter_ids(context)
        logits = self._sync(d_context, max_tokens + 1)
        self._refill_penalty(d_context)
        self._base = self.backend.n_past
        # The grammar's lookahead speaks target ids: in trimmed mode greedy
        # drafts go unconstrained (the engine prunes them to the grammar).
        inside = self._constraint is not None and self._map is None
        with self._constraint.lookahead() if inside else nullcontext() as look:
            tokens, runners, confidence = self._chain_from(logits, max_tokens, stop_at_control=False, look=look)
        if self._map is not None:
            tokens = self._map.target_ids(tokens)
            runners = [(int(self._map.to_target[second]), p1, p2) for second, p1, p2 in runners]
        self._chain = tokens
        if greedy:
            return self._widen(tokens, runners, confidence)
        return Draft(tokens=tokens, probs=self._target_q(len(tokens)), source=self.name)

    def _target_q(self, n: int) -> int:
        """Address of the (n, n_vocab_target) q rows: the draft's own, or in
        trimmed mode scattered into target ids (0 for tokens it does not keep)."""
        if self._map is None:
            return self._probs.ctypes.data
        if self._q.shape[0] < n:
            self._q = np.empty((n, self._q.shape[1]), dtype=np.float32)
        q = self._q[:n]
        q.fill(0.0)
        q[:, self._map.to_target] = self._probs[:n]
        return self._q.ctypes.data

    def _widen(self, tokens: list[int], runners: list[tuple], confidence: list[float]) -> Draft:
        """A greedy chain, with runner-up leaves where the planner says they pay."""
        draft, widened = siblings.widen(self.planner, self.name, tokens, runners)
        self.n_trees += widened
        return replace(draft, confidence=confidence)

    def _draft_text(self, context: Sequence[int], max_tokens: int) -> Draft:
        """Cross-tokenizer mode: draft text, re-tokenized into target tokens."""
        bridge = self._bridge
        if not bridge.update(context):
            return Draft(source=self.name)
        # Enough draft tokens for one target token more than asked (the last
        # is dropped), at the context's own ratio of draft to target tokens.
        ratio = len(bridge.d_tokens) / len(bridge.t_tokens)
        n = min(math.ceil((max_tokens + 1) * ratio), 4 * (max_tokens + 1),
                self.backend.n_ctx - len(bridge.d_tokens) - 1)
        logits = self._sync(bridge.d_tokens, n + 1)
        tokens, _, _ = self._chain_from(logits, n, stop_at_control=True)
        text = b"".join(self.backend.piece(t) for t in tokens)
        proposal = bridge.target_tokens(text)
        if text and not proposal:
            self.n_boundary_misses += 1
        return Draft(tokens=proposal[:-1][:max_tokens], source=self.name)

    def accept(self, step: Verified) -> None:
        """Same-vocabulary mode: roll the cache back to the part of the last
        chain the text kept, whichever drafter's draft the target verified
        (the rest of the text comes with the next draft)."""
        if self._bridge is not None or not self._chain:
            return
        evaluated = self._chain[:-1]   # the chain's last token was sampled, never evaluated
        k = 0
        while k < len(evaluated) and k < len(step.tokens) and evaluated[k] == step.tokens[k]:
            k += 1
        self.backend.truncate(self._base + k)
        self._chain = []

    def stats(self) -> dict:
        return {"mode": self.mode, "draft_model": self.ref, "opened": self._backend is not None, "drafts": self.n_drafts,
                "draft_tokens_evaluated": self.n_evaluated, "trees": self.n_trees,
                **({"boundary_misses": self.n_boundary_misses} if self._bridge is not None else {})}

    def close(self) -> None:
        if getattr(self, "_sampler", None) is not None:
            self._sampler.close()
            self._sampler = None
        if self._backend is not None:
            self._backend.close()
            self._backend = None


DRAFTER = ModelDrafter
