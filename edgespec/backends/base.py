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

Groups. A backend that sets ``groups`` (native) evaluates several slots'
steps in one batch: ``decode_group([GroupStep(slot, pending, tokens,
parents, depths), ...])`` appends each slot's pending tokens and draft (a
chain, or a tree as ``decode_tree`` takes it) to that slot's cache, as one
``decode``/``decode_tree`` per slot would, bit for bit; a tree is followed by
``drop_tree`` on its slot, a chain by ``truncate``. It supplies
``_evaluate_group(batches)``.

Slots. A backend opened with ``slots=N`` keeps N KV caches over one loaded
model (a context each, made when first used), each with its own record.
A slot's context holds ``n_ctx`` tokens unless a generation asks for
another size (``reuse_prefix(tokens, n_ctx)``: Ollama's ``num_ctx``): it
then runs in a slot of that size, one made again at it if none is.
``reuse_prefix`` picks the slot a generation runs in: the one sharing the
longest prefix with its tokens, if taking it discards little of what that
slot holds (a tenth while an empty slot remains, half once none does: a
shared system prompt must not take over another conversation's slot), else
an empty slot, else the least recently used; every other call works on the
selected slot. A backend supplies ``_select_slot(i, n_ctx)``
for N > 1 or another size.

Embeddings. ``hidden_states(sequences)`` evaluates token sequences on an
embeddings context of their own (no slot's cache changes) and returns every
token's hidden state after the final norm; several sequences share a batch.
A backend supplies ``_hidden(pieces, fresh)``: one batch of sequences, each
from position 0 after an emptied cache (``fresh``), or one sequence appended
to the cache (a long sequence in chunks).
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..capi import Closing
from ..config import DEFAULT_CTX, MAX_CTX, MAX_SLOTS, MIN_CTX
from ..costs import available_memory  # noqa: F401  (re-exported: what the pool reads)
from ..models.gguf import GGUFFile
from ..errors import (ContextOverflowError, EngineClosedError, InvalidArgumentError,
                      UnsupportedModelError)

EMBED_SEQS = 16       # sequences in one embeddings batch


def default_threads() -> int:
    """Physical cores are what matters for decoding; on SMT machines with many
    logical CPUs use half of them."""
    n = os.cpu_count() or 1
    return n if n <= 4 else n // 2


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


def kv_row_bytes(cache_type: str, head_dim: int) -> int:
    """Bytes of one head's ``head_dim`` keys or values in a KV-cache type
    (EngineConfig.cache_type_k / cache_type_v): f16 two a value, q8_0 ggml's
    blocks of 32 int8 and an F16 scale (34 bytes per 32 values)."""
    return 2 * head_dim if cache_type == "f16" else -(-head_dim // 32) * 34


def kv_cache_bytes(metadata: Callable[[str], object], n_ctx: int,
                   cache_types: tuple[str, str] = ("f16", "f16")) -> int | None:
    """Bytes of a KV cache of ``n_ctx`` tokens (keys and values, every layer)
    of ``cache_types`` (key type, value type) from a model's GGUF
    hyperparameters (``metadata(key)``: a value or None); None when the model
    does not state them."""
    arch = metadata("general.architecture")
    try:
        n_layer = int(metadata(f"{arch}.block_count"))
        n_embd = int(metadata(f"{arch}.embedding_length"))
        n_head = int(metadata(f"{arch}.attention.head_count"))
        n_head_kv = int(metadata(f"{arch}.attention.head_count_kv") or n_head)
        head_dim = int(metadata(f"{arch}.attention.key_length") or n_embd // n_head)
    except (TypeError, ValueError, ZeroDivisionError):
        return None
    return n_layer * n_ctx * n_head_kv * sum(kv_row_bytes(t, head_dim) for t in cache_types)


@dataclass(frozen=True)
class GroupStep:
    """One slot's step in ``Backend.decode_group``: its ``pending`` tokens
    (ending with the root), then its draft: a chain (``parents`` None) or a
    tree as ``decode_tree`` takes it (``parents`` with -1 = the root, ``depths``)."""

    slot: int
    pending: Sequence[int]
    tokens: Sequence[int] = ()
    parents: Sequence[int] | None = None
    depths: Sequence[int] | None = None


class Interrupted(Exception):
    """Raised by ``decode`` when its ``cancel`` callable said stop between chunks."""


@dataclass
class SlotStats:
    """What one KV-cache slot did: generations it served, and prompt tokens
    whose K/V it already held."""

    slot: int
    tokens: int = 0       # tokens its cache holds now
    uses: int = 0         # generations started in it
    prefix_hits: int = 0  # of those, with a reused prefix
    reused: int = 0       # prompt tokens not evaluated again, summed


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the common prefix of a and b, at most limit."""
    n, limit = 0, min(limit, len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


class Backend(Closing, ABC):
    """Base of every backend: the KV-cache record and protocol over the primitives.

    Subclasses set ``name``, ``path``, ``n_vocab``, ``n_embd``, ``n_ctx``,
    ``n_batch``, ``n_ctx_train`` and ``threads``, give the vocabulary half of
    the contract (``tokenize``, ``piece``, ``is_eog``, ``token_text``,
    ``metadata``, ``bos_token``, ``eos_token``; see ``vocab.VocabMixin``), and
    implement ``_evaluate``, ``_truncate`` and ``_close`` (``_select_slot``
    for several slots, ``_hidden`` for embeddings).
    """

    name: str
    n_vocab: int
    n_embd: int
    n_ctx: int
    n_batch: int
    threads: int
    exact_trees = True  # a draft tree's rows equal those of its nodes' paths evaluated as chains
    resizable = False   # a slot's context may be made at another size (_select_slot)
    embeds = False      # hidden_states works (_hidden)
    ctx_extend = False  # contexts beyond the training context are allowed
    groups = False      # decode_group works (_evaluate_group)
    expert_cache = None  # the native engine's moe.ExpertCache, where it keeps one
    cache_types = ("f16", "f16")  # the KV cache's key and value types (EngineConfig.cache_type_k / _v)
    _closed = False   # class defaults: close() works on a half-made backend too

    def __init__(self, slots: int = 1):
        if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
            raise InvalidArgumentError(f"slots must be a whole number in [1, {MAX_SLOTS}], got {slots!r}")
        self.n_slots = slots
        # Per slot: the tokens its KV cache holds, in position order; _cells is the selected one's.
        self._records: list[list[int]] = [[] for _ in range(slots)]
        self._stats = [SlotStats(i) for i in range(slots)]
        self._last_used = [0] * slots   # LRU clock value of each slot's last generation
        self._sizes: list[int | None] = [None] * slots   # a slot's context size; None: n_ctx
        self._trees = [0] * slots       # per slot: cells of an evaluated draft tree, after the record
        self._clock = 0
        self.slot = 0
        self._cells = self._records[0]

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

    def _select_slot(self, i: int, n_ctx: int) -> None:
        """Make slot i's context the one evaluated and truncated, holding
        ``n_ctx`` tokens: made on first use, made again (empty) when it holds
        another size (``_sizes[i]`` says which it holds). The memory check
        first (``_check_kv_memory``); a failure leaves every context as it was."""
        raise InvalidArgumentError(f"the {self.name} backend keeps one KV cache of {self.n_ctx} tokens")

    def _state(self) -> bytes:
        """The selected slot's KV cache (its record's cells) as the backend's own bytes."""
        raise UnsupportedModelError(f"the {self.name} backend cannot save a KV cache")

    def _set_state(self, state: bytes, n_tokens: int) -> None:
        """Replace the selected slot's KV cache with ``_state``'s bytes of
        ``n_tokens`` cells; InvalidArgumentError (the cache emptied) when they
        do not fit it."""
        raise UnsupportedModelError(f"the {self.name} backend cannot restore a KV cache")

    def _evaluate_group(self, batches: list[tuple[int, list[int], list[int] | None, int]]) -> list[int]:
        """One batch of several slots' tokens: ``(slot, tokens, parents,
        logits_from)`` each, as ``_evaluate`` takes them for that slot (every
        slot's context made). Returns each one's logits address. On failure
        every slot's cache is as before."""
        raise UnsupportedModelError(f"the {self.name} backend evaluates one slot at a time")

    def _hidden(self, pieces: list[list[int]], fresh: bool) -> np.ndarray:
        """One batch on the embeddings context: ``fresh``, each piece is a
        sequence from position 0 in an emptied cache; otherwise the one piece
        continues the sequence in the cache. Returns the (total tokens,
        n_embd) hidden states after the final norm, a copy."""
        raise UnsupportedModelError(f"the {self.name} backend does not compute embeddings")

    def expert_stats(self, reset: bool = False) -> dict | None:
        """A MoE model's expert cache counters since the last reset (``reset``:
        start counting again); None where the backend has no expert cache."""
        return None

    def speed_variant(self) -> tuple[str, str]:
        """What this backend's speed depends on besides its name, model file
        and threads, as two parts of its cost key (edgespec.costs.cost_key):
        the device (``@cpu``: an ONNX execution provider; ``@avx2``: the
        native kernel set) and the settings (``:rows-N``: a trimmed output
        layer; an expert cache's). ("", "") here."""
        return "", ""

    def _check_kv_memory(self, n_ctx: int) -> None:
        """Refuse a KV cache (keys and values of ``cache_types``, every layer)
        larger than the memory available, before anything is allocated. Uses
        the GGUF's own hyperparameters; a model that does not state them is
        not checked."""
        path = Path(getattr(self, "path", "") or "")
        if path.suffix == ".gguf" and path.is_file():   # the C reader: no tokenizer loaded to read four numbers
            with GGUFFile(path) as f:
                need = kv_cache_bytes(f.get, n_ctx, self.cache_types)
        else:
            need = kv_cache_bytes(self.metadata, n_ctx, self.cache_types)
        have = available_memory()
        if need is not None and have is not None and need > have:
            raise InvalidArgumentError(f"a context of {n_ctx} tokens needs {need / 2**30:.1f} GiB for its KV "
                                       f"cache, but {have / 2**30:.1f} GiB of memory is available")

    # -- the record ----------------------------------------------------------

    @property
    def n_past(self) -> int:
        """Tokens the KV cache holds."""
        return len(self._cells)

    @property
    def context(self) -> int:
        """Tokens the selected slot's context holds: n_ctx unless a generation
        asked for another size."""
        return self._sizes[self.slot] or self.n_ctx

    def check_context(self, n_ctx: int) -> int:
        """A context size a generation may ask for, checked as opening does
        (the training context, memory for its KV cache); InvalidArgumentError
        naming the sizes otherwise."""
        n_ctx = context_size(n_ctx, self.n_ctx_train, extend=self.ctx_extend)
        if n_ctx != self.n_ctx:
            if not self.resizable:
                raise InvalidArgumentError(f"the {self.name} backend keeps one KV cache of {self.n_ctx} tokens; "
                                           f"a context of {n_ctx} needs the model opened with that context")
            self._check_kv_memory(n_ctx)
        return n_ctx

    @property
    def cached_tokens(self) -> list[int]:
        """A copy of the tokens the KV cache holds, in order."""
        return list(self._cells)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError(f"the {self.name} backend is closed")

    def _settle(self) -> None:
        """Drop the selected slot's draft tree's cells, if any: its cache then holds the record."""
        if self._trees[self.slot]:
            self._trees[self.slot] = 0
            self._truncate(len(self._cells))

    def _resync(self) -> None:
        """After a failure: make the cache hold the record again, or clear both."""
        self._trees[self.slot] = 0
        try:
            self._truncate(len(self._cells))
        except Exception:
            self._cells.clear()
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
        if start + n > self.context:
            raise ContextOverflowError(f"{start + n} tokens do not fit the context of {self.context}")
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
        if k + n > self.n_batch or start + k + max(depths, default=0) > self.context:
            raise ContextOverflowError(f"a draft tree of {n} nodes after {k} pending tokens does not fit "
                                       f"the batch of {self.n_batch} or the context of {self.context}")
        root = k - 1
        batch_parents = list(range(-1, k - 1)) + [root if p < 0 else k + p for p in parents]
        positions = list(range(start, start + k)) + [start + root + d for d in depths]
        try:
            address = self._evaluate(pending + tokens, positions, batch_parents, root)
        except BaseException:
            self._resync()
            raise
        self._cells.extend(pending)
        self._trees[self.slot] = n
        return address

    def decode_group(self, steps: Sequence[GroupStep]) -> list[int]:
        """Evaluate several slots' steps in one batch (see Groups in the
        module docstring). Returns, per step, the address of its
        ``(len(tokens) + 1, n_vocab)`` rows: its root's (the last pending
        token's), then its draft's. Leaves the last step's slot selected."""
        self._check_open()
        if not self.groups:
            raise UnsupportedModelError(f"the {self.name} backend evaluates one slot at a time")
        slots = [s.slot for s in steps]
        if not steps or len(set(slots)) != len(slots):
            raise InvalidArgumentError(f"a group needs distinct slots, got {slots}")
        batches, total = [], 0
        for s in steps:
            self.select_slot(s.slot)
            self._settle()
            k, n = len(s.pending), len(s.tokens)
            if k == 0:
                raise InvalidArgumentError(f"slot {s.slot}'s step needs its root token")
            self._check_tokens(list(s.pending) + list(s.tokens))
            depth = n if s.parents is None else max(s.depths, default=0)
            if len(self._cells) + k + depth > self.context:
                raise ContextOverflowError(f"slot {s.slot}: {len(self._cells) + k + depth} tokens do not fit "
                                           f"the context of {self.context}")
            parents = (None if s.parents is None else
                       list(range(-1, k - 1)) + [k - 1 if p < 0 else k + p for p in s.parents])
            batches.append((s.slot, list(s.pending) + list(s.tokens), parents, k - 1))
            total += k + n
        if total > self.n_batch:
            raise InvalidArgumentError(f"a group of {total} tokens does not fit one batch of {self.n_batch}")
        addresses = self._evaluate_group(batches)
        for s in steps:   # as decode (a chain is recorded whole) or decode_tree would
            self._records[s.slot].extend(s.pending)
            if s.parents is None:
                self._records[s.slot].extend(s.tokens)
            else:
                self._trees[s.slot] = len(s.tokens)
        return addresses

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
        self._trees[self.slot] = 0
        try:
            self._truncate(n_keep)
        except BaseException:
            self._resync()
            raise
        del self._cells[n_keep:]

    def reuse_prefix(self, tokens: Sequence[int], n_ctx: int | None = None, busy: Sequence[int] = ()) -> int:
        """Select the slot for a generation of ``tokens`` in a context of
        ``n_ctx`` tokens (None: the backend's; see the module docstring; never
        one of the ``busy`` slots, other generations' under way) and keep the
        longest prefix its cache shares with them, short of their
        last token (which is always evaluated again: its row gives the next
        token). Returns how many tokens are kept; the caller decodes
        ``tokens[kept:]``."""
        self._check_open()
        self.use_slot(self.choose_slot(tokens, n_ctx, busy), n_ctx)
        keep = common_prefix(self._cells, tokens, len(tokens) - 1)
        self.truncate(keep)
        self._clock += 1
        self._last_used[self.slot] = self._clock
        stats = self._stats[self.slot]
        stats.uses += 1
        stats.prefix_hits += keep > 0
        stats.reused += keep
        return keep

    def choose_slot(self, tokens: Sequence[int], n_ctx: int | None = None, busy: Sequence[int] = ()) -> int:
        """The slot a generation of ``tokens`` would run in (see the module
        docstring): among the slots of its context size, else an empty one
        (made again at that size), else the least recently used; never a
        ``busy`` one."""
        size = n_ctx or self.n_ctx
        if self.n_slots == 1:
            return 0
        limit = len(tokens) - 1
        free = [i for i in range(self.n_slots) if i not in busy]
        if not free:
            raise InvalidArgumentError(f"all {self.n_slots} slots are busy")
        fits = [i for i in free if (self._sizes[i] or self.n_ctx) == size]
        empty = [i for i in fits if not self._records[i]]
        # The largest share of a slot's tokens a match may discard.
        share = 0.1 if empty else 0.5
        matches = [(n, self._last_used[i], i) for i in fits
                   if (n := common_prefix(self._records[i], tokens, limit)) > 0
                   and len(self._records[i]) - n <= share * len(self._records[i])]
        if matches:
            return max(matches)[2]
        empty = empty or [i for i in free if not self._records[i]]
        if empty:
            return empty[0]
        return min(free, key=lambda i: self._last_used[i])

    def use_slot(self, i: int, n_ctx: int | None = None) -> None:
        """Select slot i, its context holding ``n_ctx`` tokens (None: n_ctx;
        one of another size is emptied and made again): later calls evaluate
        into and truncate its cache."""
        self._check_open()
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_slots:
            raise InvalidArgumentError(f"slot {i!r} is outside [0, {self.n_slots})")
        size = n_ctx or self.n_ctx
        resize = (self._sizes[i] or self.n_ctx) != size
        if i == self.slot and not resize:
            return
        self._settle()
        self._select_slot(i, size)
        if resize:
            self._records[i].clear()
        self._sizes[i] = size if size != self.n_ctx else None
        self.slot = i
        self._cells = self._records[i]

    def select_slot(self, i: int) -> None:
        """Select slot i at the size it holds (``use_slot`` never resizes it then)."""
        self.use_slot(i, self._sizes[i] if 0 <= i < self.n_slots else None)

    def slot_state(self, i: int) -> tuple[list[int], int, bytes]:
        """Slot i's tokens, context size and KV cache state (the backend's own
        bytes), to restore later with ``restore_slot``."""
        self.select_slot(i)
        self._settle()
        return list(self._cells), self.context, self._state()

    def restore_slot(self, i: int, tokens: Sequence[int], state: bytes) -> None:
        """Make slot i hold ``tokens`` from a state ``slot_state`` gave (of
        this model, in a context of slot i's size); on a refusal the slot is
        left empty."""
        self.select_slot(i)
        self._settle()
        self._check_tokens(tokens)
        self._cells.clear()
        try:
            self._set_state(state, len(tokens))
        except BaseException:
            self._resync()
            raise
        self._cells.extend(tokens)

    def erase_slot(self, i: int) -> int:
        """Empty slot i's cache; returns the tokens it held."""
        self.select_slot(i)
        n = self.n_past
        self.clear()
        return n

    def slot_tokens(self, i: int) -> list[int]:
        """A copy of the tokens slot i's KV cache holds, in order (selected or not)."""
        if not 0 <= i < self.n_slots:
            raise InvalidArgumentError(f"slot {i} is outside [0, {self.n_slots})")
        return list(self._records[i])

    def slot_sizes(self) -> list[int]:
        """Each slot's context size."""
        return [size or self.n_ctx for size in self._sizes]

    def slot_stats(self) -> list[SlotStats]:
        """A snapshot of every slot's counters."""
        return [SlotStats(s.slot, len(self._records[s.slot]), s.uses, s.prefix_hits, s.reused)
                for s in self._stats]

    def clear(self) -> None:
        """Empty the selected slot's cache."""
        self.truncate(0)

    def clear_slots(self) -> None:
        """Empty every slot's cache; slot 0 is selected afterwards."""
        for i in reversed(range(self.n_slots)):
            if self._records[i] or i == 0:
                self.select_slot(i)
                self.clear()

    # -- embeddings --------------------------------------------------------------

    def hidden_states(self, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """The hidden state after the final norm of every token of each
        sequence, ``(len(sequence), n_embd)`` float32 each, each sequence
        evaluated on its own from position 0 (packed into shared batches).
        No slot's KV cache changes."""
        self._check_open()
        seqs = [list(s) for s in sequences]
        for i, seq in enumerate(seqs):
            if not seq:
                raise InvalidArgumentError(f"input {i} has no tokens")
            if len(seq) > self.n_ctx:
                raise ContextOverflowError(f"input {i} is {len(seq)} tokens but the context holds {self.n_ctx}")
            self._check_tokens(seq)
        out: list[np.ndarray | None] = [None] * len(seqs)
        pack: list[int] = []   # indices of the sequences in the next batch

        def flush():
            if pack:
                rows = self._hidden([seqs[j] for j in pack], True)
                start = 0
                for j in pack:
                    out[j] = rows[start:start + len(seqs[j])]
                    start += len(seqs[j])
                pack.clear()

        for i, seq in enumerate(seqs):
            if len(seq) > self.n_batch:   # alone, in chunks appended to the cache
                flush()
                chunks = [seq[a:a + self.n_batch] for a in range(0, len(seq), self.n_batch)]
                out[i] = np.concatenate([self._hidden([c], k == 0) for k, c in enumerate(chunks)])
                continue
            if len(pack) == EMBED_SEQS or sum(len(seqs[j]) for j in pack) + len(seq) > self.n_batch:
                flush()
            pack.append(i)
        flush()
        return out

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._close()
