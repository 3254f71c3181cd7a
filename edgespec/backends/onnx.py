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

from pathlib import Path

import numpy as np

from ..models import registry
from . import onnx_export
from ..errors import BackendError, InvalidArgumentError, ModelFormatError
from . import default_threads
from .base import Backend, context_size
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


class OnnxBackend(VocabMixin, Backend):
    name = "onnx"
    _session = None
    vocab = None

    def __init__(self, path: Path, *, n_ctx: int | None = None, n_batch: int = 512,
                 threads: int | None = None, ep: str | None = None, verbose: bool = False):
        import onnxruntime as ort

        super().__init__()
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
            self.n_ctx = context_size(n_ctx, self.static["ctx"] - self._chunk, extend=None,
                                      limit_name="the static graph's cache")
            self._kv_shape = (1, cfg["n_head_kv"], self.static["ctx"], cfg["head_dim"])
        else:
            # The graph's RoPE tables cover the training context and no more.
            self.n_ctx = context_size(n_ctx, self.n_ctx_train, extend=None)
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
        self._kv = [np.zeros(self._kv_shape, dtype=np.float16)] * (2 * self.n_layer)
        self._n = 0  # cache slots written

    # -- evaluation ---------------------------------------------------------

    def _forward(self, tokens: list[int], positions: list[int], bias: np.ndarray, first_row: int) -> int:
        """Evaluate ``tokens`` into cache slots n_past... under ``bias`` (n, n_past + n):
        row i may attend to the slots where it is 0. Runs in chunks (n_batch
        tokens, or the static graph's fixed width, padded); keeps the logits of
        rows >= first_row, C-contiguous float32 (n - first_row, n_vocab), alive
        until the next call, and returns their address."""
        start, n = self._n, len(tokens)
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

    # -- primitives (base.Backend owns the protocol) -------------------------

    def _evaluate(self, tokens: list[int], positions: list[int], parents: list[int] | None,
                  logits_from: int) -> int:
        """One evaluation under an additive mask (n, n_past + n): token i sees
        the cache, itself and its ancestors in the batch (for a chain, every
        earlier token)."""
        n, start = len(tokens), self._n
        bias = np.zeros((n, start + n), dtype=np.float32)
        if parents is None:
            bias[:, start:] = np.triu(np.full((n, n), MASKED), 1)
        else:
            bias[:, start:] = MASKED
            for i in range(n):
                node = i
                while node >= 0:
                    bias[i, start + node] = 0
                    node = parents[node]
        return self._forward(tokens, positions, bias, logits_from)

    def _truncate(self, n_keep: int) -> None:
        """Keep the first n_keep slots (a static cache keeps its slots; the
        mask hides them until they are written again)."""
        if n_keep < self._n:
            if not self.static:
                self._kv = [np.ascontiguousarray(a[:, :, :n_keep]) for a in self._kv]
            self._n = n_keep

    def _close(self) -> None:
        self._session = None
        if self.vocab is not None:
            self.vocab.close()
            self.vocab = None


BACKEND = OnnxBackend
