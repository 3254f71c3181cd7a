"""llama.cpp backend, through llama-cpp-python's low-level C API bindings.

Only llama.cpp's own objects are touched here: model, context, KV memory and
one preallocated batch. Logits stay in llama.cpp's buffer; callers get the
address of the first output row and hand it to the C core, so no
vocabulary-sized row is ever copied into Python.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp.llama_cpp as lc

from ..capi import Closing
from ..errors import BackendError, ContextOverflowError, ModelFormatError
from . import default_threads
from .vocab import Vocab, VocabMixin, init_llama


class LlamaBackend(VocabMixin, Closing):
    name = "llama"
    _model = _ctx = _batch = None  # llama.cpp objects, freed by close() in reverse order

    def __init__(self, path: Path, *, n_ctx: int = 4096, n_batch: int = 512,
                 threads: int | None = None, gpu_layers: int = 0, n_seq: int = 1,
                 swa_full: bool = True, verbose: bool = False):
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

    # -- evaluation ---------------------------------------------------------

    def decode(self, tokens: list[int], start: int, *, logits_from: int | None = None,
               seq_id: int = 0) -> int:
        """Evaluate ``tokens`` at positions ``start...`` of sequence ``seq_id``.

        Returns the address of the first logits row, (n_rows, n_vocab) float32
        in llama.cpp's buffer: one row per token of ``tokens[logits_from:]``,
        or the last token's row alone when ``logits_from`` is None. Valid
        until the next decode.
        """
        n = len(tokens)
        if n == 0:
            raise BackendError("decode of an empty batch")
        if start + n > self.n_ctx:
            raise ContextOverflowError(f"{start + n} tokens do not fit the context of {self.n_ctx}")
        first_row = n - 1 if logits_from is None else logits_from
        if n - first_row > self.n_batch or (logits_from is not None and n > self.n_batch):
            raise BackendError(f"{n} tokens with several logits rows do not fit one batch of {self.n_batch}")
        b = self._batch
        done = 0
        while done < n:  # prefill in chunks of n_batch
            m = min(self.n_batch, n - done)
            for i in range(m):
                b.token[i] = tokens[done + i]
                b.pos[i] = start + done + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq_id
                b.logits[i] = done + i >= first_row
            b.n_tokens = m
            self._run(b)
            done += m
        return ctypes.addressof(lc.llama_get_logits(self._ctx).contents)

    def _run(self, batch) -> None:
        rc = lc.llama_decode(self._ctx, batch)
        if rc != 0:
            raise BackendError(f"llama_decode failed with status {rc} "
                               f"({'no KV slot: context full' if rc == 1 else 'see the llama.cpp log (--verbose)'})")

    def decode_tree(self, prefix: list[int], tokens: list[int], parents: list[int], start: int) -> int:
        """Evaluate ``prefix`` (ending with the root token) from position
        ``start`` and a draft tree below the root, in one batch.

        Each leaf's path is its own sequence (ids 0..n_leaves-1); the prefix
        belongs to all of them. Returns the address of (n_nodes + 1, n_vocab)
        logits rows: the root's, then the nodes' in node order. Follow with
        ``drop_tree``.
        """
        n = len(tokens)
        children = [0] * n
        depth = [0] * n
        for i, p in enumerate(parents):
            depth[i] = 1 if p < 0 else depth[p] + 1
            if p >= 0:
                children[p] += 1
        leaves = [i for i in range(n) if children[i] == 0]
        if len(leaves) > self.n_seq:
            raise BackendError(f"a draft tree with {len(leaves)} leaves needs more than {self.n_seq} sequences")
        root_pos = start + len(prefix) - 1
        if root_pos + 1 + max(depth) > self.n_ctx or len(prefix) + n > self.n_batch:
            raise ContextOverflowError("the draft tree does not fit the context or the batch")
        seqs: list[list[int]] = [[] for _ in range(n)]
        for b, leaf in enumerate(leaves):
            node = leaf
            while node >= 0:
                seqs[node].append(b)
                node = parents[node]
        for b in range(1, len(leaves)):
            lc.llama_memory_seq_cp(self._mem, 0, b, -1, start)
        every = range(len(leaves))
        entries = [(t, start + i, every, i == len(prefix) - 1) for i, t in enumerate(prefix)]
        entries += [(tokens[j], root_pos + depth[j], seqs[j], True) for j in range(n)]
        batch = self._batch
        for i, (tok, pos, ids, want_logits) in enumerate(entries):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = len(ids)
            for k, sid in enumerate(ids):
                batch.seq_id[i][k] = sid
            batch.logits[i] = want_logits
        batch.n_tokens = len(entries)
        self._tree_leaves = len(leaves)
        self._run(batch)
        return ctypes.addressof(lc.llama_get_logits(self._ctx).contents)

    def drop_tree(self, n_keep: int) -> None:
        """After decode_tree: keep positions < n_keep (the prefix) in sequence 0
        and drop every tree node. Accepted nodes are evaluated again with the
        next batch: llama.cpp's results depend on the order of KV cells, and
        keeping the accepted nodes would leave them out of order."""
        lc.llama_memory_seq_rm(self._mem, -1, n_keep, -1)
        for b in range(1, self._tree_leaves):
            lc.llama_memory_seq_rm(self._mem, b, -1, -1)

    def truncate(self, n_keep: int, seq_id: int = 0) -> None:
        """Drop positions >= n_keep from the KV cache of ``seq_id``."""
        if not lc.llama_memory_seq_rm(self._mem, seq_id, n_keep, -1):
            raise BackendError(f"llama.cpp cannot roll the KV cache back to {n_keep} tokens")

    def clear(self) -> None:
        lc.llama_memory_clear(self._mem, True)

    def close(self) -> None:
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
