"""llama.cpp backend, through llama-cpp-python's low-level C API bindings.

Only llama.cpp's own objects are touched here: model, context, KV memory and
one preallocated batch. Logits stay in llama.cpp's buffer; callers get the
address of the first output row and hand it to the C core. The KV-cache
protocol (chunking, trees, rollback) is base.Backend's.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp.llama_cpp as lc

from ..errors import BackendError, ModelFormatError
from . import default_threads
from .base import Backend, context_size
from .vocab import Vocab, VocabMixin, init_llama


class LlamaBackend(VocabMixin, Backend):
    name = "llama"
    _model = _ctx = _batch = None  # llama.cpp objects, freed by close() in reverse order
    _n_tree_seqs = 1               # KV sequences the last draft tree used

    def __init__(self, path: Path, *, n_ctx: int | None = None, n_batch: int = 512,
                 threads: int | None = None, gpu_layers: int = 0, n_seq: int = 1,
                 swa_full: bool = True, ctx_extend: bool = False, verbose: bool = False):
        super().__init__()
        init_llama(verbose)
        self.path = Path(path)

        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = gpu_layers
        self._model = lc.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self._model:
            raise ModelFormatError(f"{self.path}: llama.cpp could not load this model "
                                   "(unsupported architecture or damaged file)")
        self.vocab = Vocab(self._model)
        self.n_vocab = self.vocab.n_vocab
        self.n_ctx_train = lc.llama_model_n_ctx_train(self._model)
        try:
            n_ctx = context_size(n_ctx, self.n_ctx_train, extend=ctx_extend)
            self._check_kv_memory(n_ctx)
        except BaseException:
            self.close()
            raise

        threads = threads or default_threads()
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.no_perf = True
        # A full-size sliding-window cache lets rejected draft positions be
        # removed again (llama.cpp cannot roll back a trimmed SWA cache).
        cparams.swa_full = swa_full
        # Draft-tree branches are sequences sharing the prefix's cells; a unified
        # cache makes llama_memory_seq_cp a tag on those cells, not a copy.
        cparams.kv_unified = True
        self._ctx = lc.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            self.close()
            raise BackendError(f"llama.cpp could not create a context of {n_ctx} tokens")
        self._mem = lc.llama_get_memory(self._ctx)
        self.n_ctx = lc.llama_n_ctx(self._ctx)
        # llama.cpp caps the batch at the context size it was asked for.
        self.n_batch = lc.llama_n_batch(self._ctx)
        self.n_seq = n_seq
        self.threads = threads
        self._batch = lc.llama_batch_init(self.n_batch, 0, n_seq)

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

    def _close(self) -> None:
        if self._batch is not None:
            lc.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            lc.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            lc.llama_model_free(self._model)
            self._model = None


BACKEND = LlamaBackend
