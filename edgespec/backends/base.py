"""The backend contract, implemented once.

A backend evaluates tokens into a KV cache and exposes logits rows by address:
``(n_rows, n_vocab)`` float32 in the backend's own buffer, valid until its next
evaluation. ``Backend`` keeps the record of which tokens the cache holds, in
order, and builds everything the engine does with the cache on two primitives
that each backend supplies:

``_evaluate(tokens, positions, parents, logits_from) -> address``
    One batch of at most ``n_batch`` tokens, appended after the cache's
    ``n_past`` cells. ``parents is None``: a chain (token i follows token
    i - 1, the first follows the cache). Otherwise ``parents[i]`` in
    ``[-1, i)`` names the batch token that token i follows (-1: the cache's
    last cell), which draws a tree; ``positions[i]`` is its parent's position
    + 1. Token i attends to the cache, its ancestors in the batch and itself.
    Rows are kept for ``tokens[logits_from:]``.
``_truncate(n_keep)``
    Keep the first ``n_keep`` cells, dropping everything after them in every
    sequence (a tree's branches included).

The rules, the same on every backend:

* ``decode`` appends after what the cache holds; rewinding is always explicit
  (``truncate``, ``reuse_prefix``), never implied by a position argument.
* Tokens before the first wanted logits row go in chunks of ``n_batch``; the
  wanted rows go together in the last chunk, so at most ``n_batch`` of them.
  A ``cancel`` callable is asked between chunks (prompt evaluation can be
  interrupted after any chunk; what was evaluated stays in the cache).
* ``decode_tree(pending, tokens, parents, depths)`` appends ``pending`` (its
  last token is the draft's root) and evaluates the draft tree below the
  root in the same batch. ``drop_tree()`` drops the tree's cells again,
  leaving ``pending`` in the cache (so does any next call); accepted nodes are
  evaluated again with the next batch, because llama.cpp's results depend on
  the order of KV cells and holes left by rejected branches change them.
* An evaluation that fails or is interrupted leaves the cache holding what
  the record says.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Sequence

from ..capi import Closing
from ..errors import ContextOverflowError, EngineClosedError, InvalidArgumentError

DEFAULT_CTX = 4096    # the KV cache size when none is asked for (capped at the training context)
MIN_CTX = 16          # smaller caches trip llama.cpp's asserts, and hold no useful text
MAX_CTX = 2**31 - 1   # positions are int32 in every backend


def context_size(requested: int | None, limit: int, *, extend: bool | None = False,
                 limit_name: str = "the model's training context") -> int:
    """The KV cache size to make: ``requested`` checked against ``limit`` (the
    model's training context; beyond it only with ``extend``, and never where
    ``extend`` is None), or, when None, the default capped at ``limit``."""
    if requested is None:
        return min(DEFAULT_CTX, limit) if limit > 0 else DEFAULT_CTX
    if not MIN_CTX <= requested <= MAX_CTX:
        raise InvalidArgumentError(f"the context must hold {MIN_CTX} to {MAX_CTX} tokens, got {requested}")
    if limit > 0 and requested > limit and not extend:
        hint = "" if extend is None else " (ctx_extend / --ctx-extend allows it, at the model's risk)"
        raise InvalidArgumentError(f"a context of {requested} tokens exceeds {limit_name} of {limit}{hint}")
    return requested


def available_memory() -> int | None:
    """Bytes of memory the kernel says a new allocation can take, where it says."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Interrupted(Exception):
    """Raised by ``decode`` when its ``cancel`` callable said stop between chunks."""


class Backend(Closing, ABC):
    """Base of every backend: the KV-cache record and protocol over the primitives.

    Subclasses set ``name``, ``path``, ``n_vocab``, ``n_ctx``, ``n_batch``,
    ``n_ctx_train`` and ``threads``, give the vocabulary half of the contract
    (``tokenize``, ``piece``, ``is_eog``, ``token_text``, ``metadata``,
    ``bos_token``, ``eos_token``; see ``vocab.VocabMixin``), and implement
    ``_evaluate``, ``_truncate`` and ``_close``.
    """

    name: str
    n_vocab: int
    n_ctx: int
    n_batch: int
    threads: int
    _closed = False   # class defaults: close() works on a half-made backend too
    _tree_cells = 0   # cells of an evaluated draft tree, after the record

    def __init__(self):
        self._cells: list[int] = []  # the tokens the KV cache holds, in position order

    # -- primitives ---------------------------------------------------------

    @abstractmethod
    def _evaluate(self, tokens: list[int], positions: list[int], parents: list[int] | None,
                  logits_from: int) -> int:
        """One batch appended after the cache (see the module docstring)."""

    @abstractmethod
    def _truncate(self, n_keep: int) -> None:
        """Keep the first n_keep cells in every sequence."""

    @abstractmethod
    def _close(self) -> None:
        """Free the backend's objects; safe on a half-made backend."""

    def expert_stats(self, reset: bool = False) -> dict | None:
        """A MoE model's expert cache counters since the last reset (``reset``:
        start counting again); None where the backend has no expert cache."""
        return None

    def _check_kv_memory(self, n_ctx: int) -> None:
        """Refuse a KV cache (F16 keys and values, every layer) larger than the
        memory available, before anything is allocated. Uses the GGUF's own
        hyperparameters; a model that does not state them is not checked."""
        arch = self.metadata("general.architecture")
        try:
            n_layer = int(self.metadata(f"{arch}.block_count"))
            n_embd = int(self.metadata(f"{arch}.embedding_length"))
            n_head = int(self.metadata(f"{arch}.attention.head_count"))
            n_head_kv = int(self.metadata(f"{arch}.attention.head_count_kv") or n_head)
            head_dim = int(self.metadata(f"{arch}.attention.key_length") or n_embd // n_head)
        except (TypeError, ValueError, ZeroDivisionError):
            return
        need = 2 * n_layer * n_ctx * n_head_kv * head_dim * 2
        have = available_memory()
        if have is not None and need > have:
            raise InvalidArgumentError(f"a context of {n_ctx} tokens needs {need / 2**30:.1f} GiB for its KV "
                                       f"cache, but {have / 2**30:.1f} GiB of memory is available")

    # -- the record ----------------------------------------------------------

    @property
    def n_past(self) -> int:
        """Tokens the KV cache holds."""
        return len(self._cells)

    @property
    def cached_tokens(self) -> list[int]:
        """A copy of the tokens the KV cache holds, in order."""
        return list(self._cells)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError(f"the {self.name} backend is closed")

    def _settle(self) -> None:
        """Drop a draft tree's cells, if any: the cache then holds the record."""
        if self._tree_cells:
            self._tree_cells = 0
            self._truncate(len(self._cells))

    def _resync(self) -> None:
        """After a failure: make the cache hold the record again, or clear both."""
        self._tree_cells = 0
        try:
            self._truncate(len(self._cells))
        except Exception:
            self._cells = []
            self._truncate(0)

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        if tokens and not (0 <= min(tokens) and max(tokens) < self.n_vocab):
            bad = next(t for t in tokens if not 0 <= t < self.n_vocab)
            raise InvalidArgumentError(f"token id {bad} is outside the vocabulary [0, {self.n_vocab})")

    # -- the protocol -----------------------------------------------------------

    def decode(self, tokens: Sequence[int], *, logits_from: int | None = None,
               cancel: Callable[[], bool] | None = None) -> int:
        """Evaluate ``tokens`` after what the cache holds.

        Returns the address of the logits rows of ``tokens[logits_from:]``
        (the last token's row alone when ``logits_from`` is None). Raises
        ``Interrupted`` when ``cancel()`` turns true between chunks.
        """
        self._check_open()
        tokens = list(tokens)
        n = len(tokens)
        if n == 0:
            raise InvalidArgumentError("decode of an empty batch")
        first_row = n - 1 if logits_from is None else logits_from
        if not 0 <= first_row < n:
            raise InvalidArgumentError(f"logits_from {logits_from} outside a batch of {n} tokens")
        if n - first_row > self.n_batch:
            raise InvalidArgumentError(f"{n - first_row} logits rows do not fit one batch of {self.n_batch}")
        self._check_tokens(tokens)
        self._settle()
        start = len(self._cells)
        if start + n > self.n_ctx:
            raise ContextOverflowError(f"{start + n} tokens do not fit the context of {self.n_ctx}")
        # The last chunk holds every wanted row: it starts at the last multiple
        # of n_batch, or earlier at the first wanted row.
        last = min((n - 1) // self.n_batch * self.n_batch, first_row)
        try:
            for a in range(0, last, self.n_batch):
                b = min(a + self.n_batch, last)
                self._append(tokens[a:b], b - a - 1)
                if cancel is not None and cancel():
                    raise Interrupted
            return self._append(tokens[last:], first_row - last)
        except BaseException:
            self._resync()
            raise

    def _append(self, tokens: list[int], logits_from: int) -> int:
        """Evaluate a chain chunk after the cache and record it."""
        start = len(self._cells)
        address = self._evaluate(tokens, list(range(start, start + len(tokens))), None, logits_from)
        self._cells.extend(tokens)
        return address

    def decode_tree(self, pending: Sequence[int], tokens: Sequence[int], parents: Sequence[int],
                    depths: Sequence[int]) -> int:
        """Append ``pending`` (ending with the root) and evaluate the draft tree
        below the root (``tokens``, ``parents`` with -1 = the root, ``depths``
        with 1 = a child of the root) in one batch.

        Returns the address of ``(n_nodes + 1, n_vocab)`` rows: the root's,
        then the nodes'. Follow with ``drop_tree``.
        """
        self._check_open()
        pending, tokens = list(pending), list(tokens)
        k, n = len(pending), len(tokens)
        if k == 0:
            raise InvalidArgumentError("decode_tree needs the root token")
        self._check_tokens(pending + tokens)
        self._settle()
        start = len(self._cells)
        if k + n > self.n_batch or start + k + max(depths, default=0) > self.n_ctx:
            raise ContextOverflowError(f"a draft tree of {n} nodes after {k} pending tokens does not fit "
                                       f"the batch of {self.n_batch} or the context of {self.n_ctx}")
        root = k - 1
        batch_parents = list(range(-1, k - 1)) + [root if p < 0 else k + p for p in parents]
        positions = list(range(start, start + k)) + [start + root + d for d in depths]
        try:
            address = self._evaluate(pending + tokens, positions, batch_parents, root)
        except BaseException:
            self._resync()
            raise
        self._cells.extend(pending)
        self._tree_cells = n
        return address

    def drop_tree(self) -> None:
        """After ``decode_tree``: drop the tree's cells (the pending tokens stay)."""
        self._check_open()
        self._settle()

    def truncate(self, n_keep: int) -> None:
        """Keep the first ``n_keep`` tokens of the cache (rollback); keeping
        more than it holds keeps everything."""
        self._check_open()
        if n_keep < 0:
            raise InvalidArgumentError(f"cannot keep {n_keep} tokens")
        if n_keep >= len(self._cells):
            self._settle()
            return
        self._tree_cells = 0
        try:
            self._truncate(n_keep)
        except BaseException:
            self._resync()
            raise
        del self._cells[n_keep:]

    def reuse_prefix(self, tokens: Sequence[int]) -> int:
        """Keep the longest prefix the cache shares with ``tokens``, short of
        their last token (which is always evaluated again: its row gives the
        next token). Returns how many tokens are kept; the caller decodes
        ``tokens[kept:]``."""
        self._check_open()
        keep, limit = 0, min(len(self._cells), len(tokens) - 1)
        while keep < limit and self._cells[keep] == tokens[keep]:
            keep += 1
        self.truncate(keep)
        return keep

    def clear(self) -> None:
        """Empty the cache."""
        self.truncate(0)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._close()
