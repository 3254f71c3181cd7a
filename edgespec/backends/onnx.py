"""ONNX Runtime backend: a decoder graph from ``edgespec export-onnx`` on an
execution provider (CPU, or an NPU/GPU through QNN, OpenVINO, DirectML, CoreML, CUDA).

The KV cache is explicit: one (1, n_head_kv, P, head_dim) float16 key and value array
per layer, fed to the graph as ``past.*`` and replaced by its ``present.*``
outputs. Rolling back is slicing. Every call passes an additive attention
mask, so a draft tree is one call: each node sees the cache, the prefix and
its own ancestors. Logits come back as a C-contiguous float32 numpy array that
this object keeps alive until the next call; callers get its address.

Tokenizer, metadata and chat template come from the source GGUF through
llama.cpp's vocabulary (edgespec.backends.vocab), token for token the llama
backend's.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..models import registry
from . import onnx_export
from ..capi import Closing
from ..errors import BackendError, ContextOverflowError, InvalidArgumentError, ModelFormatError
from . import default_threads
from .vocab import Vocab, VocabMixin

# --ep name -> ONNX Runtime execution provider
PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "qnn": "QNNExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "dml": "DmlExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
}
MASKED = np.float32(-np.inf)


def provider(ep: str) -> str:
    """The installed ONNX Runtime provider for ``--ep``; a clear error otherwise."""
    import onnxruntime as ort

    if ep not in PROVIDERS:
        raise InvalidArgumentError(f"unknown execution provider '{ep}' (known: {', '.join(PROVIDERS)})")
    installed = ort.get_available_providers()
    if PROVIDERS[ep] not in installed:
        have = [name for name, p in PROVIDERS.items() if p in installed]
        raise InvalidArgumentError(
            f"execution provider '{ep}' ({PROVIDERS[ep]}) is not in this onnxruntime build; "
            f"available: {', '.join(have)} (install the onnxruntime package built for it, "
            "e.g. onnxruntime-qnn, onnxruntime-openvino, onnxruntime-directml, onnxruntime-gpu)")
    return PROVIDERS[ep]


def resolve_model(ref: str, *, weights: str = "int4") -> Path:
    """An exported folder, or a model reference (built-in name, GGUF path,
    hf:...) exported into the cache on first use. Returns the folder."""
    path = Path(ref).expanduser()
    if path.is_dir():
        onnx_export.load_export(path)  # fails clearly on a folder that is not an export
        return path
    gguf = registry.model_path_checked(ref)
    return onnx_export.cached_export(gguf, onnx_export.check_weights(weights), model_ref=ref)


class OnnxBackend(VocabMixin, Closing):
    name = "onnx"
    _session = None
    vocab = None

    def __init__(self, path: Path, *, n_ctx: int = 4096, n_batch: int = 512,
                 threads: int | None = None, ep: str | None = None, verbose: bool = False):
        import onnxruntime as ort

        self.ep = ep = ep or "cpu"
        providers = [provider(ep)] + (["CPUExecutionProvider"] if ep != "cpu" else [])
        self.folder = Path(path)
        meta = onnx_export.load_export(self.folder)
        cfg = meta["config"]
        self.path = self.folder / meta["model"]
        self.weights = meta["weights"]
        source = Path(meta["source"]["gguf"])
        if not source.is_file():
            raise ModelFormatError(f"{self.folder}: its source GGUF {source} (tokenizer and metadata) "
                                   "is missing; export the model again")
        self.gguf_path = source
        self.vocab = Vocab.load(source, verbose=verbose)
        self.n_vocab = cfg["n_vocab"]
        if self.vocab.n_vocab != self.n_vocab:
            raise ModelFormatError(f"{self.folder}: the graph has {self.n_vocab} logits but its source GGUF "
                                   f"{self.vocab.n_vocab} tokens; export the model again")
        self.n_ctx_train = cfg["n_ctx_train"]
        self.threads = threads or default_threads()
        self.n_layer = cfg["n_layer"]
        self.static = meta["static"]
        if self.static:
            # Fixed shapes: calls of `seq` tokens (padded), a cache of `ctx` slots of
            # which the last `seq` take a call's padding.
            self._chunk = self.static["seq"]
            self.n_ctx = min(n_ctx, self.static["ctx"] - self._chunk)
            self._kv_shape = (1, cfg["n_head_kv"], self.static["ctx"], cfg["head_dim"])
        else:
            self.n_ctx = min(n_ctx, self.n_ctx_train)  # RoPE tables cover the training context
            self._kv_shape = (1, cfg["n_head_kv"], 0, cfg["head_dim"])
        self.n_batch = min(n_batch, self.n_ctx)
        if not self.static:
            self._chunk = self.n_batch

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.log_severity_level = 0 if verbose else 3
        try:
            self._session = ort.InferenceSession(str(self.path), opts, providers=providers)
        except Exception as e:
            self.close()
            raise BackendError(f"onnxruntime could not load {self.path} on {ep}: "
                               f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from e
        self._outputs = ["logits"] + [f"present.{i}.{k}" for i in range(self.n_layer) for k in ("key", "value")]
        self.clear()

    # -- evaluation ---------------------------------------------------------

    def _forward(self, tokens: list[int], positions: list[int], bias: np.ndarray, first_row: int) -> int:
        """Evaluate ``tokens`` into cache slots n_past... under ``bias`` (n, n_past + n):
        row i may attend to the slots where it is 0. Runs in chunks (n_batch
        tokens, or the static graph's fixed width, padded); keeps the logits of
        rows >= first_row, C-contiguous float32 (n - first_row, n_vocab), alive
        until the next call, and returns their address."""
        start, n = self.n_past, len(tokens)
        kept = []
        for a in range(0, n, self._chunk):
            b = min(a + self._chunk, n)
            rows = np.arange(max(first_row - a, 0), b - a, dtype=np.int64)
            if len(rows) == 0:
                rows = np.array([b - a - 1], dtype=np.int64)  # a chunk before the wanted rows
            logits = self._run(tokens[a:b], positions[a:b], bias[a:b, :start + b], rows, start + a)
            if b > first_row:
                kept.append(logits)
        self._logits = kept[0] if len(kept) == 1 else np.concatenate(kept)
        return self._logits.ctypes.data

    def _run(self, tokens, positions, bias: np.ndarray, rows: np.ndarray, first_slot: int) -> np.ndarray:
        """One graph call for m tokens written to slots first_slot...; returns
        their logits rows ``rows`` (len(rows), n_vocab)."""
        m = len(tokens)
        slots = None
        if self.static:  # pad to the fixed width; a padding row sees only its own slot
            width, size = self._chunk, self._kv_shape[2]
            tokens = list(tokens) + [0] * (width - m)
            positions = list(positions) + [positions[-1]] * (width - m)
            full = np.full((width, size), MASKED, dtype=np.float32)
            full[:m, :bias.shape[1]] = bias
            slots = np.arange(first_slot, first_slot + width, dtype=np.int64)
            full[np.arange(m, width), slots[m:]] = 0
            bias, wanted, rows = full, rows, np.arange(width, dtype=np.int64)
        feeds = {
            "input_ids": np.asarray(tokens, dtype=np.int64)[None],
            "position_ids": np.asarray(positions, dtype=np.int64)[None],
            "attention_bias": bias[None, None],
            "logits_rows": rows,
        }
        if slots is not None:
            feeds["cache_slots"] = slots
        for i in range(self.n_layer):
            feeds[f"past.{i}.key"] = self._kv[2 * i]
            feeds[f"past.{i}.value"] = self._kv[2 * i + 1]
        try:
            out = self._session.run(self._outputs, feeds)
        except Exception as e:
            raise BackendError(f"onnxruntime failed: {str(e).strip().splitlines()[0]}") from e
        self._kv = out[1:]
        self._n = first_slot + m
        logits = out[0][0]                                   # (rows, n_vocab)
        if slots is not None:
            logits = logits[wanted]
        return np.ascontiguousarray(logits, dtype=np.float32)

    @property
    def n_past(self) -> int:
        """Positions the KV cache holds."""
        return self._n

    def decode(self, tokens: list[int], start: int, *, logits_from: int | None = None,
               seq_id: int = 0) -> int:
        """Evaluate ``tokens`` at positions ``start...`` (the cache is cut back to
        ``start`` first). Returns the address of one logits row per token of
        ``tokens[logits_from:]`` (the last token's alone when None), valid
        until the next call."""
        n = len(tokens)
        if n == 0:
            raise BackendError("decode of an empty batch")
        if start + n > self.n_ctx:
            raise ContextOverflowError(f"{start + n} tokens do not fit the context of {self.n_ctx}")
        if start > self.n_past:
            raise BackendError(f"decode at position {start} but the KV cache holds {self.n_past}")
        self.truncate(start)
        bias = np.zeros((n, start + n), dtype=np.float32)
        bias[:, start:] = np.triu(np.full((n, n), MASKED), 1)  # causal among the new tokens
        return self._forward(tokens, list(range(start, start + n)), bias,
                             n - 1 if logits_from is None else logits_from)

    def decode_tree(self, prefix: list[int], tokens: list[int], parents: list[int], start: int) -> int:
        """Evaluate ``prefix`` (ending with the root token) from position
        ``start`` and a draft tree below the root in one call: the mask lets
        each node see the cache, the prefix and its ancestors. Returns the
        address of (n_nodes + 1, n_vocab) rows: the root's, then the nodes'.
        Follow with ``drop_tree``."""
        n, k = len(tokens), len(prefix)
        self.truncate(start)
        depth = [0] * n
        for i, p in enumerate(parents):
            depth[i] = 1 if p < 0 else depth[p] + 1
        root_pos = start + k - 1
        if start + k + n > self.n_ctx:
            raise ContextOverflowError("the draft tree does not fit the context")
        m = k + n
        bias = np.full((m, start + m), MASKED, dtype=np.float32)
        bias[:, :start] = 0
        bias[:, start:start + k] = np.triu(np.full((k, k), MASKED), 1)[np.minimum(np.arange(m), k - 1)]
        for j in range(n):  # node j: itself and its ancestors
            node = j
            while node >= 0:
                bias[k + j, start + k + node] = 0
                node = parents[node]
        positions = list(range(start, start + k)) + [root_pos + d for d in depth]
        return self._forward(prefix + tokens, positions, bias, k - 1)

    def drop_tree(self, n_keep: int) -> None:
        """After decode_tree: keep positions < n_keep (the prefix), drop the nodes."""
        self.truncate(n_keep)

    def truncate(self, n_keep: int, seq_id: int = 0) -> None:
        """Drop positions >= n_keep from the KV cache (a static cache keeps its
        slots; the mask hides them until they are written again)."""
        if n_keep < self._n:
            if not self.static:
                self._kv = [np.ascontiguousarray(a[:, :, :n_keep]) for a in self._kv]
            self._n = n_keep

    def clear(self) -> None:
        empty = np.zeros(self._kv_shape, dtype=np.float16)
        self._kv = [empty] * (2 * self.n_layer)
        self._n = 0

    def close(self) -> None:
        self._session = None
        if self.vocab is not None:
            self.vocab.close()
            self.vocab = None


BACKEND = OnnxBackend
