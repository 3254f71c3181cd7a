"""edgespec's own C inference engine (csrc/native/), through the cffi core.

The weights run in C; the tokenizer and metadata come from llama.cpp's
vocabulary-only load of the same file (``Vocab``), so tokens match the llama
backend's exactly. Logits stay in the engine's buffer: ``decode`` returns the
address of its first row. With ``keep_features(True)`` each evaluation also
keeps the hidden states after the final norm of its logits rows (the input
of the vocabulary projection, left in the engine's buffer at no cost):
``features()`` returns them, the target features a draft head reads.

Every token's logits are bit-identical whether it is evaluated alone, in a
chain or in a draft tree (the engine is batch invariant), so speculative
decoding on this backend reproduces plain decoding at any context length.
"""
from __future__ import annotations

import logging
import os
import stat
import threading
from pathlib import Path
from typing import Sequence

import numpy as np

from ..capi import ERR_CAP, Owned, check, check_file, ffi, kernel_set, lib
from ..errors import (BackendError, ContextOverflowError, IncompatibleDraftModelError, InvalidArgumentError,
                      ModelFormatError, UnsupportedModelError)
from .. import moe
from ..config import DEFAULT_BATCH, KERNEL_SETS, EngineConfig
from ..models import registry
from ..models.gguf import GGUFFile
from .base import Backend, context_size, default_threads
from .vocab import Vocab, VocabMixin

# EngineConfig.expert_weights: how MoE experts' weights are served.
_EXPERT_WEIGHTS = {"mapped": lib.ES_EXPERTS_MAPPED, "f32": lib.ES_EXPERTS_F32}
# EngineConfig.cache_type_k / cache_type_v: the KV cache's types (es_context_params.type_k, type_v).
_CACHE_TYPES = {"f16": lib.ES_TYPE_F16, "q8_0": lib.ES_TYPE_Q8_0}

log = logging.getLogger("edgespec")


def select_kernels(name: str) -> None:
    """Make kernel set ``name`` (EngineConfig.kernels; auto: the best this CPU
    runs) the whole process's. A set the CPU lacks is an InvalidArgumentError."""
    if lib.es_kernels_select(name.encode()) != lib.ES_OK:
        raise InvalidArgumentError(f"kernels {name}: not a kernel set this CPU runs "
                                   f"(available: {', '.join(KERNEL_SETS)})")


def model_params(experts: moe.ExpertCache | None, expert_weights: str, repack: str):
    """es_model_params from the native engine's options (EngineConfig's
    expert_weights and repack) and the expert cache settings (None: experts
    served from the mapping)."""
    params = lib.es_model_default_params()
    params.experts = _EXPERT_WEIGHTS[expert_weights]
    params.repack = repack != "off"
    if experts is not None:
        params.expert_cache_bytes = experts.budget_bytes
        params.expert_precision = moe.PRECISIONS.index(experts.precision)
        params.expert_policy = moe.POLICIES.index(experts.policy)
        params.prefetch_depth = experts.prefetch
    return params


_noticed: set[Path] = set()   # repack cache files this process has said it will not use


def _foreign_pack_notice(pack: Path) -> None:
    """Says once per process and file why the repack cache file at ``pack``
    was left alone (es_model_params.repack_cache: ES_PACKED_FOREIGN)."""
    if pack in _noticed:
        return
    _noticed.add(pack)
    try:
        st = pack.lstat()
        what = ("a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file" if not stat.S_ISREG(st.st_mode)
                else f"owned by uid {st.st_uid}" if st.st_uid != os.geteuid()
                else f"writable by others (mode {stat.S_IMODE(st.st_mode):o})")
    except OSError as e:
        what = e.strerror or str(e)
    log.info("%s is %s: the repacked weights are not read from or written to it (repacked in memory)", pack, what)


class NativeModel(Owned):
    """An es_model: the mapped, validated GGUF and its bound weights, with
    its expert cache when ``experts`` asks for one."""

    _free = lib.es_model_free

    def __init__(self, path: Path, experts: moe.ExpertCache | None = None, *, kernels: str = "auto",
                 repack: str = "cached", expert_weights: str = "mapped"):
        if experts is not None:
            with GGUFFile(path) as f:
                arch = f.get("general.architecture")
                if not f.get(f"{arch}.expert_count", 0):
                    raise InvalidArgumentError(f"{Path(path).name} is a dense {arch} model (no experts): an "
                                               "expert cache (--expert-cache) is for mixture-of-experts models")
        params = ffi.new("es_model_params *", model_params(experts, expert_weights, repack))
        sidecar = experts.sidecar(path) if experts is not None else None
        if sidecar is not None:
            keep = ffi.new("char[]", str(sidecar).encode())
            params.expert_sidecar = keep
        select_kernels(kernels)
        cache = registry.repacked_cache(path) if repack == "cached" else None
        if cache is not None:
            keep_cache = ffi.new("char[]", os.fsencode(cache[0]))
            keep_secret = ffi.new("uint8_t[]", cache[1])
            params.repack_cache, params.repack_secret = keep_cache, keep_secret
        out = ffi.new("es_model **")
        err = ffi.new("char[]", ERR_CAP)
        check_file(lib.es_model_load(str(path).encode(), params, out, err, ERR_CAP), err, path,
                   "es_model_load")
        self._ptr = out[0]
        self.arch = ffi.string(lib.es_model_arch(self._ptr)).decode()
        self.n_vocab = lib.es_model_n_vocab(self._ptr)
        self.n_embd = lib.es_model_n_embd(self._ptr)
        self.n_ctx_train = lib.es_model_n_ctx_train(self._ptr)
        self.expert_cache = experts
        self.packed_from = lib.es_model_packed_from(self._ptr)   # enum es_packed_from
        pack = Path(os.fsdecode(ffi.string(lib.es_model_packed_file(self._ptr))))
        if self.packed_from in (lib.ES_PACKED_WRITTEN, lib.ES_PACKED_MAPPED):
            registry.repacked_used(pack, path, written=self.packed_from == lib.ES_PACKED_WRITTEN)
        elif self.packed_from == lib.ES_PACKED_FOREIGN:
            _foreign_pack_notice(pack)

    def expert_stats(self, reset: bool = False) -> dict | None:
        """The expert cache's counters since the last reset (None: no cache)."""
        if self.expert_cache is None:
            return None
        st = ffi.new("es_expert_stats *")
        if lib.es_model_expert_stats(self._ptr, st) != lib.ES_OK:
            return None
        if reset:
            lib.es_model_expert_stats_reset(self._ptr)
        return moe.stats_dict(st)

    def expert_error(self) -> str:
        return ffi.string(lib.es_model_expert_error(self._ptr)).decode("utf-8", "replace")


class NativeContext(Owned):
    """An es_context: thread pool, KV cache and logits (or, with
    ``embeddings``, hidden states) over one NativeModel; several may share it."""

    _free = lib.es_context_free

    n_rows = 0   # logits rows (and features) of the last decode

    def __init__(self, model: NativeModel, *, n_ctx: int, n_batch: int, threads: int,
                 cache_types: tuple[str, str] = ("f16", "f16"), embeddings: bool = False):
        params = lib.es_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_threads = threads
        params.type_k, params.type_v = (_CACHE_TYPES[t] for t in cache_types)
        params.embeddings = embeddings
        out = ffi.new("es_context **")
        status = lib.es_context_init(model.handle, ffi.new("es_context_params *", params), out)
        if status == lib.ES_ERR_UNSUPPORTED:
            raise UnsupportedModelError(f"a {'/'.join(cache_types)} (key/value) KV cache: this model's attention "
                                        "heads are not a multiple of 32 wide (one Q8_0 block); use f16")
        check(status, f"native context of {n_ctx} tokens")
        self._ptr = out[0]
        self.model = model  # must outlive the context
        self.cache_types = cache_types
        self.n_ctx = lib.es_context_n_ctx(self._ptr)
        self.n_batch = lib.es_context_n_batch(self._ptr)
        self.kv_bytes_per_token = lib.es_context_kv_cell_bytes(self._ptr)

    @property
    def n_past(self) -> int:
        return lib.es_context_n_past(self._ptr)

    def decode(self, tokens: list[int], parents: list[int] | None, logits_from: int) -> int:
        """One es_decode; returns the address of the first kept logits row."""
        self._decode(tokens, parents, logits_from)
        return self.logits

    def hidden(self, tokens: list[int], parents: list[int] | None) -> np.ndarray:
        """One es_decode on an embeddings context: the (n, n_embd) hidden states, a copy."""
        self._decode(tokens, parents, 0)
        return self.states()

    def keep_features(self, on: bool) -> None:
        """Keep each decode's logits rows' hidden states (es_context_keep_features)."""
        lib.es_context_keep_features(self._ptr, on)

    def states(self) -> np.ndarray:
        """The last decode's (n_rows, n_embd) hidden states after the final
        norm (an embeddings context's, or the features a context keeps), a
        copy; (0, n_embd) when it kept none."""
        rows, n_embd = lib.es_context_embeddings(self._ptr), self.model.n_embd
        if rows == ffi.NULL:
            return np.zeros((0, n_embd), dtype=np.float32)
        return np.frombuffer(ffi.buffer(rows, self.n_rows * n_embd * 4), dtype=np.float32).reshape(
            self.n_rows, n_embd).copy()

    def _decode(self, tokens: list[int], parents: list[int] | None, logits_from: int) -> None:
        n = len(tokens)
        status = lib.es_decode(self._ptr, ffi.new("es_token[]", tokens),
                               ffi.new("int32_t[]", parents) if parents is not None else ffi.NULL,
                               n, logits_from)
        if status == lib.ES_ERR_CONTEXT_FULL:
            raise ContextOverflowError(f"{self.n_past + n} tokens do not fit the context of {self.n_ctx}")
        _check_decode(status, self.model, "es_decode")
        self.n_rows = n - logits_from

    @property
    def logits(self) -> int:
        """The address of the last decode's first kept logits row."""
        return int(ffi.cast("uintptr_t", lib.es_context_logits(self._ptr)))

    def truncate(self, n_keep: int) -> None:
        check(lib.es_context_truncate(self._ptr, n_keep), f"truncate to {n_keep} tokens")

    def state(self) -> bytes:
        """The KV cache's cells as es_context_state_get writes them."""
        buf = ffi.new("char[]", max(lib.es_context_state_size(self._ptr), 1))
        check(lib.es_context_state_get(self._ptr, buf, len(buf)), "es_context_state_get")
        return ffi.buffer(buf, lib.es_context_state_size(self._ptr))[:]

    def set_state(self, state: bytes, n_past: int) -> None:
        # The state's first 8 bytes are its cache types (es_context_state_get).
        saved = tuple(next((name for name, t in _CACHE_TYPES.items() if t == v), str(v))
                      for v in np.frombuffer(state[:8], dtype="<i4")) if len(state) >= 8 else None
        if saved is not None and saved != self.cache_types:
            raise InvalidArgumentError(f"the saved state holds a {'/'.join(saved)} (key/value) KV cache; this "
                                       f"context keeps {'/'.join(self.cache_types)} (cache_type_k/cache_type_v)")
        check(lib.es_context_state_set(self._ptr, ffi.from_buffer(state), len(state), n_past),
              f"a saved state of {n_past} cells")


class NativeHead(Owned):
    """An es_head: a draft head (EAGLE) over a NativeModel, which must outlive
    it; its own KV cache of (feature, token) rows."""

    _free = lib.es_head_free
    output_rows = 0   # restrict_output: the output layer's rows computed (0: all)

    def __init__(self, model: NativeModel, path: Path, *, n_ctx: int, n_batch: int, threads: int):
        params = lib.es_head_default_params()
        params.n_ctx, params.n_batch, params.n_threads = n_ctx, n_batch, threads
        out = ffi.new("es_head **")
        err = ffi.new("char[]", ERR_CAP)
        status = lib.es_head_init(model.handle, str(path).encode(), ffi.new("es_head_params *", params), out,
                                  err, ERR_CAP)
        if status == lib.ES_ERR_INVALID_ARG and err[0] != b"\0":   # made for another target
            raise IncompatibleDraftModelError(f"{path}: {ffi.string(err).decode('utf-8', 'replace')}")
        check_file(status, err, path, "es_head_init")
        self._ptr = out[0]
        self.model = model
        self.n_vocab, self.n_embd = model.n_vocab, model.n_embd
        self.n_ctx = lib.es_head_n_ctx(self._ptr)
        self.n_batch = lib.es_head_n_batch(self._ptr)
        self.n_rows = 0   # kept rows of the last decode

    @property
    def n_past(self) -> int:
        return lib.es_head_n_past(self._ptr)

    def decode(self, features: np.ndarray, tokens: Sequence[int], logits_from: int) -> int:
        """One es_head_decode of (n, n_embd) float32 ``features`` and n
        ``tokens``; returns the address of the first kept logits row."""
        features = np.ascontiguousarray(features, dtype=np.float32)
        n = len(tokens)
        if features.shape != (n, self.n_embd):
            raise InvalidArgumentError(f"head rows: {features.shape} features for {n} tokens of width {self.n_embd}")
        status = lib.es_head_decode(self._ptr, ffi.cast("float *", features.ctypes.data),
                                    ffi.new("es_token[]", list(tokens)), n, logits_from)
        if status == lib.ES_ERR_CONTEXT_FULL:
            raise ContextOverflowError(f"{self.n_past + n} rows do not fit the head's cache of {self.n_ctx}")
        check(status, "es_head_decode")
        self.n_rows = n - logits_from
        return int(ffi.cast("uintptr_t", lib.es_head_logits(self._ptr)))

    def hidden(self) -> np.ndarray:
        """The last decode's (n_rows, n_embd) layer outputs (the guessed next features), a copy."""
        rows = lib.es_head_hidden(self._ptr)
        if rows == ffi.NULL:
            return np.zeros((0, self.n_embd), dtype=np.float32)
        return np.frombuffer(ffi.buffer(rows, self.n_rows * self.n_embd * 4), dtype=np.float32).reshape(
            self.n_rows, self.n_embd).copy()

    def truncate(self, n_keep: int) -> None:
        check(lib.es_head_truncate(self._ptr, n_keep), f"head truncate to {n_keep} rows")

    def restrict_output(self, ids: Sequence[int]) -> None:
        """Compute the logits of the tokens ``ids`` only (the others -inf)."""
        arr = np.ascontiguousarray(ids, dtype=np.int32)
        check(lib.es_head_set_output_rows(self._ptr, ffi.cast("es_token *", arr.ctypes.data), len(arr)),
              "es_head_set_output_rows")
        self.output_rows = len(arr)


def _check_decode(status: int, model: NativeModel, where: str) -> None:
    if status == lib.ES_ERR_IO:
        raise BackendError(f"{where}: expert weights: {model.expert_error() or 'I/O error'}")
    check(status, where)


class NativeGroup(Owned):
    """An es_group: several NativeContexts' batches evaluated as one (its
    own batch buffers and thread pool), each context's logits then its own."""

    _free = lib.es_group_free

    def __init__(self, model: NativeModel, *, n_ctx: int, n_batch: int, threads: int):
        params = lib.es_group_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_threads = threads
        out = ffi.new("es_group **")
        check(lib.es_group_init(model.handle, ffi.new("es_group_params *", params), out),
              f"native group of {n_batch} tokens")
        self._ptr = out[0]
        self.model = model  # must outlive the group
        self.n_ctx = n_ctx

    def decode(self, members: list[tuple[NativeContext, list[int], list[int] | None, int]]) -> list[int]:
        """One es_decode_group of ``(context, tokens, parents, logits_from)``
        members; returns each context's logits address."""
        seqs = ffi.new("es_group_seq[]", len(members))
        keep = []   # the arrays the call reads
        for seq, (ctx, tokens, parents, logits_from) in zip(seqs, members):
            seq.ctx = ctx.handle
            seq.tokens = t = ffi.new("es_token[]", tokens)
            seq.parents = p = ffi.new("int32_t[]", parents) if parents is not None else ffi.NULL
            seq.n = len(tokens)
            seq.logits_from = logits_from
            keep += [t, p]
        status = lib.es_decode_group(self._ptr, seqs, len(members))
        if status == lib.ES_ERR_CONTEXT_FULL:
            raise ContextOverflowError("a group member's tokens do not fit its context")
        _check_decode(status, self.model, "es_decode_group")
        for ctx, tokens, _, logits_from in members:
            ctx.n_rows = len(tokens) - logits_from
        return [ctx.logits for ctx, *_ in members]


class NativeBackend(VocabMixin, Backend):
    """One es_model; an es_context per KV-cache slot (made on first use) and
    one more, with embeddings, for hidden states."""

    name = "native"
    resizable = True
    embeds = True
    groups = True
    _ctx = _model = _embed_ctx = _vocab = _group = None
    _vocab_loading: tuple[threading.Thread, list] | None = None   # vocab_early's thread and its [result]
    _contexts: list = []
    output_rows = 0   # restrict_output: the output layer's rows computed (0: all)
    features_kept = False   # keep_features: every evaluation keeps its rows' hidden states

    def __init__(self, path: Path, *, n_ctx: int | None = None, n_batch: int = DEFAULT_BATCH,
                 threads: int | None = None, n_seq: int = 1, slots: int = 1,
                 ctx_extend: bool = False, experts: moe.ExpertCache | None = None,
                 kernels: str | None = None, repack: str | None = None, expert_weights: str | None = None,
                 cache_type_k: str = "f16", cache_type_v: str = "f16", verbose: bool = False,
                 vocab_early: bool = False):
        # n_seq does not apply: draft trees need no sequences here (a tree is
        # one batch with parents). kernels, repack, expert_weights: EngineConfig's
        # (None: its default, the environment's); cache_type_k, cache_type_v:
        # every slot's (and the hidden states') KV cache types.
        # vocab_early: build the tokenizer in a thread while the model loads
        # (es_model_load runs without the GIL): a target needs it at once,
        # a draft model drafting in its target's ids never does.
        super().__init__(slots)
        self.path = Path(path)
        self._verbose = verbose
        self._vocab_lock = threading.Lock()
        if vocab_early:
            result: list = []
            thread = threading.Thread(target=self._load_vocab_into, args=(result,), daemon=True)
            self._vocab_loading = (thread, result)
            thread.start()
        try:
            self.cache_types = (EngineConfig.check("cache_type_k", cache_type_k),
                                EngineConfig.check("cache_type_v", cache_type_v))
            given = {"kernels": kernels, "repack": repack, "expert_weights": expert_weights}
            self._model = NativeModel(self.path, experts, **{
                name: EngineConfig.default(name) if value is None else EngineConfig.check(name, value)
                for name, value in given.items()})
        except BaseException:
            self.close()
            raise
        self._contexts = [None] * slots
        self.ctx_extend = ctx_extend
        try:
            self.threads = threads or default_threads()
            n_ctx = context_size(n_ctx, self._model.n_ctx_train, extend=ctx_extend)
            self._check_kv_memory(n_ctx)
            self._ctx = self._contexts[0] = self._new_context(n_ctx, n_batch)
        except BaseException:
            self.close()
            raise
        self.n_vocab = self._model.n_vocab
        self.n_embd = self._model.n_embd
        self.n_ctx_train = self._model.n_ctx_train
        self.arch = self._model.arch
        self.n_ctx = self._ctx.n_ctx
        self.n_batch = self._ctx.n_batch
        self.kv_bytes_per_token = self._ctx.kv_bytes_per_token

    @property
    def vocab(self) -> Vocab:
        """The vocabulary (tokenizer, pieces, special tokens), loaded on
        first use, or while the model loaded (vocab_early): a draft model that
        drafts in its target's token ids never needs it, and its load takes
        0.2-0.4 s on a 150k-token vocabulary."""
        with self._vocab_lock:
            if self._vocab is None:
                self._check_open()
                vocab = self._loaded_vocab()
                if vocab.n_vocab != self._model.n_vocab:
                    vocab.close()
                    raise ModelFormatError(f"{self.path}: the vocabulary has {vocab.n_vocab} tokens, "
                                           f"the embeddings {self._model.n_vocab}")
                self._vocab = vocab
            return self._vocab

    def _load_vocab_into(self, result: list) -> None:
        """The early load's thread: [vocab] or [the exception it raised]."""
        try:
            result.append(Vocab.load(self.path, verbose=self._verbose))
        except BaseException as e:
            result.append(e)

    def _early_vocab(self):
        """The early load's outcome, waited for: its Vocab, the exception it
        raised, or None where none is pending."""
        if self._vocab_loading is None:
            return None
        thread, result = self._vocab_loading
        self._vocab_loading = None
        thread.join()
        return result[0]

    def _loaded_vocab(self) -> Vocab:
        """The early load's vocabulary, else one loaded now."""
        early = self._early_vocab()
        if isinstance(early, BaseException):
            raise early
        return early if early is not None else Vocab.load(self.path, verbose=self._verbose)

    @property
    def packed_from(self) -> int:
        """Where the repacked weights came from (enum es_packed_from: repacked
        at this load, written to the cache, mapped from it, or none)."""
        return self._model.packed_from

    @property
    def kernels(self) -> str:
        """The kernel set the weights' products run on (es_kernels_name)."""
        return kernel_set()

    def speed_variant(self) -> tuple[str, str]:
        # An expert cache's batches read the union of their tokens' experts
        # from disk: a curve of its own for each setting.
        cache = self.expert_cache
        experts = (f":experts-{cache.budget_mb}MB-{cache.precision}-{cache.policy}-{cache.prefetch}:compute"
                   if cache is not None else "")
        return f"@{self.kernels}", experts + (f":rows-{self.output_rows}" if self.output_rows else "")

    def _new_context(self, n_ctx: int, n_batch: int, embeddings: bool = False) -> NativeContext:
        ctx = NativeContext(self._model, n_ctx=n_ctx, n_batch=n_batch, threads=self.threads,
                            cache_types=self.cache_types, embeddings=embeddings)
        if not embeddings:
            ctx.keep_features(self.features_kept)
        return ctx

    def keep_features(self, on: bool = True) -> None:
        """From the next evaluation on, keep beside the logits rows of every
        slot's evaluations their hidden states after the final norm (the
        target features of a draft head, EAGLE's): ``features`` returns them.
        Off when opened; they cost nothing (the vocabulary projection's input,
        left where it is; a group evaluation copies each slot's rows)."""
        self._check_open()
        self.features_kept = bool(on)
        for ctx in self._contexts:
            if ctx is not None:
                ctx.keep_features(self.features_kept)

    def features(self, slot: int | None = None) -> np.ndarray:
        """The (n_rows, n_embd) float32 hidden states after the final norm of
        the rows whose logits the selected slot's (or ``slot``'s) last
        evaluation returned, in the same order (``decode``: ``tokens[logits_from:]``;
        ``decode_tree`` and ``decode_group``: the root's, then the draft's), a
        copy. Bit-identical to ``hidden_states`` of the same tokens after the
        same cache, whatever the batch. InvalidArgumentError unless
        ``keep_features`` is on."""
        self._check_open()
        if not self.features_kept:
            raise InvalidArgumentError("the native backend keeps no features: call keep_features() first")
        ctx = self._ctx if slot is None else self._contexts[slot] if 0 <= slot < self.n_slots else None
        if ctx is None:
            raise InvalidArgumentError(f"slot {slot} has no context (slots: {self.n_slots})")
        return ctx.states()

    # -- primitives (base.Backend owns the protocol) -------------------------

    def _evaluate(self, tokens: list[int], positions: list[int], parents: list[int] | None,
                  logits_from: int) -> int:
        # es_decode derives the positions from the parents itself.
        return self._ctx.decode(tokens, parents, logits_from)

    def _truncate(self, n_keep: int) -> None:
        self._ctx.truncate(n_keep)

    def _evaluate_group(self, batches: list[tuple[int, list[int], list[int] | None, int]]) -> list[int]:
        # The group's attention scratch covers the largest member context;
        # made when first used, again for a larger one.
        n_ctx = max(self._contexts[slot].n_ctx for slot, *_ in batches)
        if self._group is None or self._group.n_ctx < n_ctx:
            if self._group is not None:
                self._group.close()
                self._group = None
            self._group = NativeGroup(self._model, n_ctx=n_ctx, n_batch=self.n_batch, threads=self.threads)
        return self._group.decode([(self._contexts[slot], tokens, parents, logits_from)
                                   for slot, tokens, parents, logits_from in batches])

    def _select_slot(self, i: int, n_ctx: int) -> None:
        old = self._contexts[i]
        if old is None or (self._sizes[i] or self.n_ctx) != n_ctx:
            self._check_kv_memory(n_ctx)
            self._contexts[i] = self._new_context(n_ctx, self.n_batch)
            if old is not None:   # another size: made again
                old.close()
        self._ctx = self._contexts[i]

    def _state(self) -> bytes:
        return self._ctx.state()

    def _set_state(self, state: bytes, n_tokens: int) -> None:
        self._ctx.set_state(state, n_tokens)

    def _hidden(self, pieces: list[list[int]], fresh: bool) -> np.ndarray:
        if self._embed_ctx is None:
            self._check_kv_memory(self.n_ctx)
            self._embed_ctx = self._new_context(self.n_ctx, self.n_batch, embeddings=True)
        ctx = self._embed_ctx
        tokens = [t for p in pieces for t in p]
        if not fresh:
            return ctx.hidden(tokens, None)
        ctx.truncate(0)
        # Several sequences in one batch: each starts a new root (parent -1 at
        # position 0 of the empty cache) and sees only its own tokens.
        parents, start = [], 0
        for p in pieces:
            parents += [-1, *range(start, start + len(p) - 1)]
            start += len(p)
        return ctx.hidden(tokens, parents)

    def expert_stats(self, reset: bool = False) -> dict | None:
        self._check_open()
        return self._model.expert_stats(reset)

    def restrict_output(self, ids: Sequence[int]) -> None:
        """Compute the logits of the tokens ``ids`` only (a draft head trimmed
        to the target's most used tokens); the others come out as -inf, so
        logits rows stay n_vocab wide. An empty ``ids`` computes every row again."""
        self._check_open()
        arr = np.ascontiguousarray(ids, dtype=np.int32)
        check(lib.es_model_set_output_rows(self._model.handle, ffi.cast("es_token *", arr.ctypes.data), len(arr)),
              "es_model_set_output_rows")
        self.output_rows = len(arr)

    def open_head(self, path: Path, n_ctx: int | None = None) -> NativeHead:
        """A draft head (``es_head``) for this model from the head file at
        ``path``: IncompatibleDraftModelError for a head made for another
        target (both named), ModelFormatError for a damaged file. Its cache
        holds ``n_ctx`` rows (default: this backend's context)."""
        self._check_open()
        return NativeHead(self._model, Path(path), n_ctx=n_ctx or self.n_ctx, n_batch=self.n_batch,
                          threads=self.threads)

    @property
    def expert_cache(self) -> moe.ExpertCache | None:
        """The expert cache's settings (None: experts from the mapping)."""
        return self._model.expert_cache if self._model is not None else None

    def _close(self) -> None:
        for c in (self._group, self._embed_ctx, *self._contexts):
            if c is not None:
                c.close()
        self._ctx = self._embed_ctx = self._group = None
        self._contexts = []
        early = self._early_vocab()   # closed before its vocabulary was asked for
        if early is not None and not isinstance(early, BaseException):
            early.close()
        if self._vocab is not None:
            self._vocab.close()
            self._vocab = None
        if self._model is not None:
            self._model.close()
            self._model = None


BACKEND = NativeBackend
