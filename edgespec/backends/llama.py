"""llama.cpp backend, through llama-cpp-python's low-level C API bindings.

Only llama.cpp's own objects are touched here: one model, a context per
KV-cache slot (made on first use) and one more with embeddings, their KV
memory and preallocated batches. Logits stay in llama.cpp's buffer; callers get the
address of the first output row and hand it to the C core. The KV-cache
protocol (chunking, trees, rollback) is base.Backend's.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp.llama_cpp as lc
import numpy as np

from ..config import DEFAULT_BATCH, EngineConfig
from ..errors import BackendError, InvalidArgumentError, ModelFormatError
from ..models.gguf import GGUFFile
from .base import Backend, EMBED_SEQS, context_size, default_threads
from .llama_vocab import LlamaVocab, init_llama, model_params
from .vocab import Vocab, VocabMixin


# ggml's CPU buffers hold tensors at multiples of this many bytes (TENSOR_ALIGNMENT).
GGML_ALIGNMENT = 32
# EngineConfig.cache_type_k / cache_type_v as llama.cpp's type_k / type_v.
_CACHE_TYPES = {"f16": lc.GGML_TYPE_F16, "q8_0": lc.GGML_TYPE_Q8_0}


def _load_mode(path: Path) -> int:
    """How llama.cpp loads ``path``: mapped, unless the file's tensors may sit
    at offsets that are not multiples of 32 bytes (general.alignment 1..16,
    valid GGUF), which ggml asserts (aborts the process) on when it maps them
    in place; those are read into aligned buffers instead."""
    with GGUFFile(path) as f:
        mappable = f.alignment % GGML_ALIGNMENT == 0
    return lc.LLAMA_LOAD_MODE_AUTO if mappable else lc.LLAMA_LOAD_MODE_NONE


def _load(path: Path, **params):
    """A llama_model of ``path`` (the caller frees it); ModelFormatError when llama.cpp refuses it."""
    model = lc.llama_model_load_from_file(str(path).encode(), model_params(**params))
    if not model:
        raise ModelFormatError(f"{path}: llama.cpp could not load this model "
                               "(unsupported architecture or damaged file)")
    return model


def check_loadable(path: Path) -> None:
    """llama.cpp reads ``path`` as it would load it, but not its tensors'
    data (``no_alloc``): hyperparameters, vocabulary and tensor table, the
    checks both backends pass through; then its tokenizer is tried on a text
    of letters, digits, punctuation and a non-ASCII letter.
    ModelFormatError naming what failed."""
    init_llama(False)
    model = _load(path, no_alloc=True, load_mode=lc.LLAMA_LOAD_MODE_NONE)  # mapping asserts under no_alloc
    try:
        LlamaVocab(model).tokenize("Hello, world: 42 caf\u00e9!")
    finally:
        lc.llama_model_free(model)


class LlamaBackend(VocabMixin, Backend):
    name = "llama"
    resizable = True
    embeds = True
    # llama.cpp objects, freed by close() in reverse order
    _model = _ctx = _batch = _embed_ctx = _embed_batch = vocab = None
    _contexts: list = []
    _n_tree_seqs = 1               # KV sequences the last draft tree used

    def __init__(self, path: Path, *, n_ctx: int | None = None, n_batch: int = DEFAULT_BATCH,
                 threads: int | None = None, gpu_layers: int = 0, n_seq: int = 1, slots: int = 1,
                 swa_full: bool = True, ctx_extend: bool = False, cache_type_k: str = "f16",
                 cache_type_v: str = "f16", verbose: bool = False):
        super().__init__(slots)
        self.cache_types = (EngineConfig.check("cache_type_k", cache_type_k),
                            EngineConfig.check("cache_type_v", cache_type_v))
        self._contexts = [None] * slots
        init_llama(verbose)
        self.path = Path(path)

        self._model = _load(self.path, n_gpu_layers=gpu_layers, load_mode=_load_mode(self.path))
        self.vocab = Vocab.load(self.path, verbose=verbose)
        self.n_vocab = self.vocab.n_vocab
        self.n_embd = lc.llama_model_n_embd(self._model)
        self.n_ctx_train = lc.llama_model_n_ctx_train(self._model)
        self.threads = threads or default_threads()
        self._swa_full = swa_full
        self.ctx_extend = ctx_extend
        try:
            n_ctx = context_size(n_ctx, self.n_ctx_train, extend=ctx_extend)
            self._check_kv_memory(n_ctx)
            self._ctx = self._contexts[0] = self._new_context(n_ctx, n_batch, n_seq)
        except BaseException:
            self.close()
            raise
        self._mem = lc.llama_get_memory(self._ctx)
        # llama.cpp pads the cache (to a multiple of 256): the context is the
        # one asked for, as on the native backend, not the padded size.
        self.n_ctx = min(n_ctx, lc.llama_n_ctx(self._ctx))
        # llama.cpp caps the batch at the context size it was asked for.
        self.n_batch = lc.llama_n_batch(self._ctx)
        self.n_seq = n_seq
        self._batch = lc.llama_batch_init(self.n_batch, 0, n_seq)

    def _new_context(self, n_ctx: int, n_batch: int, n_seq: int, embeddings: bool = False):
        """A llama_context on the model (the caller frees it)."""
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq
        cparams.n_threads = self.threads
        cparams.n_threads_batch = self.threads
        cparams.no_perf = True
        # A full-size sliding-window cache lets rejected draft positions be
        # removed again (llama.cpp cannot roll back a trimmed SWA cache).
        cparams.swa_full = self._swa_full
        # A quantized V cache needs flash attention, which llama.cpp's default (auto) turns on where it can.
        cparams.type_k, cparams.type_v = (_CACHE_TYPES[t] for t in self.cache_types)
        # Draft-tree branches are sequences sharing the prefix's cells; a unified
        # cache makes llama_memory_seq_cp a tag on those cells, not a copy.
        # (Embeddings: sequences of a batch take cells anywhere in the cache.)
        cparams.kv_unified = True
        if embeddings:
            # Every token's hidden state after the final norm; pooling is the engine's.
            cparams.embeddings = True
            cparams.pooling_type = lc.LLAMA_POOLING_TYPE_NONE
        ctx = lc.llama_init_from_model(self._model, cparams)
        if not ctx:
            raise BackendError(f"llama.cpp could not create a context of {n_ctx} tokens")
        return ctx

    # -- primitives (base.Backend owns the protocol) -------------------------

    def _evaluate(self, tokens: list[int], positions: list[int], parents: list[int] | None,
                  logits_from: int) -> int:
        """One llama_decode. A tree's branches are KV sequences: each leaf's
        path is one (ids 0..n_leaves-1), sharing the cache's cells and the
        tokens above the first branching; returns the address of the rows of
        tokens[logits_from:]."""
        n = len(tokens)
        start = self.n_past
        if parents is None:
            seqs = [(0,)] * n
        else:
            seqs = self._tree_sequences(parents)
            for s in range(1, self._n_tree_seqs):
                lc.llama_memory_seq_cp(self._mem, 0, s, -1, start)
        b = self._batch
        for i in range(n):
            b.token[i] = tokens[i]
            b.pos[i] = positions[i]
            b.n_seq_id[i] = len(seqs[i])
            for k, sid in enumerate(seqs[i]):
                b.seq_id[i][k] = sid
            b.logits[i] = i >= logits_from
        b.n_tokens = n
        rc = lc.llama_decode(self._ctx, b)
        if rc != 0:
            raise BackendError(f"llama_decode failed with status {rc} "
                               f"({'no KV slot: context full' if rc == 1 else 'see the llama.cpp log (--verbose)'})")
        return ctypes.addressof(lc.llama_get_logits(self._ctx).contents)

    def _tree_sequences(self, parents: list[int]) -> list[tuple[int, ...]]:
        """The sequence ids of each batch token: one sequence per leaf, and a
        token belongs to the sequences of every leaf below it."""
        n = len(parents)
        has_child = [False] * n
        for p in parents:
            if p >= 0:
                has_child[p] = True
        leaves = [i for i in range(n) if not has_child[i]]
        if len(leaves) > self.n_seq:
            raise BackendError(f"a draft tree with {len(leaves)} leaves needs more than {self.n_seq} sequences")
        seqs: list[list[int]] = [[] for _ in range(n)]
        for s, leaf in enumerate(leaves):
            node = leaf
            while node >= 0:
                seqs[node].append(s)
                node = parents[node]
        self._n_tree_seqs = len(leaves)
        return [tuple(ids) for ids in seqs]

    def _truncate(self, n_keep: int) -> None:
        """Drop positions >= n_keep from every sequence, and the tree's extra sequences."""
        if not lc.llama_memory_seq_rm(self._mem, -1, n_keep, -1):
            raise BackendError(f"llama.cpp cannot roll the KV cache back to {n_keep} tokens")
        for s in range(1, self._n_tree_seqs):
            lc.llama_memory_seq_rm(self._mem, s, -1, -1)
        self._n_tree_seqs = 1

    def _select_slot(self, i: int, n_ctx: int) -> None:
        old = self._contexts[i]
        if old is None or (self._sizes[i] or self.n_ctx) != n_ctx:
            self._check_kv_memory(n_ctx)
            self._contexts[i] = self._new_context(n_ctx, self.n_batch, self.n_seq)
            if old is not None:   # another size: made again
                lc.llama_free(old)
        self._ctx = self._contexts[i]
        self._mem = lc.llama_get_memory(self._ctx)

    def _state(self) -> bytes:
        n = lc.llama_state_seq_get_size(self._ctx, 0)
        buf = (ctypes.c_uint8 * n)()
        if lc.llama_state_seq_get_data(self._ctx, buf, n, 0) != n:
            raise BackendError("llama.cpp could not copy the KV cache's state")
        return bytes(buf)

    def _set_state(self, state: bytes, n_tokens: int) -> None:
        lc.llama_memory_seq_rm(self._mem, -1, 0, -1)
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if lc.llama_state_seq_set_data(self._ctx, buf, len(state), 0) == 0:
            raise InvalidArgumentError("llama.cpp refused the saved KV cache state (another model or context)")
        if lc.llama_memory_seq_pos_max(self._mem, 0) + 1 != n_tokens:
            lc.llama_memory_seq_rm(self._mem, -1, 0, -1)
            raise InvalidArgumentError(f"the saved KV cache state does not hold its {n_tokens} tokens")

    def _hidden(self, pieces: list[list[int]], fresh: bool) -> np.ndarray:
        if self._embed_ctx is None:
            self._check_kv_memory(self.n_ctx)
            self._embed_ctx = self._new_context(self.n_ctx, self.n_batch, EMBED_SEQS, embeddings=True)
            self._embed_batch = lc.llama_batch_init(self.n_batch, 0, 1)
        ctx, b = self._embed_ctx, self._embed_batch
        mem = lc.llama_get_memory(ctx)
        if fresh:
            lc.llama_memory_clear(mem, True)
            start = 0
        else:  # one sequence, continued
            start = lc.llama_memory_seq_pos_max(mem, 0) + 1
        i = 0
        for seq, piece in enumerate(pieces):
            for pos, token in enumerate(piece):
                b.token[i] = token
                b.pos[i] = start + pos
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq
                b.logits[i] = True
                i += 1
        b.n_tokens = i
        rc = lc.llama_decode(ctx, b)
        if rc != 0:
            raise BackendError(f"llama_decode (embeddings) failed with status {rc}")
        rows = lc.llama_get_embeddings(ctx)
        return np.ctypeslib.as_array(rows, shape=(i, self.n_embd)).copy()

    def _close(self) -> None:
        for b in (self._embed_batch, self._batch):
            if b is not None:
                lc.llama_batch_free(b)
        self._batch = self._embed_batch = None
        for c in (self._embed_ctx, *self._contexts):
            if c:
                lc.llama_free(c)
        self._ctx = self._embed_ctx = None
        self._contexts = []
        if self._model:
            lc.llama_model_free(self._model)
            self._model = None
        if self.vocab is not None:
            self.vocab.close()


BACKEND = LlamaBackend
